"""Benchmark helpers: jitted callables that block until their result is ready."""
import jax
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
