"""Attention implementations: XLA programs and Pallas kernels.

Three stages, each a primitive (``primitives/attention.py``): the forward
(``out``, ``lse``), the tangent (linear in the inputs' tangents) and the
backward (its transpose).

* ``common.py``: the operands' layout, visibility, block ranges and the block
  math every implementation runs;
* ``config.py``: ``AttentionConfig``, heuristics, autotuning space, legality;
* ``xla.py``: the blockwise XLA programs (the CPU path);
* ``triton.py``, ``mosaic_tpu.py``: the Pallas kernels.
"""

from __future__ import annotations

import dataclasses

from pallax.kernels.attention import config, mosaic_tpu, triton
from pallax.kernels.attention.common import with_sinks
from pallax.kernels.attention.config import STAGES, AttentionConfig
from pallax.op import Kernel

__all__ = ["AttentionConfig", "STAGES", "kernel"]


def kernel(stage: str) -> Kernel:
  """The Pallas kernel of ``stage`` (``"fwd"``, ``"jvp"`` or ``"bwd"``), sinks applied around it."""
  family = Kernel.of_stage(
    stage, config=config, backends={"triton": triton, "mosaic_tpu": mosaic_tpu}
  )
  impls = {name: with_sinks(stage, fn) for name, fn in family.impls.items()}
  return dataclasses.replace(family, impls=impls)
