"""Benchmark helpers: jitted callables that block until their result is ready, and
the forward+backward loss every bench uses."""

import jax
import jax.numpy as jnp
import pytest


def ready(fn):
  """``fn`` jitted, warmed up, and blocking, for pytest-benchmark to time."""
  jitted = jax.jit(fn)

  def call(*args):
    return jax.block_until_ready(jitted(*args))

  return call


@pytest.fixture
def bench(benchmark):
  """``bench(fn, *args)``: times the jitted ``fn`` after one warm-up call."""

  def run(fn, *args, rounds=30):
    call = ready(fn)
    call(*args)
    return benchmark.pedantic(call, args=args, rounds=rounds, iterations=1, warmup_rounds=2)

  return run


@pytest.fixture
def fwd_bwd():
  """``fwd_bwd(fn, n)``: ``value_and_grad`` of ``sum(out * c)`` over ``fn``'s outputs.

  The result takes ``fn``'s ``n`` inputs, then one cotangent ``c`` per output.
  Random cotangents passed as arguments keep either side from folding its
  backward into a constant.
  """

  def make(fn, n):
    def loss(*a):
      outs = jax.tree.leaves(fn(*a[:n]))
      return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, a[n:]))

    return jax.value_and_grad(loss, tuple(range(n)))

  return make
