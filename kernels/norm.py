"""Normalisation implementations: the XLA programs and the Pallas kernels.

One implementation serves three ops, told apart by a static ``NormKind``:
``rms_norm`` (scale only), ``layer_norm`` (centre, scale, bias) and
``fused_add_rms_norm`` (add a residual first and return the sum too). Each op
has a forward stage (outputs plus the statistics the backward needs), a
tangent stage (forward-mode AD) and a backward stage.

Layout shared by every implementation: ``x`` is ``(*lead, H)``; ``w`` is
``(*groups, H)`` where ``groups`` is a prefix of ``lead`` (empty for the usual
shared weight; vmapping over the weight adds group dims). Statistics are in
float32 (float64 for float64 inputs); outputs have the input's dtype.

The kernels view ``x`` as ``(G, R, H)`` (G = prod(groups)) and run a
``(G, cdiv(R, block_rows))`` grid. Triton needs power-of-two blocks, so the
hidden block is ``H`` rounded up and padded columns are masked; Mosaic TPU
takes the whole hidden dim and ``block_rows`` a multiple of the sublane tile.
``dweight`` (and ``dbias``) are reduced per row block inside the backward
kernel and the per-block partials are summed after it, so ``x`` is read once.
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

from pallax.executor import KernelSpec, register_kernel
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend, xla_allowed, xla_on_cpu
from pallax.pallas_utils import (and_masks, in_bounds, load, masked, next_pow2, stat_dtype, store,
                                 sublanes, triton_compiler_params)


@dataclasses.dataclass(frozen=True)
class NormConfig(KernelConfig):
  """Block sizes of the norm kernels (every op, forward and backward).

  implementation: ``"pallas"`` (the kernel) or ``"xla"`` (the XLA program).
  block_rows: rows per program (power of two on Triton; multiple of the
    sublane tile, or all rows, on TPU).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """
  block_rows: int
  num_warps: int = 4
  num_stages: int = 1
  positive_fields: ClassVar[tuple[str, ...]] = ("block_rows", "num_warps", "num_stages")


def _rows_hidden(avals) -> tuple[int, int]:
  x = avals[0]
  return max(1, math.prod(x.shape[:-1])), x.shape[-1]


def _pallas_heuristic(avals, backend: str, **params) -> NormConfig:
  """Rows per block so that one block of x holds about 16K (Triton) or 512K (TPU) elements."""
  rows, hidden = _rows_hidden(avals)
  if backend == "triton":
    bh = next_pow2(hidden)
    block_rows = max(1, min(next_pow2(rows), 16384 // bh, 64))
    num_warps = max(1, min(16, bh * block_rows // 1024))
    return NormConfig(block_rows=block_rows, num_warps=next_pow2(num_warps))
  sub = sublanes(avals[0].dtype)
  fit = max(sub, (524288 // hidden) // sub * sub)
  return NormConfig(block_rows=min(fit, 1024))


norm_heuristic = xla_on_cpu(_pallas_heuristic)


def norm_candidates(avals: Sequence[Any], target: str, **params) -> list[NormConfig]:
  """The autotuning space: block rows (and warps on Triton), plus the XLA program."""
  rows, hidden = _rows_hidden(avals)
  backend = kernel_backend(target)
  if interpreted(target):  # interpreted kernels are slow: a few block sizes
    base = _pallas_heuristic(avals, backend)
    blocks = sorted({base.block_rows, max(1, base.block_rows // 4)})
    out = [dataclasses.replace(base, block_rows=b) for b in blocks]
  elif backend == "triton":
    bh = next_pow2(hidden)
    out = [NormConfig(block_rows=b, num_warps=w)
           for b in (1, 2, 4, 8, 16, 32, 64) if b <= next_pow2(rows) and b * bh <= 65536
           for w in (2, 4, 8, 16) if w * 32 <= b * bh]
  else:
    sub = sublanes(avals[0].dtype)
    out = [NormConfig(block_rows=b) for b in (sub, 2 * sub, 4 * sub, 8 * sub, 256, 512, 1024)
           if b % sub == 0 and b * hidden <= 2 ** 21]
  if xla_allowed(target):
    out.append(NormConfig(block_rows=1, implementation="xla"))
  return out or [_pallas_heuristic(avals, backend)]


def norm_supports(avals: Sequence[Any], target: str, config: NormConfig,
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


for _op in ("rms_norm", "layer_norm", "fused_add_rms_norm"):
  for _stage in ("fwd", "bwd"):
    register_kernel(KernelSpec(f"{_op}_{_stage}", NormConfig, norm_heuristic, norm_candidates,
                               norm_supports))


# ----------------------------------------------------------------------------
# The three ops: operand and result names per stage.

# What each name is: a full row of x (ROW), a per-row statistic (STAT) or a
# weight-like vector (WEIGHT).
ROW, STAT, WEIGHT = "row", "stat", "weight"
CATEGORY = {
    **dict.fromkeys(("x", "r", "y", "h", "dy", "dh", "dx", "x_dot", "y_dot", "h_dot"), ROW),
    **dict.fromkeys(("mean", "rstd"), STAT),
    **dict.fromkeys(("w", "b", "w_dot", "b_dot", "dw", "db"), WEIGHT),
}


@dataclasses.dataclass(frozen=True)
class NormKind:
  """Which normalisation: centre (subtract the mean), bias, fused residual add.

  With ``residual``, the op normalises ``h = x + r`` and returns ``h`` too;
  the tangent and backward stages then see ``h`` as their ``x``.
  """
  center: bool = False
  bias: bool = False
  residual: bool = False

  def names(self, stage: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(operands, results) of ``stage`` in ``fwd``, ``jvp``, ``bwd``."""
    c, b, r = self.center, self.bias, self.residual
    mean = ("mean",) * c
    return {
        "fwd": (("x",) + ("r",) * r + ("w",) + ("b",) * b,
                ("y",) + ("h",) * r + mean + ("rstd",)),
        "jvp": (("x", "w") + mean + ("rstd", "x_dot", "w_dot") + ("b_dot",) * b,
                ("y_dot",) + ("h_dot",) * r),
        "bwd": (("x", "w") + mean + ("rstd", "dy") + ("dh",) * r,
                ("dx", "dw") + ("db",) * b),
    }[stage]


