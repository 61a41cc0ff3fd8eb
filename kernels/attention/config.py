"""The attention kernels' config: ``AttentionConfig``, heuristics, autotuning space, legality.

One config class serves the forward, tangent and backward kernels; each
stage has its own heuristic (the backward holds more accumulators per block).

The forward and backward also have raw Triton kernels (``triton_raw.py``),
chosen by a config with ``implementation="triton_raw"``. The heuristic always
returns the Pallas kernel's config: which of the two runs faster is decided by
timing them, when autotuning on a GPU, where the executor adds a raw twin of
each Pallas candidate; ``supports`` refuses the twins that spill
(``_RAW_SPILLS``) and the features the raw kernels lack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import triton_raw
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


CONFIG_CLS = AttentionConfig


_TPU_SUBLANES, _TPU_LANES = 8, 128


def _head(p: Problem) -> int:
  return next_pow2(max(p.head_dim, p.value_dim, 16))


# The Triton configs, (block_q, block_k, num_warps, num_stages) in order of
# preference, per stage, operand width (float32 or 16-bit) and padded head
# dim: the ones ptxas compiled spill-free for both H100 and A100 over
# ``pallax.verify``'s sweep, where a register model did not predict spills
# reliably (float32 dots at precision HIGHEST hold their operands in
# registers; spills moved by tens of bytes between neighbouring configs and
# between the two GPUs, and 128x64 backward blocks that compiled clean for
# one call spilled 16 bytes for another on A100; the tangent's 64x64 3-stage
# blocks overflowed A100's shared memory at head dim 128). Smaller heads use
# the 64-wide lists; a call with no list (float32 tangent from head dim 80 up,
# float32 at 256) runs the XLA program, visibly.
_TRITON_CONFIGS = {
  ("fwd", 2, 64): (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
  ),
  ("fwd", 2, 128): (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (64, 32, 4, 2),
    (32, 32, 4, 2),
  ),
  ("fwd", 2, 256): ((64, 64, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("fwd", 4, 64): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("fwd", 4, 128): ((16, 32, 4, 2), (16, 16, 4, 2)),
  ("bwd", 2, 64): ((64, 64, 4, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)),
  ("bwd", 2, 128): (
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 8, 2),
    (64, 32, 4, 2),
    (32, 32, 8, 2),
    (32, 32, 4, 2),
  ),
  ("bwd", 2, 256): ((32, 32, 8, 2), (32, 32, 8, 1), (16, 16, 4, 2)),
  ("bwd", 4, 64): ((64, 32, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2), (16, 16, 4, 2)),
  ("bwd", 4, 128): ((16, 16, 4, 2),),
  ("jvp", 2, 64): ((64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2)),
  ("jvp", 2, 128): ((32, 32, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)),
  ("jvp", 2, 256): ((16, 32, 4, 2), (16, 16, 4, 2)),
  ("jvp", 4, 64): ((16, 16, 4, 2), (16, 16, 4, 3), (16, 16, 8, 2)),
}


# The configs above that spill once the kernel also masks by segment ids and
# soft-caps its logits (``pallax.verify``'s ``attention_features``: the cap's
# derivative and the segment ids take registers of their own).
_TRITON_SPILL_WITH_FEATURES = {
  ("fwd", 2, 128): {(128, 64, 8, 2), (128, 64, 8, 3)},
  ("fwd", 4, 64): {(32, 32, 8, 2)},
  ("fwd", 4, 128): {(16, 32, 4, 2)},
  ("jvp", 2, 64): {(64, 64, 8, 2)},
  ("jvp", 2, 256): {(16, 32, 4, 2)},
  ("jvp", 4, 64): {(16, 16, 4, 2), (16, 16, 4, 3)},
  ("bwd", 2, 128): {(64, 32, 4, 2)},
  ("bwd", 2, 256): {(32, 32, 8, 2), (32, 32, 8, 1)},
}


# The raw Triton kernels' twins of the configs above (the executor times a raw
# twin of each Pallas candidate) that ptxas spilled, for H100 (sm_90a) or A100
# (sm_80): measured at (B, T, N, K, H) = (2, 1024, 8, 8, 64), (1, 1000, 8, 2,
# 128), (1, 1000, 8, 2, 80) and (1, 2048, 4, 4, 256), causal and with lengths,
# a two-sided window and a soft cap. Spills again moved between neighbours
# (float32 dk/dv at 64x32 blocks and 8 warps took 64 registers and spilled 10
# KB on sm_90a, at 32x32 none). No twin overflowed shared memory (the most:
# 160 KiB of H100's 227 KiB, the 16-bit forward at head dim 256 with 64x64
# blocks; 105 KiB of A100's 163 KiB). No float32 backward at head dim 128 is
# left: its dq kernel spilled 8 bytes with every feature on. pallax.verify's
# sweep found one more: the 16-bit forward at head dim 128 with 64x64 blocks
# on 4 warps, without a mask (no causal, window or lengths), on A100.
_RAW_SPILLS = {
  ("fwd", 2, 128): {(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2)},
  ("fwd", 4, 64): {(32, 32, 4, 2)},
  ("fwd", 4, 128): {(16, 32, 4, 2)},
  ("bwd", 2, 64): {(64, 64, 4, 2)},
  ("bwd", 2, 128): {(64, 64, 8, 2), (64, 32, 4, 2)},
  ("bwd", 4, 64): {(64, 32, 8, 2), (16, 32, 4, 2)},
  ("bwd", 4, 128): {(16, 16, 4, 2)},
}


def _triton_configs(
  p: Problem, stage: str, implementation: str = "pallas"
) -> list[AttentionConfig]:
  """The verified Triton configs of a call, blocks clamped to its lengths (may be empty)."""
  width = 4 if jnp.dtype(p.dtype).itemsize == 4 else 2
  key = (stage, width, max(_head(p), 64))
  if implementation == triton_raw.IMPLEMENTATION:
    spill = _RAW_SPILLS.get(key, set())
  elif p.has_segments or p.soft_cap is not None:
    spill = _TRITON_SPILL_WITH_FEATURES.get(key, set())
  else:
    spill = set()
  clamp = lambda x, n: min(x, max(16, next_pow2(n)))
  return list(
    dict.fromkeys(
      AttentionConfig(
        block_q=clamp(bq, p.t),
        block_k=clamp(bk, p.s),
        num_warps=w,
        num_stages=st,
        implementation=implementation,
      )
      for bq, bk, w, st in _TRITON_CONFIGS.get(key, ())
      if (bq, bk, w, st) not in spill
    )
  )


def _triton_heuristic(p: Problem, stage: str) -> AttentionConfig:
  """The first verified config; 64x64 blocks where there is none (``supports`` refuses them)."""
  configs = _triton_configs(p, stage)
  return configs[0] if configs else AttentionConfig(block_q=64, block_k=64)


# TPU blocks in order of preference (multiples of (8, 128)): large blocks
# amortise the per-step overhead; the first whose VMEM fits is the heuristic's.
_TPU_BLOCKS = ((512, 512), (256, 512), (256, 256), (128, 256), (128, 128))


def _tpu_configs(p: Problem) -> list[AttentionConfig]:
  """TPU block shapes clamped to the call (a block covering T or S is whole)."""
  return list(
    dict.fromkeys(
      AttentionConfig(block_q=min(bq, p.t), block_k=min(bk, p.s)) for bq, bk in _TPU_BLOCKS
    )
  )


def _tpu_heuristic(p: Problem, stage: str) -> AttentionConfig:
  configs = _tpu_configs(p)
  return next((c for c in configs if tpu_vmem(p, c) <= TPU_VMEM_BUDGET), configs[-1])


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
    return _triton_heuristic(p, stage)
  return _tpu_heuristic(p, stage)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params) -> list[AttentionConfig]:
  """The autotuning space: the verified Triton configs, or TPU block shapes."""
  p = Problem.of(avals, **params)
  backend = kernel_backend(target)
  base = heuristic(avals, target, stage=stage, **params)
  if interpreted(target):
    return [base]
  if backend == "triton":
    out = _triton_configs(p, stage)
  else:
    out = [
      AttentionConfig(block_q=bq, block_k=bk) for bq in (128, 256, 512) for bk in (128, 256, 512)
    ]
  legal = [c for c in out if supports(avals, target, c, stage=stage, **params) is None]
  return list(dict.fromkeys([base, *legal]))


def supports(
  avals: Sequence[Any], target: str, config: AttentionConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, **params)
  if p.dtype == jnp.float64:
    return "float64 has no attention kernel"
  if config.implementation == triton_raw.IMPLEMENTATION:
    return _raw_reason(p, target, config, stage)
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
  reason = _triton_blocks_reason(p, config)
  if reason is None and not interpreted(target) and not _triton_configs(p, stage):
    reason = (
      f"no {stage} Triton config compiles spill-free for {jnp.dtype(p.dtype).name} at head dim "
      f"{max(p.head_dim, p.value_dim)} (float32 dots at precision HIGHEST need too many registers)"
    )
  return reason


def _triton_blocks_reason(p: Problem, config: AttentionConfig) -> Optional[str]:
  """Why a Triton kernel (Pallas or raw) cannot take ``config``'s blocks and warps, if so."""
  for name in ("block_q", "block_k"):
    value = getattr(config, name)
    if value & (value - 1) or value < 16:
      return f"{name}={value} must be a power of two >= 16 on Triton"
  if _head(p) > 256:
    return f"head dims up to 256 on Triton, got {max(p.head_dim, p.value_dim)}"
  return triton_warps_reason(config)


def raw_feature_reason(p: Problem) -> Optional[str]:
  """Why the raw Triton kernels cannot run a call's features, if they cannot.

  They implement lengths, windows, the soft cap and GQA; a bias, a mask and
  segment ids are the Pallas kernels' (their operands would each need their
  own tiles and loop structure in the raw kernels).
  """
  features = ((p.has_bias, "bias"), (p.has_mask, "mask"), (p.has_segments, "segment ids"))
  for present, name in features:
    if present:
      return f"the raw Triton attention kernels take no {name} (the Pallas kernels do)"
  return None


def _raw_reason(p: Problem, target: str, config: AttentionConfig, stage: str) -> Optional[str]:
  """``supports`` for a raw Triton config: features, blocks, the verified configs."""
  reason = raw_feature_reason(p) or _triton_blocks_reason(p, config)
  if (
    reason is None
    and not interpreted(target)
    and config not in _triton_configs(p, stage, config.implementation)
  ):
    reason = (
      f"raw Triton {stage} config {config} is not one that compiles spill-free within shared "
      f"memory for {jnp.dtype(p.dtype).name} at head dim {max(p.head_dim, p.value_dim)}"
    )
  return reason
