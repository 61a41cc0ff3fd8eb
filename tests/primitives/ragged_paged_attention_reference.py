"""The float64 reference of ragged_paged_attention and random mixed batches, shared by its tests.

The reference gathers each sequence's pages in NumPy (only up to its
``kv_len``), builds the bottom-right causal (and window) mask of its queries
densely and runs a float64 softmax per query head, sinks in the denominator;
it shares no code with pallax.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from tests.helpers import f64


def reference(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  scale=None,
  logits_soft_cap=None,
  sliding_window=None,
  sinks=None,
):
  """``(T, N, Hv)`` float64: each sequence's queries over its gathered cache."""
  q, k_pages, v_pages = f64(q), f64(k_pages), f64(v_pages)
  kv_lens, table, cu = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens))
  t, n, h = q.shape
  kv_heads, _, page_size, hv = v_pages.shape
  g = n // kv_heads
  scale = 1 / np.sqrt(h) if scale is None else scale
  out = np.zeros((t, n, hv))
  for i in range(int(np.asarray(num_seqs).reshape(-1)[0])):
    lo, hi, kv_len = int(cu[i]), int(cu[i + 1]), int(kv_lens[i])
    if hi == lo or kv_len == 0:
      continue
    pages = table[i, : -(-kv_len // page_size)]
    k = np.repeat(k_pages[:, pages].reshape(kv_heads, -1, h)[:, :kv_len], g, axis=0)
    v = np.repeat(v_pages[:, pages].reshape(kv_heads, -1, hv)[:, :kv_len], g, axis=0)
    position = kv_len - (hi - lo) + np.arange(hi - lo)
    keys = np.arange(kv_len)
    seen = keys[None, :] <= position[:, None]
    if sliding_window is not None:
      seen &= keys[None, :] > position[:, None] - sliding_window
    s = np.einsum("tnh,nlh->ntl", q[lo:hi], k) * scale
    if logits_soft_cap is not None:
      s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    s = np.where(seen[None], s, -np.inf)
    top = s.max(-1, keepdims=True)
    if sinks is not None:
      top = np.maximum(top, f64(sinks)[:, None, None])
    top = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(s - top)
    denom = w.sum(-1, keepdims=True)
    if sinks is not None:
      denom = denom + np.exp(f64(sinks)[:, None, None] - top)
    p = np.divide(w, denom, out=np.zeros_like(w), where=denom > 0)
    out[lo:hi] = np.einsum("ntl,nlh->tnh", p, v)
  return out


@dataclasses.dataclass(frozen=True)
class Batch:
  """A mixed batch: each sequence's new query tokens and cached tokens (those included).

  ``pad_tokens`` query tokens follow the last sequence's and belong to none;
  ``spare_slots`` sequence slots past ``num_seqs`` hold garbage that must not
  be read. Pool rows no sequence reads are NaN (with ``nan_fill``), so a path
  that lets one into its result fails.
  """

  q_lens: tuple[int, ...] = (1, 5, 12, 0, 1)
  kv_lens: tuple[int, ...] = (9, 12, 30, 3, 1)
  n: int = 4
  k: int = 2
  h: int = 32
  hv: Optional[int] = None
  page_size: int = 8
  pages_per_sequence: int = 5
  pad_tokens: int = 3
  spare_slots: int = 1


def inputs(batch: Batch, dtype=jnp.float32, seed: int = 0, nan_fill: bool = True):
  """``(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)``: a shuffled pool."""
  rng = np.random.default_rng(seed)
  used = len(batch.q_lens)
  slots = used + batch.spare_slots
  pps, ps = batch.pages_per_sequence, batch.page_size
  total = slots * pps
  table = rng.permutation(total).reshape(slots, pps)
  hv = batch.hv or batch.h
  cu = np.concatenate([[0], np.cumsum(batch.q_lens)])
  t = int(cu[-1]) + batch.pad_tokens
  cu = np.concatenate([cu, np.full(batch.spare_slots, cu[-1] + batch.pad_tokens)])
  kv_lens = np.concatenate([batch.kv_lens, rng.integers(0, pps * ps, batch.spare_slots)])
  q = rng.standard_normal((t, batch.n, batch.h))
  k_pages = rng.standard_normal((batch.k, total, ps, batch.h))
  v_pages = rng.standard_normal((batch.k, total, ps, hv))
  if nan_fill:
    read = np.zeros((total, ps), bool)
    for i, kv_len in enumerate(batch.kv_lens):
      rows = np.arange(kv_len)
      read[table[i, rows // ps], rows % ps] = True
    k_pages[:, ~read] = np.nan
    v_pages[:, ~read] = np.nan
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(k_pages, dtype),
    jnp.asarray(v_pages, dtype),
    jnp.asarray(kv_lens, jnp.int32),
    jnp.asarray(table, jnp.int32),
    jnp.asarray(cu, jnp.int32),
    jnp.asarray([used], jnp.int32),
  )
