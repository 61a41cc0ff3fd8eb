"""Softmax implementations: the XLA programs and the Pallas kernels.

Every implementation works on the last axis of 2-D-or-more operands of one
shape (the public functions move the softmax axes there): the leading dims are
rows, the last dim is the row. ``mask`` (the ``where=`` argument) is an
optional trailing bool operand; where it is False an entry takes no part in the
row's reduction and its output is 0 (softmax) or -inf (log_softmax), as in
``jax.nn``. Arithmetic is in float32 (float64 for float64 inputs); outputs have
the input's dtype.

Every kernel is one two-phase row program (``_RowProgram``): a reduction over
the row's column blocks into per-row accumulators, then an elementwise pass
over the same column blocks that writes the output. The forward reduction is
the online softmax (running max ``m`` and running sum ``l`` of
``exp(x - m)``, rescaled when the max grows), so a row never has to fit in one
block. Per backend:

* Triton: one program per row block loops over the column blocks twice (a
  single load when the row is one block). Loads and stores are masked by hand:
  Pallas-Triton does not bound-check blocks that overhang the array.
* Mosaic TPU: the grid is ``(row blocks, phase, column blocks)``, the last two
  axes sequential ("arbitrary"), with the accumulators in VMEM scratch. A row
  that is one block is fetched once: its block index does not change between
  the phases.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.executor import KernelSpec, register_kernel
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend, xla_allowed, xla_on_cpu
from pallax.pallas_utils import (and_masks, in_bounds, load, masked, next_pow2, stat_dtype, store,
                                 sublanes, triton_compiler_params)

OPS = ("softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_jvp", "log_softmax_bwd")


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
  positive_fields: ClassVar[tuple[str, ...]] = ("block_rows", "block_cols", "num_warps",
                                                "num_stages")


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


def _pallas_heuristic(avals, backend: str, **params) -> SoftmaxConfig:
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


softmax_heuristic = xla_on_cpu(_pallas_heuristic)


def softmax_candidates(avals: Sequence[Any], target: str, **params) -> list[SoftmaxConfig]:
  """The autotuning space: row and column blocks (and warps on Triton), plus XLA."""
  rows, cols = _rows_cols(avals)
  backend = kernel_backend(target)
  base = _pallas_heuristic(avals, backend)
  if interpreted(target):  # interpreted kernels are slow: the heuristic and a narrower block
    narrower = base.block_cols // 2
    legal = narrower % _TPU_LANES == 0 if backend == "mosaic_tpu" else narrower >= 16
    out = [base] + ([dataclasses.replace(base, block_cols=narrower)] if legal else [])
  elif backend == "triton":
    widest = min(next_pow2(cols), 2 * _TRITON_MAX_COLS)
    out = [SoftmaxConfig(block_rows=br, block_cols=bc, num_warps=w)
           for bc in sorted({widest, max(widest // 2, 1), max(widest // 4, 1)})
           if bc >= min(widest, 128)
           for br in (1, 2, 4, 8, 16, 32, 64) if br <= next_pow2(rows) and br * bc <= 32768
           for w in (2, 4, 8, 16) if w * 32 <= br * bc]
  else:
    tile = _tpu_row_tile(avals)
    itemsize = jnp.dtype(avals[0].dtype).itemsize
    widths = ([cols] if cols <= 2 * _TPU_MAX_COLS else []) + [
        c for c in (512, 1024, 2048, 4096) if c < cols]
    out = [SoftmaxConfig(block_rows=br, block_cols=bc) for bc in widths
           for br in sorted({tile, 2 * tile, 4 * tile, 8 * tile, 256, 512, 1024})
           if br % tile == 0 and br * bc * itemsize <= 2 ** 21]
  if xla_allowed(target):
    out.append(SoftmaxConfig(block_rows=1, block_cols=1, implementation="xla"))
  return out or [base]


def softmax_supports(avals: Sequence[Any], target: str, config: SoftmaxConfig,
                     **params) -> Optional[str]:
  """Why ``config`` cannot run this call on ``target``, if it cannot."""
  if config.implementation == "xla":
    return None
  rows, cols = _rows_cols(avals)
  dtype = avals[0].dtype
  if kernel_backend(target) == "mosaic_tpu":
    if dtype == jnp.float64:
      return "float64 has no Mosaic TPU kernel"
    if config.block_cols < cols and config.block_cols % _TPU_LANES:
      return (f"block_cols={config.block_cols} must be a multiple of {_TPU_LANES} on TPU "
              f"(or cover all {cols} columns)")
    tile = _tpu_row_tile(avals)
    if config.block_rows < rows and config.block_rows % tile:
      with_mask = " with a where= mask" if _masked(avals) else ""
      return (f"block_rows={config.block_rows} must be a multiple of {tile} on TPU{with_mask} "
              f"(or cover all {rows} rows)")
    return None
  for name in ("block_rows", "block_cols"):
    value = getattr(config, name)
    if value & (value - 1):
      return f"{name}={value} must be a power of two on Triton"
  return None


for _op in OPS:
  register_kernel(KernelSpec(_op, SoftmaxConfig, softmax_heuristic, softmax_candidates,
                             softmax_supports))


# ----------------------------------------------------------------------------
# XLA programs (the CPU path; the reference's twin).


def _shifted(x, mask):
  """``x - max(x)`` over the unmasked entries, in the stats dtype (masked: -inf).

  The max is exact in any dtype, so it is taken in the input's, as jax.nn does.
  """
  x = masked(x, mask, -jnp.inf)
  m = jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf)
  st = stat_dtype(x.dtype)
  return x.astype(st) - m.astype(st)


def softmax_fwd_xla(x, mask=None):
  e = jnp.exp(_shifted(x, mask))
  y = e / jnp.sum(e, axis=-1, keepdims=True)
  return [masked(y, mask, 0).astype(x.dtype)]


def log_softmax_fwd_xla(x, mask=None):
  s = _shifted(x, mask)
  z = s - jnp.log(jnp.sum(jnp.exp(s), axis=-1, keepdims=True))
  return [masked(z, mask, -jnp.inf).astype(x.dtype)]


def softmax_bwd_xla(y, v, mask=None):
  """``y * (v - sum(y * v))`` (masked: 0): softmax's (symmetric) Jacobian times ``v``."""
  st = stat_dtype(y.dtype)
  yf, vf = y.astype(st), v.astype(st)
  s = jnp.sum(masked(yf * vf, mask, 0), axis=-1, keepdims=True)
  return [masked(yf * (vf - s), mask, 0).astype(v.dtype)]


