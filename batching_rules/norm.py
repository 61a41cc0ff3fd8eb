"""vmap rules for the norm family: every batched call stays one kernel.

Operands are row-like (``x``, ``rstd``, ``dy``, tangents of ``x``; the leading
dims are rows) or weight-like (``w (*groups, H)``, whose group dims prefix the
rows' leading dims). The vmapped axis is folded in one of two ways:

* only row-like operands mapped, no weight-like result: the axis becomes one
  more row dim, placed after the weight's group dims; the weight stays shared.
* otherwise (a mapped weight, or a weight gradient that must be per example):
  the axis becomes a new leading group dim of every operand, unmapped operands
  broadcast along it.
"""
from __future__ import annotations

import functools
from typing import Sequence

from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, at_axis, axis_size, batch_first


def _rowwise_batching_rule(prim, row_operands: Sequence[int], weight_operands: Sequence[int],
                           weight_results: Sequence[int], args, bdims, **params):
  w0 = weight_operands[0]
  groups = args[w0].ndim - 1 - (bdims[w0] is not NOT_MAPPED)
  weight_mapped = any(bdims[i] is not NOT_MAPPED for i in weight_operands)
  if not weight_mapped and not weight_results:
    size, args = axis_size(args, bdims), list(args)
    for i in row_operands:
      args[i] = at_axis(args[i], bdims[i], size, groups)
    out_axis = groups
  else:
    args, out_axis = batch_first(args, bdims), 0
  outs = prim.bind(*args, **params)
  return outs, [out_axis] * len(outs)


def register_rowwise(prim, *, row_operands: Sequence[int], weight_operands: Sequence[int],
                     weight_results: Sequence[int] = ()) -> None:
  """Registers the row-folding batching rule for ``prim``."""
  batching.primitive_batchers[prim] = functools.partial(
      _rowwise_batching_rule, prim, tuple(row_operands), tuple(weight_operands),
      tuple(weight_results))
