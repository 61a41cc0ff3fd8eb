"""The grouped matmuls as XLA programs: a sorted-tile work list, no G-fold work.

``lax.ragged_dot`` on CPU and GPU expands to a masked dense product over
every group, G times the FLOPs. Here the rows, sorted by group, are cut into
tiles of ``tile`` rows; the work list holds one item per (tile, group) pair
that meet, at most ``tiles + groups - 1`` of them (neighbouring groups share
at most one tile). One ``fori_loop`` walks it: each item multiplies its
tile's rows of its group (the others masked to zero) by the group's weight
and adds the product into its tile of a float32 accumulator. A tile's row
belongs to one group, so each output row gets one product and zeros: exact.

Two programs, the forward and the weight gradient:

* ``gmm(lhs [M, K], rhs [G, K, N])``: ``out[rows of g] = lhs[rows of g] @ rhs[g]``;
* ``tgmm(lhs [M, K], rhs [M, N])``: ``out[g] = lhs[rows of g]^T @ rhs[rows of g]``
  (the ragged-contracting product, ``[G, K, N]``).

``group_sizes [Gt]`` may list more groups than ``rhs`` (``gmm``) or the
result (``tgmm``) holds: ``group_offset [1]`` is the first group of those
(expert parallelism: a device holds groups ``[offset, offset + G)``). Rows of
other groups, and rows past ``sum(group_sizes)``, give zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def acc_dtype(*dtypes) -> jnp.dtype:
  """float32 accumulation (float64 for float64 inputs)."""
  return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


def row_tile(m: int, groups: int) -> int:
  """Rows a tile: 512, or the power of two covering a group's mean rows, at least 32.

  Each group boundary inside a tile computes that tile twice, so the extra
  work is at most ``(groups - 1) * tile`` rows; smaller tiles bound it
  tighter but cost more per row (measured on a CPU at M=8192, K=1024,
  N=2048, G=8: 512-row tiles 1.03x a dense GEMM's time with even groups and
  1.17x with halving ones, 64-row tiles 1.26x and 1.37x).
  """
  mean = max(-(-m // max(groups, 1)), 1)
  return min(512, max(32, 1 << (mean - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class WorkList:
  """The (tile, group) items of one call, padded to a static length.

  Attributes:
    tile: rows a tile.
    tiles, groups: per item its tile index and its group (among all
      ``group_sizes``); entries from ``count`` on are padding.
    count: the items in the list (a traced int32): the loops run that many,
      not the static bound (an empty item would cost a whole tile's GEMM).
    starts, ends: per group its rows ``[start, end)`` (clipped to ``m``).
  """

  tile: int
  tiles: jax.Array
  groups: jax.Array
  count: jax.Array
  starts: jax.Array
  ends: jax.Array

  @classmethod
  def of(cls, group_sizes, group_offset, m: int, local: int, tile: int) -> WorkList:
    """The items of the ``local`` groups from ``group_offset[0]`` over ``m`` rows."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.cumsum(sizes)
    starts, ends = jnp.minimum(ends - sizes, m), jnp.minimum(ends, m)
    index = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    offset = group_offset.astype(jnp.int32)[0]
    mine = (index >= offset) & (index < offset + local) & (ends > starts)
    first, last = starts // tile, (ends - 1) // tile
    count = jnp.where(mine, last - first + 1, 0)
    cum = jnp.cumsum(count)
    items = max(-(-m // tile) + local - 1, 1)
    i = jnp.arange(items, dtype=jnp.int32)
    group = jnp.searchsorted(cum, i, side="right").astype(jnp.int32)
    group = jnp.minimum(group, sizes.shape[0] - 1)
    tiles = first[group] + i - (cum - count)[group]
    return cls(tile, tiles, group, cum[-1], starts, ends)

  def rows(self, x: jax.Array, i) -> tuple[jax.Array, jax.Array]:
    """Item ``i``'s first row and its tile of ``x``, the rows of other groups zeroed."""
    g, start = self.groups[i], self.tiles[i] * self.tile
    rows = start + lax.iota(jnp.int32, self.tile)
    mine = (rows >= self.starts[g]) & (rows < self.ends[g])
    return start, jnp.where(mine[:, None], self.tile_of(x, start), 0)

  def tile_of(self, x: jax.Array, start) -> jax.Array:
    """The tile of ``x``'s (padded) rows from ``start``."""
    return lax.dynamic_slice(x, (start, _zero(start)), (self.tile, x.shape[1]))


def _zero(index):
  """0 of ``index``'s integer type (``dynamic_slice`` wants one type; no array at import)."""
  return jnp.zeros((), index.dtype)


def _padded_rows(x: jax.Array, tile: int) -> jax.Array:
  pad = -x.shape[0] % tile
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def _dot(a, b, contract: tuple[int, int], precision, dtype) -> jax.Array:
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=dtype)


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  out_dtype: Any,
  precision: Any = None,
) -> jax.Array:
  """``[M, N]``: each row of ``lhs`` times its group's ``rhs[g - offset]`` (``[G, K, N]``)."""
  m, k = lhs.shape
  local, _, n = rhs.shape
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  work = WorkList.of(group_sizes, group_offset, m, local, row_tile(m, local))
  x = _padded_rows(lhs, work.tile)
  offset = group_offset.astype(jnp.int32)[0]

  def item(i, out):
    start, rows = work.rows(x, i)
    w = lax.dynamic_index_in_dim(rhs, work.groups[i] - offset, 0, keepdims=False)
    product = _dot(rows, w, (1, 0), precision, acc)
    return lax.dynamic_update_slice(out, work.tile_of(out, start) + product, (start, _zero(start)))

  out = lax.fori_loop(0, work.count, item, jnp.zeros((x.shape[0], n), acc))
  return out[:m].astype(out_dtype)


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  groups: int,
  out_dtype: Any,
  precision: Any = None,
) -> jax.Array:
  """``[groups, K, N]``: per group ``g - offset``, ``lhs[rows of g]^T @ rhs[rows of g]``."""
  m, k = lhs.shape
  n = rhs.shape[1]
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  work = WorkList.of(group_sizes, group_offset, m, groups, row_tile(m, groups))
  x, y = _padded_rows(lhs, work.tile), _padded_rows(rhs, work.tile)
  offset = group_offset.astype(jnp.int32)[0]

  def item(i, out):
    start, rows = work.rows(x, i)
    product = _dot(rows, work.tile_of(y, start), (0, 0), precision, acc)
    g = jnp.clip(work.groups[i] - offset, 0, groups - 1)
    return out.at[g].add(product)

  out = lax.fori_loop(0, work.count, item, jnp.zeros((groups, k, n), acc))
  return out.astype(out_dtype)