RMS = NormKind()
LAYER = NormKind(center=True, bias=True)
ADD_RMS = NormKind(residual=True)


# ----------------------------------------------------------------------------
# XLA programs (the CPU path; the reference's twin).


def _weight_like_x(w: jax.Array, x_ndim: int) -> jax.Array:
  """``w (*groups, H)`` reshaped to broadcast against ``x (*lead, H)``."""
  groups = w.shape[:-1]
  return w.reshape(groups + (1,) * (x_ndim - 1 - len(groups)) + w.shape[-1:])


def _sum_to_weight(v: jax.Array, w_ndim: int) -> jax.Array:
  """Sums ``v (*lead, H)`` over the lead dims that are not weight groups."""
  return jnp.sum(v, axis=tuple(range(w_ndim - 1, v.ndim - 1)))


# Up to this many elements of x the XLA programs take the forms autodiff of
# plain jnp takes; beyond, forms that write less memory. XLA:CPU fuses them
# differently, and neither wins at every size (bench/test_norm.py):
# * backward: ``dx = g*r + xc * s`` with dw from ``xc*r`` below, the factored
#   ``r * (g - xc * r^2 * mean(g * xc))`` above. rms_norm fwd+bwd measured
#   1.02-1.07x plain jnp at 1024x1024 with the first (1.15x with the second);
#   at 4096x1024 and 8192x4096 the second 0.8-0.9x, the first 0.9-1.0x.
# * fused_add_rms_norm forward: ``h = x + r`` in x's dtype below (XLA may keep
#   the float32 sum for the statistics, as for plain jnp); above, the float32
#   sum rounded to h's dtype first, so a 16-bit h is the only copy written
#   (half the bytes of plain jnp in bf16 from 4096x1024 on).
_CACHE_SIZED_ELEMENTS = 1 << 20


