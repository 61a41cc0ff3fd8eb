"""A tiny causal language model trained with pallax ops: ``jax.jit`` of a ``jax.grad`` step.

One pre-norm attention block and a tied language-model head, written with
``pallax.rms_norm``, ``pallax.matmul``, ``pallax.dot_product_attention`` and
``pallax.linear_cross_entropy``; the update is plain SGD (no optax needed).
``loss`` takes its arrays as positional arguments, so ``python -m pallax.tune``
can trace it from shapes alone (the exact command is in ``docs/tuning.md``);
``reference_loss`` is the same model in plain JAX, which the demo checks it
against.

Run from the repository root::

  python -m examples.train_step   # 20 SGD steps on one random batch; the loss falls
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallax

HEADS = 4

# ``python -m pallax.tune examples.train_step:loss --args`` these shapes: a batch
# of 2 sequences of 16 tokens, width 32, a vocabulary of 64.
ARGS = ("i32[2,16]", "i32[2,16]", "f32[64,32]", "f32[32]", "f32[32,96]", "f32[32,32]")


def init(key: jax.Array, vocab: int = 64, width: int = 32) -> tuple[jax.Array, ...]:
  """Random parameters: (embedding, norm weight, qkv projection, output projection)."""
  k_embed, k_qkv, k_out = jax.random.split(key, 3)
  embedding = jax.random.normal(k_embed, (vocab, width)) * 0.02
  norm = jnp.ones((width,))
  w_qkv = jax.random.normal(k_qkv, (width, 3 * width)) * width**-0.5
  w_out = jax.random.normal(k_out, (width, width)) * width**-0.5
  return embedding, norm, w_qkv, w_out


def loss(
  tokens: jax.Array,
  labels: jax.Array,
  embedding: jax.Array,
  norm: jax.Array,
  w_qkv: jax.Array,
  w_out: jax.Array,
) -> jax.Array:
  """The mean next-token cross-entropy of a one-block model.

  Args:
    tokens: ``(batch, seq)`` token ids.
    labels: ``(batch, seq)`` the ids to predict.
    embedding: ``(vocab, width)``, also the output head (tied).
    norm: ``(width,)`` rms_norm weight.
    w_qkv: ``(width, 3 * width)`` query, key and value projections.
    w_out: ``(width, width)`` the attention's output projection.

  Returns:
    The scalar loss, float32.
  """
  batch, seq = tokens.shape
  width = embedding.shape[1]
  x = embedding[tokens]  # (batch, seq, width)
  q, k, v = jnp.split(pallax.matmul(pallax.rms_norm(x, norm), w_qkv), 3, axis=-1)
  heads = lambda t: t.reshape(batch, seq, HEADS, width // HEADS)
  attended = pallax.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
  x = x + pallax.matmul(attended.reshape(batch, seq, width), w_out)
  # The tied head reads the (vocab, width) table as it is laid out.
  return pallax.linear_cross_entropy(pallax.rms_norm(x), embedding, labels, transposed_weight=True)


def reference_loss(tokens, labels, embedding, norm, w_qkv, w_out) -> jax.Array:
  """``loss`` in plain JAX (``jax.nn``, materialised logits): what the pallax ops compute."""
  batch, seq = tokens.shape
  width = embedding.shape[1]

  def rms(x, weight=1.0):
    return x * jax.lax.rsqrt(jnp.mean(x**2, -1, keepdims=True) + 1e-6) * weight

  x = embedding[tokens]
  q, k, v = jnp.split(rms(x, norm) @ w_qkv, 3, axis=-1)
  heads = lambda t: t.reshape(batch, seq, HEADS, width // HEADS)
  attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
  x = x + attended.reshape(batch, seq, width) @ w_out
  logits = rms(x) @ embedding.T
  label_logits = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - label_logits)


@jax.jit
def sgd_step(
  params: tuple[jax.Array, ...], tokens: jax.Array, labels: jax.Array, lr: float = 0.5
) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """One SGD step: the loss before it and the updated parameters."""
  value, grads = jax.value_and_grad(lambda p: loss(tokens, labels, *p))(params)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def main(steps: int = 20) -> None:
  """Trains on one random batch (it memorises it) and prints the loss.

  Raises AssertionError if the loss differs from plain JAX's at the start, or
  does not halve.
  """
  k_params, k_tokens = jax.random.split(jax.random.key(0))
  params = init(k_params)
  sequence = jax.random.randint(k_tokens, (2, 17), 0, params[0].shape[0])
  tokens, labels = sequence[:, :-1], sequence[:, 1:]  # predict the next token
  want = jax.jit(reference_loss)(tokens, labels, *params)
  got = jax.jit(loss)(tokens, labels, *params)
  if not jnp.allclose(got, want, rtol=1e-4):
    raise AssertionError(f"pallax's loss {float(got)} differs from plain JAX's {float(want)}")
  first = None
  for step in range(steps):
    params, value = sgd_step(params, tokens, labels)
    first = value if first is None else first
    if step % 5 == 0 or step == steps - 1:
      print(f"step {step:2d}  loss {float(value):.4f}")
  if not value < first / 2:
    raise AssertionError(f"the loss fell from {float(first)} to {float(value)} only")


if __name__ == "__main__":
  main()
