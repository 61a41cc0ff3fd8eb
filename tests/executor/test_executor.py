"""The selection chain, the policies, the XLA program's place and the autotuner (fake timers)."""

from __future__ import annotations

import dataclasses
import io
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor import Executor, KernelConfig, KernelSpec, register_kernel
from pallax.executor import autotune as autotune_lib
from pallax.executor import executor as executor_lib
from pallax.executor.executor import cache_key


@dataclasses.dataclass(frozen=True)
class FakeConfig(KernelConfig):
  block: int


CANDIDATES = [FakeConfig(block=b) for b in (1, 2, 4, 8)] + [
  FakeConfig(block=1, implementation="xla")
]
SPEC = KernelSpec(
  "fake_op",
  FakeConfig,
  heuristic=lambda avals, target, **p: FakeConfig(block=2),
  candidates=lambda avals, target, **p: CANDIDATES,
  # block 8 "cannot run" this call: it must be skipped, visibly.
  supports=lambda avals, target, config, **p: "block 8 too big" if config.block == 8 else None,
)
register_kernel(SPEC)

AVALS = [jax.ShapeDtypeStruct((16, 32), jnp.float32)]
PARAMS = {"eps": 1e-6}


def _kernel_only_supports(avals, target, config, **p):
  assert config.implementation == "pallas", f"the kernel was asked about {config}"
  return None


# A kernel as it describes itself to the executor: its heuristic picks the
# kernel on every target, it lists no XLA candidate, and it is never asked
# about an XLA config.
KERNEL_ONLY = KernelSpec(
  "kernel_only_op",
  FakeConfig,
  heuristic=lambda avals, target, **p: FakeConfig(block=2),
  candidates=lambda avals, target, **p: [FakeConfig(block=b) for b in (1, 2, 4)],
  supports=_kernel_only_supports,
)
register_kernel(KERNEL_ONLY)
# The same kernel as kernel modules used to describe it: the XLA program by
# heuristic on CPU, and an XLA candidate of its own where XLA may run.
LEGACY = KernelSpec(
  "legacy_op",
  FakeConfig,
  heuristic=lambda avals, target, **p: FakeConfig(
    block=2, implementation="xla" if target == "cpu" else "pallas"
  ),
  candidates=lambda avals, target, **p: (
    [FakeConfig(block=b) for b in (1, 2, 4)]
    + ([] if target.startswith("interpret-") else [FakeConfig(block=1, implementation="xla")])
  ),
  supports=lambda avals, target, config, **p: None,
)
register_kernel(LEGACY)


def fake_timer(times, calls=None):
  def timer(config):
    if calls is not None:
      calls.append(config)
    if config not in times:
      raise RuntimeError(f"{config} failed to compile")
    return times[config]

  return timer


def _select(ex, **kw):
  return ex.select("fake_op", AVALS, "cpu", PARAMS, make_fn=lambda cfg: None, **kw)


def _write_disk(ex, config, key=None):
  key = key or cache_key(SPEC, AVALS, "cpu", PARAMS)
  ex.disk.store(
    jax.devices("cpu")[0].device_kind, "fake_op", SPEC.version, {key: {"config": config.to_dict()}}
  )


def test_chain_order(tmp_path, monkeypatch):
  kind = jax.devices("cpu")[0].device_kind
  key = cache_key(SPEC, AVALS, "cpu", PARAMS)
  monkeypatch.setattr(
    executor_lib,
    "shipped_defaults",
    lambda k, op, v: {key: {"config": FakeConfig(block=16).to_dict()}} if op == "fake_op" else {},
  )
  ex = Executor(cache_dir=tmp_path)
  assert (_select(ex).source, _select(ex).config.block) == ("default", 16)

  ex = Executor(cache_dir=tmp_path)
  _write_disk(ex, FakeConfig(block=32))
  assert (_select(ex).source, _select(ex).config.block) == ("disk", 32)
  # Now it is in memory.
  assert (_select(ex).source, _select(ex).config.block) == ("memory", 32)
  ex._memory[(kind, key)] = dataclasses.replace(_select(ex), config=FakeConfig(block=64))
  assert _select(ex).config.block == 64

  overlays = (("fake_op", FakeConfig(block=128)), ("other_op", FakeConfig(block=1)))
  chosen = _select(ex, overlays=overlays)
  assert (chosen.source, chosen.config.block) == ("overlay", 128)
  ex.override("fake_op", FakeConfig(block=256))
  assert (_select(ex, overlays=overlays).source, _select(ex).config.block) == ("pinned", 256)
  chosen = _select(ex, overlays=overlays, pinned=FakeConfig(block=512))
  assert (chosen.source, chosen.config.block) == ("pinned", 512)
  ex.override("fake_op", None)
  assert _select(ex).source == "memory"


