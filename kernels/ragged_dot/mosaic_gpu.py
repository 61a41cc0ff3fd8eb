"""The grouped GEMM on Pallas Mosaic GPU (Hopper): a work-list grid, TMA pipeline, ``wgmma``.

Grid ``(items, N / tile_n)``, one warpgroup a program: item ``w`` is one
(row tile, group) pair of ``common.WorkList.by_tile`` (a tile that meets no
held group is one group-less item), at most ``tiles + groups - 1`` of them.
A program with a group multiplies its tile's rows by that group's weight
(``plgpu.emit_pipeline`` over K: TMA loads into a ``stages``-deep ring of
swizzled SMEM tiles, an asynchronous ``wgmma`` a step, one in flight),
zeroes the rows of other groups, runs the epilogue (the activation, or
``act(a) * b`` of a gated weight's two halves, accumulated side by side)
and stores its rows.

The items of one tile store disjoint row ranges that cover the tile: each
its group's rows, the first from the tile's top and the last to its bottom
(rows of no held group: zeros). A TMA store has a static shape, so a range
of ``r`` rows leaves SMEM as one copy per set bit of ``r`` (a ladder of
power-of-two row counts, as JAX's ``ragged_dot_mgpu`` stores), and every
output row is written once, by one program: no zero-fill pass, no atomics.
Group-less items store zeros without a product. The extra work is one tile
product per group boundary inside a tile.

The weight gradient (tgmm) has no kernel here: it runs on Pallas-Triton.
Selection: as the Mosaic GPU matmul, the heuristic returns None (the
executor keeps Pallas-Triton on an H100) and these configs are autotuning
candidates: the kernel is checked interpreted and compiled for H100, and
has not run on a GPU yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.activations import activate_in_kernel
from pallax.kernels.ragged_dot.common import WorkList, epilogue, gemm_params, kernel_name
from pallax.kernels.ragged_dot.config import Problem
from pallax.pallas_mosaic_gpu import plgpu

IMPLEMENTATION = mgpu.IMPLEMENTATION


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDotConfig(mgpu.GemmTiles):
  """Tiles of the Mosaic GPU grouped GEMM (``pallas_mosaic_gpu.GemmTiles``).

  Each group boundary inside a ``tile_m``-row tile costs a tile product; a
  gated weight's ``tile_n`` columns are each half's (two accumulators).
  """


CONFIG_CLS = MosaicGpuRaggedDotConfig


def smem_bytes(p: Problem, config: MosaicGpuRaggedDotConfig) -> int:
  """SMEM of one program: the pipeline's ring (the rows and each weight half) and the out tile."""
  c = config
  return mgpu.smem_bytes(
    ((c.stages, c.tile_m, c.tile_k), p.dtypes[0]),
    ((c.stages * p.halves, c.tile_k, c.tile_n), p.dtypes[1]),
    ((c.tile_m, c.tile_n), p.dtypes[2]),
  )


def call_reason(avals: Sequence[Any], stage: str, **params) -> Optional[str]:
  """Why the kernel cannot run this call whatever its tiles, if it cannot."""
  p = Problem.of(avals, stage, **params)
  operands = {"lhs": p.dtypes[0], "rhs": p.dtypes[1]}
  reason = mgpu.gemm_dtypes_reason("grouped GEMM", operands, {"out_dtype": p.dtypes[2]})
  if reason is None and min(p.m, p.k, p.n, p.groups) == 0:
    return "an empty dim: nothing for a kernel to do"
  return reason


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuRaggedDotConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  reason = call_reason(avals, stage, **params)
  if reason is not None:
    return reason
  p = Problem.of(avals, stage, **params)
  return mgpu.gemm_tiles_reason(
    config, smem_bytes(p, config), accumulators=p.halves, activation=params.get("activation")
  )


def heuristic_config(p: Problem) -> MosaicGpuRaggedDotConfig:
  """128x128 tiles (64 wide per half for a gated weight), 64 rows for small groups."""
  rows = 128 if p.m >= 128 * max(p.groups, 1) else 64
  return MosaicGpuRaggedDotConfig(tile_m=rows, tile_n=128 // p.halves if rows == 128 else 128)


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params) -> None:
  """None: the executor keeps Pallas-Triton; these configs are autotuning candidates.

  Why: the module's docstring (not yet measured on a GPU).
  """
  return None


# The autotuning space: (tile_m, tile_n, stages), tile_k 64.
_SPACE = ((128, 128, 4), (128, 64, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3), (64, 64, 4))


def candidates(
  avals: Sequence[Any], target: str, *, stage: str, **params
) -> list[MosaicGpuRaggedDotConfig]:
  """``heuristic_config``'s tiles, then the space's, each legal for the call."""
  if call_reason(avals, stage, **params) is not None:
    return []
  p = Problem.of(avals, stage, **params)
  out = [heuristic_config(p)]
  out += [MosaicGpuRaggedDotConfig(tile_m=tm, tile_n=tn, stages=s) for tm, tn, s in _SPACE]
  return [
    c for c in dict.fromkeys(out) if supports(avals, target, c, stage=stage, **params) is None
  ]


