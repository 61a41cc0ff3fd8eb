"""Helpers shared by the batching rules.

JAX's public ones cover the rest: ``jax.interpreters.batching.bdim_at_front``
and ``broadcast``.
"""

from __future__ import annotations

# The batch dim of an unmapped operand (jax's private `batching.not_mapped`).
NOT_MAPPED = None


def axis_size(args, bdims) -> int:
  """The vmapped axis' size, from the first mapped operand."""
  return next(a.shape[d] for a, d in zip(args, bdims) if d is not NOT_MAPPED)
