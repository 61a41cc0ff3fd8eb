"""vmap rule for the cross-entropy primitives: every batched call stays one kernel.

Operands lead with ``(G, N)``: groups, then tokens (``x`` or the logits,
labels, statistics, their tangents and cotangents), except the weight-like
ones (``w``, ``b`` and their tangents), which lead with ``G`` only. Where
only token operands are mapped and every result is per token (the forward,
the tangent, the logits' backward), the vmapped axis becomes one more token
dim: a batch of sequences is one kernel over all their tokens. Otherwise (a mapped weight, or
the backward of ``linear_cross_entropy``, whose weight gradient must come
back per example) it folds into the groups, unmapped operands broadcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.kernels.cross_entropy.common import Problem, weight_like


def _example(a, d) -> jax.ShapeDtypeStruct:
  """The shape and dtype of one example of ``a``, vmapped at ``d``."""
  shape = a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :]
  return jax.ShapeDtypeStruct(shape, a.dtype)


def fold(stage: str, prim, args, bdims, **params):
  """The batching rule (register with ``PrimitiveSpec.batching`` as ``partial(fold, stage)``)."""
  size = axis_size(args, bdims)
  p = Problem.of([_example(a, d) for a, d in zip(args, bdims)], **params)
  weights = weight_like(stage, p)
  front = lambda i: batching.bdim_at_front(args[i], bdims[i], size)
  if not (stage == "bwd" and p.linear) and all(bdims[i] is NOT_MAPPED for i in weights):
    # One more token dim, after the groups.
    moved = [a if i in weights else jnp.moveaxis(front(i), 0, 1) for i, a in enumerate(args)]
    outs = prim.bind(*moved, **params)
    return outs, [1] * len(outs)
  fronts = [front(i) for i in range(len(args))]
  outs = prim.bind(*[m.reshape(size * m.shape[1], *m.shape[2:]) for m in fronts], **params)
  return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)
