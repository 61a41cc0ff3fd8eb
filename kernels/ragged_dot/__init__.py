"""Grouped matmuls (``ragged_dot``): the XLA programs.

* ``xla.py``: the sorted-tile programs of the forward (``gmm``) and of the
  weight gradient (``tgmm``), no G-fold work; they run on every platform
  until the grouped GEMM kernels land.
"""

from __future__ import annotations

from pallax.kernels.ragged_dot.xla import acc_dtype, gmm, tgmm

__all__ = ["acc_dtype", "gmm", "tgmm"]
