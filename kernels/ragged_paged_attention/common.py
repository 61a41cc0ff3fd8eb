"""What every ragged-paged-attention implementation shares: the call's facts, work list and mask.

The primitive's operands (``primitives/ragged_paged_attention.py`` builds them):

* ``q (T, K, G, H)``: the batch's query tokens, the sequences' tokens
  concatenated, query heads grouped by the kv head they read;
* ``k_pages (K, P, page_size, H)``, ``v_pages (K, P, page_size, Hv)``: the
  page pools, as ``paged_attention``'s;
* ``kv_lens (S,)`` int32 in ``[0, pages_per_sequence * page_size]``: each
  sequence's tokens in the cache, its new ones included;
* ``page_indices (S, pages_per_sequence)`` int32 in ``[0, P)``;
* ``cu_q_lens (S + 1,)`` int32, non-decreasing from 0, at most ``T``:
  sequence ``i``'s queries are tokens ``cu_q_lens[i] : cu_q_lens[i + 1]``;
* ``num_seqs (1,)`` int32 in ``[0, S]``: the sequences in use.

Query ``j`` of sequence ``i`` (``q_len = cu_q_lens[i + 1] - cu_q_lens[i]``)
sits at position ``kv_len - q_len + j`` of its sequence (bottom-right causal
alignment: the new tokens are the cache's last) and sees the keys at the
positions ``p`` with ``p <= position``, ``p < kv_len`` and, with a sliding
window ``w``, ``p > position - w``. Results: ``out (T, K, G, Hv)`` in q's
dtype and ``lse (T, K, G)`` in the stats dtype; a token that sees no key, or
belongs to no sequence (past ``cu_q_lens[num_seqs]``), gives 0 and ``-inf``.

Every implementation works on a *work list*: each sequence's queries cut
into items of ``block_q`` tokens (``work_list``), so that an item's rows share
one sequence's keys, read once for all of them. The items' queries are
gathered into aligned blocks (``item_queries``; the Triton kernel reads
decode-sized items from the tokens instead, the Mosaic GPU kernel every
item's) and each token gathers its
result from its item (``token_results``): ``run_items`` does all three around
an implementation's item kernel. The logits are ``paged_attention``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax.kernels.paged_attention.common import PagedFacts


@dataclasses.dataclass(frozen=True)
class Problem(PagedFacts):
  """The static facts of one ragged-paged-attention call."""

  tokens: int
  max_seqs: int
  window: Optional[int]

  @classmethod
  def of(
    cls,
    avals: Sequence[Any],
    *,
    scale: float,
    logits_soft_cap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **_,
  ) -> Problem:
    q, k, v, kv_lens, table = avals[:5]
    return cls(
      tokens=q.shape[0],
      max_seqs=kv_lens.shape[0],
      window=sliding_window,
      **cls.cache_fields(q, k, v, table, scale, logits_soft_cap),
    )


def items_bound(p: Problem, block_q: int) -> int:
  """The most items any call of these shapes has: ``ceil(T / block_q) + S``."""
  return -(-p.tokens // block_q) + p.max_seqs


@dataclasses.dataclass(frozen=True)
class Items:
  """The work list, ``(I,)`` int32 each: item ``i`` runs queries ``q0 : q0 + block_q``.

  ``q_len`` and ``kv_len`` are its sequence's (0 for the unused items at the
  end), ``start`` the token index of its first query, ``seq`` its sequence.
  """

  seq: jax.Array
  q0: jax.Array
  q_len: jax.Array
  kv_len: jax.Array
  start: jax.Array


def _chunks(block_q: int, cu_q_lens, num_seqs):
  """Per sequence slot: its items (0 for slots not in use) and the index of its first."""
  live = jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs[0]
  chunks = -(-jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0) // block_q)
  return chunks, jnp.cumsum(chunks) - chunks


def _owner(ends, at, bound: int) -> jax.Array:
  """The slot whose ``[start, end)`` range holds each of ``at``: ends ``<= at`` counted.

  Compared all at once (``len(at) x S`` booleans). The default binary search
  is a loop of dependent steps, each its own kernels on a GPU: with it, a
  decode step of 32 sequences took 479 us on an H200, without it 271 us.
  """
  owner = jnp.searchsorted(ends, at, side="right", method="compare_all")
  return jnp.minimum(owner, bound - 1).astype(jnp.int32)


def work_list(p: Problem, block_q: int, kv_lens, cu_q_lens, num_seqs) -> Items:
  """Each sequence's queries cut into items of ``block_q`` tokens, in sequence order."""
  chunks, first = _chunks(block_q, cu_q_lens, num_seqs)
  item = jnp.arange(items_bound(p, block_q), dtype=jnp.int32)
  seq = _owner(first + chunks, item, p.max_seqs)
  used = item < jnp.sum(chunks)
  q0 = (item - first[seq]) * block_q
  return Items(
    seq=seq,
    q0=jnp.where(used, q0, 0),
    q_len=jnp.where(used, cu_q_lens[seq + 1] - cu_q_lens[seq], 0),
    kv_len=jnp.where(used, kv_lens[seq], 0),
    start=cu_q_lens[seq] + jnp.where(used, q0, 0),
  )


