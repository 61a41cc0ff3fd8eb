"""The norm kernels' bodies, shared by the Triton and Mosaic TPU kernels.

The kernels view ``x`` as ``(G, R, H)`` (G = prod(groups), the weight's group
dims) and run a ``(G, cdiv(R, block_rows))`` grid, a whole row per block.
``dweight`` (and ``dbias``) are reduced per row block inside the backward
kernel and the per-block partials are summed after it, so ``x`` is read once.
The backends differ in how blocks are sized and masked (``Layout``) and in
their compiler params: see ``triton.py`` and ``mosaic_tpu.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.kernels.norm import xla
from pallax.kernels.norm.config import NormConfig
from pallax.kernels.norm.kind import CATEGORY, ROW, STAT, WEIGHT, NormKind
from pallax.pallas_utils import RowBlocks, and_masks, load, masked, stat_dtype, store


@dataclasses.dataclass(frozen=True)
class Layout:
  """The (G, R, H) view of one call and its blocks.

  ``masks_by_hand``: whether blocks overhanging the array must be masked by hand
  (Triton); Mosaic TPU pads partial blocks itself (reads of the padding give
  garbage, writes to it are dropped).
  """

  groups: int
  blocks: RowBlocks
  masks_by_hand: bool

  @classmethod
  def of(cls, x_shape, w_shape, config: NormConfig, backend: str) -> Layout:
    groups = math.prod(w_shape[:-1])
    rows = math.prod(x_shape[:-1]) // max(groups, 1)
    blocks = RowBlocks.of(rows, x_shape[-1], config.block_rows, None, backend)
    return cls(groups, blocks, masks_by_hand=backend == "triton")

  @property
  def grid(self) -> tuple[int, int]:
    return (self.groups, self.blocks.row_blocks)

  def spec(self, category: str) -> pl.BlockSpec:
    """The block of an operand or result of ``category`` in the (G, R, H) view."""
    b = self.blocks
    if category == WEIGHT:
      return pl.BlockSpec((None, 1, b.block_cols), lambda g, i: (g, 0, 0))
    width = b.block_cols if category == ROW else 1
    return pl.BlockSpec((None, b.block_rows, width), lambda g, i: (g, i, 0))

  def view_shape(self, category: str) -> tuple[int, ...]:
    b = self.blocks
    return {
      ROW: (self.groups, b.rows, b.cols),
      STAT: (self.groups, b.rows, 1),
      WEIGHT: (self.groups, 1, b.cols),
    }[category]

  def column_mask(self, shape) -> Optional[jax.Array]:
    return self.blocks.cols_in_bounds(0, shape)

  def row_mask(self, shape) -> Optional[jax.Array]:
    return self.blocks.rows_in_bounds(pl.program_id(1), shape)

  def bounds(self, category: str, shape) -> Optional[jax.Array]:
    """Where blocks are masked: which entries of a ``category`` block lie inside the array."""
    if not self.masks_by_hand:
      return None
    rows = self.row_mask(shape) if category in (ROW, STAT) else None
    cols = self.column_mask(shape) if category in (ROW, WEIGHT) else None
    return and_masks(rows, cols)


def _load(ref, st, layout: Layout, category: str):
  """A block in the stats dtype; entries outside the array read as 0 where masked."""
  return load(ref, layout.bounds(category, ref.shape)).astype(st)


def _store(ref, value, layout: Layout, category: str) -> None:
  store(ref, value.astype(ref.dtype), layout.bounds(category, ref.shape))


def _fwd_kernel(*refs, kind: NormKind, layout: Layout, eps, offset):
  operands, results = kind.names("fwd")
  ref = dict(zip(operands + results, refs))
  st = stat_dtype(ref["x"].dtype)
  x = _load(ref["x"], st, layout, ROW)
  if kind.residual:
    h = (x + _load(ref["residual"], st, layout, ROW)).astype(ref["h"].dtype)
    _store(ref["h"], h, layout, ROW)
    x = h.astype(st)
  hidden = layout.blocks.cols
  if kind.center:
    mean = jnp.sum(x, axis=-1, keepdims=True) / hidden
    x = masked(x - mean, layout.column_mask(x.shape))  # padded columns stay 0
    _store(ref["mean"], mean, layout, STAT)
  rstd = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / hidden + eps)
  y = x * rstd * (_load(ref["w"], st, layout, WEIGHT) + offset)
  if kind.bias:
    y = y + _load(ref["b"], st, layout, WEIGHT)
  _store(ref["y"], y, layout, ROW)
  _store(ref["rstd"], rstd, layout, STAT)


def _bwd_kernel(*refs, kind: NormKind, layout: Layout, offset):
  operands, results = kind.names("bwd")
  ref = dict(zip(operands + results, refs))
  st = stat_dtype(ref["x"].dtype)
  x, dy = _load(ref["x"], st, layout, ROW), _load(ref["dy"], st, layout, ROW)
  rstd = _load(ref["rstd"], st, layout, STAT)
  xhat = ((x - _load(ref["mean"], st, layout, STAT)) if kind.center else x) * rstd
  g = dy * (_load(ref["w"], st, layout, WEIGHT) + offset)
  hidden = layout.blocks.cols
  inner = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / hidden)
  if kind.center:
    inner = inner - jnp.sum(g, axis=-1, keepdims=True) / hidden
  dx = rstd * inner
  if kind.residual:
    dx = dx + _load(ref["dh"], st, layout, ROW)
  _store(ref["dx"], dx, layout, ROW)
  # Rows past the end of the last block hold garbage on TPU (NaN when
  # interpreted): mask them out of the per-block partial sums. Padded columns
  # have dy = 0, so they add nothing.
  rows = layout.row_mask(x.shape)
  _store(ref["dw"], jnp.sum(masked(dy * xhat, rows), axis=0, keepdims=True), layout, WEIGHT)
  if kind.bias:
    _store(ref["db"], jnp.sum(masked(dy, rows), axis=0, keepdims=True), layout, WEIGHT)


def _fwd_outputs(lay: Layout, results, dtype, st):
  """The forward's out specs and shapes: rows in ``dtype``, statistics in ``st``."""
  specs = [lay.spec(CATEGORY[n]) for n in results]
  shapes = [
    jax.ShapeDtypeStruct(lay.view_shape(CATEGORY[n]), st if CATEGORY[n] == STAT else dtype)
    for n in results
  ]
  return specs, shapes


