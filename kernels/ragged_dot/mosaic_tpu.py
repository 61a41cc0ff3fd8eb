"""The grouped matmuls on Pallas-Mosaic TPU: the work list as a grid axis.

The work list (``common.WorkList``, built by XLA once a call) is
scalar-prefetched into SMEM: per item its tile, its group among the held ones
and the rows ``[start, end)`` it computes. Index maps read it, so each grid
step fetches its item's blocks; padding items repeat the last real item's
blocks (nothing new is fetched) and compute nothing.

* ``gmm``: grid ``(N / bn, items, K / bk)``, items by tile (every tile has
  one, a tile meeting no held group a group-less one). The output block is
  the item's tile: consecutive items of a tile keep it in VMEM, each writing
  its group's rows from the float32 accumulator; the tile's first item
  starts it from zeros, so rows of no held group come out 0.
* ``tgmm``: grid ``(K / bk, N / bn, items)``, items by group (every held
  group has one, an empty group's writes zeros). The output block is the
  item's group's ``[bk, bn]``: its items accumulate ``lhs^T @ rhs`` over the
  group's row tiles; the last one writes it.

Rows of other groups are zeroed before each product (rows past ``M`` of an
overhanging tile hold whatever VMEM held: selected away, never multiplied),
and the K tail of the last step in both operands. Blocks overhanging N (or
K in tgmm's output) are clipped when written back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.activations import activate_in_kernel
from pallax.kernels.ragged_dot.common import (
  WorkList,
  acc_dtype,
  epilogue,
  gemm_params,
  kernel_name,
  tile_dot,
)
from pallax.kernels.ragged_dot.config import RaggedDotConfig, tpu_blocks


def _rows_mask(item_ref, shape, tile: int, i) -> jax.Array:
  """Which rows of item ``i``'s tile (a block of ``shape``) belong to its group."""
  tiles_ref, _, starts_ref, ends_ref = item_ref[:4]
  rows = tiles_ref[i] * tile + lax.broadcasted_iota(jnp.int32, shape, 0)
  return (rows >= starts_ref[i]) & (rows < ends_ref[i])


def _zero_tail(x: jax.Array, left, axis: int) -> jax.Array:
  """``x`` with entries at offsets >= ``left`` along ``axis`` (past the end of K) zeroed."""
  return jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, axis) < left, x, 0)


def _prefetch(work: WorkList) -> list[jax.Array]:
  """The scalar-prefetched operands: tiles, local groups, row starts and ends, flags, count."""
  tiles = work.padded_to_last(work.tiles)
  groups = work.padded_to_last(work.slots)
  starts, ends = work.item_rows()
  return [tiles, groups, starts, ends, work.count.reshape(1)]


def _item_key(work_keys: jax.Array) -> jax.Array:
  """Per item 1 where its key (tile or group) differs from the previous item's."""
  return jnp.concatenate(
    [jnp.ones((1,), jnp.int32), (work_keys[1:] != work_keys[:-1]).astype(jnp.int32)]
  )


