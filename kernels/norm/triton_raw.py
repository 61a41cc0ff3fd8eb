"""The rms_norm kernels in raw Triton (``@triton.jit``), started by ``pallax.triton_raw.launch``.

They take and return what the Pallas kernels of ``triton.py`` do (the same
operands, ``y`` or ``dx`` in ``x``'s dtype, ``rstd`` in float32, the weight
gradient in the weight's dtype) over the same ``(G, R, H)`` view and blocks
(``common.Layout``: ``block_rows`` rows a block, the hidden dim padded to a
power of two and masked), for rms_norm only (``__init__.py`` gives the other
kinds no raw kernel). Why a second implementation: Triton's own language lets the backward
kernel loop over row blocks. Each program accumulates the weight gradient of
the blocks it visits in registers and writes one partial sum, where the Pallas
kernel writes one per row block; with one row a block (rows of 8K elements and
more), those partials are as large as ``x`` in float32 and double the
backward's memory traffic. Loads also carry cache hints: ``x`` and ``dy`` are
read once and evicted first, the weight is kept.

This module imports triton at its top (``import_triton``: without the triton
extra, an ImportError naming it): ``kernels/norm/__init__.py`` loads it
through ``pallax.triton_raw.LazyKernels``, when a raw kernel first runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallax.kernels.norm import xla
from pallax.kernels.norm.common import Layout
from pallax.kernels.norm.config import NormConfig
from pallax.kernels.norm.kind import RMS, ROW, STAT, WEIGHT, NormKind
from pallax.triton_raw import import_triton, launch

triton, tl = import_triton(__name__)

# Programs per weight group of the backward kernel, at most: each writes one
# partial weight gradient, so fewer programs write less, while 1024 still fill
# an H100's 132 SMs (or an A100's 108) several times over.
MAX_BWD_PROGRAMS = 1024


@triton.jit
def _block(
  group,
  block,
  ROWS: tl.constexpr,
  HIDDEN: tl.constexpr,
  BLOCK_ROWS: tl.constexpr,
  BLOCK_H: tl.constexpr,
):
  """Row block ``block`` of group ``group`` in the (G, R, H) view.

  Returns ``first``, the index of the block's first row in the (G, R)
  statistics; the block's rows' offsets from it and which of them lie inside
  the array; its elements' offsets from row ``first``'s start, and their mask.
  Only ``first`` is an int64 (x may hold 2**31 elements or more): offsets
  within a block stay int32, which saves registers (ptxas spilled a few bytes
  at 40 registers with int64 offsets).
  """
  rows = tl.arange(0, BLOCK_ROWS)
  cols = tl.arange(0, BLOCK_H)
  inside = block * BLOCK_ROWS + rows < ROWS
  first = group.to(tl.int64) * ROWS + block * BLOCK_ROWS
  offsets = rows[:, None] * HIDDEN + cols[None, :]
  return first, rows, inside, offsets, inside[:, None] & (cols < HIDDEN)[None, :]


@triton.jit
def _scale(w_ptr, group, OFFSET: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
  """``weight + offset`` of group ``group`` in float32 (0 in the padded columns)."""
  cols = tl.arange(0, BLOCK_H)
  w = tl.load(
    w_ptr + group.to(tl.int64) * HIDDEN + cols,
    mask=cols < HIDDEN,
    other=0.0,
    eviction_policy="evict_last",
  )
  return w.to(tl.float32) + OFFSET


@triton.jit
def _fwd_kernel(
  x_ptr,
  w_ptr,
  y_ptr,
  rstd_ptr,
  ROWS: tl.constexpr,
  HIDDEN: tl.constexpr,
  EPS: tl.constexpr,
  OFFSET: tl.constexpr,
  BLOCK_ROWS: tl.constexpr,
  BLOCK_H: tl.constexpr,
):
  """``y = x * rstd * (w + offset)`` and ``rstd`` of one row block (grid: groups, row blocks)."""
  group = tl.program_id(0)
  first, rows, inside, offsets, mask = _block(
    group, tl.program_id(1), ROWS, HIDDEN, BLOCK_ROWS, BLOCK_H
  )
  at = first * HIDDEN
  x = tl.load(x_ptr + at + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
  x = x.to(tl.float32)
  rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HIDDEN + EPS)
  y = x * rstd[:, None] * _scale(w_ptr, group, OFFSET, HIDDEN, BLOCK_H)[None, :]
  tl.store(y_ptr + at + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
  tl.store(rstd_ptr + first + rows, rstd, mask=inside)


@triton.jit
def _bwd_kernel(
  x_ptr,
  w_ptr,
  rstd_ptr,
  dy_ptr,
  dx_ptr,
  dw_ptr,
  ROWS: tl.constexpr,
  HIDDEN: tl.constexpr,
  OFFSET: tl.constexpr,
  BLOCK_ROWS: tl.constexpr,
  BLOCK_H: tl.constexpr,
  PROGRAMS: tl.constexpr,
):
  """``dx`` of every ``PROGRAMS``-th row block from this one, and their weight gradient's sum.

  Grid: (groups, ``PROGRAMS``). Rows and columns outside the array load as
  0, so they add nothing to the sums.
  """
  group, program = tl.program_id(0), tl.program_id(1)
  dw = tl.zeros([BLOCK_H], dtype=tl.float32)
  for block in tl.range(program, tl.cdiv(ROWS, BLOCK_ROWS), PROGRAMS):
    first, rows, inside, offsets, mask = _block(group, block, ROWS, HIDDEN, BLOCK_ROWS, BLOCK_H)
    at = first * HIDDEN
    x = tl.load(x_ptr + at + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    dy = tl.load(dy_ptr + at + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    x, dy = x.to(tl.float32), dy.to(tl.float32)
    rstd = tl.load(rstd_ptr + first + rows, mask=inside, other=0.0)[:, None]
    xhat = x * rstd
    # The weight is loaded again per block (an L1 hit) rather than held across
    # the loop, where a row of 16K elements would keep 32 more registers a thread.
    g = dy * _scale(w_ptr, group, OFFSET, HIDDEN, BLOCK_H)[None, :]
    dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / HIDDEN)[:, None])
    tl.store(dx_ptr + at + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    dw += tl.sum(dy * xhat, axis=0)
  cols = tl.arange(0, BLOCK_H)
  at = (group * PROGRAMS + program).to(tl.int64) * HIDDEN
  tl.store(dw_ptr + at + cols, dw, mask=cols < HIDDEN)


def _layout(x: jax.Array, w: jax.Array, config: NormConfig, kind: NormKind) -> Layout:
  if kind != RMS:
    raise NotImplementedError(f"the raw Triton norm kernels compute rms_norm only, not {kind}")
  return Layout.of(x.shape, w.shape, config, "triton")


def _launch(
  kernel, lay: Layout, config: NormConfig, interpret: bool, operands, out_shape, grid, **constexprs
) -> list[jax.Array]:
  """``launch`` of ``kernel`` on the (G, R, H) views of ``operands`` (``(view, array)`` pairs).

  Its constexprs are ``constexprs`` and the sizes every kernel takes: the
  view's and the block's.
  """
  b = lay.blocks
  return launch(
    kernel,
    *(a.reshape(lay.view_shape(view)) for view, a in operands),
    out_shape=out_shape,
    grid=grid,
    num_warps=config.num_warps,
    num_stages=config.num_stages,
    interpret=interpret,
    **constexprs,
    ROWS=b.rows,
    HIDDEN=b.cols,
    BLOCK_ROWS=b.block_rows,
    BLOCK_H=b.block_cols,
  )


def norm_fwd(
  x: jax.Array, w: jax.Array, *, config: NormConfig, interpret: bool, **params: Any
) -> list[jax.Array]:
  """rms_norm's forward: ``[y, rstd]`` (``y`` in ``x``'s dtype, ``rstd`` float32).

  ``params``: ``kind``, ``eps`` and ``offset``, as ``xla.norm_fwd`` takes them.
  """
  if x.size == 0:
    return xla.norm_fwd(x, w, **params)
  lay = _layout(x, w, config, params["kind"])
  y, rstd = _launch(
    _fwd_kernel,
    lay,
    config,
    interpret,
    [(ROW, x), (WEIGHT, w)],
    [
      jax.ShapeDtypeStruct(lay.view_shape(ROW), x.dtype),
      jax.ShapeDtypeStruct(lay.view_shape(STAT), jnp.float32),
    ],
    lay.grid,
    EPS=params["eps"],
    OFFSET=params["offset"],
  )
  return [y.reshape(x.shape), rstd.reshape(x.shape[:-1])]


def norm_bwd(
  x: jax.Array,
  w: jax.Array,
  rstd: jax.Array,
  dy: jax.Array,
  *,
  config: NormConfig,
  interpret: bool,
  **params: Any,
) -> list[jax.Array]:
  """rms_norm's backward: ``[dx, dweight]`` in the dtypes of ``x`` and ``w``.

  ``params``: ``kind`` and ``offset``, as ``xla.norm_bwd`` takes them.
  """
  if x.size == 0:
    return xla.norm_bwd(x, w, rstd, dy, **params)
  lay = _layout(x, w, config, params["kind"])
  programs = min(lay.blocks.row_blocks, MAX_BWD_PROGRAMS)
  dx, partials = _launch(
    _bwd_kernel,
    lay,
    config,
    interpret,
    [(ROW, x), (WEIGHT, w), (STAT, rstd), (ROW, dy)],
    [
      jax.ShapeDtypeStruct(lay.view_shape(ROW), x.dtype),
      jax.ShapeDtypeStruct((lay.groups, programs, lay.blocks.cols), jnp.float32),
    ],
    (lay.groups, programs),
    OFFSET=params["offset"],
    PROGRAMS=programs,
  )
  dw = jnp.sum(partials, axis=1).reshape(w.shape).astype(w.dtype)
  return [dx.reshape(x.shape), dw]
