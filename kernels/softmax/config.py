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

from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.pallas_utils import next_pow2, sublanes, triton_warps_reason


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


# Elements per program's (block_rows, block_cols) tile and the widest column
# block: Triton holds the tile in registers, TPU in (double-buffered) VMEM.
_TRITON_TILE, _TRITON_MAX_COLS = 8192, 8192
_TPU_TILE, _TPU_MAX_COLS, _TPU_LANES = 262144, 8192, 128


def _rows_cols(avals) -> tuple[int, int]:
  """Rows and columns of a call, at least 1 each (empty calls run no kernel)."""
  x = avals[0]
  return max(1, math.prod(x.shape[:-1])), max(1, x.shape[-1])


def _masked(avals) -> bool:
  return avals[-1].dtype == jnp.bool_


def _tpu_row_tile(avals) -> int:
  """Row multiple on TPU: the data's sublane tile, or int8's (32) with a mask."""
  sub = sublanes(avals[0].dtype)
  return max(sub, sublanes(jnp.int8)) if _masked(avals) else sub


def _backend_heuristic(avals, backend: str) -> SoftmaxConfig:
  """The whole row in one block up to 8192 columns; rows to fill the tile."""
  rows, cols = _rows_cols(avals)
  if backend == "triton":
    block_cols = min(next_pow2(cols), _TRITON_MAX_COLS)
    block_rows = max(1, min(next_pow2(rows), _TRITON_TILE // block_cols, 64))
    num_warps = next_pow2(max(1, min(16, block_rows * block_cols // 1024)))
    return SoftmaxConfig(block_rows=block_rows, block_cols=block_cols, num_warps=num_warps)
  block_cols = cols if cols <= _TPU_MAX_COLS else 2048
  tile = _tpu_row_tile(avals)
  block_rows = min(max(tile, (_TPU_TILE // block_cols) // tile * tile), 1024)
  return SoftmaxConfig(block_rows=min(block_rows, rows), block_cols=block_cols)


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
    widest = min(next_pow2(cols), 2 * _TRITON_MAX_COLS)
    out = [
      SoftmaxConfig(block_rows=br, block_cols=bc, num_warps=w)
      for bc in sorted({widest, max(widest // 2, 1), max(widest // 4, 1)})
      if bc >= min(widest, 128)
      for br in (1, 2, 4, 8, 16, 32, 64)
      if br <= next_pow2(rows) and br * bc <= 32768
      for w in (2, 4, 8, 16)
      if w * 32 <= br * bc
    ]
  else:
    tile = _tpu_row_tile(avals)
    itemsize = jnp.dtype(avals[0].dtype).itemsize
    widths = ([cols] if cols <= 2 * _TPU_MAX_COLS else []) + [
      c for c in (512, 1024, 2048, 4096) if c < cols
    ]
    out = [
      SoftmaxConfig(block_rows=br, block_cols=bc)
      for bc in widths
      for br in sorted({tile, 2 * tile, 4 * tile, 8 * tile, 256, 512, 1024})
      if br % tile == 0 and br * bc * itemsize <= 2**21
    ]
  return out or [base]


def supports(avals: Sequence[Any], target: str, config: SoftmaxConfig, **params) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  rows, cols = _rows_cols(avals)
  dtype = avals[0].dtype
  if kernel_backend(target) == "mosaic_tpu":
    if dtype == jnp.float64:
      return "float64 has no Mosaic TPU kernel"
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
  return triton_warps_reason(config)


CONFIG_CLS = SoftmaxConfig
