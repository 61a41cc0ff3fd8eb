"""Shared by the cross-entropy tests: the float64 reference, inputs, configs, comparisons.

The reference is written from the definition, never from pallax's programs:
it computes the full logits ``z = x @ weight + bias`` in float64, the soft cap
``z' = cap * tanh(z / cap)``, ``lse = logsumexp(z')`` and per token

    loss = lse - (1 - eps) * z'[label] - (eps / V) * sum_v z'_v + z_loss * lse**2

(label smoothing uniform over the V classes, as PyTorch and Optax do it).
Tokens whose label is ``ignore_index`` have loss 0 and no gradient; a
non-ignored label outside ``[0, V)`` gives NaN. ``"mean"`` divides the sum by
the number of non-ignored tokens (0 when there are none, with zero gradients).
Call it under ``tests.helpers.x64()``; jax differentiates it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import pallax
from tests.helpers import assert_close, rand

IGNORE = -100
REDUCTIONS = ("mean", "sum", "none")

# Pinned configs whose blocks split tokens, vocabulary and hidden dim into
# several (ragged) blocks at the tests' sizes. Mosaic TPU blocks: block_n a
# multiple of 8, block_v and block_d multiples of 128 (or covering the dim).
SMALL_BLOCKS = {
  "triton": dict(block_n=16, block_v=32, block_d=16),
  "mosaic_tpu": dict(block_n=8, block_v=128, block_d=128),
}


def small_blocks(path: str):
  """The pinned multi-block config of ``path`` (None on the XLA path)."""
  if path == "xla":
    return None
  return pallax.CrossEntropyConfig(**SMALL_BLOCKS[path])


# (path, pinned config): the executor's choice on every path, then the small
# multi-block configs on both interpreted kernels.
PATH_CONFIGS = [
  ("xla", False),
  ("triton", False),
  ("mosaic_tpu", False),
  ("triton", True),
  ("mosaic_tpu", True),
]


# The interpreted kernels only (the XLA path has its own tests of every option).
KERNEL_PATH_CONFIGS = PATH_CONFIGS[1:]


def pc_id(pc) -> str:
  path, small = pc
  return path + ("-small-blocks" if small else "")


def pc_config(pc):
  path, small = pc
  return small_blocks(path) if small else None


# Option sets: every option alone, then all of them together.
OPTIONS = {
  "plain": dict(),
  "smoothing": dict(label_smoothing=0.1),
  "z_loss": dict(z_loss=1e-2),
  "cap": dict(logit_soft_cap=4.0),
  "ignore_index_7": dict(ignore_index=7),
  "no_ignore_index": dict(ignore_index=None),
  "all": dict(label_smoothing=0.2, z_loss=1e-2, logit_soft_cap=3.0),
}


def labels_for(
  rng: np.random.Generator,
  shape,
  vocab: int,
  ignore_index: Optional[int] = IGNORE,
  ignored: float = 0.25,
  dtype=jnp.int32,
) -> jnp.ndarray:
  """Random labels in ``[0, vocab)``, the first at 0 and the last at ``vocab - 1``.

  About ``ignored`` of the others are ``ignore_index`` (none when it is None).
  """
  labels = np.asarray(rng.integers(0, vocab, size=shape))
  flat = labels.reshape(-1)
  if ignore_index is not None and flat.size > 2:
    drop = rng.random(flat.size) < ignored
    drop[0] = drop[-1] = False
    drop[1] = True  # at least one ignored token
    flat[drop] = ignore_index
  flat[0] = 0
  if flat.size > 1:
    flat[-1] = vocab - 1
  return jnp.asarray(flat.reshape(shape), dtype)


def linear_inputs(rng, tokens_shape, d: int, v: int, dtype=jnp.float32, ignore_index=IGNORE):
  """``x (..., D)``, ``weight (D, V)``, ``bias (V,)`` and labels; logits of a few units."""
  x = rand(rng, tuple(tokens_shape) + (d,), dtype)
  w = rand(rng, (d, v), dtype, scale=2.0 / np.sqrt(d))
  b = rand(rng, (v,), dtype, scale=0.5)
  return x, w, b, labels_for(rng, tokens_shape, v, ignore_index)


def logits_inputs(rng, tokens_shape, v: int, dtype=jnp.float32, ignore_index=IGNORE):
  """``logits (..., V)`` and labels."""
  z = rand(rng, tuple(tokens_shape) + (v,), dtype, scale=2.0)
  return z, labels_for(rng, tokens_shape, v, ignore_index)


def reference(
  logits,
  labels,
  *,
  ignore_index: Optional[int] = IGNORE,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  logit_soft_cap: Optional[float] = None,
  reduction: str = "mean",
  return_lse: bool = False,
):
  """Independent float64 cross entropy of given logits (see the module docstring)."""
  z = jnp.asarray(logits).astype(jnp.float64)
  labels = jnp.asarray(labels).astype(jnp.int32)
  v = z.shape[-1]
  if logit_soft_cap is not None:
    z = logit_soft_cap * jnp.tanh(z / logit_soft_cap)
  m = jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True))
  lse = (m + jnp.log(jnp.sum(jnp.exp(z - m), -1, keepdims=True)))[..., 0]
  keep = jnp.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
  in_range = (labels >= 0) & (labels < v)
  safe = jnp.where(in_range, labels, 0)
  zy = jnp.take_along_axis(z, safe[..., None], -1)[..., 0]
  zy = jnp.where(in_range, zy, jnp.nan)
  eps = label_smoothing
  loss = lse - (1 - eps) * zy - (eps / v) * jnp.sum(z, -1) + z_loss * lse**2
  loss = jnp.where(keep, loss, 0.0)
  if reduction == "sum":
    loss = jnp.sum(loss)
  elif reduction == "mean":
    count = jnp.sum(keep)
    loss = jnp.sum(loss) / jnp.where(count > 0, count, 1)
  elif reduction != "none":
    raise ValueError(reduction)
  return (loss, lse) if return_lse else loss


def logits_of(x, weight, bias=None):
  """``x @ weight + bias`` in float64 (the full logits)."""
  z = jnp.einsum(
    "...d,dv->...v",
    jnp.asarray(x).astype(jnp.float64),
    jnp.asarray(weight).astype(jnp.float64),
    precision=jax.lax.Precision.HIGHEST,
  )
  return z if bias is None else z + jnp.asarray(bias).astype(jnp.float64)


def linear_reference(x, weight, labels, *, bias=None, **options):
  """``reference`` of the full logits ``x @ weight + bias``."""
  return reference(logits_of(x, weight, bias), labels, **options)


def numpy_reference(
  logits, labels, *, ignore_index=IGNORE, label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None
):
  """Per-token losses by a loop over tokens in numpy: the smoothed target distribution.

  ``-sum_v q_v log_softmax(z')_v + z_loss * lse**2`` with
  ``q = (1 - eps) * onehot(label) + eps / V``: another formulation, to check
  ``reference`` against.
  """
  shape = np.shape(labels)
  z = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])
  labels = np.asarray(labels).reshape(-1)
  v = z.shape[-1]
  out = np.zeros(len(labels))
  for i, (row, label) in enumerate(zip(z, labels)):
    if ignore_index is not None and label == ignore_index:
      continue
    if logit_soft_cap is not None:
      row = logit_soft_cap * np.tanh(row / logit_soft_cap)
    lse = np.log(np.sum(np.exp(row - row.max()))) + row.max()
    q = np.full(v, label_smoothing / v)
    q[label] += 1 - label_smoothing
    out[i] = -np.sum(q * (row - lse)) + z_loss * lse**2
  return out.reshape(shape)


def assert_loss_close(got, want, dtype, what: str) -> None:
  """Loss values (float32 or float64) against the float64 reference.

  The loss is computed in float32 for every input dtype but float64, so the
  tolerance is float32's unless the inputs were float64 (bfloat16 inputs are
  rounded before the reference sees them).
  """
  tol_dtype = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  assert_close(got, want, tol_dtype, what)


def loss_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# ----------------------------------------------------------------------------
# Both ops behind one interface: operands as a dict, called like the reference.

OPS = ("cross_entropy", "linear_cross_entropy")


def inputs(
  op: str,
  rng,
  tokens_shape,
  v: int,
  d: int = 24,
  dtype=jnp.float32,
  *,
  bias=True,
  ignore_index=IGNORE,
) -> dict:
  """The operands of ``op`` by name (``labels`` included; ``bias`` None without a bias)."""
  if op == "cross_entropy":
    z, labels = logits_inputs(rng, tokens_shape, v, dtype, ignore_index)
    return dict(logits=z, labels=labels)
  x, w, b, labels = linear_inputs(rng, tokens_shape, d, v, dtype, ignore_index)
  return dict(x=x, weight=w, bias=b if bias else None, labels=labels)


def floating(ops: dict) -> dict:
  """The differentiable operands of ``ops`` (those present)."""
  return {k: a for k, a in ops.items() if k != "labels" and a is not None}


def pallax_loss(op: str, ops: dict, config=None, **options):
  """``pallax.<op>`` of the operands ``ops``."""
  if op == "cross_entropy":
    return pallax.cross_entropy(ops["logits"], ops["labels"], config=config, **options)
  return pallax.linear_cross_entropy(
    ops["x"], ops["weight"], ops["labels"], bias=ops.get("bias"), config=config, **options
  )


def reference_loss(op: str, ops: dict, **options):
  """``reference`` of the operands ``ops`` (call under ``x64()``; floats become float64)."""
  ops = {
    k: (a if k == "labels" or a is None else jnp.asarray(a).astype(jnp.float64))
    for k, a in ops.items()
  }
  if op == "cross_entropy":
    return reference(ops["logits"], ops["labels"], **options)
  return linear_reference(ops["x"], ops["weight"], ops["labels"], bias=ops.get("bias"), **options)
