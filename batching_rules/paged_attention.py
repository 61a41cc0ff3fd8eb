"""vmap rule for paged attention: the vmapped axis folds into the batch dim, one kernel.

``q``, ``lengths`` and ``page_indices`` lead with the batch dim ``B``: the
vmapped axis of size ``V`` goes in front and merges with it (``V * B``
sequences; unmapped ones are broadcast). Page pools lead with the kv heads;
a vmapped pool is folded into its pages instead: the ``V`` pools are
concatenated along ``total_pages`` (``(K, V * P, page_size, H)``) and each
example's page indices are offset by ``v * P``. (A vmapped key pool with a
shared value pool, or the reverse, broadcasts the shared one.)
"""

from __future__ import annotations

import jax.numpy as jnp

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.op.fold import merge_into


def fold_into_batch(prim, args, bdims, **params):
  """The batch-folding rule (``pallax.custom_op``'s ``batching``)."""
  size = axis_size(args, bdims)
  q, k_pages, v_pages, lengths, table = args
  q_dim, k_dim, v_dim, len_dim, table_dim = bdims
  example = lambda a, d: a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :]
  batch = example(q, q_dim)[0]
  pages = example(k_pages, k_dim)[1]
  q, lengths, table = (
    merge_into(*a, size, 0) for a in ((q, q_dim), (lengths, len_dim), (table, table_dim))
  )
  if k_dim is not NOT_MAPPED or v_dim is not NOT_MAPPED:
    k_pages, v_pages = merge_into(k_pages, k_dim, size, 1), merge_into(v_pages, v_dim, size, 1)
    offsets = jnp.arange(size, dtype=table.dtype) * pages  # example v's pages start at v * P
    table = table + jnp.repeat(offsets, batch)[:, None]
  if size * batch == 0:  # no sequence: no kernel to run
    shape = (size, batch, *q.shape[1:3], v_pages.shape[3])
    return [jnp.zeros(shape, q.dtype)], [0]
  (out,) = prim.bind(q, k_pages, v_pages, lengths, table, **params)
  return [out.reshape(size, batch, *out.shape[1:])], [0]
