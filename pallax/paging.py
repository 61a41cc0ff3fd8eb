"""Checks and clamps shared by the ops that read or write a paged KV cache.

``paged_attention``, ``ragged_paged_attention`` and ``update_kv_cache`` take
page pools ``(K, total_pages, page_size, H)`` and a page table ``(S,
pages_per_sequence)``: token ``s`` of sequence ``b`` is row ``s % page_size``
of page ``page_indices[b, s // page_size]``. Values known at trace time are
checked here with errors that name the op and the argument; traced ones are
clamped by the op (a wrong index reads a wrong page, never memory outside
the pool).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallax import validation


def no_derivatives(op: str):
  """The ``jvp`` of an inference op over a paged cache: raises, naming the op and what to do."""

  def jvp(primals, tangents, out, **params):
    raise NotImplementedError(
      f"pallax.{op} is an inference op: it has no derivatives (grad, jvp, vjp, linearize); "
      "differentiate pallax.dot_product_attention on the gathered keys and values instead, "
      "or stop_gradient its inputs"
    )

  return jvp


def array(op: str, name: str, x, ndim: int) -> jax.Array:
  """``x`` as an array of ``ndim`` dims (ValueError naming ``name`` otherwise)."""
  x = jnp.asarray(x)
  if x.ndim != ndim:
    raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {x.shape}")
  return x


def check_integer(op: str, name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{op}: {name} must have an integer dtype, got {x.dtype}")


def check_pools(op: str, q: jax.Array, k_pages, v_pages) -> tuple[jax.Array, jax.Array]:
  """The pools as 4-D arrays of ``q``'s dtype whose kv heads divide q's heads (``q``'s dim -2).

  ``q``'s last dim is the head dim, which ``k_pages`` must have too.
  """
  k_pages = array(op, "k_pages", k_pages, 4)
  v_pages = array(op, "v_pages", v_pages, 4)
  validation.check_floating_alike(op, {"q": q, "k_pages": k_pages, "v_pages": v_pages})
  n, h = q.shape[-2:]
  kv_heads = k_pages.shape[0]
  if k_pages.shape[3] != h:
    raise ValueError(
      f"{op}: k_pages of shape {k_pages.shape} must have q's head dim {h} (q {q.shape})"
    )
  if v_pages.shape[:3] != k_pages.shape[:3]:
    raise ValueError(
      f"{op}: v_pages of shape {v_pages.shape} must match k_pages {k_pages.shape} in "
      "(K, total_pages, page_size)"
    )
  if kv_heads == 0 or n % kv_heads:
    raise ValueError(
      f"{op}: the pools' {kv_heads} kv heads must divide q's {n} heads (q {q.shape}, "
      f"k_pages {k_pages.shape})"
    )
  return k_pages, v_pages


def check_call(
  op: str,
  arrays,
  lengths_name: str,
  scale,
  logits_soft_cap,
  batch: Optional[int] = None,
  used: Optional[int] = None,
) -> tuple:
  """The arguments an attention op over a paged cache shares, checked; ``(*arrays, scale, cap)``.

  ``arrays``: ``(q, k_pages, v_pages, lengths, page_indices)``. ``q`` is
  ``(rows, N, H)``; ``lengths`` ``(S,)``, with ``S = batch`` when given
  (``paged_attention``: one query row a sequence); ``page_indices`` ``(S,
  pages_per_sequence)``. ``scale`` defaults to ``1 / sqrt(H)``, a soft
  cap must be > 0. Concrete lengths and page indices are checked
  (``check_page_table``): the first ``used`` sequences' when given (the
  others are unused slots that may hold anything).
  """
  q, k_pages, v_pages, lengths, page_indices = arrays
  q = array(op, "q", q, 3)
  k_pages, v_pages = check_pools(op, q, k_pages, v_pages)
  lengths = array(op, lengths_name, lengths, 1)
  page_indices = array(op, "page_indices", page_indices, 2)
  check_integer(op, lengths_name, lengths)
  check_integer(op, "page_indices", page_indices)
  seqs = lengths.shape[0] if batch is None else batch
  if lengths.shape != (seqs,):
    raise ValueError(f"{op}: {lengths_name} must have shape ({seqs},), got {lengths.shape}")
  if page_indices.shape[0] != seqs:
    raise ValueError(
      f"{op}: page_indices must have shape (sequences, pages_per_sequence) with {seqs} "
      f"sequences (as {lengths_name}), got {page_indices.shape}"
    )
  h = q.shape[2]
  scale = 1 / np.sqrt(h) if scale is None else validation.check_static_float(op, "scale", scale)
  cap = None
  if logits_soft_cap is not None:
    cap = validation.check_positive_float(op, "logits_soft_cap", logits_soft_cap)
  _, total_pages, page_size, _ = k_pages.shape
  if total_pages == 0 and page_indices.shape[1] * page_size:
    raise ValueError(f"{op}: k_pages of shape {k_pages.shape} holds no page")
  in_use = slice(None) if used is None else slice(0, used)
  check_page_table(op, lengths[in_use], page_indices[in_use], page_size, total_pages, lengths_name)
  return q, k_pages, v_pages, lengths, page_indices, float(scale), cap


def check_page_table(
  op: str, lengths, page_indices, page_size: int, total_pages: int, lengths_name: str
) -> None:
  """Static checks of concrete lengths and page indices (traced ones are clamped)."""
  max_len = page_indices.shape[1] * page_size
  validation.check_concrete_range(
    op, lengths_name, lengths, 0, max_len, high_name="pages_per_sequence * page_size"
  )
  lens, table = validation.concrete(lengths), validation.concrete(page_indices)
  if lens is None or table is None or not table.size:
    return
  needed = np.arange(table.shape[1])[None, :] * page_size < lens[:, None]
  bad = needed & ((table < 0) | (table >= total_pages))
  if bad.any():
    b, i = (int(x[0]) for x in np.nonzero(bad))
    raise ValueError(
      f"{op}: page_indices must lie in [0, total_pages) = [0, {total_pages}) for every page "
      f"below a sequence's length; page_indices[{b}, {i}] = {table[b, i]}"
    )


def clamped(lengths, page_indices, page_size: int, total_pages: int):
  """``(lengths, page_indices)`` as int32 clamped into the table and the pool."""
  max_len = page_indices.shape[1] * page_size
  lengths = jnp.clip(lengths, 0, max_len).astype(jnp.int32)
  return lengths, jnp.clip(page_indices, 0, max(total_pages - 1, 0)).astype(jnp.int32)


def full_cache_inputs(avals, seed: int, **params) -> list[jax.Array]:
  """Autotuning operands ``q, k_pages, v_pages, lengths, page_indices``: every cache full.

  A kernel's timing depends on the lengths and the page table, not only on
  the shapes: random small integers (the executor's default) would time a
  few tokens a sequence. Full caches through a shuffled page table over the
  pool are the longest reads of the call's shapes (a pool smaller than the
  table gives pages to several sequences, so that some reads repeat).
  ``params``: the call's, which the operands do not depend on.
  """
  rng = np.random.default_rng(seed)
  floats = [jnp.asarray(rng.standard_normal(a.shape, dtype=np.float32), a.dtype) for a in avals[:3]]
  total_pages, page_size = avals[1].shape[1:3]
  seqs, pages = avals[4].shape
  lengths = jnp.full(avals[3].shape, pages * page_size, avals[3].dtype)
  table = rng.permutation(np.resize(np.arange(total_pages), seqs * pages)).reshape(seqs, pages)
  return [*floats, lengths, jnp.asarray(table, avals[4].dtype)]
