"""softmax / log_softmax vs jax.nn, in every mode.

Run: ``pytest -n 0 bench/test_softmax.py
--benchmark-group-by=param:op,param:shape,param:dtype,param:mode``.
Each group then holds the pallax and jax.nn timings of one case side by side.
Modes (``bench/modes.py``): ``fwd``, ``fwd+bwd`` (a random cotangent as an
argument, so neither side can fold the backward away), ``jvp`` and ``hvp``.
``extra_info`` (``fwd`` and ``fwd+bwd``): the bytes the op's definition moves
and the achieved GB/s, with the fraction of the device's bandwidth where
``pallax.roofline`` knows it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from modes import MODES, transformed
from throughput import record_throughput

import pallax
from pallax import roofline

SHAPES = [(1024, 1024), (4096, 1024), (8192, 4096)]
IMPLS = {
  "softmax": {"pallax": pallax.softmax, "jax.nn": jax.nn.softmax},
  "log_softmax": {"pallax": pallax.log_softmax, "jax.nn": jax.nn.log_softmax},
}


def input_(shape, dtype, rng):
  """The random logits of the cases."""
  return jnp.asarray(2 * rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("impl", ["pallax", "jax.nn"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(IMPLS))
def test_softmax(benchmark, bench, op, impl, mode, dtype, shape):
  rng = np.random.default_rng(0)
  x = input_(shape, dtype, rng)
  benchmark.extra_info.update(
    op=op, impl=impl, mode=mode, dtype=jnp.dtype(dtype).name, shape=list(shape)
  )
  fn, args = transformed(IMPLS[op][impl], [x], mode, rng)
  bench(fn, *args)
  if mode in roofline.MODES:
    record_throughput(benchmark, roofline.softmax_work(shape, dtype, mode), dtype)
