"""What the Pallas-Triton kernels share: masks of padded tiles, and their launch.

Pallas-Triton blocks are powers of two that may overhang an array's edges or
a dim padded to a power of two (a head dim of 80 in a block of 128), and
Pallas-Triton does not bound-check them: each kernel builds the masks of its
loads and stores from 1-D masks of a tile's rows and columns (None where a
dim is whole, so that a whole tile is loaded without a mask).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.pallas_utils import and_masks, triton_compiler_params


def padded_ok(size: int, extent: int) -> Optional[jax.Array]:
  """Which of ``size`` positions (a dim of ``extent`` padded to ``size``) lie inside it.

  Returns None when there is no padding (``size == extent``).
  """
  return None if size == extent else lax.broadcasted_iota(jnp.int32, (size,), 0) < extent


def tile_mask(rows_ok: Optional[jax.Array], cols_ok: Optional[jax.Array]) -> Optional[jax.Array]:
  """The 2-D mask of a tile from its rows' and its columns' 1-D masks (None: all inside)."""
  return and_masks(
    None if rows_ok is None else rows_ok[:, None], None if cols_ok is None else cols_ok[None, :]
  )


def triton_call(
  kernel: Callable[..., None],
  grid: tuple[int, ...],
  operands: Sequence[jax.Array],
  in_specs: Sequence[pl.BlockSpec],
  out_shapes: Sequence[jax.ShapeDtypeStruct],
  out_specs: Sequence[pl.BlockSpec],
  config: Any,
  interpret: Any,
  name: str,
) -> Any:
  """Runs Pallas kernel ``kernel`` over ``grid`` on Triton and returns its outputs.

  Args:
    kernel: the kernel body, taking the operands' refs then the outputs'.
    grid: the launch grid.
    operands: the kernel's inputs, in the order of ``in_specs``.
    in_specs: a BlockSpec per operand.
    out_shapes: the outputs' shapes and dtypes.
    out_specs: a BlockSpec per output.
    config: the kernel's config (its ``num_warps`` and ``num_stages``).
    interpret: the ``pallas_call`` interpret switch.
    name: the kernel's name in the program.
  """
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shapes,
    compiler_params=triton_compiler_params(config),
    interpret=interpret,
    name=name,
  )(*operands)
