"""Roofline numbers: the work of an op call and the peaks of the devices it runs on.

A benchmark's time says little until it is set against what the hardware can
do. This module holds both halves, once:

* ``PEAKS``: dense matrix-unit throughput per dtype (TFLOP/s) and memory
  bandwidth (GB/s) per device kind, each figure with its source; ``peak_of``
  finds a device's entry from its ``device_kind``.
* ``Work`` counters per op (``matmul_work``, ``attention_work``, ...): each op
  family defines its own in its ``kernels/<family>/tools.py``
  (``pallax.family``), found here by name (``pallax.roofline.matmul_work``).
  They count from the op's definition, not from what an implementation does:
  FLOPs are 2 per multiply-add of the op's matrix products (elementwise work,
  softmax exponentials and normalisation are not counted; ops without matrix
  products have no FLOPs, only bytes); bytes are the least traffic the
  definition allows: every operand read once and every result written once,
  and for forward+backward the backward's reads (primal operands, forward
  outputs it needs, cotangents) and gradient writes on top, in the operands'
  dtypes. Small per-row statistics (``lse``, ``rstd``) and integer side inputs
  of the size of a row count are left out.
* ``throughput``: the achieved TFLOP/s and GB/s of a timed call, and their
  fractions of the device's peaks where the device is in the table.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Optional

import jax.numpy as jnp

from pallax import family

__all__ = ["MODES", "PEAKS", "Peak", "Work", "check_mode", "nbytes", "peak_of", "throughput"]

MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class Peak:
  """A device's peaks.

  name: the device, as this table names it.
  tflops: dense (no structured sparsity) matrix throughput per dtype name, in
    TFLOP/s; ``float32`` is IEEE float32 (NVIDIA's non-tensor-core FP32, not
    TF32), absent where the vendor gives no figure.
  hbm_gbps: memory bandwidth, GB/s (10**9 bytes per second).
  """

  name: str
  tflops: Mapping[str, float]
  hbm_gbps: float


# (pattern on jax's ``device_kind``, case-insensitive; first match wins) -> Peak.
# NVIDIA halves its tensor-core datasheet figures for dense math (the
# datasheets print them with 2:4 sparsity).
PEAKS: tuple[tuple[str, Peak], ...] = (
  # NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column: BF16/FP16
  # 1,513 TFLOPS sparse, FP32 51 TFLOPS, 2.0 TB/s (HBM2e).
  (r"H100.*PCIe", Peak("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float32": 51.0}, 2000)),
  # Same datasheet, H100 SXM column: BF16/FP16 1,979 TFLOPS sparse (989.4
  # dense), FP32 67 TFLOPS (66.9), 3.35 TB/s (HBM3). jax: "NVIDIA H100 80GB
  # HBM3" (an H100 NVL, another part, is not in the table).
  (
    r"H100.*(SXM|HBM3\b)",
    Peak("H100 SXM", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}, 3350),
  ),
  # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the H100 SXM's compute
  # (BF16/FP16 1,979 sparse, FP32 67), 4.8 TB/s (HBM3e).
  (r"H200", Peak("H200 SXM", {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9}, 4800)),
  # NVIDIA A100 Tensor Core GPU datasheet: BF16/FP16 312 TFLOPS dense, FP32
  # 19.5 TFLOPS; 80GB SXM 2,039 GB/s (HBM2e; the 80GB PCIe card: 1,935),
  # 40GB 1,555 GB/s (HBM2).
  (
    r"A100.*80\s*GB",
    Peak("A100 80GB", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 2039),
  ),
  (r"A100", Peak("A100 40GB", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1555)),
  # NVIDIA L4 Tensor Core GPU datasheet: BF16/FP16 242 TFLOPS sparse, FP32
  # 30.3 TFLOPS, 300 GB/s (GDDR6).
  (r"\bL4\b", Peak("L4", {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3}, 300)),
  # AMD Instinct MI300X data sheet: FP16/BF16 1,307.4 TFLOPS dense, FP32
  # matrix 163.4 TFLOPS, 5.3 TB/s (HBM3).
  (r"MI300X", Peak("MI300X", {"bfloat16": 1307.4, "float16": 1307.4, "float32": 163.4}, 5300)),
  # Google Cloud TPU system architecture pages (per chip). bf16 only: the
  # MXUs have no native float16, and Google gives no float32 figure.
  # TPU v4: 275 TFLOPs bf16, 1,200 GBps (HBM2).
  (r"TPU v4", Peak("TPU v4", {"bfloat16": 275.0}, 1200)),
  # TPU v5e ("TPU v5 lite" in jax): 197 TFLOPs bf16, 819 GBps.
  (r"TPU v5 ?(lite|e)", Peak("TPU v5e", {"bfloat16": 197.0}, 819)),
  # TPU v5p ("TPU v5" in jax): 459 TFLOPs bf16, 2,765 GBps.
  (r"TPU v5", Peak("TPU v5p", {"bfloat16": 459.0}, 2765)),
  # TPU v6e / Trillium ("TPU v6 lite" in jax): 918 TFLOPs bf16, 1,638 GBps.
  (r"TPU v6", Peak("TPU v6e", {"bfloat16": 918.0}, 1638)),
)


def peak_of(device_kind: str) -> Optional[Peak]:
  """The peaks of a device from its ``jax.Device.device_kind``, or None if not in ``PEAKS``."""
  for pattern, peak in PEAKS:
    if re.search(pattern, device_kind, re.IGNORECASE):
      return peak
  return None


@dataclasses.dataclass(frozen=True)
class Work:
  """What one call does: matrix FLOPs (None for an op without matrix products) and bytes."""

  flops: Optional[int]
  bytes: int


def throughput(work: Work, seconds: float, device_kind: str, dtype) -> dict:
  """Achieved rates of a call that took ``seconds``, and their fractions of the peaks.

  Returns ``tflop_per_s`` (when the op has FLOPs) and ``gbyte_per_s``, and for
  a device in ``PEAKS`` its ``peak_device`` name with
  ``fraction_of_peak_flops`` (when the table has ``dtype``'s matrix peak) and
  ``fraction_of_peak_bandwidth``.
  """
  if not seconds > 0:
    raise ValueError(f"seconds must be positive, got {seconds}")
  info: dict = {"gbyte_per_s": work.bytes / seconds / 1e9}
  if work.flops is not None:
    info["tflop_per_s"] = work.flops / seconds / 1e12
  peak = peak_of(device_kind)
  if peak is None:
    return info
  info["peak_device"] = peak.name
  info["fraction_of_peak_bandwidth"] = info["gbyte_per_s"] / peak.hbm_gbps
  name = jnp.dtype(dtype).name
  if work.flops is not None and name in peak.tflops:
    info["fraction_of_peak_flops"] = info["tflop_per_s"] / peak.tflops[name]
  return info


def check_mode(mode: str) -> bool:
  """Whether ``mode`` (one of ``MODES``) is forward+backward; a work model's first check."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  return mode == "fwd+bwd"


def nbytes(elements: int, dtype) -> int:
  """The bytes of ``elements`` values of ``dtype``."""
  return int(elements) * jnp.dtype(dtype).itemsize


def __getattr__(name: str):
  """The op families' work models (``pallax.family.work_models``) by name, e.g. ``matmul_work``."""
  models = {} if name.startswith("__") else family.work_models()
  if name in models:
    return models[name]
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted([*globals(), *family.work_models()])
