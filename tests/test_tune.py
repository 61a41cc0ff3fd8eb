"""pallax.tune: tuning a function's kernels, the cache a fresh process reads, export and import.

On the CPU the XLA program is the only candidate (interpreted kernels are
timed only under the interpret switch): real timings, small shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor import Executor
from pallax.executor.cache import slug
from pallax.tune import export_configs, import_configs, parse_shape, this_device_kind, tune
from tests.tune_model import ARGS, two_layer

ROOT = Path(__file__).resolve().parents[1]
STRUCTS = [parse_shape(a) for a in ARGS]
FORWARD_OPS = ["rms_norm_fwd", "matmul", "matmul", "softmax_fwd"]


def _run(code_or_args: list[str], cache: Path) -> str:
  env = dict(os.environ, PALLAX_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu", PALLAX_INTERPRET="0")
  out = subprocess.run(
    [sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_cli_tunes_and_a_fresh_process_reads_the_cache(tmp_path):
  """``python -m pallax.tune`` writes the cache; another process's explain finds it on disk."""
  cache = tmp_path / "cache"
  out = _run(["-m", "pallax.tune", "tests.tune_model:two_layer", "--args", *ARGS, "--grad"], cache)
  assert "autotune" in out
  files = {p.name for p in (cache / slug(this_device_kind())).glob("*.json")}
  assert {"rms_norm_fwd.json", "rms_norm_bwd.json", "matmul.json", "softmax_fwd.json"} <= files
  probe = (
    "import jax, pallax\n"
    "from pallax.tune import parse_shape\n"
    "from tests.tune_model import ARGS, two_layer\n"
    "structs = [parse_shape(a) for a in ARGS]\n"
    "loss = lambda *a: two_layer(*a).sum()\n"
    "for s in [*pallax.explain(two_layer, *structs), *pallax.explain(jax.grad(loss), *structs)]:\n"
    "  print(s.op, s.source)\n"
  )
  rows = [line.split() for line in _run(["-c", probe], cache).splitlines()]
  assert rows[:4] == [[op, "disk"] for op in FORWARD_OPS]
  assert {"rms_norm_bwd", "softmax_bwd"} <= {op for op, _ in rows[4:]}
  # Later calls of an op already read find it in memory: nothing falls back to the heuristic.
  assert {source for _, source in rows} == {"disk", "memory"}, rows


def test_export_import_round_trip(tmp_path):
  tuned, other, defaults = tmp_path / "tuned", tmp_path / "other", tmp_path / "defaults"
  report = tune(two_layer, *STRUCTS, executor=Executor(cache_dir=tuned))
  assert [s.op for s in report] == FORWARD_OPS
  assert {s.source for s in report} == {"autotune"}
  bundle = tmp_path / "tuned.json"
  assert export_configs(bundle, cache_dir=tuned) == 4
  assert json.loads(bundle.read_text())["device_kind"] == slug(this_device_kind())
  assert import_configs(bundle, into=other) == 4
  kind = slug(this_device_kind())
  for name in ("rms_norm_fwd.json", "matmul.json", "softmax_fwd.json"):
    want = json.loads((tuned / kind / name).read_text())
    assert json.loads((other / kind / name).read_text()) == want
  # A shipped-defaults directory takes the same files, without lock files.
  assert import_configs(bundle, into=defaults) == 4
  assert sorted(p.name for p in (defaults / kind).iterdir()) == sorted(
    ["matmul.json", "rms_norm_fwd.json", "softmax_fwd.json"]
  )
  # The imported cache serves a fresh executor without tuning.
  with Executor(cache_dir=other, policy="error"):
    assert {s.source for s in pallax.explain(two_layer, *STRUCTS)} == {"disk"}


def test_import_refuses_another_device_kind_and_bad_files(tmp_path):
  bundle = tmp_path / "tuned.json"
  export_configs(bundle, cache_dir=tmp_path / "empty")
  with pytest.raises(ValueError, match="tuned on"):
    import_configs(bundle, into=tmp_path / "c", device_kind="NVIDIA H100 80GB HBM3")
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match="not JSON"):
    import_configs(tmp_path / "bad.json", into=tmp_path / "c")
  (tmp_path / "other.json").write_text(json.dumps({"entries": {}}))
  with pytest.raises(ValueError, match="--export"):
    import_configs(tmp_path / "other.json", into=tmp_path / "c")


def test_import_skips_other_op_versions(tmp_path):
  kind = slug(this_device_kind())
  bundle = {
    "format": 1,
    "kind": "pallax-tuned-configs",
    "device_kind": kind,
    "ops": {"softmax_fwd": {"op_version": 999, "entries": {"k": {"config": {}}}}},
  }
  path = tmp_path / "old.json"
  path.write_text(json.dumps(bundle))
  said = []
  assert import_configs(path, into=tmp_path / "c", log=said.append) == 0
  assert "skipping softmax_fwd" in said[0]


def test_tune_refuses_the_interpret_switch():
  with pallax.interpret(), pytest.raises(ValueError, match="interpret"):
    tune(two_layer, *STRUCTS)


def test_parse_shape():
  assert parse_shape("f32[8,1024]") == jax.ShapeDtypeStruct((8, 1024), jnp.float32)
  assert parse_shape("bfloat16[ 4 ]") == jax.ShapeDtypeStruct((4,), jnp.bfloat16)
  assert parse_shape("i32[]") == jax.ShapeDtypeStruct((), jnp.int32)
  for bad in ("f32(8)", "nope[3]", "f32[a]"):
    with pytest.raises(ValueError, match="pallax.tune"):
      parse_shape(bad)


def _recording_timer(timed: list):
  def timer(config):
    timed.append(config)
    return 1e-3 if config.implementation == "xla" else 1e-6  # a kernel would win if timed

  return timer


def test_cpu_autotuning_never_times_interpreted_kernels():
  """Outside the interpret switch, a kernel that would run interpreted is not a candidate."""
  timed = []
  ex = Executor(policy="autotune", cache_dir=False, timer=_recording_timer(timed))
  x = jnp.ones((64, 128), jnp.float32)
  with ex:
    pallax.softmax(x).block_until_ready()
  assert timed and {c.implementation for c in timed} == {"xla"}, timed
  chosen, result = ex.tune_log[-1]
  assert chosen.config.implementation == "xla"
  assert result.failures and all("not timed" in why for _, why in result.failures)


def test_interpret_switch_times_the_interpreted_kernels():
  timed = []
  ex = Executor(policy="autotune", cache_dir=False, timer=_recording_timer(timed))
  x = jnp.ones((64, 128), jnp.float32)
  with ex, pallax.interpret():
    pallax.softmax(x).block_until_ready()
  assert timed and {c.implementation for c in timed} == {"pallas"}, timed


def test_tune_times_each_kernel_call_once_per_run():
  """The backward's recomputed forward calls are not tuned a second time."""
  timed = []
  ex = Executor(cache_dir=False, timer=_recording_timer(timed))
  report = tune(two_layer, *STRUCTS, grad=True, executor=ex)
  keys = [s.key for s in report]
  assert len(keys) == len(set(keys)), keys
  assert [s.key for s, _ in ex.tune_log] == keys
  assert {"rms_norm_bwd", "softmax_bwd"} <= {s.op for s in report}