def test_heuristic_policy_never_writes_disk(tmp_path):
  ex = Executor(cache_dir=tmp_path, timer=fake_timer({}))
  chosen = _select(ex)
  assert (chosen.source, chosen.config.block) == ("heuristic", 2)
  assert not list(tmp_path.rglob("*.json"))
  ex.override("fake_op", FakeConfig(block=4))
  _select(ex)
  assert not list(tmp_path.rglob("*.json")), "pinned configs are never stored"


def test_error_policy_raises_on_miss(tmp_path):
  ex = Executor(policy="error", cache_dir=tmp_path)
  with pytest.raises(LookupError, match="fake_op"):
    _select(ex)
  _write_disk(ex, FakeConfig(block=4))
  assert (
    Executor(policy="error", cache_dir=tmp_path)
    .select("fake_op", AVALS, "cpu", PARAMS)
    .config.block
    == 4
  )


def test_bad_policy():
  with pytest.raises(ValueError, match="policy"):
    Executor(policy="fastest")


def test_autotune_picks_fastest_and_skips_failures(tmp_path):
  times = {
    FakeConfig(block=1): 3.0,
    FakeConfig(block=2): 2.0,
    FakeConfig(block=4): 0.5,
    # block 8 is unsupported; the XLA candidate "fails to compile".
    FakeConfig(block=8): 0.1,
  }
  calls = []
  ex = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer(times, calls))
  chosen = _select(ex)
  assert (chosen.source, chosen.config) == ("autotune", FakeConfig(block=4))
  assert FakeConfig(block=8) not in calls  # never timed
  ((_, result),) = ex.tune_log
  reasons = dict(result.failures)
  assert "block 8 too big" in reasons[FakeConfig(block=8)]
  assert "failed to compile" in reasons[FakeConfig(block=1, implementation="xla")]
  assert len(result.timings) == 3
  # Stored: memory now, and disk for a fresh executor, which does not tune again.
  assert _select(ex).source == "memory"
  fresh = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer({}))
  assert (_select(fresh).source, _select(fresh).config.block) == ("disk", 4)
  assert fresh.tune_log == []


def test_autotune_with_every_candidate_failing(tmp_path):
  ex = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer({}))
  with pytest.raises(RuntimeError, match="no candidate ran"):
    _select(ex)


def test_dry_run_does_not_tune(tmp_path):
  ex = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer({}))
  assert _select(ex, dry_run=True).source == "heuristic"


def test_autotune_without_a_device_for_the_target_uses_heuristic(tmp_path):
  ex = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer({}))
  chosen = ex.select("fake_op", AVALS, "cuda", PARAMS, make_fn=lambda cfg: None)
  assert chosen.source == "heuristic" and "needs a cuda device" in chosen.note


def test_an_unsupported_cached_config_gives_way_to_the_heuristic_visibly(tmp_path):
  """A disk or shipped config this call cannot run (say, under XLA's determinism flags)."""
  ex = Executor(cache_dir=tmp_path)
  _write_disk(ex, FakeConfig(block=8))
  chosen = _select(ex)
  assert (chosen.source, chosen.config.block) == ("heuristic", 2)  # on a CPU, its XLA program
  assert "disk config" in chosen.note and "block 8 too big" in chosen.note
  with pytest.raises(ValueError, match="block 8 too big"):
    _select(ex, pinned=FakeConfig(block=8))
  # The error policy says why the cached config did not count.
  with pytest.raises(LookupError, match="block 8 too big"):
    Executor(policy="error", cache_dir=tmp_path).select("fake_op", AVALS, "cpu", PARAMS)
  # Under the interpret switch too: the heuristic's kernel, interpreted.
  ex2 = Executor(cache_dir=tmp_path)
  ex2.disk.store(
    jax.devices("cpu")[0].device_kind,
    "fake_op",
    SPEC.version,
    {cache_key(SPEC, AVALS, "interpret-triton", PARAMS): {"config": FakeConfig(block=8).to_dict()}},
  )
  assert ex2.select("fake_op", AVALS, "interpret-triton", PARAMS).config == FakeConfig(block=2)


# The heuristic's own config refused: the XLA program, visibly.
TOO_BIG = KernelSpec(
  "fake_too_big_op",
  FakeConfig,
  heuristic=lambda avals, target, **p: FakeConfig(block=8),
  candidates=lambda avals, target, **p: CANDIDATES,
  supports=SPEC.supports,
)
register_kernel(TOO_BIG)


