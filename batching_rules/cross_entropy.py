"""vmap rule for the cross-entropy primitives: every batched call stays one kernel.

Operands lead with ``(G, N)``: groups, then tokens (``x`` or the logits,
labels, statistics, their tangents and cotangents), except the weight-like
ones (``w``, ``b`` and their tangents), which lead with ``G`` only
(``common.has_tokens``). Where only token operands are mapped and every
result is per token (the forward, the tangent, the logits' backward), the
vmapped axis becomes one more token dim: a batch of sequences is one kernel
over all their tokens. Otherwise (a mapped weight, or the backward of
``linear_cross_entropy``, whose weight gradient must come back per example)
it folds into the groups, unmapped operands broadcast.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.kernels.cross_entropy.common import SIGNATURE, has_tokens


def fold(stage: str, prim, args, bdims, **params):
  """The batching rule (register with ``PrimitiveSpec.batching`` as ``partial(fold, stage)``)."""
  size = axis_size(args, bdims)
  sig = SIGNATURE.stage(stage, params)
  tokens = [has_tokens(sig, n) for n in sig.operands]
  front = lambda a, d: batching.bdim_at_front(a, d, size)
  weights_mapped = any(d is not NOT_MAPPED for d, t in zip(bdims, tokens) if not t)
  if not (stage == "bwd" and params["linear"]) and not weights_mapped:
    # One more token dim, after the groups.
    moved = [jnp.moveaxis(front(a, d), 0, 1) if t else a for a, d, t in zip(args, bdims, tokens)]
    outs = prim.bind(*moved, **params)
    return outs, [1] * len(outs)
  fronts = [front(a, d) for a, d in zip(args, bdims)]
  outs = prim.bind(*[m.reshape(size * m.shape[1], *m.shape[2:]) for m in fronts], **params)
  return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0] * len(outs)
