"""Matrix multiplication with a fused epilogue: ``pallax.matmul``.

One primitive, in the manner of ``lax.dot_general``:

* ``matmul_p (a, b[, bias]) -> (y[, z])``: ``y = act(op(a) @ op(b) + bias)``
  accumulated in float32, where ``op`` transposes an operand's last two dims
  when ``transpose_a`` / ``transpose_b`` say so and batch dims follow the masks
  described in kernels/matmul/layout.py. ``z``, the pre-activation, is a second
  result when ``save_preactivation`` (the JVP asks for it when there is an
  activation).

Autodiff follows from bilinearity. The JVP is
``y_dot = act'(z) * (a_dot @ b + a @ b_dot + bias_dot)``, each product a
``matmul_p`` without epilogue. Such a ``matmul_p`` is linear in either operand
and its transpose is again a ``matmul_p``: ``dA = dC @ B^T`` and
``dB = A^T @ dC``, the transposes being flags of the call, never copies.
``grad`` thus runs one forward kernel (which saves ``z``) and two backward
kernels; the activation's derivative is an elementwise XLA op on ``z``, applied
to the cotangent before the backward kernels. Higher-order AD differentiates
the same rules.

Sharding: batch dims and M shard freely, a sharded N shards the result, and a
sharded K runs a per-shard program (``pallax.op.collectives``): K is
contracted per device and the float32 partial products are summed across
devices (an all-reduce) before the epilogue.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from pallax.activations import activate, activation_derivative
from pallax.batching_rules import matmul as matmul_batching
from pallax.kernels import matmul as kernels
from pallax.kernels.matmul import ACTIVATIONS, MatmulConfig
from pallax.kernels.matmul.mosaic_gpu import MosaicGpuMatmulConfig
from pallax.op import (
  Dims,
  PrimitiveSpec,
  Program,
  bind,
  define_primitive,
  derived_aval,
  full_spec,
  match_manual_axes,
)
from pallax.validation import check_array, check_config, check_floating, check_precision

__all__ = ["matmul", "matmul_reference", "MatmulConfig", "MosaicGpuMatmulConfig", "ACTIVATIONS"]


# ----------------------------------------------------------------------------
# Shapes and shardings.


def _result_spec(a, b, *bias, **params) -> list:
  """The result's sharding: each batch dim's from the first operand that has it.

  M's comes from ``a``, N's from ``b``. A mesh axis already used by an earlier
  dim is dropped (a result dim cannot be sharded twice over one axis).
  """
  lead = -2 - params["contract_batch"]
  specs = [iter(full_spec(a)[:lead]), iter(full_spec(b)[:lead])]
  specs += [iter(full_spec(x)[:-1]) for x in bias]
  spec = []
  for has in zip(params["a_batch"], params["b_batch"], params["bias_batch"]):
    found = [next(it) for it, h in zip(specs, has) if h]
    spec.append(found[0])
  spec.append(full_spec(a)[-1 if params["transpose_a"] else -2])
  spec.append(full_spec(b)[-2 if params["transpose_b"] else -1])
  used: set = set()
  for i, axes in enumerate(spec):
    names = {axes} if isinstance(axes, str) else set(axes or ())
    if names & used:
      spec[i] = None
    used |= names
  return spec


def _matmul_abstract_eval(a, b, *bias, out_dtype, **params):
  if params["contract_batch"] and (not params["transpose_a"] or params["transpose_b"]):
    raise ValueError("matmul_p: contracted batch dims need transpose_a and not transpose_b")
  prob = kernels.Problem.of([x.shape for x in (a, b, *bias)], **params)
  spec = _result_spec(a, b, *bias, **params)
  result = derived_aval(a, prob.batch + (prob.rows, prob.n), out_dtype, spec)
  return [result] * (1 + params["save_preactivation"])


def _product(prim, a, b, *, a_batch, b_batch, **params) -> jax.Array:
  """``op(a) @ op(b)`` without epilogue.

  The batch dims only the bias has get size 1 (they broadcast against the bias).
  """
  kept = [i for i, has in enumerate(zip(a_batch, b_batch)) if any(has)]
  no_epilogue = dict(
    params, bias_batch=(False,) * len(kept), activation=None, save_preactivation=False
  )
  (out,) = prim.bind(
    a,
    b,
    a_batch=tuple(a_batch[i] for i in kept),
    b_batch=tuple(b_batch[i] for i in kept),
    **no_epilogue,
  )
  missing = tuple(i for i in range(len(a_batch)) if i not in kept)
  return jnp.expand_dims(out, missing) if missing else out


def _matmul_per_shard(shards, a, b, *bias, out_dtype, **params):
  """Sharded K: this device's partial product, summed across devices, then the epilogue.

  The sum is in float32: the bias and the activation must see the whole sum.
  """
  product, epilogue_params = kernels.split_params(params)
  acc = kernels.acc_dtype(a.dtype, b.dtype)
  partial = _product(matmul_p.kernel, a, b, out_dtype=acc, **product)
  return kernels.epilogue(shards.psum(partial, 0), *bias, out_dtype=out_dtype, **epilogue_params)


def _matmul_dims(a, b, *bias, **params) -> Dims:
  batch = tuple(f"b{i}" for i in range(len(params["a_batch"])))
  contracted = tuple(f"c{i}" for i in range(params["contract_batch"]))
  pick = lambda mask: tuple(f for f, has in zip(batch, params[mask]) if has)
  operands = (
    pick("a_batch") + contracted + (("k", "m") if params["transpose_a"] else ("m", "k")),
    pick("b_batch") + contracted + (("n", "k") if params["transpose_b"] else ("k", "n")),
  )
  if bias:
    operands += (pick("bias_batch") + ("n",),)
  results = (batch + ("m", "n"),) * (1 + params["save_preactivation"])
  sum_partials = Program(
    "psum_partials", ("k",) + contracted, functools.partial(_matmul_per_shard, **params)
  )
  return Dims(operands, results, programs=(sum_partials,))


matmul_p = define_primitive(
  "matmul",
  PrimitiveSpec(
    abstract_eval=_matmul_abstract_eval,
    xla=kernels.matmul_xla,
    kernel=kernels.KERNEL,
    dims=_matmul_dims,
    batching=matmul_batching.matmul_rule,
  ),
)


# ----------------------------------------------------------------------------
# Autodiff.


def _activation_derivative(activation: str, z: jax.Array) -> jax.Array:
  """``act'(z)`` elementwise, in the accumulation dtype."""
  return activation_derivative(activation, z.astype(kernels.acc_dtype(z.dtype)))


