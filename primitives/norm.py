"""Normalisation ops: ``pallax.rms_norm``.

Three primitives, following design.md section 2:

* ``rms_norm_fwd_p (x, w) -> (y, rstd)``: the forward kernel; ``rstd`` is the
  residual the backward needs.
* ``rms_norm_jvp_p (x, w, rstd, x_dot, w_dot) -> (y_dot,)``: the tangent,
  linear in ``x_dot, w_dot``; its transpose is the backward kernel.
* ``rms_norm_bwd_p (x, w, rstd, dy) -> (dx, dw)``: the backward kernel.

``grad`` thus costs one forward and one backward kernel. Second-order AD
differentiates the XLA programs of the tangent and backward primitives.
``w`` may carry leading group dims that prefix ``x``'s leading dims: that is
how vmapping over the weight stays one kernel (see batching_rules/norm.py).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from pallax.batching_rules import norm as norm_batching
from pallax.kernels import norm as kernels
from pallax.kernels.norm import RmsNormConfig
from pallax.op import (Dims, bind, define_primitive, derived_aval, instantiate,
                       match_manual_axes, register_jvp_by_xla)
from pallax.selfcheck import SelfCheck, register
from pallax.validation import check_floating, check_static_float

__all__ = ["rms_norm", "rms_norm_reference", "RmsNormConfig"]


# ----------------------------------------------------------------------------
# Shapes and shardings.


def _row_spec(x_aval):
  return tuple(x_aval.sharding.spec) + (None,) * (x_aval.ndim - len(x_aval.sharding.spec))


def _rstd_aval(x_aval):
  return derived_aval(x_aval, x_aval.shape[:-1], kernels.stat_dtype(x_aval.dtype),
                      _row_spec(x_aval)[:-1])


def _factors(x_ndim: int, w_ndim: int):
  """Factor names: ``x`` rows (leading dims), the weight's group dims, hidden."""
  lead = tuple(f"r{i}" for i in range(x_ndim - 1))
  return lead + ("h",), lead[:w_ndim - 1] + ("h",), lead


def _rms_norm_fwd_abstract_eval(x, w, **params):
  return [x.update(weak_type=False), _rstd_aval(x)]


def _rms_norm_fwd_dims(x, w, **params) -> Dims:
  xs, ws, rows = _factors(x.ndim, w.ndim)
  return Dims(operands=(xs, ws), results=(xs, rows), replicated=("h",))


def _rms_norm_jvp_abstract_eval(x, w, rstd, x_dot, w_dot, **params):
  return [x.update(weak_type=False)]


def _rms_norm_jvp_dims(x, w, rstd, x_dot, w_dot, **params) -> Dims:
  xs, ws, rows = _factors(x.ndim, w.ndim)
  return Dims(operands=(xs, ws, rows, xs, ws), results=(xs,), replicated=("h",))


def _rms_norm_bwd_abstract_eval(x, w, rstd, dy, **params):
  return [x.update(weak_type=False), w.update(weak_type=False)]


def _rms_norm_bwd_dims(x, w, rstd, dy, **params) -> Dims:
  xs, ws, rows = _factors(x.ndim, w.ndim)
  return Dims(operands=(xs, ws, rows, xs), results=(xs, ws), replicated=("h",))


rms_norm_fwd_p = define_primitive(
    "rms_norm_fwd", abstract_eval=_rms_norm_fwd_abstract_eval,
    xla_impl=kernels.rms_norm_fwd_xla, kernel_impl=kernels.rms_norm_fwd_pallas,
    dims=_rms_norm_fwd_dims)

# The tangent runs as its XLA program on every platform (forward-mode AD only;
# under grad it is transposed into the backward kernel, never run).
rms_norm_jvp_p = define_primitive(
    "rms_norm_jvp", abstract_eval=_rms_norm_jvp_abstract_eval,
    xla_impl=kernels.rms_norm_jvp_xla, kernel_impl=None, dims=_rms_norm_jvp_dims)

rms_norm_bwd_p = define_primitive(
    "rms_norm_bwd", abstract_eval=_rms_norm_bwd_abstract_eval,
    xla_impl=kernels.rms_norm_bwd_xla, kernel_impl=kernels.rms_norm_bwd_pallas,
    dims=_rms_norm_bwd_dims)


# ----------------------------------------------------------------------------
# Autodiff.


def _rms_norm_fwd_jvp_rule(primals, tangents, *, eps, offset, **fw):
  x, w = primals
  x_dot, w_dot = instantiate(tangents)
  y, rstd = rms_norm_fwd_p.bind(x, w, eps=eps, offset=offset, **fw)
  (y_dot,) = rms_norm_jvp_p.bind(x, w, rstd, x_dot, w_dot, offset=offset, **fw)
  # d rstd = -rstd^3 * mean(x * x_dot): needed by second-order AD, which
  # differentiates the backward primitive with respect to rstd.
  st = rstd.dtype
  rstd_dot = -rstd ** 3 * jnp.mean(x.astype(st) * x_dot.astype(st), axis=-1)
  return [y, rstd], [y_dot, rstd_dot]


