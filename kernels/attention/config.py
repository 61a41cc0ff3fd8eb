"""The attention kernels' config: ``AttentionConfig``, heuristics, autotuning space, legality.

One config class serves the forward, tangent and backward kernels; each
stage has its own heuristic (the backward holds more accumulators per block).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.attention.common import Problem
from pallax.pallas_utils import TPU_VMEM_BUDGET, mosaic_dtype_reason, next_pow2, triton_warps_reason

STAGES = ("fwd", "jvp", "bwd")


@dataclasses.dataclass(frozen=True)
class AttentionConfig(KernelConfig):
  """Block sizes of the attention kernels.

  block_q: query rows per block (Triton: a power of two >= 16; TPU: a
    multiple of 8, or all of T).
  block_k: keys per block (Triton: a power of two >= 16; TPU: a multiple of
    128, or all of S).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """

  block_q: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 2


_TPU_SUBLANES, _TPU_LANES = 8, 128


def _head(p: Problem) -> int:
  return next_pow2(max(p.head_dim, p.value_dim, 16))


# Triton blocks in order of preference: large query blocks amortise the
# key/value loads; the first one a call's screen (``_triton_fits``) lets
# through is the heuristic's.
_TRITON_ORDER = (
  (128, 64, 4),
  (128, 64, 8),
  (64, 64, 4),
  (64, 64, 8),
  (64, 32, 4),
  (64, 32, 8),
  (32, 32, 4),
  (32, 32, 8),
  (16, 32, 4),
  (16, 16, 4),
)


def _triton_heuristic(p: Problem, stage: str, interpret: bool) -> AttentionConfig:
  """The first block shape of ``_TRITON_ORDER`` whose registers fit, clamped to the call."""
  fit = lambda c: interpret or _triton_fits(p, c, stage) is None
  configs = [AttentionConfig(block_q=bq, block_k=bk, num_warps=w) for bq, bk, w in _TRITON_ORDER]
  config = next((c for c in configs if fit(c)), configs[-1])
  clamp = lambda x, n: min(x, max(16, next_pow2(n)))
  bq, bk = clamp(config.block_q, p.t), clamp(config.block_k, p.s)
  return dataclasses.replace(config, block_q=bq, block_k=bk)


def _tpu_heuristic(p: Problem, stage: str) -> AttentionConfig:
  bq = p.t if p.t <= 256 else 256 if stage == "bwd" else 512
  bk = p.s if p.s <= 512 else 512
  return AttentionConfig(block_q=bq, block_k=bk)


def tpu_vmem(p: Problem, config: AttentionConfig) -> int:
  """Scoped VMEM of a TPU attention kernel: blocks (double-buffered) and float32 scratch.

  Per grid step a kernel reads a query-side block (q, dq or do: block_q x H),
  a key-side one (k, v, their tangents: block_k x H) and, with a bias or mask,
  a (block_q, block_k) tile, and holds float32 logits and probabilities.
  """
  item = jnp.dtype(p.dtype).itemsize
  h = max(p.head_dim, p.value_dim)
  rows = 2 * item * (3 * config.block_q * h + 4 * config.block_k * h)
  tile = config.block_q * config.block_k * (4 * 4 + 2 * (item + 1) * (p.has_bias + p.has_mask))
  scratch = 4 * (3 * config.block_q * h + 2 * config.block_k * h)
  return rows + tile + scratch


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params) -> AttentionConfig:
  p = Problem.of(avals, **params)
  if kernel_backend(target) == "triton":
    return _triton_heuristic(p, stage, interpreted(target))
  return _tpu_heuristic(p, stage)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params) -> list[AttentionConfig]:
  """The autotuning space: block shapes around the heuristic's (and warps on Triton)."""
  backend = kernel_backend(target)
  base = heuristic(avals, target, stage=stage, **params)
  if interpreted(target):
    return [base]
  if backend == "triton":
    out = [
      AttentionConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
      for bq, bk, w in _TRITON_ORDER
      for st in (1, 2, 3)
    ]
  else:
    out = [
      AttentionConfig(block_q=bq, block_k=bk) for bq in (128, 256, 512) for bk in (128, 256, 512)
    ]
  legal = [c for c in out if supports(avals, target, c, stage=stage, **params) is None]
  return list(dict.fromkeys([base, *legal]))


