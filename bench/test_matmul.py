"""matmul vs ``jnp.matmul`` plus the unfused epilogue, forward and forward+backward.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_matmul.py --benchmark-group-by=param:shape,param:epilogue,param:mode

Each group then holds the pallax and plain-jnp timings of one case side by side.
Shapes are ``(M, K, N)``: ``[M, K] @ [K, N]``. Modes (``bench/modes.py``):
``fwd``, ``fwd+bwd`` (random cotangents as arguments), ``jvp`` and ``hvp``.
``extra_info`` (``fwd`` and ``fwd+bwd``): the FLOPs and
bytes of the op's definition (``pallax.roofline.matmul_work``), the achieved
TFLOP/s and GB/s, and their fractions of the device's peaks where
``pallax.roofline`` knows them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from modes import MODES, transformed
from throughput import record_throughput

import pallax
from pallax import roofline
from pallax.primitives.matmul import matmul_reference

SHAPES = [(512, 512, 512), (2048, 2048, 2048), (8192, 1024, 4096)]
EPILOGUES = {"none": {}, "bias+gelu": {"activation": "gelu"}}
IMPLS = {"pallax": pallax.matmul, "jnp": matmul_reference}


def inputs(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  a = jnp.asarray(rng.standard_normal((m, k)), dtype)
  b = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  bias = jnp.asarray(rng.standard_normal(n), dtype)
  return a, b, bias


def _rounds(m, k, n) -> int:
  """Fewer rounds for the large products (seconds per call on a CPU)."""
  return 30 if m * k * n <= 2**30 else 10


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("dtype", [jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul(benchmark, bench, impl, mode, epilogue, dtype, shape):
  a, b, bias = inputs(*shape, dtype)
  kwargs = EPILOGUES[epilogue]
  op = IMPLS[impl]
  if kwargs:
    fn, args = (lambda a, b, bias: op(a, b, bias=bias, **kwargs)), [a, b, bias]
  else:
    fn, args = (lambda a, b: op(a, b)), [a, b]
  info = dict(op="matmul", impl=impl, mode=mode, dtype=jnp.dtype(dtype).name, shape=list(shape))
  benchmark.extra_info.update(info, variant=epilogue)
  fn, args = transformed(fn, args, mode, np.random.default_rng(1))
  bench(fn, *args, rounds=_rounds(*shape))
  if mode in roofline.MODES:
    work = roofline.matmul_work(*shape, dtype, mode, bias=bool(kwargs))
    record_throughput(benchmark, work, dtype)


VMAP_IMPLS = {
  # 256 vectors, vmapped against a shared weight: one folded GEMM.
  "pallax_vmap": jax.vmap(pallax.matmul, in_axes=(0, None)),
  # The same product written as one call.
  "pallax_explicit": pallax.matmul,
  "jnp_explicit": jnp.matmul,
}


@pytest.mark.parametrize("impl", list(VMAP_IMPLS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("epilogue", ["vmap"])
@pytest.mark.parametrize("shape", [(256, 1024, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_vmap_vectors_times_shared_weight(benchmark, bench, impl, mode, epilogue, shape):
  vectors, weight, _ = inputs(*shape, jnp.float32)
  fn, args = transformed(VMAP_IMPLS[impl], [vectors, weight], mode, np.random.default_rng(1))
  bench(fn, *args)
  if mode in roofline.MODES:
    record_throughput(benchmark, roofline.matmul_work(*shape, jnp.float32, mode), jnp.float32)
