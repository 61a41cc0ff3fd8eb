"""vmap rule for attention: the vmapped axis folds into the batch dim, one kernel.

Every operand of the attention primitives leads with the batch dim ``B``
(``q``, ``k``, ``v``, lengths, ``out``, ``lse``, tangents), except the
bias-like ones (bias, mask, the bias tangent), which lead with 1 or ``B``
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
from pallax.kernels.attention.common import Problem


def _bias_like(prim, p: Problem, n_operands: int) -> set[int]:
  """Indices of the bias-like operands: bias, mask and the tangent's dbias (last)."""
  out = set(range(5, 5 + p.has_bias + p.has_mask))
  if p.has_bias and prim.name.endswith("_jvp"):
    out.add(n_operands - 1)
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
  returns_dbias = prim.name.endswith("_bwd") and p.has_bias
  bias_like = _bias_like(prim, p, len(args))
  folded = []
  for i, (a, d) in enumerate(zip(args, bdims)):
    shared = i in bias_like and a.shape[0] == 1
    if d is NOT_MAPPED and shared and not (returns_dbias and i == 5):
      folded.append(a)  # broadcasts over every example
      continue
    a = batching.bdim_at_front(a, d, size)
    if a.shape[1] != b:
      a = jnp.broadcast_to(a, (size, b, *a.shape[2:]))
    folded.append(a.reshape(size * b, *a.shape[2:]))
  outs = prim.bind(*folded, **params)
  outs = [o.reshape(size, b, *o.shape[1:]) for o in outs]
  if returns_dbias and examples[5].shape[0] == 1:
    outs[-1] = jnp.sum(outs[-1], axis=1, keepdims=True)
  return outs, [0] * len(outs)
