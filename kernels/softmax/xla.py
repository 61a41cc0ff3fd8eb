"""The softmax XLA programs: the CPU path and the float64 reference's twin.

Every program works on the last axis of operands of one shape; ``mask`` (the
``where=`` argument) is an optional trailing bool operand. Arithmetic is in
float32 (float64 for float64 inputs); outputs have the input's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallax.pallas_utils import masked, stat_dtype


def _shifted(x, mask):
  """``x - max(x)`` over the unmasked entries, in the stats dtype (masked: -inf).

  The max is exact in any dtype, so it is taken in the input's, as jax.nn does.
  """
  x = masked(x, mask, -jnp.inf)
  m = jnp.max(x, axis=-1, keepdims=True, initial=-jnp.inf)
  st = stat_dtype(x.dtype)
  return x.astype(st) - m.astype(st)


def softmax_fwd(x, mask=None):
  e = jnp.exp(_shifted(x, mask))
  y = e / jnp.sum(e, axis=-1, keepdims=True)
  return [masked(y, mask, 0).astype(x.dtype)]


def log_softmax_fwd(x, mask=None):
  s = _shifted(x, mask)
  z = s - jnp.log(jnp.sum(jnp.exp(s), axis=-1, keepdims=True))
  return [masked(z, mask, -jnp.inf).astype(x.dtype)]


def softmax_bwd(y, v, mask=None):
  """``y * (v - sum(y * v))`` (masked: 0): softmax's (symmetric) Jacobian times ``v``."""
  st = stat_dtype(y.dtype)
  yf, vf = y.astype(st), v.astype(st)
  s = jnp.sum(masked(yf * vf, mask, 0), axis=-1, keepdims=True)
  return [masked(yf * (vf - s), mask, 0).astype(v.dtype)]


# Up to this many elements of x, log_softmax's tangent and backward share the
# forward's exp (see ``_exp_and_sum``); above, they recompute it.
CACHE_SIZED_ELEMENTS = 1 << 20


def _exp_and_sum(x, mask):
  """``exp(x - max(x))`` (masked: 0) and its row sum, in the stats dtype.

  The same operations as ``log_softmax_fwd``'s. Up to ``CACHE_SIZED_ELEMENTS``
  elements XLA computes them once where the forward and these derivatives are
  in one program (common subexpressions): ``grad`` takes one ``exp`` per
  element, as autodiff of ``jax.nn.log_softmax`` does, and the shared ``exp``
  is written out once and read back while it is in cache. Above, an
  optimization barrier keeps them apart: each pass fuses its own ``exp``
  instead of writing and re-reading an array of x's size (float32
  forward+backward on 2 CPU cores: 0.78-0.83x jax.nn's time at 8192x4096
  this way, 1.04-1.06x shared; bench/test_xla_parity.py).
  """
  if x.size > CACHE_SIZED_ELEMENTS:
    x = lax.optimization_barrier(x)
  e = jnp.exp(_shifted(x, mask))
  return e, jnp.sum(e, axis=-1, keepdims=True)


def log_softmax_jvp(x, t, mask=None):
  """``t - sum(softmax(x) * t)`` (masked: 0): log_softmax's Jacobian times ``t``."""
  e, total = _exp_and_sum(x, mask)
  tf = masked(t.astype(e.dtype), mask, 0)
  dot = jnp.sum(e * tf, axis=-1, keepdims=True)
  return [masked(tf - dot / total, mask, 0).astype(t.dtype)]


def log_softmax_bwd(x, g, mask=None):
  """``g - softmax(x) * sum(g)`` (masked: 0): the transposed Jacobian times ``g``."""
  e, total = _exp_and_sum(x, mask)
  gf = masked(g.astype(e.dtype), mask, 0)
  dx = gf - e * (jnp.sum(gf, axis=-1, keepdims=True) / total)
  return [masked(dx, mask, 0).astype(g.dtype)]
