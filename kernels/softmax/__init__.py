"""Softmax implementations: XLA programs and Pallas kernels.

Every implementation works on the last axis of operands of one shape (the
public functions move the softmax axes there): the leading dims are rows, the
last dim is the row. ``mask`` (the ``where=`` argument) is an optional
trailing bool operand; where it is False an entry takes no part in the row's
reduction and its output is 0 (softmax) or -inf (log_softmax), as in
``jax.nn``.

* ``config.py``: ``SoftmaxConfig``, its heuristic, autotuning space, legality;
* ``xla.py``: the XLA programs (the CPU path);
* ``programs.py``: the row programs every kernel runs, on ``triton.py`` and
  ``mosaic_tpu.py``.
"""

from __future__ import annotations

from pallax.kernels.softmax import config, mosaic_tpu, triton
from pallax.kernels.softmax.config import SoftmaxConfig
from pallax.kernels.softmax.programs import PROGRAMS
from pallax.op import Kernel

__all__ = ["SoftmaxConfig", "OPS", "kernel"]

OPS = tuple(PROGRAMS)


def kernel(name: str) -> Kernel:
  """The Pallas kernel of the softmax primitive ``name`` (e.g. ``"log_softmax_jvp"``)."""
  return Kernel.of_family(
    "run",
    config=config,
    program=PROGRAMS[name],
    backends={"pallas_triton": triton, "pallas_mosaic_tpu": mosaic_tpu},
  )
