"""Timing several implementations of one case in one process, for the device benches.

``bench/test_attention_hopper.py`` and ``bench/test_matmul_hopper.py`` call
``compare``: each implementation's first result is checked, pallax is timed
by the benchmark fixture and its alternatives (other kernels, cuDNN, cuBLAS)
the same way, and each one's rates and its ratio to the baseline go into
``extra_info``.

A sample dispatches a case's calls back to back and waits for the last
(``pallax.executor.autotune.back_to_back_time``, the autotuner's timing), as
a model's steps run: a call timed alone also holds the host's dispatch and
wait, about 170 us on an H200 (stop 39), 15% of a 1 ms attention forward,
which pulls every ratio towards 1. Every implementation of a case takes the
same count of calls a sample (about ``SAMPLE_S`` of the baseline's). The one-call times, the
measure of the sessions before, are kept beside them (``one_call_*``).
"""

import itertools
from collections.abc import Callable

import jax
import numpy as np

from pallax import roofline
from pallax.executor.autotune import back_to_back_time, calls_per_sample, median_time
from pallax.executor.executor import device_target
from pallax.executor.implementation import implementation
from pallax.pallas_mosaic_gpu import IMPLEMENTATION as MOSAIC_GPU

ROUNDS = 20  # timed samples per implementation, after one warm-up
SAMPLE_S = 0.02  # a sample's length, about: the baseline's calls back to back


def on_nvidia_gpu() -> bool:
  """Whether JAX's default device is an NVIDIA GPU (the device benches run only there)."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return False
  return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


def on_hopper_gpu() -> bool:
  """Whether the executor prefers the Mosaic GPU kernels on this device (an H100 or H200)."""
  return on_nvidia_gpu() and implementation(MOSAIC_GPU).prefers(device_target("cuda"))


def back_to_back(call, calls: int) -> Callable[[], None]:
  """``call`` waiting for every ``calls``-th result: ``calls`` of them time a sample.

  The benchmark fixture's rounds of ``calls`` iterations then time calls
  dispatched back to back, its statistics a call's seconds.
  """
  count = itertools.count(1)

  def target() -> None:
    out = call()
    if next(count) % calls == 0:
      jax.block_until_ready(out)

  return target


def record(
  info: dict, seconds: dict, work: roofline.Work, dtype, baseline: str, measure: str = ""
) -> str:
  """Each implementation's rates and its speed over ``baseline``'s in ``info``; a summary line.

  Keys per implementation ``i``: ``{i}_{measure}tflop_per_s``,
  ``{i}_{measure}fraction_of_peak_flops`` (None on a device ``pallax.roofline``
  does not know) and ``{i}_{measure}ratio_to_{baseline}`` (the baseline's time
  over ``i``'s: above 1 is faster); ``measure`` names how ``seconds`` were
  timed (``"one_call_"``; empty for the samples of calls back to back).
  """
  kind = jax.devices()[0].device_kind
  cells = []
  for impl, s in seconds.items():
    rates = roofline.throughput(work, s, kind, dtype)
    ratio = seconds[baseline] / s
    info[f"{impl}_{measure}tflop_per_s"] = rates["tflop_per_s"]
    info[f"{impl}_{measure}fraction_of_peak_flops"] = rates.get("fraction_of_peak_flops")
    info[f"{impl}_{measure}ratio_to_{baseline}"] = ratio
    cells.append(f"{impl} {rates['tflop_per_s']:.0f} TFLOP/s ({ratio:.2f}x {baseline})")
  return ", ".join(cells)


def rel_err(got, want) -> float:
  """Max absolute error over the largest absolute value of ``want``."""
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def compare(
  benchmark,
  request,
  calls: dict[str, Callable],
  error: Callable,
  tolerance: float,
  work: roofline.Work,
  dtype,
  baseline: str,
) -> None:
  """Checks and times ``calls`` (name -> a compiled call with its arguments bound).

  ``error(result)`` of each one's first result must stay below ``tolerance``
  (``{name}_max_rel_err``). ``calls["pallax"]`` is the benchmark; the others
  are timed by ``back_to_back_time`` with as many calls a sample
  (``calls_per_sample`` in ``extra_info``), and every one alone too
  (``one_call_*``). ``record`` adds the rates, and the terminal summary gets
  one line for the case.
  """
  info = benchmark.extra_info
  for name, call in calls.items():
    info[f"{name}_max_rel_err"] = err = error(call())
    assert err < tolerance, f"{name} is wrong: max rel err {err:.2e}"
  if not benchmark.enabled:  # --benchmark-disable, or under xdist: checked, not timed
    return
  info["calls_per_sample"] = n = calls_per_sample(calls[baseline], (), SAMPLE_S)
  seconds, one_call = {}, {}
  for name, call in calls.items():
    one_call[name] = median_time(call, (), warmup=1, repeats=ROUNDS)
    if name != "pallax":
      seconds[name] = back_to_back_time(call, (), repeats=ROUNDS, calls=n)
  benchmark.pedantic(back_to_back(calls["pallax"], n), rounds=ROUNDS, iterations=n, warmup_rounds=1)
  seconds["pallax"] = benchmark.stats.stats.median
  line = record(info, {name: seconds[name] for name in calls}, work, dtype, baseline)
  alone = record(info, one_call, work, dtype, baseline, measure="one_call_")
  request.node.user_properties.append(("summary", f"{benchmark.group}: {line}"))
  request.node.user_properties.append(("summary", f"{benchmark.group} (one call): {alone}"))
