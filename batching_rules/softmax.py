"""vmap rule for the softmax family: every batched call stays one kernel.

Every operand of a softmax primitive has the same shape ``(*rows, cols)`` and
the primitive reduces over the last axis only, so the vmapped axis is one more
row dim. Like the batchers of JAX's elementwise ops: operands all mapped at
the same row axis are bound as they are (no copy); otherwise the axis goes in
front of every operand (``bdim_at_front``), unmapped ones (a shared
``where=`` mask, the primal of a vmapped tangent) broadcast along it.
"""

from __future__ import annotations

from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size


def rows(prim, args, bdims, **params):
  """The row-folding batching rule (register with ``PrimitiveSpec.batching``)."""
  axis = bdims[0]
  if axis is not NOT_MAPPED and axis < args[0].ndim - 1 and all(d == axis for d in bdims):
    outs = prim.bind(*args, **params)
    return outs, [axis] * len(outs)
  size = axis_size(args, bdims)
  outs = prim.bind(*[batching.bdim_at_front(a, d, size) for a, d in zip(args, bdims)], **params)
  return outs, [0] * len(outs)
