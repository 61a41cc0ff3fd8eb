"""The norm kernels' config: ``NormConfig``, heuristic, autotuning space, legality.

Every norm op, forward and backward, shares one config class: the kernels
differ in what they compute per row block, not in how rows are blocked.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import pallas_utils as pu
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.triton_raw import IMPLEMENTATION as RAW


@dataclasses.dataclass(frozen=True)
class NormConfig(KernelConfig):
  """Block sizes of the norm kernels (every op, forward and backward).

  implementation: ``"pallas"`` (the kernel), ``"triton_raw"`` (rms_norm's raw
    Triton kernel, ``triton_raw.py``) or ``"xla"`` (the XLA program).
  block_rows: rows per program (power of two on Triton; multiple of the
    sublane tile, or all rows, on TPU).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """

  block_rows: int
  num_warps: int = 4
  num_stages: int = 1


def _rows_hidden(avals) -> tuple[int, int]:
  x = avals[0]
  return max(1, math.prod(x.shape[:-1])), x.shape[-1]


# The widest row (a power of two) the Triton kernels hold in registers: the
# backward kernel spills at every num_warps beyond it (788-14378 bytes at 32K,
# float32 and bfloat16, H100 and A100; the raw kernel 260-2584 bytes at 16 and
# 32 warps). Wider rows run the XLA program.
_TRITON_MAX_HIDDEN = 16384


def _spills(block_rows: int, block_hidden: int, num_warps: int) -> bool:
  """Whether a Triton norm kernel with this block and warps spills registers.

  Measured with ptxas (``pallax.verify``: --warn-on-spills, sm_90a and sm_80)
  on the kernels of all three norms, float32 and bfloat16. A thread holds at
  most 32 elements of the block: (8 rows of 1024, 8 warps) uses 128-137
  registers in the backward kernels, while 64 per thread spilled there
  (fused_add_rms_norm float32, one row of 16K on 8 warps, A100: 6468 bytes)
  and in the forward (rms_norm bfloat16, one row of 4096 on 2 warps, A100: 8
  bytes). With 16 warps (128 registers a thread) only a single-row block
  fits: one row of 16K uses 118-128 registers, while (8, 1024) and (2, 4096),
  16 per thread, spilled in bfloat16 backward kernels on A100 and H100.
  """
  per_thread = block_rows * block_hidden // (32 * num_warps)
  return per_thread > 32 or (num_warps >= 16 and block_rows > 1)


def tpu_vmem(block_rows: int, hidden: int, itemsize: int) -> int:
  """Scoped VMEM of the largest norm kernel, for a block of ``block_rows`` rows.

  fused_add_rms_norm's backward reads x, dy, dh and writes dx, each block
  double-buffered, plus about three float32 temporaries of the block. Checked
  against libtpu's compile-only v5e/v6e targets, which report the scoped
  allocation when it overflows: rms_norm's backward at x (4096, 8192) float32
  with 64 rows needs 18.03 MiB (this model: 22 MiB); fused_add_rms_norm's
  forward at x (1000, 4000) float32 with 128 rows overflowed v5e's 16 MiB.
  """
  block = (block_rows, hidden)
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer(block, itemsize, copies=2 * 4, padded=False),
      pu.VmemBuffer(block, 4, copies=3, padded=False),
    ]
  )


def _backend_heuristic(avals, backend: str) -> NormConfig:
  """Rows per block: about 8K elements (Triton), or what fits in VMEM (TPU).

  On TPU, as many rows as fit ``TPU_VMEM_BUDGET`` (``tpu_vmem``), at most
  1024. On Triton, a warp per 1K elements of the block: 32 elements per
  thread, which the backward kernel holds without spilling (``_spills``); 8
  warps for multi-row blocks, 16 for a row of 16K elements or more (one row
  per block).
  """
  rows, hidden = _rows_hidden(avals)
  if backend == "triton":
    block_hidden = pu.next_pow2(hidden)
    block_rows = max(1, min(pu.next_pow2(rows), 8192 // block_hidden, 64))
    num_warps = max(1, min(8 if block_rows > 1 else 16, block_hidden * block_rows // 1024))
    return NormConfig(block_rows=block_rows, num_warps=pu.next_pow2(num_warps))
  dtype = avals[0].dtype
  sub = pu.sublanes(dtype)
  fit = pu.TPU_VMEM_BUDGET // tpu_vmem(1, hidden, jnp.dtype(dtype).itemsize)
  return NormConfig(block_rows=min(max(sub, fit // sub * sub), 1024))


def heuristic(avals: Sequence[Any], target: str, **params) -> NormConfig:
  """The kernel's config for this call: see ``_backend_heuristic``.

  Always a Pallas config: whether rms_norm's raw Triton kernels beat the
  Pallas ones is decided by autotuning on a GPU, where the executor times a
  raw twin of every Pallas candidate.
  """
  return _backend_heuristic(avals, kernel_backend(target))


def candidates(avals: Sequence[Any], target: str, **params) -> list[NormConfig]:
  """The autotuning space: block rows (and warps on Triton)."""
  rows, hidden = _rows_hidden(avals)
  backend = kernel_backend(target)
  if interpreted(target):  # interpreted kernels are slow: a few block sizes
    base = _backend_heuristic(avals, backend)
    blocks = sorted({base.block_rows, max(1, base.block_rows // 4)})
    return [dataclasses.replace(base, block_rows=b) for b in blocks]
  if backend == "triton":
    block_hidden = pu.next_pow2(hidden)
    out = [
      NormConfig(block_rows=b, num_warps=w)
      for b in (1, 2, 4, 8, 16, 32, 64)
      if b <= pu.next_pow2(rows) and b * block_hidden <= 65536
      for w in (2, 4, 8, 16)
      if w * 32 <= b * block_hidden and not _spills(b, block_hidden, w)
    ]
  else:
    sub, itemsize = pu.sublanes(avals[0].dtype), jnp.dtype(avals[0].dtype).itemsize
    out = [
      NormConfig(block_rows=b)
      for b in (sub, 2 * sub, 4 * sub, 8 * sub, 256, 512, 1024)
      if b % sub == 0 and tpu_vmem(b, hidden, itemsize) <= pu.TPU_VMEM_BUDGET
    ]
  return out or [_backend_heuristic(avals, backend)]


def _triton_reason(avals, target: str, config: NormConfig) -> Optional[str]:
  """Why a Triton kernel (Pallas or raw) cannot run this call with ``config``, if it cannot."""
  block_rows = config.block_rows
  if block_rows & (block_rows - 1):
    return f"block_rows={block_rows} must be a power of two on Triton"
  if not interpreted(target) and _rows_hidden(avals)[1] > _TRITON_MAX_HIDDEN:
    return (
      f"rows wider than {_TRITON_MAX_HIDDEN} elements spill registers in the Triton "
      "kernels at every num_warps"
    )
  return pu.triton_warps_reason(config)


def _raw_reason(avals) -> Optional[str]:
  """Why the raw Triton kernels (``triton_raw.py``) cannot run this call, if they cannot.

  Only rms_norm has them (``kernels/norm/__init__.py`` gives the other kinds
  none, and the executor refuses their raw configs by name).
  """
  if any(a.dtype == jnp.float64 for a in avals):
    return "float64 has no raw Triton kernel (its statistics are float32)"
  return None


def supports(avals: Sequence[Any], target: str, config: NormConfig, **params) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot.

  A ``"triton_raw"`` config follows the Triton rules wherever it runs
  (compiled on cuda, interpreted on the CPU) and the raw kernels' own
  (``_raw_reason``).
  """
  if config.implementation == RAW:
    return _raw_reason(avals) or _triton_reason(avals, target, config)
  if kernel_backend(target) == "triton":
    return _triton_reason(avals, target, config)
  block_rows = config.block_rows
  if avals[0].dtype == jnp.float64:
    return "float64 has no Mosaic TPU kernel"
  reason = pu.mosaic_dtype_reason([a.dtype for a in avals], target)
  if reason:
    return reason
  rows, sub = _rows_hidden(avals)[0], pu.sublanes(avals[0].dtype)
  if block_rows < rows and block_rows % sub:
    return f"block_rows={block_rows} must be a multiple of {sub} on TPU (or cover all {rows} rows)"
  return None


CONFIG_CLS = NormConfig