def _matmul_jvp_rule(primals, tangents, *, activation, save_preactivation, **params):
  a, b, *bias = primals
  a_dot, b_dot, *bias_dot = tangents
  outs = matmul_p.bind(
    a, b, *bias, activation=activation, save_preactivation=activation is not None, **params
  )
  y, z = outs[0], outs[-1]  # z is y itself without an activation
  product = {k: v for k, v in params.items() if k != "bias_batch"}
  terms = []
  if type(a_dot) is not ad.Zero:
    terms.append(_product(matmul_p, a_dot, b, **product))
  if type(b_dot) is not ad.Zero:
    terms.append(_product(matmul_p, a, b_dot, **product))
  if bias_dot and type(bias_dot[0]) is not ad.Zero:
    # Broadcast in the accumulation dtype: its transpose, the bias gradient,
    # then sums in float32 too.
    wide = bias_dot[0].astype(kernels.acc_dtype(bias_dot[0].dtype))
    terms.append(
      jnp.broadcast_to(kernels.bias_like(wide, params["bias_batch"], y.ndim), y.shape).astype(
        y.dtype
      )
    )
  primals_out = [y, z] if save_preactivation else [y]
  if not terms:
    return primals_out, [ad.Zero.from_primal_value(x) for x in primals_out]
  z_dot = jnp.broadcast_to(functools.reduce(jnp.add, terms), y.shape)
  y_dot = z_dot
  if activation is not None:
    d = _activation_derivative(activation, z)
    y_dot = (d * z_dot.astype(d.dtype)).astype(y.dtype)
  return primals_out, [y_dot, z_dot] if save_preactivation else [y_dot]


def _sum_batch_dims(x: jax.Array, keep, dtype) -> jax.Array:
  """``x`` summed over the batch dims ``keep`` marks False, cast to ``dtype``."""
  axes = tuple(i for i, k in enumerate(keep) if not k)
  return (jnp.sum(x, axis=axes) if axes else x).astype(dtype)


# The transposes see the call's batch dims extended by its contracted ones:
# ``a_batch``, ``b_batch`` and ``ct_batch`` say which dims ``a``, ``b`` and the
# cotangent have (the cotangent lacks exactly the contracted ones).


def _plain_product(lhs, rhs, batches, transposes, **params) -> jax.Array:
  """``matmul_p`` of ``lhs`` and ``rhs`` with these batch masks and transpose flags."""
  (out,) = matmul_p.bind(
    lhs,
    rhs,
    a_batch=batches[0],
    b_batch=batches[1],
    transpose_a=transposes[0],
    transpose_b=transposes[1],
    **params,
  )
  return out