def _rms_norm_jvp_transpose_rule(cts, x, w, rstd, x_dot, w_dot, *, offset, **fw):
  (ct,) = cts
  if type(ct) is ad.Zero:
    return [None] * 3 + [ad.Zero(a.aval) if ad.is_undefined_primal(a) else None
                         for a in (x_dot, w_dot)]
  dx, dw = rms_norm_bwd_p.bind(x, w, rstd, ct, offset=offset, **fw)
  return [None, None, None,
          dx if ad.is_undefined_primal(x_dot) else None,
          dw if ad.is_undefined_primal(w_dot) else None]


ad.primitive_jvps[rms_norm_fwd_p] = _rms_norm_fwd_jvp_rule
ad.primitive_transposes[rms_norm_jvp_p] = _rms_norm_jvp_transpose_rule
register_jvp_by_xla(rms_norm_jvp_p)
register_jvp_by_xla(rms_norm_bwd_p)

norm_batching.register_rowwise(rms_norm_fwd_p, row_operands=(0,), weight_operands=(1,))
norm_batching.register_rowwise(rms_norm_jvp_p, row_operands=(0, 2, 3),
                               weight_operands=(1, 4))
norm_batching.register_rowwise(rms_norm_bwd_p, row_operands=(0, 2, 3),
                               weight_operands=(1,), weight_results=(1,))


# ----------------------------------------------------------------------------
# Public function.


def rms_norm(x: jax.Array, weight: Optional[jax.Array] = None, *, eps: float = 1e-6,
             offset: float = 0.0, config: Optional[RmsNormConfig] = None) -> jax.Array:
  """Root-mean-square normalisation over the last axis.

  ``y = x / sqrt(mean(x**2, axis=-1) + eps) * (offset + weight)``, with the
  statistics in float32 (float64 for float64 inputs) and ``y.dtype == x.dtype``.

  Args:
    x: floating array ``(..., hidden)``, any number of leading dims.
    weight: optional ``(hidden,)`` scale; None means no scaling.
    eps: non-negative constant added to the mean square.
    offset: added to ``weight`` (``offset=1.0`` gives the Gemma-style
      ``1 + weight``); only meaningful with a weight.
    config: pin the kernels' ``RmsNormConfig`` instead of letting the executor
      choose.

  Returns:
    The normalised array, same shape and dtype as ``x``.
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError("rms_norm: x must have at least 1 dimension, got a scalar (shape ())")
  check_floating("rms_norm", "x", x)
  eps = check_static_float("rms_norm", "eps", eps, minimum=0.0)
  offset = check_static_float("rms_norm", "offset", offset)
  if config is not None and not isinstance(config, RmsNormConfig):
    raise TypeError(f"rms_norm: config must be an RmsNormConfig, got {type(config).__name__}")
  hidden = x.shape[-1]
  if weight is None:
    if offset != 0.0:
      raise ValueError(f"rms_norm: offset={offset} needs a weight; got weight=None")
    # No weight == weight 0 with offset 1: one kernel serves both.
    weight, offset = jnp.zeros((hidden,), x.dtype), 1.0
  else:
    weight = jnp.asarray(weight)
    check_floating("rms_norm", "weight", weight)
    if weight.shape != (hidden,):
      raise ValueError(f"rms_norm: weight must have shape (hidden,) = ({hidden},) "
                       f"for x of shape {x.shape}; got weight of shape {weight.shape}")
  x, weight = match_manual_axes(x, weight)
  y, _ = bind(rms_norm_fwd_p, x, weight, eps=eps, offset=offset, config=config)
  return y


def rms_norm_reference(x: jax.Array, weight: Optional[jax.Array] = None, *,
                       eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
  """The plain-jnp formulation of ``rms_norm``.

  The baseline ``bench/`` and ``python -m pallax`` time against, and, fed
  float64 inputs, the self-check's oracle.
  """
  st = jnp.promote_types(x.dtype, jnp.float32)
  xf = x.astype(st)
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * (offset + weight.astype(st))
  return y.astype(x.dtype)


def _selfcheck_args(rng: np.random.Generator, dtype, small: bool):
  rows, hidden = (37, 200) if small else (4096, 1024)
  x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
  w = jnp.asarray(1.0 + 0.5 * rng.standard_normal(hidden), dtype)
  return x, w


register(SelfCheck("rms_norm", make_args=_selfcheck_args, op=rms_norm,
                   reference=rms_norm_reference))
