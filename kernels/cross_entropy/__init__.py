"""Cross-entropy implementations: XLA programs and Pallas kernels.

Three stages, each a primitive (``primitives/cross_entropy.py``): the forward
(per-token statistics ``lse``, ``zy``, ``zsum``), the tangent (linear in the
inputs' tangents) and the backward (its transpose). ``linear_cross_entropy``
computes the logits block by block from ``x`` and ``w`` and never holds them;
``cross_entropy`` reads given logits.

* ``common.py``: the operands' layout and the tile math every implementation runs;
* ``config.py``: ``CrossEntropyConfig``, heuristics, autotuning space, legality;
* ``xla.py``: the chunked XLA programs (the CPU path);
* ``triton.py``, ``mosaic_tpu.py``: the Pallas kernels.
"""

from __future__ import annotations

import dataclasses

from pallax.kernels.cross_entropy import config, mosaic_tpu, triton
from pallax.kernels.cross_entropy.common import flat_tokens
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
from pallax.op import Kernel
from pallax.op.signature import STAGES

__all__ = ["CrossEntropyConfig", "STAGES", "kernel"]


def kernel(stage: str) -> Kernel:
  """The Pallas kernel of ``stage`` (``"fwd"``, ``"jvp"`` or ``"bwd"``)."""
  family = Kernel.of_stage(
    stage, config=config, backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu}
  )
  impls = {name: flat_tokens(stage, fn) for name, fn in family.impls.items()}
  return dataclasses.replace(family, impls=impls)
