"""Paged attention: ``pallax.paged_attention``, one decode step against a paged KV cache.

The layout and signature of JAX's TPU ``paged_attention`` op: each sequence's
keys and values live in fixed-size pages of a shared pool, and a page table
says which pages, in order, hold it. One primitive, declared as a user
declares an op, through ``pallax.custom_op`` (one framework for both):

* ``paged_attention (q, k_pages, v_pages, lengths, page_indices) -> (out,)``
  with the operands of ``kernels/paged_attention/common.py`` (query heads
  grouped by their kv head); its lowering is the blockwise XLA program
  (CPU), the flash-decoding Triton kernel (GPU) or the Mosaic kernel (TPU),
  as the executor's ``PagedAttentionConfig`` says.

An inference op: it has no derivatives, and ``grad`` / ``jvp`` raise
``NotImplementedError`` rather than return anything. vmap folds into the batch
(``batching_rules/paged_attention.py``); batch and kv heads (with their query
heads) shard freely, the pools' pages and the page table's columns are
replicated.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from pallax import paging, validation
from pallax.batching_rules import paged_attention as paged_batching
from pallax.custom_op import custom_op
from pallax.kernels import paged_attention as kernels
from pallax.kernels.paged_attention import PagedAttentionConfig
from pallax.kernels.paged_attention import xla as paged_xla

__all__ = ["paged_attention", "PagedAttentionConfig"]

_OP = "paged_attention"


def _out_shape(q, k_pages, v_pages, lengths, page_indices, **params) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((*q.shape[:3], v_pages.shape[3]), q.dtype)


# Declared as a user declares an op (``pallax.custom_op``): the pools' pages,
# the page table's columns and the head dims are replicated; vmap has a rule
# of its own (the per-example pools concatenated along the pages).
paged_attention_op = custom_op(
  _OP,
  reference=paged_xla.paged_attention,
  abstract_eval=_out_shape,
  dims="b k g h, k p ps h, k p ps hv, b, b pp -> b k g hv",
  replicated=("h", "p", "ps", "hv", "pp"),  # in order of appearance (Shardy sorts them)
  kernels=kernels.KERNEL.impls,
  config=kernels.KERNEL.space,
  batching=paged_batching.fold_into_batch,
  jvp=paging.no_derivatives(_OP),
)
paged_attention_p = paged_attention_op.primitive


# ----------------------------------------------------------------------------
# The public function: validation and layout.


def paged_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  lengths: jax.Array,
  page_indices: jax.Array,
  *,
  scale: Optional[float] = None,
  logits_soft_cap: Optional[float] = None,
  config: Optional[PagedAttentionConfig] = None,
) -> jax.Array:
  """Attention of one query per sequence over that sequence's pages of a KV cache.

  Token ``s`` of sequence ``b`` is row ``s % page_size`` of page
  ``page_indices[b, s // page_size]`` of the pools; sequence ``b`` has
  ``lengths[b]`` tokens, and pages past its length are never read (the TPU
  kernel fetches the first page of a sequence of length 0 once). Per query
  head: ``softmax(soft_cap(scale * q k^T)) v`` with logits and softmax
  statistics in float32 (float64 for float64 inputs). A sequence of length 0
  gives 0.

  Lengths and page indices known at trace time are checked; traced ones are
  clamped: lengths into ``[0, pages_per_sequence * page_size]``, page
  indices into ``[0, total_pages)`` (a wrong index reads a wrong page, never
  memory outside the pool).

  Args:
    q: ``(B, N, H)``, floating: one query per sequence and head.
    k_pages: ``(K, total_pages, page_size, H)``, q's dtype; ``K`` divides
      ``N`` (grouped-query attention: query head ``n`` reads kv head
      ``n // (N // K)``).
    v_pages: ``(K, total_pages, page_size, Hv)``, q's dtype (``Hv`` may
      differ from ``H``).
    lengths: ``(B,)`` integer: each sequence's token count.
    page_indices: ``(B, pages_per_sequence)`` integer: each sequence's pages
      in order; entries past a sequence's length are ignored.
    scale: the logits' scale; default ``1 / sqrt(H)``.
    logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` after
      scaling (Gemma 2); None: no cap.
    config: pin the kernel's ``PagedAttentionConfig`` (or
      ``PagedAttentionConfig(implementation="xla")``).

  Returns:
    ``(B, N, Hv)`` in q's dtype.

  Raises:
    ValueError: concrete lengths or page indices out of range, naming the argument.
    NotImplementedError: under ``grad``, ``jvp`` and the like: an inference op.
  """
  validation.check_config(_OP, config, PagedAttentionConfig)
  batch = jnp.shape(q)[0] if jnp.ndim(q) == 3 else None  # one query row a sequence
  q, k_pages, v_pages, lengths, page_indices, scale, cap = paging.check_call(
    _OP, (q, k_pages, v_pages, lengths, page_indices), "lengths", scale, logits_soft_cap, batch
  )
  b, n, h = q.shape
  kv_heads, total_pages, page_size, _ = k_pages.shape
  max_len = page_indices.shape[1] * page_size
  hv = v_pages.shape[3]
  if 0 in (b, n, max_len):  # no query, or no token: nothing to attend to
    return jnp.zeros((b, n, hv), q.dtype)
  lengths, page_indices = paging.clamped(lengths, page_indices, page_size, total_pages)
  q4 = q.reshape(b, kv_heads, n // kv_heads, h)
  out = paged_attention_op(
    q4,
    k_pages,
    v_pages,
    lengths,
    page_indices,
    config=config,
    scale=scale,
    logits_soft_cap=cap,
  )
  return out.reshape(b, n, hv)
