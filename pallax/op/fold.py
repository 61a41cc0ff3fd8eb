"""The generic vmap rule: fold the vmapped axis into a batch-like dim, else a grid axis.

An op whose sharding dims are a ``DimsRule`` gets its batching rule from
them, one kernel call either way (design.md section 2, "vmap never loops"):

* fold: where every mapped operand and every result lead with a ``...`` of
  one length, the vmapped axis becomes one more leading dim of each ``...``;
  else it is merged into the first batch-like factor (in every result, not
  replicated, no program's) that every mapped operand has. Unmapped operands
  holding it are broadcast.
* grid: else the operands get a leading grid-batch axis and the primitive's
  ``batched`` param (``BATCHED``) says so: its kernels see it as a grid axis
  (``jax.vmap`` of a ``pallas_call``), its XLA program is vmapped over it,
  and its dims name it ``_batch``, a batch-like factor. A nested vmap merges
  into that axis.

Ops whose kernels take a leading batch axis always (``grid=True``) bind with
``batched`` set from the start, and vmap only grows that axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.op.dims_rule import DimsRule
from pallax.op.primitive import op_params
from pallax.op.sharding import Dims

# The primitive param that says the operands carry one leading grid-batch
# axis. Like the framework's params, it is not an op's own.
BATCHED = "batched"
# The grid-batch axis's factor name in a call's ``Dims``.
BATCH_FACTOR = "_batch"


def structs(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
  """``avals`` as ``ShapeDtypeStruct``s (no sharding or manual axes)."""
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def lead(avals: Sequence[Any], size: int) -> list[jax.ShapeDtypeStruct]:
  """``avals`` with a leading axis of ``size``."""
  return [jax.ShapeDtypeStruct((size, *a.shape), a.dtype) for a in avals]


def example_avals(avals: Sequence[Any], batched: bool) -> list[jax.ShapeDtypeStruct]:
  """The per-example avals of a call: without the grid-batch axis where it is ``batched``."""
  if not batched:
    return structs(avals)
  return [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in avals]


def split_params(params: dict) -> tuple[dict, bool]:
  """A primitive's params as the op's own params and whether the call is ``batched``."""
  own = op_params(params)
  return own, bool(own.pop(BATCHED, False))


def batched_dims(dims: Dims, batched: bool) -> Dims:
  """``dims`` with the grid-batch axis in front of every operand and result, where there is one."""
  if not batched:
    return dims
  front = lambda d: tuple((BATCH_FACTOR, *names) for names in d)
  return dataclasses.replace(dims, operands=front(dims.operands), results=front(dims.results))


def fold_rule(
  dims: DimsRule, out_structs: Callable[[Sequence[Any], dict], list], *, grid: bool = False
) -> Callable[..., tuple]:
  """The batching rule ``(prim, args, bdims, **params) -> (outs, out_dims)`` of an op.

  Args:
    dims: the op's dims.
    out_structs: ``(per-example operand avals, own params) -> per-example result structs``.
    grid: the kernels take a leading batch axis always: never fold.
  """

  def rule(prim, args, bdims, **params):
    size = axis_size(args, bdims)
    if not params[BATCHED] and not grid:
      folded = _fold(dims, out_structs, prim, args, bdims, size, params)
      if folded is not None:
        return folded
    return _grid(prim, args, bdims, size, params)

  return rule


def merge_into(a: jax.Array, bdim: Any, size: int, position: int) -> jax.Array:
  """``a`` with its vmapped axis ``bdim`` (of ``size``) merged into its dim ``position``.

  The vmapped axis goes in front of that dim and the two become one of
  ``size`` times its length, vmapped index major; an unmapped ``a``
  (``bdim`` None) is broadcast first.
  """
  if bdim is NOT_MAPPED:
    a = batching.broadcast(a, size, position, None)
  else:
    a = jnp.moveaxis(a, bdim, position)
  return a.reshape((*a.shape[:position], size * a.shape[position + 1], *a.shape[position + 2 :]))


def _grid(prim, args, bdims, size, params):
  """The vmapped axis as the leading grid-batch axis, merged with one already there."""
  args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, bdims)]
  if not params[BATCHED]:
    outs = prim.bind(*args, **{**params, BATCHED: True})
    return outs, [0] * len(outs)
  inner = args[0].shape[1]
  args = [a.reshape((size * inner, *a.shape[2:])) for a in args]
  outs = prim.bind(*args, **params)
  return [o.reshape((size, inner, *o.shape[1:])) for o in outs], [0] * len(outs)


def _fold(rule: DimsRule, out_structs, prim, args, bdims, size, params):
  """The vmapped axis folded into a ``...`` or a batch-like factor, if it can be; else None."""
  mapped = [d is not NOT_MAPPED for d in bdims]
  per = [
    jax.ShapeDtypeStruct(a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :], a.dtype)
    for a, d in zip(args, bdims)
  ]
  own = split_params(params)[0]
  outs = out_structs(per, own)
  if rule.parsed:
    lengths = {
      a.ndim - len(lab.names)
      for lab, a in list(zip(rule.operands, per)) + list(zip(rule.results, outs))
      if lab.ellipsis
    }
    if (
      all(r.ellipsis for r in rule.results)
      and all(lab.ellipsis for lab, m in zip(rule.operands, mapped) if m)
      and len(lengths) == 1
    ):
      new = [
        a
        if not lab.ellipsis
        else (
          jnp.moveaxis(a, d, 0) if d is not NOT_MAPPED else batching.broadcast(a, size, 0, None)
        )
        for a, d, lab in zip(args, bdims, rule.operands)
      ]
      out = prim.bind(*new, **params)
      return out, [0] * len(out)
  dims = rule(per, outs, own)
  refused = set(dims.replicated) | set(dims.refused) | dims.program_factors
  order = [f for names in dims.operands + dims.results for f in names]
  for f in dict.fromkeys(order):
    if f in refused or any(names.count(f) > 1 for names in dims.operands + dims.results):
      continue
    if all(f in names for names in dims.results) and all(
      f in names for names, m in zip(dims.operands, mapped) if m
    ):
      return _merge(prim, args, bdims, size, params, dims, f, outs)
  return None


def _merge(prim, args, bdims, size, params, dims: Dims, factor: str, outs):
  """The vmapped axis moved next to ``factor`` in every operand holding it, and merged into it."""
  new = [
    merge_into(a, d, size, names.index(factor)) if factor in names else a
    for a, d, names in zip(args, bdims, dims.operands)
  ]
  results = prim.bind(*new, **params)
  out_dims = [names.index(factor) for names in dims.results]
  split = [
    o.reshape((*o.shape[:q], size, per.shape[q], *o.shape[q + 1 :]))
    for o, q, per in zip(results, out_dims, outs)
  ]
  return split, out_dims
