"""The benches' fixture: a peer that raises is reported with its error, never skipped;
each case's memory; a case's own summary line; ``side_by_side.compare``'s
samples of calls back to back.

Runs pytest-benchmark on a small bench file next to copies of
``bench/conftest.py`` and the modules it imports, with a
``custom_vjp`` function (as tokamax's ops are) as the peer under ``jvp``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers import run_pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

CASES = """
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from modes import transformed


@jax.custom_vjp
def peer(x):
  return jnp.sin(x)


peer.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


@pytest.mark.parametrize("mode", ["fwd", "jvp"])
@pytest.mark.parametrize("impl", ["ours", "peer"])
def test_case(bench, impl, mode):
  fn = jnp.sin if impl == "ours" else peer
  f, args = transformed(fn, [jnp.ones(8)], mode, np.random.default_rng(0))
  bench(f, *args, rounds=2, peer=impl == "peer")


def test_memory(bench, request):
  # A 64 MiB output: one call raises the resident set by at least that much.
  bench(lambda x: jnp.cumsum(x, axis=0) * 2, jnp.ones((4096, 4096)), rounds=2)
  request.node.user_properties.append(("summary", "a line of the case's own"))


def test_ours_failing_is_a_failure(bench):
  bench(peer, jnp.ones(3), jnp.ones(3), rounds=2)  # two arguments for one: a TypeError


def test_side_by_side(benchmark, request):
  from side_by_side import compare

  from pallax import roofline

  x = jnp.ones((64, 64))
  ours = jax.jit(lambda x: x @ x).lower(x).compile()
  theirs = jax.jit(lambda x: jnp.dot(x, x, precision="highest")).lower(x).compile()
  calls = {"pallax": lambda: ours(x), "base": lambda: theirs(x)}
  error = lambda result: float(jnp.max(jnp.abs(result - 64.0)))
  work = roofline.Work(flops=2 * 64**3, bytes=3 * 64 * 64 * 4)
  compare(benchmark, request, calls, error, 1e-6, work, jnp.float32, "base")
"""


def test_a_raising_peer_is_reported_and_side_by_side_times_per_call(tmp_path):
  for name in ("conftest.py", "modes.py", "peak_memory.py", "side_by_side.py"):
    shutil.copy(BENCH / name, tmp_path / name)
  (tmp_path / "test_cases.py").write_text(CASES)
  args = ["-p", "no:xdist", "--benchmark-json", "out.json", "test_cases.py"]
  out = run_pytest(args, tmp_path, timeout=300)
  assert "1 failed, 6 passed" in out.stdout, out.stdout[-3000:]
  assert "a line of the case's own" in out.stdout
  assert "(one call): pallax " in out.stdout
  assert "raised: test_case[peer-jvp]: TypeError: can't apply forward-mode autodiff" in out.stdout
  data = json.loads((tmp_path / "out.json").read_text())
  timed = sorted(b["name"] for b in data["benchmarks"])
  assert timed == [
    "test_case[ours-fwd]",
    "test_case[ours-jvp]",
    "test_case[peer-fwd]",
    "test_memory",
    "test_side_by_side",
  ]
  (side,) = [b for b in data["benchmarks"] if b["name"] == "test_side_by_side"]
  info, n = side["extra_info"], side["extra_info"]["calls_per_sample"]
  # The fixture's rounds are samples of n calls, its statistics a call's seconds.
  assert 1 < n <= 64 and side["stats"]["iterations"] == n, side["stats"]
  assert side["stats"]["rounds"] == 20
  for prefix in ("", "one_call_"):
    assert info[f"base_{prefix}ratio_to_base"] == 1.0
    for impl in ("pallax", "base"):
      assert info[f"{impl}_{prefix}tflop_per_s"] > 0
  (memory,) = [b["extra_info"]["memory"] for b in data["benchmarks"] if b["name"] == "test_memory"]
  assert memory["outputs"] == 2**26 and memory["peak"] >= 2 * 2**26
  assert memory["rss_growth"] >= 2**26, memory  # the CPU: measured
  (raised,) = data["raised"]
  assert raised["name"] == "test_case[peer-jvp]"
  assert raised["error"].startswith("TypeError: can't apply forward-mode autodiff (jvp)")


def test_tokamax_peers_run():
  """One tokamax case of each peer suite runs with the test extra's tokamax, none skipped.

  On the CPU tokamax's ``custom_vjp`` attention raises under ``jvp``: reported.
  """
  selection = (
    "test_norm and 1024x1024-float32-fwd-layer_norm-tokamax"
    " or test_attention_modes and S512-float32-jvp-tokamax"
    " or test_linear_cross_entropy_modes and V4096-float32-fwd-tokamax"
  )
  files = [f"bench/test_{name}.py" for name in ("norm", "attention", "cross_entropy")]
  args = ["-n", "0", "-rs", "--peers", "--benchmark-disable", *files, "-k", selection]
  out = run_pytest(args, BENCH.parent, timeout=300)
  assert "3 passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-3000:]
  assert "raised: test_attention_modes[S512-float32-jvp-tokamax]: TypeError" in out.stdout