def test_an_unsupported_heuristic_falls_back_to_xla_visibly():
  ex = Executor(cache_dir=False)
  chosen = ex.select("fake_too_big_op", AVALS, "cuda", PARAMS)
  assert chosen.implementation == "xla" and "block 8 too big" in chosen.note
  # Under the interpret switch the XLA program is no alternative: a clear error.
  with pytest.raises(NotImplementedError, match="block 8 too big"):
    ex.select("fake_too_big_op", AVALS, "interpret-triton", PARAMS)


def test_wrong_config_type():
  ex = Executor(cache_dir=False)
  with pytest.raises(TypeError, match="FakeConfig"):
    ex.override("fake_op", pallax.NormConfig(block_rows=8))
  with pytest.raises(TypeError, match="FakeConfig"):
    with ex.overlay({"fake_op": pallax.NormConfig(block_rows=8)}):
      pass


def test_progress_on_stderr_only_for_long_runs():
  timer = fake_timer({c: 1e-3 for c in CANDIDATES})
  quiet = io.StringIO()
  autotune_lib.tune("fake_op", CANDIDATES, autotune_lib.timer_benchmark(timer), stream=quiet)
  assert quiet.getvalue() == ""

  def slow(config):
    time.sleep(0.02)
    return timer(config)

  loud = io.StringIO()
  slow_benchmark = autotune_lib.timer_benchmark(slow)
  autotune_lib.tune("fake_op", CANDIDATES, slow_benchmark, progress_after_s=0.01, stream=loud)
  lines = loud.getvalue().splitlines()
  assert lines and all(line.startswith("pallax autotune fake_op: candidate") for line in lines)
  assert "5/5" in lines[-1] and "best" in lines[-1]


