"""softmax / log_softmax vs jax.nn, forward and forward+backward.

Run: ``pytest -n 0 bench/test_softmax.py
--benchmark-group-by=param:op,param:shape,param:dtype,param:mode``.
Each group then holds the pallax and jax.nn timings of one case side by side.
The forward+backward loss takes a random cotangent (an argument, not a
constant), so neither side can fold the backward away. ``extra_info``: the
bytes the op's definition moves and the achieved GB/s, with the fraction of
the device's bandwidth where ``pallax.roofline`` knows it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from throughput import record_throughput

import pallax
from pallax import roofline

SHAPES = [(1024, 1024), (4096, 1024), (8192, 4096)]
IMPLS = {
  "softmax": {"pallax": pallax.softmax, "jax.nn": jax.nn.softmax},
  "log_softmax": {"pallax": pallax.log_softmax, "jax.nn": jax.nn.log_softmax},
}


@pytest.mark.parametrize("impl", ["pallax", "jax.nn"])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(IMPLS))
def test_softmax(benchmark, bench, fwd_bwd, op, impl, mode, dtype, shape):
  rng = np.random.default_rng(0)
  x = jnp.asarray(2 * rng.standard_normal(shape), dtype)
  fn = IMPLS[op][impl]
  if mode == "fwd":
    bench(fn, x)
  else:
    bench(fwd_bwd(fn, 1), x, jnp.asarray(rng.standard_normal(shape), jnp.float32))
  record_throughput(benchmark, roofline.softmax_work(shape, dtype, mode), dtype)
