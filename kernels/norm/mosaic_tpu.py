"""The norm kernels on Pallas-Mosaic TPU.

A block spans the whole hidden dim and ``block_rows`` is a multiple of the
sublane tile (or all rows); Mosaic pads partial blocks itself. Both grid axes
are independent ("parallel"), so megacore chips split them. A block that
needs more scoped VMEM than the default limit allows (very wide rows) raises
the limit for its kernel, up to most of the chip's VMEM.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.norm import common
from pallax.kernels.norm.config import tpu_vmem
from pallax.pallas_utils import TPU_VMEM_BUDGET, TPU_VMEM_CEILING


def _compiler_params(layout: common.Layout, dtype) -> pltpu.CompilerParams:
  blocks = layout.blocks
  need = tpu_vmem(blocks.block_rows, blocks.cols, jnp.dtype(dtype).itemsize)
  limit = None if need <= TPU_VMEM_BUDGET else min(2 * need, TPU_VMEM_CEILING)
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=limit)


def _call(stage, *args, **params):
  return common.norm_kernel(
    stage, *args, backend="mosaic_tpu", compiler_params=_compiler_params, **params
  )


norm_fwd = functools.partial(_call, "fwd")
norm_bwd = functools.partial(_call, "bwd")
