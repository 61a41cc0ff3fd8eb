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

from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size


def rowwise(
  *, row_operands: Sequence[int], weight_operands: Sequence[int], weight_results: Sequence[int] = ()
) -> Callable:
  """The row-folding batching rule of a norm primitive with these operand roles."""

  def rule(prim, args, bdims, **params):
    size, args = axis_size(args, bdims), list(args)
    w0 = weight_operands[0]
    groups = args[w0].ndim - 1 - (bdims[w0] is not NOT_MAPPED)
    weight_mapped = any(bdims[i] is not NOT_MAPPED for i in weight_operands)
    if not weight_mapped and not weight_results:
      for i in row_operands:
        if bdims[i] is NOT_MAPPED:
          args[i] = batching.broadcast(args[i], size, groups, None)
        else:
          args[i] = jnp.moveaxis(args[i], bdims[i], groups)
      out_axis = groups
    else:
      args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, bdims)]
      out_axis = 0
    outs = prim.bind(*args, **params)
    return outs, [out_axis] * len(outs)

  return rule
