"""Softmax ops: ``pallax.softmax`` and ``pallax.log_softmax``.

The primitives reduce over the last axis of operands of one shape; the public
functions move the softmax axes there and back. ``mask`` is the ``where=``
argument as an optional trailing bool operand, absent without one (so the
common call reads nothing extra). Following design.md section 2, each forward
primitive returns the residual its backward needs, which is its output:

* ``softmax_fwd_p (x, [mask]) -> (y,)``: the forward kernel.
* ``softmax_bwd_p (y, v, [mask]) -> (y * (v - sum(y * v)),)``: softmax's
  Jacobian is symmetric (masked: projected by the mask on both sides), so this
  one primitive, linear in ``v``, is both the tangent (``v = x_dot``) and, as
  its own transpose, the backward kernel. The mask is needed although masked
  ``y`` are 0: in a NaN row (only -inf, or a +inf) jax's gradient is 0, not
  NaN, at masked entries.
* ``log_softmax_fwd_p (x, [mask]) -> (z,)``: the forward kernel.
* ``log_softmax_jvp_p (z, t, [mask]) -> (t - sum(exp(z) * t),)``: the tangent,
  linear in ``t``; its transpose is
* ``log_softmax_bwd_p (z, g, [mask]) -> (g - exp(z) * sum(g),)``: the backward
  kernel (both 0 where masked).

``grad`` thus costs one forward and one backward kernel, and ``jvp`` one
forward and one tangent kernel. Second-order AD differentiates the XLA
programs of the tangent and backward primitives.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from pallax.batching_rules import softmax as softmax_batching
from pallax.kernels import softmax as kernels
from pallax.kernels.softmax import SoftmaxConfig
from pallax.op import (Dims, bind, define_primitive, instantiate, match_manual_axes,
                       register_jvp_by_xla)
from pallax.selfcheck import SelfCheck, register
from pallax.validation import check_config, check_floating

__all__ = ["softmax", "log_softmax", "SoftmaxConfig"]

Axis = Union[int, Sequence[int], None]


# ----------------------------------------------------------------------------
# Shapes and shardings.


def _dims(*avals, **params) -> Dims:
  """Leading dims are rows and shard freely; the softmax axis is replicated."""
  names = tuple(f"r{i}" for i in range(avals[0].ndim - 1)) + ("c",)
  return Dims(operands=(names,) * len(avals), results=(names,), replicated=("c",))


def _like_first(*avals, **params):
  return [avals[0].update(weak_type=False)]


def _like_second(*avals, **params):
  return [avals[1].update(weak_type=False)]


def _define(name: str, abstract_eval):
  """The primitive ``name``, its XLA program and kernel taken from kernels/softmax.py."""
  return define_primitive(name, abstract_eval=abstract_eval,
                          xla_impl=getattr(kernels, f"{name}_xla"),
                          kernel_impl=getattr(kernels, f"{name}_pallas"), dims=_dims)


softmax_fwd_p = _define("softmax_fwd", _like_first)
softmax_bwd_p = _define("softmax_bwd", _like_second)
log_softmax_fwd_p = _define("log_softmax_fwd", _like_first)
log_softmax_jvp_p = _define("log_softmax_jvp", _like_second)
log_softmax_bwd_p = _define("log_softmax_bwd", _like_second)


# ----------------------------------------------------------------------------
# Autodiff. The mask is bool: it has no tangent and gets no cotangent.


def _fwd_jvp_rule(fwd, tangent, primals, tangents, **params):
  """JVP of a forward primitive ``(x, [mask])``: itself, then its tangent primitive."""
  x, *mask = primals
  (x_dot,) = instantiate(tangents[:1])
  (out,) = fwd.bind(x, *mask, **params)
  return [out], tangent.bind(out, x_dot, *mask, **params)


def _tangent_transpose_rule(transposed, cts, primal, tangent, *mask, **params):
  """Transpose of a tangent primitive ``(primal, tangent, [mask])``, linear in ``tangent``."""
  (ct,) = cts
  assert not ad.is_undefined_primal(primal), "linear in the tangent operand only"
  if type(ct) is ad.Zero:
    return [None, ad.Zero(tangent.aval), *[None] * len(mask)]
  return [None, *transposed.bind(primal, ct, *mask, **params), *[None] * len(mask)]


for _fwd, _tangent, _bwd in ((softmax_fwd_p, softmax_bwd_p, softmax_bwd_p),
                             (log_softmax_fwd_p, log_softmax_jvp_p, log_softmax_bwd_p)):
  ad.primitive_jvps[_fwd] = functools.partial(_fwd_jvp_rule, _fwd, _tangent)
  ad.primitive_transposes[_tangent] = functools.partial(_tangent_transpose_rule, _bwd)

# Second order (HVPs, jacfwd of grad) differentiates the XLA programs.
for _prim in (softmax_bwd_p, log_softmax_jvp_p, log_softmax_bwd_p):
  register_jvp_by_xla(_prim)

for _prim in (softmax_fwd_p, softmax_bwd_p, log_softmax_fwd_p, log_softmax_jvp_p,
              log_softmax_bwd_p):
  softmax_batching.register_rows(_prim)


# ----------------------------------------------------------------------------
# Public functions.


def _softmax_axes(op: str, axis: Axis, shape: tuple[int, ...]) -> tuple[int, ...]:
  """``axis`` (an int, a sequence of ints or None: all) as sorted non-negative axes."""
  ndim = len(shape)
  if axis is None:
    return tuple(range(ndim))
  axes = (axis,) if isinstance(axis, (numbers.Integral, np.integer)) else axis
  try:
    axes = tuple(axes)
  except TypeError:
    raise TypeError(f"{op}: axis must be an int, a tuple of ints or None, "
                    f"got {type(axis).__name__}") from None
  for a in axes:
    if isinstance(a, (bool, np.bool_)) or not isinstance(a, (numbers.Integral, np.integer)):
      raise TypeError(f"{op}: axis must be an int, a tuple of ints or None, got {axis!r}")
    if not -ndim <= a < ndim:
      raise ValueError(f"{op}: axis {a} is out of range for x of shape {shape}")
  normalized = tuple(sorted(int(a) % ndim for a in axes))
  if len(set(normalized)) != len(normalized):
    raise ValueError(f"{op}: axis {axis!r} repeats an axis (x of shape {shape})")
  return normalized


def _call(op: str, prim, x, axis: Axis, where, config) -> jax.Array:
  """Validates, moves the softmax axes last (merged into one), binds, moves back."""
  x = jnp.asarray(x)
  check_floating(op, "x", x)
  axes = _softmax_axes(op, axis, x.shape)
  check_config(op, config, SoftmaxConfig)
  operands = [x]
  if where is not None:
    where = jnp.asarray(where)
    if where.dtype != jnp.bool_:
      raise TypeError(f"{op}: where must be a boolean array, got {where.dtype} "
                      f"(shape {where.shape})")
    try:
      broadcast = np.broadcast_shapes(where.shape, x.shape) == x.shape
    except ValueError:
      broadcast = False
    if not broadcast:
      raise ValueError(f"{op}: where of shape {where.shape} does not broadcast to the shape "
                       f"of x {x.shape}")
    operands.append(jnp.broadcast_to(where, x.shape))
  kept = tuple(d for d in range(x.ndim) if d not in axes)
  perm = kept + axes
  moved = tuple(x.shape[d] for d in perm)
  rows_shape = moved[:len(kept)] + (math.prod(moved[len(kept):]),)
  operands = [jnp.transpose(a, perm).reshape(rows_shape) for a in operands]
  (out,) = bind(prim, *match_manual_axes(*operands), config=config)
  return jnp.transpose(out.reshape(moved), np.argsort(perm))


def softmax(x: jax.Array, axis: Axis = -1, *, where: Optional[jax.Array] = None,
            config: Optional[SoftmaxConfig] = None) -> jax.Array:
  """Softmax over ``axis``, with ``jax.nn.softmax``'s semantics.

  ``exp(x - max(x)) / sum(exp(x - max(x)))`` with the arithmetic in float32
  (float64 for float64 inputs) and ``y.dtype == x.dtype``. Entries where
  ``where`` is False take no part and are 0 (a fully masked row is all 0);
  -inf entries are 0; a row holding +inf, or only -inf, is NaN, as in jax.

  Args:
    x: floating array.
    axis: the axis, or tuple of axes, to normalise over; None means all.
    where: optional boolean array broadcastable to ``x``: the entries to include.
    config: pin the kernels' ``SoftmaxConfig`` instead of letting the executor
      choose.

  Returns:
    An array of ``x``'s shape and dtype.
  """
  return _call("softmax", softmax_fwd_p, x, axis, where, config)


def log_softmax(x: jax.Array, axis: Axis = -1, *, where: Optional[jax.Array] = None,
                config: Optional[SoftmaxConfig] = None) -> jax.Array:
  """Log-softmax over ``axis``, with ``jax.nn.log_softmax``'s semantics.

  ``(x - max(x)) - log(sum(exp(x - max(x))))`` with the arithmetic in float32
  (float64 for float64 inputs) and ``z.dtype == x.dtype``. Entries where
  ``where`` is False take no part and are -inf (a fully masked row is all
  -inf); a row holding +inf, or only -inf, is NaN, as in jax.

  Args: as for ``softmax``.

  Returns:
    An array of ``x``'s shape and dtype.
  """
  return _call("log_softmax", log_softmax_fwd_p, x, axis, where, config)


def _selfcheck_args(rng: np.random.Generator, dtype, small: bool):
  rows, cols = (37, 300) if small else (4096, 1024)
  return (jnp.asarray(3 * rng.standard_normal((rows, cols)), dtype),)


register(SelfCheck("softmax", make_args=_selfcheck_args, op=softmax,
                   reference=jax.nn.softmax))
register(SelfCheck("log_softmax", make_args=_selfcheck_args, op=log_softmax,
                   reference=jax.nn.log_softmax))
