"""RMS norm implementations: the XLA programs and the Pallas kernels.

Layout shared by every implementation: ``x`` is ``(*lead, H)``; ``w`` is
``(*groups, H)`` where ``groups`` is a prefix of ``lead`` (empty for the usual
shared weight; vmapping over the weight adds group dims). Statistics are in
float32 (float64 for float64 inputs); outputs have the input's dtype.

The kernels view ``x`` as ``(G, R, H)`` (G = prod(groups)) and run a
``(G, cdiv(R, block_rows))`` grid. Triton needs power-of-two blocks, so the
hidden block is ``H`` rounded up and padded columns are masked; Mosaic TPU
takes the whole hidden dim and ``block_rows`` a multiple of the sublane tile.
``dweight`` is reduced per row block inside the backward kernel and the
per-block partials are summed after it, so ``x`` is read once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from pallax.executor import KernelSpec, register_kernel
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend, xla_allowed
from pallax.pallas_utils import next_pow2, sublanes


@dataclasses.dataclass(frozen=True)
class RmsNormConfig(KernelConfig):
  """Block sizes of the rms_norm forward and backward kernels.

  block_rows: rows per program (power of two on Triton; multiple of the
    sublane tile, or all rows, on TPU).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """
  block_rows: int
  num_warps: int = 4
  num_stages: int = 1
  positive_fields: ClassVar[tuple[str, ...]] = ("block_rows", "num_warps", "num_stages")


def stat_dtype(dtype) -> jnp.dtype:
  """Dtype of the statistics: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def _rows_hidden(avals) -> tuple[int, int]:
  x = avals[0]
  return max(1, math.prod(x.shape[:-1])), x.shape[-1]


