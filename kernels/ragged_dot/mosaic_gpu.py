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

The weight gradient (tgmm) runs on Pallas-Triton (``supports`` says so).
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
from pallax.executor.config import KernelConfig
from pallax.kernels.ragged_dot.common import WorkList, epilogue, gemm_params, kernel_name
from pallax.kernels.ragged_dot.config import Problem
from pallax.pallas_mosaic_gpu import plgpu

IMPLEMENTATION = "pallas_mosaic_gpu"
_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OUTPUTS = (*_INPUTS, jnp.dtype(jnp.float32))
# Tiles: multiples of 64 (128-byte swizzled rows of 16-bit elements, and one
# warpgroup's wgmma M), at most 256; the float32 accumulators (two for a
# gated weight) at most 128 registers a thread of the warpgroup.
_TILE_QUANTUM, _TILE_MAX, _ACC_MAX = 64, 256, 128 * 128
# The exact GELU's arithmetic on a 128x128 accumulator spills (the matmul's
# measurement); at most 64x128 with it.
_GELU_ACC_MAX = 64 * 128


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedDotConfig(KernelConfig):
  """Tiles of the Mosaic GPU grouped GEMM.

  tile_m: rows of an output tile (each group boundary inside a tile costs a
    tile product); tile_n: its columns (a gated weight's: each half's);
    multiples of 64 up to 256, ``tile_m * tile_n`` (twice, gated) at most
    ``128 * 128``.
  tile_k: the K step of the pipeline (a multiple of 64).
  stages: SMEM slots of the TMA pipeline (at least 2).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  implementation: str = dataclasses.field(default=IMPLEMENTATION, kw_only=True)


CONFIG_CLS = MosaicGpuRaggedDotConfig


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


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
  if stage != "gmm":
    return (
      "the Mosaic GPU kernel computes the grouped GEMM only; the weight gradient (tgmm) runs "
      "on Pallas-Triton"
    )
  p = Problem.of(avals, stage, **params)
  lhs, rhs, out = (jnp.dtype(d) for d in p.dtypes)
  if lhs != rhs or lhs not in _INPUTS:
    return (
      f"the Mosaic GPU grouped GEMM takes lhs and rhs of one 16-bit dtype (bfloat16 or "
      f"float16), got {lhs} and {rhs}"
    )
  if out not in _OUTPUTS:
    return (
      f"the Mosaic GPU grouped GEMM's out_dtype must be bfloat16, float16 or float32, got {out}"
    )
  if min(p.m, p.k, p.n, p.groups) == 0:
    return "an empty dim: nothing for a kernel to do"
  return None


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuRaggedDotConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  reason = call_reason(avals, stage, **params)
  if reason is not None:
    return reason
  p, c = Problem.of(avals, stage, **params), config
  tiles = (c.tile_m, c.tile_n, c.tile_k)
  if any(t % _TILE_QUANTUM for t in tiles) or max(c.tile_m, c.tile_n) > _TILE_MAX:
    return f"tiles {tiles} must be multiples of 64 (tile_m, tile_n at most 256) on Mosaic GPU"
  if c.tile_m * c.tile_n * p.halves > _ACC_MAX:
    return (
      f"{p.halves} float32 accumulator(s) of {c.tile_m}x{c.tile_n} are over the 128 registers "
      "a thread one warpgroup may give them"
    )
  if params.get("activation") == "gelu" and c.tile_m * c.tile_n > _GELU_ACC_MAX:
    return (
      f"the exact GELU on a {c.tile_m}x{c.tile_n} accumulator spills registers on Mosaic GPU "
      f"(at most {_GELU_ACC_MAX} elements)"
    )
  if c.stages < 2:
    return f"stages={c.stages}: the TMA pipeline needs at least 2"
  need = smem_bytes(p, config)
  if need > mgpu.SMEM_BUDGET:
    return f"{config} needs {need} bytes of SMEM, over {mgpu.SMEM_BUDGET}"
  return None


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


def tgmm(*args, **params):
  """Not on Mosaic GPU: ``call_reason`` sends the weight gradient to Pallas-Triton."""
  raise NotImplementedError(f"ragged_dot: {call_reason(args[:2], 'tgmm', **params)}")


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
  step = tile
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
  mp, kp, np_ = _round_up(m, tm), _round_up(k, tk), _round_up(n, tn)
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
    interpret=form.interpret,
  )
  operands = (items, x, w)
  (out,) = kernel(*operands) if form.hopper else mgpu.on_host(kernel, [out_type], *operands)
  return out[:m, :n]
