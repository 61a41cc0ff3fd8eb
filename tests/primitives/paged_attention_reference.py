"""The float64 reference of paged_attention and random paged KV caches, shared by its tests.

The reference gathers each sequence's pages in NumPy (only up to its length)
and runs a dense float64 softmax per query head; it shares no code with
pallax.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from tests.helpers import f64


def reference(q, k_pages, v_pages, lengths, page_indices, *, scale=None, logits_soft_cap=None):
  """``(B, N, Hv)`` float64: dense attention of each query over its gathered pages."""
  q, k_pages, v_pages = f64(q), f64(k_pages), f64(v_pages)
  lengths, table = np.asarray(lengths), np.asarray(page_indices)
  b, n, h = q.shape
  kv_heads, _, page_size, hv = v_pages.shape
  g = n // kv_heads
  scale = 1 / np.sqrt(h) if scale is None else scale
  out = np.zeros((b, n, hv))
  for i in range(b):
    length = int(lengths[i])
    if length == 0:
      continue
    pages = table[i, : -(-length // page_size)]
    k = k_pages[:, pages].reshape(kv_heads, -1, h)[:, :length]
    v = v_pages[:, pages].reshape(kv_heads, -1, hv)[:, :length]
    s = np.einsum("kgh,klh->kgl", q[i].reshape(kv_heads, g, h), k) * scale
    if logits_soft_cap is not None:
      s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out[i] = np.einsum("kgl,klh->kgh", w, v).reshape(n, hv)
  return out


@dataclasses.dataclass(frozen=True)
class Case:
  """A random paged KV cache and the queries of one decode step.

  lengths: per sequence; None: 0, 1, page_size - 1, page_size, page_size + 1
  and the full table (B = 6). table: ``"perm"`` (every sequence its own pages,
  a random permutation of the pool) or ``"shared"`` (drawn with replacement:
  sequences share pages, and a sequence may repeat one).
  """

  n: int = 4
  k: int = 2
  h: int = 32
  hv: Optional[int] = None
  page_size: int = 4
  pages_per_sequence: int = 5
  spare_pages: int = 3
  lengths: Optional[tuple[int, ...]] = None
  table: str = "perm"

  def lengths_(self) -> np.ndarray:
    ps, full = self.page_size, self.page_size * self.pages_per_sequence
    if self.lengths is not None:
      return np.asarray(self.lengths, np.int32)
    return np.asarray([0, 1, ps - 1, ps, ps + 1, full], np.int32)


def inputs(case: Case, dtype=jnp.float32, seed: int = 0, nan_fill: bool = True):
  """``(q, k_pages, v_pages, lengths, page_indices)`` of ``case``.

  With ``nan_fill``, every pool row that no sequence reads below its length
  is NaN (pages no table entry names, rows past a length in a sequence's last
  page), so an implementation that lets one into its result fails.
  """
  rng = np.random.default_rng(seed)
  lengths = case.lengths_()
  b, pps, ps = len(lengths), case.pages_per_sequence, case.page_size
  total = b * pps + case.spare_pages
  if case.table == "perm":
    table = rng.permutation(total)[: b * pps].reshape(b, pps)
  else:
    table = rng.integers(0, total, (b, pps))
  table = table.astype(np.int32)
  hv = case.hv or case.h
  q = rng.standard_normal((b, case.n, case.h))
  k = rng.standard_normal((case.k, total, ps, case.h))
  v = rng.standard_normal((case.k, total, ps, hv))
  if nan_fill:
    used = np.zeros((total, ps), bool)
    for i in range(b):
      for s in range(int(lengths[i])):
        used[table[i, s // ps], s % ps] = True
    k[:, ~used], v[:, ~used] = np.nan, np.nan
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), jnp.asarray(lengths), jnp.asarray(table)
