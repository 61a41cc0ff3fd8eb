"""Roofline numbers in a benchmark's ``extra_info``: ``pallax.roofline`` applied to its median."""

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
