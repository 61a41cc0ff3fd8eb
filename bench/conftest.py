"""Benchmark helpers: jitted callables that block until their result is ready, the
forward+backward loss every bench uses, ``--peers``, and the report of peers that
raise.

``--peers`` adds the peers' cases (what a user would otherwise call: tokamax's
ops, from the ``bench`` extra), the ones marked ``peer``; without it they are
deselected. A peer that raises where pallax works (tokamax's
``custom_vjp`` ops under ``jvp``) is not a skip: the test passes, the terminal
summary lists it, and ``--benchmark-json`` writes it under ``"raised"``. A
case adds its own line to the terminal summary as a ``("summary", line)``
user property (``request.node.user_properties``).
"""

import os
import time

# 8 CPU devices, for the sharded benches (bench/test_attention_context.py),
# set before jax starts; other benches run on the first device as before.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from modes import fwd_bwd as make_fwd_bwd  # noqa: E402
from modes import transformed as make_transformed  # noqa: E402
from peak_memory import host_call_growth  # noqa: E402

RAISED = []  # {"name", "group", "error"} of each peer call that raised
SUMMARY = []  # the ("summary", line) user properties of the cases, for the terminal
ROUND_BUDGET_S = 1.5
SLOW_S = 0.25


def pytest_addoption(parser):
  parser.addoption(
    "--peers", action="store_true", help="also time the peers (tokamax: the bench extra)"
  )


def pytest_configure(config):
  config.addinivalue_line("markers", "peer: a peer's case, run with --peers")
  config.addinivalue_line("markers", "nvidia_gpu: a device bench, collected on an NVIDIA GPU only")
  config.addinivalue_line("markers", "hopper_gpu: a device bench, collected on a Hopper GPU only")


def _deselect(config, items, marker: str) -> None:
  """Drops the items marked ``marker``, reported as deselected."""
  gone = [item for item in items if item.get_closest_marker(marker)]
  if gone:
    config.hook.pytest_deselected(items=gone)
    items[:] = [item for item in items if not item.get_closest_marker(marker)]


def pytest_collection_modifyitems(config, items):
  """Deselects the device benches off their GPUs, and the peers' cases without ``--peers``."""
  from side_by_side import on_hopper_gpu, on_nvidia_gpu

  if not on_nvidia_gpu():
    _deselect(config, items, "nvidia_gpu")
  if not on_hopper_gpu():
    _deselect(config, items, "hopper_gpu")
  if not config.getoption("--peers"):
    _deselect(config, items, "peer")


def pytest_runtest_setup(item):
  """A tokamax case (parameter ``impl="tokamax"``) needs the ``bench`` extra."""
  if getattr(item, "callspec", None) and item.callspec.params.get("impl") == "tokamax":
    pytest.importorskip("tokamax", reason="install the bench extra: pip install -e '.[bench]'")


def pytest_benchmark_update_json(config, benchmarks, output_json):
  output_json["raised"] = list(RAISED)


def pytest_runtest_logreport(report):
  if report.when == "call":
    SUMMARY.extend(line for key, line in report.user_properties if key == "summary")


def pytest_terminal_summary(terminalreporter):
  for r in RAISED:
    terminalreporter.write_line(f"raised: {r['name']}: {r['error']}")
  for line in SUMMARY:
    terminalreporter.write_line(line)


def ready(fn):
  """``fn`` jitted, warmed up, and blocking, for pytest-benchmark to time."""
  jitted = jax.jit(fn)

  def call(*args):
    return jax.block_until_ready(jitted(*args))

  call.jitted = jitted
  return call


def memory_info(call, args) -> dict:
  """The memory of one call, for ``extra_info["memory"]`` (bytes).

  ``arguments``, ``outputs``, ``temp``: XLA's buffer assignment of the
  compiled call (``memory_analysis``), what a GPU or TPU allocates for it;
  ``peak`` is their sum. On the CPU also ``rss_growth``: how far one more
  call raised the resident set over its level before the call, with the
  high-water mark reset (``peak_memory.host_call_growth``; the attention,
  paged-attention and cross-entropy benches also measure a fresh process).
  On a GPU or TPU ``device_peak`` is added by the fixture.
  """
  analysis = call.jitted.lower(*args).compile().memory_analysis()
  info = {
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "temp": analysis.temp_size_in_bytes,
  }
  info["peak"] = sum(info.values())
  if jax.devices()[0].platform == "cpu":
    info["rss_growth"] = host_call_growth(call, args)
  return info


def _device_stats():
  device = jax.devices()[0]
  return device.memory_stats() if device.platform != "cpu" else None


@pytest.fixture
def bench(benchmark, request):
  """``bench(fn, *args, rounds=30, peer=False)``: times the jitted ``fn`` after two warm-up calls.

  Rounds: ``rounds``, fewer for slow calls (about ``ROUND_BUDGET_S`` seconds
  of timed calls; at least 3, or 2 for calls over ``SLOW_S``).

  With ``peer=True`` an error of the first call is recorded (``RAISED``) and
  the case is not timed; pallax's errors always fail the test. A timed case
  records its memory (``memory_info``) in ``extra_info["memory"]``. Returns
  whether it was timed. ``bench.transformed(fn, args, mode, rng, peer=False)``
  is ``modes.transformed``, where a peer's error while it traces ``fn`` (for
  the cotangents' shapes) is reported the same way and gives None.
  """

  def report_raised(err):
    message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    RAISED.append({"name": request.node.name, "group": benchmark.group, "error": message})
    benchmark.extra_info["raised"] = message

  def run(fn, *args, rounds=30, peer=False):
    call = ready(fn)
    before = _device_stats()
    try:
      call(*args)
    except Exception as err:  # noqa: BLE001 -- a peer's failure is a result to report
      if not peer:
        raise
      report_raised(err)
      return False
    start = time.perf_counter()
    call(*args)
    seconds = time.perf_counter() - start
    # About ROUND_BUDGET_S of timed calls: at least 3 rounds after one more warm-up
    # call, or 2 rounds straight away for calls slower than SLOW_S (already warm).
    slow = seconds > SLOW_S
    rounds = max(2 if slow else 3, min(rounds, int(ROUND_BUDGET_S / seconds)))
    benchmark.pedantic(call, args=args, rounds=rounds, iterations=1, warmup_rounds=0 if slow else 1)
    memory = memory_info(call, args)
    after = _device_stats()
    if after is not None:
      rose = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
      memory["device_peak"] = after["peak_bytes_in_use"] - before["bytes_in_use"] if rose else None
    benchmark.extra_info["memory"] = memory
    return True

  def transformed(fn, args, mode, rng, peer=False):
    try:
      return make_transformed(fn, args, mode, rng)
    except Exception as err:  # noqa: BLE001 -- a peer's failure is a result to report
      if not peer:
        raise
      report_raised(err)
      return None

  run.transformed = transformed
  return run


@pytest.fixture
def fwd_bwd():
  """``fwd_bwd(fn, n)``: ``value_and_grad`` of ``sum(out * c)`` over ``fn``'s outputs.

  The result takes ``fn``'s ``n`` inputs, then one cotangent ``c`` per output.
  Random cotangents passed as arguments keep either side from folding its
  backward into a constant.
  """
  return make_fwd_bwd