def _items(work: WorkList, tile: int) -> jax.Array:
  """``[6, items]`` int32 per item: tile, group, its group's rows and the rows it stores.

  Rows as ``[start, end)`` of the padded rows: the group's within the tile
  (empty for a group-less item), and the item's share of the tile (the
  first item of a tile from its top, the last to its bottom; none for
  padding items).
  """
  count = work.tiles.shape[0]
  index = jnp.arange(count, dtype=jnp.int32)
  real = index < work.count
  top = work.tiles * tile
  g_lo, g_hi = work.item_rows()
  g_lo, g_hi = (jnp.clip(r, top, top + tile) for r in (g_lo, g_hi))
  g_hi = jnp.where(work.held, g_hi, g_lo)
  before = jnp.concatenate([jnp.full((1,), -1, jnp.int32), work.tiles[:-1]])
  after = jnp.concatenate([work.tiles[1:], jnp.full((1,), -1, jnp.int32)])
  first = real & (work.tiles != before)
  last = real & ((index == work.count - 1) | (work.tiles != after))
  lo = jnp.where(first, top, jnp.where(work.held, g_lo, top))
  hi = jnp.where(last, top + tile, jnp.where(work.held, g_hi, top))
  lo, hi = jnp.where(real, lo, 0), jnp.where(real, hi, 0)
  return jnp.stack([work.tiles, work.slots, g_lo, g_hi, lo, hi]).astype(jnp.int32)


def _store_rows(out_smem, out_ref, top, lo, hi, cols, tile: int) -> None:
  """Rows ``[lo, hi)`` of the tile from row ``top``: one TMA copy per set bit of ``hi - lo``."""
  count, offset = hi - lo, lo - top
  step = 1 << (tile.bit_length() - 1)  # tile may be no power of two (192 = 128 + 64)
  while step:
    size = step

    @pl.when(count & size != 0)
    def _(offset=offset, size=size):
      rows = pl.ds(offset, size)
      plgpu.copy_smem_to_gmem(out_smem.at[rows], out_ref.at[pl.ds(top + offset, size), cols])

    offset = offset + (count & size)
    step //= 2
  plgpu.wait_smem_to_gmem(0)


def gmm(
  lhs, rhs, group_sizes, group_offset, *, config: MosaicGpuRaggedDotConfig, interpret: Any, **params
):
  """``[M, N]``: each row of ``lhs`` times its group's ``rhs[g - offset]``, then the epilogue."""
  out_dtype, _, activation, gated = gemm_params(params)
  reason = call_reason([lhs, rhs], "gmm", **params)
  if reason is not None:
    raise NotImplementedError(f"ragged_dot: {reason}")
  (m, k), (local, _, width) = lhs.shape, rhs.shape
  halves = 2 if gated else 1
  n = width // halves
  tm, tn, tk, stages = config.tile_m, config.tile_n, config.tile_k, config.stages
  mp, kp, np_ = mgpu.round_up(m, tm), mgpu.round_up(k, tk), mgpu.round_up(n, tn)
  form = mgpu.Form.of(interpret)
  x = jnp.pad(lhs, ((0, mp - m), (0, kp - k)))
  parts = jnp.split(rhs, halves, axis=-1)
  w = jnp.concatenate([jnp.pad(h, ((0, 0), (0, kp - k), (0, np_ - n))) for h in parts], -1)
  work = WorkList.by_tile(group_sizes, group_offset, m, local, tm)
  items = _items(work, tm)
  swizzled = mgpu.swizzle_transforms(lhs.dtype)
  column_blocks = np_ // tn

  def body(items_ref, x_ref, w_ref, out_ref):
    i, j = lax.axis_index("item"), lax.axis_index("n")
    tile, group, g_lo, g_hi, lo, hi = (items_ref[r, i] for r in range(6))
    top, cols = tile * tm, pl.ds(j * tn, tn)

    def finish(out_smem, value):
      out_smem[...] = value.astype(out_dtype)
      plgpu.commit_smem()
      _store_rows(out_smem, out_ref, top, lo, hi, cols, tm)

    def product(out_smem, accs):
      def step(_, x_smem, *w_smem):
        for acc, half in zip(accs, w_smem):
          plgpu.wgmma(acc, x_smem, half)
        plgpu.wgmma_wait(halves)  # one step's products in flight: the last slot is free

      specs = [plgpu.BlockSpec((tm, tk), lambda s: (tile, s), transforms=swizzled, delay_release=1)]
      specs += [
        plgpu.BlockSpec(
          (tk, tn), lambda s, h=h: (s, j + h * column_blocks), transforms=swizzled, delay_release=1
        )
        for h in range(halves)
      ]
      plgpu.emit_pipeline(step, grid=(kp // tk,), in_specs=specs, max_concurrent_steps=stages)(
        x_ref, *[w_ref.at[group]] * halves
      )
      plgpu.wgmma_wait(0)
      rows = top + form.iota((tm, tn), 0)
      mine = (rows >= g_lo) & (rows < g_hi)
      value = epilogue([acc[...] for acc in accs], activation, activate_in_kernel)
      finish(out_smem, jnp.where(mine, value, 0))

    def tiles(out_smem):
      @pl.when(g_hi > g_lo)
      def _():
        accs = [plgpu.ACC((tm, tn), jnp.float32)] * halves
        pl.run_scoped(lambda *refs: product(out_smem, refs), *accs)

      @pl.when((g_hi <= g_lo) & (hi > lo))
      def _():
        finish(out_smem, jnp.zeros((tm, tn), jnp.float32))

    pl.run_scoped(tiles, plgpu.SMEM((tm, tn), out_dtype))

  body.__name__ = body.__qualname__ = kernel_name(params)
  out_type = jax.ShapeDtypeStruct((mp, np_), out_dtype)
  kernel = plgpu.kernel(
    body,
    out_type=(out_type,),
    grid=(items.shape[1], column_blocks),
    grid_names=("item", "n"),
    compiler_params=mgpu.compiler_params(approx_math=False),
    interpret=form.interpret,
  )
  operands = (items, x, w)
  (out,) = kernel(*operands) if form.hopper else mgpu.on_host(kernel, [out_type], *operands)
  return out[:m, :n]
