"""Grouped matmuls (``ragged_dot``): the XLA programs and the kernels.

* ``common.py``: each group's rows and each row tile's groups;
* ``config.py``: ``RaggedDotConfig``, its heuristic, space and legality, for
  both kernels (``stage`` ``"gmm"`` or ``"tgmm"``);
* ``xla.py``: the sorted-tile programs of the forward (``gmm``) and of the
  weight gradient (``tgmm``), no G-fold work (the CPU path);
* ``triton.py``, ``mosaic_tpu.py``: the Pallas kernels of both;
* ``mosaic_gpu.py``: the Hopper grouped GEMM (TMA pipeline, ``wgmma``) with a
  config class of its own, an autotuning candidate on H100/H200.
"""

from __future__ import annotations

from pallax.kernels.ragged_dot import config, mosaic_gpu, mosaic_tpu, triton
from pallax.kernels.ragged_dot.common import acc_dtype, held_bounds, shard_group_sizes
from pallax.kernels.ragged_dot.config import RaggedDotConfig
from pallax.kernels.ragged_dot.xla import gmm, gmm_epilogue, tgmm
from pallax.op import Kernel

__all__ = [
  "GMM",
  "TGMM",
  "RaggedDotConfig",
  "acc_dtype",
  "held_bounds",
  "gmm",
  "gmm_epilogue",
  "shard_group_sizes",
  "tgmm",
]

GMM, TGMM = (
  Kernel.of_stage(
    stage,
    config=config,
    backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu},
    own_configs={mosaic_gpu.IMPLEMENTATION: mosaic_gpu},
  )
  for stage in ("gmm", "tgmm")
)
