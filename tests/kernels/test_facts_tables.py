"""The shipped verdicts reject exactly what the hand tables they replaced rejected.

Before issue 27, ``kernels/attention/config.py`` held three tables of
``pallax.verify`` findings, ``kernels/cross_entropy/config.py`` one,
``kernels/matmul/config.py`` a spill rule and
``kernels/paged_attention/config.py`` a largest-block rule; they are data now
(``pallax/executor/defaults/{h100,a100}/*.json``). The tables and rules are
copied here as they were (the attention backward's order of preference
since updated from an H200 run, and one spill found since added), and the
candidates and ``supports`` of the configs built from the data must match
them on ``cuda`` (which takes the verdicts of both GPUs).
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor.registry import kernel_spec
from pallax.executor.tools import kernel_calls
from pallax.kernels.attention import AttentionConfig
from pallax.kernels.cross_entropy import config as ce_config
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
from pallax.kernels.matmul import MatmulConfig
from pallax.kernels.matmul import config as matmul_config
from pallax.kernels.paged_attention import PagedAttentionConfig
from pallax.kernels.paged_attention import config as paged_config
from pallax.op import op_params
from tests.helpers import executor_view

# (stage, operand width, padded head dim) -> (block_q, block_k, num_warps, num_stages),
# in order of preference (the backward's 64x32x4x2 moved up after an H200 run).
OLD_TRITON_CONFIGS = {
  ("fwd", 2, 64): (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
  ),
  ("fwd", 2, 128): (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
  ),
  ("fwd", 2, 256): ((64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("fwd", 4, 64): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("fwd", 4, 128): ((16, 32, 4, 2), (16, 16, 4, 2)),
  ("bwd", 2, 64): ((64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2)),
  ("bwd", 2, 128): (
    (64, 32, 4, 2),
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 8, 2),
    (32, 32, 8, 2),
    (32, 32, 4, 2),
  ),
  ("bwd", 2, 256): ((32, 32, 8, 2), (32, 32, 8, 1), (16, 16, 4, 2)),
  ("bwd", 4, 64): ((64, 32, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2), (16, 16, 4, 2)),
  ("bwd", 4, 128): ((16, 16, 4, 2),),
  ("jvp", 2, 64): ((64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("jvp", 2, 128): ((32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)),
  ("jvp", 2, 256): ((16, 32, 4, 2), (16, 16, 4, 2)),
  ("jvp", 4, 64): ((16, 16, 4, 2), (16, 16, 4, 3), (16, 16, 8, 2)),
}
OLD_SPILL_WITH_FEATURES = {
  ("fwd", 2, 128): {(128, 64, 8, 2), (128, 64, 8, 3)},
  ("fwd", 4, 64): {(32, 32, 8, 2)},
  ("fwd", 4, 128): {(16, 32, 4, 2)},
  ("jvp", 2, 64): {(64, 64, 8, 2)},
  ("jvp", 2, 256): {(16, 32, 4, 2)},
  ("jvp", 4, 64): {(16, 16, 4, 2), (16, 16, 4, 3)},
  ("bwd", 2, 128): {(64, 32, 4, 2)},
  ("bwd", 2, 256): {(32, 32, 8, 2), (32, 32, 8, 1)},
  ("bwd", 4, 128): {(16, 16, 4, 2)},  # found since (5c6dca7): 12 bytes on H100
}
OLD_RAW_SPILLS = {
  ("fwd", 2, 128): {(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)},
  ("fwd", 4, 64): {(32, 32, 4, 2)},
  ("fwd", 4, 128): {(16, 32, 4, 2)},
  ("bwd", 2, 64): {(64, 64, 4, 2)},
  ("bwd", 2, 128): {(64, 64, 8, 2), (64, 32, 4, 2)},
  ("bwd", 4, 64): {(64, 32, 8, 2), (16, 32, 4, 2)},
  ("bwd", 4, 128): {(16, 16, 4, 2)},
}
T, N, K = 256, 4, 2


def _attention(features: bool):
  if not features:
    return pallax.dot_product_attention
  return lambda q, k, v, seg: pallax.dot_product_attention(
    q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg, logits_soft_cap=30.0
  )


def _kernel_calls(stage: str, h: int, dtype, features: bool) -> list:
  s = jax.ShapeDtypeStruct
  args = [s((1, T, N, h), dtype), s((1, T, K, h), dtype), s((1, T, K, h), dtype)]
  args += [s((1, T), jnp.int32)] * features
  return _stage_calls(stage, _attention(features), args, 3)


def _stage_calls(stage: str, attention, args: list, n_diff: int) -> list:
  """``stage``'s kernel calls of ``attention(*args)``, differentiating its first ``n_diff`` args."""
  fn = attention
  if stage == "bwd":
    loss = lambda *x: jnp.sum(attention(*x).astype(jnp.float32))
    fn = jax.grad(loss, argnums=tuple(range(n_diff)))
  elif stage == "jvp":
    fn = lambda *x: jax.jvp(lambda *d: attention(*d, *x[n_diff:]), x[:n_diff], x[:n_diff])
  name = f"dot_product_attention_{stage}"
  return [e for e in kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == name]


