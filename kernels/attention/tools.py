"""The attention family's tools: self-check case, verify sweep, bench suite, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``) for ``dot_product_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.attention import dot_product_attention
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "attention_work"]


def attention_work(
  batch: int,
  heads: int,
  kv_heads: int,
  q_len: int,
  kv_len: int,
  head_dim: int,
  dtype,
  mode: str,
  *,
  causal: bool = False,
  documents: int = 1,
) -> Work:
  """Dot-product attention, counting the unmasked (query, key) pairs only.

  Forward: ``Q K^T`` and ``P V`` over the pairs, ``4 B N pairs H`` FLOPs
  (FlashAttention's convention; GQA counts query heads ``N``); ``pairs =
  T S``, causal ``T (T + 1) / 2`` for ``T <= S`` (query ``i`` sees keys
  ``0..i``). ``documents``: self-attention over that many packed documents of
  equal length (segment ids), each attending within itself.
  Forward+backward: 3.5x (``dV``, ``dP``, ``dQ``, ``dK`` and the recomputed
  ``Q K^T``: seven products against two). Bytes: reads ``q``, ``k``, ``v``,
  writes ``o``; the backward reads them and ``do``, writes ``dq``, ``dk``, ``dv``.
  """
  bwd = check_mode(mode)
  if documents < 1 or q_len % documents or kv_len % documents:
    raise ValueError(f"documents must divide both lengths, got {documents}")
  t, s = q_len // documents, kv_len // documents
  if causal:
    pairs = t * (t + 1) // 2 if t <= s else s * (s + 1) // 2 + (t - s) * s
  else:
    pairs = t * s
  flops = 4 * batch * heads * documents * pairs * head_dim
  q = batch * q_len * heads * head_dim
  kv = batch * kv_len * kv_heads * head_dim
  elements = 2 * q + 2 * kv  # q, k, v in; o out
  if bwd:
    elements += 3 * q + 2 * kv + q + 2 * kv  # q, o, do, k, v in; dq, dk, dv out
    flops = flops * 7 // 2
  return Work(flops, nbytes(elements, dtype))


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  b, t, n, kv, h = (2, 37, 4, 2, 64) if small else (1, 2048, 8, 8, 64)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), dtype)
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), dtype) for _ in range(2))
  return q, k, v


def _causal(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  return dot_product_attention(q, k, v, is_causal=True)


def _causal_reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _capped(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal with Gemma 2's soft cap (its global layers)."""
  return dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=50.0)


def _packed_documents(q, k, v, sinks, q_segment_ids, kv_segment_ids) -> jax.Array:
  """Packed documents with Gemma 2's soft cap and sinks: causal within each segment."""
  return dot_product_attention(
    q,
    k,
    v,
    is_causal=True,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    logits_soft_cap=30.0,
    sinks=sinks,
  )


def _padded_batch(q, k, v, query_seq_lengths, key_value_seq_lengths, q_seg, kv_seg) -> jax.Array:
  """A padded batch of packed documents: lengths and segment ids, no causal mask.

  Without a window, the masked blocks come from the lengths and the ids alone.
  """
  return dot_product_attention(
    q,
    k,
    v,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
  )


def _biased(q, k, v, bias, mask) -> jax.Array:
  """Causal with a bias of every query head and a mask of every example (shared by the heads)."""
  return dot_product_attention(q, k, v, bias, mask, is_causal=True)


def _float32_bias(q, k, v, bias) -> jax.Array:
  """A float32 bias of every query head (an ALiBi bias, as models pass it), whatever q's dtype."""
  return dot_product_attention(q, k, v, bias.astype(jnp.float32))


# Sweep sizes (B, T, N, K, H), self-attention: head dims 64, a padded 80 and
# 128 with GQA and odd lengths, 256, 32, and 128 in whole blocks of 128 keys
# (FlashAttention-3's tile in the fused Mosaic GPU backward unmasked: padded
# keys mask its every step, ``masks_every_step``); causal: the first four. Every
# batch is above 1: with one example a kernel's grid has no batch index, and
# the Mosaic GPU backward at head dim 128 compiled spill-free there while
# spilling 12-96 bytes from a batch of 2 up.
_qkv = lambda b, t, n, kv, h: [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
SIZES = (
  (2, 1024, 8, 8, 64),
  (2, 1000, 8, 2, 80),
  (2, 1000, 8, 2, 128),
  (2, 2048, 4, 4, 256),
  (4, 512, 8, 8, 32),
  (2, 1024, 8, 2, 128),
)
QUICK = ((2, 1024, 8, 8, 64), (2, 1000, 8, 2, 128))

TOOLS = (
  OpTools(
    "dot_product_attention",
    check=SelfCheck("dot_product_attention", _args, _causal, _causal_reference),
    sweep={
      "attention": SweepOp(dot_product_attention, _qkv, SIZES, QUICK),
      # Its candidates compile in the exhaustive sweep; by default those of the
      # packed-documents case below (the same blocks, with segments, a soft cap
      # and sinks on top of the causal mask) stand for them.
      "attention_causal": SweepOp(_causal, _qkv, SIZES[:4], QUICK, candidates=False),
      # The heuristic's blocks with a soft cap on the causal mask (above head
      # dim 64 the Mosaic GPU backward, an autotuning candidate there, splits
      # dK's and dV's columns; at head dim 256 the forward, also one, runs one
      # consumer: compiled at every size as preferred candidates are).
      "attention_capped": SweepOp(
        _capped, _qkv, QUICK + ((2, 2048, 4, 4, 256),), QUICK, candidates=False
      ),
      # The two trailing int32 arrays are the query's and key's segment ids.
      "attention_features": SweepOp(
        _packed_documents,
        lambda b, t, n, kv, h: [*_qkv(b, t, n, kv, h), (n,), (b, t), (b, t)],
        QUICK + ((2, 2048, 4, 4, 256),),
        QUICK,
        ints=2,
      ),
      # The four trailing int32 arrays: the query and key lengths and segment ids.
      "attention_lengths": SweepOp(
        _padded_batch,
        lambda b, t, n, kv, h: [*_qkv(b, t, n, kv, h), (b,), (b,), (b, t), (b, t)],
        QUICK + ((2, 2048, 4, 4, 256),),
        QUICK,
        ints=4,
        candidates=False,
      ),
      # The trailing boolean array is the mask. The Mosaic GPU kernels
      # stream tiles of the bias in its dtype (``logit_bias_dtype``): here
      # the case's, float32 in the next.
      "attention_biased": SweepOp(
        _biased,
        lambda b, t, n, kv, h: [*_qkv(b, t, n, kv, h), (b, n, t, t), (b, 1, t, t)],
        QUICK,
        QUICK,
        masks=1,
      ),
      "attention_float32_bias": SweepOp(
        _float32_bias, lambda b, t, n, kv, h: [*_qkv(b, t, n, kv, h), (1, n, t, t)], QUICK, QUICK
      ),
    },
    bench=BenchSuite("test_attention.py", "test_attention_modes", "B x T x N x H"),
    work=attention_work,
  ),
)
