"""The matmul kernel's config: ``MatmulConfig``, heuristic, autotuning space, legality."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

from pallax import pallas_utils as pu
from pallax.executor import facts
from pallax.executor.config import KernelConfig
from pallax.executor.implementation import XLA
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.matmul.layout import Problem, problem_of


@dataclasses.dataclass(frozen=True)
class MatmulConfig(KernelConfig):
  """Tile sizes of the matmul kernel.

  block_m, block_n: the output tile; block_k: the K step. Triton: powers of
    two >= 16. TPU: multiples of 128 (a block at least as large as its dim
    covers the whole dim).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """

  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3


# ----------------------------------------------------------------------------
# Configs: heuristic, autotuning space, legality.

# On-chip memory the tiles may use: Triton's shared memory for the operand
# tiles of all pipeline stages (fits every GPU since V100), and TPU VMEM for
# the double-buffered tiles plus the accumulator (``TPU_VMEM_BUDGET``).
# Compiled (``pallax.verify``), the largest tile, 128x128x64 bfloat16 in 3
# stages, takes exactly this model's 96 KiB on H100 and 64 KiB on A100
# (Triton keeps one stage fewer in shared memory on sm_80): two blocks' worth
# of an SM's shared memory on both, while its 94-172 registers a thread (256
# threads) let one or two blocks run per SM.
TRITON_SMEM_BYTES = 96 * 1024
TPU_VMEM_BUDGET = pu.TPU_VMEM_BUDGET
_LANES = 128


def _triton_smem(config: MatmulConfig, itemsize: int) -> int:
  c = config
  tiles = ((c.block_m, c.block_k), (c.block_k, c.block_n))
  return pu.triton_smem_bytes(tiles, itemsize, c.num_stages)


def _tpu_vmem(bm: int, bn: int, bk: int, in_itemsize: int, out_itemsize: int, outputs: int) -> int:
  """The a and b blocks, ``outputs`` output blocks, double-buffered, and the float32 accumulator."""
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer((bm, bk), in_itemsize, padded=False),
      pu.VmemBuffer((bk, bn), in_itemsize, padded=False),
      pu.VmemBuffer((bm, bn), out_itemsize, copies=2 * outputs, padded=False),
      pu.VmemBuffer((bm, bn), 4, copies=1, padded=False),
    ]
  )


def _clamp_pow2(n: int, lo: int, hi: int) -> int:
  return max(lo, min(hi, pu.next_pow2(n)))


def _triton_heuristic(prob: Problem, target: str, itemsize: int, call: dict) -> MatmulConfig:
  """Output tiles up to 128x128, smaller for small M (or N); 3 stages if they fit.

  The K step is 64 for 2-byte inputs and 32 for 4-byte ones, or the other one
  where that tile spills (``_spills``).
  """
  bm = _clamp_pow2(prob.m, 16, 128)
  bn = _clamp_pow2(prob.n, 16, 128)
  bk = _clamp_pow2(prob.k, 16, 64 if itemsize <= 2 else 32)
  config = _with_stages(bm, bn, bk, itemsize, 3)
  other = {32: 64, 64: 32}.get(bk)
  fits = other is not None and other <= max(32, pu.next_pow2(prob.k))
  if fits and _spills(config, target, call):
    config = _with_stages(bm, bn, other, itemsize, 3)
  return config


# The autotuning space. Triton: output tiles up to 128x128 and a small-M one
# for skinny problems, with K steps of 32 and 64 (``_spills`` permitting), as
# many pipeline stages (up to 3) as fit, 8 warps for 128x128. TPU: square and
# 2:1 tiles with K steps of 256 and 512, blocks larger than a dim clamped to it
# (so small problems get few distinct candidates).
_TRITON_TILES = ((128, 128), (64, 128), (128, 64), (64, 64), (16, 128))


def call_facts(avals: Sequence[Any], **params) -> dict[str, Any]:
  """What the compiler verdicts on a call's configs depend on (``pallax.executor.facts``).

  The inputs' widest itemsize and whether a and b are stored transposed.
  """
  return {
    "itemsize": _itemsizes(avals, params)[0],
    "transpose_a": params["transpose_a"],
    "transpose_b": params["transpose_b"],
  }


def _spills(config: MatmulConfig, target: str, call: dict) -> bool:
  """Whether ``pallax.verify`` saw ptxas spill registers for this Triton config (``facts``).

  Its verdicts (``defaults/<device>/matmul.json``) come from the sweep's
  forward, backward and tangent calls. Left out of the space for spilling
  there: 128x256 and 256x128 tiles (in 30-100% of the calls, every dtype), 4
  pipeline stages (64x64x32, A100), and 8 warps on 128x64 (128x64x32, A100,
  2-byte tangent calls).
  """
  return facts.rejection(target, "matmul", config, call) is not None


_TPU_TILES = ((512, 512), (512, 256), (256, 512), (256, 256), (128, 512), (128, 128))


def _with_stages(bm: int, bn: int, bk: int, itemsize: int, stages: int) -> MatmulConfig:
  """A Triton config with ``stages`` stages, fewer if they do not fit ``TRITON_SMEM_BYTES``."""
  config = MatmulConfig(
    block_m=bm,
    block_n=bn,
    block_k=bk,
    num_warps=8 if bm * bn >= 128 * 128 else 4,
    num_stages=stages,
  )
  while _triton_smem(config, itemsize) > TRITON_SMEM_BYTES and config.num_stages > 1:
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  return config


def _tpu_heuristic(
  prob: Problem, in_itemsize: int, out_itemsize: int, outputs: int
) -> MatmulConfig:
  """512-wide tiles (whole dims when smaller), shrunk until they fit VMEM."""
  bm, bn, bk = 512, 512, 512
  fits = lambda bm, bn, bk: (
    _tpu_vmem(min(prob.m, bm), min(prob.n, bn), min(prob.k, bk), in_itemsize, out_itemsize, outputs)
    <= TPU_VMEM_BUDGET
  )
  while not fits(bm, bn, bk):
    if bk > _LANES:
      bk //= 2
    elif bm >= bn and bm > _LANES:
      bm //= 2
    else:
      bn //= 2
  return MatmulConfig(block_m=bm, block_n=bn, block_k=bk)


def _itemsizes(avals, params) -> tuple[int, int]:
  in_size = max(jnp.dtype(a.dtype).itemsize for a in avals[:2])
  return in_size, jnp.dtype(params["out_dtype"]).itemsize


def _backend_heuristic(avals, target: str, **params) -> MatmulConfig:
  prob = problem_of(avals, params)
  in_size, out_size = _itemsizes(avals, params)
  if kernel_backend(target) == "triton":
    return _triton_heuristic(prob, target, in_size, call_facts(avals, **params))
  return _tpu_heuristic(prob, in_size, out_size, 1 + params["save_preactivation"])


# Where XLA's GEMM (cuBLAS) is the heuristic's choice: plain 16-bit products on
# Hopper. Measured on an H200 (bench/test_matmul_hopper.py, two runs, bf16,
# 4096 and 8192 cubed, forward and forward+backward): cuBLAS was faster than
# both Pallas kernels in 6 of 8 cases (the Triton kernel at 0.76-0.99x of
# cuBLAS's time there, the Mosaic GPU one at 0.67-0.86x), and the two Pallas
# kernels tied within the runs' noise. A fused epilogue (bias, activation)
# was not measured there and stays on the kernel, which saves its pass.
_CUBLAS_DEVICES = ("h100", "h200")


def _cublas_preferred(avals: Sequence[Any], target: str, params: dict) -> bool:
  """Whether XLA's GEMM is the heuristic's choice for this call (``_CUBLAS_DEVICES``)."""
  plain = len(avals) == 2 and params["activation"] is None and not params["save_preactivation"]
  sixteen_bit = all(jnp.dtype(a.dtype).itemsize == 2 for a in avals)
  hopper = getattr(target, "device_kind", "") in _CUBLAS_DEVICES and not interpreted(target)
  return plain and sixteen_bit and hopper


def heuristic(avals: Sequence[Any], target: str, **params) -> MatmulConfig:
  """The kernel's config for this call (``_backend_heuristic``), made XLA's where cuBLAS wins.

  On an H100 or H200 a plain 16-bit product (no bias, no activation) runs
  XLA's GEMM: ``_CUBLAS_DEVICES`` says what was measured.
  """
  config = _backend_heuristic(avals, target, **params)
  if _cublas_preferred(avals, target, params):
    return dataclasses.replace(config, implementation=XLA)
  return config


def candidates(avals: Sequence[Any], target: str, **params) -> list[MatmulConfig]:
  """The autotuning space: tile shapes (and warps, stages on Triton)."""
  backend = kernel_backend(target)
  base = _backend_heuristic(avals, target, **params)
  prob = problem_of(avals, params)
  in_size, out_size = _itemsizes(avals, params)
  if interpreted(target):  # interpreted kernels are slow: two tilings
    smaller = dataclasses.replace(
      base, block_k=max(16 if backend == "triton" else _LANES, base.block_k // 2)
    )
    out = list(dict.fromkeys([base, smaller]))
  elif backend == "triton":
    out = []
    for bm, bn in _TRITON_TILES:
      if bm > max(16, pu.next_pow2(prob.m)) or bn > max(32, pu.next_pow2(prob.n)):
        continue
      for bk in (32, 64):
        config = _with_stages(bm, bn, bk, in_size, 3)
        fits = bk <= max(32, pu.next_pow2(prob.k))
        if fits and not _spills(config, target, call_facts(avals, **params)):
          out.append(config)
  else:
    outputs = 1 + params["save_preactivation"]
    tiles = {
      mosaic_blocks(prob, MatmulConfig(block_m=bm, block_n=bn, block_k=bk))
      for bm, bn in _TPU_TILES
      for bk in (256, 512)
    }
    out = [
      MatmulConfig(block_m=bm, block_n=bn, block_k=bk)
      for bm, bn, bk in sorted(tiles)
      if _tpu_vmem(bm, bn, bk, in_size, out_size, outputs) <= TPU_VMEM_BUDGET
    ]
  out = [c for c in out if supports(avals, target, c, **params) is None] or [base]
  return out


def mosaic_blocks(prob: Problem, config: MatmulConfig) -> tuple[int, int, int]:
  """TPU block sizes: a block at least as large as its dim is the whole dim."""
  return (min(config.block_m, prob.m), min(config.block_n, prob.n), min(config.block_k, prob.k))


def _mosaic_tiling_error(
  name: str, block: tuple[int, int], shape: tuple[int, int], dtype
) -> Optional[str]:
  rows, cols = block
  sub = pu.sublanes(dtype)
  if (rows % sub and rows != shape[0]) or (cols % _LANES and cols != shape[1]):
    return (
      f"the {name} block {block} of {shape} must be divisible by ({sub}, {_LANES}) "
      f"or equal the array's dims on TPU"
    )
  return None


def supports(avals: Sequence[Any], target: str, config: MatmulConfig, **params) -> Optional[str]:
  """Why ``config`` cannot run this call on ``target``, if it cannot."""
  a, b = avals[:2]
  if jnp.float64 in (a.dtype, b.dtype, params["out_dtype"]):
    return "float64 has no Pallas matmul kernel"
  reason = pu.mosaic_dtype_reason([a.dtype for a in avals] + [params["out_dtype"]], target)
  if reason:
    return reason
  backend = kernel_backend(target)
  blocks = (config.block_m, config.block_n, config.block_k)
  if backend == "triton":
    if any(x < 16 or x & (x - 1) for x in blocks):
      return f"blocks {blocks} must be powers of two >= 16 on Triton"
    return pu.triton_warps_reason(config)
  precision = params["precision"]
  if precision is not None and (
    precision[0] != precision[1]
    or precision[0] not in (lax.Precision.DEFAULT, lax.Precision.HIGHEST)
  ):
    return f"precision {precision} has no Mosaic TPU lowering (DEFAULT or HIGHEST only)"
  prob = problem_of(avals, params)
  bm, bn, bk = mosaic_blocks(prob, config)
  ta, tb = params["transpose_a"], params["transpose_b"]
  checks = [
    ("a", (bk, bm) if ta else (bm, bk), (prob.k, prob.m) if ta else (prob.m, prob.k), a.dtype),
    ("b", (bn, bk) if tb else (bk, bn), (prob.n, prob.k) if tb else (prob.k, prob.n), b.dtype),
    ("output", (bm, bn), (prob.m, prob.n), params["out_dtype"]),
  ]
  for name, block, shape, dtype in checks:
    error = _mosaic_tiling_error(name, block, shape, dtype)
    if error:
      return error
  return None


CONFIG_CLS = MatmulConfig
