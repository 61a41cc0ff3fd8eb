"""The cross-entropy kernels' config: ``CrossEntropyConfig``, heuristic, autotuning space, legality.

One config class serves the three stages (forward, tangent, backward) of both
ops; the executor selects one per stage and call.
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
from pallax.kernels.cross_entropy.common import Problem


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig(KernelConfig):
  """Blocks of the cross-entropy kernels.

  block_n: tokens per program (Triton: a power of two >= 16; TPU: a multiple
    of the sublane tile or all tokens).
  block_v: vocabulary columns per step (Triton: a power of two >= 16; TPU: a
    multiple of 128 or the whole vocabulary).
  block_d: hidden columns per step of the logits' matmul (``linear`` only;
    Triton: a power of two >= 16; TPU: a multiple of 128 or all of D).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """

  block_n: int
  block_v: int
  block_d: int = 64
  num_warps: int = 4
  num_stages: int = 2


CONFIG_CLS = CrossEntropyConfig


def _problem(avals, params) -> Problem:
  return Problem.of(avals, **params)


# The Triton tiles, ``block_n x block_v x block_d x num_warps x num_stages``,
# per kind of call (with the logits' matmul or not) and stage, in order of
# preference. A call takes those ``pallax.verify`` did not see spill or
# overflow shared memory on its devices (``facts``:
# ``defaults/<device>/cross_entropy_<stage>.json``, per kind of call and
# width of the matmul's operands). What spilled there: float32 tiles over
# 64 x 64 x 16 in the tangent (its two accumulators, and float32 dots at
# precision HIGHEST run on FMAs) and over 32 x 128 x 32 elsewhere; 16-bit
# 128 x 128 and 64 x 128 x 64 tiles in the backward (its dw kernel holds g, the
# dw tile and its update), 64 x 128 tiles and 64-deep D steps in the tangent
# (A100); logits-only rows over 32 (forward) or 64 (tangent, backward) float32
# elements per thread.
_TRITON_SPACE = {
  ("linear", "fwd"): "64x128x32x4x3 128x128x32x8x2 32x128x64x4x2 64x64x64x4x2 "
  "32x128x32x8x2 64x64x32x8x2 32x64x32x4x2 16x128x32x4x2",
  ("linear", "jvp"): "64x64x32x4x2 32x128x32x4x2 16x64x16x4x2 64x64x16x8x2",
  ("linear", "bwd"): "64x128x32x8x2 64x64x64x4x2 64x64x32x4x2 32x128x32x8x2 32x64x16x4x2 "
  "16x64x16x4x2 32x128x16x8x2",
  ("logits", "fwd"): "16x512x16x8x2 16x256x16x4x2",
  ("logits", "jvp"): "16x1024x16x8x2 16x512x16x4x2",
  ("logits", "bwd"): "16x1024x16x8x2 16x512x16x4x2",
}


def call_facts(avals: Sequence[Any], **params) -> dict[str, Any]:
  """What the compiler verdicts on a call's configs depend on (``pallax.executor.facts``).

  linear: whether the kernel computes the logits (a matmul); width: the widest
  operand's bytes an element (2 or 4).
  """
  return _facts(_problem(avals, params))


def _facts(p: Problem) -> dict[str, Any]:
  dtypes = (p.dtype, p.w_dtype) if p.linear else (p.dtype,)
  wide = max(jnp.dtype(d).itemsize for d in dtypes)
  return {"linear": p.linear, "width": 2 if wide <= 2 else 4}


def _rejection(p: Problem, target: str, stage: str, config: CrossEntropyConfig) -> Optional[str]:
  return facts.rejection(target, f"cross_entropy_{stage}", config, _facts(p))


def _triton_tiles(
  p: Problem, target: str, stage: str, judged: bool = True
) -> list[CrossEntropyConfig]:
  """The call's tiles no verdict rejects, each clamped to the problem (powers of two >= 16).

  The verdicts are about the tiles of ``_TRITON_SPACE``, before clamping;
  ``judged=False``: all of them.
  """
  fit = lambda block, extent: min(block, max(16, pu.next_pow2(extent)))
  space = [
    CrossEntropyConfig(block_n=bn, block_v=bv, block_d=bd, num_warps=warps, num_stages=stages)
    for bn, bv, bd, warps, stages in pu.config_space(
      _TRITON_SPACE["linear" if p.linear else "logits", stage]
    )
  ]
  return [
    dataclasses.replace(
      c,
      block_n=fit(c.block_n, p.tokens),
      block_v=fit(c.block_v, p.vocab),
      block_d=fit(c.block_d, p.hidden) if p.linear else c.block_d,
    )
    for c in space
    if not judged or _rejection(p, target, stage, c) is None
  ]


def _triton_heuristic(p: Problem, target: str, stage: str) -> CrossEntropyConfig:
  """The first tile of the call's kind no verdict rejects (else the first of its space)."""
  return (_triton_tiles(p, target, stage) or _triton_tiles(p, target, stage, judged=False))[0]


