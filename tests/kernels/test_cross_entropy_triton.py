"""The cross-entropy Pallas-Triton kernels: interpreted numerics, lowering, config legality.

Each stage (``fwd``, ``jvp``, ``bwd``) of the kernels, interpreted, is compared
with the XLA programs (``kernels/cross_entropy/xla.py``) and with a float64
reference written here from the definitions: full logits, ``logsumexp``, the
label's logit, their sum; the tangent by ``jax.jvp`` and the backward by
``jax.vjp`` of that reference. Sizes are odd (N, D, V no multiples of the
pinned 16/32 blocks) and labels include 0, V - 1, negative and >= V ones.

Tolerances (max |got - want| / max |want|): float32 2e-5 everywhere; bfloat16
inputs (the reference takes the same rounded values) 1e-4 for the statistics
and their tangents, which are float32 dots of exact products, and 2e-2 for the
cotangents, whose dots take the logits' cotangent rounded to bfloat16 and whose
outputs are bfloat16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallax.kernels.cross_entropy import config as ce_config
from pallax.kernels.cross_entropy import triton, xla
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
from tests.helpers import CALL_TARGET, f64, lower_text, rel_err, x64

G, N, D, V = 2, 37, 50, 301
CONFIG = CrossEntropyConfig(block_n=16, block_v=32, block_d=16)
TOL = {"float32": {"stats": 2e-5, "cot": 2e-5}, "bfloat16": {"stats": 1e-4, "cot": 2e-2}}

# (linear, has_bias, transposed_weight, soft_cap, dtype)
CASES = [
  (True, True, False, None, jnp.float32),
  (True, False, True, 5.0, jnp.float32),
  (True, True, True, None, jnp.bfloat16),
  (False, False, False, 5.0, jnp.float32),
  (False, False, False, None, jnp.bfloat16),
]


def _params(linear, has_bias, transposed_weight, soft_cap):
  return dict(
    linear=linear, has_bias=has_bias, transposed_weight=transposed_weight, soft_cap=soft_cap
  )


def _labels(rng):
  labels = rng.integers(0, V, (G, N))
  labels.flat[:6] = [0, V - 1, -1, V, -7, V + 40]  # edges, and out of range: zy = 0
  return jnp.asarray(labels, jnp.int32)


def _primals(rng, params, dtype):
  """The floating primals and the labels."""
  if params["linear"]:
    w_shape = (G, V, D) if params["transposed_weight"] else (G, D, V)
    floats = [rng.standard_normal((G, N, D)), 0.3 * rng.standard_normal(w_shape)]
    if params["has_bias"]:
      floats.append(rng.standard_normal((G, V)))
  else:
    floats = [3 * rng.standard_normal((G, N, V))]
  return [jnp.asarray(a, dtype) for a in floats], _labels(rng)


def _reference_stats(params, labels):
  """``floats -> (lse, zy, zsum)`` written from the definitions (run under x64)."""

  def stats(*floats):
    if params["linear"]:
      x, w, *b = floats
      spec = "gnd,gvd->gnv" if params["transposed_weight"] else "gnd,gdv->gnv"
      z = jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)
      if b:
        z = z + b[0][:, None, :]
    else:
      (z,) = floats
    cap = params["soft_cap"]
    if cap is not None:
      z = cap * jnp.tanh(z / cap)
    inside = (labels >= 0) & (labels < V)
    zy = jnp.take_along_axis(z, jnp.clip(labels, 0, V - 1)[..., None], axis=2)[..., 0]
    return jax.nn.logsumexp(z, axis=2), jnp.where(inside, zy, 0), jnp.sum(z, axis=2)

  return stats


def _check(got, want, tol, what):
  assert len(got) == len(want), what
  for i, (g, w) in enumerate(zip(got, want)):
    err = rel_err(g, w)
    assert err < tol, f"{what}[{i}]: relative error {err:.3g} >= {tol:g}"


@pytest.mark.parametrize(
  "linear, has_bias, transposed_weight, soft_cap, dtype",
  CASES,
  ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else str(v),
)
def test_stages_match_xla_and_float64(linear, has_bias, transposed_weight, soft_cap, dtype):
  rng = np.random.default_rng(hash((linear, has_bias, transposed_weight, soft_cap)) % 2**32)
  params = _params(linear, has_bias, transposed_weight, soft_cap)
  floats, labels = _primals(rng, params, dtype)
  tangents = [jnp.asarray(rng.standard_normal(a.shape), dtype) for a in floats]
  cots = [jnp.asarray(rng.standard_normal((G, N)), jnp.float32) for _ in range(3)]
  prim = [*floats, labels]
  run = lambda stage, *ops: getattr(triton, stage)(*ops, config=CONFIG, interpret=True, **params)
  tol = TOL[jnp.dtype(dtype).name]

  fwd = run("fwd", *prim)
  assert [(a.shape, a.dtype) for a in fwd] == [((G, N), jnp.float32)] * 3
  lse = fwd[0]
  jvp = run("jvp", *prim, lse, *tangents)
  bwd = run("bwd", *prim, lse, *cots)
  assert [(a.shape, a.dtype) for a in bwd] == [(a.shape, a.dtype) for a in floats]

  # The XLA programs: the same operands, so only the summation order differs.
  _check(fwd, xla.fwd(*prim, **params), tol["stats"], "fwd vs xla")
  _check(jvp, xla.jvp(*prim, lse, *tangents, **params), tol["stats"], "jvp vs xla")
  _check(bwd, xla.bwd(*prim, lse, *cots, **params), tol["cot"], "bwd vs xla")

  with x64():
    stats = _reference_stats(params, jnp.asarray(labels))
    floats64 = [jnp.asarray(f64(a)) for a in floats]
    want_fwd = stats(*floats64)
    _, want_jvp = jax.jvp(stats, floats64, [jnp.asarray(f64(t)) for t in tangents])
    _, vjp = jax.vjp(stats, *floats64)
    want_bwd = vjp(tuple(jnp.asarray(f64(c)) for c in cots))
    want = [np.asarray(a) for a in (*want_fwd, *want_jvp, *want_bwd)]
  _check(fwd, want[:3], tol["stats"], "fwd vs float64")
  _check(jvp, want[3:6], tol["stats"], "jvp vs float64")
  _check(bwd, want[6:], tol["cot"], "bwd vs float64")


def test_one_block_everywhere():
  """Blocks larger than every dim (one vocabulary, token and D block; all masked)."""
  rng = np.random.default_rng(1)
  params = _params(True, True, False, None)
  x = jnp.asarray(rng.standard_normal((1, 5, 7)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((1, 7, 9)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((1, 9)), jnp.float32)
  labels = jnp.asarray([[0, 8, 9, -1, 4]], jnp.int32)
  cots = [jnp.asarray(rng.standard_normal((1, 5)), jnp.float32) for _ in range(3)]
  config = CrossEntropyConfig(block_n=16, block_v=16, block_d=16)
  run = lambda stage, *ops: getattr(triton, stage)(*ops, config=config, interpret=True, **params)
  fwd = run("fwd", x, w, b, labels)
  _check(fwd, xla.fwd(x, w, b, labels, **params), 2e-5, "fwd")
  bwd = run("bwd", x, w, b, labels, fwd[0], *cots)
  _check(bwd, xla.bwd(x, w, b, labels, fwd[0], *cots, **params), 2e-5, "bwd")


def _avals(params, dtype, n=N, d=D, v=V):
  s = jax.ShapeDtypeStruct
  if params["linear"]:
    w = (G, v, d) if params["transposed_weight"] else (G, d, v)
    floats = [s((G, n, d), dtype), s(w, dtype)] + ([s((G, v), dtype)] if params["has_bias"] else [])
  else:
    floats = [s((G, n, v), dtype)]
  return floats, s((G, n), jnp.int32), s((G, n), jnp.float32)


def _stage_operands(stage, floats, labels, stat):
  if stage == "fwd":
    return [*floats, labels]
  if stage == "jvp":
    return [*floats, labels, stat, *floats]
  return [*floats, labels, stat, stat, stat, stat]


@pytest.mark.lowering
@pytest.mark.parametrize("stage", ["fwd", "jvp", "bwd"])
@pytest.mark.parametrize("linear", [True, False], ids=["linear", "logits"])
def test_lowers_for_cuda_with_the_heuristic(stage, linear):
  params = _params(linear, linear, linear, 30.0)
  ops = _stage_operands(stage, *_avals(params, jnp.bfloat16))
  config = ce_config.heuristic(ops, "cuda", stage=stage, **params)
  assert ce_config.supports(ops, "cuda", config, stage=stage, **params) is None
  fn = lambda *a: getattr(triton, stage)(*a, config=config, interpret=False, **params)
  kernels = 2 if stage == "bwd" and linear else 1
  assert lower_text(fn, "cuda", *ops).count(CALL_TARGET["cuda"]) == kernels


@pytest.mark.parametrize("stage", ["fwd", "jvp", "bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
  "sizes", [(8192, 1024, 32768), (1000, 4096, 50257), (16, 2048, 32001), (4096, 0, 32768)], ids=str
)
def test_triton_configs_are_legal(stage, dtype, sizes):
  n, d, v = sizes
  params = _params(d > 0, d > 0, False, None)
  ops = _stage_operands(stage, *_avals(params, dtype, n, max(d, 1), v))
  base = ce_config.heuristic(ops, "cuda", stage=stage, **params)
  assert ce_config.supports(ops, "cuda", base, stage=stage, **params) is None
  found = ce_config.candidates(ops, "cuda", stage=stage, **params)
  assert base in found
  assert all(ce_config.supports(ops, "cuda", c, stage=stage, **params) is None for c in found)


def test_float64_is_refused_on_triton():
  params = _params(True, False, False, None)
  ops = _stage_operands("fwd", *_avals(params, jnp.float64))
  config = CrossEntropyConfig(block_n=16, block_v=32, block_d=16)
  assert "float64" in ce_config.supports(ops, "cuda", config, stage="fwd", **params)
