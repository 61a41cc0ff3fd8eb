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

import jax
import jax.numpy as jnp
from jax.interpreters import batching

from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.kernels.attention.common import SIGNATURE, inputs


def _example(a, d) -> jax.ShapeDtypeStruct:
  """The shape and dtype of one example of ``a``, vmapped at ``d``."""
  shape = a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :]
  return jax.ShapeDtypeStruct(shape, a.dtype)


def fold_into_batch(stage: str, prim, args, bdims, **params):
  """The batch-folding rule of ``stage`` (register with ``PrimitiveSpec.batching``)."""
  size = axis_size(args, bdims)
  examples = [_example(a, d) for a, d in zip(args, bdims)]
  sig = SIGNATURE.stage(stage, params)
  b = inputs(examples, params).q.shape[0]
  # The backward returns the gradient of each differentiable input: where
  # that input broadcasts over the batch, so must its gradient.
  grads = {sig.operand(g).name: i for i, g in enumerate(sig.results)} if stage == "bwd" else {}
  folded, summed = [], []
  for name, a, d, example in zip(sig.operands, args, bdims, examples):
    shared = sig.operand(name).broadcast and example.shape[0] == 1
    grad = grads.get(name)
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
