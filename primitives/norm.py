"""Normalisation ops: ``rms_norm``, ``layer_norm``, ``fused_add_rms_norm``.

Each op has three primitives, following design.md section 2 (names for
rms_norm; the others alike):

* ``rms_norm_fwd`` -> outputs plus the statistics the backward needs
  (``rstd``; ``mean`` too for layer_norm): the forward kernel;
* ``rms_norm_jvp`` -> the tangent, linear in the tangent operands; its
  transpose is the backward kernel;
* ``rms_norm_bwd`` -> ``dx`` and the weight (and bias) gradients: the
  backward kernel.

``grad`` thus costs one forward and one backward kernel. Second-order AD
differentiates the XLA programs of the tangent and backward primitives.
Operands and results are named (``kernels.norm.NormKind.names``), and every
rule here is written once over those names. Weight-like operands may carry
leading group dims that prefix ``x``'s leading dims: that is how vmapping over
the weight stays one kernel (see batching_rules/norm.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from pallax.batching_rules import norm as norm_batching
from pallax.kernels import norm as kernels
from pallax.kernels.norm import CATEGORY, ROW, STAT, WEIGHT, NormConfig, NormKind
from pallax.op import (Dims, bind, define_primitive, derived_aval, full_spec, instantiate,
                       match_manual_axes, register_jvp_by_xla)
from pallax.pallas_utils import stat_dtype
from pallax.selfcheck import SelfCheck, register
from pallax.validation import check_array, check_config, check_floating, check_static_float

__all__ = ["rms_norm", "layer_norm", "fused_add_rms_norm", "NormConfig", "rms_norm_reference",
           "layer_norm_reference", "fused_add_rms_norm_reference"]


# ----------------------------------------------------------------------------
# Shapes and shardings, from the operand and result names.


def _norm_abstract_eval(operands, results, *avals, **params):
  a = dict(zip(operands, avals))
  x, w = a["x"], a["w"]
  stat = derived_aval(x, x.shape[:-1], stat_dtype(x.dtype), full_spec(x)[:-1])
  by_category = {ROW: x.update(weak_type=False), STAT: stat, WEIGHT: w.update(weak_type=False)}
  return [by_category[CATEGORY[n]] for n in results]


def _norm_dims(operands, results, *avals, **params) -> Dims:
  """Rows (x's leading dims) shard freely; the hidden dim ``h`` is replicated."""
  a = dict(zip(operands, avals))
  rows = tuple(f"r{i}" for i in range(a["x"].ndim - 1))
  factors = {ROW: rows + ("h",), STAT: rows, WEIGHT: rows[:a["w"].ndim - 1] + ("h",)}
  return Dims(operands=tuple(factors[CATEGORY[n]] for n in operands),
              results=tuple(factors[CATEGORY[n]] for n in results), replicated=("h",))


_IMPLEMENTATIONS = {
    "fwd": (kernels.norm_fwd_xla, kernels.norm_fwd_pallas),
    # The tangent runs as its XLA program on every platform (forward-mode AD
    # only; under grad it is transposed into the backward kernel, never run).
    "jvp": (kernels.norm_jvp_xla, None),
    "bwd": (kernels.norm_bwd_xla, kernels.norm_bwd_pallas),
}


def _define(op: str, kind: NormKind, stage: str):
  operands, results = kind.names(stage)
  xla_impl, kernel_impl = _IMPLEMENTATIONS[stage]
  prim = define_primitive(
      f"{op}_{stage}",
      abstract_eval=functools.partial(_norm_abstract_eval, operands, results),
      xla_impl=functools.partial(xla_impl, kind=kind),
      kernel_impl=kernel_impl and functools.partial(kernel_impl, kind=kind),
      dims=functools.partial(_norm_dims, operands, results))
  index = lambda names, category: tuple(i for i, n in enumerate(names) if CATEGORY[n] == category)
  norm_batching.register_rowwise(
      prim, row_operands=index(operands, ROW) + index(operands, STAT),
      weight_operands=index(operands, WEIGHT), weight_results=index(results, WEIGHT))
  return prim


# ----------------------------------------------------------------------------
# Autodiff, written once over the names.


def _norm_fwd_jvp_rule(kind, fwd_p, jvp_p, primals, tangents, *, eps, offset, **fw):
  operands, results = kind.names("fwd")
  a, t = dict(zip(operands, primals)), dict(zip(operands, instantiate(tangents)))
  outs = fwd_p.bind(*primals, eps=eps, offset=offset, **fw)
  o = dict(zip(results, outs))
  x, x_dot = (o["h"], t["x"] + t["r"]) if kind.residual else (a["x"], t["x"])
  args = {"x": x, "w": a["w"], "mean": o.get("mean"), "rstd": o["rstd"], "x_dot": x_dot,
          "w_dot": t["w"], "b_dot": t.get("b")}
  jvp_operands, jvp_results = kind.names("jvp")
  tangent = dict(zip(jvp_results, jvp_p.bind(*[args[n] for n in jvp_operands],
                                             offset=offset, **fw)))
  # Tangents of the statistics: needed by second-order AD, which differentiates
  # the backward primitive with respect to them.
  rstd = o["rstd"]
  xf, xdf = x.astype(rstd.dtype), x_dot.astype(rstd.dtype)
  out_tangents = {"y": tangent["y_dot"], "h": tangent.get("h_dot")}
  if kind.center:
    out_tangents["mean"] = jnp.mean(xdf, axis=-1)
    xf, xdf = xf - o["mean"][..., None], xdf - out_tangents["mean"][..., None]
  out_tangents["rstd"] = -rstd ** 3 * jnp.mean(xf * xdf, axis=-1)
  return outs, [out_tangents[n] for n in results]


_LINEAR = {"x_dot": "dx", "w_dot": "dw", "b_dot": "db"}


def _norm_jvp_transpose_rule(kind, bwd_p, cts, *args, offset, **fw):
  operands, results = kind.names("jvp")
  a, c = dict(zip(operands, args)), dict(zip(results, cts))
  wanted = [n in _LINEAR and ad.is_undefined_primal(arg) for n, arg in zip(operands, args)]
  if all(type(ct) is ad.Zero for ct in cts):
    return [ad.Zero(arg.aval) if w else None for w, arg in zip(wanted, args)]
  c = dict(zip(results, instantiate(cts)))
  bwd_args = {**a, "dy": c["y_dot"], "dh": c.get("h_dot")}
  bwd_operands, bwd_results = kind.names("bwd")
  grads = dict(zip(bwd_results, bwd_p.bind(*[bwd_args[n] for n in bwd_operands],
                                           offset=offset, **fw)))
  return [grads[_LINEAR[n]] if w else None for n, w in zip(operands, wanted)]


def _define_op(op: str, kind: NormKind):
  fwd_p, jvp_p, bwd_p = (_define(op, kind, stage) for stage in ("fwd", "jvp", "bwd"))
  ad.primitive_jvps[fwd_p] = functools.partial(_norm_fwd_jvp_rule, kind, fwd_p, jvp_p)
  ad.primitive_transposes[jvp_p] = functools.partial(_norm_jvp_transpose_rule, kind, bwd_p)
  register_jvp_by_xla(jvp_p)
  register_jvp_by_xla(bwd_p)
  return fwd_p, jvp_p, bwd_p


rms_norm_fwd_p, rms_norm_jvp_p, rms_norm_bwd_p = _define_op("rms_norm", kernels.RMS)
layer_norm_fwd_p, layer_norm_jvp_p, layer_norm_bwd_p = _define_op("layer_norm", kernels.LAYER)
fused_add_rms_norm_fwd_p, fused_add_rms_norm_jvp_p, fused_add_rms_norm_bwd_p = _define_op(
    "fused_add_rms_norm", kernels.ADD_RMS)


# ----------------------------------------------------------------------------
# Public functions.


def _check_vector(op: str, name: str, v, hidden: int, x_shape) -> jax.Array:
  v = jnp.asarray(v)
  check_floating(op, name, v)
  if v.shape != (hidden,):
    raise ValueError(f"{op}: {name} must have shape (hidden,) = ({hidden},) for x of shape "
                     f"{x_shape}; got {name} of shape {v.shape}")
  return v


def _scale(op: str, x: jax.Array, weight, offset: float) -> tuple[jax.Array, float]:
  """The weight operand and offset; no weight == weight 0 with offset 1 (one kernel)."""
  if weight is None:
    if offset != 0.0:
      raise ValueError(f"{op}: offset={offset} needs a weight; got weight=None")
    return jnp.zeros(x.shape[-1:], x.dtype), 1.0
  return _check_vector(op, "weight", weight, x.shape[-1], x.shape), offset


def rms_norm(x: jax.Array, weight: Optional[jax.Array] = None, *, eps: float = 1e-6,
             offset: float = 0.0, config: Optional[NormConfig] = None) -> jax.Array:
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
  y, _ = bind(rms_norm_fwd_p, *match_manual_axes(x, weight), eps=eps, offset=offset,
              config=config)
  return y


def layer_norm(x: jax.Array, weight: Optional[jax.Array] = None,
               bias: Optional[jax.Array] = None, *, eps: float = 1e-5,
               config: Optional[NormConfig] = None) -> jax.Array:
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
  y, _, _ = bind(layer_norm_fwd_p, *match_manual_axes(x, weight, bias), eps=eps,
                 offset=offset, config=config)
  return y


def fused_add_rms_norm(x: jax.Array, residual: jax.Array, weight: Optional[jax.Array] = None,
                       *, eps: float = 1e-6, offset: float = 0.0,
                       config: Optional[NormConfig] = None) -> tuple[jax.Array, jax.Array]:
  """``new_residual = x + residual`` and ``rms_norm(new_residual, weight)`` in one pass.

  The forward kernel reads ``x`` and ``residual`` once and writes both outputs;
  the backward kernel adds the ``new_residual`` cotangent to the norm's input
  gradient, so gradients flowing through both outputs cost one kernel too.

  Args:
    x, residual: floating arrays of the same shape ``(..., hidden)``; their
      dtypes are promoted like ``x + residual``.
    weight, eps, offset, config: as for ``rms_norm``.

  Returns:
    ``(normed, new_residual)``, both of the promoted dtype.
  """
  op = "fused_add_rms_norm"
  x, residual = check_array(op, "x", x), jnp.asarray(residual)
  check_floating(op, "residual", residual)
  if residual.shape != x.shape:
    raise ValueError(f"{op}: residual must have the shape of x {x.shape}; "
                     f"got residual of shape {residual.shape}")
  common = jnp.result_type(x, residual)
  x, residual = x.astype(common), residual.astype(common)
  eps = check_static_float(op, "eps", eps, minimum=0.0)
  offset = check_static_float(op, "offset", offset)
  check_config(op, config, NormConfig)
  weight, offset = _scale(op, x, weight, offset)
  y, h, _ = bind(fused_add_rms_norm_fwd_p, *match_manual_axes(x, residual, weight), eps=eps,
                 offset=offset, config=config)
  return y, h


# ----------------------------------------------------------------------------
# Plain-jnp formulations: the baselines of bench/ and python -m pallax, and
# (fed float64) the self-check's oracles.


def rms_norm_reference(x: jax.Array, weight: Optional[jax.Array] = None, *,
                       eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
  """``rms_norm`` in plain jnp."""
  xf = x.astype(stat_dtype(x.dtype))
  y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * (offset + weight.astype(xf.dtype))
  return y.astype(x.dtype)


def layer_norm_reference(x: jax.Array, weight: Optional[jax.Array] = None,
                         bias: Optional[jax.Array] = None, *, eps: float = 1e-5) -> jax.Array:
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


def fused_add_rms_norm_reference(x: jax.Array, residual: jax.Array,
                                 weight: Optional[jax.Array] = None, *, eps: float = 1e-6,
                                 offset: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """``fused_add_rms_norm`` in plain jnp: the unfused ``x + r`` then ``rms_norm``."""
  h = x + residual
  return rms_norm_reference(h, weight, eps=eps, offset=offset), h


def _selfcheck_args(*vectors: str):
  def make(rng: np.random.Generator, dtype, small: bool):
    rows, hidden = (37, 200) if small else (4096, 1024)
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    rest = {"x": x, "residual": jnp.asarray(rng.standard_normal((rows, hidden)), dtype),
            "weight": jnp.asarray(1.0 + 0.5 * rng.standard_normal(hidden), dtype),
            "bias": jnp.asarray(0.5 * rng.standard_normal(hidden), dtype)}
    return tuple(rest[n] for n in vectors)
  return make


register(SelfCheck("rms_norm", _selfcheck_args("x", "weight"), rms_norm, rms_norm_reference))
register(SelfCheck("layer_norm", _selfcheck_args("x", "weight", "bias"), layer_norm,
                   layer_norm_reference))
register(SelfCheck("fused_add_rms_norm", _selfcheck_args("x", "residual", "weight"),
                   fused_add_rms_norm, fused_add_rms_norm_reference))
