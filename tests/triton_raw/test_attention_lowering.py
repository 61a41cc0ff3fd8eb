"""dot_product_attention's raw Triton kernels lowered for cuda without a GPU, and what they refuse.

jax-triton compiles each raw kernel while the program is lowered, for the
compute capability ``pallax.triton_raw.compute_capability`` names (90: H100,
80: A100), and leaves one ``triton_kernel_call`` per launch: the forward is
one, the backward two (the ``dq`` and the ``dk, dv`` kernels). The configs
are the raw twins of the Pallas candidates that the executor would time on a
GPU, so these are the configs autotuning can choose. Numerics are tested
under Triton's interpreter (``interpreted_attention.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax import triton_raw
from tests.helpers import CALL_TARGET, executor_view, lower_text

pytestmark = pytest.mark.lowering

RAW_CALL = "triton_kernel_call"
FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))
DTYPES = (jnp.float32, jnp.bfloat16)
# (B, T, N, K): GQA, T not a multiple of any block.
B, T, N, K = 2, 200, 4, 2
PARAMS = dict(
  scale=0.125,
  window_left=None,
  window_right=0,
  has_lengths=True,
  has_bias=False,
  has_mask=False,
  has_segments=False,
  has_sinks=False,
  logits_soft_cap=None,
)


def _shapes(dtype, h: int, lead=()):
  """``(q, k, v, q_len, kv_len)`` of the public function, BTNH."""
  s = lambda *shape: jax.ShapeDtypeStruct((*lead, *shape), dtype)
  lengths = jax.ShapeDtypeStruct((*lead, B), jnp.int32)
  return s(B, T, N, h), s(B, T, K, h), s(B, T, K, h), lengths, lengths


def _kernel_avals(dtype, h: int, stage: str) -> list:
  """The avals of the fwd / bwd primitive's operands (kernel layout, BKGTH)."""
  s = jax.ShapeDtypeStruct
  g = N // K
  avals = [s((B, K, g, T, h), dtype), s((B, K, T, h), dtype), s((B, K, T, h), dtype)]
  avals += [s((B,), jnp.int32)] * 2
  if stage == "bwd":
    rows, stats = s((B, K, g, T, h), dtype), s((B, K, g, T), jnp.float32)
    avals += [rows, stats, rows, stats]
  return avals


def _raw_candidates(dtype, h: int, stage: str) -> list:
  """The raw Triton configs that autotuning times on cuda for the test's call."""
  avals = _kernel_avals(dtype, h, stage)
  _, candidates, supports = executor_view(f"dot_product_attention_{stage}")
  configs = candidates(avals, "cuda", **PARAMS)
  return [
    c
    for c in configs
    if c.implementation == triton_raw.IMPLEMENTATION
    and supports(avals, "cuda", c, **PARAMS) is None
  ]


def _attention(q, k, v, q_len, kv_len, config=None, **kw):
  return pallax.dot_product_attention(
    q,
    k,
    v,
    is_causal=True,
    query_seq_lengths=q_len,
    key_value_seq_lengths=kv_len,
    scale=0.125,
    config=config,
    **kw,
  )


def _grad(q, k, v, q_len, kv_len, **kw):
  loss = lambda q, k, v: jnp.sum(_attention(q, k, v, q_len, kv_len, **kw).astype(jnp.float32))
  return jax.grad(loss, (0, 1, 2))(q, k, v)


def _calls(fn, cc: int, *args) -> tuple[int, int]:
  """``fn``'s raw Triton and Pallas launches, lowered on cuda at compute capability ``cc``."""
  with triton_raw.compute_capability(cc):
    text = lower_text(fn, "cuda", *args)
  return text.count(RAW_CALL), text.count(CALL_TARGET["cuda"])


