"""Helpers shared by the batching rules."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# The batch dim of an unmapped operand (jax's private `batching.not_mapped`).
NOT_MAPPED = None


def axis_size(args, bdims) -> int:
  """The vmapped axis' size, from the first mapped operand."""
  return next(a.shape[d] for a, d in zip(args, bdims) if d is not NOT_MAPPED)


def batch_first(args, bdims) -> list[jax.Array]:
  """Every operand with its mapped axis (broadcast where unmapped) in front."""
  size = axis_size(args, bdims)
  return [at_axis(a, d, size, 0) for a, d in zip(args, bdims)]


def at_axis(a: jax.Array, bdim, size: int, axis: int) -> jax.Array:
  """``a`` with its mapped axis (or a broadcast one, if unmapped) at ``axis``."""
  if bdim is NOT_MAPPED:
    a = jnp.expand_dims(a, axis)
    return jnp.broadcast_to(a, a.shape[:axis] + (size,) + a.shape[axis + 1:])
  return jnp.moveaxis(a, bdim, axis)
