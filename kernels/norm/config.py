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
from pallax.executor import facts
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


# The Triton space: block rows and warps, in order of preference, whose
# threads each hold at most 32 elements of the block
# (``pu.triton_elements_per_thread``), with 16 warps (128 registers a thread)
# for single rows only. This register model is what ptxas measured
# (``pallax.verify``: --warn-on-spills, sm_90a and sm_80, the kernels of all
# three norms, float32 and bfloat16): 32 elements a thread use 128-137
# registers in the backward kernels at (8 rows of 1024, 8 warps), while 64
# spilled there (fused_add_rms_norm float32, one row of 16K on 8 warps, A100:
# 6468 bytes) and in the forward (rms_norm bfloat16, one row of 4096 on 2
# warps, A100: 8 bytes); at 16 warps one row of 16K uses 118-128 registers,
# while (8, 1024) and (2, 4096) blocks, 16 elements a thread, spilled in
# bfloat16 backward kernels on A100 and H100. So a row wider than 16 warps
# of 32 elements a thread (16384) has no config and runs the XLA program.
# What the compilers find about configs of the space is data: the verdicts
# of ``defaults/<device>/<kernel>.json`` (``facts``, ``call_facts``).
_TRITON_ROWS = (1, 2, 4, 8, 16, 32, 64)
_TRITON_WARPS = (2, 4, 8, 16)
_THREAD_ELEMENTS = 32
_TRITON_MAX_HIDDEN = _THREAD_ELEMENTS * 32 * max(_TRITON_WARPS)


def call_facts(avals: Sequence[Any], **params) -> dict[str, Any]:
  """What the compiler verdicts on a call's configs depend on (``pallax.executor.facts``).

  width: the rows' bytes an element; hidden: the row's width padded to a
  power of two (a Triton block's).
  """
  return {"width": jnp.dtype(avals[0].dtype).itemsize, "hidden": pu.next_pow2(avals[0].shape[-1])}


def _in_space(block_rows: int, block_hidden: int, num_warps: int) -> bool:
  """Whether a Triton block and warps are in the space (its register model)."""
  per_thread = pu.triton_elements_per_thread(block_rows * block_hidden, num_warps)
  return 0 < per_thread <= _THREAD_ELEMENTS and (num_warps < 16 or block_rows == 1)


def _triton_configs(avals, target: str, kernel: str) -> list[NormConfig]:
  """The configs of the space for this call that no verdict rejects (may be empty)."""
  rows, call = _rows_hidden(avals)[0], call_facts(avals)
  space = [
    NormConfig(block_rows=b, num_warps=w)
    for b in _TRITON_ROWS
    if b <= pu.next_pow2(rows)
    for w in _TRITON_WARPS
    if _in_space(b, call["hidden"], w)
  ]
  return [c for c in space if facts.rejection(target, kernel, c, call) is None]


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


def _triton_heuristic(avals, target: str, kernel: str) -> NormConfig:
  """About 8K elements a block, 32 a thread: 8 warps on several rows, up to 16 on one.

  A warp per 1K elements of the block; where a verdict rejects that config,
  the first config of the space left (where none is, ``supports`` refuses it).
  """
  rows, hidden = _rows_hidden(avals)
  block_hidden = pu.next_pow2(hidden)
  block_rows = max(1, min(pu.next_pow2(rows), 8192 // block_hidden, 64))
  num_warps = max(1, min(8 if block_rows > 1 else 16, block_hidden * block_rows // 1024))
  config = NormConfig(block_rows=block_rows, num_warps=pu.next_pow2(num_warps))
  if facts.rejection(target, kernel, config, call_facts(avals)) is None:
    return config
  return next(iter(_triton_configs(avals, target, kernel)), config)


def _tpu_heuristic(avals) -> NormConfig:
  """As many rows as fit ``TPU_VMEM_BUDGET`` (``tpu_vmem``), at most 1024."""
  hidden = _rows_hidden(avals)[1]
  dtype = avals[0].dtype
  sub = pu.sublanes(dtype)
  fit = pu.TPU_VMEM_BUDGET // tpu_vmem(1, hidden, jnp.dtype(dtype).itemsize)
  return NormConfig(block_rows=min(max(sub, fit // sub * sub), 1024))


def heuristic(avals: Sequence[Any], target: str, *, kernel: str, **params) -> NormConfig:
  """The kernel's config for this call: Triton's or TPU's heuristic.

  Always a Pallas config: whether rms_norm's raw Triton kernels beat the
  Pallas ones is decided by autotuning on a GPU, where the executor times a
  raw twin of every Pallas candidate.
  """
  if kernel_backend(target) == "triton":
    return _triton_heuristic(avals, target, kernel)
  return _tpu_heuristic(avals)


def candidates(avals: Sequence[Any], target: str, *, kernel: str, **params) -> list[NormConfig]:
  """The autotuning space: block rows (and warps on Triton)."""
  hidden = _rows_hidden(avals)[1]
  base = heuristic(avals, target, kernel=kernel)
  if interpreted(target):  # interpreted kernels are slow: a few block sizes
    blocks = sorted({base.block_rows, max(1, base.block_rows // 4)})
    return [dataclasses.replace(base, block_rows=b) for b in blocks]
  if kernel_backend(target) == "triton":
    out = _triton_configs(avals, target, kernel)
  else:
    sub, itemsize = pu.sublanes(avals[0].dtype), jnp.dtype(avals[0].dtype).itemsize
    out = [
      NormConfig(block_rows=b)
      for b in (sub, 2 * sub, 4 * sub, 8 * sub, 256, 512, 1024)
      if b % sub == 0 and tpu_vmem(b, hidden, itemsize) <= pu.TPU_VMEM_BUDGET
    ]
  return out or [base]


def _triton_reason(avals, target: str, config: NormConfig, kernel: str) -> Optional[str]:
  """Why a Triton kernel (Pallas or raw) cannot run this call with ``config``, if it cannot."""
  block_rows = config.block_rows
  if block_rows & (block_rows - 1):
    return f"block_rows={block_rows} must be a power of two on Triton"
  if not interpreted(target):
    if _rows_hidden(avals)[1] > _TRITON_MAX_HIDDEN:
      return (
        f"rows wider than {_TRITON_MAX_HIDDEN} elements spill registers in the Triton "
        "kernels at every num_warps"
      )
    reason = facts.rejection(target, kernel, config, call_facts(avals))
    if reason:
      return reason
  return pu.triton_warps_reason(config)


def _raw_reason(avals) -> Optional[str]:
  """Why the raw Triton kernels (``triton_raw.py``) cannot run this call, if they cannot.

  Only rms_norm has them (``kernels/norm/__init__.py`` gives the other kinds
  none, and the executor refuses their raw configs by name).
  """
  if any(a.dtype == jnp.float64 for a in avals):
    return "float64 has no raw Triton kernel (its statistics are float32)"
  return None


def supports(
  avals: Sequence[Any], target: str, config: NormConfig, *, kernel: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot.

  A ``"triton_raw"`` config follows the Triton rules wherever it runs
  (compiled on cuda, interpreted on the CPU) and the raw kernels' own
  (``_raw_reason``).
  """
  if config.implementation == RAW:
    return _raw_reason(avals) or _triton_reason(avals, target, config, kernel)
  if kernel_backend(target) == "triton":
    return _triton_reason(avals, target, config, kernel)
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
