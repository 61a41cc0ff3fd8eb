"""vmap rule for attention: the vmapped axis folds into the batch dim, one kernel.

Every operand of the attention primitives leads with the batch dim ``B``
(``q``, ``k``, ``v``, lengths, segment ids, ``out``, ``lse``, tangents),
except the bias, mask, sinks and their tangents, which lead with 1 or ``B``
(broadcast over the batch). The vmapped axis of size ``V`` goes in front and
merges with ``B``: ``V * B`` examples. Unmapped batch operands are broadcast;
an unmapped bias that broadcasts over the batch stays as it is, except where
the primitive returns its gradient, which must then be per example: it is
computed per ``(v, b)`` and summed over ``b``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.kernels.attention.common import Problem


def _broadcast_operands(prim, p: Problem, n_operands: int) -> dict[int, Optional[int]]:
  """Operands leading with 1 or ``B`` -> the index of the backward's result that is their gradient.

  The bias, mask and sinks, and the tangent's dbias and dsinks (its last operands).
  """
  first_sink = 5 + p.has_bias + p.has_mask + 2 * p.has_segments
  out = {}
  if p.has_bias:
    out[5] = 3
  if p.has_mask:
    out[5 + p.has_bias] = None
  if p.has_sinks:
    out[first_sink] = -1
  if prim.name.endswith("_jvp"):
    tangents = [None] * p.has_bias + [None] * p.has_sinks
    out.update({n_operands - len(tangents) + i: g for i, g in enumerate(tangents)})
  return out


def _example(a, d) -> jax.ShapeDtypeStruct:
  """The shape and dtype of one example of ``a``, vmapped at ``d``."""
  shape = a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :]
  return jax.ShapeDtypeStruct(shape, a.dtype)


def fold_into_batch(prim, args, bdims, **params):
  """The batch-folding rule (register with ``PrimitiveSpec.batching``)."""
  size = axis_size(args, bdims)
  examples = [_example(a, d) for a, d in zip(args, bdims)]
  p = Problem.of(examples, **params)
  b = p.batch
  returns_grads = prim.name.endswith("_bwd")
  broadcast = _broadcast_operands(prim, p, len(args))
  folded, summed = [], []
  for i, (a, d) in enumerate(zip(args, bdims)):
    shared = i in broadcast and examples[i].shape[0] == 1
    grad = broadcast.get(i) if returns_grads else None
    if d is NOT_MAPPED and shared and grad is None:
      folded.append(a)  # broadcasts over every example
      continue
    if shared and grad is not None:
      summed.append(grad)  # its gradient comes back per (v, b): summed over b
    a = batching.bdim_at_front(a, d, size)
    if a.shape[1] != b:
      a = jnp.broadcast_to(a, (size, b, *a.shape[2:]))
    folded.append(a.reshape(size * b, *a.shape[2:]))
  outs = prim.bind(*folded, **params)
  outs = [o.reshape(size, b, *o.shape[1:]) for o in outs]
  for g in summed:
    outs[g] = jnp.sum(outs[g], axis=1, keepdims=True)
  return outs, [0] * len(outs)
