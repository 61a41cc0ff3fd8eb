"""The norm kernels on Pallas-Mosaic TPU.

A block spans the whole hidden dim and ``block_rows`` is a multiple of the
sublane tile (or all rows); Mosaic pads partial blocks itself. Both grid axes
are independent ("parallel"), so megacore chips split them.
"""

from __future__ import annotations

import functools

from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.norm import common

_COMPILER_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _call(stage, *args, **params):
  return common.norm_kernel(
    stage, *args, backend="mosaic_tpu", compiler_params=_COMPILER_PARAMS, **params
  )


norm_fwd = functools.partial(_call, "fwd")
norm_bwd = functools.partial(_call, "bwd")
