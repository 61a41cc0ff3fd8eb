"""Benchmark helpers: jitted callables that block until their result is ready, the
forward+backward loss every bench uses, ``--peers``, and the report of peers that
raise.

``--peers`` adds the peers' cases (what a user would otherwise call: tokamax's
ops, from the ``bench`` extra), the ones marked ``peer``; without it they are
deselected. A peer that raises where pallax works (tokamax's
``custom_vjp`` ops under ``jvp``) is not a skip: the test passes, the terminal
summary lists it, and ``--benchmark-json`` writes it under ``"raised"``.
"""

import time

import jax
import pytest
from modes import fwd_bwd as make_fwd_bwd

RAISED = []  # {"name", "group", "error"} of each peer call that raised
ROUND_BUDGET_S = 1.5
SLOW_S = 0.25


def pytest_addoption(parser):
  parser.addoption(
    "--peers", action="store_true", help="also time the peers (tokamax: the bench extra)"
  )


def pytest_configure(config):
  config.addinivalue_line("markers", "peer: a peer's case, run with --peers")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--peers"):
    return
  peers = [item for item in items if item.get_closest_marker("peer")]
  if peers:
    config.hook.pytest_deselected(items=peers)
    items[:] = [item for item in items if not item.get_closest_marker("peer")]


def pytest_benchmark_update_json(config, benchmarks, output_json):
  output_json["raised"] = list(RAISED)


def pytest_terminal_summary(terminalreporter):
  for r in RAISED:
    terminalreporter.write_line(f"raised: {r['name']}: {r['error']}")


def ready(fn):
  """``fn`` jitted, warmed up, and blocking, for pytest-benchmark to time."""
  jitted = jax.jit(fn)

  def call(*args):
    return jax.block_until_ready(jitted(*args))

  call.jitted = jitted
  return call


def memory_info(jitted, args) -> dict:
  """The memory of one call, for ``extra_info["memory"]`` (bytes).

  ``arguments``, ``outputs``, ``temp``: XLA's buffer assignment of the
  compiled call (``memory_analysis``), what a GPU or TPU allocates for it;
  ``peak`` is their sum. On a GPU or TPU also ``device_peak``: the device's
  ``peak_bytes_in_use`` less the bytes in use before the case, where the case
  raised the process's peak (else None: an earlier case's peak hides it).
  On the CPU, ``bench/peak_memory.py`` measures peak RSS in a fresh process
  (the cross-entropy bench).
  """
  analysis = jitted.lower(*args).compile().memory_analysis()
  info = {
    "arguments": analysis.argument_size_in_bytes,
    "outputs": analysis.output_size_in_bytes,
    "temp": analysis.temp_size_in_bytes,
  }
  info["peak"] = sum(info.values())
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
  whether it was timed.
  """

  def run(fn, *args, rounds=30, peer=False):
    call = ready(fn)
    before = _device_stats()
    try:
      call(*args)
    except Exception as err:  # noqa: BLE001 -- a peer's failure is a result to report
      if not peer:
        raise
      message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
      RAISED.append({"name": request.node.name, "group": benchmark.group, "error": message})
      benchmark.extra_info["raised"] = message
      return False
    start = time.perf_counter()
    call(*args)
    seconds = time.perf_counter() - start
    # About ROUND_BUDGET_S of timed calls: at least 3 rounds after one more warm-up
    # call, or 2 rounds straight away for calls slower than SLOW_S (already warm).
    slow = seconds > SLOW_S
    rounds = max(2 if slow else 3, min(rounds, int(ROUND_BUDGET_S / seconds)))
    benchmark.pedantic(call, args=args, rounds=rounds, iterations=1, warmup_rounds=0 if slow else 1)
    memory = memory_info(call.jitted, args)
    after = _device_stats()
    if after is not None:
      rose = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
      memory["device_peak"] = after["peak_bytes_in_use"] - before["bytes_in_use"] if rose else None
    benchmark.extra_info["memory"] = memory
    return True

  return run


@pytest.fixture
def fwd_bwd():
  """``fwd_bwd(fn, n)``: ``value_and_grad`` of ``sum(out * c)`` over ``fn``'s outputs.

  The result takes ``fn``'s ``n`` inputs, then one cotangent ``c`` per output.
  Random cotangents passed as arguments keep either side from folding its
  backward into a constant.
  """
  return make_fwd_bwd
