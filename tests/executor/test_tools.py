"""Executor end to end with rms_norm: autotune, explain, overlays, vmap/pmap helpers."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallax
from pallax.executor import Executor
from pallax.executor.tools import kernel_calls
from tests.helpers import lower_text, rand, sharding_devices

CFG8 = pallax.NormConfig(block_rows=8)


def _xw(shape=(64, 128), seed=0):
  rng = np.random.default_rng(seed)
  return rand(rng, shape), rand(rng, shape[-1:], shift=1.0)


def _has_grid_loop(fn, *args) -> bool:
  """Whether ``fn`` lowers to an interpreted kernel (a while loop over the grid)."""
  return "stablehlo.while" in jax.jit(fn).lower(*args).as_text()


def test_kernel_calls_finds_kernels_in_nested_jaxprs():
  x, w = _xw((8, 128))
  norm = lambda x: pallax.rms_norm(x, w)
  identity = jax.custom_vjp(norm)
  identity.defvjp(lambda x: (norm(x), None), lambda _, g: (g,))
  mesh = jax.make_mesh(
    (2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,), devices=sharding_devices(2)
  )
  nested = {
    "jit": jax.jit(norm),
    "scan": lambda x: jax.lax.scan(lambda c, row: (c, norm(row[None])), 0.0, x)[1],
    "cond": lambda x: jax.lax.cond(x.sum() > 0, norm, lambda x: x, x),
    "while": lambda x: jax.lax.while_loop(lambda x: x.sum() > 0, norm, x),
    "custom_vjp": identity,
    "shard_map": jax.shard_map(norm, mesh=mesh, in_specs=P("i"), out_specs=P("i")),
    "jit(scan(cond))": jax.jit(
      lambda x: jax.lax.scan(
        lambda c, row: (c, jax.lax.cond(c > 0, norm, lambda r: r, row[None])), 1.0, x
      )[1]
    ),
  }
  for name, fn in nested.items():
    calls = kernel_calls(jax.make_jaxpr(fn)(x).jaxpr)
    assert [eqn.primitive.name for eqn in calls] == ["rms_norm_fwd"], name


def test_real_autotune_on_cpu_then_fresh_process_hits_cache(tmp_path):
  x, w = _xw()
  ex = Executor(policy="autotune", cache_dir=tmp_path)
  loss = lambda x, w: jnp.sum(pallax.rms_norm(x, w) ** 2)
  report = pallax.autotune(jax.grad(loss, (0, 1)), x, w, executor=ex)
  assert [s.op for s in report] == ["rms_norm_fwd", "rms_norm_bwd"]
  assert all(s.source == "autotune" for s in report)
  for _, result in ex.tune_log:
    timed = {c.implementation for c, _ in result.timings}
    assert timed == {"xla"}  # the interpreted kernel is no candidate outside pallax.interpret
    assert result.best == min(result.timings, key=lambda ct: ct[1])[0]
  assert "rms_norm_fwd" in str(report)
  files = sorted(p.name for p in tmp_path.rglob("*.json"))
  assert files == ["rms_norm_bwd.json", "rms_norm_fwd.json"]
  code = """
import jax, jax.numpy as jnp, numpy as np, pallax
x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 128)), jnp.float32)
w = jnp.ones(128)
loss = lambda x, w: jnp.sum(pallax.rms_norm(x, w) ** 2)
print(sorted(s.source for s in pallax.explain(jax.grad(loss, (0, 1)), x, w)))
jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1)))(x, w))
print("tuned:", len(pallax.default_executor().tune_log))
"""
  # Policy "error": any miss would raise, so the run proves both ops hit the disk cache.
  env = {**os.environ, "PALLAX_CACHE_DIR": str(tmp_path), "PALLAX_POLICY": "error"}
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split("\n")[:2] == ["['disk', 'disk']", "tuned: 0"], out.stdout


def test_autotune_policy_inside_jit(tmp_path):
  x, w = _xw((32, 128), seed=1)
  ex = Executor(policy="autotune", cache_dir=tmp_path)
  with ex:
    y = jax.jit(pallax.rms_norm)(x, w)
  assert len(ex.tune_log) == 1
  np.testing.assert_allclose(y, pallax.rms_norm(x, w), rtol=1e-6, atol=1e-6)


def test_hlo_identical_selected_or_pinned():
  x, w = _xw((48, 200), seed=2)

  def body(text):
    return text.split("\n", 1)[1]

  with pallax.interpret():
    chosen = pallax.explain(pallax.rms_norm, x, w)[0]
    assert chosen.source == "heuristic" and chosen.implementation == "pallas"
    selected = jax.jit(pallax.rms_norm).lower(x, w).as_text()
    pinned = jax.jit(functools.partial(pallax.rms_norm, config=chosen.config)).lower(x, w).as_text()
  assert body(selected) == body(pinned)
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w)]
  cuda = (
    pallax.default_executor()
    .select("rms_norm_fwd", structs, "cuda", {"eps": 1e-6, "offset": 0.0})
    .config
  )
  lower = lambda f: body(lower_text(f, "cuda", *structs))
  assert lower(pallax.rms_norm) == lower(functools.partial(pallax.rms_norm, config=cuda))


def test_explain_reports_sources():
  x, w = _xw()
  ex = Executor(cache_dir=False)
  with ex:
    (chosen,) = pallax.explain(pallax.rms_norm, x, w)
    assert (chosen.source, chosen.implementation, chosen.target) == ("heuristic", "xla", "cpu")
    assert chosen.key.startswith("rms_norm_fwd@v1|cpu|float32[64,128];float32[128]|")
    assert chosen.device_kind == jax.devices("cpu")[0].device_kind
    assert pallax.explain(pallax.rms_norm, x, w, config=CFG8)[0].source == "pinned"
    with ex.overlay({"rms_norm_fwd": CFG8}):
      assert pallax.explain(pallax.rms_norm, x, w)[0].source == "overlay"
  loss = lambda x, w: pallax.rms_norm(x, w).sum()
  assert [s.op for s in pallax.explain(jax.grad(loss), x, w)] == ["rms_norm_fwd", "rms_norm_bwd"]


def test_explain_sees_the_kernels_of_a_composite_primitive():
  """A scalar cross-entropy's gradient is one composite primitive; explain lists its kernels."""
  x, w = _xw()
  labels = jnp.arange(x.shape[0]) % w.shape[0]
  table = jnp.ones((x.shape[1], 300))
  loss = lambda x, table: pallax.linear_cross_entropy(x, table, labels)
  assert [s.op for s in pallax.explain(loss, x, table)] == ["cross_entropy_fwd"]
  picks = pallax.explain(jax.grad(loss, (0, 1)), x, table)
  assert [s.op for s in picks] == ["cross_entropy_fwd", "cross_entropy_bwd"]
  assert [s.implementation for s in picks] == ["xla", "xla"]
  with pallax.interpret():
    assert {s.implementation for s in pallax.explain(jax.grad(loss), x, table)} == {"pallas"}


