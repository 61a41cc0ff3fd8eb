"""Normalisation implementations: XLA programs and Pallas kernels.

One implementation serves ``rms_norm``, ``layer_norm`` and
``fused_add_rms_norm``, told apart by a static ``NormKind`` (``kind.py``).
Each op has a forward stage (outputs plus the statistics the backward needs),
a tangent stage (forward-mode AD; an XLA program on every platform) and a
backward stage.

* ``kind.py``: ``NormKind`` and the operand and result names of each stage;
* ``config.py``: ``NormConfig``, its heuristic, autotuning space and legality;
* ``xla.py``: the XLA programs (the CPU path);
* ``common.py``: the kernel bodies, run by ``triton.py`` and ``mosaic_tpu.py``;
* ``triton_raw.py``: rms_norm's kernels in raw Triton (loaded when first run).
"""

from __future__ import annotations

from pallax.kernels.norm import config, mosaic_tpu, triton
from pallax.kernels.norm.config import NormConfig
from pallax.kernels.norm.kind import ADD_RMS, CATEGORY, LAYER, RMS, ROW, STAT, WEIGHT, NormKind
from pallax.op import Kernel
from pallax.triton_raw import IMPLEMENTATION as RAW
from pallax.triton_raw import LazyKernels

__all__ = [
  "NormConfig",
  "NormKind",
  "RMS",
  "LAYER",
  "ADD_RMS",
  "CATEGORY",
  "ROW",
  "STAT",
  "WEIGHT",
  "kernel",
]


_RAW_KERNELS = LazyKernels("pallax.kernels.norm.triton_raw", ("norm_fwd", "norm_bwd"))


def kernel(name: str, stage: str, kind: NormKind) -> Kernel:
  """The kernels ``name`` (``rms_norm_fwd``, ...) of ``stage`` (``fwd`` or ``bwd``) for ``kind``.

  Its config space is told ``name`` (the compiler verdicts on its configs are
  that kernel's, ``config.py``).

  Pallas on Triton and Mosaic TPU for every kind; raw Triton for rms_norm
  only, so the executor neither times nor accepts ``"triton_raw"`` configs
  for layer_norm and fused_add_rms_norm (it says they have no such kernel).
  """
  backends = {"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu}
  if kind == RMS:
    backends[RAW] = _RAW_KERNELS
  return Kernel.of_family(
    f"norm_{stage}", config=config, backends=backends, space_params={"kernel": name}, kind=kind
  )
