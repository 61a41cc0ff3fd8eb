"""The ways a bench calls a function: forward, forward+backward, and forward mode.

* ``fwd``: the function.
* ``fwd+bwd``: ``jax.value_and_grad`` of ``sum(out * c)`` over its outputs,
  with a random cotangent ``c`` per output passed as an argument (a constant
  would let either side fold its backward away).
* ``jvp``: ``jax.jvp`` with a random tangent per input.
* ``hvp``: a Hessian-vector product of that loss, forward over reverse
  (``jax.jvp`` of ``jax.grad``).

Peers built on ``custom_vjp`` raise under ``jvp`` and ``hvp``; the benches
report that (``bench/conftest.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("fwd", "fwd+bwd", "jvp", "hvp")


def _loss(fn, n):
  """``sum(out * c)`` of ``fn``'s outputs: ``n`` inputs, then one cotangent per output."""

  def loss(*a):
    outs = jax.tree.leaves(fn(*a[:n]))
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, a[n:]))

  return loss


def fwd_bwd(fn, n):
  """``value_and_grad`` of ``sum(out * c)``: takes ``fn``'s ``n`` inputs, then the cotangents."""
  return jax.value_and_grad(_loss(fn, n), tuple(range(n)))


def _random(rng, structs, dtype=None):
  return [
    jnp.asarray(rng.standard_normal(s.shape), dtype or s.dtype) for s in jax.tree.leaves(structs)
  ]


def transformed(fn, args, mode: str, rng: np.random.Generator):
  """``(function, arguments)`` that time ``fn`` at ``args`` in ``mode``."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  n = len(args)
  if mode == "fwd":
    return fn, list(args)
  if mode == "jvp":
    return (lambda *a: jax.jvp(fn, a[:n], a[n:])), [*args, *_random(rng, args)]
  cotangents = _random(rng, jax.eval_shape(fn, *args), jnp.float32)
  if mode == "fwd+bwd":
    return fwd_bwd(fn, n), [*args, *cotangents]
  loss = _loss(fn, n)
  m = len(cotangents)

  def hvp(*a):
    primals, cts, tangents = a[:n], a[n : n + m], a[n + m :]
    grad = lambda *p: jax.grad(loss, tuple(range(n)))(*p, *cts)
    return jax.jvp(grad, primals, tangents)

  return hvp, [*args, *cotangents, *_random(rng, args)]


def assert_agrees(fn, other, args, tolerance: float, what: str) -> float:
  """Two implementations in one mode: max over outputs of ``max |fn - other| / max |other|``.

  Asserts it is under ``tolerance`` (``what`` names ``other`` in the message)
  and returns it, for the benchmark's ``extra_info``.
  """
  got, want = (jax.tree.leaves(jax.jit(f)(*args)) for f in (fn, other))
  error = max(
    float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
    / max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1e-30)
    for g, w in zip(got, want)
  )
  assert error < tolerance, f"pallax differs from {what}: {error:.2e}"
  return error
