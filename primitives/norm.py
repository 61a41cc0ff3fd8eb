"""Normalisation ops: ``rms_norm``, ``layer_norm``, ``fused_add_rms_norm``.

Each op has three primitives, following design.md section 2 (names for
rms_norm; the others alike):

* ``rms_norm_fwd`` -> outputs plus the statistics the backward needs
  (``rstd``; ``mean`` too for layer_norm): the forward kernel;
* ``rms_norm_jvp`` -> the tangent, linear in the tangent operands; its
  transpose is the backward kernel;
* ``rms_norm_bwd`` -> ``dx`` and the weight (and bias) gradients: the
  backward kernel.

Each op is declared with ``define_residual_op``: ``grad`` thus costs one
forward and one backward kernel, and second-order AD differentiates the XLA
programs of the tangent and backward primitives. Operands and results are
named (``kernels.norm.NormKind.names``), and every rule here is written once
over those names. Weight-like operands may carry leading group dims that
prefix ``x``'s leading dims: that is how vmapping over the weight stays one
kernel (see batching_rules/norm.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax.batching_rules import norm as norm_batching
from pallax.kernels import norm as kernels
from pallax.kernels.norm import CATEGORY, ROW, STAT, WEIGHT, NormConfig, NormKind
from pallax.kernels.norm import xla as norm_xla
from pallax.op import (
  Dims,
  PrimitiveSpec,
  ResidualOp,
  bind,
  define_residual_op,
  derived_aval,
  full_spec,
  instantiate,
  match_manual_axes,
)
from pallax.pallas_utils import stat_dtype
from pallax.validation import check_array, check_config, check_floating, check_static_float

__all__ = [
  "rms_norm",
  "layer_norm",
  "fused_add_rms_norm",
  "NormConfig",
  "rms_norm_reference",
  "layer_norm_reference",
  "fused_add_rms_norm_reference",
]


# ----------------------------------------------------------------------------
# Shapes, shardings and batching, from the operand and result names.


def _norm_abstract_eval(operands, results, *avals, **params):
  aval = dict(zip(operands, avals))
  x, w = aval["x"], aval["w"]
  stat = derived_aval(x, x.shape[:-1], stat_dtype(x.dtype), full_spec(x)[:-1])
  by_category = {ROW: x.update(weak_type=False), STAT: stat, WEIGHT: w.update(weak_type=False)}
  return [by_category[CATEGORY[n]] for n in results]


def _norm_dims(operands, results, *avals, **params) -> Dims:
  """Rows (x's leading dims) shard freely; the hidden dim ``h`` is replicated."""
  aval = dict(zip(operands, avals))
  rows = tuple(f"r{i}" for i in range(aval["x"].ndim - 1))
  factors = {ROW: rows + ("h",), STAT: rows, WEIGHT: rows[: aval["w"].ndim - 1] + ("h",)}
  return Dims(
    operands=tuple(factors[CATEGORY[n]] for n in operands),
    results=tuple(factors[CATEGORY[n]] for n in results),
    replicated=("h",),
  )


_XLA = {"fwd": norm_xla.norm_fwd, "jvp": norm_xla.norm_jvp, "bwd": norm_xla.norm_bwd}


def _stage(name: str, kind: NormKind, stage: str) -> PrimitiveSpec:
  operands, results = kind.names(stage)
  index = lambda names, category: tuple(i for i, n in enumerate(names) if CATEGORY[n] == category)
  return PrimitiveSpec(
    abstract_eval=functools.partial(_norm_abstract_eval, operands, results),
    xla=functools.partial(_XLA[stage], kind=kind),
    # The tangent runs as its XLA program on every platform (forward-mode AD
    # only; under grad it is transposed into the backward kernel, never run).
    kernel=None if stage == "jvp" else kernels.kernel(f"{name}_{stage}", stage, kind),
    dims=functools.partial(_norm_dims, operands, results),
    batching=norm_batching.rowwise(
      row_operands=index(operands, ROW) + index(operands, STAT),
      weight_operands=index(operands, WEIGHT),
      weight_results=index(results, WEIGHT),
    ),
  )


def _tangent_operands(kind, primals, outs, tangents, **params):
  """The tangent stage's operands: residuals, then the tangents of x (h) and the weights."""
  operands, results = kind.names("fwd")
  primal, out = dict(zip(operands, primals)), dict(zip(results, outs))
  tangent = dict(zip(operands, instantiate(tangents)))
  named = {**primal, **out, "w_dot": tangent["w"], "b_dot": tangent.get("b"), "x_dot": tangent["x"]}
  if kind.residual:
    named.update(x=out["h"], x_dot=tangent["x"] + tangent["residual"])
  return [named[n] for n in kind.names("jvp")[0]]


def _stat_tangents(kind, primals, outs, operands, **params):
  """Tangents of the statistics.

  Second-order AD needs them: it differentiates the backward stage with respect
  to them.
  """
  arg = dict(zip(kind.names("jvp")[0], operands))
  rstd = arg["rstd"]
  xf, x_dot = arg["x"].astype(rstd.dtype), arg["x_dot"].astype(rstd.dtype)
  stat_tangents = []
  if kind.center:
    mean_dot = jnp.mean(x_dot, axis=-1)
    xf, x_dot = xf - arg["mean"][..., None], x_dot - mean_dot[..., None]
    stat_tangents.append(mean_dot)
  return stat_tangents + [-(rstd**3) * jnp.mean(xf * x_dot, axis=-1)]


def _define_op(name: str, kind: NormKind) -> ResidualOp:
  return define_residual_op(
    name,
    fwd=_stage(name, kind, "fwd"),
    tangent=_stage(name, kind, "jvp"),
    bwd=_stage(name, kind, "bwd"),
    linear=slice(len(kind.residuals()), None),
    tangent_operands=functools.partial(_tangent_operands, kind),
    residual_tangents=functools.partial(_stat_tangents, kind),
    fwd_only_params=("eps",),
  )


rms_norm_p = _define_op("rms_norm", kernels.RMS)
layer_norm_p = _define_op("layer_norm", kernels.LAYER)
fused_add_rms_norm_p = _define_op("fused_add_rms_norm", kernels.ADD_RMS)


# ----------------------------------------------------------------------------
# Public functions.


def _check_vector(op: str, name: str, v, hidden: int, x_shape) -> jax.Array:
  v = jnp.asarray(v)
  check_floating(op, name, v)
  if v.shape != (hidden,):
    raise ValueError(
      f"{op}: {name} must have shape (hidden,) = ({hidden},) for x of shape "
      f"{x_shape}; got {name} of shape {v.shape}"
    )
  return v


def _scale(op: str, x: jax.Array, weight, offset: float) -> tuple[jax.Array, float]:
  """The weight operand and offset; no weight == weight 0 with offset 1 (one kernel)."""
  if weight is None:
    if offset != 0.0:
      raise ValueError(f"{op}: offset={offset} needs a weight; got weight=None")
    return jnp.zeros(x.shape[-1:], x.dtype), 1.0
  return _check_vector(op, "weight", weight, x.shape[-1], x.shape), offset


def rms_norm(
  x: jax.Array,
  weight: Optional[jax.Array] = None,
  *,
  eps: float = 1e-6,
  offset: float = 0.0,
  config: Optional[NormConfig] = None,
) -> jax.Array:
  """Root-mean-square normalisation over the last axis.

  ``y = x / sqrt(mean(x**2, axis=-1) + eps) * (offset + weight)``, with the
  statistics in float32 (float64 for float64 inputs) and ``y.dtype == x.dtype``.

  Args:
    x: floating array ``(..., hidden)``, any number of leading dims.
    weight: optional ``(hidden,)`` scale; None means no scaling.
    eps: non-negative constant added to the mean square.
    offset: added to ``weight`` (``offset=1.0`` gives the Gemma-style
      ``1 + weight``); only meaningful with a weight.
    config: pin the kernels' ``NormConfig`` instead of letting the executor
      choose.

  Returns:
    The normalised array, same shape and dtype as ``x``.
  """
  x = check_array("rms_norm", "x", x)
  eps = check_static_float("rms_norm", "eps", eps, minimum=0.0)
  offset = check_static_float("rms_norm", "offset", offset)
  check_config("rms_norm", config, NormConfig)
  weight, offset = _scale("rms_norm", x, weight, offset)
  y, _ = bind(rms_norm_p.fwd, *match_manual_axes(x, weight), eps=eps, offset=offset, config=config)
  return y


def layer_norm(
  x: jax.Array,
  weight: Optional[jax.Array] = None,
  bias: Optional[jax.Array] = None,
  *,
  eps: float = 1e-5,
  config: Optional[NormConfig] = None,
) -> jax.Array:
  """Layer normalisation over the last axis.

  ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the mean and the
  (biased) variance over the last axis computed in float32 (float64 for
  float64 inputs); ``y.dtype == x.dtype``. The backward pass saves only the
  per-row mean and ``1 / sqrt(var + eps)``.

  Args:
    x: floating array ``(..., hidden)``, any number of leading dims.
    weight: optional ``(hidden,)`` scale (None: no scaling).
    bias: optional ``(hidden,)`` shift (None: no shift). With both given,
      they are promoted to a common dtype like jnp.
    eps: non-negative constant added to the variance.
    config: pin the kernels' ``NormConfig``.
  """
  op = "layer_norm"
  x = check_array(op, "x", x)
  eps = check_static_float(op, "eps", eps, minimum=0.0)
  check_config(op, config, NormConfig)
  weight, offset = _scale(op, x, weight, 0.0)
  if bias is None:
    bias = jnp.zeros_like(weight)
  else:
    bias = _check_vector(op, "bias", bias, x.shape[-1], x.shape)
  common = jnp.result_type(weight, bias)
  weight, bias = weight.astype(common), bias.astype(common)
  y, _, _ = bind(
    layer_norm_p.fwd, *match_manual_axes(x, weight, bias), eps=eps, offset=offset, config=config
  )
  return y


def fused_add_rms_norm(
  x: jax.Array,
  residual: jax.Array,
  weight: Optional[jax.Array] = None,
  *,
  eps: float = 1e-6,
  offset: float = 0.0,
  config: Optional[NormConfig] = None,
) -> tuple[jax.Array, jax.Array]:
  """``new_residual = x + residual`` and ``rms_norm(new_residual, weight)`` in one pass.

  The forward kernel reads ``x`` and ``residual`` once and writes both outputs;
  the backward kernel adds the ``new_residual`` cotangent to the norm's input
  gradient, so gradients flowing through both outputs cost one kernel too.

  Args:
    x: floating array ``(..., hidden)``.
    residual: floating array of ``x``'s shape; the dtypes of ``x`` and
      ``residual`` are promoted like ``x + residual``.
    weight: optional ``(hidden,)`` scale, as for ``rms_norm``.
    eps: as for ``rms_norm``.
    offset: as for ``rms_norm``.
    config: as for ``rms_norm``.

  Returns:
    ``(normed, new_residual)``, both of the promoted dtype.
  """
  op = "fused_add_rms_norm"
  x, residual = check_array(op, "x", x), jnp.asarray(residual)
  check_floating(op, "residual", residual)
  if residual.shape != x.shape:
    raise ValueError(
      f"{op}: residual must have the shape of x {x.shape}; got residual of shape {residual.shape}"
    )
  common = jnp.result_type(x, residual)
  x, residual = x.astype(common), residual.astype(common)
  eps = check_static_float(op, "eps", eps, minimum=0.0)
  offset = check_static_float(op, "offset", offset)
  check_config(op, config, NormConfig)
  weight, offset = _scale(op, x, weight, offset)
  y, h, _ = bind(
    fused_add_rms_norm_p.fwd,
    *match_manual_axes(x, residual, weight),
    eps=eps,
    offset=offset,
    config=config,
  )
  return y, h


# ----------------------------------------------------------------------------
# Plain-jnp formulations: the baselines of bench/ and python -m pallax, and
# (fed float64) the self-check's oracles.


def rms_norm_reference(
  x: jax.Array, weight: Optional[jax.Array] = None, *, eps: float = 1e-6, offset: float = 0.0
) -> jax.Array:
  """``rms_norm`` in plain jnp."""
  xf = x.astype(stat_dtype(x.dtype))
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * (offset + weight.astype(xf.dtype))
  return y.astype(x.dtype)


def layer_norm_reference(
  x: jax.Array,
  weight: Optional[jax.Array] = None,
  bias: Optional[jax.Array] = None,
  *,
  eps: float = 1e-5,
) -> jax.Array:
  """``layer_norm`` in plain jnp."""
  xf = x.astype(stat_dtype(x.dtype))
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * lax.rsqrt(var + eps)
  if weight is not None:
    y = y * weight.astype(xf.dtype)
  if bias is not None:
    y = y + bias.astype(xf.dtype)
  return y.astype(x.dtype)


def fused_add_rms_norm_reference(
  x: jax.Array, residual: jax.Array, *args, **kwargs
) -> tuple[jax.Array, jax.Array]:
  """``fused_add_rms_norm`` in plain jnp: the unfused ``x + residual`` then ``rms_norm``.

  ``args`` and ``kwargs`` (``weight``, ``eps``, ``offset``) are
  ``rms_norm_reference``'s.
  """
  h = x + residual
  return rms_norm_reference(h, *args, **kwargs), h
