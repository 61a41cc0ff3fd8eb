"""What the grouped matmuls' programs share: each group's rows, and the work lists.

A work list pairs row tiles with the groups meeting them, sorted by row (the
rows are sorted by group), padded to a static length: at most ``tiles +
groups - 1`` items, since neighbouring groups share at most one tile. The
XLA programs loop over its real items; the Mosaic TPU kernels make it a grid
axis (scalar-prefetched), so consecutive items of one output block accumulate
into it while it stays in VMEM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


def acc_dtype(*dtypes) -> jnp.dtype:
  """float32 accumulation (float64 for float64 inputs)."""
  return jnp.promote_types(jnp.float32, jnp.result_type(*dtypes))


def tile_dot(a, b, contract: tuple[int, int], precision, dtype) -> jax.Array:
  """One product contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``.

  In the operands' promoted dtype (a cotangent may be wider than the
  primal), accumulated in ``dtype``.
  """
  compute = jnp.promote_types(a.dtype, b.dtype)
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(
    a.astype(compute), b.astype(compute), dims, precision=precision, preferred_element_type=dtype
  )


def gemm_params(params: dict) -> tuple:
  """A kernel call's ``(out_dtype, precision, activation, gated)``: the op's params it reads."""
  return params["out_dtype"], params.get("precision"), params.get("activation"), params.get("gated")


def kernel_name(params: dict) -> str:
  """The ``pallas_call`` name of a grouped GEMM: the primitive's, with or without an epilogue."""
  return "ragged_dot_epilogue" if params.get("activation") or params.get("gated") else "ragged_dot"


def epilogue(products, activation, act) -> jax.Array:
  """The grouped GEMM's epilogue of its float32 product(s): ``act(h)``, or ``act(a) * b`` gated.

  ``products``: ``[h]``, or ``[a, b]`` (the two halves of a gated weight);
  ``act(activation, z)``: ``pallax.activations.activate`` or its kernel
  form. Every activation there vanishes at 0, so rows of no group (zero
  products) stay 0 and outputs of sharded groups still sum.
  """
  out = act(activation, products[0])
  return out * products[1] if len(products) == 2 else out


