"""Timing kernel candidates on this device.

Each candidate config is compiled once, warmed up and timed on fresh random
inputs of the call's avals (never the user's data, never zeros); the median
of several runs is its time. Candidates that fail to compile or run are
skipped and the reason recorded. Tuning runs in a worker thread, so that it
is outside any JAX trace even when it is triggered from inside a lowering.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallax.executor.config import KernelConfig

# measure(config) -> seconds; raises if the candidate cannot run.
Measure = Callable[[KernelConfig], float]


@dataclasses.dataclass(frozen=True)
class TuneResult:
  best: KernelConfig
  time_s: float
  timings: tuple[tuple[KernelConfig, float], ...]
  failures: tuple[tuple[KernelConfig, str], ...]


def random_inputs(avals: Sequence[Any], seed: int) -> list[jax.Array]:
  """Random arrays of the given avals: normal floats, small non-zero ints."""
  rng = np.random.default_rng(seed)
  out = []
  for aval in avals:
    dtype = jnp.dtype(aval.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
      value = rng.standard_normal(aval.shape) + 0.5
    elif jnp.issubdtype(dtype, jnp.integer):
      value = rng.integers(1, 8, aval.shape)
    else:
      value = rng.integers(0, 2, aval.shape).astype(bool)
    out.append(jnp.asarray(value, dtype))
  return out


def median_time(fn: Callable, args: Sequence[Any], *, warmup: int = 2, repeats: int = 7) -> float:
  """Median wall-clock seconds of ``fn(*args)`` (until ready) over ``repeats`` runs."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def wall_clock_measure(make_fn: Callable[[KernelConfig], Callable],
                       avals: Sequence[Any]) -> Measure:
  """The default ``Measure``: compile ``make_fn(config)`` once, then ``median_time``."""

  def measure(config: KernelConfig) -> float:
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    compiled = jax.jit(make_fn(config)).lower(*structs).compile()
    return median_time(compiled, random_inputs(avals, seed=len(str(config))))

  return measure


def tune(op: str, candidates: Sequence[KernelConfig], measure: Measure, *,
         progress_after_s: float = 1.0, stream=None) -> TuneResult:
  """Times every candidate (in a worker thread) and returns the fastest."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(_tune, op, candidates, measure, progress_after_s,
                       stream or sys.stderr).result()


def _tune(op, candidates, measure, progress_after_s, stream) -> TuneResult:
  start = time.perf_counter()
  timings, failures = [], []
  best: Optional[tuple[KernelConfig, float]] = None
  for i, config in enumerate(candidates):
    try:
      seconds = measure(config)
    except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
      failures.append((config, f"{type(err).__name__}: {err}".splitlines()[0][:300]))
    else:
      timings.append((config, seconds))
      if best is None or seconds < best[1]:
        best = (config, seconds)
    if time.perf_counter() - start > progress_after_s:
      so_far = f"best {best[1] * 1e6:.1f} us {best[0]}" if best else "no candidate ran yet"
      print(f"pallax autotune {op}: candidate {i + 1}/{len(candidates)}, {so_far}",
            file=stream, flush=True)
  if best is None:
    reasons = "; ".join(f"{c}: {r}" for c, r in failures)
    raise RuntimeError(f"pallax autotune {op}: no candidate ran ({reasons})")
  return TuneResult(best[0], best[1], tuple(timings), tuple(failures))