def _transpose_lhs(
  ct, b, a_aval, *, a_batch, b_batch, ct_batch, transpose_a, transpose_b, **params
):
  """``dA = dC @ op(b)^T`` (``op(b) @ dC^T`` for a transposed ``a``).

  Summed over the batch dims ``a`` lacks.
  """
  dtype = a_aval.dtype if all(a_batch) else kernels.acc_dtype(a_aval.dtype)
  params.update(bias_batch=(False,) * len(a_batch), contract_batch=0, out_dtype=dtype)
  if transpose_a:
    da = _plain_product(b, ct, (b_batch, ct_batch), (transpose_b, True), **params)
  else:
    da = _plain_product(ct, b, (ct_batch, b_batch), (False, not transpose_b), **params)
  return _sum_batch_dims(da, a_batch, a_aval.dtype)


def _transpose_rhs(
  ct, a, b_aval, *, a_batch, b_batch, ct_batch, transpose_a, transpose_b, **params
):
  """``dB = op(a)^T @ dC`` (``dC^T @ op(a)`` for a transposed ``b``).

  Summed over the batch dims ``b`` lacks. The trailing batch dims ``b`` lacks
  are contiguous with M in ``a`` and ``dC``, so the product contracts them
  with M: a weight shared by a batch gets its gradient from one GEMM, per
  device, never a reshape of sharded dims.
  """
  contract = 0
  if not transpose_a:
    while (
      contract < len(b_batch)
      and not b_batch[-1 - contract]
      and ct_batch[-1 - contract]
      and a_batch[-1 - contract]
    ):
      contract += 1
  kept = len(b_batch) - contract
  a_batch, b_batch, ct_batch = a_batch[:kept], b_batch[:kept], ct_batch[:kept]
  dtype = b_aval.dtype if all(b_batch) else kernels.acc_dtype(b_aval.dtype)
  params.update(bias_batch=(False,) * kept, contract_batch=contract, out_dtype=dtype)
  if transpose_b:
    db = _plain_product(ct, a, (ct_batch, a_batch), (True, transpose_a), **params)
  else:
    db = _plain_product(a, ct, (a_batch, ct_batch), (not transpose_a, False), **params)
  return _sum_batch_dims(db, b_batch, b_aval.dtype)


def _matmul_transpose_rule(
  cts, a, b, *bias, a_batch, b_batch, contract_batch, activation, save_preactivation, **params
):
  if bias or activation is not None or save_preactivation:
    raise NotImplementedError(
      "matmul with a bias or an activation is not linear in a or b; "
      "only the plain products of its JVP are transposed"
    )
  (ct,) = cts
  undefined = [ad.is_undefined_primal(x) for x in (a, b)]
  if type(ct) is ad.Zero:
    return [ad.Zero(x.aval) if u else None for x, u in zip((a, b), undefined)]
  contracted = (True,) * contract_batch
  params = dict(
    params,
    a_batch=a_batch + contracted,
    b_batch=b_batch + contracted,
    ct_batch=(True,) * len(a_batch) + (False,) * contract_batch,
    activation=None,
    save_preactivation=False,
  )
  params.pop("bias_batch")
  if undefined[0]:
    return [_transpose_lhs(ct, b, a.aval, **params), None]
  return [None, _transpose_rhs(ct, a, b.aval, **params)]


ad.primitive_jvps[matmul_p] = _matmul_jvp_rule
ad.primitive_transposes[matmul_p] = _matmul_transpose_rule


# ----------------------------------------------------------------------------
# Public function.


def _batch_masks(a_dims, b_dims, a_shape, b_shape):
  """Broadcast batch shape and which of its dims ``a`` and ``b`` have (jnp.matmul rules)."""
  try:
    batch = np.broadcast_shapes(a_dims, b_dims)
  except ValueError:
    raise ValueError(
      f"matmul: the batch dims of a {a_dims} and b {b_dims} do not broadcast "
      f"(a of shape {a_shape}, b of shape {b_shape})"
    ) from None

  def has(dims):
    pad = len(batch) - len(dims)
    return tuple(i >= pad and dims[i - pad] == batch[i] for i in range(len(batch)))

  return batch, has(a_dims), has(b_dims)


