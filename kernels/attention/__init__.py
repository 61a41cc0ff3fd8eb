"""Attention implementations: XLA programs and Pallas kernels.

Three stages, each a primitive (``primitives/attention.py``): the forward
(``out``, ``lse``), the tangent (linear in the inputs' tangents) and the
backward (its transpose).

* ``common.py``: the operands' layout, visibility, block ranges and the block
  math every implementation runs;
* ``config.py``: ``AttentionConfig``, heuristics, autotuning space, legality;
* ``xla.py``: the blockwise XLA programs (the CPU path);
* ``context.py``: the ring and all-gather programs of a sharded sequence
  (context parallelism), and the sequence layouts around every
  implementation;
* ``triton.py``, ``mosaic_tpu.py``: the Pallas kernels;
* ``mosaic_gpu/``: the Hopper forward, backward and tangent kernels
  (FlashAttention-3's structure), with a config class of its own;
* ``triton_raw.py``: the forward and backward as raw Triton kernels
  (imported when one first runs: it imports triton).
"""

from __future__ import annotations

import dataclasses

from pallax.kernels.attention import config, mosaic_gpu, mosaic_tpu, triton
from pallax.kernels.attention.common import with_sinks
from pallax.kernels.attention.config import AttentionConfig
from pallax.kernels.attention.context import in_layout
from pallax.op import Kernel
from pallax.op.signature import STAGES
from pallax.triton_raw import LazyKernels

__all__ = ["AttentionConfig", "STAGES", "kernel"]


_RAW = LazyKernels("pallax.kernels.attention.triton_raw", ("fwd", "bwd"))


def kernel(stage: str) -> Kernel:
  """The kernels of ``stage`` (``"fwd"``, ``"jvp"`` or ``"bwd"``), with sinks and layouts.

  The Pallas kernels of every stage, the raw Triton ones of the forward and
  backward (the tangent has none), and the Mosaic GPU ones of every stage.
  """
  backends = {"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu, "triton_raw": _RAW}
  own = {mosaic_gpu.IMPLEMENTATION: mosaic_gpu}
  family = Kernel.of_stage(stage, config=config, backends=backends, own_configs=own)
  impls = {name: in_layout(stage, with_sinks(stage, fn)) for name, fn in family.impls.items()}
  return dataclasses.replace(family, impls=impls)
