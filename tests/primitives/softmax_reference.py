"""Shared by the softmax tests: the float64 reference, configs, comparisons."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallax
from tests.helpers import assert_close, f64

OPS = ("softmax", "log_softmax")
# Pinned configs that split rows of >= 128 into several ragged column blocks:
# the online reduction. Mosaic TPU takes 32-row blocks with a mask (int8
# tiles) and 128-column blocks.
MULTI_BLOCK = {
  "triton": pallax.SoftmaxConfig(block_rows=4, block_cols=32),
  "mosaic_tpu": pallax.SoftmaxConfig(block_rows=32, block_cols=128),
}
# (path, pinned config): the executor's choice on every path, then the
# multi-block configs on both interpreted kernels.
CONFIGS = [
  ("xla", None),
  ("triton", None),
  ("mosaic_tpu", None),
  ("triton", MULTI_BLOCK["triton"]),
  ("mosaic_tpu", MULTI_BLOCK["mosaic_tpu"]),
]


def config_id(path_config) -> str:
  path, config = path_config
  return path + ("-multiblock" if config else "")


def pallax_op(op: str, config=None):
  """``pallax.<op>`` with ``config`` pinned, called like the reference."""
  fn = getattr(pallax, op)
  return lambda x, axis=-1, where=None: fn(x, axis, where=where, config=config)


def reference(x, axis=-1, where=None, *, op: str):
  """Independent float64 (log-)softmax: plain jnp on finite inputs.

  Fully masked rows are 0 (softmax) or -inf (log_softmax), with zero gradients.
  """
  x = jnp.asarray(x).astype(jnp.float64)
  where = jnp.ones(x.shape, bool) if where is None else jnp.broadcast_to(where, x.shape)
  m = jnp.max(jnp.where(where, x, -jnp.inf), axis, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully masked rows
  e = jnp.where(where, jnp.exp(x - m), 0.0)
  s = jnp.sum(e, axis, keepdims=True)
  s = jnp.where(s > 0, s, 1.0)  # fully masked rows
  if op == "log_softmax":
    return jnp.where(where, x - m - jnp.log(s), -jnp.inf)
  return e / s


def reference_op(op: str):
  return lambda x, axis=-1, where=None: reference(x, axis, where, op=op)


def assert_matches(got, want, dtype, what: str) -> None:
  """``got`` is -inf exactly where ``want`` is and close to it elsewhere."""
  got, want = f64(got), f64(want)
  inf = np.isneginf(want)
  np.testing.assert_array_equal(np.isneginf(got), inf, err_msg=f"{what}: -inf entries")
  assert_close(got[~inf], want[~inf], dtype, what)


def random_mask(rng: np.random.Generator, shape) -> jnp.ndarray:
  """A random ``where=`` mask keeping about 70% of entries, at least one per row."""
  mask = rng.random(shape) < 0.7
  mask[..., rng.integers(shape[-1])] = True
  return jnp.asarray(mask)
