"""The norm kernels on Pallas-Mosaic TPU.

A block spans the whole hidden dim and ``block_rows`` is a multiple of the
sublane tile (or all rows); Mosaic pads partial blocks itself. Both grid axes
are independent ("parallel"), so megacore chips split them. A block that
needs more scoped VMEM than the default limit allows (very wide rows) raises
the limit for its kernel, up to most of the chip's VMEM.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.norm import common
from pallax.kernels.norm.config import TPU_VMEM_BUDGET, NormConfig, tpu_vmem

# Most of the 128 MiB of VMEM of v5e and v6e, for blocks over the default limit.
_VMEM_CEILING = 100 * 2**20


def _compiler_params(x, config: NormConfig) -> pltpu.CompilerParams:
  rows = max(1, math.prod(x.shape[:-1]))
  need = tpu_vmem(min(config.block_rows, rows), x.shape[-1], jnp.dtype(x.dtype).itemsize)
  limit = None if need <= TPU_VMEM_BUDGET else min(2 * need, _VMEM_CEILING)
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=limit)


def _call(stage, *args, config: NormConfig, **params):
  return common.norm_kernel(
    stage,
    *args,
    config=config,
    backend="mosaic_tpu",
    compiler_params=_compiler_params(args[0], config),
    **params,
  )


norm_fwd = functools.partial(_call, "fwd")
norm_bwd = functools.partial(_call, "bwd")