# Registers: a screen in "float32 values per thread" fitted to what ptxas
# reported over ``pallax.verify``'s sweep (H100/A100). float32 operands count
# double (triple-pass tf32-free dots: precision HIGHEST keeps them in
# registers), the tangent's four dots per block four times. Shared memory: the
# pipelined blocks of the loop, within A100's 163 KiB.
_REGISTER_LIMIT = {"fwd": 128, "jvp": 176, "bwd": 224}
_FLOAT32_WEIGHT = {"fwd": 2, "jvp": 4, "bwd": 2}
_SMEM_LIMIT = 160 * 1024


def _triton_fits(p: Problem, config: AttentionConfig, stage: str) -> Optional[str]:
  """Why a Triton config would spill registers or overflow shared memory, if it would."""
  h, item = _head(p), jnp.dtype(p.dtype).itemsize
  bq, bk, stages = config.block_q, config.block_k, config.num_stages
  if stage == "fwd":
    values = bq * h * (1 + item / 4) + bq * bk
    smem = stages * 2 * bk * h * item + bq * h * item
  elif stage == "jvp":
    values = bq * h * (3 + 2 * item / 4) + 2 * bq * bk
    smem = stages * 4 * bk * h * item + 2 * bq * h * item
  else:
    values = bk * h * (2 + 2 * item / 4) + 2 * bq * h * item / 4 + 2 * bq * bk
    smem = stages * 2 * bq * h * item + 2 * bk * h * item + bq * bk * 4
  weight = _FLOAT32_WEIGHT[stage] if item == 4 else 1
  if values * weight / (32 * config.num_warps) > _REGISTER_LIMIT[stage]:
    return f"blocks ({bq}, {bk}) with {config.num_warps} warps spill registers"
  if smem > _SMEM_LIMIT:
    return f"blocks ({bq}, {bk}) with {stages} stages need more shared memory than an A100 has"
  return None


def supports(
  avals: Sequence[Any], target: str, config: AttentionConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, **params)
  if p.dtype == jnp.float64:
    return "float64 has no attention kernel"
  if kernel_backend(target) == "mosaic_tpu":
    reason = mosaic_dtype_reason([p.dtype], target)
    if reason:
      return reason
    if config.block_q < p.t and config.block_q % _TPU_SUBLANES:
      return f"block_q={config.block_q} must be a multiple of 8 on TPU (or cover all {p.t} queries)"
    if config.block_k < p.s and config.block_k % _TPU_LANES:
      return f"block_k={config.block_k} must be a multiple of 128 on TPU (or cover all {p.s} keys)"
    if not interpreted(target) and tpu_vmem(p, config) > TPU_VMEM_BUDGET:
      return f"blocks ({config.block_q}, {config.block_k}) need more than the VMEM budget"
    return None
  for name in ("block_q", "block_k"):
    value = getattr(config, name)
    if value & (value - 1) or value < 16:
      return f"{name}={value} must be a power of two >= 16 on Triton"
  if _head(p) > 256:
    return f"head dims up to 256 on Triton, got {max(p.head_dim, p.value_dim)}"
  reason = None if interpreted(target) else _triton_fits(p, config, stage)
  return reason or triton_warps_reason(config)


def for_stage(stage: str) -> types.SimpleNamespace:
  """The config space of one stage's kernel, as ``Kernel.of_family`` reads it."""
  bound = lambda f: lambda *a, **kw: f(*a, stage=stage, **kw)
  return types.SimpleNamespace(
    CONFIG_CLS=AttentionConfig,
    heuristic=bound(heuristic),
    candidates=bound(candidates),
    supports=bound(supports),
  )
