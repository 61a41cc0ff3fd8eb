"""The benches' peer reporting: a peer that raises is reported with its error, never skipped.

Runs pytest-benchmark on a small bench file next to copies of
``bench/conftest.py`` and ``bench/modes.py``, with a ``custom_vjp`` function
(as tokamax's ops are) as the peer under ``jvp``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_ours_failing_is_a_failure(bench):
  bench(peer, jnp.ones(3), jnp.ones(3), rounds=2)  # two arguments for one: a TypeError
"""


def test_a_raising_peer_is_reported(tmp_path):
  for name in ("conftest.py", "modes.py"):
    shutil.copy(BENCH / name, tmp_path / name)
  (tmp_path / "test_cases.py").write_text(CASES)
  # Not an xdist worker (pytest-benchmark would not time under one), whatever runs this test.
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-p",
      "no:cacheprovider",
      "-p",
      "no:xdist",
      "-q",
      "--benchmark-json",
      "out.json",
      "test_cases.py",
    ],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert "1 failed, 4 passed" in out.stdout, out.stdout[-3000:]
  assert "raised: test_case[peer-jvp]: TypeError: can't apply forward-mode autodiff" in out.stdout
  data = json.loads((tmp_path / "out.json").read_text())
  timed = sorted(b["name"] for b in data["benchmarks"])
  assert timed == ["test_case[ours-fwd]", "test_case[ours-jvp]", "test_case[peer-fwd]"]
  (raised,) = data["raised"]
  assert raised["name"] == "test_case[peer-jvp]"
  assert raised["error"].startswith("TypeError: can't apply forward-mode autodiff (jvp)")