def _bwd_outputs(lay: Layout, results, dtype, st):
  """The backward's out specs and shapes: ``dx``, then per-row-block partial weight sums."""
  b = lay.blocks
  partial = pl.BlockSpec((None, None, 1, b.block_cols), lambda g, i: (g, i, 0, 0))
  partial_shape = jax.ShapeDtypeStruct((lay.groups, b.row_blocks, 1, b.cols), st)
  weights = len(results) - 1
  return [lay.spec(ROW)] + [partial] * weights, [
    jax.ShapeDtypeStruct(lay.view_shape(ROW), dtype)
  ] + [partial_shape] * weights


_STAGES = {
  "fwd": (_fwd_kernel, _fwd_outputs, xla.norm_fwd),
  "bwd": (_bwd_kernel, _bwd_outputs, xla.norm_bwd),
}


def norm_kernel(
  stage: str,
  *args,
  kind: NormKind,
  config: NormConfig,
  backend: str,
  compiler_params: Callable[[Layout, Any], Any],
  interpret,
  **scalars,
):
  """The ``stage`` (``"fwd"``, ``"bwd"``) kernel on ``backend``.

  Called by ``triton.py`` and ``mosaic_tpu.py``, whose ``compiler_params(layout,
  dtype)`` gives the backend's compiler params for the call's blocks and
  ``x``'s dtype; ``scalars`` are the stage's static params (``eps``,
  ``offset``).
  """
  body, outputs, xla_program = _STAGES[stage]
  operands, results = kind.names(stage)
  arg = dict(zip(operands, args))
  x, w = arg["x"], arg["w"]
  if x.size == 0:
    return xla_program(*args, kind=kind, **scalars)
  lay = Layout.of(x.shape, w.shape, config, backend)
  out_specs, out_shape = outputs(lay, results, x.dtype, stat_dtype(x.dtype))
  outs = pl.pallas_call(
    functools.partial(body, kind=kind, layout=lay, **scalars),
    grid=lay.grid,
    in_specs=[lay.spec(CATEGORY[n]) for n in operands],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=compiler_params(lay, x.dtype),
    interpret=interpret,
    name=f"norm_{stage}",
  )(*[arg[n].reshape(lay.view_shape(CATEGORY[n])) for n in operands])
  if stage == "fwd":
    shapes = {ROW: x.shape, STAT: x.shape[:-1]}
    return [o.reshape(shapes[CATEGORY[n]]) for o, n in zip(outs, results)]
  # The weight-like results of the backward: sum the per-block partials.
  sums = [jnp.sum(o, axis=(1, 2)).reshape(w.shape).astype(w.dtype) for o in outs[1:]]
  return [outs[0].reshape(x.shape)] + sums