def _add(x, r):
  """``x + r`` in x's dtype (see ``_CACHE_SIZED_ELEMENTS``)."""
  if x.size <= _CACHE_SIZED_ELEMENTS:
    return x + r
  return (x.astype(stat_dtype(x.dtype)) + r.astype(stat_dtype(x.dtype))).astype(x.dtype)


def norm_fwd_xla(*args, kind: NormKind, eps: float, offset: float):
  operands, results = kind.names("fwd")
  a = dict(zip(operands, args))
  x, out = a["x"], {}
  if kind.residual:
    x = out["h"] = _add(x, a["r"])
  st = stat_dtype(x.dtype)
  xf = x.astype(st)
  if kind.center:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xf, out["mean"] = xf - mean, mean[..., 0]
  rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  y = xf * rstd * (_weight_like_x(a["w"], x.ndim).astype(st) + offset)
  if kind.bias:
    y = y + _weight_like_x(a["b"], x.ndim).astype(st)
  out["y"], out["rstd"] = y.astype(x.dtype), rstd[..., 0]
  return [out[n] for n in results]


def _centered(a, st):
  """``x - mean`` (``x`` without centring) in the stats dtype, and ``rstd`` as a column.

  The XLA programs keep ``(x - mean)`` and ``rstd`` apart rather than forming
  ``xhat = (x - mean) * rstd``: XLA:CPU then fuses the backward into as many
  passes over memory as autodiff of the plain formulation takes.
  """
  xf = a["x"].astype(st)
  if "mean" in a:
    xf = xf - a["mean"][..., None]
  return xf, a["rstd"][..., None]


def norm_jvp_xla(*args, kind: NormKind, offset: float):
  operands, results = kind.names("jvp")
  a = dict(zip(operands, args))
  x = a["x"]
  st = stat_dtype(x.dtype)
  xc, r = _centered(a, st)
  xhat, xd = xc * r, a["x_dot"].astype(st)
  if kind.center:
    xd = xd - jnp.mean(xd, axis=-1, keepdims=True)
  xhat_dot = r * (xd - xhat * jnp.mean(xhat * xd, axis=-1, keepdims=True))
  y_dot = (xhat_dot * (_weight_like_x(a["w"], x.ndim).astype(st) + offset)
           + xhat * _weight_like_x(a["w_dot"], x.ndim).astype(st))
  if kind.bias:
    y_dot = y_dot + _weight_like_x(a["b_dot"], x.ndim).astype(st)
  out = {"y_dot": y_dot.astype(x.dtype), "h_dot": a["x_dot"]}
  return [out[n] for n in results]




def norm_bwd_xla(*args, kind: NormKind, offset: float):
  operands, results = kind.names("bwd")
  a = dict(zip(operands, args))
  x, w = a["x"], a["w"]
  st = stat_dtype(x.dtype)
  (xc, r), dy = _centered(a, st), a["dy"].astype(st)
  g = dy * (_weight_like_x(w, x.ndim).astype(st) + offset)
  if x.size <= _CACHE_SIZED_ELEMENTS:
    # dx = g*r + xc * (sum(g*xc) * -r^3/H), the form autodiff of plain jnp takes.
    dx = g * r + xc * (jnp.sum(g * xc, axis=-1, keepdims=True) * (r * r * r) / -x.shape[-1])
    if kind.center:
      dx = dx - r * jnp.mean(g, axis=-1, keepdims=True)
    dw = dy * (xc * r)
  else:
    inner = g - xc * (r * r) * jnp.mean(g * xc, axis=-1, keepdims=True)
    if kind.center:
      inner = inner - jnp.mean(g, axis=-1, keepdims=True)
    dx = r * inner
    dw = dy * xc * r
  if kind.residual:
    dx = dx + a["dh"].astype(st)
  out = {"dx": dx.astype(x.dtype), "dw": _sum_to_weight(dw, w.ndim).astype(w.dtype),
         "db": _sum_to_weight(dy, w.ndim).astype(w.dtype)}
  return [out[n] for n in results]


# ----------------------------------------------------------------------------
# Pallas kernels.


