"""Roofline numbers in a benchmark's ``extra_info``: ``pallax.roofline`` applied to its median.

And, on a GPU, to the device's own time a call (``record_kernel_throughput``).
"""

import tempfile
from pathlib import Path

import jax

from pallax import roofline


def record_throughput(benchmark, work: roofline.Work, dtype) -> None:
  """Adds ``flops``, ``bytes`` and the achieved rates and peak fractions of the median.

  Keys: ``flops`` (None for ops without matrix products), ``bytes``,
  ``tflop_per_s``, ``gbyte_per_s``, and on a device in ``pallax.roofline.PEAKS``
  ``peak_device``, ``fraction_of_peak_flops`` and ``fraction_of_peak_bandwidth``
  (``pallax.roofline.throughput``). Nothing but the counts under
  ``--benchmark-disable``.
  """
  info = benchmark.extra_info
  info.update(flops=work.flops, bytes=work.bytes)
  if benchmark.stats is None:  # --benchmark-disable
    return
  kind = jax.devices()[0].device_kind
  info.update(roofline.throughput(work, benchmark.stats.stats.median, kind, dtype))


def kernel_times(fn, args, calls: int = 20) -> dict[str, float]:
  """Seconds a call of ``fn(*args)`` spends in each GPU kernel, from a profiler trace.

  The mean over ``calls`` calls of each kernel's duration on the device's
  streams: what the device itself spends, without the host's dispatch and
  the wait for the result, which a wall-clock median of one call includes
  (about 170 us a call on an H200 with jax 0.11, more than a decode step's
  kernels). Empty off a GPU (not traced there).
  """
  if jax.devices()[0].platform != "gpu":
    return {}
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace:
    with jax.profiler.trace(trace):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    data = jax.profiler.ProfileData.from_file(str(next(Path(trace).rglob("*.xplane.pb"))))
  seconds: dict[str, float] = {}
  for plane in data.planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        if line.name.startswith("Stream"):
          for event in line.events:
            seconds[event.name] = seconds.get(event.name, 0.0) + event.duration_ns * 1e-9 / calls
  return seconds


def record_kernel_throughput(benchmark, fn, args, work: roofline.Work, dtype) -> None:
  """On a GPU, ``kernel_times``' total and its rates in ``extra_info``, prefixed ``kernel_``.

  Keys: ``kernel_us`` (the device's time a call), ``kernel_gbyte_per_s``,
  ``kernel_tflop_per_s`` and, on a device ``pallax.roofline`` knows,
  ``kernel_fraction_of_peak_bandwidth`` and ``kernel_fraction_of_peak_flops``.
  """
  seconds = sum(kernel_times(fn, args).values())
  if not seconds:
    return
  info = benchmark.extra_info
  info["kernel_us"] = seconds * 1e6
  kind = jax.devices()[0].device_kind
  rates = roofline.throughput(work, seconds, kind, dtype)
  info.update({f"kernel_{k}": v for k, v in rates.items() if k != "peak_device"})
