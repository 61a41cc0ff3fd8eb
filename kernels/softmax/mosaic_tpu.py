"""The softmax kernels on Pallas-Mosaic TPU.

The grid is ``(row blocks, phase, column blocks)``, the last two axes
sequential ("arbitrary"), with the accumulators in VMEM scratch. A row that is
one block is fetched once: its block index does not change between the phases.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.softmax.config import SoftmaxConfig
from pallax.kernels.softmax.programs import RowProgram, run_rows
from pallax.pallas_utils import RowBlocks, and_masks, stat_dtype


def _call(
  program: RowProgram, data, mask, out_dtype, lay: RowBlocks, config: SoftmaxConfig, interpret
):
  """Grid (row blocks, phase, column blocks): phase 0 reduces, phase 1 writes."""
  st = stat_dtype(data[0].dtype)
  in_spec = pl.BlockSpec(lay.block, lambda i, p, j: (i, j))
  # Phase 0 parks on the row's first output block without writing it; it is
  # written in phase 1 before the index first moves on, so nothing unwritten
  # is ever copied back.
  out_spec = pl.BlockSpec(lay.block, lambda i, p, j: (i, j * p))

  def kernel(*refs):
    n = len(data) + (mask is not None)
    in_refs, out_ref, acc_refs = refs[:n], refs[n], refs[n + 1 :]
    data_refs = in_refs[: len(data)]
    phase, j = pl.program_id(1), pl.program_id(2)

    def load_cols():
      blocks = [ref[...].astype(st) for ref in data_refs]
      user = None if mask is None else in_refs[-1][...].astype(jnp.int32) != 0
      return blocks, and_masks(lay.cols_in_bounds(j), user), user

    @pl.when((phase == 0) & (j == 0))
    def _init():
      for ref, value in zip(acc_refs, program.init):
        ref[...] = jnp.full(ref.shape, value, st)

    @pl.when(phase == 0)
    def _reduce():
      blocks, keep, _ = load_cols()
      acc = program.accumulate(tuple(ref[...] for ref in acc_refs), blocks, keep)
      for ref, value in zip(acc_refs, acc):
        ref[...] = value

    @pl.when(phase == 1)
    def _emit():
      blocks, _, user = load_cols()
      acc = tuple(ref[...] for ref in acc_refs)
      out_ref[...] = program.emit(acc, blocks, user).astype(out_ref.dtype)

  return pl.pallas_call(
    kernel,
    grid=(lay.row_blocks, 2, lay.col_blocks),
    in_specs=[in_spec] * (len(data) + (mask is not None)),
    out_specs=out_spec,
    out_shape=jax.ShapeDtypeStruct((lay.rows, lay.cols), out_dtype),
    scratch_shapes=[pltpu.VMEM((lay.block_rows, 1), st) for _ in program.init],
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "arbitrary", "arbitrary")
    ),
    interpret=interpret,
    name=program.name,
  )(*data, *([] if mask is None else [mask]))


run = functools.partial(run_rows, _call, backend="mosaic_tpu")