@dataclasses.dataclass(frozen=True)
class _Layout:
  """The (G, R, H) view of one call and its grid for a given config/backend."""
  backend: str
  groups: int
  rows: int
  hidden: int
  block_rows: int
  block_hidden: int

  @classmethod
  def of(cls, x_shape, w_shape, config: NormConfig, backend: str) -> "_Layout":
    hidden = x_shape[-1]
    groups = math.prod(w_shape[:-1])
    rows = math.prod(x_shape[:-1]) // max(groups, 1)
    block_rows = min(config.block_rows, rows) if backend == "mosaic_tpu" else config.block_rows
    block_hidden = next_pow2(hidden) if backend == "triton" else hidden
    return cls(backend, groups, rows, hidden, block_rows, block_hidden)

  @property
  def num_blocks(self) -> int:
    return pl.cdiv(self.rows, self.block_rows)

  @property
  def grid(self) -> tuple[int, int]:
    return (self.groups, self.num_blocks)

  def rows_spec(self, width: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, self.block_rows, width), lambda g, i: (g, i, 0))

  def spec(self, category: str) -> pl.BlockSpec:
    """The block of an operand or result of ``category`` in the (G, R, H) view."""
    if category == ROW:
      return self.rows_spec(self.block_hidden)
    if category == STAT:
      return self.rows_spec(1)
    return self.weight_spec()

  def view_shape(self, category: str) -> tuple[int, ...]:
    return {ROW: (self.groups, self.rows, self.hidden), STAT: (self.groups, self.rows, 1),
            WEIGHT: (self.groups, 1, self.hidden)}[category]

  def weight_spec(self) -> pl.BlockSpec:
    return pl.BlockSpec((None, 1, self.block_hidden), lambda g, i: (g, 0, 0))

  def column_mask(self, shape) -> jax.Array | None:
    return in_bounds(0, self.block_hidden, self.hidden, shape, len(shape) - 1)

  def row_mask(self, shape) -> jax.Array | None:
    return in_bounds(pl.program_id(1), self.block_rows, self.rows, shape, 0)

  def bounds(self, category: str, shape) -> jax.Array | None:
    """Triton only: which entries of a ``category`` block lie inside the array.

    Mosaic TPU pads partial blocks itself (reads of the padding give garbage,
    writes to it are dropped); Triton blocks must be masked explicitly.
    """
    if self.backend != "triton":
      return None
    rows = self.row_mask(shape) if category in (ROW, STAT) else None
    cols = self.column_mask(shape) if category in (ROW, WEIGHT) else None
    return and_masks(rows, cols)


def _compiler_params(config: NormConfig, backend: str):
  if backend == "triton":
    return triton_compiler_params(config)
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _load(ref, st, layout: _Layout, category: str):
  """A block in the stats dtype; entries outside the array read as 0 on Triton."""
  return load(ref, layout.bounds(category, ref.shape)).astype(st)


def _store(ref, value, layout: _Layout, category: str) -> None:
  store(ref, value.astype(ref.dtype), layout.bounds(category, ref.shape))


def _fwd_kernel(*refs, kind: NormKind, layout: _Layout, eps, offset):
  operands, results = kind.names("fwd")
  r = dict(zip(operands + results, refs))
  st = stat_dtype(r["x"].dtype)
  x = _load(r["x"], st, layout, ROW)
  if kind.residual:
    h = (x + _load(r["r"], st, layout, ROW)).astype(r["h"].dtype)
    _store(r["h"], h, layout, ROW)
    x = h.astype(st)
  if kind.center:
    mean = jnp.sum(x, axis=-1, keepdims=True) / layout.hidden
    x = masked(x - mean, layout.column_mask(x.shape))  # padded columns stay 0
    _store(r["mean"], mean, layout, STAT)
  rstd = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / layout.hidden + eps)
  y = x * rstd * (_load(r["w"], st, layout, WEIGHT) + offset)
  if kind.bias:
    y = y + _load(r["b"], st, layout, WEIGHT)
  _store(r["y"], y, layout, ROW)
  _store(r["rstd"], rstd, layout, STAT)


