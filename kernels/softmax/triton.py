"""The softmax kernels on Pallas-Triton.

One program per row block loops over the row's column blocks twice (a single
load when the row is one block). Loads and stores are masked by hand:
Pallas-Triton does not bound-check blocks that overhang the array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.kernels.softmax.config import SoftmaxConfig
from pallax.kernels.softmax.programs import RowProgram, run_rows
from pallax.pallas_utils import (
  RowBlocks,
  and_masks,
  load,
  stat_dtype,
  store,
  triton_compiler_params,
)


def _call(
  program: RowProgram, data, mask, out_dtype, lay: RowBlocks, config: SoftmaxConfig, interpret
):
  """One program per row block, looping over the row's column blocks."""
  st = stat_dtype(data[0].dtype)
  # The block spans every column block of the row (it overhangs the array when
  # cols is not a multiple of block_cols); the kernel slices it block by block.
  spec = pl.BlockSpec((lay.block_rows, lay.col_blocks * lay.block_cols), lambda i: (i, 0))

  def kernel(*refs):
    *data_refs, out_ref = refs
    mask_ref = data_refs.pop() if mask is not None else None
    rows_ok = lay.rows_in_bounds(pl.program_id(0))

    def load_cols(j):
      """Column block ``j``: data blocks, kept entries, mask block, index, bounds."""
      cols_ok = lay.cols_in_bounds(j)
      bounds = and_masks(rows_ok, cols_ok)
      idx = (slice(None), pl.ds(j * lay.block_cols, lay.block_cols))
      read = lambda ref: load(ref.at[idx], bounds)
      blocks = [read(ref).astype(st) for ref in data_refs]
      user = None if mask_ref is None else read(mask_ref) != 0
      return blocks, and_masks(cols_ok, user), user, idx, bounds

    def emit(acc, loaded):
      blocks, _, user, idx, bounds = loaded
      out = program.emit(acc, blocks, user).astype(out_dtype)
      store(out_ref.at[idx], out, bounds)

    init = tuple(jnp.full((lay.block_rows, 1), v, st) for v in program.init)
    if lay.col_blocks == 1:  # the row is one block: load it once
      loaded = load_cols(0)
      emit(program.accumulate(init, *loaded[:2]), loaded)
      return
    acc = lax.fori_loop(
      0, lay.col_blocks, lambda j, acc: program.accumulate(acc, *load_cols(j)[:2]), init
    )

    def emit_block(j, carry):
      emit(acc, load_cols(j))
      return carry

    lax.fori_loop(0, lay.col_blocks, emit_block, 0)

  return pl.pallas_call(
    kernel,
    grid=(lay.row_blocks,),
    in_specs=[spec] * (len(data) + (mask is not None)),
    out_specs=spec,
    out_shape=jax.ShapeDtypeStruct((lay.rows, lay.cols), out_dtype),
    compiler_params=triton_compiler_params(config),
    interpret=interpret,
    name=program.name,
  )(*data, *([] if mask is None else [mask]))


run = functools.partial(run_rows, _call, backend="triton")
