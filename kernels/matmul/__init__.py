"""Matmul implementations: the XLA program and the Pallas kernels.

* ``layout.py``: the operand layout every implementation shares (batch masks,
  contracted batch dims, the folded GEMM ``Problem``);
* ``config.py``: ``MatmulConfig``, its heuristic, autotuning space, legality;
* ``xla.py``: the XLA program (the CPU path) and the epilogue;
* ``common.py``: block specs and the call the kernels of ``triton.py`` and
  ``mosaic_tpu.py`` share, and the operand folding ``mosaic_gpu.py`` shares too;
* ``mosaic_gpu.py``: the Hopper kernel (TMA pipeline, ``wgmma``) with a config
  class of its own, an autotuning candidate on H100/H200.

Products accumulate in float32 (float64 for float64 inputs); the epilogue
(bias, activation) runs on the accumulator and the result is cast to
``out_dtype``. With ``save_preactivation`` the pre-activation
``a @ b + bias`` is a second result: what the activation's derivative needs
under AD. Contracted batch dims need ``transpose_a`` and not
``transpose_b``, which makes them contiguous with K in both operands: the
gradient of a weight shared by a batch sums over the batch in the same GEMM.
"""

from __future__ import annotations

from pallax.activations import ACTIVATIONS
from pallax.kernels.matmul import config, mosaic_gpu, mosaic_tpu, triton
from pallax.kernels.matmul.config import TPU_VMEM_BUDGET, TRITON_SMEM_BYTES, MatmulConfig
from pallax.kernels.matmul.layout import Problem, acc_dtype, bias_like, output_batch
from pallax.kernels.matmul.xla import epilogue, matmul_xla, split_params
from pallax.op import Kernel

__all__ = [
  "ACTIVATIONS",
  "MatmulConfig",
  "Problem",
  "TPU_VMEM_BUDGET",
  "TRITON_SMEM_BYTES",
  "KERNEL",
  "acc_dtype",
  "bias_like",
  "epilogue",
  "matmul_xla",
  "output_batch",
  "split_params",
]

KERNEL = Kernel.of_family(
  "matmul",
  config=config,
  backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu},
  own_configs={mosaic_gpu.IMPLEMENTATION: mosaic_gpu},
)
