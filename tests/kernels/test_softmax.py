"""softmax kernels: lowering for every claimed platform, configs and executor integration.

Lowering holds the kernels to each backend's rules that interpret mode does
not check: Pallas-Triton takes only power-of-two blocks, Mosaic TPU wants the
last two block dims divisible by (8, 128) (32 rows for the int8 mask) or equal
to the array's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor import Executor
from pallax.executor.registry import TARGETS
from pallax.kernels.softmax import OPS, SoftmaxConfig
from tests.conftest import PLATFORM
from tests.helpers import CALL_TARGET, executor_view, lower_text, rand

softmax_heuristic, softmax_candidates, softmax_supports = executor_view("softmax_fwd")

# (300, 20000): rows longer than the widest default block, so the default
# configs reduce over several column blocks.
SHAPES = [(3, 96), (2, 5, 200), (37, 1000), (1, 7), (300, 20000)]
DTYPES = [jnp.float32, jnp.bfloat16]


def _loss(x, m):
  return sum(
    jnp.sum(jnp.where(m, op(x, where=m), 0).astype(jnp.float32) ** 2)
    for op in (pallax.softmax, pallax.log_softmax)
  )


# kind -> (function of x and a mask, kernels it launches)
FUNCTIONS = {
  "forward": (lambda x, m: [pallax.softmax(x), pallax.log_softmax(x)], 2),
  "masked_backward": (jax.grad(_loss), 4),
  "masked_jvp": (
    lambda x, m: [
      jax.jvp(lambda x: op(x, where=m), (x,), (x,)) for op in (pallax.softmax, pallax.log_softmax)
    ],
    4,
  ),
  # vmapped over x with a shared mask: the mask is broadcast, still one kernel each.
  "vmapped": (jax.vmap(jax.grad(_loss), in_axes=(0, None)), 4),
}


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(FUNCTIONS))
def test_lowers(platform, dtype, shape, kind):
  fn, kernels = FUNCTIONS[kind]
  batch = (2,) if kind == "vmapped" else ()
  x = jax.ShapeDtypeStruct(batch + shape, dtype)
  m = jax.ShapeDtypeStruct(shape, jnp.bool_)
  assert lower_text(fn, platform, x, m).count(CALL_TARGET[platform]) == kernels


@pytest.mark.lowering
@pytest.mark.parametrize(
  "platform, config",
  [
    ("cuda", SoftmaxConfig(block_rows=16, block_cols=64, num_warps=2)),
    ("rocm", SoftmaxConfig(block_rows=1, block_cols=256)),
    ("tpu", SoftmaxConfig(block_rows=32, block_cols=128)),
    ("tpu", SoftmaxConfig(block_rows=64, block_cols=256)),
  ],
  ids=str,
)
def test_lowers_with_pinned_multi_block_config(platform, config):
  """Ragged rows and several ragged column blocks, with and without a mask.

  ``value_and_grad``: log_softmax's backward takes ``x``, so under ``grad``
  alone its forward kernel would be dead code.
  """
  fn = lambda x, m: jax.value_and_grad(
    lambda x: sum(
      jnp.sum(jnp.where(m, op(x, where=w, config=config), 0))
      for op in (pallax.softmax, pallax.log_softmax)
      for w in (None, m)
    )
  )(x)
  x = jax.ShapeDtypeStruct((100, 1000), jnp.float32)
  m = jax.ShapeDtypeStruct((100, 1000), jnp.bool_)
  assert lower_text(fn, platform, x, m).count(CALL_TARGET[platform]) == 8


@pytest.mark.lowering
def test_cpu_lowering_is_the_xla_program():
  x, m = jnp.ones((4, 8)), jnp.ones((4, 8), bool)
  for op in (pallax.softmax, pallax.log_softmax):
    text = jax.jit(jax.grad(lambda x: jnp.sum(op(x, where=m)))).lower(x).as_text()
    assert "custom_call" not in text and "while" not in text


def _rows(shape):
  return math.prod(shape[:-1])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("masked", [False, True])
def test_heuristic_respects_backend_rules(shape, dtype, masked):
  avals = [jax.ShapeDtypeStruct(shape, dtype)] + [jax.ShapeDtypeStruct(shape, jnp.bool_)] * masked
  rows, cols = _rows(shape), shape[-1]
  pow2 = lambda n: n & (n - 1) == 0
  triton = softmax_heuristic(avals, "cuda")
  assert triton.implementation == "pallas"
  assert pow2(triton.block_rows) and pow2(triton.block_cols) and pow2(triton.num_warps)
  assert triton.block_cols <= 8192 and triton.block_rows * triton.block_cols <= 8192
  tpu = softmax_heuristic(avals, "tpu")
  tile = 32 if masked else 8 * (4 // jnp.dtype(dtype).itemsize)
  assert tpu.implementation == "pallas"
  assert tpu.block_rows % tile == 0 or tpu.block_rows >= rows
  assert tpu.block_cols % 128 == 0 or tpu.block_cols == cols
  assert softmax_heuristic(avals, "cpu").implementation == "xla"
  assert softmax_heuristic(avals, "interpret-triton").implementation == "pallas"
  for target in TARGETS:
    assert softmax_supports(avals, target, softmax_heuristic(avals, target)) is None


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(300, 1000), (64, 20000), (5, 7)], ids=str)
@pytest.mark.parametrize("masked", [False, True])
def test_candidates_are_legal(target, shape, masked):
  avals = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] + [
    jax.ShapeDtypeStruct(shape, jnp.bool_)
  ] * masked
  candidates = softmax_candidates(avals, target)
  assert candidates and len(set(candidates)) == len(candidates)
  for config in candidates:
    assert softmax_supports(avals, target, config) is None, config
  assert any(c.implementation == "pallas" for c in candidates)
  has_xla = any(c.implementation == "xla" for c in candidates)
  assert has_xla == (not target.startswith("interpret-"))
  if shape[-1] > 8192 and not target.startswith("interpret-"):
    assert any(c.block_cols < shape[-1] for c in candidates if c.implementation == "pallas")


def test_config_validation_and_json_round_trip():
  config = SoftmaxConfig(block_rows=32, block_cols=512, num_warps=8, num_stages=2)
  assert SoftmaxConfig.from_json(config.to_json()) == config
  assert hash(config) == hash(SoftmaxConfig.from_json(config.to_json()))
  for bad in (
    dict(block_rows=0, block_cols=8),
    dict(block_rows=8, block_cols=-128),
    dict(block_rows=8, block_cols=8, num_warps=0),
    dict(block_rows=8, block_cols=2.5),
    dict(block_rows=True, block_cols=8),
  ):
    with pytest.raises(ValueError, match="must be a positive int"):
      SoftmaxConfig(**bad)
  with pytest.raises(ValueError, match="implementation"):
    SoftmaxConfig(block_rows=8, block_cols=8, implementation="cuda")
  assert str(config) == "pallas(block_rows=32, block_cols=512, num_warps=8, num_stages=2)"


@pytest.mark.lowering
@pytest.mark.parametrize(
  "platform, config, masked, words",
  [
    ("cuda", SoftmaxConfig(block_rows=24, block_cols=128), False, "block_rows=24 must be a power"),
    ("rocm", SoftmaxConfig(block_rows=8, block_cols=100), False, "block_cols=100 must be a power"),
    ("tpu", SoftmaxConfig(block_rows=8, block_cols=200), False, "multiple of 128"),
    ("tpu", SoftmaxConfig(block_rows=12, block_cols=128), False, "multiple of 8"),
    ("tpu", SoftmaxConfig(block_rows=16, block_cols=128), True, "multiple of 32 on TPU with a"),
  ],
  ids=str,
)
def test_config_not_legal_for_backend(platform, config, masked, words):
  fn = lambda x, m: pallax.softmax(x, where=m if masked else None, config=config)
  x = jax.ShapeDtypeStruct((100, 1000), jnp.float32)
  m = jax.ShapeDtypeStruct((100, 1000), jnp.bool_)
  with pytest.raises(ValueError, match=words):
    lower_text(fn, platform, x, m)


@pytest.mark.lowering
def test_float64_on_tpu_falls_back_visibly():
  with jax.enable_x64(True):
    structs = [jax.ShapeDtypeStruct((16, 128), jnp.float64)]
    chosen = Executor(cache_dir=False).select("softmax_fwd", structs, "tpu", {})
    assert chosen.implementation == "xla" and "float64" in chosen.note
    text = lower_text(pallax.log_softmax, "tpu", *structs)
    assert "tpu_custom_call" not in text
    # The interpreted TPU kernel is no place for a silent XLA fallback.
    with pallax.interpret("mosaic_tpu"), pytest.raises(NotImplementedError, match="float64"):
      jax.jit(pallax.softmax).lower(*structs)


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_inside_shard_map(platform):
  mesh = jax.make_mesh((8,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  # value_and_grad: the backward takes x, so grad alone would not need the forward.
  fn = jax.value_and_grad(
    lambda x, m: jax.shard_map(
      lambda x, m: pallax.log_softmax(x, where=m),
      mesh=mesh,
      in_specs=(P("a"), P()),
      out_specs=P("a"),
    )(x, m).sum(where=m)
  )
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  m = jax.ShapeDtypeStruct((256,), jnp.bool_)
  text = jax.jit(fn).trace(x, m).lower(lowering_platforms=(platform,)).as_text()
  assert text.count(CALL_TARGET[platform]) == 2


# ----------------------------------------------------------------------------
# Executor integration.


def test_explain_lists_every_kernel_call_with_folded_shapes():
  x = rand(np.random.default_rng(0), (6, 10, 96))
  m = jnp.asarray(np.random.default_rng(1).random((10, 96)) < 0.7)
  loss = lambda x: jnp.sum(jnp.sin(jax.vmap(lambda x: pallax.log_softmax(x, where=m))(x)))
  with Executor(cache_dir=False):
    report = pallax.explain(jax.grad(loss), x)
  assert [s.op for s in report] == ["log_softmax_fwd", "log_softmax_bwd"]
  native = "xla" if PLATFORM == "cpu" else "pallas"
  assert all(s.source == "heuristic" and s.implementation == native for s in report)
  # The vmapped axis is folded into rows; the shared mask is broadcast along it.
  assert report[0].key.startswith("log_softmax_fwd@v2|")
  assert "|float32[6,10,96];bool[6,10,96]|" in report[0].key
  with pallax.interpret():
    jvp = pallax.explain(lambda x: jax.jvp(pallax.softmax, (x,), (x,)), x)
  assert [(s.op, s.implementation) for s in jvp] == [
    ("softmax_fwd", "pallas"),
    ("softmax_bwd", "pallas"),
  ]


def test_hlo_identical_selected_or_pinned():
  x = rand(np.random.default_rng(2), (48, 200))
  body = lambda text: text.split("\n", 1)[1]
  with pallax.interpret("mosaic_tpu"):
    chosen = pallax.explain(pallax.softmax, x)[0]
    assert chosen.source == "heuristic" and chosen.implementation == "pallas"
    selected = jax.jit(pallax.softmax).lower(x).as_text()
    pinned = jax.jit(functools.partial(pallax.softmax, config=chosen.config)).lower(x).as_text()
  assert body(selected) == body(pinned)


def test_autotune_times_xla_not_the_interpreted_kernel_and_caches(tmp_path):
  x = rand(np.random.default_rng(3), (64, 256))
  ex = Executor(policy="autotune", cache_dir=tmp_path)
  report = pallax.autotune(jax.grad(lambda x: jnp.sum(jnp.sin(pallax.softmax(x)))), x, executor=ex)
  assert [s.op for s in report] == ["softmax_fwd", "softmax_bwd"]
  assert all(s.source == "autotune" for s in report)
  for _, result in ex.tune_log:
    assert {c.implementation for c, _ in result.timings} == {"xla"}
  assert sorted(p.name for p in tmp_path.rglob("*.json")) == [
    "softmax_bwd.json",
    "softmax_fwd.json",
  ]
  with ex:
    assert [
      s.source for s in pallax.explain(jax.grad(lambda x: jnp.sum(jnp.sin(pallax.softmax(x)))), x)
    ] == ["memory", "memory"]


def test_every_kernel_is_registered():
  from pallax.executor.registry import registered_ops

  assert set(OPS) <= set(registered_ops())