def matmul(
  a: jax.Array,
  b: jax.Array,
  *,
  bias: Optional[jax.Array] = None,
  activation: Optional[str] = None,
  preferred_element_type=None,
  precision=None,
  config: Optional[Union[MatmulConfig, MosaicGpuMatmulConfig]] = None,
) -> jax.Array:
  """``activation(a @ b + bias)`` as one kernel, like ``jnp.matmul`` plus an epilogue.

  Products accumulate in float32 (float64 for float64 inputs); the bias and the
  activation are applied to the accumulator, then the result is cast.

  Args:
    a: floating array ``(..., M, K)``, or a vector ``(K,)``.
    b: floating array ``(K, N)`` or ``(..., K, N)``, or a vector ``(K,)``.
      Leading dims broadcast as in ``jnp.matmul``; a broadcast operand is
      never copied (256 vectors times a shared weight are one GEMM).
    bias: optional ``(N,)`` added to every row.
    activation: None, ``"relu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` or
      ``"silu"``.
    preferred_element_type: result dtype; default ``jnp.matmul``'s (the
      promoted input dtype).
    precision: as in ``jnp.matmul``: None (the backend's default; TF32 for
      float32 on GPU), a ``lax.Precision`` or its name, or a pair of them.
    config: pin the kernel's ``MatmulConfig`` (or, on Hopper, a
      ``MosaicGpuMatmulConfig``) instead of letting the executor choose.

  Returns:
    ``(*batch, M, N)`` (the M or N dim dropped for a vector ``a`` or ``b``).
  """
  a, b = check_array("matmul", "a", a), check_array("matmul", "b", b)
  dtype = jnp.result_type(a, b)
  out_dtype = dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(f"matmul: preferred_element_type must be a floating dtype, got {out_dtype}")
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(
      f"matmul: activation must be one of {(None,) + ACTIVATIONS}, got {activation!r}"
    )
  precision = check_precision("matmul", precision)
  check_config("matmul", config, (MatmulConfig, MosaicGpuMatmulConfig))
  a2 = a[None] if a.ndim == 1 else a
  b2 = b[:, None] if b.ndim == 1 else b
  if a2.shape[-1] != b2.shape[-2]:
    where = "length" if b.ndim == 1 else "second-to-last dim"
    raise ValueError(
      f"matmul: a's last dim ({a.shape[-1]}) must equal b's {where} "
      f"({b2.shape[-2]}); got a of shape {a.shape} and b of shape {b.shape}"
    )
  batch, a_batch, b_batch = _batch_masks(a2.shape[:-2], b2.shape[:-2], a.shape, b.shape)
  args = [a2, b2]
  if bias is not None:
    bias = jnp.asarray(bias)
    check_floating("matmul", "bias", bias)
    if b.ndim == 1:
      raise ValueError(f"matmul: bias needs a matrix b with an N dim; got b of shape {b.shape}")
    if bias.shape != (b.shape[-1],):
      raise ValueError(
        f"matmul: bias must have shape (N,) = ({b.shape[-1]},) for b of shape "
        f"{b.shape}; got bias of shape {bias.shape}"
      )
    args.append(bias)
  # Drop the broadcast dims: an operand lacking a batch dim is shared along it.
  for i, mask in enumerate((a_batch, b_batch)):
    kept = tuple(size for size, has in zip(batch, mask) if has)
    args[i] = args[i].astype(dtype).reshape(kept + args[i].shape[-2:])
  args = match_manual_axes(*args)
  (y,) = bind(
    matmul_p,
    *args,
    a_batch=a_batch,
    b_batch=b_batch,
    bias_batch=(False,) * len(batch),
    contract_batch=0,
    transpose_a=False,
    transpose_b=False,
    activation=activation,
    out_dtype=out_dtype,
    precision=precision,
    save_preactivation=False,
    config=config,
  )
  if a.ndim == 1:
    y = y[..., 0, :]
  if b.ndim == 1:
    y = y[..., 0]
  return y


def matmul_reference(
  a: jax.Array,
  b: jax.Array,
  bias: Optional[jax.Array] = None,
  activation: Optional[str] = None,
  **matmul_kwargs,
) -> jax.Array:
  """The plain-jnp formulation of ``matmul``: ``jnp.matmul``, then the unfused epilogue.

  The baseline ``bench/`` and ``python -m pallax`` time against, and, fed
  float64 inputs, the self-check's oracle. ``matmul_kwargs``
  (``preferred_element_type``, ``precision``) go to ``jnp.matmul``.
  """
  y = jnp.matmul(a, b, **matmul_kwargs)
  if bias is not None:
    y = y + bias.astype(y.dtype)
  return activate(activation, y)
