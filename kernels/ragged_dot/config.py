"""The grouped matmuls' config: ``RaggedDotConfig``, heuristic, space, legality.

One config class for both kernels, told apart by ``stage`` (``"gmm"``, the
grouped GEMM, or ``"tgmm"``, the weight gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import pallas_utils as pu
from pallax.executor import facts
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig(KernelConfig):
  """Blocks of the grouped-matmul kernels (powers of two >= 16: Triton's dots).

  On TPU a block at least as large as its dim is the whole dim, and the
  others are multiples of 128 (``tpu_blocks``).

  block_m: gmm: rows of an output tile (each group meeting the tile costs one
    tile product, so smaller tiles waste less at group boundaries); tgmm:
    rows a step of the reduction over a group's rows.
  block_n: columns of an output tile (N).
  block_k: gmm: the contraction's step; tgmm: rows of an output tile (K).
  num_warps, num_stages: Triton launch parameters.
  """

  block_m: int = 64
  block_n: int = 64
  block_k: int = 32
  num_warps: int = 4
  num_stages: int = 2


CONFIG_CLS = RaggedDotConfig

# The Triton space: (block_m, block_n, block_k) per operand width, in order of
# preference; ``pallax.verify`` compiles each for H100 and A100.
_TRITON_BLOCKS = {
  2: ((128, 128, 64), (64, 128, 64), (64, 64, 64), (128, 64, 32), (32, 64, 32)),
  4: ((64, 64, 32), (64, 128, 32), (32, 64, 32), (128, 64, 16), (32, 32, 32)),
}
# TPU: (block_m, block_n, block_k), in order of preference (megablox-sized
# tiles; blocks past a dim are the whole dim).
_TPU_BLOCKS = ((512, 512, 512), (256, 512, 512), (256, 256, 256), (128, 128, 128))
# Each group meeting a gmm tile costs a whole tile product: tiles no taller
# than the power of two covering a group's mean rows (but at least this).
_MIN_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts of one call: ``lhs [m, k]`` and the stage's other operand."""

  stage: str
  m: int
  k: int
  n: int
  groups: int
  dtype: Any
  dtypes: tuple[Any, ...]  # the operands' and the result's, as given
  halves: int = 1  # 2 for a gated gmm: two products (N each) of a [G, K, 2N] weight

  @classmethod
  def of(cls, avals: Sequence[Any], stage: str, **params) -> Problem:
    lhs, rhs = avals[:2]
    m, k = lhs.shape[-2:]
    halves = 2 if params.get("gated") else 1
    if stage == "gmm":
      groups, n = rhs.shape[-3], rhs.shape[-1] // halves
    else:
      groups, n = params["groups"], rhs.shape[-1]
    dtypes = (lhs.dtype, rhs.dtype, params["out_dtype"])
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return cls(stage, m, k, n, groups, dtype, dtypes, halves)

  @property
  def width(self) -> int:
    return jnp.dtype(self.dtype).itemsize


def call_facts(avals: Sequence[Any], stage: str, **params) -> dict[str, Any]:
  """What the compiler verdicts depend on: the operands' bytes an element."""
  return {"width": Problem.of(avals, stage, **params).width}


def tpu_blocks(config: RaggedDotConfig, m: int, n: int, k: int) -> tuple[int, int, int]:
  """TPU block sizes ``(rows, N, K)``: a block at least as large as its dim is the whole dim."""
  return min(config.block_m, m), min(config.block_n, n), min(config.block_k, k)


def _rows(p: Problem, block_m: int, least: int) -> int:
  """gmm: ``block_m``, no taller than the power of two covering a group's mean rows."""
  if p.stage != "gmm":
    return block_m
  mean = -(-p.m // max(p.groups, 1))
  return max(least, min(block_m, pu.next_pow2(mean)))


def _space(p: Problem, target: str) -> list[RaggedDotConfig]:
  if kernel_backend(target) == "mosaic_tpu":
    return list(
      dict.fromkeys(RaggedDotConfig(_rows(p, bm, 128), bn, bk) for bm, bn, bk in _TPU_BLOCKS)
    )
  out = []
  for bm, bn, bk in _TRITON_BLOCKS[4 if p.width >= 4 else 2]:
    # A gated gmm holds two accumulators: half as many columns keeps the
    # registers of one (128x128 gated tiles spill on A100).
    bn = max(16, bn // p.halves)
    warps = 8 if bm * bn * p.halves >= 128 * 128 else 4
    out.append(RaggedDotConfig(_rows(p, bm, _MIN_ROWS), bn, bk, num_warps=warps, num_stages=2))
  return list(dict.fromkeys(out))


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params) -> RaggedDotConfig:
  """The first config of the space that compiles cleanly on ``target``'s devices."""
  p = Problem.of(avals, stage, **params)
  space = _space(p, target)
  return next((c for c in space if _reason(p, target, c) is None), space[-1])


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params) -> list[RaggedDotConfig]:
  """The autotuning space: the blocks of the space (on Triton at 4 and 8 warps)."""
  p = Problem.of(avals, stage, **params)
  base = heuristic(avals, target, stage=stage, **params)
  if interpreted(target):
    return [base]
  out = _space(p, target)
  if kernel_backend(target) == "triton":
    out = [dataclasses.replace(c, num_warps=w) for c in out for w in (4, 8)]
  legal = [c for c in out if supports(avals, target, c, stage=stage, **params) is None]
  return list(dict.fromkeys([base, *legal]))


def _tpu_vmem(p: Problem, config: RaggedDotConfig) -> int:
  """Scoped VMEM of a TPU kernel: double-buffered operand and output blocks, the accumulator."""
  bm, bn, bk = tpu_blocks(config, p.m, p.n, p.k)
  out = (bm, bn) if p.stage == "gmm" else (bk, bn)
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer((bm, bk), p.width),
      pu.VmemBuffer((bk, bn) if p.stage == "gmm" else (bm, bn), p.width, copies=2 * p.halves),
      pu.VmemBuffer(out, p.width),
      pu.VmemBuffer(out, 4, copies=p.halves),
    ]
  )


