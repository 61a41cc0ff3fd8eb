"""vmap rules for the softmax family: every batched call stays one kernel.

Every operand of a softmax primitive has the same shape ``(*rows, cols)`` and
the primitive reduces over the last axis only, so the vmapped axis becomes one
more leading row dim of every operand: unmapped operands (a shared ``where=``
mask, the primal of a vmapped tangent) are broadcast along it. (The norm
family's rule needs a weight operand to place the axis against.)
"""
from __future__ import annotations

import functools

from jax.interpreters import batching

from pallax.batching_utils import batch_first


def _rows_batching_rule(prim, args, bdims, **params):
  outs = prim.bind(*batch_first(args, bdims), **params)
  return outs, [0] * len(outs)


def register_rows(prim) -> None:
  """Registers the row-folding batching rule for ``prim``."""
  batching.primitive_batchers[prim] = functools.partial(_rows_batching_rule, prim)
