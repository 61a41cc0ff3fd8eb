"""Small helpers shared by the Pallas kernels."""
from __future__ import annotations

import jax.numpy as jnp


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1): Triton's block sizes."""
  return 1 << max(0, n - 1).bit_length()


def sublanes(dtype) -> int:
  """TPU sublane tile for ``dtype``: 8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