def log_softmax_jvp_xla(z, t, mask=None):
  """``t - sum(softmax * t)`` (masked: 0): log_softmax's Jacobian times ``t``."""
  st = stat_dtype(z.dtype)
  tf = t.astype(st)
  s = jnp.sum(masked(jnp.exp(z.astype(st)) * tf, mask, 0), axis=-1, keepdims=True)
  return [masked(tf - s, mask, 0).astype(t.dtype)]


def log_softmax_bwd_xla(z, g, mask=None):
  """``g - softmax * sum(g)`` (masked: 0): the transposed Jacobian times ``g``."""
  st = stat_dtype(z.dtype)
  gf = masked(g.astype(st), mask, 0)
  dx = gf - jnp.exp(z.astype(st)) * jnp.sum(gf, axis=-1, keepdims=True)
  return [masked(dx, mask, 0).astype(g.dtype)]


# ----------------------------------------------------------------------------
# Row programs: what each kernel computes, block by block.


@dataclasses.dataclass(frozen=True)
class _RowProgram:
  """A reduction over a row's column blocks, then an elementwise pass.

  init: initial values of the per-row accumulators (each ``(block_rows, 1)``).
  accumulate: ``(acc, data, keep) -> acc`` folds one column block in; ``keep``
    (None: all) marks the entries that take part: in bounds and not masked.
  emit: ``(acc, data, mask) -> block`` of the output; ``mask`` is the
    ``where=`` block (None without one).
  ``data`` are the data operands' blocks in the stats dtype.
  """
  init: tuple[float, ...]
  accumulate: Callable[..., tuple]
  emit: Callable[..., jax.Array]


def _online_max_sum(acc, data, keep):
  """Running max ``m`` and sum ``l`` of ``exp(x - m)``, over the kept entries.

  Rows whose max is still -inf shift by 0 instead (their kept entries are all
  -inf, so they add exp(-inf) = 0), so ``l`` never becomes NaN from -inf - -inf.
  """
  m, l = acc
  (x,) = data
  x = masked(x, keep, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(x, axis=-1, keepdims=True))
  shift = jnp.where(m_new == -jnp.inf, 0, m_new)
  l = l * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift), axis=-1, keepdims=True)
  return m_new, l


def _softmax_emit(acc, data, mask):
  (m, l), (x,) = acc, data
  return masked(jnp.exp(x - m) / l, mask, 0)


def _log_softmax_emit(acc, data, mask):
  (m, l), (x,) = acc, data
  return masked((x - m) - jnp.log(l), mask, -jnp.inf)