# -- Mosaic TPU --------------------------------------------------------------------

# The kernels raise their scoped VMEM limit (``vmem_limit_bytes``) to this, and
# a config's model may reach the cap (``supports``; ``pallax.pallas_utils``).
TPU_VMEM_LIMIT = pu.TPU_VMEM_RAISED_LIMIT
_TPU_VMEM_CAP = pu.TPU_VMEM_RAISED_BUDGET

# float32 (block_n, block_v) temporaries of the tile math the model counts.
_TPU_TEMPS = 6


def _up(n: int, m: int) -> int:
  return -(-n // m) * m


def tpu_vmem(p: Problem, config: CrossEntropyConfig, stage: str) -> int:
  """Modelled scoped VMEM of the stage's largest Mosaic kernel with ``config``, in bytes.

  Double-buffered operand and result blocks (tiles padded to (16, 128);
  ``(block_n, 1)`` columns take 128 lanes), float32 scratch and the tile
  math's float32 temporaries. The backward reads all of ``D`` a step.
  """
  bn, bv = _up(min(config.block_n, p.tokens), 16), _up(min(config.block_v, p.vocab), 128)
  ix = jnp.dtype(p.dtype).itemsize
  # (block_n, 1) float32 columns (labels, results, statistics, their scratch).
  cols = lambda n: pu.VmemBuffer((bn, 1), 4, copies=n)
  temps = pu.VmemBuffer((bn, bv), 4, copies=_TPU_TEMPS)
  if not p.linear:
    blocks, columns = {"fwd": (2, 12), "jvp": (4, 13), "bwd": (4, 10)}[stage]
    return pu.tpu_vmem_bytes([pu.VmemBuffer((bn, bv), ix, copies=blocks), cols(columns), temps])
  iw = jnp.dtype(p.w_dtype).itemsize
  d = _up(p.hidden, 128)
  bias = pu.VmemBuffer((16, bv), 4, copies=2 * p.has_bias)
  if stage == "bwd":
    x, w = pu.VmemBuffer((bn, d), ix, copies=1), pu.VmemBuffer((d, bv), iw, copies=1)
    # dx: x, w, dx blocks, masked w; accumulator and product. dw: x, w, dw
    # blocks, masked / transposed x; accumulator and product.
    dx = pu.tpu_vmem_bytes([_times(x, 4), _times(w, 3), pu.VmemBuffer((bn, d), 4, copies=2)])
    dw = pu.tpu_vmem_bytes([_times(w, 4), _times(x, 4), pu.VmemBuffer((d, bv), 4, copies=2)])
    return max(dx, dw) + pu.tpu_vmem_bytes([bias, cols(10), temps])
  bd = min(config.block_d, p.hidden)
  split = bd < p.hidden
  step = _up(bd, 128)  # D steps counted in whole 128-wide tiles in both factors
  x, w = pu.VmemBuffer((bn, step), ix, copies=1), pu.VmemBuffer((step, bv), iw, copies=1)
  tile = pu.VmemBuffer((bn, bv), 4, copies=split)  # the partial logits over D steps
  # With D split, the hidden tail zeroed in both factors (one copy each).
  if stage == "fwd":
    buffers = [_times(x, 2 + split), _times(w, 2 + split), bias, cols(12), tile, temps]
    return pu.tpu_vmem_bytes(buffers)
  # The tangent's float32 dots over all of D hold about four more block copies
  # (the MXU takes float32 operands as bfloat16 parts): v5e's compile reports
  # 37.6 MiB at (16, 512, 2048) float32 where the terms above give 16.8.
  parts = 4 if not split and max(ix, iw) == 4 else 0
  buffers = [
    _times(x, 4 + 2 * split + parts),
    _times(w, 4 + 2 * split + parts),
    _times(bias, 2),
    cols(13),
    _times(tile, 2),
    temps,
  ]
  return pu.tpu_vmem_bytes(buffers)


def _times(buffer: pu.VmemBuffer, n: int) -> pu.VmemBuffer:
  return dataclasses.replace(buffer, copies=buffer.copies * n)


def _mosaic_heuristic(p: Problem, stage: str) -> CrossEntropyConfig:
  """Big tiles within ``TPU_VMEM_RAISED_TARGET`` of modelled VMEM.

  Without ``linear`` (bandwidth-bound): 2048-column blocks (the whole
  vocabulary up to 2048) and about 256K logits a block. With ``linear``
  (MXU-bound): 256 tokens (each weight block is reused by that many rows) by
  512 columns (256 in the backward, which holds all of D), and all of D per
  step in the forward and tangent when it fits (x's block is then fetched once
  per token block); blocks shrink (D first, then columns, then tokens) until
  the model fits.
  """
  tile = pu.sublanes(p.dtype)
  rows = lambda n: p.tokens if p.tokens <= n else max(tile, n // tile * tile)
  cols = lambda n: p.vocab if p.vocab <= n else n
  if not p.linear:
    block_v = cols(2048)
    block_n = rows(min(512, max(tile, (1 << 18) // block_v)))
    config = CrossEntropyConfig(block_n=block_n, block_v=block_v, block_d=128)
    while tpu_vmem(p, config, stage) > pu.TPU_VMEM_RAISED_TARGET and config.block_n > tile:
      config = dataclasses.replace(config, block_n=rows(config.block_n // 2))
    return config
  bwd = stage == "bwd"
  steps = [dict(block_d=d) for d in (2048, 1024, 512, 256) if d < p.hidden and not bwd]
  steps += [dict(block_v=cols(v)) for v in (256, 128)]
  steps += [dict(block_n=rows(n)) for n in (128, 64, 32, tile)]
  config = CrossEntropyConfig(
    block_n=rows(256), block_v=cols(256 if bwd else 512), block_d=p.hidden
  )
  for step in steps:
    if tpu_vmem(p, config, stage) <= pu.TPU_VMEM_RAISED_TARGET:
      break
    config = dataclasses.replace(config, **step)
  return config


def _mosaic_candidates(p: Problem, base: CrossEntropyConfig) -> list[CrossEntropyConfig]:
  """The heuristic and its neighbours: tokens x2 or /2, columns x2 or /2 (``supports`` filters)."""
  tile = pu.sublanes(p.dtype)
  rows = lambda n: p.tokens if p.tokens <= n else max(tile, n // tile * tile)
  cols = lambda n: p.vocab if p.vocab <= n else max(128, n // 128 * 128)
  out = [base]
  for bn in (base.block_n // 2, base.block_n * 2):
    out.append(dataclasses.replace(base, block_n=rows(bn)))
  for bv in (base.block_v // 2, base.block_v * 2):
    out.append(dataclasses.replace(base, block_v=cols(bv)))
  return out


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params) -> CrossEntropyConfig:
  """The kernel's config for this call."""
  p = _problem(avals, params)
  if kernel_backend(target) == "triton":
    return _triton_heuristic(p, target, stage)
  return _mosaic_heuristic(p, stage)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params):
  """The autotuning space (the heuristic alone for interpreted targets)."""
  base = heuristic(avals, target, stage=stage, **params)
  if interpreted(target):
    return [base]
  p = _problem(avals, params)
  if kernel_backend(target) == "triton":
    out = _triton_tiles(p, target, stage)
  else:
    out = _mosaic_candidates(p, base)
  return [
    c for c in dict.fromkeys(out) if supports(avals, target, c, stage=stage, **params) is None
  ]


def supports(
  avals: Sequence[Any], target: str, config: CrossEntropyConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = _problem(avals, params)
  if kernel_backend(target) == "mosaic_tpu":
    if p.dtype == jnp.float64:
      return "float64 has no Mosaic TPU kernel"
    reason = pu.mosaic_dtype_reason([a.dtype for a in avals], target)
    if reason:
      return reason
    tile = pu.sublanes(p.dtype)
    if config.block_n < p.tokens and config.block_n % tile:
      return f"block_n={config.block_n} must be a multiple of {tile} on TPU (or cover all tokens)"
    if config.block_v < p.vocab and config.block_v % 128:
      return f"block_v={config.block_v} must be a multiple of 128 on TPU (or cover the vocabulary)"
    if p.linear and config.block_d < p.hidden and config.block_d % 128:
      return f"block_d={config.block_d} must be a multiple of 128 on TPU (or cover all of D)"
    vmem = tpu_vmem(p, config, stage)
    if not interpreted(target) and vmem > _TPU_VMEM_CAP:
      return (
        f"{config} needs about {vmem / pu.MiB:.1f} MiB of VMEM in the {stage} stage, over the "
        f"{_TPU_VMEM_CAP // pu.MiB} MiB a Mosaic TPU cross-entropy kernel may take"
      )
    return None
  if p.stat_dtype != jnp.float32:
    return "float64 has no Triton cross-entropy kernel (it computes in float32)"
  for name in ("block_n", "block_v", "block_d"):
    value = getattr(config, name)
    if value < 16 or value & (value - 1):
      return f"{name}={value} must be a power of two >= 16 on Triton"
  return pu.triton_warps_reason(config)