def _config(t, implementation="pallas") -> AttentionConfig:
  bq, bk, w, st = t
  return AttentionConfig(
    block_q=bq, block_k=bk, num_warps=w, num_stages=st, implementation=implementation
  )


@pytest.mark.parametrize("features", [False, True], ids=["plain", "segments_cap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("h", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("stage", ["fwd", "bwd", "jvp"])
def test_attention_candidates_and_supports_as_the_hand_tables(stage, h, dtype, features):
  key = (stage, 4 if dtype == jnp.float32 else 2, 64 if h <= 64 else 128 if h <= 128 else 256)
  listed = OLD_TRITON_CONFIGS.get(key, ())
  spill = OLD_SPILL_WITH_FEATURES.get(key, set()) if features else set()
  pallas = [_config(t) for t in listed if t not in spill]
  raw = {_config(t, "triton_raw") for t in listed if t not in OLD_RAW_SPILLS.get(key, set())}
  heuristic, candidates, _ = executor_view(f"dot_product_attention_{stage}")
  supports = kernel_spec(f"dot_product_attention_{stage}").supports
  calls = _kernel_calls(stage, h, dtype, features)
  assert calls
  for eqn in calls:
    avals, params = [v.aval for v in eqn.invars], op_params(eqn.params)
    found = [c for c in candidates(avals, "cuda", **params) if c.implementation == "pallas"]
    base = heuristic(avals, "cuda", **params)
    if pallas:
      assert found == pallas
      assert base == pallas[0]
    else:
      assert "spill-free" in supports(avals, "cuda", base, **params)
    if stage == "jvp" or features:  # no raw tangent kernel; raw kernels take no segment ids
      continue
    for t in OLD_TRITON_CONFIGS[key[0], key[1], 64] + OLD_TRITON_CONFIGS[key[0], 2, 128]:
      config = _config(t, "triton_raw")
      assert (supports(avals, "cuda", config, **params) is None) == (config in raw), config


def _old_spills(bm: int, bn: int, bk: int, itemsize: int) -> bool:
  """``kernels/matmul/config.py``'s ``_spills`` before issue 27."""
  if itemsize == 4 and bk > 32 and bm * bn >= 128 * 128:
    return True
  return (bm, bn, bk) == (128, 64, 64) or (itemsize == 2 and (bm, bn, bk) == (64, 64, 32))


def test_matmul_spills_as_the_hand_rule():
  blocks = (16, 32, 64, 128)
  for bm, bn, bk, itemsize, warps, stages, ta, tb in itertools.product(
    blocks, blocks, (16, 32, 64), (2, 4), (4, 8), (1, 3), (False, True), (False, True)
  ):
    config = MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    call = {"itemsize": itemsize, "transpose_a": ta, "transpose_b": tb}
    assert matmul_config._spills(config, "cuda", call) == _old_spills(bm, bn, bk, itemsize)
    assert not matmul_config._spills(config, "tpu", call)  # verdicts of the GPUs only


def _old_max_block_k(itemsize: int, head: int) -> int:
  """``kernels/paged_attention/config.py``'s ``max_triton_block_k`` before issue 27."""
  if itemsize < 4:
    return 128
  return 64 if max(16, 1 << (head - 1).bit_length()) <= 64 else 32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head", [32, 64, 80, 128, 256])
def test_paged_attention_blocks_as_the_hand_rule(head, dtype):
  b, n, kv, pages, page = 4, 8, 2, 64, 16
  s = jax.ShapeDtypeStruct
  args = [s((b, n, head), dtype), s((kv, b * pages, page, head), dtype)]
  args += [s((kv, b * pages, page, head), dtype), s((b,), jnp.int32), s((b, pages), jnp.int32)]
  jaxpr = jax.make_jaxpr(pallax.paged_attention)(*args).jaxpr
  (eqn,) = kernel_calls(jaxpr)
  avals, params = [v.aval for v in eqn.invars], op_params(eqn.params)
  most = _old_max_block_k(jnp.dtype(dtype).itemsize, head)
  for block_k in (16, 32, 64, 128, 256, 512):
    for warps in (4, 8):
      config = PagedAttentionConfig(block_k=block_k, num_warps=warps)
      reason = paged_config.supports(avals, "cuda", config, **params)
      assert (reason is None) == (block_k <= most), (block_k, reason)
      assert reason is None or "spills" in reason
  assert paged_config.heuristic(avals, "cuda", **params).block_k == min(64, most)
  found = {c.block_k for c in paged_config.candidates(avals, "cuda", **params)}
  assert found == {k for k in (32, 64, 128) if k <= most}


# (stage, operand width) -> (block_n, block_v, block_d, num_warps, num_stages).
OLD_CE_LINEAR = {
  ("fwd", 2): ((64, 128, 32, 4, 3), (128, 128, 32, 8, 2), (32, 128, 64, 4, 2), (64, 64, 64, 4, 2)),
  ("jvp", 2): ((64, 64, 32, 4, 2), (32, 128, 32, 4, 2)),
  ("bwd", 2): ((64, 128, 32, 8, 2), (64, 64, 64, 4, 2), (64, 64, 32, 4, 2)),
  ("fwd", 4): ((32, 128, 32, 8, 2), (64, 64, 32, 8, 2), (32, 64, 32, 4, 2), (16, 128, 32, 4, 2)),
  ("jvp", 4): ((16, 64, 16, 4, 2), (64, 64, 16, 8, 2)),
  ("bwd", 4): ((32, 128, 32, 8, 2), (32, 64, 16, 4, 2), (16, 64, 16, 4, 2), (32, 128, 16, 8, 2)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("stage", ["fwd", "bwd", "jvp"])
def test_linear_cross_entropy_tiles_as_the_hand_table(stage, dtype):
  """The stage's tiles for the forward kernel call's operands (the stages share them)."""
  s = jax.ShapeDtypeStruct
  args = [s((256, 256), dtype), s((256, 1024), dtype), s((256,), jnp.int32)]
  jaxpr = jax.make_jaxpr(pallax.linear_cross_entropy)(*args).jaxpr
  (eqn,) = [e for e in kernel_calls(jaxpr) if e.primitive.name == "cross_entropy_fwd"]
  avals, params = [v.aval for v in eqn.invars], op_params(eqn.params)
  want = [
    CrossEntropyConfig(block_n=bn, block_v=bv, block_d=bd, num_warps=w, num_stages=st)
    for bn, bv, bd, w, st in OLD_CE_LINEAR[stage, jnp.dtype(dtype).itemsize]
  ]
  assert ce_config.candidates(avals, "cuda", stage=stage, **params) == want
  assert ce_config.heuristic(avals, "cuda", stage=stage, **params) == want[0]


@pytest.mark.parametrize("stage", ["fwd", "bwd", "jvp"])
def test_a_bias_or_mask_takes_the_configs_of_segment_ids_and_a_cap(stage):
  """A bias and a mask count as features: the Triton configs left are those with segment ids.

  The tangent of a bias and a mask spilled 16 bytes on A100 (float16, head
  dim 64) in the 64 x 64 blocks of 8 warps plain calls take (pallax.verify's
  ``attention_biased``).
  """
  key = (stage, 2, 64)
  spill = OLD_SPILL_WITH_FEATURES.get(key, set())
  want = [_config(t) for t in OLD_TRITON_CONFIGS[key] if t not in spill]
  heuristic, candidates, _ = executor_view(f"dot_product_attention_{stage}")
  s = jax.ShapeDtypeStruct
  q, kv = s((1, T, N, 64), jnp.float16), s((1, T, K, 64), jnp.float16)
  bias, mask = s((1, N, T, T), jnp.float16), s((1, 1, T, T), jnp.bool_)
  (eqn,) = _stage_calls(stage, pallax.dot_product_attention, [q, kv, kv, bias, mask], 4)
  avals, params = [v.aval for v in eqn.invars], op_params(eqn.params)
  found = [c for c in candidates(avals, "cuda", **params) if c.implementation == "pallas"]
  assert found == want and heuristic(avals, "cuda", **params) == want[0]
