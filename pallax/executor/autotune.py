"""Timing kernel candidates on this device.

One tuning call draws inputs of the call's avals once (random ones, never
the user's data, never zeros; or the kernel's own, ``ConfigSpace.inputs``),
compiles every candidate config in a thread pool (compiles dominate tuning
time, and XLA releases the GIL while it compiles), then times the compiled
candidates one at a time, so that timings never overlap, all on those same
inputs: the median of several samples after warm-up is a candidate's time,
each sample as many calls dispatched back to back as take about 2 ms
(``back_to_back_time``). Candidates that fail to compile or run are skipped and the
reason recorded. Tuning runs in a worker thread, so that it is outside any JAX
trace even when it is triggered from inside a lowering.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from pallax.executor.config import KernelConfig

# timer(config) -> seconds, raising for a candidate that cannot run.
Timer = Callable[[KernelConfig], float]


@dataclasses.dataclass(frozen=True)
class TuneResult:
  best: KernelConfig
  time_s: float
  timings: tuple[tuple[KernelConfig, float], ...]
  failures: tuple[tuple[KernelConfig, str], ...]


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """How ``tune`` times candidates.

  Attributes:
    compile: ``config -> compiled``, called for every candidate at once in a
      thread pool; raises for a candidate that cannot compile.
    time: ``(compiled, inputs) -> seconds``, called for one candidate at a
      time; raises for a candidate that cannot run.
    inputs: ``() -> inputs``, called once per tuning call, outside any trace:
      every candidate is timed on these.
  """

  compile: Callable[[KernelConfig], Any]
  time: Callable[[Any, Any], float]
  inputs: Callable[[], Any] = tuple


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


def median_time(
  fn: Callable, args: Sequence[Any], *, warmup: int = 2, repeats: int = 7, calls: int = 1
) -> float:
  """Median wall-clock seconds a call of ``fn(*args)`` takes, over ``repeats`` samples.

  Each sample dispatches ``calls`` calls back to back and waits for the last
  (a device runs them in order): the seconds of a sample over ``calls``.
  """
  if calls < 1:
    raise ValueError(f"median_time: calls must be at least 1, got {calls}")
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


# A sample of ``back_to_back_time``: about this long, at most this many calls.
_SAMPLE_S = 2e-3
_MOST_CALLS = 64


def back_to_back_time(
  fn: Callable, args: Sequence[Any], *, repeats: int = 7, calls: Optional[int] = None
) -> float:
  """``median_time`` of ``calls`` calls a sample, by default as many as take about 2 ms.

  A call timed alone includes the host's dispatch and the wait for its
  result: about 170 us a call on an H200, more than a decode step's
  kernels, which would hide the differences between their configs. Calls
  dispatched back to back overlap the host's work with the device's, as the
  steps of a model do, so a sample measures the device's time a call where
  the device is the bottleneck. ``calls``: None counts them from one call
  (at most 64); a tuning call counts once, for all its candidates alike.
  """
  jax.block_until_ready(fn(*args))  # warm up
  if calls is None:
    calls = calls_per_sample(fn, args)
  return median_time(fn, args, warmup=0, repeats=repeats, calls=calls)


def calls_per_sample(fn: Callable, args: Sequence[Any], sample_s: float = _SAMPLE_S) -> int:
  """How many calls of ``fn(*args)`` take about ``sample_s`` (at least 1, at most 64).

  Counted from one call's time.
  """
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - start
  return max(1, min(_MOST_CALLS, int(sample_s / max(once, 1e-9))))


def wall_clock_benchmark(
  make_fn: Callable[[KernelConfig], Callable],
  avals: Sequence[Any],
  *,
  seed: int = 0,
  inputs: Optional[Callable[[Sequence[Any], int], Sequence[Any]]] = None,
) -> Benchmark:
  """The default ``Benchmark``: ``make_fn(config)`` compiled for ``avals``, ``back_to_back_time``.

  Args:
    make_fn: ``config -> function of the operands`` running the kernel with that config.
    avals: the operands' avals.
    seed: seeds the inputs, drawn once per tuning call.
    inputs: ``(avals, seed) -> operands`` (the kernel's ``ConfigSpace.inputs``);
      default ``random_inputs``.
  """
  structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  counted: list[int] = []  # calls a sample: counted on the first candidate, for all

  def timed(fn, args):
    if not counted:
      jax.block_until_ready(fn(*args))  # warm up
      counted.append(calls_per_sample(fn, args))
    return back_to_back_time(fn, args, calls=counted[0])

  return Benchmark(
    compile=lambda config: jax.jit(make_fn(config)).lower(*structs).compile(),
    time=timed,
    inputs=lambda: _drawn(inputs or random_inputs, structs, seed),
  )


def _drawn(draw: Callable, structs: Sequence[jax.ShapeDtypeStruct], seed: int) -> list:
  """``draw(structs, seed)`` as arrays, checked against the operands' shapes and dtypes."""
  arrays = [jnp.asarray(x) for x in draw(structs, seed)]
  got = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
  if got != list(structs):
    describe = lambda xs: ", ".join(f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for x in xs)
    raise ValueError(
      f"autotuning inputs: the kernel's inputs gave ({describe(got)}) for its operands "
      f"({describe(structs)})"
    )
  return arrays


def timer_benchmark(timer: Timer) -> Benchmark:
  """A ``Benchmark`` whose ``timer(config)`` stands for compiling and timing (for tests)."""
  return Benchmark(compile=lambda config: config, time=lambda config, inputs: timer(config))


def tune(
  op: str,
  candidates: Sequence[KernelConfig],
  benchmark: Benchmark,
  *,
  progress_after_s: float = 1.0,
  stream: Optional[TextIO] = None,
  compile_threads: Optional[int] = None,
) -> TuneResult:
  """Times every candidate (in a worker thread) and returns the fastest.

  Args:
    op: the kernel's name, for messages.
    candidates: the configs to time.
    benchmark: how to compile and time them.
    progress_after_s: once tuning has taken this long, a progress line goes to
      ``stream`` after each compiled and each timed candidate.
    stream: where progress goes (default stderr).
    compile_threads: how many candidates compile at once (default: one per CPU).

  Raises:
    RuntimeError: no candidate compiled and ran.
  """
  with concurrent.futures.ThreadPoolExecutor(1) as worker:
    return worker.submit(
      _tune,
      op,
      candidates,
      benchmark,
      progress_after_s,
      stream or sys.stderr,
      compile_threads or os.cpu_count() or 1,
    ).result()


def _failure(err: Exception) -> str:
  return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _tune(op, candidates, benchmark, progress_after_s, stream, compile_threads) -> TuneResult:
  start = time.perf_counter()

  def progress(message: str) -> None:
    if time.perf_counter() - start > progress_after_s:
      print(f"pallax autotune {op}: {message}", file=stream, flush=True)

  inputs = benchmark.inputs()
  with concurrent.futures.ThreadPoolExecutor(compile_threads) as pool:
    futures = {pool.submit(benchmark.compile, config): config for config in candidates}
    for done, _ in enumerate(concurrent.futures.as_completed(futures), 1):
      progress(f"candidate {done}/{len(futures)} compiled")
  compiled, failures = [], []
  for future, config in futures.items():
    try:
      compiled.append((config, future.result()))
    except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
      failures.append((config, _failure(err)))

  timings = []
  best: Optional[tuple[KernelConfig, float]] = None
  for i, (config, executable) in enumerate(compiled):
    try:
      seconds = benchmark.time(executable, inputs)
    except Exception as err:  # noqa: BLE001 - any failure disqualifies the candidate
      failures.append((config, _failure(err)))
    else:
      timings.append((config, seconds))
      if best is None or seconds < best[1]:
        best = (config, seconds)
    so_far = f"best {best[1] * 1e6:.1f} us {best[0]}" if best else "no candidate ran yet"
    progress(f"candidate {i + 1}/{len(compiled)}, {so_far}")
  if best is None:
    reasons = "; ".join(f"{c}: {r}" for c, r in failures)
    raise RuntimeError(f"pallax autotune {op}: no candidate ran ({reasons})")
  return TuneResult(best[0], best[1], tuple(timings), tuple(failures))