def gmm(lhs, rhs, group_sizes, group_offset, *, config: RaggedDotConfig, interpret: Any, **params):
  """``[M, N]``: each row of ``lhs`` times its group's ``rhs[g - offset]``, then the epilogue.

  Gated (``rhs [G, K, 2N]``, ``config.supports``: N a multiple of the
  column block): column block ``j`` of each half, ``j`` and ``j + N / bn``
  of ``rhs``, accumulate side by side; ``act(a) * b`` is written.
  """
  out_dtype, precision, activation, gated = gemm_params(params)
  (m, k), (local, _, width) = lhs.shape, rhs.shape
  n = width // 2 if gated else width
  bm, bn, bk = tpu_blocks(config, m, n, k)
  work = WorkList.by_tile(group_sizes, group_offset, m, local, bm)
  prefetch = _prefetch(work)
  fresh = _item_key(prefetch[0])
  steps = pl.cdiv(k, bk)
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  halves = (0, n // bn) if gated else (0,)

  def kernel(*refs):
    item_ref, fresh_ref = refs[:5], refs[5]
    lhs_ref, *w_refs = refs[6 : 7 + len(halves)]
    out_ref, *acc_refs = refs[7 + len(halves) :]
    i, s = pl.program_id(1), pl.program_id(2)
    real = i < item_ref[4][0]

    @pl.when(s == 0)
    def _init():
      for acc_ref in acc_refs:
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(real & (item_ref[3][i] > item_ref[2][i]))
    def _product():
      a = jnp.where(_rows_mask(item_ref, lhs_ref.shape, bm, i), lhs_ref[...], 0)
      if k % bk:
        a = _zero_tail(a, k - s * bk, 1)
      for acc_ref, w_ref in zip(acc_refs, w_refs):
        b = _zero_tail(w_ref[...], k - s * bk, 0) if k % bk else w_ref[...]
        acc_ref[...] += tile_dot(a, b, (1, 0), precision, acc)

    @pl.when(real & (s == steps - 1))
    def _write():
      mine = _rows_mask(item_ref, out_ref.shape, bm, i)
      before = jnp.where(fresh_ref[i] == 1, jnp.zeros_like(out_ref), out_ref[...])
      out = epilogue([r[...] for r in acc_refs], activation, activate_in_kernel)
      out_ref[...] = jnp.where(mine, out.astype(out_ref.dtype), before)

  weight = lambda half: pl.BlockSpec(
    (None, bk, bn), lambda j, i, s, tiles, groups, *_: (groups[i], s, j + half)
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=6,
    grid=(pl.cdiv(n, bn), work.tiles.shape[0], steps),
    in_specs=[
      pl.BlockSpec((bm, bk), lambda j, i, s, tiles, *_: (tiles[i], s)),
      *map(weight, halves),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda j, i, s, tiles, *_: (tiles[i], j)),
    scratch_shapes=[pltpu.VMEM((bm, bn), acc) for _ in halves],
  )
  return pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")
    ),
    interpret=interpret,
    name=kernel_name(params),
  )(*prefetch, fresh, lhs, *[rhs] * len(halves))


def tgmm(lhs, rhs, group_sizes, group_offset, *, config: RaggedDotConfig, interpret: Any, **params):
  """``[groups, K, N]``: per held group ``lhs[rows of g]^T @ rhs[rows of g]``."""
  out_dtype, precision, _, _ = gemm_params(params)
  groups = params["groups"]
  (m, k), n = lhs.shape, rhs.shape[1]
  bm, bn, bk = tpu_blocks(config, m, n, k)
  work = WorkList.by_group(group_sizes, group_offset, m, groups, bm, every_group=True)
  prefetch = _prefetch(work)
  fresh = _item_key(prefetch[1])
  last = jnp.concatenate([fresh[1:], jnp.ones((1,), jnp.int32)])
  last = jnp.where(jnp.arange(last.shape[0]) == work.count - 1, 1, last)
  acc = acc_dtype(lhs.dtype, rhs.dtype)

  def kernel(*refs):
    item_ref, fresh_ref, last_ref = refs[:5], refs[5], refs[6]
    lhs_ref, rhs_ref, out_ref, acc_ref = refs[7:]
    i = pl.program_id(2)
    real = i < item_ref[4][0]

    @pl.when(real & (fresh_ref[i] == 1))
    def _init():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(real & (item_ref[3][i] > item_ref[2][i]))
    def _product():
      a = jnp.where(_rows_mask(item_ref, lhs_ref.shape, bm, i), lhs_ref[...], 0)
      b = jnp.where(_rows_mask(item_ref, rhs_ref.shape, bm, i), rhs_ref[...], 0)
      acc_ref[...] += tile_dot(a, b, (0, 0), precision, acc)

    @pl.when(real & (last_ref[i] == 1))
    def _write():
      out_ref[...] = acc_ref[...].astype(out_ref.dtype)

  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=7,
    grid=(pl.cdiv(k, bk), pl.cdiv(n, bn), work.tiles.shape[0]),
    in_specs=[
      pl.BlockSpec((bm, bk), lambda c, j, i, tiles, *_: (tiles[i], c)),
      pl.BlockSpec((bm, bn), lambda c, j, i, tiles, *_: (tiles[i], j)),
    ],
    out_specs=pl.BlockSpec((None, bk, bn), lambda c, j, i, tiles, groups, *_: (groups[i], c, j)),
    scratch_shapes=[pltpu.VMEM((bk, bn), acc)],
  )
  return pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
    name="ragged_dot_tgmm",
  )(*prefetch, fresh, last, lhs, rhs)