def _bwd_kernel(*refs, kind: NormKind, layout: _Layout, offset):
  operands, results = kind.names("bwd")
  r = dict(zip(operands + results, refs))
  st = stat_dtype(r["x"].dtype)
  x, dy = _load(r["x"], st, layout, ROW), _load(r["dy"], st, layout, ROW)
  rstd = _load(r["rstd"], st, layout, STAT)
  xhat = ((x - _load(r["mean"], st, layout, STAT)) if kind.center else x) * rstd
  g = dy * (_load(r["w"], st, layout, WEIGHT) + offset)
  inner = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / layout.hidden)
  if kind.center:
    inner = inner - jnp.sum(g, axis=-1, keepdims=True) / layout.hidden
  dx = rstd * inner
  if kind.residual:
    dx = dx + _load(r["dh"], st, layout, ROW)
  _store(r["dx"], dx, layout, ROW)
  # Rows past the end of the last block hold garbage on TPU (NaN when
  # interpreted): mask them out of the per-block partial sums. Padded columns
  # have dy = 0, so they add nothing.
  rows = layout.row_mask(x.shape)
  _store(r["dw"], jnp.sum(masked(dy * xhat, rows), axis=0, keepdims=True), layout, WEIGHT)
  if kind.bias:
    _store(r["db"], jnp.sum(masked(dy, rows), axis=0, keepdims=True), layout, WEIGHT)


def norm_fwd_pallas(*args, kind: NormKind, eps: float, offset: float, config: NormConfig,
                    backend: str, interpret):
  operands, results = kind.names("fwd")
  a = dict(zip(operands, args))
  x = a["x"]
  if x.size == 0:
    return norm_fwd_xla(*args, kind=kind, eps=eps, offset=offset)
  lay = _Layout.of(x.shape, a["w"].shape, config, backend)
  st = stat_dtype(x.dtype)
  outs = pl.pallas_call(
      lambda *refs: _fwd_kernel(*refs, kind=kind, layout=lay, eps=eps, offset=offset),
      grid=lay.grid,
      in_specs=[lay.spec(CATEGORY[n]) for n in operands],
      out_specs=[lay.spec(CATEGORY[n]) for n in results],
      out_shape=[jax.ShapeDtypeStruct(lay.view_shape(CATEGORY[n]),
                                      st if CATEGORY[n] == STAT else x.dtype) for n in results],
      compiler_params=_compiler_params(config, backend),
      interpret=interpret,
      name="norm_fwd",
  )(*[a[n].reshape(lay.view_shape(CATEGORY[n])) for n in operands])
  shapes = {ROW: x.shape, STAT: x.shape[:-1]}
  return [o.reshape(shapes[CATEGORY[n]]) for o, n in zip(outs, results)]


def norm_bwd_pallas(*args, kind: NormKind, offset: float, config: NormConfig,
                    backend: str, interpret):
  operands, results = kind.names("bwd")
  a = dict(zip(operands, args))
  x, w = a["x"], a["w"]
  if x.size == 0:
    return norm_bwd_xla(*args, kind=kind, offset=offset)
  lay = _Layout.of(x.shape, w.shape, config, backend)
  st = stat_dtype(x.dtype)
  partial = pl.BlockSpec((None, None, 1, lay.block_hidden), lambda g, i: (g, i, 0, 0))
  partial_shape = jax.ShapeDtypeStruct((lay.groups, lay.num_blocks, 1, lay.hidden), st)
  outs = pl.pallas_call(
      lambda *refs: _bwd_kernel(*refs, kind=kind, layout=lay, offset=offset),
      grid=lay.grid,
      in_specs=[lay.spec(CATEGORY[n]) for n in operands],
      out_specs=[lay.spec(ROW)] + [partial] * (len(results) - 1),
      out_shape=[jax.ShapeDtypeStruct(lay.view_shape(ROW), x.dtype)]
                + [partial_shape] * (len(results) - 1),
      compiler_params=_compiler_params(config, backend),
      interpret=interpret,
      name="norm_bwd",
  )(*[a[n].reshape(lay.view_shape(CATEGORY[n])) for n in operands])
  # The weight-like results: sum the per-block partials.
  sums = [jnp.sum(o, axis=(1, 2)).reshape(w.shape).astype(w.dtype) for o in outs[1:]]
  return [outs[0].reshape(x.shape)] + sums
