"""The norm kernels on Pallas-Triton.

The hidden block is ``H`` rounded up to a power of two and ``block_rows`` a
power of two; blocks overhanging the array are masked by hand, since
Pallas-Triton does not bounds-check them (``common.Layout``).
"""

from __future__ import annotations

import functools

from pallax.kernels.norm import common
from pallax.pallas_utils import triton_compiler_params


def _call(stage, *args, config, **params):
  return common.norm_kernel(
    stage,
    *args,
    config=config,
    backend="triton",
    compiler_params=lambda layout, dtype: triton_compiler_params(config),
    **params,
  )


norm_fwd = functools.partial(_call, "fwd")
norm_bwd = functools.partial(_call, "bwd")
