"""The paged-attention family's tools: self-check case, verify sweep, bench suite, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``) for ``paged_attention``, an
inference op: forward only, no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.paged_attention import paged_attention
from pallax.roofline import Work, nbytes

__all__ = ["TOOLS", "paged_decode_work"]


def paged_decode_work(lengths, heads: int, kv_heads: int, head_dim: int, dtype) -> Work:
  """One decode step against a paged KV cache: the keys and values each sequence reads.

  ``lengths``: the sequences' context lengths. FLOPs ``4 N len H`` per
  sequence (one query row); bytes the keys and values under the lengths plus
  ``q`` read and ``o`` written. Forward only: an inference op.
  """
  tokens = int(np.sum(np.asarray(lengths, np.int64)))
  batch = len(np.asarray(lengths).reshape(-1))
  flops = 4 * heads * tokens * head_dim
  elements = 2 * tokens * kv_heads * head_dim + 2 * batch * heads * head_dim
  return Work(flops, nbytes(elements, dtype))


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  """A decode step: ragged lengths from 1 to full, a pool of every sequence's pages, shuffled."""
  b, n, kv, h, page_size, pages = (3, 8, 2, 64, 8, 5) if small else (8, 16, 4, 128, 16, 64)
  q = jnp.asarray(rng.standard_normal((b, n, h)), dtype)
  pool = (kv, b * pages, page_size, h)
  k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in range(2))
  lengths = rng.integers(1, pages * page_size + 1, b)
  lengths[0] = pages * page_size
  table = rng.permutation(b * pages).reshape(b, pages)
  return q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32)


def _gathered_reference(q, k_pages, v_pages, lengths, page_indices) -> jax.Array:
  """Plain JAX: every sequence's pages gathered into dense keys and values, masked softmax.

  Query head ``n`` reads kv head ``n // (N / K)``; statistics in float32 (the
  inputs' dtype when wider).
  """
  kv, _, _, h = k_pages.shape
  b, n, _ = q.shape
  st = jnp.promote_types(q.dtype, jnp.float32)

  def dense(pages):  # (K, P, page_size, H) -> (B, K, S, H)
    x = pages[:, page_indices].astype(st)  # (K, B, pages_per_sequence, page_size, H)
    return jnp.swapaxes(x.reshape(kv, b, -1, x.shape[-1]), 0, 1)

  k, v = dense(k_pages), dense(v_pages)
  s = jnp.einsum("bkgh,bksh->bkgs", q.astype(st).reshape(b, kv, n // kv, h), k) / np.sqrt(h)
  s = jnp.where(jnp.arange(k.shape[2]) < lengths[:, None, None, None], s, -jnp.inf)
  o = jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(s, axis=-1), v)
  return o.reshape(b, n, -1).astype(q.dtype)


# Sweep sizes (B, N, K, H, page_size, pages_per_sequence), a pool of
# B * pages_per_sequence pages: the bench's decode step, a padded head dim 80
# with odd counts and small pages, MQA, head dim 256, MHA with large pages.
SIZES = (
  (32, 32, 8, 128, 16, 256),
  (3, 12, 4, 80, 8, 37),
  (8, 8, 1, 64, 32, 64),
  (4, 16, 2, 256, 16, 64),
  (4, 8, 8, 128, 128, 8),
)


def _shapes(b, n, kv, h, page_size, pages) -> list[tuple[int, ...]]:
  pool = (kv, b * pages, page_size, h)
  return [(b, n, h), pool, pool, (b,), (b, pages)]


TOOLS = (
  OpTools(
    "paged_attention",
    check=SelfCheck(
      "paged_attention", _args, paged_attention, _gathered_reference, differentiable=False
    ),
    sweep={
      "paged_attention": SweepOp(
        paged_attention, _shapes, SIZES, SIZES[:2], ints=2, stages=("fwd",)
      )
    },
    bench=BenchSuite("test_paged_attention.py", "test_paged_attention", "B x N x S x H"),
    work=paged_decode_work,
  ),
)
