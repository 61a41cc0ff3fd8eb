"""``define_residual_op``: an op's forward, tangent and backward primitives and their AD rules."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.interpreters import ad

from pallax.op.primitive import KernelPrimitive, PrimitiveSpec, define_primitive, op_params
from pallax.op.signature import ResidualSignature


@dataclasses.dataclass(frozen=True)
class ResidualOp:
  """The primitives of an op defined by ``define_residual_op``."""

  fwd: KernelPrimitive
  tangent: KernelPrimitive
  bwd: KernelPrimitive


def define_residual_op(
  name: str,
  *,
  fwd: PrimitiveSpec,
  tangent: PrimitiveSpec,
  bwd: PrimitiveSpec | None = None,
  signature: ResidualSignature | None = None,
  linear: slice | Callable[..., slice] | None = None,
  tangent_operands: Callable[..., Sequence[Any]] | None = None,
  residual_tangents: Callable[..., Sequence[Any]] | None = None,
  fwd_only_params: Sequence[str] = (),
) -> ResidualOp:
  """Defines an op's forward, tangent and backward primitives and their AD rules.

  The pattern of design.md section 2: the forward primitive returns the
  residuals its derivatives need; its JVP binds the tangent primitive, which is
  linear in a block of its operands; the transpose of the tangent primitive is
  the backward primitive. ``grad`` thus costs one forward and one backward
  kernel, ``jvp`` one forward and one tangent kernel. An input declared with a
  ``tangent_when`` param (``pallax.op.signature.Operand``) whose tangent is a
  symbolic zero is left out of both (its tangent and its gradient). Second-order AD
  (HVPs, ``jacfwd`` of ``grad``) differentiates the XLA programs of the tangent
  and backward primitives.

  The contract between the three primitives:

  * ``tangent``'s operands are residuals (primal operands or forward results)
    with one contiguous block, ``linear``, of tangents, in which it is linear;
    its results are the tangents of the forward's first results.
  * ``bwd`` takes ``tangent``'s operands with the ``linear`` block replaced by
    the cotangents of ``tangent``'s results, and returns one cotangent per
    operand of the ``linear`` block, in order.
  * Without ``bwd`` the tangent primitive is its own transpose (softmax).

  The primitives are named ``{name}_fwd``, ``{name}_jvp`` and ``{name}_bwd``
  (``{name}_fwd`` and ``{name}_bwd`` when the tangent is its own transpose).

  Args:
    name: the op's name, the prefix of its primitives' names.
    fwd: the forward primitive.
    tangent: the tangent primitive.
    bwd: the backward primitive; None when ``tangent`` is its own transpose.
    signature: the op's named operands (``pallax.op.signature``), from which
      ``linear`` and ``tangent_operands`` follow; give those two instead only
      where the tangent stage's operands are not the residuals and the
      inputs' tangents (a fused residual add whose tangent stage sees the sum).
    linear: the block of ``tangent``'s operands it is linear in, or a function
      of the primitives' params giving it.
    tangent_operands: ``(primals, outs, tangents, **params) -> operands`` of ``tangent``
      from the forward's operands, its results and its operands' tangents
      (symbolic zeros included: ``instantiate`` those used).
    residual_tangents: ``(primals, outs, operands, **params) -> tangents`` of the
      forward results after those ``tangent`` returns (statistics), from the
      tangent's ``operands``; needed where the forward has such results.
    fwd_only_params: the forward's params that the other two do not take.
  """
  tangent_params = lambda primals, tangents, params: {}
  if signature is not None:
    linear = lambda **params: signature.linear(params)
    tangent_operands = lambda primals, outs, tangents, **params: _named_tangent_operands(
      signature, primals, outs, tangents, params
    )
    tangent_params = functools.partial(_zero_tangent_params, signature)
  if linear is None or tangent_operands is None:
    raise TypeError(f"{name}: give a signature, or both linear and tangent_operands")
  fwd_p = define_primitive(f"{name}_fwd", fwd)
  tangent_p = define_primitive(f"{name}_{'bwd' if bwd is None else 'jvp'}", tangent)
  bwd_p = tangent_p if bwd is None else define_primitive(f"{name}_bwd", bwd)

  def fwd_jvp_rule(primals, tangents, **params):
    outs = fwd_p.bind(*primals, **params)
    params = {**params, **tangent_params(primals, tangents, params)}
    operands = list(tangent_operands(primals, outs, tangents, **params))
    shared = {k: v for k, v in params.items() if k not in fwd_only_params}
    out_tangents = list(tangent_p.bind(*operands, **shared))
    if residual_tangents is not None:
      out_tangents += residual_tangents(primals, outs, operands, **params)
    return outs, out_tangents

  def tangent_transpose_rule(cts, *args, **params):
    block = range(len(args))[linear(**params) if callable(linear) else linear]
    wanted = [i in block and ad.is_undefined_primal(a) for i, a in enumerate(args)]
    if any(ad.is_undefined_primal(a) for i, a in enumerate(args) if i not in block):
      raise NotImplementedError(
        f"{tangent_p.name} is linear in operands {block.start}:{block.stop} only"
      )
    if all(type(ct) is ad.Zero for ct in cts):
      return [ad.Zero(a.aval) if w else None for w, a in zip(wanted, args)]
    grads = bwd_p.bind(*args[: block.start], *instantiate(cts), *args[block.stop :], **params)
    return [grads[i - block.start] if w else None for i, w in enumerate(wanted)]

  ad.primitive_jvps[fwd_p] = fwd_jvp_rule
  ad.primitive_transposes[tangent_p] = tangent_transpose_rule
  for p in {tangent_p, bwd_p}:
    _register_jvp_by_xla(p)
  return ResidualOp(fwd_p, tangent_p, bwd_p)


def _named_tangent_operands(signature, primals, outs, tangents, params) -> list:
  """The tangent stage's operands of a ``signature``: residuals, then the inputs' tangents."""
  operands = signature.tangent_operands(primals, outs, tangents, params)
  block = signature.linear(params)
  return operands[: block.start] + instantiate(operands[block])


def _zero_tangent_params(signature, primals, tangents, params) -> dict:
  """The tangent and backward stages' params that drop inputs whose tangents are symbolic zeros."""
  named = signature.stage("fwd", params).unpack(tangents)
  zero = [name for name, t in named.items() if type(t) is ad.Zero]
  return signature.zero_tangent_params(zero, params)


def instantiate(tangents: Sequence[Any]) -> list:
  """Symbolic-zero tangents as arrays."""
  return [ad.instantiate_zeros(t) for t in tangents]


def _register_jvp_by_xla(prim: KernelPrimitive) -> None:
  """JVP of ``prim`` by differentiating its XLA program.

  Used for the secondary primitives (tangent and backward kernels), whose
  derivatives are only needed for second-order AD (Hessian-vector products,
  ``jacfwd`` of ``grad``).
  """
  ad.primitive_jvps[prim] = jvp_by_differentiating(prim.xla_impl, all_params=False)


def jvp_by_differentiating(fn: Callable, *, all_params: bool) -> Callable:
  """A JVP rule: ``jax.jvp`` of ``fn(*primals, **params)``.

  The framework's params are passed only with ``all_params``.
  """

  def jvp(primals, tangents, **params):
    outs, out_tangents = jax.jvp(
      functools.partial(fn, **(params if all_params else op_params(params))),
      tuple(primals),
      tuple(instantiate(tangents)),
    )
    return list(outs), list(out_tangents)

  return jvp
