"""Cost of one config selection: warm in-memory cache, and a disk hit.

Target: a warm in-memory selection under 20 microseconds.
"""

import jax
import jax.numpy as jnp

import pallax  # noqa: F401  (registers the kernels)
from pallax.executor import Executor

AVALS = [
  jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16),
  jax.ShapeDtypeStruct((1024,), jnp.bfloat16),
]
PARAMS = {"eps": 1e-6, "offset": 0.0}


def _tuned_executor(cache_dir):
  """An executor whose cache holds a tuned rms_norm_fwd entry (timer faked: no run)."""
  ex = Executor(policy="autotune", cache_dir=cache_dir, timer=lambda config: config.block_rows)
  ex.select("rms_norm_fwd", AVALS, "cpu", PARAMS, make_fn=lambda config: None)
  return ex


def test_select_warm_memory(benchmark, tmp_path):
  ex = _tuned_executor(tmp_path)
  chosen = benchmark(ex.select, "rms_norm_fwd", AVALS, "cpu", PARAMS)
  assert chosen.source == "memory"


def test_select_disk_hit(benchmark, tmp_path):
  _tuned_executor(tmp_path)

  def fresh_select():
    return Executor(cache_dir=tmp_path).select("rms_norm_fwd", AVALS, "cpu", PARAMS)

  chosen = benchmark(fresh_select)
  assert chosen.source == "disk"
