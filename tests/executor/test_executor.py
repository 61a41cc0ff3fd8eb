"""The selection chain, the policies and the autotuner, with a fake timer."""
from __future__ import annotations

import dataclasses
import io
import time
from typing import ClassVar

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
  positive_fields: ClassVar[tuple[str, ...]] = ("block",)


CANDIDATES = [FakeConfig(block=b) for b in (1, 2, 4, 8)] + [FakeConfig(block=1, implementation="xla")]
SPEC = KernelSpec(
    "fake_op", FakeConfig,
    heuristic=lambda avals, target, **p: FakeConfig(block=2),
    candidates=lambda avals, target, **p: CANDIDATES,
    # block 8 "cannot run" this call: it must be skipped, visibly.
    supports=lambda avals, target, config, **p: "block 8 too big" if config.block == 8 else None)
register_kernel(SPEC)
AVALS = [jax.ShapeDtypeStruct((16, 32), jnp.float32)]
PARAMS = {"eps": 1e-6}


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
  ex.disk.store(jax.devices("cpu")[0].device_kind, "fake_op", SPEC.version,
                {key: {"config": config.to_dict()}})


def test_chain_order(tmp_path, monkeypatch):
  kind = jax.devices("cpu")[0].device_kind
  key = cache_key(SPEC, AVALS, "cpu", PARAMS)
  monkeypatch.setattr(executor_lib, "shipped_defaults",
                      lambda k, op, v: {key: {"config": FakeConfig(block=16).to_dict()}}
                      if op == "fake_op" else {})
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
  assert Executor(policy="error", cache_dir=tmp_path).select(
      "fake_op", AVALS, "cpu", PARAMS).config.block == 4


def test_bad_policy():
  with pytest.raises(ValueError, match="policy"):
    Executor(policy="fastest")


def test_autotune_picks_fastest_and_skips_failures(tmp_path):
  times = {FakeConfig(block=1): 3.0, FakeConfig(block=2): 2.0, FakeConfig(block=4): 0.5,
           # block 8 is unsupported; the XLA candidate "fails to compile".
           FakeConfig(block=8): 0.1}
  calls = []
  ex = Executor(policy="autotune", cache_dir=tmp_path, timer=fake_timer(times, calls))
  chosen = _select(ex)
  assert (chosen.source, chosen.config) == ("autotune", FakeConfig(block=4))
  assert FakeConfig(block=8) not in calls  # never timed
  (_, result), = ex.tune_log
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


def test_unsupported_selection_falls_back_to_xla_visibly(tmp_path):
  ex = Executor(cache_dir=tmp_path)
  _write_disk(ex, FakeConfig(block=8))
  chosen = _select(ex)
  assert chosen.implementation == "xla" and "block 8 too big" in chosen.note
  with pytest.raises(ValueError, match="block 8 too big"):
    _select(ex, pinned=FakeConfig(block=8))
  # Under the interpret switch the XLA program is no alternative: a clear error.
  ex2 = Executor(cache_dir=tmp_path)
  ex2.disk.store(jax.devices("cpu")[0].device_kind, "fake_op", SPEC.version,
                 {cache_key(SPEC, AVALS, "interpret-triton", PARAMS):
                  {"config": FakeConfig(block=8).to_dict()}})
  with pytest.raises(NotImplementedError, match="block 8 too big"):
    ex2.select("fake_op", AVALS, "interpret-triton", PARAMS)


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
  autotune_lib.tune("fake_op", CANDIDATES, timer, stream=quiet)
  assert quiet.getvalue() == ""

  def slow(config):
    time.sleep(0.02)
    return timer(config)

  loud = io.StringIO()
  autotune_lib.tune("fake_op", CANDIDATES, slow, progress_after_s=0.01, stream=loud)
  lines = loud.getvalue().splitlines()
  assert lines and all(line.startswith("pallax autotune fake_op: candidate") for line in lines)
  assert "5/5" in lines[-1] and "best" in lines[-1]


def test_random_inputs_are_random_and_nonzero():
  avals = [jax.ShapeDtypeStruct((64, 8), jnp.bfloat16), jax.ShapeDtypeStruct((5,), jnp.int32)]
  a, b = autotune_lib.random_inputs(avals, seed=0)
  assert a.dtype == jnp.bfloat16 and b.dtype == jnp.int32
  assert float(jnp.std(a.astype(jnp.float32))) > 0.5 and bool(jnp.all(b != 0))
