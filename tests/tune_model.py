"""A small two-layer function for the tuning tests (``python -m pallax.tune``)."""

import jax

import pallax

# The example arguments, as ``python -m pallax.tune`` reads them.
ARGS = ("f32[64,128]", "f32[128,256]", "f32[256,128]", "f32[128]")


def two_layer(x: jax.Array, w1: jax.Array, w2: jax.Array, scale: jax.Array) -> jax.Array:
  """rms_norm, a matmul with a gelu epilogue, a matmul and a softmax."""
  h = pallax.matmul(pallax.rms_norm(x, scale), w1, activation="gelu")
  return pallax.softmax(pallax.matmul(h, w2))