def _sum_of(term):
  """An accumulate function: the running row sum of ``term(*data)`` over kept entries."""
  def accumulate(acc, data, keep):
    (s,) = acc
    return (s + jnp.sum(masked(term(*data), keep, 0), axis=-1, keepdims=True),)
  return accumulate


def _softmax_bwd_emit(acc, data, mask):
  (s,), (y, v) = acc, data
  return masked(y * (v - s), mask, 0)


def _log_softmax_jvp_emit(acc, data, mask):
  (s,), (_, t) = acc, data
  return masked(t - s, mask, 0)


def _log_softmax_bwd_emit(acc, data, mask):
  (s,), (z, g) = acc, data
  return masked(g - jnp.exp(z) * s, mask, 0)


_SOFTMAX_FWD = _RowProgram((-math.inf, 0.0), _online_max_sum, _softmax_emit)
_LOG_SOFTMAX_FWD = _RowProgram((-math.inf, 0.0), _online_max_sum, _log_softmax_emit)
_SOFTMAX_BWD = _RowProgram((0.0,), _sum_of(lambda y, v: y * v), _softmax_bwd_emit)
_LOG_SOFTMAX_JVP = _RowProgram((0.0,), _sum_of(lambda z, t: jnp.exp(z) * t),
                               _log_softmax_jvp_emit)
_LOG_SOFTMAX_BWD = _RowProgram((0.0,), _sum_of(lambda z, g: g), _log_softmax_bwd_emit)


# ----------------------------------------------------------------------------
# Pallas kernels.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The (rows, cols) view of one call and its blocks for a given config/backend."""
  rows: int
  cols: int
  block_rows: int
  block_cols: int

  @classmethod
  def of(cls, rows: int, cols: int, config: SoftmaxConfig, backend: str) -> "_Layout":
    if backend == "triton":  # powers of two, no wider than the array needs
      return cls(rows, cols, min(config.block_rows, next_pow2(rows)),
                 min(config.block_cols, next_pow2(cols)))
    return cls(rows, cols, min(config.block_rows, rows),
               cols if config.block_cols >= cols else config.block_cols)

  @property
  def row_blocks(self) -> int:
    return pl.cdiv(self.rows, self.block_rows)

  @property
  def col_blocks(self) -> int:
    return pl.cdiv(self.cols, self.block_cols)

  @property
  def block(self) -> tuple[int, int]:
    return (self.block_rows, self.block_cols)

  def rows_in_bounds(self, row_block) -> Optional[jax.Array]:
    return in_bounds(row_block, self.block_rows, self.rows, self.block, 0)

  def cols_in_bounds(self, col_block) -> Optional[jax.Array]:
    return in_bounds(col_block, self.block_cols, self.cols, self.block, 1)


def _triton_call(program: _RowProgram, data, mask, out_dtype, lay: _Layout,
                 config: SoftmaxConfig, interpret, name: str):
  """One program per row block, looping over the row's column blocks."""
  st = stat_dtype(data[0].dtype)
  # The block spans every column block of the row (it overhangs the array when
  # cols is not a multiple of block_cols); the kernel slices it block by block.
  spec = pl.BlockSpec((lay.block_rows, lay.col_blocks * lay.block_cols), lambda i: (i, 0))

  def kernel(*refs):
    *data_refs, out_ref = refs
    mask_ref = data_refs.pop() if mask is not None else None
    rows_ok = lay.rows_in_bounds(pl.program_id(0))

    def load_cols(j):
      """Column block ``j``: data blocks, kept entries, mask block, index, bounds."""
      cols_ok = lay.cols_in_bounds(j)
      bounds = and_masks(rows_ok, cols_ok)
      idx = (slice(None), pl.ds(j * lay.block_cols, lay.block_cols))
      read = lambda ref: load(ref.at[idx], bounds)
      blocks = [read(ref).astype(st) for ref in data_refs]
      user = None if mask_ref is None else read(mask_ref) != 0
      return blocks, and_masks(cols_ok, user), user, idx, bounds

    def emit(acc, loaded):
      blocks, _, user, idx, bounds = loaded
      out = program.emit(acc, blocks, user).astype(out_dtype)
      store(out_ref.at[idx], out, bounds)

    init = tuple(jnp.full((lay.block_rows, 1), v, st) for v in program.init)
    if lay.col_blocks == 1:  # the row is one block: load it once
      loaded = load_cols(0)
      emit(program.accumulate(init, *loaded[:2]), loaded)
      return
    acc = lax.fori_loop(0, lay.col_blocks,
                        lambda j, acc: program.accumulate(acc, *load_cols(j)[:2]), init)

    def emit_block(j, carry):
      emit(acc, load_cols(j))
      return carry

    lax.fori_loop(0, lay.col_blocks, emit_block, 0)

  return pl.pallas_call(
      kernel,
      grid=(lay.row_blocks,),
      in_specs=[spec] * (len(data) + (mask is not None)),
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct((lay.rows, lay.cols), out_dtype),
      compiler_params=triton_compiler_params(config),
      interpret=interpret,
      name=name,
  )(*data, *([] if mask is None else [mask]))