def _tpu_reason(p: Problem, target: str, config: RaggedDotConfig) -> Optional[str]:
  reason = pu.mosaic_dtype_reason(p.dtypes, target)
  if reason:
    return reason
  bm, bn, bk = tpu_blocks(config, p.m, p.n, p.k)
  sub = pu.sublanes(p.dtype)
  if (bm % sub and bm != p.m) or any(b % pu.LANES and b != d for b, d in ((bn, p.n), (bk, p.k))):
    return (
      f"blocks ({bm}, {bn}, {bk}) must be multiples of ({sub}, {pu.LANES}, {pu.LANES}) or "
      "whole dims on TPU"
    )
  if p.halves == 2 and (bn % pu.LANES or p.n % bn):
    return (
      f"a gated weight's halves of {p.n} columns must be whole blocks of a multiple of "
      f"{pu.LANES} on TPU, got blocks of {bn}"
    )
  if not interpreted(target) and _tpu_vmem(p, config) > pu.TPU_VMEM_BUDGET:
    return f"blocks ({bm}, {bn}, {bk}) need more than the VMEM budget"
  return None


def _reason(p: Problem, target: str, config: RaggedDotConfig) -> Optional[str]:
  if kernel_backend(target) == "mosaic_tpu":
    return _tpu_reason(p, target, config)
  for name in ("block_m", "block_n", "block_k"):
    value = getattr(config, name)
    if value < 16 or value & (value - 1):
      return f"{name}={value} must be a power of two >= 16 on Triton"
  if interpreted(target):
    return None
  kernel = "ragged_dot" if p.stage == "gmm" else "ragged_dot_tgmm"
  reason = facts.rejection(target, kernel, config, {"width": p.width})
  return reason or pu.triton_warps_reason(config)


def supports(
  avals: Sequence[Any], target: str, config: RaggedDotConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, stage, **params)
  if jnp.float64 in p.dtypes:
    return "float64 has no grouped-matmul kernel"
  if min(p.m, p.k, p.n, p.groups) == 0:
    return "an empty dim: nothing for a kernel to do"
  return _reason(p, target, config)
