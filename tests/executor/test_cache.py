"""The persistent cache: corrupt files, other versions, no permission, concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from pallax.executor.cache import FORMAT, DiskCache, default_cache_dir, slug

KIND = "TPU v5 lite"


def _entry(i):
  return {f"key{i}": {"config": {"block_rows": i, "implementation": "pallas"}, "time_s": i * 1e-6}}


def test_round_trip_and_merge(tmp_path):
  cache = DiskCache(tmp_path)
  assert cache.store(KIND, "op", 1, _entry(1))
  assert cache.store(KIND, "op", 1, _entry(2))
  assert set(cache.load(KIND, "op", 1)) == {"key1", "key2"}
  assert cache.path(KIND, "op") == tmp_path / "tpu_v5_lite" / "op.json"
  data = json.loads(cache.path(KIND, "op").read_text())
  assert (data["format"], data["op"], data["op_version"]) == (FORMAT, "op", 1)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("PALLAX_CACHE_DIR", str(tmp_path))
  assert default_cache_dir() == tmp_path
  monkeypatch.delenv("PALLAX_CACHE_DIR")
  assert default_cache_dir().parts[-2:] == (".cache", "pallax")
  assert slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


@pytest.mark.parametrize(
  "text",
  [
    "{not json",
    '{"format": 1, "op": "op", "entr',
    "[]",
    '{"format": 1, "op": "other", "op_version": 1, "entries": {}}',
  ],
)
def test_corrupt_file_is_ignored_with_one_warning(tmp_path, text):
  cache = DiskCache(tmp_path)
  path = cache.path(KIND, "op")
  path.parent.mkdir(parents=True)
  path.write_text(text)
  with pytest.warns(RuntimeWarning, match="corrupt"):
    assert cache.load(KIND, "op", 1) == {}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert cache.load(KIND, "op", 1) == {}  # no second warning
  # Writing replaces the corrupt file.
  assert cache.store(KIND, "op", 1, _entry(3))
  assert set(cache.load(KIND, "op", 1)) == {"key3"}


@pytest.mark.parametrize(
  "header", [{"format": FORMAT + 1, "op_version": 1}, {"format": FORMAT, "op_version": 2}]
)
def test_other_version_is_ignored_with_a_warning(tmp_path, header):
  cache = DiskCache(tmp_path)
  path = cache.path(KIND, "op")
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps({**header, "op": "op", "entries": _entry(1)}))
  with pytest.warns(RuntimeWarning, match="version"):
    assert cache.load(KIND, "op", 1) == {}


def test_unwritable_dir_falls_back_to_memory(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  cache = DiskCache(blocker / "cache")
  with pytest.warns(RuntimeWarning, match="not writable"):
    assert not cache.store(KIND, "op", 1, _entry(1))
  assert not cache.writable
  assert not cache.store(KIND, "op", 1, _entry(2))  # silently memory-only from now on


def test_unwritable_dir_keeps_tuned_config_in_memory(tmp_path):
  from pallax.executor import Executor
  from tests.executor.test_executor import AVALS, PARAMS, FakeConfig, fake_timer

  blocker = tmp_path / "file"
  blocker.write_text("x")
  ex = Executor(
    policy="autotune",
    cache_dir=blocker / "cache",
    timer=fake_timer({FakeConfig(block=2): 1.0, FakeConfig(block=4): 0.5}),
  )
  with pytest.warns(RuntimeWarning, match="not writable"):
    chosen = ex.select("fake_op", AVALS, "cpu", PARAMS, make_fn=lambda c: None)
  assert chosen.config.block == 4
  assert ex.select("fake_op", AVALS, "cpu", PARAMS).source == "memory"


_WRITER = """
import sys
from pallax.executor.cache import DiskCache
i = int(sys.argv[2])
cache = DiskCache(sys.argv[1])
for j in range(25):  # many writes per process, so that they overlap
  assert cache.store("TPU v5 lite", "op", 1, {f"key{i}_{j}": {"config": {"block_rows": j + 1}}})
"""


def test_eight_processes_writing_at_once(tmp_path):
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _WRITER, str(tmp_path), str(i)],
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    for i in range(8)
  ]
  assert [p.wait(timeout=120) for p in procs] == [0] * 8
  entries = DiskCache(tmp_path).load(KIND, "op", 1)
  assert set(entries) == {f"key{i}_{j}" for i in range(8) for j in range(25)}
  assert not [p for p in (tmp_path / "tpu_v5_lite").iterdir() if p.suffix == ".tmp"]
