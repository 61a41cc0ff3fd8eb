"""Softmax ops: ``pallax.softmax`` and ``pallax.log_softmax``.

The primitives reduce over the last axis of operands of one shape; the public
functions move the softmax axes there and back. ``mask`` is the ``where=``
argument as an optional trailing bool operand, absent without one (so the
common call reads nothing extra). Each op is declared with
``define_residual_op`` (design.md section 2); softmax's derivatives take its
output, log_softmax's its input:

* ``softmax_fwd (x, [mask]) -> (y,)``: the forward kernel.
* ``softmax_bwd (y, v, [mask]) -> (y * (v - sum(y * v)),)``: softmax's
  Jacobian is symmetric (masked: projected by the mask on both sides), so this
  one primitive, linear in ``v``, is both the tangent (``v = x_dot``) and, as
  its own transpose, the backward kernel. The mask is needed although masked
  ``y`` are 0: in a NaN row (only -inf, or a +inf) jax's gradient is 0, not
  NaN, at masked entries.
* ``log_softmax_fwd (x, [mask]) -> (z,)``: the forward kernel.
* ``log_softmax_jvp (x, t, [mask]) -> (t - sum(softmax(x) * t),)``: the
  tangent, linear in ``t``; its transpose is
* ``log_softmax_bwd (x, g, [mask]) -> (g - softmax(x) * sum(g),)``: the
  backward kernel (both 0 where masked). They take the input, not the output:
  the kernels recompute the row's max and sum (the same bytes read as from
  ``z``, and ``softmax`` exact rather than ``exp`` of a rounded ``z``), and
  on the CPU, where ``exp`` rather than memory sets the time, XLA shares the
  forward's ``exp(x - max)`` with them, one ``exp`` an element as for
  autodiff of ``jax.nn.log_softmax`` (``bench/test_xla_parity.py``).

``grad`` thus costs one forward and one backward kernel (log_softmax's
forward only where its value is used), and ``jvp`` one forward and one
tangent kernel. Second-order AD differentiates the XLA
programs of the tangent and backward primitives.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from pallax.batching_rules import softmax as softmax_batching
from pallax.kernels import softmax as kernels
from pallax.kernels.softmax import SoftmaxConfig
from pallax.kernels.softmax import xla as softmax_xla
from pallax.op import Dims, PrimitiveSpec, bind, define_residual_op, instantiate, match_manual_axes
from pallax.validation import check_config, check_floating

__all__ = ["softmax", "log_softmax", "SoftmaxConfig"]

Axis = Union[int, Sequence[int], None]
Mask = Optional[jax.Array]
Config = Optional[SoftmaxConfig]


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


def _stage(name: str, abstract_eval) -> PrimitiveSpec:
  """The primitive ``name``: its XLA program and kernel taken from kernels/softmax."""
  return PrimitiveSpec(
    abstract_eval=abstract_eval,
    xla=getattr(softmax_xla, name),
    kernel=kernels.kernel(name),
    dims=_dims,
    batching=softmax_batching.rows,
  )


def _tangent_operands(residual: str):
  """``(residual, x_dot, [mask])``, the residual being the output or the input.

  The mask is bool: it has no tangent and gets no cotangent.
  """

  def operands(primals, outs, tangents, **params):
    x, *mask = primals
    return [outs[0] if residual == "out" else x, *instantiate(tangents[:1]), *mask]

  return operands


softmax_p = define_residual_op(
  "softmax",
  fwd=_stage("softmax_fwd", _like_first),
  tangent=_stage("softmax_bwd", _like_second),
  linear=slice(1, 2),
  tangent_operands=_tangent_operands("out"),
)
log_softmax_p = define_residual_op(
  "log_softmax",
  fwd=_stage("log_softmax_fwd", _like_first),
  tangent=_stage("log_softmax_jvp", _like_second),
  bwd=_stage("log_softmax_bwd", _like_second),
  linear=slice(1, 2),
  tangent_operands=_tangent_operands("x"),
)


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
    raise TypeError(
      f"{op}: axis must be an int, a tuple of ints or None, got {type(axis).__name__}"
    ) from None
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
      raise TypeError(
        f"{op}: where must be a boolean array, got {where.dtype} (shape {where.shape})"
      )
    try:
      broadcast = np.broadcast_shapes(where.shape, x.shape) == x.shape
    except ValueError:
      broadcast = False
    if not broadcast:
      raise ValueError(
        f"{op}: where of shape {where.shape} does not broadcast to the shape of x {x.shape}"
      )
    operands.append(jnp.broadcast_to(where, x.shape))
  kept = tuple(d for d in range(x.ndim) if d not in axes)
  perm = kept + axes
  moved = tuple(x.shape[d] for d in perm)
  rows_shape = moved[: len(kept)] + (math.prod(moved[len(kept) :]),)
  operands = [jnp.transpose(a, perm).reshape(rows_shape) for a in operands]
  (out,) = bind(prim, *match_manual_axes(*operands), config=config)
  return jnp.transpose(out.reshape(moved), np.argsort(perm))


def softmax(
  x: jax.Array, axis: Axis = -1, *, where: Mask = None, config: Config = None
) -> jax.Array:
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
  return _call("softmax", softmax_p.fwd, x, axis, where, config)


def log_softmax(
  x: jax.Array, axis: Axis = -1, *, where: Mask = None, config: Config = None
) -> jax.Array:
  """Log-softmax over ``axis``, with ``jax.nn.log_softmax``'s semantics.

  ``(x - max(x)) - log(sum(exp(x - max(x))))`` with the arithmetic in float32
  (float64 for float64 inputs) and ``z.dtype == x.dtype``. Entries where
  ``where`` is False take no part and are -inf (a fully masked row is all
  -inf); a row holding +inf, or only -inf, is NaN, as in jax.

  Args: as for ``softmax``.

  Returns:
    An array of ``x``'s shape and dtype.
  """
  return _call("log_softmax", log_softmax_p.fwd, x, axis, where, config)
