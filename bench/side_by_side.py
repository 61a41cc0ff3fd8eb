"""Timing several implementations of one case in one process, for the device benches.

``bench/test_attention_hopper.py`` and ``bench/test_matmul_hopper.py`` call
``compare``: each implementation's first result is checked, pallax is timed
by the benchmark fixture and its alternatives (other kernels, cuDNN, cuBLAS)
by ``median_s`` the same way, and each one's rates and its ratio to the
baseline go into ``extra_info``.
"""

import statistics
import time
from collections.abc import Callable

import jax
import numpy as np

from pallax import roofline
from pallax.executor.executor import device_target
from pallax.executor.implementation import implementation
from pallax.pallas_mosaic_gpu import IMPLEMENTATION as MOSAIC_GPU

ROUNDS = 20  # timed calls per implementation, after one warm-up call


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


def median_s(call) -> float:
  """The median seconds of ``ROUNDS`` calls of ``call`` after a warm-up, each waited for."""
  jax.block_until_ready(call())
  times = []
  for _ in range(ROUNDS):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def record(info: dict, seconds: dict, work: roofline.Work, dtype, baseline: str) -> str:
  """Each implementation's rates and its speed over ``baseline``'s in ``info``; a summary line.

  Keys per implementation ``i``: ``{i}_tflop_per_s``, ``{i}_fraction_of_peak_flops``
  (None on a device ``pallax.roofline`` does not know) and ``{i}_ratio_to_{baseline}``
  (the baseline's time over ``i``'s: above 1 is faster).
  """
  kind = jax.devices()[0].device_kind
  cells = []
  for impl, s in seconds.items():
    rates = roofline.throughput(work, s, kind, dtype)
    ratio = seconds[baseline] / s
    info[f"{impl}_tflop_per_s"] = rates["tflop_per_s"]
    info[f"{impl}_fraction_of_peak_flops"] = rates.get("fraction_of_peak_flops")
    info[f"{impl}_ratio_to_{baseline}"] = ratio
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
  are timed by ``median_s``. ``record`` adds the rates, and the terminal
  summary gets one line for the case.
  """
  info = benchmark.extra_info
  seconds = {}
  for name, call in calls.items():
    info[f"{name}_max_rel_err"] = err = error(call())
    assert err < tolerance, f"{name} is wrong: max rel err {err:.2e}"
    if name != "pallax":
      seconds[name] = median_s(call)
  pallax_call = calls["pallax"]
  benchmark.pedantic(lambda: jax.block_until_ready(pallax_call()), rounds=ROUNDS, warmup_rounds=1)
  seconds["pallax"] = benchmark.stats.stats.median
  line = record(info, {n: seconds[n] for n in calls}, work, dtype, baseline)
  request.node.user_properties.append(("summary", f"{benchmark.group}: {line}"))
