"""Small helpers shared by the kernels, and the on-chip memory model of their configs.

The memory model (``VmemBuffer``, ``tpu_vmem_bytes``, ``triton_smem_bytes``)
and the TPU VMEM constants serve every family's heuristic and ``supports``:
a family describes its blocks (shapes, dtypes, buffering, scratch) and the
model adds them up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def stat_dtype(dtype) -> jnp.dtype:
  """Dtype of reductions and statistics: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1): Triton's block sizes."""
  return 1 << max(0, n - 1).bit_length()


def sublanes(dtype) -> int:
  """TPU sublane tile for ``dtype``: 8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit."""
  return _sublane_rows(jnp.dtype(dtype).itemsize)


def _sublane_rows(itemsize: int) -> int:
  return 8 * max(1, 4 // itemsize)


def in_bounds(block_index, block_size: int, extent: int, shape, axis: int) -> Optional[jax.Array]:
  """Which entries of a block of ``shape`` lie inside the array along ``axis``.

  The block is the ``block_index``-th of ``block_size`` along an array dim of
  ``extent``. None when ``block_size`` divides ``extent``: every block is whole.
  """
  if extent % block_size == 0:
    return None
  return block_index * block_size + lax.broadcasted_iota(jnp.int32, shape, axis) < extent


def masked(value: jax.Array, mask: Optional[jax.Array], fill=0) -> jax.Array:
  """``value`` where ``mask`` is True (everywhere if ``mask`` is None), else ``fill``."""
  return value if mask is None else jnp.where(mask, value, fill)


def and_masks(*masks: Optional[jax.Array]) -> Optional[jax.Array]:
  """The conjunction of the masks that are not None (None if all are)."""
  out = None
  for m in masks:
    out = m if out is None else out if m is None else out & m
  return out


def load(ref, bounds: Optional[jax.Array] = None, other=0) -> jax.Array:
  """A block of ``ref``; where ``bounds`` is False, ``other``, and memory is not read.

  Pallas-Triton does not bounds-check blocks that overhang the array (jax
  0.10.2 applies only the caller's mask): every load of such a block must be
  masked, or it reads past the array on a GPU.
  """
  return ref[...] if bounds is None else pltriton.load(ref, mask=bounds, other=other)


def store(ref, value: jax.Array, bounds: Optional[jax.Array] = None) -> None:
  """Writes ``value`` to ``ref``'s block, only where ``bounds`` is True (see ``load``)."""
  if bounds is None:
    ref[...] = value
  else:
    pltriton.store(ref, value, mask=bounds)


# -- On-chip memory: the model every kernel family's configs are checked with -----

MiB = 2**20
LANES = 128  # the TPU vector register's lanes: a block's last dim is padded to them


@dataclasses.dataclass(frozen=True)
class TpuVmem:
  """One TPU generation's VMEM: ``physical`` a core, ``default_limit`` a kernel's scoped share."""

  physical: int
  default_limit: int


# libtpu 0.0.42 reports the default scoped limits in its overflow errors
# ("limit 16.00M" on v5e, "32.00M" on v6e: ``pallax.verify``'s compile-only
# targets); both chips have 128 MiB of VMEM a core.
TPU_VMEM = {"v5e": TpuVmem(128 * MiB, 16 * MiB), "v6e": TpuVmem(128 * MiB, 32 * MiB)}
# What a kernel's modelled VMEM may reach without raising its limit: the
# smallest default limit (v5e's) less 4 MiB for what the models leave out.
TPU_VMEM_BUDGET = min(v.default_limit for v in TPU_VMEM.values()) - 4 * MiB
# The scoped limit a kernel that always raises it asks for (cross-entropy's):
# half the physical VMEM, the rest left to XLA's own buffers.
TPU_VMEM_RAISED_LIMIT = min(v.physical for v in TPU_VMEM.values()) // 2
# What such a kernel's modelled VMEM may reach (``supports``): a quarter of
# its limit is headroom for what the model leaves out.
TPU_VMEM_RAISED_BUDGET = 3 * TPU_VMEM_RAISED_LIMIT // 4
# What its heuristic's blocks stay under: room for larger autotuning candidates.
TPU_VMEM_RAISED_TARGET = TPU_VMEM_RAISED_BUDGET // 2
# The most a kernel that raises its limit only when its blocks need it (a norm
# over very wide rows) may ask for: most of the physical VMEM.
TPU_VMEM_CEILING = 100 * MiB


@dataclasses.dataclass(frozen=True)
class VmemBuffer:
  """One buffer a Mosaic TPU kernel holds in VMEM, as the memory model counts it.

  shape: the block, scratch or temporary's shape.
  itemsize: bytes an element.
  copies: how many of it the kernel holds: 2 for an operand or result block
    (Mosaic's pipeline double-buffers them), 1 for scratch or a temporary,
    ``n`` times that for ``n`` buffers alike.
  padded: count the last two dims padded to Mosaic's (sublane, lane) tile
    (``tpu_tile``), as Mosaic lays the buffer out; False for a family whose
    model is calibrated per element against libtpu's reports instead.
  """

  shape: tuple[int, ...]
  itemsize: int
  copies: int = 2
  padded: bool = True

  @property
  def nbytes(self) -> int:
    shape = tpu_tile(self.shape, self.itemsize) if self.padded else self.shape
    return self.copies * math.prod(shape) * self.itemsize


def tpu_tile(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
  """``shape`` with its last dim padded to 128 lanes and the one before to the sublane tile.

  The sublane tile is 8 rows of 32-bit elements, 16 of 16-bit, 32 of 8-bit
  (``sublanes``).
  """
  up = lambda n, m: -(-n // m) * m
  if len(shape) < 2:
    return tuple(up(n, LANES) for n in shape)
  return (*shape[:-2], up(shape[-2], _sublane_rows(itemsize)), up(shape[-1], LANES))


def tpu_vmem_bytes(buffers: Iterable[VmemBuffer]) -> int:
  """The scoped VMEM a Mosaic TPU kernel holding ``buffers`` needs, by the model."""
  return sum(b.nbytes for b in buffers)


def triton_smem_bytes(tiles: Iterable[tuple[int, int]], itemsize: int, num_stages: int) -> int:
  """Shared memory of a Triton kernel's pipelined operand ``tiles``: one copy per stage."""
  return num_stages * sum(rows * cols for rows, cols in tiles) * itemsize


def triton_elements_per_thread(block_elements: int, num_warps: int) -> int:
  """The elements of a Triton program's block each thread holds (32 threads a warp).

  The register model of the row-wise kernels (norms, softmax): a thread keeps
  its share of the block, and its float32 temporaries, in registers.
  """
  return block_elements // (32 * num_warps)


def config_space(text: str) -> tuple[tuple[int, ...], ...]:
  """A space of Triton configs written as ``"128x64x8x2 64x64x4x2 ..."``: their fields' values."""
  return tuple(tuple(int(n) for n in config.split("x")) for config in text.split())


def triton_warps_reason(config) -> Optional[str]:
  """Why a Triton config's ``num_warps`` cannot compile, if it cannot.

  Triton's layouts need a power of two: ``num_warps=3`` makes LLVM abort the
  whole process during compilation ("Out-dim sizes must be powers of 2").
  """
  warps = config.num_warps
  return None if warps & (warps - 1) == 0 else f"num_warps={warps} must be a power of two on Triton"


def mosaic_dtype_reason(dtypes, target: str) -> Optional[str]:
  """Why a Mosaic TPU kernel cannot take operands of ``dtypes`` on ``target``, if it cannot.

  float16: libtpu (0.0.42) rejects its vector loads when compiling for v5e and
  v6e ("Invalid vector type for load", found by ``pallax.verify``); the
  interpreted kernel runs it, so only the real ``tpu`` target refuses it.
  """
  if target == "tpu" and any(jnp.dtype(d) == jnp.float16 for d in dtypes):
    return "float16 has no Mosaic TPU kernel (libtpu cannot load float16 vectors on v5e/v6e)"
  return None


def triton_compiler_params(config) -> pltriton.CompilerParams:
  """Triton launch parameters from a config's ``num_warps`` and ``num_stages``."""
  return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


@dataclasses.dataclass(frozen=True)
class RowBlocks:
  """A ``(rows, cols)`` array cut into ``(block_rows, block_cols)`` blocks.

  The view the row-wise kernels (norms, softmax) share. On Triton blocks are
  powers of two, no larger than the array needs, and overhang its edges (the
  kernels mask them with ``rows_in_bounds`` / ``cols_in_bounds``); on Mosaic
  TPU a block is no larger than its dim and partial blocks are padded by
  Mosaic itself.
  """

  rows: int
  cols: int
  block_rows: int
  block_cols: int

  @classmethod
  def of(
    cls, rows: int, cols: int, block_rows: int, block_cols: Optional[int], backend: str
  ) -> RowBlocks:
    """The blocks of a ``(rows, cols)`` array; ``block_cols=None``: whole rows."""
    if backend == "triton":
      wide = next_pow2(cols)
      return cls(
        rows,
        cols,
        min(block_rows, next_pow2(rows)),
        wide if block_cols is None else min(block_cols, wide),
      )
    return cls(
      rows, cols, min(block_rows, rows), cols if block_cols is None else min(block_cols, cols)
    )

  @property
  def row_blocks(self) -> int:
    return pl.cdiv(self.rows, self.block_rows)

  @property
  def col_blocks(self) -> int:
    return pl.cdiv(self.cols, self.block_cols)

  @property
  def block(self) -> tuple[int, int]:
    return (self.block_rows, self.block_cols)

  def rows_in_bounds(self, row_block, shape=None) -> Optional[jax.Array]:
    """Which rows of a block of ``shape`` (default: one block) lie inside the array."""
    return in_bounds(row_block, self.block_rows, self.rows, shape or self.block, 0)

  def cols_in_bounds(self, col_block, shape=None) -> Optional[jax.Array]:
    """Which columns of a block of ``shape`` (default: one block) lie inside the array."""
    shape = shape or self.block
    return in_bounds(col_block, self.block_cols, self.cols, shape, len(shape) - 1)