def test_back_to_back_time_is_a_calls_time_with_calls_waited_for_once(monkeypatch):
  """On a clock each call advances by 0.25 ms: 8 calls a 2-ms sample, timed exactly.

  A fake clock, not ``time.sleep``: a sleep overshooting on a loaded machine
  made the calibrating call look like a whole sample (one call a sample).
  """
  clock, waits, calls = [0.0], [], []
  monkeypatch.setattr(autotune_lib, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

  class Result:  # what block_until_ready waits for
    def block_until_ready(self):
      waits.append(len(calls))
      return self

  def call():
    calls.append(clock[0])
    clock[0] += 2.5e-4
    return Result()

  seconds = autotune_lib.back_to_back_time(call, (), repeats=3)
  assert seconds == pytest.approx(2.5e-4)  # a call's time, not a sample's
  samples = len(calls) - 2  # a warm-up call and the calibrating one
  assert samples == 3 * 8, "8 calls a sample of about 2 ms"
  assert waits[2:] == [2 + 8 * (i + 1) for i in range(3)], "one wait a sample"


def test_random_inputs_are_random_and_nonzero():
  avals = [jax.ShapeDtypeStruct((64, 8), jnp.bfloat16), jax.ShapeDtypeStruct((5,), jnp.int32)]
  a, b = autotune_lib.random_inputs(avals, seed=0)
  assert a.dtype == jnp.bfloat16 and b.dtype == jnp.int32
  assert float(jnp.std(a.astype(jnp.float32))) > 0.5 and bool(jnp.all(b != 0))


@pytest.mark.parametrize("op", ["kernel_only_op", "legacy_op"])
def test_heuristic_picks_the_xla_program_on_cpu_only(op):
  ex = Executor(cache_dir=False)
  on_cpu = ex.select(op, AVALS, "cpu", PARAMS)
  assert (on_cpu.source, on_cpu.config) == ("heuristic", FakeConfig(block=2, implementation="xla"))
  for target in ("cuda", "tpu", "interpret-triton"):
    assert ex.select(op, AVALS, target, PARAMS).config == FakeConfig(block=2), target


# The kernel's own XLA candidate if it lists one, else the heuristic's config made "xla".
@pytest.mark.parametrize("op, xla_block", [("kernel_only_op", 2), ("legacy_op", 1)])
def test_autotune_candidates_hold_the_xla_program_once_where_it_may_run(op, xla_block):
  calls = []

  def timer(config):
    calls.append(config)
    return 0.5 if config.implementation == "xla" else config.block

  ex = Executor(policy="autotune", cache_dir=False, timer=timer)
  chosen = ex.select(op, AVALS, "cpu", PARAMS, make_fn=lambda cfg: None)
  assert (chosen.source, chosen.implementation) == ("autotune", "xla")
  assert [c.block for c in calls if c.implementation == "pallas"] == [1, 2, 4]
  assert [c for c in calls if c.implementation == "xla"] == [
    FakeConfig(block=xla_block, implementation="xla")
  ]
  # Under the interpret switch the XLA program is no candidate.
  calls.clear()
  chosen = ex.select(op, AVALS, "interpret-triton", PARAMS, make_fn=lambda cfg: None)
  assert chosen.config == FakeConfig(block=1)
  assert calls == [FakeConfig(block=b) for b in (1, 2, 4)]


def test_xla_configs_are_accepted_without_asking_the_kernel(tmp_path):
  xla = FakeConfig(block=8, implementation="xla")
  ex = Executor(cache_dir=tmp_path)
  for target in ("cpu", "tpu", "interpret-mosaic_tpu"):
    chosen = ex.select("kernel_only_op", AVALS, target, PARAMS, pinned=xla)
    assert (chosen.source, chosen.config) == ("pinned", xla)
    overlays = (("kernel_only_op", xla),)
    chosen = ex.select("kernel_only_op", AVALS, target, PARAMS, overlays=overlays)
    assert (chosen.source, chosen.config) == ("overlay", xla)
  ex.override("kernel_only_op", xla)
  assert ex.select("kernel_only_op", AVALS, "tpu", PARAMS).config == xla
  ex.override("kernel_only_op", None)
  key = cache_key(KERNEL_ONLY, AVALS, "tpu", PARAMS)
  ex.disk.store("tpu (no device)", "kernel_only_op", 1, {key: {"config": xla.to_dict()}})
  chosen = Executor(cache_dir=tmp_path).select("kernel_only_op", AVALS, "tpu", PARAMS)
  assert (chosen.source, chosen.config, chosen.note) == ("disk", xla, "")


def test_wall_clock_tuning_compiles_everything_first_then_times_on_the_same_inputs(monkeypatch):
  events = []

  def make_fn(config):
    def fn(x):
      events.append(("compile", config))
      if config.block == 4:
        raise ValueError("block 4 does not tile")
      return x * config.block

    return fn

  def back_to_back_time(fn, args, calls):
    assert calls == counted, "every candidate timed with the first one's count of calls"
    events.append(("time", args))
    jax.block_until_ready(fn(*args))
    return 1e-3 * len(events)

  counted = 5
  monkeypatch.setattr(autotune_lib, "back_to_back_time", back_to_back_time)
  monkeypatch.setattr(autotune_lib, "calls_per_sample", lambda fn, args: counted)
  ex = Executor(policy="autotune", cache_dir=False)
  chosen = ex.select("kernel_only_op", AVALS, "cpu", PARAMS, make_fn=make_fn)
  ((_, result),) = ex.tune_log
  assert [kind for kind, _ in events] == ["compile"] * 4 + ["time"] * 3
  assert [config for config, _ in result.timings] == [
    FakeConfig(block=1),
    FakeConfig(block=2),
    FakeConfig(block=2, implementation="xla"),
  ]
  assert result.failures == ((FakeConfig(block=4), "ValueError: block 4 does not tile"),)
  assert chosen.config == FakeConfig(block=1)
  (first, *others) = [args for kind, args in events if kind == "time"]
  assert all(args is first for args in others), "every candidate gets the same arrays"
  (x,) = first
  assert x.shape == AVALS[0].shape and float(jnp.std(x)) > 0.5


def test_candidates_compile_concurrently_then_time_one_at_a_time():
  both_compiling = threading.Barrier(2, timeout=60)
  events, timing = [], []

  def compile_(config):
    if config.block == 8:
      raise RuntimeError("no such tiling")
    both_compiling.wait()  # passes only while the other candidate compiles too
    events.append(("compiled", config))
    return config

  def time_(config, inputs):
    timing.append(config)
    assert len(timing) == 1, "timings overlap"
    time.sleep(0.01)
    timing.pop()
    events.append(("timed", config, inputs))
    return float(config.block)

  inputs = object()
  benchmark = autotune_lib.Benchmark(compile=compile_, time=time_, inputs=lambda: inputs)
  candidates = [FakeConfig(block=b) for b in (2, 1, 8)]
  result = autotune_lib.tune("fake_op", candidates, benchmark, compile_threads=2)
  assert [e[0] for e in events] == ["compiled"] * 2 + ["timed"] * 2
  assert [e[1:] for e in events[2:]] == [
    (FakeConfig(block=2), inputs),
    (FakeConfig(block=1), inputs),
  ]
  assert result.best == FakeConfig(block=1)
  assert result.failures == ((FakeConfig(block=8), "RuntimeError: no such tiling"),)
