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
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size


def _fold_batch(a, d, size: int, batch: int):
  """``a`` with the vmapped axis in front, merged with its batch dim: ``(size * batch, ...)``."""
  a = batching.bdim_at_front(a, d, size)
  return a.reshape(size * batch, *a.shape[2:])


def _fold_pool(a, d, size: int):
  """``V`` pools ``(K, P, page_size, H)`` as one ``(K, V * P, page_size, H)``."""
  a = jnp.moveaxis(batching.bdim_at_front(a, d, size), 0, 1)
  return a.reshape(a.shape[0], size * a.shape[2], *a.shape[3:])


def fold_into_batch(prim, args, bdims, **params):
  """The batch-folding rule (register with ``PrimitiveSpec.batching``)."""
  size = axis_size(args, bdims)
  q, k_pages, v_pages, lengths, table = args
  q_dim, k_dim, v_dim, len_dim, table_dim = bdims
  example = lambda a, d: a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :]
  batch = example(q, q_dim)[0]
  pages = example(k_pages, k_dim)[1]
  q = _fold_batch(q, q_dim, size, batch)
  lengths = _fold_batch(lengths, len_dim, size, batch)
  table = batching.bdim_at_front(table, table_dim, size)
  if k_dim is not NOT_MAPPED or v_dim is not NOT_MAPPED:
    k_pages, v_pages = _fold_pool(k_pages, k_dim, size), _fold_pool(v_pages, v_dim, size)
    offsets = jnp.arange(size, dtype=table.dtype) * pages
    table = table + offsets[:, None, None]
  table = table.reshape(size * batch, table.shape[-1])
  if size * batch == 0:  # no sequence: no kernel to run
    shape = (size, batch, *q.shape[1:3], v_pages.shape[3])
    return [jnp.zeros(shape, q.dtype)], [0]
  (out,) = prim.bind(q, k_pages, v_pages, lengths, table, **params)
  return [out.reshape(size, batch, *out.shape[1:])], [0]
