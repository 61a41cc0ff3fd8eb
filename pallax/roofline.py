"""Roofline numbers: the work of an op call and the peaks of the devices it runs on.

A benchmark's time says little until it is set against what the hardware can
do. This module holds both halves, once:

* ``PEAKS``: dense matrix-unit throughput per dtype (TFLOP/s) and memory
  bandwidth (GB/s) per device kind, each figure with its source; ``peak_of``
  finds a device's entry from its ``device_kind``.
* ``Work`` counters per op (``matmul_work``, ``attention_work``, ...), counted
  from the op's definition, not from what an implementation happens to do:
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
import math
import re
from collections.abc import Mapping, Sequence
from typing import Optional

import jax.numpy as jnp
import numpy as np

__all__ = [
  "PEAKS",
  "Peak",
  "Work",
  "attention_work",
  "cross_entropy_work",
  "linear_cross_entropy_work",
  "matmul_work",
  "norm_work",
  "paged_decode_work",
  "peak_of",
  "softmax_work",
  "throughput",
]

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


def _check_mode(mode: str) -> bool:
  """Whether ``mode`` is forward+backward."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  return mode == "fwd+bwd"


def _bytes(elements: int, dtype) -> int:
  return int(elements) * jnp.dtype(dtype).itemsize


def matmul_work(m: int, k: int, n: int, dtype, mode: str, *, bias: bool = False) -> Work:
  """``[M, K] @ [K, N]`` (plus a ``(N,)`` bias): ``2MKN`` FLOPs; backward ``dA`` and ``dB``.

  Forward+backward: 3x the FLOPs (``dC B^T`` and ``A^T dC``); the backward
  reads ``A``, ``B``, ``dC`` (once per product: twice) and writes ``dA``,
  ``dB`` (and ``dbias``). An epilogue's activation is elementwise: not counted.
  """
  bwd = _check_mode(mode)
  elements = m * k + k * n + m * n + (n if bias else 0)
  flops = 2 * m * k * n
  if bwd:
    elements += 2 * (m * k + k * n + m * n) + (n if bias else 0)
    flops *= 3
  return Work(flops, _bytes(elements, dtype))


def norm_work(op: str, shape: Sequence[int], dtype, mode: str) -> Work:
  """rms_norm / layer_norm / fused_add_rms_norm over the last dim of ``x``: bytes only.

  Forward: reads ``x`` (and the residual for ``fused_add_rms_norm``) and the
  ``(D,)`` parameters, writes ``y`` (and the sum). Backward: reads ``x`` (the
  sum), the weight (layer_norm's bias is not needed) and the cotangents,
  writes ``dx`` (and ``dresidual`` for ``fused_add_rms_norm``: the same
  array, counted once) and the parameters' gradients.
  """
  bwd = _check_mode(mode)
  params = {"rms_norm": 1, "layer_norm": 2, "fused_add_rms_norm": 1}
  if op not in params:
    raise ValueError(f"op must be one of {tuple(params)}, got {op!r}")
  size, d = math.prod(shape), shape[-1]
  fused = op == "fused_add_rms_norm"
  rows = (2 if fused else 1) * size  # x (and the residual) in; y (and the sum) out
  elements = 2 * rows + params[op] * d
  if bwd:  # x (or the sum), the cotangent(s) and the weight in; dx and dparams out
    elements += (3 if fused else 2) * size + d + size + params[op] * d
  return Work(None, _bytes(elements, dtype))


def softmax_work(shape: Sequence[int], dtype, mode: str) -> Work:
  """Softmax or log-softmax of ``x``: bytes only.

  Reads ``x`` and writes ``y``; the backward reads ``y`` and ``dy``, writes ``dx``.
  """
  bwd = _check_mode(mode)
  size = math.prod(shape)
  return Work(None, _bytes((5 if bwd else 2) * size, dtype))


def attention_work(
  batch: int,
  heads: int,
  kv_heads: int,
  q_len: int,
  kv_len: int,
  head_dim: int,
  dtype,
  mode: str,
  *,
  causal: bool = False,
  documents: int = 1,
) -> Work:
  """Dot-product attention, counting the unmasked (query, key) pairs only.

  Forward: ``Q K^T`` and ``P V`` over the pairs, ``4 B N pairs H`` FLOPs
  (FlashAttention's convention; GQA counts query heads ``N``); ``pairs =
  T S``, causal ``T (T + 1) / 2`` for ``T <= S`` (query ``i`` sees keys
  ``0..i``). ``documents``: self-attention over that many packed documents of
  equal length (segment ids), each attending within itself.
  Forward+backward: 3.5x (``dV``, ``dP``, ``dQ``, ``dK`` and the recomputed
  ``Q K^T``: seven products against two). Bytes: reads ``q``, ``k``, ``v``,
  writes ``o``; the backward reads them and ``do``, writes ``dq``, ``dk``, ``dv``.
  """
  bwd = _check_mode(mode)
  if documents < 1 or q_len % documents or kv_len % documents:
    raise ValueError(f"documents must divide both lengths, got {documents}")
  t, s = q_len // documents, kv_len // documents
  if causal:
    pairs = t * (t + 1) // 2 if t <= s else s * (s + 1) // 2 + (t - s) * s
  else:
    pairs = t * s
  flops = 4 * batch * heads * documents * pairs * head_dim
  q = batch * q_len * heads * head_dim
  kv = batch * kv_len * kv_heads * head_dim
  elements = 2 * q + 2 * kv  # q, k, v in; o out
  if bwd:
    elements += 3 * q + 2 * kv + q + 2 * kv  # q, o, do, k, v in; dq, dk, dv out
    flops = flops * 7 // 2
  return Work(flops, _bytes(elements, dtype))


def paged_decode_work(lengths, heads: int, kv_heads: int, head_dim: int, dtype) -> Work:
  """One decode step against a paged KV cache: the keys and values each sequence reads.

  ``lengths``: the sequences' context lengths. FLOPs ``4 N len H`` per
  sequence (one query row); bytes the keys and values under the lengths plus
  ``q`` read and ``o`` written. Forward only: an inference op.
  """
  tokens = int(np.sum(np.asarray(lengths, np.int64)))
  batch = len(np.asarray(lengths).reshape(-1))
  flops = 4 * heads * tokens * head_dim
  elements = 2 * tokens * kv_heads * head_dim + 2 * batch * heads * head_dim
  return Work(flops, _bytes(elements, dtype))


def linear_cross_entropy_work(tokens: int, hidden: int, vocab: int, dtype, mode: str) -> Work:
  """The language-model head's loss of ``x (N, D)`` and ``weight (D, V)``: ``2 N D V`` FLOPs.

  Forward+backward: 3x (``x W``, ``dlogits W^T``, ``x^T dlogits``); bytes:
  reads ``x`` and ``weight``, and the backward reads them again and writes
  ``dx`` and ``dweight``. The ``[N, V]`` logits are not in the op's
  definition's traffic: they need not leave the chip.
  """
  bwd = _check_mode(mode)
  operands = tokens * hidden + hidden * vocab
  flops = 2 * tokens * hidden * vocab
  return Work(3 * flops if bwd else flops, _bytes((3 if bwd else 1) * operands, dtype))


def cross_entropy_work(tokens: int, vocab: int, dtype, mode: str) -> Work:
  """Cross-entropy of given ``logits (N, V)``: bytes only.

  Reads the logits; the backward reads them again and writes their gradient.
  """
  bwd = _check_mode(mode)
  return Work(None, _bytes((3 if bwd else 1) * tokens * vocab, dtype))