def _pallas_heuristic(avals, backend: str) -> RmsNormConfig:
  """Rows per block so that one block of x holds about 16K (Triton) or 512K (TPU) elements."""
  rows, hidden = _rows_hidden(avals)
  if backend == "triton":
    bh = next_pow2(hidden)
    block_rows = max(1, min(next_pow2(rows), 16384 // bh, 64))
    num_warps = max(1, min(16, bh * block_rows // 1024))
    return RmsNormConfig(block_rows=block_rows, num_warps=next_pow2(num_warps))
  sub = sublanes(avals[0].dtype)
  fit = max(sub, (524288 // hidden) // sub * sub)
  return RmsNormConfig(block_rows=min(fit, 1024))


def rms_norm_heuristic(avals: Sequence[Any], target: str, **params) -> RmsNormConfig:
  """The kernel on accelerators and under the interpret switch; XLA's program on CPU."""
  config = _pallas_heuristic(avals, kernel_backend(target))
  return dataclasses.replace(config, implementation="xla") if target == "cpu" else config


def rms_norm_candidates(avals: Sequence[Any], target: str, **params) -> list[RmsNormConfig]:
  """The autotuning space: block rows (and warps on Triton), plus the XLA program."""
  rows, hidden = _rows_hidden(avals)
  backend = kernel_backend(target)
  if interpreted(target):  # interpreted kernels are slow: a few block sizes
    base = _pallas_heuristic(avals, backend)
    blocks = sorted({base.block_rows, max(1, base.block_rows // 4)})
    out = [dataclasses.replace(base, block_rows=b) for b in blocks]
  elif backend == "triton":
    bh = next_pow2(hidden)
    out = [RmsNormConfig(block_rows=b, num_warps=w)
           for b in (1, 2, 4, 8, 16, 32, 64) if b <= next_pow2(rows) and b * bh <= 65536
           for w in (2, 4, 8, 16) if w * 32 <= b * bh]
  else:
    sub = sublanes(avals[0].dtype)
    out = [RmsNormConfig(block_rows=b) for b in (sub, 2 * sub, 4 * sub, 8 * sub, 256, 512, 1024)
           if b % sub == 0 and b * hidden <= 2 ** 21]
  if xla_allowed(target):
    out.append(RmsNormConfig(block_rows=1, implementation="xla"))
  return out or [_pallas_heuristic(avals, backend)]


def rms_norm_supports(avals: Sequence[Any], target: str, config: RmsNormConfig,
                      **params) -> Optional[str]:
  """Why ``config`` cannot run this call on ``target``, if it cannot."""
  if config.implementation == "xla":
    return None
  backend = kernel_backend(target)
  rows, _ = _rows_hidden(avals)
  dtype = avals[0].dtype
  if backend == "mosaic_tpu":
    if dtype == jnp.float64:
      return "float64 has no Mosaic TPU kernel"
    sub = sublanes(dtype)
    if config.block_rows < rows and config.block_rows % sub:
      return (f"block_rows={config.block_rows} must be a multiple of {sub} on TPU "
              f"(or cover all {rows} rows)")
  elif config.block_rows & (config.block_rows - 1):
    return f"block_rows={config.block_rows} must be a power of two on Triton"
  return None


for _op in ("rms_norm_fwd", "rms_norm_bwd"):
  register_kernel(KernelSpec(_op, RmsNormConfig, rms_norm_heuristic, rms_norm_candidates,
                             rms_norm_supports))


# ----------------------------------------------------------------------------
# XLA programs (the CPU path; the reference's twin).


def _weight_like_x(w: jax.Array, x_ndim: int) -> jax.Array:
  """``w (*groups, H)`` reshaped to broadcast against ``x (*lead, H)``."""
  groups = w.shape[:-1]
  return w.reshape(groups + (1,) * (x_ndim - 1 - len(groups)) + w.shape[-1:])


def _sum_to_weight(v: jax.Array, w_ndim: int) -> jax.Array:
  """Sums ``v (*lead, H)`` over the lead dims that are not weight groups."""
  ngroups = w_ndim - 1
  return jnp.sum(v, axis=tuple(range(ngroups, v.ndim - 1)))


def rms_norm_fwd_xla(x, w, *, eps: float, offset: float):
  st = stat_dtype(x.dtype)
  xf = x.astype(st)
  rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  scale = _weight_like_x(w, x.ndim).astype(st) + offset
  return [(xf * rstd * scale).astype(x.dtype), rstd[..., 0]]


def rms_norm_jvp_xla(x, w, rstd, x_dot, w_dot, *, offset: float):
  st = stat_dtype(x.dtype)
  xf, xdf, r = x.astype(st), x_dot.astype(st), rstd[..., None]
  scale = _weight_like_x(w, x.ndim).astype(st) + offset
  r_dot = -r * r * r * jnp.mean(xf * xdf, axis=-1, keepdims=True)
  y_dot = (xdf * r + xf * r_dot) * scale + xf * r * _weight_like_x(w_dot, x.ndim).astype(st)
  return [y_dot.astype(x.dtype)]


def rms_norm_bwd_xla(x, w, rstd, dy, *, offset: float):
  st = stat_dtype(x.dtype)
  xf, dyf, r = x.astype(st), dy.astype(st), rstd[..., None]
  g = dyf * (_weight_like_x(w, x.ndim).astype(st) + offset)
  dx = r * (g - xf * (r * r) * jnp.mean(g * xf, axis=-1, keepdims=True))
  dw = _sum_to_weight(dyf * xf * r, w.ndim)
  return [dx.astype(x.dtype), dw.astype(w.dtype)]


# ----------------------------------------------------------------------------
# Pallas kernels.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The (G, R, H) view of one call and its grid for a given config/backend."""
  groups: int
  rows: int
  hidden: int
  block_rows: int
  block_hidden: int

  @classmethod
  def of(cls, x_shape, w_shape, config: RmsNormConfig, backend: str) -> "_Layout":
    hidden = x_shape[-1]
    groups = math.prod(w_shape[:-1])
    rows = math.prod(x_shape[:-1]) // max(groups, 1)
    block_rows = min(config.block_rows, rows) if backend == "mosaic_tpu" else config.block_rows
    block_hidden = next_pow2(hidden) if backend == "triton" else hidden
    return cls(groups, rows, hidden, block_rows, block_hidden)

  @property
  def num_blocks(self) -> int:
    return pl.cdiv(self.rows, self.block_rows)

  @property
  def grid(self) -> tuple[int, int]:
    return (self.groups, self.num_blocks)

  def rows_spec(self, width: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, self.block_rows, width), lambda g, i: (g, i, 0))

  def weight_spec(self) -> pl.BlockSpec:
    return pl.BlockSpec((None, 1, self.block_hidden), lambda g, i: (g, 0, 0))

  def column_mask(self, shape) -> jax.Array | None:
    if self.block_hidden == self.hidden:
      return None
    return lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) < self.hidden

  def row_mask(self, shape) -> jax.Array | None:
    if self.rows % self.block_rows == 0:
      return None
    row = pl.program_id(1) * self.block_rows + lax.broadcasted_iota(jnp.int32, shape, 0)
    return row < self.rows


def _compiler_params(config: RmsNormConfig, backend: str):
  if backend == "triton":
    return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _where(mask, value):
  return value if mask is None else jnp.where(mask, value, 0)


def _load(ref, st, mask):
  """Loads a block in the stats dtype with padded columns zeroed."""
  return _where(mask, ref[...].astype(st))


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, layout: _Layout, eps, offset):
  st = stat_dtype(x_ref.dtype)
  cols = layout.column_mask(x_ref.shape)
  x = _load(x_ref, st, cols)
  rstd = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / layout.hidden + eps)
  scale = _load(w_ref, st, layout.column_mask(w_ref.shape)) + offset
  y_ref[...] = (x * rstd * scale).astype(y_ref.dtype)
  rstd_ref[...] = rstd.astype(rstd_ref.dtype)


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref, *, layout: _Layout, offset):
  st = stat_dtype(x_ref.dtype)
  cols = layout.column_mask(x_ref.shape)
  x, dy = _load(x_ref, st, cols), _load(dy_ref, st, cols)
  r = rstd_ref[...].astype(st)
  g = dy * (_load(w_ref, st, layout.column_mask(w_ref.shape)) + offset)
  mean_gx = jnp.sum(g * x, axis=-1, keepdims=True) / layout.hidden
  dx_ref[...] = (r * (g - x * (r * r) * mean_gx)).astype(dx_ref.dtype)
  # Rows past the end of the last block hold garbage (possibly NaN): mask them
  # out of the weight-gradient partial sum.
  contrib = _where(layout.row_mask(x.shape), dy * x * r)
  dw_ref[...] = jnp.sum(contrib, axis=0, keepdims=True).astype(dw_ref.dtype)


def rms_norm_fwd_pallas(x, w, *, eps: float, offset: float, config: RmsNormConfig,
                        backend: str, interpret):
  st = stat_dtype(x.dtype)
  if x.size == 0:
    return [x, jnp.zeros(x.shape[:-1], st)]
  lay = _Layout.of(x.shape, w.shape, config, backend)
  x3 = x.reshape(lay.groups, lay.rows, lay.hidden)
  w3 = w.reshape(lay.groups, 1, lay.hidden)
  y, rstd = pl.pallas_call(
      lambda *refs: _fwd_kernel(*refs, layout=lay, eps=eps, offset=offset),
      grid=lay.grid,
      in_specs=[lay.rows_spec(lay.block_hidden), lay.weight_spec()],
      out_specs=[lay.rows_spec(lay.block_hidden), lay.rows_spec(1)],
      out_shape=[jax.ShapeDtypeStruct(x3.shape, x.dtype),
                 jax.ShapeDtypeStruct((lay.groups, lay.rows, 1), st)],
      compiler_params=_compiler_params(config, backend),
      interpret=interpret,
      name="rms_norm_fwd",
  )(x3, w3)
  return [y.reshape(x.shape), rstd.reshape(x.shape[:-1])]


def rms_norm_bwd_pallas(x, w, rstd, dy, *, offset: float, config: RmsNormConfig,
                        backend: str, interpret):
  if x.size == 0:
    return [jnp.zeros_like(x), jnp.zeros_like(w)]
  lay = _Layout.of(x.shape, w.shape, config, backend)
  st = stat_dtype(x.dtype)
  x3 = x.reshape(lay.groups, lay.rows, lay.hidden)
  dx, dw_blocks = pl.pallas_call(
      lambda *refs: _bwd_kernel(*refs, layout=lay, offset=offset),
      grid=lay.grid,
      in_specs=[lay.rows_spec(lay.block_hidden), lay.weight_spec(),
                lay.rows_spec(1), lay.rows_spec(lay.block_hidden)],
      out_specs=[lay.rows_spec(lay.block_hidden),
                 pl.BlockSpec((None, None, 1, lay.block_hidden), lambda g, i: (g, i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct(x3.shape, x.dtype),
                 jax.ShapeDtypeStruct((lay.groups, lay.num_blocks, 1, lay.hidden), st)],
      compiler_params=_compiler_params(config, backend),
      interpret=interpret,
      name="rms_norm_bwd",
  )(x3, w.reshape(lay.groups, 1, lay.hidden), rstd.reshape(lay.groups, lay.rows, 1),
    dy.reshape(x3.shape))
  dw = jnp.sum(dw_blocks, axis=(1, 2)).reshape(w.shape).astype(w.dtype)
  return [dx.reshape(x.shape), dw]
