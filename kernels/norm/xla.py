"""The norm XLA programs: the CPU path and the float64 reference's twin.

Layout: ``x`` is ``(*lead, H)``; ``w`` is ``(*groups, H)`` where ``groups``
is a prefix of ``lead`` (empty for the usual shared weight; vmapping over the
weight adds group dims). Statistics are in float32 (float64 for float64
inputs); outputs have the input's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallax.kernels.norm.kind import NormKind
from pallax.pallas_utils import stat_dtype

# Up to this many elements of x (rows that the CPU caches hold) the XLA
# programs take forms close to autodiff of plain jnp; beyond, forms that write
# less memory. XLA:CPU fuses and schedules them differently, and neither wins at
# every size (bench/test_norm.py, bench/test_xla_parity.py):
# * backward: below, ``dx = g*rstd + xc * s`` with the row sum ``s`` taken
#   over the forward's normalised rows ``(xc * rstd) * scale`` (see
#   ``norm_bwd``); above, the factored ``rstd * (g - xc * rstd^2 * mean(g *
#   xc))``. rms_norm float32 fwd+bwd at 1024x1024 measured 0.73-0.76x plain jnp
#   with the first (the autodiff-like ``s = sum(g * xc)``: 1.05-1.08x, its
#   backward written out before the forward's rows are consumed; the factored:
#   1.15x); at 4096x1024 and 8192x4096 the factored 0.84-0.89x, the first
#   0.98-1.0x.
# * fused_add_rms_norm forward: ``h = x + residual`` in x's dtype below (XLA
#   may keep the float32 sum for the statistics, as for plain jnp); above, the
#   float32 sum rounded to h's dtype first, so a 16-bit h is the only copy
#   written (half the bytes of plain jnp in bf16 from 4096x1024 on).
CACHE_SIZED_ELEMENTS = 1 << 20


def _weight_like_x(w: jax.Array, x_ndim: int) -> jax.Array:
  """``w (*groups, H)`` reshaped to broadcast against ``x (*lead, H)``."""
  groups = w.shape[:-1]
  return w.reshape(groups + (1,) * (x_ndim - 1 - len(groups)) + w.shape[-1:])


def _scale(w: jax.Array, x: jax.Array, st, offset: float) -> jax.Array:
  """``w + offset`` in the stats dtype, broadcasting against ``x``.

  One expression for every stage, so that XLA can merge the backward's
  recomputed ``(xc * rstd) * scale`` with the forward's.
  """
  return _weight_like_x(w, x.ndim).astype(st) + offset


def _sum_to_weight(v: jax.Array, w_ndim: int) -> jax.Array:
  """Sums ``v (*lead, H)`` over the lead dims that are not weight groups."""
  return jnp.sum(v, axis=tuple(range(w_ndim - 1, v.ndim - 1)))


def _add(x, residual):
  """``x + residual`` in x's dtype (see ``CACHE_SIZED_ELEMENTS``)."""
  if x.size <= CACHE_SIZED_ELEMENTS:
    return x + residual
  st = stat_dtype(x.dtype)
  return (x.astype(st) + residual.astype(st)).astype(x.dtype)


def norm_fwd(*args, kind: NormKind, eps: float, offset: float):
  operands, results = kind.names("fwd")
  arg = dict(zip(operands, args))
  x, out = arg["x"], {}
  if kind.residual:
    x = out["h"] = _add(x, arg["residual"])
  st = stat_dtype(x.dtype)
  xf = x.astype(st)
  if kind.center:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xf, out["mean"] = xf - mean, mean[..., 0]
  rstd = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  y = xf * rstd * _scale(arg["w"], x, st, offset)
  if kind.bias:
    y = y + _weight_like_x(arg["b"], x.ndim).astype(st)
  out["y"], out["rstd"] = y.astype(x.dtype), rstd[..., 0]
  return [out[n] for n in results]


def _centered(arg, st):
  """``x - mean`` (``x`` without centring) in the stats dtype, and ``rstd`` as a column.

  The XLA programs keep ``(x - mean)`` and ``rstd`` apart rather than forming
  ``xhat = (x - mean) * rstd``: XLA:CPU then fuses the backward into as many
  passes over memory as autodiff of the plain formulation takes.
  """
  xf = arg["x"].astype(st)
  if "mean" in arg:
    xf = xf - arg["mean"][..., None]
  return xf, arg["rstd"][..., None]


def norm_jvp(*args, kind: NormKind, offset: float):
  operands, results = kind.names("jvp")
  arg = dict(zip(operands, args))
  x = arg["x"]
  st = stat_dtype(x.dtype)
  xc, rstd = _centered(arg, st)
  xhat, xd = xc * rstd, arg["x_dot"].astype(st)
  if kind.center:
    xd = xd - jnp.mean(xd, axis=-1, keepdims=True)
  xhat_dot = rstd * (xd - xhat * jnp.mean(xhat * xd, axis=-1, keepdims=True))
  w_dot = _weight_like_x(arg["w_dot"], x.ndim).astype(st)
  y_dot = xhat_dot * _scale(arg["w"], x, st, offset) + xhat * w_dot
  if kind.bias:
    y_dot = y_dot + _weight_like_x(arg["b_dot"], x.ndim).astype(st)
  out = {"y_dot": y_dot.astype(x.dtype), "h_dot": arg["x_dot"]}
  return [out[n] for n in results]


def norm_bwd(*args, kind: NormKind, offset: float):
  operands, results = kind.names("bwd")
  arg = dict(zip(operands, args))
  x, w = arg["x"], arg["w"]
  st = stat_dtype(x.dtype)
  (xc, rstd), dy = _centered(arg, st), arg["dy"].astype(st)
  scale = _scale(w, x, st, offset)
  g = dy * scale
  if x.size <= CACHE_SIZED_ELEMENTS:
    # dx = g*rstd + xc * (sum(dy * xhat * scale) * -rstd^2/H), xhat = xc*rstd.
    # The row sum reads the forward's normalised rows (xc * rstd) * scale,
    # written in the forward's order: in one program XLA computes them once,
    # and dx, which needs the sum, comes after every other reader of those
    # rows, so it can take their buffer (autodiff's sum(g * xc) lets XLA:CPU
    # schedule dx first and keep one more full-size buffer live: 1.05-1.08x).
    xhat = xc * rstd
    dot = jnp.sum(dy * (xhat * scale), axis=-1, keepdims=True)
    dx = g * rstd + xc * (dot * (rstd * rstd) / -x.shape[-1])
    if kind.center:
      dx = dx - rstd * jnp.mean(g, axis=-1, keepdims=True)
    dw = dy * xhat
  else:
    inner = g - xc * (rstd * rstd) * jnp.mean(g * xc, axis=-1, keepdims=True)
    if kind.center:
      inner = inner - jnp.mean(g, axis=-1, keepdims=True)
    dx = rstd * inner
    dw = dy * xc * rstd
  if kind.residual:
    dx = dx + arg["dh"].astype(st)
  out = {
    "dx": dx.astype(x.dtype),
    "dw": _sum_to_weight(dw, w.ndim).astype(w.dtype),
    "db": _sum_to_weight(dy, w.ndim).astype(w.dtype),
  }
  return [out[n] for n in results]
