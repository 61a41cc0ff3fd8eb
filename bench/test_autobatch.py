"""Benchmarks of ``pallax.autobatch``: speed against the alternatives, peak memory.

Speed: a small MLP per row (64 -> 512 -> 16, tanh) over n = 10000 and the
prime n = 10007 rows, with a budget of a quarter of the total io bytes, run
unbatched, through ``pallax.autobatch``, through ``jax.lax.map(...,
batch_size=...)`` with the same chunk length, and through bartz's
``autobatch`` when bartz is installed. Each case records its chunk count in
``extra_info``; compare the means within a group (target: autobatch within
1.10x of unbatched, 4 chunks at both lengths).

Memory: a subprocess runs an MLP whose unbatched hidden layer alone takes
4 GiB, unbatched and autobatched with ``count_intermediates=True`` under a
256 MiB budget, and reports the growth of its peak memory during the call
(host RSS on CPU, ``peak_bytes_in_use`` on accelerators). The autobatched
growth must stay under the budget plus a fixed overhead: one copy of the
input (the scan's chunked view), the output, and 64 MiB for the runtime.

Run: ``PYTHONPATH=. python -m pytest -n 0 bench/test_autobatch.py --benchmark-only``.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallax.autobatch import autobatch

D, HIDDEN, OUT = 64, 512, 16
LENGTHS = [10000, 10007]
CHUNKS = 4


def mlp(x, w1, w2):
  return jnp.tanh(x @ w1) @ w2


def io_nbytes(n):
  return n * (D + OUT) * 4


@pytest.fixture(scope="module")
def weights():
  rng = np.random.default_rng(0)
  w1 = jnp.asarray(rng.normal(size=(D, HIDDEN)) / math.sqrt(D), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(HIDDEN, OUT)) / math.sqrt(HIDDEN), jnp.float32)
  return w1, w2


def rows(n):
  return jnp.asarray(np.random.default_rng(n).normal(size=(n, D)), jnp.float32)


def run_case(benchmark, fn, x, w1, w2, nbatches, n):
  """Compile, then time ``fn`` (returning ``(out, ...)``) to completion."""
  jax.block_until_ready(fn(x, w1, w2))
  benchmark.group = f"mlp n={n}"
  benchmark.extra_info.update(n=n, nbatches=int(nbatches))
  out = benchmark(lambda: jax.block_until_ready(fn(x, w1, w2)))
  np.testing.assert_allclose(out, mlp(x, w1, w2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", LENGTHS)
def test_unbatched(benchmark, weights, n):
  run_case(benchmark, jax.jit(mlp), rows(n), *weights, nbatches=1, n=n)


@pytest.mark.parametrize("n", LENGTHS)
def test_pallax_autobatch(benchmark, weights, n):
  x = rows(n)
  budget = io_nbytes(n) // CHUNKS
  _, nbatches = autobatch(mlp, budget, in_axes=(0, None, None), return_nbatches=True)(x, *weights)
  assert int(nbatches) == CHUNKS
  run_case(
    benchmark, autobatch(mlp, budget, in_axes=(0, None, None)), x, *weights, nbatches=nbatches, n=n
  )


@pytest.mark.parametrize("n", LENGTHS)
def test_lax_map(benchmark, weights, n):
  batch_size = -(-n // CHUNKS)

  @jax.jit
  def mapped(x, w1, w2):
    return jax.lax.map(lambda row: mlp(row, w1, w2), x, batch_size=batch_size)

  run_case(benchmark, mapped, rows(n), *weights, nbatches=-(-n // batch_size), n=n)


@pytest.mark.parametrize("n", LENGTHS)
def test_bartz_autobatch(benchmark, weights, n):
  pytest.importorskip("bartz")
  from bartz._jaxext import autobatch as bartz_autobatch  # bartz exports it privately only

  x = rows(n)
  budget = io_nbytes(n) // CHUNKS
  with_count = bartz_autobatch(mlp, budget, in_axes=(0, None, None), return_nbatches=True)
  _, nbatches = with_count(x, *weights)
  run_case(
    benchmark,
    bartz_autobatch(mlp, budget, in_axes=(0, None, None)),
    x,
    *weights,
    nbatches=nbatches,
    n=n,
  )


# -- peak memory in a subprocess ----------------------------------------------

MEMORY_N, MEMORY_D, MEMORY_HIDDEN = 131072, 32, 8192  # unbatched hidden layer: 4 GiB
MEMORY_BUDGET = 256 * 2**20
RUNTIME_ALLOWANCE = 64 * 2**20

MEMORY_SCRIPT = r"""
import json, os, resource, sys
import jax, jax.numpy as jnp
from pallax.autobatch import autobatch

mode, n, d, hidden, budget = sys.argv[1], *map(int, sys.argv[2:])

def mlp(x, w1, w2):
  return jnp.tanh(x @ w1) @ w2

def memory():
  '''(in use now, peak so far) in bytes.'''
  device = jax.devices()[0]
  if device.platform == "cpu":
    if not os.path.exists("/proc/self/statm"):
      raise RuntimeError("this bench reads host memory from /proc/self/statm (Linux only)")
    with open("/proc/self/statm") as f:
      now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  stats = device.memory_stats()
  return stats["bytes_in_use"], stats["peak_bytes_in_use"]

k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k1, (n, d))
w1 = jax.random.normal(k2, (d, hidden)) / d ** 0.5
w2 = jax.random.normal(k3, (hidden, 1)) / hidden ** 0.5
if mode == "autobatch":
  fn = autobatch(mlp, budget, in_axes=(0, None, None), count_intermediates=True,
                 return_nbatches=True)
else:
  fn = jax.jit(lambda *args: (mlp(*args), 1))
compiled = fn.lower(x, w1, w2).compile()
jax.block_until_ready((x, w1, w2))
before, _ = memory()
out, nbatches = compiled(x, w1, w2)
checksum = float(jnp.abs(jax.block_until_ready(out)).sum())
_, peak = memory()
print(json.dumps({"growth": peak - before, "nbatches": int(nbatches), "checksum": checksum,
                  "temp": compiled.memory_analysis().temp_size_in_bytes}))
"""


def measure_memory(mode):
  args = [
    sys.executable,
    "-c",
    MEMORY_SCRIPT,
    mode,
    *map(str, (MEMORY_N, MEMORY_D, MEMORY_HIDDEN, MEMORY_BUDGET)),
  ]
  path = [os.getcwd(), os.environ.get("PYTHONPATH", "")]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)))
  done = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_stays_under_budget(benchmark):
  results = benchmark.pedantic(
    lambda: {mode: measure_memory(mode) for mode in ("unbatched", "autobatch")},
    rounds=1,
    iterations=1,
  )
  unbatched, batched = results["unbatched"], results["autobatch"]
  benchmark.group = "peak memory"
  benchmark.extra_info.update(
    budget_mib=MEMORY_BUDGET / 2**20,
    unbatched_growth_mib=unbatched["growth"] / 2**20,
    autobatch_growth_mib=batched["growth"] / 2**20,
    autobatch_nbatches=batched["nbatches"],
    autobatch_temp_mib=batched["temp"] / 2**20,
  )
  assert math.isclose(batched["checksum"], unbatched["checksum"], rel_tol=1e-3)
  assert unbatched["growth"] > 4 * 2**30  # the case needs several GiB unbatched
  fixed_overhead = MEMORY_N * (MEMORY_D + 1) * 4 + RUNTIME_ALLOWANCE
  assert batched["growth"] <= MEMORY_BUDGET + fixed_overhead
