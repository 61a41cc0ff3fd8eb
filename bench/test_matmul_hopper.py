"""matmul on Hopper: the Mosaic GPU kernel against the Pallas-Triton kernel and cuBLAS.

Run on an H100 or H200 (issue 28's matmul choice)::

  XLA_PYTHON_CLIENT_PREALLOCATE=false pytest -n 0 bench/test_matmul_hopper.py \\
      --benchmark-json matmul_hopper.json

Cases: bfloat16 ``[M, K] @ [K, N]`` at 4096 and 8192 cubed, ``fwd`` and
``fwd+bwd`` (``bench/modes.py``; the backward is two more products). Each case
times, in one process and one test, three implementations:

* ``pallax``: the executor's choice (``pallax_kernels`` records it: XLA's
  GEMM on Hopper since these measurements, kernels/matmul/config.py);
* ``pallax-triton``: every matmul kernel call pinned to the Pallas-Triton
  kernel's heuristic config (an executor overlay);
* ``pallax-mosaic-gpu``: pinned to the Mosaic GPU kernel's ``heuristic_config``;
* ``cublas``: ``jnp.matmul`` (XLA's GEMM, cuBLAS/cuBLASLt on an NVIDIA GPU).

The benchmark itself is pallax's; the others are timed the same way (median
of ``side_by_side.ROUNDS`` samples of calls back to back, and of single
calls as ``one_call_*``). ``extra_info``: each one's
``tflop_per_s`` (``pallax.roofline.matmul_work``), ``fraction_of_peak_flops``
and ``ratio_to_cublas`` (cuBLAS's time over the implementation's: above 1 is
faster), and its max error on the first rows against a float64 product.
Without an NVIDIA GPU the cases are deselected: nothing here runs on a CPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import modes
import numpy as np
import pytest
from side_by_side import compare, rel_err

import pallax
from pallax import roofline
from pallax.executor.registry import kernel_spec
from pallax.executor.tools import kernel_calls, local_target
from pallax.kernels.matmul import mosaic_gpu
from pallax.kernels.matmul.layout import problem_of
from pallax.op import op_params

CHECK_ROWS = 64
TOLERANCE = 2e-2  # bfloat16 result against float64, max error over max value
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192)]
IMPLS = ("pallax", "pallax-triton", "pallax-mosaic-gpu", "cublas")


pytestmark = pytest.mark.nvidia_gpu  # deselected off an NVIDIA GPU (bench/conftest.py)


def _inputs(m, k, n):
  keys = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  b = (jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  return a, b, jax.random.normal(keys[2], (m, n), jnp.float32)


def _function(impl, mode):
  f = jnp.matmul if impl == "cublas" else pallax.matmul
  return f if mode == "fwd" else modes.fwd_bwd(f, 2)


def _pins(impl, fn, args) -> dict:
  """The matmul config ``impl`` pins for every call of ``fn``: its heuristic's at the smallest."""
  calls = kernel_calls(jax.make_jaxpr(fn)(*args).jaxpr)
  avals, params = min(
    (([v.aval for v in e.invars], op_params(e.params)) for e in calls),
    key=lambda c: min(problem_of(*c).m, problem_of(*c).n),
  )
  if impl == "pallax-mosaic-gpu":
    return {"matmul": mosaic_gpu.heuristic_config(problem_of(avals, params))}
  config = kernel_spec("matmul").heuristic(avals, local_target(), **params)
  return {"matmul": dataclasses.replace(config, implementation="pallas")}


PINNED = {"pallax-triton": "pallas", "pallax-mosaic-gpu": mosaic_gpu.IMPLEMENTATION}


def _compiled(impl, mode, args):
  fn = _function(impl, mode)
  if impl in PINNED:
    with pallax.default_executor().overlay(_pins(impl, fn, args)):
      picks = pallax.explain(fn, *args)
      assert {s.implementation for s in picks} == {PINNED[impl]}, picks
      return jax.jit(fn).lower(*args).compile()
  return jax.jit(fn).lower(*args).compile()


def _reference_rows(mode, args):
  """Float64 ``a @ b`` (``fwd``) or ``dL/da = c @ b^T`` (``fwd+bwd``) of the first rows."""
  b = np.asarray(args[1].astype(jnp.float32), np.float64)
  if mode == "fwd":
    return np.asarray(args[0][:CHECK_ROWS].astype(jnp.float32), np.float64) @ b
  return np.asarray(args[2][:CHECK_ROWS], np.float64) @ b.T


def _checked_rows(mode, result):
  out = result if mode == "fwd" else result[1][0]
  return np.asarray(out[:CHECK_ROWS].astype(jnp.float32), np.float64)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_hopper_matmul(benchmark, request, shape, mode):
  benchmark.group = f"hopper-matmul-{'x'.join(map(str, shape))}-{mode}"
  a, b, c = jax.block_until_ready(_inputs(*shape))
  args = (a, b) if mode == "fwd" else (a, b, c)
  want = _reference_rows(mode, (a, b, c))
  calls = {impl: functools.partial(_compiled(impl, mode, args), *args) for impl in IMPLS}
  picks = pallax.explain(_function("pallax", mode), *args)
  benchmark.extra_info["pallax_kernels"] = [
    f"{s.op}: {s.implementation} ({s.source})" for s in picks
  ]
  error = lambda result: rel_err(_checked_rows(mode, result), want)
  work = roofline.matmul_work(*shape, jnp.bfloat16, mode)
  compare(benchmark, request, calls, error, TOLERANCE, work, jnp.bfloat16, "cublas")
