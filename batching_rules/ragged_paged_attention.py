"""vmap rule for ragged paged attention: the vmapped axis folds into tokens and sequences.

Each of the ``V`` examples is a batch of ``T`` query tokens and ``S``
sequence slots. They become one batch of ``V * T`` tokens and ``V * (S + 1)``
sequences, example ``v``'s tokens at ``v * T``: its ``num_seqs[v]`` sequences
keep their queries and caches, its unused slots get no query, and one more
sequence per example, with an empty cache, holds its tokens past
``cu_q_lens[num_seqs]`` (they see no key: 0 and ``-inf``, as unbatched). Page
pools fold as ``paged_attention``'s: a vmapped pool is concatenated along its
pages and each example's page indices offset by ``v * P``. One kernel call.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.op.fold import merge_into


def _per_example(a, bdim, size):
  """``a`` with the vmapped axis in front (broadcast if unmapped)."""
  if bdim is NOT_MAPPED:
    return jnp.broadcast_to(a, (size, *a.shape))
  return jnp.moveaxis(a, bdim, 0)


def fold_into_tokens(prim, args, bdims, **params):
  """The token-folding rule (``pallax.custom_op``'s ``batching``)."""
  size = axis_size(args, bdims)
  q, k_pages, v_pages, kv_lens, table, cu_q_lens, num_seqs = args
  q_dim, k_dim, v_dim, kv_dim, table_dim, cu_dim, num_dim = bdims
  tokens = (q if q_dim is NOT_MAPPED else jnp.moveaxis(q, q_dim, 0)[0]).shape[0]
  pages = (k_pages if k_dim is NOT_MAPPED else jnp.moveaxis(k_pages, k_dim, 0)[0]).shape[1]
  q = merge_into(q, q_dim, size, 0)
  kv_lens = _per_example(kv_lens, kv_dim, size)
  table = _per_example(table, table_dim, size)
  cu = _per_example(cu_q_lens, cu_dim, size)
  num = _per_example(num_seqs, num_dim, size)[:, 0]
  slots = kv_lens.shape[1]
  if k_dim is not NOT_MAPPED or v_dim is not NOT_MAPPED:
    k_pages, v_pages = merge_into(k_pages, k_dim, size, 1), merge_into(v_pages, v_dim, size, 1)
    table = table + (jnp.arange(size, dtype=table.dtype) * pages)[:, None, None]
  # Unused slots start where the last used sequence ends; the extra one ends at T.
  ends = jnp.take_along_axis(cu, jnp.minimum(jnp.arange(1, slots + 1), num[:, None]), axis=1)
  ends = jnp.concatenate([ends, jnp.full((size, 1), tokens, ends.dtype)], axis=1)
  ends = ends + (jnp.arange(size, dtype=ends.dtype) * tokens)[:, None]
  cu = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends.reshape(-1)])
  kv_lens = jnp.concatenate([kv_lens, jnp.zeros((size, 1), kv_lens.dtype)], axis=1).reshape(-1)
  table = jnp.concatenate([table, jnp.zeros_like(table[:, :1])], axis=1)
  table = table.reshape(-1, table.shape[-1])
  count = jnp.full((1,), size * (slots + 1), num.dtype)
  out, lse = prim.bind(q, k_pages, v_pages, kv_lens, table, cu, count, **params)
  unfold = lambda x: x.reshape(size, tokens, *x.shape[1:])
  return [unfold(out), unfold(lse)], [0, 0]
