"""What every paged-attention implementation shares: the call's static facts and the maths.

The primitive's operands (``primitives/paged_attention.py`` builds them):

* ``q (B, K, G, H)``: the query heads of one decode step, grouped by the kv
  head they read (``N = K * G``; query head ``n`` is ``(n // G, n % G)``);
* ``k_pages (K, P, page_size, H)``, ``v_pages (K, P, page_size, Hv)``: the
  page pool;
* ``lengths (B,)`` int32, in ``[0, pages_per_sequence * page_size]``;
* ``page_indices (B, pages_per_sequence)`` int32, in ``[0, P)``: token ``s``
  of sequence ``b`` is row ``s % page_size`` of page
  ``page_indices[b, s // page_size]``.

The result is ``out (B, K, G, Hv)`` in the query's dtype; a sequence of
length 0 gives 0. Logits are ``soft_cap(scale * q k^T)`` in float32 (float64
for float64 inputs), their softmax is online (``kernels/attention/common.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp

from pallax.kernels.attention.common import NEG_INF, soft_cap
from pallax.pallas_utils import stat_dtype


@dataclasses.dataclass(frozen=True)
class PagedFacts:
  """The static facts every op over a paged cache has: heads, pools, table, dtype, logits.

  Each op's ``Problem`` adds its own (the batch, the tokens, a window).
  """

  kv_heads: int
  groups: int
  head_dim: int
  value_dim: int
  total_pages: int
  page_size: int
  pages_per_sequence: int
  dtype: Any
  scale: float
  soft_cap: Optional[float]

  @property
  def stat(self) -> jnp.dtype:
    """Dtype of logits, softmax statistics and accumulators."""
    return stat_dtype(self.dtype)

  @property
  def max_len(self) -> int:
    """The longest sequence the page table holds."""
    return self.pages_per_sequence * self.page_size

  @staticmethod
  def cache_fields(q, k_pages, v_pages, page_indices, scale, soft_cap) -> dict[str, Any]:
    """The fields read off ``q (rows, K, G, H)``, the pools, the page table and the logits."""
    _, kv_heads, groups, head_dim = q.shape
    return dict(
      kv_heads=kv_heads,
      groups=groups,
      head_dim=head_dim,
      value_dim=v_pages.shape[3],
      total_pages=k_pages.shape[1],
      page_size=k_pages.shape[2],
      pages_per_sequence=page_indices.shape[1],
      dtype=q.dtype,
      scale=scale,
      soft_cap=soft_cap,
    )


@dataclasses.dataclass(frozen=True)
class Problem(PagedFacts):
  """The static facts of one paged-attention call."""

  batch: int

  @classmethod
  def of(cls, avals: Sequence[Any], *, scale: float, logits_soft_cap=None, **_) -> Problem:
    q, k, v, _, table = avals[:5]
    return cls(batch=q.shape[0], **cls.cache_fields(q, k, v, table, scale, logits_soft_cap))


def logits(p: Problem, dot, q, k, keep):
  """``soft_cap(scale * q k^T)`` in the stats dtype, -inf where ``keep`` is False."""
  s = soft_cap(dot(q, k, "qk") * p.scale, p.soft_cap)
  return jnp.where(keep, s, NEG_INF)


def combine_splits(m, denom, acc, dtype) -> tuple[jax.Array, jax.Array]:
  """``(out, lse)`` from per-split softmax partials (flash-decoding's reduction).

  ``m``, ``denom``: ``(..., splits, rows)`` running max and sum of each split
  (``-inf`` and 0 for a split that saw no key); ``acc``: ``(..., splits, rows,
  width)`` the unnormalised outputs. ``out`` in ``dtype``, ``lse`` in the
  stats'; rows no split saw give 0 and ``-inf``.
  """
  top = jnp.max(m, axis=-2, keepdims=True)
  top = jnp.where(top == NEG_INF, 0.0, top)
  w = jnp.exp(m - top)  # 0 for empty splits
  denom = jnp.sum(w * denom, axis=-2)
  acc = jnp.sum(w[..., None] * acc, axis=-3)
  empty = denom == 0.0
  out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, denom)[..., None])
  lse = jnp.where(empty, NEG_INF, top[..., 0, :] + jnp.log(jnp.where(empty, 1.0, denom)))
  return out.astype(dtype), lse