def zero_like(index):
  """0 of ``index``'s integer type (``dynamic_slice`` wants one type; no array at import)."""
  return jnp.zeros((), index.dtype)


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """Per group its rows ``[start, end)`` among ``m`` (negative sizes count as 0)."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes)
  return jnp.minimum(ends - sizes, m), jnp.minimum(ends, m)


def shard_group_sizes(group_sizes: jax.Array, first_row, rows: int) -> jax.Array:
  """The group sizes of the sorted rows ``[first_row, first_row + rows)`` (one shard's)."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes, axis=-1) - first_row
  return jnp.clip(ends, 0, rows) - jnp.clip(ends - sizes, 0, rows)


def held_bounds(
  group_sizes: jax.Array, group_offset: jax.Array, m: int, local: int
) -> tuple[jax.Array, jax.Array]:
  """Per held group (the ``local`` from ``group_offset[0]``) its rows ``[start, end)`` among ``m``.

  A held index outside ``group_sizes`` (the offset past its ends) is an
  empty group, placed where the rows' order keeps the ends sorted.
  """
  starts, ends = group_bounds(group_sizes, m)
  index = group_offset.astype(jnp.int32)[0] + jnp.arange(local, dtype=jnp.int32)
  clipped = jnp.clip(index, 0, starts.shape[0] - 1)
  inside = (index >= 0) & (index < starts.shape[0])
  past = jnp.where(index < 0, 0, ends[-1])
  return jnp.where(inside, starts[clipped], past), jnp.where(inside, ends[clipped], past)


def tile_groups(ends: jax.Array, m: int, tile: int) -> tuple[jax.Array, jax.Array]:
  """Per tile of ``tile`` rows the first and last held group meeting it (last < first: none).

  ``ends``: the held groups' (``held_bounds``). The groups in between may be
  empty; rows past the last group meet none.
  """
  starts = jnp.arange(-(-m // tile), dtype=jnp.int32) * tile
  last_rows = jnp.minimum(starts + tile, m) - 1
  lo = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
  hi = jnp.searchsorted(ends, last_rows, side="right").astype(jnp.int32)
  return lo, jnp.minimum(hi, ends.shape[0] - 1)


def _spread(counts: jax.Array, items: int) -> tuple[jax.Array, jax.Array]:
  """Per item of a static ``items`` its owner (index into ``counts``) and rank among its peers."""
  cum = jnp.cumsum(counts)
  i = jnp.arange(items, dtype=jnp.int32)
  owner = jnp.minimum(jnp.searchsorted(cum, i, side="right"), counts.shape[0] - 1)
  owner = owner.astype(jnp.int32)
  return owner, i - (cum - counts)[owner]


@dataclasses.dataclass(frozen=True)
class WorkList:
  """The (tile, held group) items of one call, padded to a static length.

  Attributes:
    tile: rows a tile.
    tiles, slots: per item its tile index and its group among the held ones
      (``rhs``'s index; clipped to them for a group-less item); entries from
      ``count`` on are padding.
    count: the items in the list (a traced int32).
    starts, ends: per held group its rows ``[start, end)`` (``held_bounds``).
    held: per item whether it is real and has a group.
  """

  tile: int
  tiles: jax.Array
  slots: jax.Array
  count: jax.Array
  starts: jax.Array
  ends: jax.Array
  held: jax.Array

  @classmethod
  def by_group(
    cls, group_sizes, group_offset, m: int, local: int, tile: int, every_group: bool = False
  ) -> WorkList:
    """Per held group the tiles its rows meet, none for an empty group.

    ``every_group``: an empty held group gets one item too (a kernel whose
    output blocks are the groups' must visit each of them).
    """
    starts, ends = held_bounds(group_sizes, group_offset, m, local)
    tiles = -(-m // tile)
    first, last = jnp.minimum(starts // tile, tiles - 1), (ends - 1) // tile
    count = jnp.where(ends > starts, last - first + 1, jnp.int32(every_group))
    items = max(tiles + local - 1, 1)
    slot, rank = _spread(count, items)
    real = jnp.arange(items) < jnp.sum(count)
    return cls(tile, first[slot] + rank, slot, jnp.sum(count), starts, ends, real)

  @classmethod
  def by_tile(cls, group_sizes, group_offset, m: int, local: int, tile: int) -> WorkList:
    """Per tile the held groups meeting it, one item (group-less) for a tile that meets none.

    For a kernel whose output blocks are the tiles: it visits each of them.
    """
    starts, ends = held_bounds(group_sizes, group_offset, m, local)
    lo, hi = tile_groups(ends, m, tile)
    count = jnp.maximum(hi - lo + 1, 1)
    items = max(lo.shape[0] + local - 1, 1)
    tile_index, rank = _spread(count, items)
    slot = lo[tile_index] + rank
    held = (jnp.arange(items) < jnp.sum(count)) & (slot <= hi[tile_index])
    slot = jnp.clip(slot, 0, local - 1)
    return cls(tile, tile_index, slot, jnp.sum(count), starts, ends, held)

  def rows(self, x: jax.Array, i) -> tuple[jax.Array, jax.Array]:
    """Item ``i``'s first row and its tile of ``x``, the rows of other groups zeroed."""
    g, start = self.slots[i], self.tiles[i] * self.tile
    rows = start + lax.iota(jnp.int32, self.tile)
    mine = (rows >= self.starts[g]) & (rows < self.ends[g])
    return start, jnp.where(mine[:, None], self.tile_of(x, start), 0)

  def tile_of(self, x: jax.Array, start) -> jax.Array:
    """The tile of ``x``'s (padded) rows from ``start``."""
    return lax.dynamic_slice(x, (start, zero_like(start)), (self.tile, x.shape[1]))

  def item_rows(self) -> tuple[jax.Array, jax.Array]:
    """Per item the rows ``[start, end)`` it computes: its group's, none where not ``held``."""
    start = jnp.where(self.held, self.starts[self.slots], 0)
    return start, jnp.where(self.held, self.ends[self.slots], 0)

  def padded_to_last(self, keys: jax.Array) -> jax.Array:
    """``keys`` per item, the padding's the last real item's (a grid step that fetches nothing)."""
    last = jnp.maximum(self.count - 1, 0)
    return jnp.where(jnp.arange(keys.shape[0]) < self.count, keys, keys[last])
