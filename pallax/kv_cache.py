"""Writing a serving step's new keys and values into a paged KV cache.

``update_kv_cache`` writes each new token's key and value into its slot of
the page pools that ``paged_attention`` and ``ragged_paged_attention`` read
(``(K, total_pages, page_size, H)``: slot ``s`` is row ``s % page_size`` of
page ``s // page_size``), and ``kv_cache_slots`` gives a batch's slots from
its page table, as ``ragged_paged_attention`` places its new tokens (the last
``q_len`` of each sequence's ``kv_len``). The write is one XLA scatter per
pool: under ``jax.jit`` with the pools donated (``donate_argnums``) XLA
writes into the pools' own buffers on every platform, so a step costs the
new tokens' bytes, not a copy of the cache. No Pallas kernel: a scatter of
rows is what XLA's is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax import paging, validation

__all__ = ["kv_cache_slots", "update_kv_cache"]

_OP = "update_kv_cache"


def kv_cache_slots(
  page_indices: jax.Array,
  kv_lens: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  page_size: int,
  tokens: int,
) -> jax.Array:
  """``(tokens,)`` int32: the cache slot of each new token of a ``ragged_paged_attention`` batch.

  Query ``j`` of sequence ``i`` (``q_len`` of them, tokens ``cu_q_lens[i] :
  cu_q_lens[i + 1]``) is the sequence's token ``kv_lens[i] - q_len + j``:
  slot ``page_indices[i, p // page_size] * page_size + p % page_size``.
  Tokens past ``cu_q_lens[num_seqs]`` get -1 (``update_kv_cache`` skips them).
  Offsets and lengths are as ``ragged_paged_attention`` checks them; a
  traced sequence with more queries than ``kv_lens`` writes its first ones
  to slots of its first page.

  Args:
    page_indices: ``(max_seqs, pages_per_sequence)`` integer.
    kv_lens: ``(max_seqs,)`` integer, counting the new tokens.
    cu_q_lens: ``(max_seqs + 1,)`` integer.
    num_seqs: integer scalar or ``(1,)``.
    page_size: the pools' tokens a page.
    tokens: the batch's query tokens ``T``.
  """
  op = "kv_cache_slots"
  page_indices = paging.array(op, "page_indices", page_indices, 2)
  kv_lens = paging.array(op, "kv_lens", kv_lens, 1)
  cu_q_lens = paging.array(op, "cu_q_lens", cu_q_lens, 1)
  for name, x in (("page_indices", page_indices), ("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
    paging.check_integer(op, name, x)
  seqs = kv_lens.shape[0]
  if page_indices.shape[0] != seqs or cu_q_lens.shape != (seqs + 1,):
    raise ValueError(
      f"{op}: page_indices (max_seqs, pages_per_sequence), kv_lens (max_seqs,) and cu_q_lens "
      f"(max_seqs + 1,) must agree; got {page_indices.shape}, {kv_lens.shape}, {cu_q_lens.shape}"
    )
  for name, value in (("page_size", page_size), ("tokens", tokens)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      raise ValueError(f"{op}: {name} must be an int >= 0, got {value!r}")
  if page_size == 0:
    raise ValueError(f"{op}: page_size must be > 0")
  if seqs == 0 or page_indices.shape[1] == 0:  # no sequence, or no page: nothing to write
    return jnp.full((tokens,), -1, jnp.int32)
  t = jnp.arange(tokens)
  seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], t, side="right"), seqs - 1)
  live = t < cu_q_lens[jnp.asarray(num_seqs).reshape(-1)[0]]
  position = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + t - cu_q_lens[seq]
  pps = page_indices.shape[1]
  page = page_indices[seq, jnp.clip(position // page_size, 0, pps - 1)]
  return jnp.where(live, page * page_size + position % page_size, -1).astype(jnp.int32)


def update_kv_cache(
  k_pages: jax.Array,
  v_pages: jax.Array,
  k: jax.Array,
  v: jax.Array,
  slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The pools with each new token's key and value written into its slot.

  ``k[t]`` goes to row ``slot_mapping[t] % page_size`` of page
  ``slot_mapping[t] // page_size`` of ``k_pages`` (every kv head), ``v[t]``
  likewise; a negative slot skips its token (padding), and no slot may
  appear twice. Values are cast to the pools' dtype. In place under
  ``jax.jit(..., donate_argnums=(0, 1))``.

  Args:
    k_pages: ``(K, total_pages, page_size, H)``, floating.
    v_pages: ``(K, total_pages, page_size, Hv)``, ``k_pages``' dtype.
    k: ``(T, K, H)``, floating: the new tokens' keys.
    v: ``(T, K, Hv)``, floating: their values.
    slot_mapping: ``(T,)`` integer: each token's slot, ``page * page_size +
      row``, or negative to skip it (``kv_cache_slots`` computes them).

  Returns:
    ``(k_pages, v_pages)`` updated.
  """
  k = paging.array(_OP, "k", k, 3)
  v = paging.array(_OP, "v", v, 3)
  k_pages = paging.array(_OP, "k_pages", k_pages, 4)
  v_pages = paging.array(_OP, "v_pages", v_pages, 4)
  validation.check_floating_alike(_OP, {"k_pages": k_pages, "v_pages": v_pages})
  validation.check_floating(_OP, "k", k)
  validation.check_floating(_OP, "v", v)
  kv_heads, total_pages, page_size, h = k_pages.shape
  t = k.shape[0]
  if v_pages.shape[:3] != k_pages.shape[:3]:
    raise ValueError(
      f"{_OP}: v_pages of shape {v_pages.shape} must match k_pages {k_pages.shape} in "
      "(K, total_pages, page_size)"
    )
  if k.shape != (t, kv_heads, h) or v.shape != (t, kv_heads, v_pages.shape[3]):
    raise ValueError(
      f"{_OP}: k and v must have shapes (T, K, H) = (T, {kv_heads}, {h}) and (T, K, Hv) = "
      f"(T, {kv_heads}, {v_pages.shape[3]}) for pools {k_pages.shape} and {v_pages.shape}; "
      f"got {k.shape} and {v.shape}"
    )
  slot_mapping = paging.array(_OP, "slot_mapping", slot_mapping, 1)
  paging.check_integer(_OP, "slot_mapping", slot_mapping)
  if slot_mapping.shape != (t,):
    raise ValueError(f"{_OP}: slot_mapping must have shape (T,) = ({t},), got {slot_mapping.shape}")
  slots = validation.concrete(slot_mapping)
  if slots is not None:
    used = slots[slots >= 0]
    if used.size and used.max() >= total_pages * page_size:
      raise ValueError(
        f"{_OP}: slot_mapping must lie below total_pages * page_size = "
        f"{total_pages * page_size}, got {used.max()}"
      )
    if used.size != np.unique(used).size:
      raise ValueError(f"{_OP}: slot_mapping names a slot twice: its writes would race")
  # Skipped tokens (and traced slots past the pool) go to an index past the pool: dropped.
  past = total_pages * page_size
  slot = jnp.where(slot_mapping < 0, past, slot_mapping)
  page, row = slot // page_size, slot % page_size

  def write(pages, new):
    new = jnp.swapaxes(new, 0, 1).astype(pages.dtype)  # (K, T, width)
    return pages.at[:, page, row].set(new, mode="drop")

  return write(k_pages, k), write(v_pages, v)