def _tpu_call(program: _RowProgram, data, mask, out_dtype, lay: _Layout, interpret, name: str):
  """Grid (row blocks, phase, column blocks): phase 0 reduces, phase 1 writes."""
  st = stat_dtype(data[0].dtype)
  in_spec = pl.BlockSpec(lay.block, lambda i, p, j: (i, j))
  # Phase 0 parks on the row's first output block without writing it; it is
  # written in phase 1 before the index first moves on, so nothing unwritten
  # is ever copied back.
  out_spec = pl.BlockSpec(lay.block, lambda i, p, j: (i, j * p))

  def kernel(*refs):
    n = len(data) + (mask is not None)
    in_refs, out_ref, acc_refs = refs[:n], refs[n], refs[n + 1:]
    data_refs = in_refs[:len(data)]
    phase, j = pl.program_id(1), pl.program_id(2)

    def load_cols():
      blocks = [ref[...].astype(st) for ref in data_refs]
      user = None if mask is None else in_refs[-1][...].astype(jnp.int32) != 0
      return blocks, and_masks(lay.cols_in_bounds(j), user), user

    @pl.when((phase == 0) & (j == 0))
    def _init():
      for ref, value in zip(acc_refs, program.init):
        ref[...] = jnp.full(ref.shape, value, st)

    @pl.when(phase == 0)
    def _reduce():
      blocks, keep, _ = load_cols()
      acc = program.accumulate(tuple(ref[...] for ref in acc_refs), blocks, keep)
      for ref, value in zip(acc_refs, acc):
        ref[...] = value

    @pl.when(phase == 1)
    def _emit():
      blocks, _, user = load_cols()
      acc = tuple(ref[...] for ref in acc_refs)
      out_ref[...] = program.emit(acc, blocks, user).astype(out_ref.dtype)

  return pl.pallas_call(
      kernel,
      grid=(lay.row_blocks, 2, lay.col_blocks),
      in_specs=[in_spec] * (len(data) + (mask is not None)),
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((lay.rows, lay.cols), out_dtype),
      scratch_shapes=[pltpu.VMEM((lay.block_rows, 1), st) for _ in program.init],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name=name,
  )(*data, *([] if mask is None else [mask]))


def _row_kernel(program: _RowProgram, name: str, data: Sequence[jax.Array], mask, out_dtype, *,
                config: SoftmaxConfig, backend: str, interpret):
  """Runs ``program`` over the rows of ``data`` (all one shape ``(*lead, cols)``)."""
  shape = data[0].shape
  if math.prod(shape) == 0:
    return [jnp.zeros(shape, out_dtype)]
  rows, cols = math.prod(shape[:-1]), shape[-1]
  lay = _Layout.of(rows, cols, config, backend)
  flat = [a.reshape(rows, cols) for a in data]
  # Bool refs are not portable across Pallas backends: the mask travels as int8.
  mask = None if mask is None else mask.reshape(rows, cols).astype(jnp.int8)
  if backend == "triton":
    out = _triton_call(program, flat, mask, out_dtype, lay, config, interpret, name)
  else:
    out = _tpu_call(program, flat, mask, out_dtype, lay, interpret, name)
  return [out.reshape(shape)]


def softmax_fwd_pallas(x, mask=None, **kw):
  return _row_kernel(_SOFTMAX_FWD, "softmax_fwd", [x], mask, x.dtype, **kw)


def log_softmax_fwd_pallas(x, mask=None, **kw):
  return _row_kernel(_LOG_SOFTMAX_FWD, "log_softmax_fwd", [x], mask, x.dtype, **kw)


def softmax_bwd_pallas(y, v, mask=None, **kw):
  return _row_kernel(_SOFTMAX_BWD, "softmax_bwd", [y, v], mask, v.dtype, **kw)


def log_softmax_jvp_pallas(z, t, mask=None, **kw):
  return _row_kernel(_LOG_SOFTMAX_JVP, "log_softmax_jvp", [z, t], mask, t.dtype, **kw)


def log_softmax_bwd_pallas(z, g, mask=None, **kw):
  return _row_kernel(_LOG_SOFTMAX_BWD, "log_softmax_bwd", [z, g], mask, g.dtype, **kw)