@pytest.mark.compilers
@pytest.mark.parametrize("h", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("cc", [90, 80])
def test_forward_grad_and_vmap_lower_to_raw_launches(cc, dtype, h):
  """The first raw candidate of each stage: a forward launch, and the dq and dk/dv launches.

  float32 at head dims over 64 has no backward config that compiles
  spill-free (the shipped ``triton_raw`` verdicts): there the Pallas backward runs.
  """
  fwd, bwd = (_raw_candidates(dtype, h, stage) for stage in ("fwd", "bwd"))
  overlay = {FWD: fwd[0], **({BWD: bwd[0]} if bwd else {})}
  assert bwd or (dtype == jnp.float32 and h > 64)
  grad_calls = (3, 0) if bwd else (1, 2)
  with pallax.default_executor().overlay(overlay):
    assert _calls(_attention, cc, *_shapes(dtype, h)) == (1, 0)
    assert _calls(_grad, cc, *_shapes(dtype, h)) == grad_calls
    assert _calls(jax.vmap(_grad), cc, *_shapes(dtype, h, lead=(3,))) == grad_calls


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("h", [64, 80, 128, 256])
def test_autotuning_on_cuda_times_raw_twins_of_the_pallas_candidates(h, dtype):
  """A raw twin of every Pallas candidate, of the forward and backward only; Pallas heuristic."""
  for stage in ("fwd", "bwd", "jvp"):
    avals = _kernel_avals(dtype, h, "bwd" if stage == "bwd" else "fwd")
    if stage == "jvp":  # out, lse, and the tangents of q, k, v
      avals += _kernel_avals(dtype, h, "bwd")[5:7] + avals[:3]
    heuristic, candidates, _ = executor_view(f"dot_product_attention_{stage}")
    assert heuristic(avals, "cuda", **PARAMS).implementation == "pallas"
    configs = candidates(avals, "cuda", **PARAMS)
    pallas = [c for c in configs if c.implementation == "pallas"]
    raw = [c for c in configs if c.implementation == triton_raw.IMPLEMENTATION]
    twins = [dataclasses.replace(c, implementation=triton_raw.IMPLEMENTATION) for c in pallas]
    assert raw == ([] if stage == "jvp" else twins), stage
  kept = {stage: _raw_candidates(dtype, h, stage) for stage in ("fwd", "bwd")}
  if dtype == jnp.bfloat16:
    assert all(kept.values()), f"no raw candidate left at head dim {h}: {kept}"


# Verified for both stages at 16-bit, head dim 64.
RAW_32 = pallax.AttentionConfig(block_q=32, block_k=32, implementation="triton_raw")


@pytest.mark.parametrize(
  "extra, words",
  [
    (lambda b, t, n, s: dict(bias=jnp.zeros((b, n, t, s))), "take no bias"),
    (lambda b, t, n, s: dict(mask=jnp.ones((b, n, t, s), bool)), "take no mask"),
    (
      lambda b, t, n, s: dict(
        q_segment_ids=jnp.zeros((b, t), jnp.int32), kv_segment_ids=jnp.zeros((b, s), jnp.int32)
      ),
      "take no segment ids",
    ),
  ],
  ids=["bias", "mask", "segments"],
)
def test_refuses_what_it_does_not_implement(extra, words):
  q, k, v, q_len, kv_len = _shapes(jnp.bfloat16, 64)
  kw = extra(B, T, N, T)
  fn = lambda q, k, v: _attention(q, k, v, None, None, config=RAW_32, **kw)
  with pytest.raises(ValueError, match=words):
    _calls(fn, 90, q, k, v)


def test_refuses_configs_not_verified_spill_free():
  """float32 at head dim 128 compiles spill-free with small blocks only."""
  config = pallax.AttentionConfig(block_q=128, block_k=64, num_warps=8, implementation="triton_raw")
  with pytest.raises(ValueError, match="compiles spill-free"):
    _calls(lambda *a: _attention(*a, config=config), 90, *_shapes(jnp.float32, 128))


@pytest.mark.compilers
def test_pinned_raw_config_names_the_tangent_it_lacks():
  """``config=`` pins every stage; the tangent has no raw kernel, and says so."""

  def jvp(q, k, v, q_len, kv_len):
    f = lambda q, k, v: _attention(q, k, v, q_len, kv_len, config=RAW_32)
    return jax.jvp(f, (q, k, v), (q, k, v))

  with pytest.raises(ValueError, match="has no triton_raw kernel"):
    _calls(jvp, 90, *_shapes(jnp.bfloat16, 64))


def test_cpu_refuses_raw_kernels_outside_the_interpreter():
  q = jnp.ones((1, 24, 2, 16))
  with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
    jax.jit(lambda q: pallax.dot_product_attention(q, q, q, config=RAW_32))(q)