def test_overlay_and_override_reach_already_jitted_functions():
  x, w = _xw()
  f = jax.jit(pallax.rms_norm)
  want = f(x, w)
  ex = Executor(cache_dir=False)
  with ex:
    assert not _has_grid_loop(f, x, w)
    with ex.overlay({"rms_norm_fwd": CFG8}):
      assert _has_grid_loop(f, x, w)
      np.testing.assert_allclose(f(x, w), want, rtol=1e-6, atol=1e-6)
    assert not _has_grid_loop(f, x, w)
    ex.override("rms_norm_fwd", CFG8)
    assert _has_grid_loop(f, x, w)
    ex.override("rms_norm_fwd", None)
    assert not _has_grid_loop(f, x, w)


def test_executor_call_style():
  x, w = _xw()
  ex = Executor(cache_dir=False)
  ex.override("rms_norm_fwd", CFG8)
  np.testing.assert_allclose(ex(pallax.rms_norm, x, w), pallax.rms_norm(x, w), rtol=1e-6)
  assert ex(pallax.explain, pallax.rms_norm, x, w)[0].source == "pinned"


def test_float64_on_tpu_runs_the_xla_program_visibly():
  with jax.enable_x64(True):
    structs = [
      jax.ShapeDtypeStruct((16, 128), jnp.float64),
      jax.ShapeDtypeStruct((128,), jnp.float64),
    ]
    chosen = Executor(cache_dir=False).select(
      "rms_norm_fwd", structs, "tpu", {"eps": 1e-6, "offset": 0.0}
    )
    assert chosen.implementation == "xla" and "float64" in chosen.note
    text = jax.jit(pallax.rms_norm).trace(*structs).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" not in text


class _Recorder:
  """An op wrapper that records whether it ever sees concrete (sample) data."""

  def __init__(self):
    self.concrete_calls = 0
    self.calls = 0

  def __call__(self, x, w, config=None):
    self.calls += 1
    self.concrete_calls += not isinstance(x, jax.core.Tracer)
    return pallax.rms_norm(x, w, config=config)


@pytest.mark.parametrize("in_axes", [(0, None), (0, 0)])
def test_vmap_with_config_selects_once_from_batched_shapes(in_axes):
  rng = np.random.default_rng(3)
  xb = rand(rng, (6, 10, 96))
  w = rand(rng, (6, 96) if in_axes[1] == 0 else (96,))
  ex = Executor(cache_dir=False)
  selections = []
  select = ex.select
  ex.select = lambda *a, **k: selections.append(k.get("pinned")) or select(*a, **k)
  op = _Recorder()
  with pallax.interpret():
    f = pallax.vmap_with_config(ex, op, in_axes=in_axes)
    y1, y2 = f(xb, w), f(xb, w)
    want = jax.vmap(pallax.rms_norm, in_axes=in_axes)(xb, w)
    pinned = [
      e.params["config"]
      for e in jax.make_jaxpr(f)(xb, w).eqns
      if e.primitive.name == "rms_norm_fwd"
    ]
    batched = pallax.explain(jax.vmap(pallax.rms_norm, in_axes=in_axes), xb, w)[0].config
  assert op.concrete_calls == 0, "the op must never run on a sample"
  assert selections.count(None) == 1, "selected once, then pinned"
  assert pinned == [batched]
  np.testing.assert_allclose(y1, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(y1, y2)


def test_pmap_with_config_selects_from_per_device_shapes():
  rng = np.random.default_rng(4)
  x, w = rand(rng, (4, 20, 128)), rand(rng, (128,))
  ex = Executor(cache_dir=False)
  op = _Recorder()
  with pallax.interpret("mosaic_tpu"):
    f = pallax.pmap_with_config(ex, op, in_axes=(0, None), axis_name="devices")
    y = f(x, w)
    (call,) = kernel_calls(jax.make_jaxpr(f)(x, w).jaxpr)
    per_device = pallax.explain(pallax.rms_norm, x[0], w)[0].config
  assert op.concrete_calls == 0
  assert call.params["config"] == per_device
  assert [v.aval.shape for v in call.invars] == [(20, 128), (128,)]
  np.testing.assert_allclose(y, jax.pmap(pallax.rms_norm, in_axes=(0, None))(x, w), rtol=1e-6)
  with pytest.raises(ValueError, match="in_axes"):
    pallax.pmap_with_config(ex, op, in_axes=(0,))(x, w)
