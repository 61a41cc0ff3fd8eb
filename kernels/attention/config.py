"""The attention kernels' config: ``AttentionConfig``, heuristics, autotuning space, legality.

One config class serves the forward, tangent and backward kernels; each
stage has its own heuristic (the backward holds more accumulators per block).

The forward and backward also have raw Triton kernels (``triton_raw.py``),
chosen by a config with ``implementation="triton_raw"``. The heuristic always
returns the Pallas kernel's config: which of the two runs faster is decided by
timing them, when autotuning on a GPU, where the executor adds a raw twin of
each Pallas candidate; ``supports`` refuses the twins that spill (the
``triton_raw`` verdicts of ``pallax.executor.facts``) and the features the raw
kernels lack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import pallas_utils as pu
from pallax import triton_raw
from pallax.executor import facts
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.attention.common import Problem


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
  return pu.next_pow2(max(p.head_dim, p.value_dim, 16))


# The Triton configs, ``block_q x block_k x num_warps x num_stages``, per stage
# in order of preference. A call's candidates are those that ``pallax.verify``
# did not see spill or overflow shared memory on its devices (``facts``:
# ``defaults/<device>/dot_product_attention_<stage>.json``), where a register
# model did not predict spills reliably: float32 dots at precision HIGHEST
# hold their operands in registers, spills moved by tens of bytes between
# neighbouring configs and between H100 and A100, and segment ids and a soft
# cap take registers of their own. The verdicts hold per operand width
# (float32 or 16-bit), padded head dim (smaller heads count as 64) and, for
# the Pallas kernels, whether the call has those features (``call_facts``).
# A call with no config left (the float32 tangent from head dim 80 up,
# float32 at 256) runs the XLA program, visibly. Measured on an H200
# (bench/hopper_tune.py, bf16, B=4, S=4096, N=16, H=128), the backward's
# 64x32x4x2 took 0.63x the time of 64x64x8x2 (0.69x causal): it comes before.
_TRITON_SPACE = {
  "fwd": "128x64x8x2 128x64x8x3 64x64x4x2 64x64x8x2 64x32x8x2 64x32x4x2 32x32x8x2 "
  "32x32x4x2 16x32x4x2 16x16x4x2",
  "bwd": "64x64x4x2 64x32x4x2 64x64x8x2 64x64x8x3 64x32x8x2 32x32x8x2 32x32x4x2 "
  "32x32x8x1 16x32x4x2 16x16x4x2",
  "jvp": "64x64x8x2 64x32x8x2 64x32x4x2 32x32x8x2 32x32x4x2 16x32x4x2 16x16x4x2 "
  "16x16x4x3 16x16x8x2",
}


def call_facts(avals: Sequence[Any], **params) -> dict[str, Any]:
  """What the compiler verdicts on a call's configs depend on (``pallax.executor.facts``).

  width: the operands' bytes an element (2 or 4); head: the padded head dim
  (64, 128 or 256; smaller heads count as 64); features: segment ids, a
  soft cap, a bias or a mask (their registers: the tangent of a bias and a
  mask spilled 16 bytes in the 64 x 64 blocks of 8 warps the verdicts kept
  for plain calls, float16 on A100).
  """
  return _facts(Problem.of(avals, **params))


def _facts(p: Problem) -> dict[str, Any]:
  return {
    "width": 4 if jnp.dtype(p.dtype).itemsize == 4 else 2,
    "head": max(_head(p), 64),
    "features": p.has_segments or p.soft_cap is not None or p.has_bias or p.has_mask,
  }


def _triton_configs(
  p: Problem, target: str, stage: str, implementation: str = "pallas"
) -> list[AttentionConfig]:
  """The Triton configs of a call no verdict rejects, blocks clamped to its lengths (may be empty).

  The verdicts are about the configs of ``_TRITON_SPACE``, before clamping.
  """
  kernel, call = f"dot_product_attention_{stage}", _facts(p)
  clamp = lambda x, n: min(x, max(16, pu.next_pow2(n)))
  space = [
    AttentionConfig(
      block_q=bq, block_k=bk, num_warps=w, num_stages=st, implementation=implementation
    )
    for bq, bk, w, st in pu.config_space(_TRITON_SPACE[stage])
  ]
  return list(
    dict.fromkeys(
      dataclasses.replace(c, block_q=clamp(c.block_q, p.t), block_k=clamp(c.block_k, p.s))
      for c in space
      if facts.rejection(target, kernel, c, call) is None
    )
  )


def _triton_heuristic(p: Problem, target: str, stage: str) -> AttentionConfig:
  """The first config left; 64x64 blocks where there is none (``supports`` refuses them)."""
  configs = _triton_configs(p, target, stage)
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
  return next((c for c in configs if tpu_vmem(p, c) <= pu.TPU_VMEM_BUDGET), configs[-1])


def tpu_vmem(p: Problem, config: AttentionConfig) -> int:
  """Scoped VMEM of a TPU attention kernel: blocks (double-buffered) and float32 scratch.

  Per grid step a kernel reads a query-side block (q, dq or do: block_q x H),
  a key-side one (k, v, their tangents: block_k x H) and, with a bias or mask,
  a (block_q, block_k) tile, and holds float32 logits and probabilities.
  """
  item = jnp.dtype(p.dtype).itemsize
  h = max(p.head_dim, p.value_dim)
  bq, bk = config.block_q, config.block_k
  tile = (bq, bk)
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer((bq, h), item, copies=2 * 3, padded=False),
      pu.VmemBuffer((bk, h), item, copies=2 * 4, padded=False),
      pu.VmemBuffer(tile, 4, copies=4, padded=False),  # logits, probabilities and their updates
      pu.VmemBuffer(tile, item + 1, copies=2 * (p.has_bias + p.has_mask), padded=False),
      pu.VmemBuffer((bq, h), 4, copies=3, padded=False),  # scratch
      pu.VmemBuffer((bk, h), 4, copies=2, padded=False),
    ]
  )


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params) -> AttentionConfig:
  p = Problem.of(avals, **params)
  if kernel_backend(target) == "triton":
    return _triton_heuristic(p, target, stage)
  return _tpu_heuristic(p, stage)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params) -> list[AttentionConfig]:
  """The autotuning space: the verified Triton configs, or TPU block shapes."""
  p = Problem.of(avals, **params)
  backend = kernel_backend(target)
  base = heuristic(avals, target, stage=stage, **params)
  if interpreted(target):
    return [base]
  if backend == "triton":
    out = _triton_configs(p, target, stage)
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
    reason = pu.mosaic_dtype_reason([p.dtype], target)
    if reason:
      return reason
    if config.block_q < p.t and config.block_q % _TPU_SUBLANES:
      return f"block_q={config.block_q} must be a multiple of 8 on TPU (or cover all {p.t} queries)"
    if config.block_k < p.s and config.block_k % _TPU_LANES:
      return f"block_k={config.block_k} must be a multiple of 128 on TPU (or cover all {p.s} keys)"
    if not interpreted(target) and tpu_vmem(p, config) > pu.TPU_VMEM_BUDGET:
      return f"blocks ({config.block_q}, {config.block_k}) need more than the VMEM budget"
    return None
  reason = _triton_blocks_reason(p, config)
  if reason is None and not interpreted(target) and not _triton_configs(p, target, stage):
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
  return pu.triton_warps_reason(config)


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
    and config not in _triton_configs(p, target, stage, config.implementation)
  ):
    reason = (
      f"raw Triton {stage} config {config} is not one that compiles spill-free within shared "
      f"memory for {jnp.dtype(p.dtype).name} at head dim {max(p.head_dim, p.value_dim)}"
    )
  return reason