def item_queries(q, items: Items, block_q: int) -> jax.Array:
  """``(I, K, block_q * G, H)``: each item's query rows, token-major (row ``j G + g``)."""
  t, kh, g, h = q.shape
  rows = jnp.clip(items.start[:, None] + jnp.arange(block_q), 0, max(t - 1, 0))
  x = q[rows]  # (I, block_q, K, G, H)
  return jnp.swapaxes(x, 1, 2).reshape(x.shape[0], kh, block_q * g, h)


def token_results(x, block_q: int, tokens: int, cu_q_lens, num_seqs, fill) -> jax.Array:
  """Items' results ``(I, K, block_q * G, ...)`` at their tokens ``(T, K, G, ...)``.

  Each token gathers its row of its item (token ``t`` of sequence ``s`` is row
  ``(t - start) % block_q`` of the sequence's item ``(t - start) // block_q``):
  one pass writing every token once, where a scatter of the items' rows first
  fills the tokens that no item holds. Those (past ``cu_q_lens[num_seqs]``) get
  ``fill``.
  """
  i, kh, rows = x.shape[:3]
  x = x.reshape(i, kh, block_q, rows // block_q, *x.shape[3:])
  token = jnp.arange(tokens, dtype=jnp.int32)
  _, first = _chunks(block_q, cu_q_lens, num_seqs)
  seqs = cu_q_lens.shape[0] - 1
  used = jnp.clip(num_seqs[0], 0, seqs)
  # The slots in use end where their ranges do, the others all at the last's end.
  seq = _owner(cu_q_lens[jnp.minimum(jnp.arange(1, seqs + 1), used)], token, seqs)
  offset = token - cu_q_lens[seq]
  # (T, K, G, ...); tokens past the sequences' (replaced below) may point past the items.
  out = x.at[first[seq] + offset // block_q, :, offset % block_q].get(mode="clip")
  live = token < cu_q_lens[used]
  return jnp.where(live.reshape(-1, *[1] * (out.ndim - 1)), out, jnp.asarray(fill, x.dtype))


def row_positions(q0, q_len, kv_len, rows: int, groups: int):
  """``(positions, live)`` columns ``(rows, 1)`` of an item's query rows.

  Row ``j G + g`` is query ``q0 + j``. Columns from a 2-D iota, and
  ``lax.div`` rather than ``//`` (which lowers through ``sign``, resolved
  against the local device): what Mosaic TPU compiles deviceless.
  """
  j = q0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), jnp.int32(groups))
  return kv_len - q_len + j, j < q_len


def key_range(p: Problem, q0, q_len, kv_len, block_q: int):
  """``[lo, hi)``: the keys an item's queries see between them."""
  first = kv_len - q_len + q0
  hi = kv_len - q_len + jnp.minimum(q0 + block_q, q_len)
  lo = jnp.zeros_like(first) if p.window is None else jnp.maximum(first - p.window + 1, 0)
  return lo, jnp.maximum(hi, lo)


def visible(p: Problem, positions, live, keys, kv_len):
  """Which keys (positions ``keys``, a row ``(1, n)``) each query (a ``row_positions`` row) sees."""
  keep = live & (keys <= positions) & (keys < kv_len)
  if p.window is not None:
    keep &= keys > positions - p.window
  return keep


def run_items(
  p: Problem,
  block_q: int,
  operands: Sequence[jax.Array],
  item_kernel,
  gather_queries: bool = True,
) -> list:
  """``[out, lse]`` of the call: ``item_kernel`` on the work list, results back at the tokens.

  ``item_kernel(q_items, k_pages, v_pages, items, table_items)`` gets the
  items' query rows ``(I, K, block_q * G, H)`` (``item_queries``; without
  ``gather_queries`` the tokens' ``q (T, K, G, H)`` itself, for a kernel
  that reads an item's rows from ``items.start``) and page-table rows ``(I,
  pages_per_sequence)`` and returns their ``out (I, K, rows, Hv)`` (q's dtype)
  and ``lse (I, K, rows)``.
  """
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = operands
  items = work_list(p, block_q, kv_lens, cu_q_lens, num_seqs)
  queries = item_queries(q, items, block_q) if gather_queries else q
  out, lse = item_kernel(queries, k_pages, v_pages, items, page_indices[items.seq])
  at_tokens = lambda x, fill: token_results(x, block_q, p.tokens, cu_q_lens, num_seqs, fill)
  return [at_tokens(out, 0), at_tokens(lse, -jnp.inf)]
