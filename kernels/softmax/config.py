"""The softmax kernels' config: ``SoftmaxConfig``, heuristic, autotuning space, legality.

One config class serves every softmax kernel (forward, tangent, backward of
both ops): they share the row-block structure.
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


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig(KernelConfig):
  """Block sizes of the softmax kernels (forward, tangent and backward).

  block_rows: rows per program (power of two on Triton; multiple of the
    sublane tile, or all rows, on TPU; 32 rows of int8 when there is a mask).
  block_cols: columns per block along the softmax axis; a longer row is
    reduced online over ``cdiv(cols, block_cols)`` blocks (power of two on
    Triton; multiple of 128, or the whole row, on TPU).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """

  block_rows: int
  block_cols: int
  num_warps: int = 4
  num_stages: int = 1


# The cache key's version: 2 since log_softmax's tangent and backward kernels
# take the input (an online max and sum more than before), so configs tuned
# for the earlier kernels are not reused.
VERSION = 2

# Elements per program's (block_rows, block_cols) tile and the widest column
# block: Triton holds the tile in registers, TPU in (double-buffered) VMEM.
_TRITON_TILE, _TRITON_MAX_COLS = 8192, 8192
_TPU_TILE, _TPU_MAX_COLS, _TPU_LANES = 262144, 8192, 128


def tpu_vmem(block_rows: int, block_cols: int, itemsize: int, masked: bool) -> int:
  """Scoped VMEM of the largest softmax kernel (the backward) for one block of the rows.

  Its two operands' blocks, double-buffered, the mask's, and four float32
  temporaries: libtpu's compile-only v5e/v6e targets reported at most 21.9
  bytes an element in bfloat16 and 31.4 in float32 over ``pallax.verify``'s
  sweep, where (256, 4096) bfloat16 blocks (2 MiB an operand) overflowed
  v5e's 16 MiB in both backward kernels.
  """
  block = (block_rows, block_cols)
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer(block, itemsize, copies=2 * 2, padded=False),
      pu.VmemBuffer(block, 1, copies=2 * masked, padded=False),
      pu.VmemBuffer(block, 4, copies=4, padded=False),
    ]
  )


def _rows_cols(avals) -> tuple[int, int]:
  """Rows and columns of a call, at least 1 each (empty calls run no kernel)."""
  x = avals[0]
  return max(1, math.prod(x.shape[:-1])), max(1, x.shape[-1])


def _masked(avals) -> bool:
  return avals[-1].dtype == jnp.bool_


def _tpu_row_tile(avals) -> int:
  """Row multiple on TPU: the data's sublane tile, or int8's (32) with a mask."""
  sub = pu.sublanes(avals[0].dtype)
  return max(sub, pu.sublanes(jnp.int8)) if _masked(avals) else sub


def _backend_heuristic(avals, backend: str) -> SoftmaxConfig:
  """The whole row in one block up to 8192 columns; rows to fill the tile."""
  rows, cols = _rows_cols(avals)
  if backend == "triton":
    block_cols = min(pu.next_pow2(cols), _TRITON_MAX_COLS)
    block_rows = max(1, min(pu.next_pow2(rows), _TRITON_TILE // block_cols, 64))
    num_warps = pu.next_pow2(max(1, min(16, block_rows * block_cols // 1024)))
    return SoftmaxConfig(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps)
  block_cols = cols if cols <= _TPU_MAX_COLS else 2048
  tile = _tpu_row_tile(avals)
  block_rows = min(max(tile, (_TPU_TILE // block_cols) // tile * tile), 1024)
  return SoftmaxConfig(block_rows=min(block_rows, rows), block_cols=block_cols)


# The Triton autotuning space: tiles of 2K-8K elements, the whole row (up to
# 8K columns) or a quarter of it per block, and the warps that give each thread
# 8 or 16 elements of the tile. ``pallax.verify`` compiled the space it
# replaced (up to 61 candidates a call) for H100 and A100: log_softmax's
# tangent kernel spilled in float32 at 32 elements per thread when the row
# spans several column blocks ((8, 1024) and (2, 1024) blocks of 4096 columns,
# (32, 256) of 1024). The heuristic's blocks, 32 per thread, compiled
# spill-free over the sweep (whole rows up to 8192 columns, 8192-column blocks
# of a 50257-wide row).
_TRITON_TILES = (2048, 4096, 8192)


def _triton_widths(cols: int) -> list[int]:
  widest = min(pu.next_pow2(cols), _TRITON_MAX_COLS)
  return [widest // 4, widest] if widest >= 64 else [widest]


def _warps(tile: int, per_thread: int) -> int:
  return max(1, min(16, tile // (32 * per_thread)))


def heuristic(avals: Sequence[Any], target: str, **params) -> SoftmaxConfig:
  """The kernel's config for this call: see ``_backend_heuristic``."""
  return _backend_heuristic(avals, kernel_backend(target))


