"""rms_norm kernels: lowering for every claimed platform, and their configs.

Lowering holds the kernels to each backend's rules that interpret mode does
not check: Pallas-Triton takes only power-of-two blocks, Mosaic TPU wants the
last two block dims divisible by (8, 128) or equal to the array's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor.registry import TARGETS
from pallax.kernels.norm import NormConfig
from pallax.kernels.norm.config import tpu_vmem
from pallax.pallas_utils import TPU_VMEM_BUDGET
from tests.helpers import CALL_TARGET, executor_view, lower_text

norm_heuristic, norm_candidates, norm_supports = executor_view("rms_norm_fwd")

SHAPES = [(3, 96), (2, 5, 200), (37, 1000), (1, 7), (300, 4096)]
DTYPES = [jnp.float32, jnp.bfloat16]


def _functions():
  loss = lambda x, w: jnp.sum(pallax.rms_norm(x, w).astype(jnp.float32) ** 2)
  return {
    "forward": pallax.rms_norm,
    "backward": jax.grad(loss, (0, 1)),
    # A vmapped weight adds a group grid axis to both kernels.
    "vmapped_weight": jax.vmap(jax.grad(loss, (0, 1))),
  }


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(_functions()))
def test_lowers(platform, dtype, shape, kind):
  fn = _functions()[kind]
  x = jax.ShapeDtypeStruct(((2,) if kind == "vmapped_weight" else ()) + shape, dtype)
  w = jax.ShapeDtypeStruct(((2,) if kind == "vmapped_weight" else ()) + shape[-1:], dtype)
  text = lower_text(fn, platform, x, w)
  expected = {"forward": 1, "backward": 2, "vmapped_weight": 2}[kind]
  assert text.count(CALL_TARGET[platform]) == expected, text[:2000]


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_with_pinned_config(platform):
  config = NormConfig(block_rows=16, num_warps=2)
  fn = lambda x, w: pallax.rms_norm(x, w, config=config)
  x = jax.ShapeDtypeStruct((100, 200), jnp.float32)
  w = jax.ShapeDtypeStruct((200,), jnp.float32)
  assert CALL_TARGET[platform] in lower_text(fn, platform, x, w)


@pytest.mark.lowering
def test_cpu_lowering_is_the_xla_program():
  text = jax.jit(pallax.rms_norm).lower(jnp.ones((4, 8)), jnp.ones(8)).as_text()
  assert "custom_call" not in text and "while" not in text


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_heuristic_respects_backend_rules(shape, dtype):
  aval = jax.ShapeDtypeStruct(shape, dtype)
  rows = 1
  for d in shape[:-1]:
    rows *= d
  triton = norm_heuristic([aval], "cuda")
  assert triton.implementation == "pallas"
  assert triton.block_rows & (triton.block_rows - 1) == 0
  assert triton.num_warps & (triton.num_warps - 1) == 0
  tpu = norm_heuristic([aval], "tpu")
  sublanes = 8 * (4 // jnp.dtype(dtype).itemsize)
  assert tpu.implementation == "pallas"
  assert tpu.block_rows % sublanes == 0 or tpu.block_rows >= rows
  assert norm_heuristic([aval], "cpu").implementation == "xla"
  assert norm_heuristic([aval], "interpret-triton").implementation == "pallas"


@pytest.mark.parametrize("target", TARGETS)
def test_candidates_are_legal(target):
  aval = jax.ShapeDtypeStruct((300, 1000), jnp.bfloat16)
  candidates = norm_candidates([aval], target)
  assert candidates and len(set(candidates)) == len(candidates)
  for config in candidates:
    assert norm_supports([aval], target, config) is None, config
  has_xla = any(c.implementation == "xla" for c in candidates)
  assert has_xla == (not target.startswith("interpret-"))


def test_config_validation_and_json_round_trip():
  config = NormConfig(block_rows=32, num_warps=8, num_stages=2)
  assert NormConfig.from_json(config.to_json()) == config
  assert hash(config) == hash(NormConfig.from_json(config.to_json()))
  for bad in (
    dict(block_rows=0),
    dict(block_rows=-8),
    dict(block_rows=8, num_warps=0),
    dict(block_rows=2.5),
    dict(block_rows=True),
  ):
    with pytest.raises(ValueError, match="must be a positive int"):
      NormConfig(**bad)
  with pytest.raises(ValueError, match="implementation"):
    NormConfig(block_rows=8, implementation="cuda")
  assert str(config) == "pallas(block_rows=32, num_warps=8, num_stages=2)"
  assert str(NormConfig(block_rows=1, implementation="xla")) == "xla"


@pytest.mark.lowering
@pytest.mark.parametrize(
  "platform, block_rows, words", [("cuda", 24, "power of two"), ("tpu", 12, "multiple of 8")]
)
def test_config_not_legal_for_backend(platform, block_rows, words):
  fn = lambda x, w: pallax.rms_norm(x, w, config=NormConfig(block_rows=block_rows))
  x = jax.ShapeDtypeStruct((100, 128), jnp.float32)
  w = jax.ShapeDtypeStruct((128,), jnp.float32)
  with pytest.raises(ValueError, match=words):
    lower_text(fn, platform, x, w)


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_inside_shard_map(platform):
  mesh = jax.make_mesh((8,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  fn = jax.grad(
    lambda x, w: jax.shard_map(
      pallax.rms_norm, mesh=mesh, in_specs=(P("a"), P()), out_specs=P("a")
    )(x, w).sum(),
    (0, 1),
  )
  x = jax.ShapeDtypeStruct((64, 200), jnp.float32)
  w = jax.ShapeDtypeStruct((200,), jnp.float32)
  text = jax.jit(fn).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
  assert text.count(CALL_TARGET[platform]) == 2


_FAMILY = {
  "layer_norm": lambda x, w: pallax.layer_norm(x, w, w * 0.5),
  "fused_add_rms_norm": lambda x, w: pallax.fused_add_rms_norm(x, x * 0.5, w),
}


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 1000), (2, 5, 200)], ids=str)
@pytest.mark.parametrize("op", list(_FAMILY))
def test_family_lowers_forward_and_backward(op, shape, dtype, platform):
  fn = _FAMILY[op]
  loss = lambda x, w: sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(x, w)))
  x = jax.ShapeDtypeStruct(shape, dtype)
  w = jax.ShapeDtypeStruct(shape[-1:], dtype)
  assert lower_text(fn, platform, x, w).count(CALL_TARGET[platform]) == 1
  assert lower_text(jax.grad(loss, (0, 1)), platform, x, w).count(CALL_TARGET[platform]) == 2


@pytest.mark.parametrize(
  "shape", SHAPES + [(512, 1024), (1000, 4000), (64, 8192), (64, 16384)], ids=str
)
def test_triton_configs_stay_within_the_register_file(shape):
  """The kernels' budget measured with ptxas on H100 and A100: at most 32 elements
  per thread, and 16 warps only for single-row blocks (the old (16 rows, 16 warps)
  at hidden 1024 spilled 124-220 bytes there, (8, 16) in bfloat16 too)."""
  aval = jax.ShapeDtypeStruct(shape, jnp.float32)
  block_hidden = 1 << (shape[-1] - 1).bit_length()
  for config in [norm_heuristic([aval], "cuda")] + norm_candidates([aval], "cuda"):
    if config.implementation == "pallas":
      rows = min(config.block_rows, 1 << (math.prod(shape[:-1]) - 1).bit_length())
      assert rows * block_hidden // (32 * config.num_warps) <= 32, config
      assert config.num_warps < 16 or rows == 1, config


@pytest.mark.parametrize("stage", ["fwd", "bwd"])
def test_triton_refuses_rows_that_spill_at_every_config(stage):
  """Wider rows run the XLA program on GPUs (visibly); interpreted kernels take any width."""
  _, _, supports = executor_view(f"rms_norm_{stage}")
  for hidden, refused in [(16384, False), (16385, True)]:
    aval = jax.ShapeDtypeStruct((4, hidden), jnp.float32)
    reason = supports([aval], "cuda", NormConfig(block_rows=1, num_warps=16))
    assert (reason is not None) == refused, reason
    assert supports([aval], "interpret-triton", NormConfig(block_rows=1, num_warps=16)) is None
  assert "wider than 16384" in reason


@pytest.mark.parametrize("target", ["cuda", "rocm"])
def test_warps_must_be_a_power_of_two_on_triton(target):
  """num_warps=3 makes LLVM abort the process while compiling: refused before that."""
  aval = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  assert "num_warps=3" in norm_supports([aval], target, NormConfig(block_rows=8, num_warps=3))
  x = jnp.ones((64, 256))
  with pytest.raises(ValueError, match="num_warps=3 must be a power of two"):
    lower_text(
      lambda x: pallax.rms_norm(x, config=NormConfig(block_rows=8, num_warps=3)), target, x
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES + [(1000, 4000), (4096, 8192), (16, 65536)], ids=str)
def test_tpu_configs_fit_the_default_scoped_vmem(shape, dtype):
  """Blocks within v5e's default scoped VMEM (16 MiB, less headroom) by ``tpu_vmem``'s model.

  The old 512K-element blocks overflowed it on libtpu's compile-only v5e target:
  fused_add_rms_norm at (1000, 4000) float32, rms_norm's backward at (4096, 8192).
  A sublane-tall block of a very wide row may need more: its kernel raises the limit.
  """
  aval = jax.ShapeDtypeStruct(shape, dtype)
  itemsize, sub = jnp.dtype(dtype).itemsize, 8 * (4 // jnp.dtype(dtype).itemsize)
  for config in [norm_heuristic([aval], "tpu")] + norm_candidates([aval], "tpu"):
    rows = min(config.block_rows, math.prod(shape[:-1]))
    if config.block_rows > sub:
      assert tpu_vmem(rows, shape[-1], itemsize) <= TPU_VMEM_BUDGET, config


@pytest.mark.lowering
def test_tpu_kernel_raises_the_vmem_limit_only_for_blocks_that_need_it():
  w = jax.ShapeDtypeStruct((65536,), jnp.float32)
  wide = lower_text(pallax.rms_norm, "tpu", jax.ShapeDtypeStruct((16, 65536), jnp.float32), w)
  assert "scoped_memory_configs" in wide
  w = jax.ShapeDtypeStruct((1024,), jnp.float32)
  usual = lower_text(pallax.rms_norm, "tpu", jax.ShapeDtypeStruct((512, 1024), jnp.float32), w)
  assert "tpu_custom_call" in usual and "scoped_memory_configs" not in usual
