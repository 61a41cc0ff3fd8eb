"""The cross-entropy family's tools: self-check cases, verify sweep, bench suites, work models.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``): one ``OpTools`` per op of the family,
``cross_entropy`` (given logits) and ``linear_cross_entropy`` (the
language-model head; tokamax's ``linear_softmax_cross_entropy_loss``
signature of it is covered by its tools).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.cross_entropy import cross_entropy, linear_cross_entropy
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "cross_entropy_work", "linear_cross_entropy_work"]

SMOOTHING = 0.1  # the self-checks' label smoothing


def linear_cross_entropy_work(tokens: int, hidden: int, vocab: int, dtype, mode: str) -> Work:
  """The language-model head's loss of ``x (N, D)`` and ``weight (D, V)``: ``2 N D V`` FLOPs.

  Forward+backward: 3x (``x W``, ``dlogits W^T``, ``x^T dlogits``); bytes:
  reads ``x`` and ``weight``, and the backward reads them again and writes
  ``dx`` and ``dweight``. The ``[N, V]`` logits are not in the op's
  definition's traffic: they need not leave the chip.
  """
  bwd = check_mode(mode)
  operands = tokens * hidden + hidden * vocab
  flops = 2 * tokens * hidden * vocab
  return Work(3 * flops if bwd else flops, nbytes((3 if bwd else 1) * operands, dtype))


def cross_entropy_work(tokens: int, vocab: int, dtype, mode: str) -> Work:
  """Cross-entropy of given ``logits (N, V)``: bytes only.

  Reads the logits; the backward reads them again and writes their gradient.
  """
  bwd = check_mode(mode)
  return Work(None, nbytes((3 if bwd else 1) * tokens * vocab, dtype))


def _labels(tokens: int, vocab: int) -> jax.Array:
  """Fixed labels spread over the vocabulary (integer labels are not differentiated)."""
  return (jnp.arange(tokens, dtype=jnp.int32) * 7919) % vocab


def _smoothed_loss_reference(logits: jax.Array) -> jax.Array:
  """Optax's formulation: log_softmax of the logits in full, the smoothed targets, the mean."""
  st = jnp.promote_types(logits.dtype, jnp.float32)
  tokens, vocab = logits.shape
  logp = jax.nn.log_softmax(logits.astype(st), axis=-1)
  one_hot = jax.nn.one_hot(_labels(tokens, vocab), vocab, dtype=st)
  target = (1 - SMOOTHING) * one_hot + SMOOTHING / vocab
  return -jnp.mean(jnp.sum(target * logp, axis=-1))


def _logits_args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array]:
  n, v = (37, 301) if small else (1024, 32000)
  return (jnp.asarray(3 * rng.standard_normal((n, v)), dtype),)


def _logits_loss(logits: jax.Array) -> jax.Array:
  return cross_entropy(logits, _labels(*logits.shape), label_smoothing=SMOOTHING)


def _lm_head_args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  n, d, v = (37, 64, 301) if small else (2048, 512, 32000)
  x = jnp.asarray(rng.standard_normal((n, d)), dtype)
  return x, jnp.asarray(rng.standard_normal((d, v)) / np.sqrt(d), dtype)


def _lm_head_loss(x: jax.Array, w: jax.Array) -> jax.Array:
  labels = _labels(x.shape[0], w.shape[1])
  return linear_cross_entropy(x, w, labels, label_smoothing=SMOOTHING)


def _lm_head_loss_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  st = jnp.promote_types(x.dtype, jnp.float32)
  return _smoothed_loss_reference(jnp.dot(x, w, preferred_element_type=st))


def _lm_head_features(x, w, b, labels) -> jax.Array:
  """Gemma 2's soft cap with a bias, label smoothing and z-loss."""
  return linear_cross_entropy(
    x, w, labels, bias=b, logit_soft_cap=30.0, label_smoothing=0.1, z_loss=1e-4
  )


# Sweep sizes of the LM head (N tokens, D hidden, V vocabulary): the bench's,
# GPT-2's odd vocabulary with a wide hidden dim, a few tokens of a Llama-2 one,
# Llama-3's; of given logits (N, V).
LM_HEAD_SIZES = ((8192, 1024, 32768), (1000, 4096, 50257), (16, 2048, 32001), (2048, 4096, 128256))
LM_HEAD_QUICK = LM_HEAD_SIZES[:2]
LOGITS_SIZES = ((4096, 32768), (1000, 50257), (16, 128256))

LOGITS = OpTools(
  "cross_entropy",
  SelfCheck("cross_entropy", _logits_args, _logits_loss, _smoothed_loss_reference),
  {
    "cross_entropy": SweepOp(
      cross_entropy, lambda n, v: [(n, v), (n,)], LOGITS_SIZES, LOGITS_SIZES[:2], ints=1
    )
  },
  BenchSuite("test_cross_entropy.py", "logits", "N x V"),
  cross_entropy_work,
)
LM_HEAD_SWEEP = {
  # Candidates as for causal attention: the features case below stands for them.
  "linear_cross_entropy": SweepOp(
    linear_cross_entropy,
    lambda n, d, v: [(n, d), (d, v), (n,)],
    LM_HEAD_SIZES,
    LM_HEAD_QUICK,
    ints=1,
    candidates=False,
  ),
  "linear_cross_entropy_features": SweepOp(
    _lm_head_features,
    lambda n, d, v: [(n, d), (d, v), (v,), (n,)],
    LM_HEAD_QUICK,
    LM_HEAD_QUICK,
    ints=1,
  ),
}
LM_HEAD = OpTools(
  "linear_cross_entropy",
  SelfCheck("linear_cross_entropy", _lm_head_args, _lm_head_loss, _lm_head_loss_reference),
  LM_HEAD_SWEEP,
  BenchSuite("test_cross_entropy.py", "test_linear_cross_entropy_modes", "N x D x V"),
  linear_cross_entropy_work,
  aliases=("linear_softmax_cross_entropy_loss",),
)

TOOLS = (LOGITS, LM_HEAD)