def candidates(avals: Sequence[Any], target: str, **params) -> list[SoftmaxConfig]:
  """The autotuning space: row and column blocks (and warps on Triton)."""
  rows, cols = _rows_cols(avals)
  backend = kernel_backend(target)
  base = _backend_heuristic(avals, backend)
  if interpreted(target):  # interpreted kernels are slow: the heuristic and a narrower block
    narrower = base.block_cols // 2
    legal = narrower % _TPU_LANES == 0 if backend == "mosaic_tpu" else narrower >= 16
    out = [base] + ([dataclasses.replace(base, block_cols=narrower)] if legal else [])
  elif backend == "triton":
    blocks = dict.fromkeys(
      (max(1, min(tile // bc, pu.next_pow2(rows))), bc)
      for bc in _triton_widths(cols)
      for tile in _TRITON_TILES
    )
    out = [
      SoftmaxConfig(block_rows=br, block_cols=bc, num_warps=w)
      for br, bc in blocks
      for w in sorted({_warps(br * bc, 8), _warps(br * bc, 16)})
    ]
  else:
    tile = _tpu_row_tile(avals)
    itemsize = jnp.dtype(avals[0].dtype).itemsize
    widths = ([cols] if cols <= _TPU_MAX_COLS else []) + [c for c in (512, 2048) if c < cols]
    out = [
      SoftmaxConfig(block_rows=br, block_cols=bc)
      for bc in widths
      for br in sorted({tile, 8 * tile, 256, 1024})
      if br % tile == 0 and tpu_vmem(br, bc, itemsize, _masked(avals)) <= pu.TPU_VMEM_BUDGET
    ]
  return out or [base]


def supports(avals: Sequence[Any], target: str, config: SoftmaxConfig, **params) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  rows, cols = _rows_cols(avals)
  dtype = avals[0].dtype
  if kernel_backend(target) == "mosaic_tpu":
    if dtype == jnp.float64:
      return "float64 has no Mosaic TPU kernel"
    reason = pu.mosaic_dtype_reason([a.dtype for a in avals], target)
    if reason:
      return reason
    if config.block_cols < cols and config.block_cols % _TPU_LANES:
      return (
        f"block_cols={config.block_cols} must be a multiple of {_TPU_LANES} on TPU "
        f"(or cover all {cols} columns)"
      )
    tile = _tpu_row_tile(avals)
    if config.block_rows < rows and config.block_rows % tile:
      with_mask = " with a where= mask" if _masked(avals) else ""
      return (
        f"block_rows={config.block_rows} must be a multiple of {tile} on TPU{with_mask} "
        f"(or cover all {rows} rows)"
      )
    return None
  for name in ("block_rows", "block_cols"):
    value = getattr(config, name)
    if value & (value - 1):
      return f"{name}={value} must be a power of two on Triton"
  return pu.triton_warps_reason(config)


CONFIG_CLS = SoftmaxConfig
