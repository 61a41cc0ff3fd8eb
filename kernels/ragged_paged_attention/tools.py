"""The ragged-paged-attention tools: self-check case, verify sweep, bench suite, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``) for ``ragged_paged_attention``, an
inference op: forward only, no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.ragged_paged_attention import ragged_paged_attention
from pallax.roofline import Work, nbytes

__all__ = ["TOOLS", "ragged_paged_work"]


def ragged_paged_work(q_lens, kv_lens, heads: int, kv_heads: int, head_dim: int, dtype) -> Work:
  """A mixed batch against a paged KV cache: every query's visible keys; the traffic floor.

  ``q_lens``, ``kv_lens``: the sequences'. FLOPs ``4 N H`` per (query,
  visible key) pair, bottom-right causal; bytes: the keys and values of each
  sequence with queries, read once (``paged_decode_work``'s floor: the items
  of a prefill chunk read the same keys again, from the cache), plus ``q``
  read and ``o`` written. Forward only: an inference op.
  """
  pairs, keys = 0, 0
  for q_len, kv_len in zip(np.asarray(q_lens).tolist(), np.asarray(kv_lens).tolist()):
    pairs += int((kv_len - q_len + np.arange(q_len) + 1).sum())  # keys each query sees
    keys += kv_len if q_len else 0
  tokens = int(np.sum(q_lens))
  elements = 2 * keys * kv_heads * head_dim + 2 * tokens * heads * head_dim
  return Work(4 * heads * head_dim * pairs, nbytes(elements, dtype))


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  """A mixed batch: decode, speculative and prefill sequences over a shuffled pool."""
  if small:
    n, kv, h, page_size, pages = 4, 2, 32, 8, 6
    q_lens, kv_lens = [1, 5, 20, 0], [9, 17, 45, 3]
  else:
    n, kv, h, page_size, pages = 16, 4, 128, 16, 40
    q_lens, kv_lens = [1] * 6 + [5, 64], [37, 100, 300, 1, 640, 512, 200, 600]
  seqs = len(q_lens)
  cu = np.concatenate([[0], np.cumsum(q_lens)])
  q = jnp.asarray(rng.standard_normal((int(cu[-1]), n, h)), dtype)
  pool = (kv, seqs * pages, page_size, h)
  k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in range(2))
  table = rng.permutation(seqs * pages).reshape(seqs, pages)
  ints = (kv_lens, table, cu, [seqs])
  return (q, k_pages, v_pages, *(jnp.asarray(x, jnp.int32) for x in ints))


def _gathered_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
  """Plain JAX: each token's sequence's pages gathered densely, its mask, a softmax.

  Statistics in float32 (the inputs' dtype when wider); O(T x max_len) memory.
  """
  kv, _, page_size, h = k_pages.shape
  t, n, _ = q.shape
  st = jnp.promote_types(q.dtype, jnp.float32)
  seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(t), side="right")
  live = seq < num_seqs[0]
  seq = jnp.minimum(seq, kv_lens.shape[0] - 1)

  def dense(pages):  # (K, P, page_size, H) -> (T, K, S, H): each token's sequence's tokens
    x = pages[:, page_indices[seq]].astype(st)  # (K, T, pages, page_size, H)
    return jnp.swapaxes(x.reshape(kv, t, -1, x.shape[-1]), 0, 1)

  k, v = dense(k_pages), dense(v_pages)
  kv_len = kv_lens[seq]
  position = kv_len - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + jnp.arange(t) - cu_q_lens[seq]
  keys = jnp.arange(k.shape[2])
  seen = (keys[None, :] <= position[:, None]) & (keys[None, :] < kv_len[:, None]) & live[:, None]
  s = jnp.einsum("tkgh,tksh->tkgs", q.astype(st).reshape(t, kv, n // kv, h), k) / np.sqrt(h)
  s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
  top = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
  denom = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(denom > 0, denom, 1.0)
  o = jnp.einsum("tkgs,tksh->tkgh", p, v)
  return o.reshape(t, n, -1).astype(q.dtype)


# Sweep sizes (T, S, N, K, H, page_size, pages_per_sequence), a pool of S *
# pages_per_sequence pages: a decode batch (one token a sequence), a mixed
# batch with prefill chunks, a padded head dim 80 with odd counts and small
# pages, MQA with head dim 256, MHA with large pages.
SIZES = (
  (32, 32, 32, 8, 128, 16, 256),
  (512, 16, 32, 8, 128, 16, 64),
  (40, 5, 12, 4, 80, 8, 37),
  (64, 8, 8, 1, 256, 16, 64),
  (128, 4, 8, 8, 128, 128, 8),
)


def _shapes(t, s, n, kv, h, page_size, pages) -> list[tuple[int, ...]]:
  pool = (kv, s * pages, page_size, h)
  return [(t, n, h), pool, pool, (s,), (s, pages), (s + 1,), (1,)]


TOOLS = (
  OpTools(
    "ragged_paged_attention",
    check=SelfCheck(
      "ragged_paged_attention",
      _args,
      ragged_paged_attention,
      _gathered_reference,
      differentiable=False,
    ),
    sweep={
      "ragged_paged_attention": SweepOp(
        ragged_paged_attention, _shapes, SIZES, SIZES[1:3], ints=4, stages=("fwd",)
      )
    },
    bench=BenchSuite(
      "test_ragged_paged_attention.py", "test_ragged_paged_attention", "T x N x S x H"
    ),
    work=ragged_paged_work,
  ),
)
