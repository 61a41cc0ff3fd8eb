"""python -m pallax.bench's report: the Markdown table and the plots, from benchmark JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pallax import bench
from tests.helpers import outside_xdist


def _benchmark(impl, mode, shape, median, **info):
  extra = dict(op="rms_norm", impl=impl, mode=mode, dtype="float32", shape=list(shape), **info)
  return {
    "name": f"test_norm[{impl}-{mode}-{shape}]",
    "stats": {"median": median},
    "extra_info": extra,
  }


def _results(tmp_path):
  data = {
    "benchmarks": [
      _benchmark(
        "pallax",
        "fwd",
        (1024, 1024),
        0.002,
        gbyte_per_s=4.2,
        memory={
          "arguments": 2**22,
          "outputs": 2**22,
          "temp": 2**20,
          "peak": 9 * 2**20,
          "rss_growth": 2**21,
        },
      ),
      _benchmark(
        "jnp",
        "fwd",
        (1024, 1024),
        0.003,
        gbyte_per_s=2.8,
        memory={"peak": 3 * 2**20, "device_peak": 5 * 2**20},
      ),
      _benchmark("pallax", "fwd", (4096, 1024), 0.008, gbyte_per_s=4.2),
      _benchmark("jnp", "fwd", (4096, 1024), 0.010, gbyte_per_s=3.3),
      _benchmark("pallax", "jvp", (1024, 1024), 0.004),
      _benchmark(
        "pallax",
        "fwd+bwd",
        (1024, 1024),
        0.001,
        gbyte_per_s=3000.0,
        fraction_of_peak_bandwidth=0.9,
      ),
      {"name": "no_info", "stats": {"median": 1.0}, "extra_info": {}},
    ],
    "raised": [{"name": "test_norm[tokamax-jvp]", "error": "TypeError: can't apply jvp"}],
  }
  path = tmp_path / "test_norm.json"
  path.write_text(json.dumps(data))
  return bench._rows([path])


def test_markdown_table(tmp_path):
  rows, raised = _results(tmp_path)
  assert len(rows) == 6  # the benchmark without case fields is left out
  text = bench.markdown(rows, raised)
  assert "## rms_norm" in text
  assert (
    "| fwd | float32 | 1024x1024 |  | pallax | 2 ms | 4.2 GB/s |  | 1.00x "
    "| 9.0 MiB (RSS +2.0 MiB) |" in text
  )
  assert (
    "| fwd | float32 | 1024x1024 |  | jnp | 3 ms | 2.8 GB/s |  | 1.50x "
    "| 3.0 MiB (device peak 5.0 MiB) |" in text
  )
  assert "| fwd | float32 | 4096x1024 |  | pallax | 8 ms | 4.2 GB/s |  | 1.00x |  |" in text
  assert (
    "| fwd+bwd | float32 | 1024x1024 |  | pallax | 1 ms | 3e+03 GB/s | 90.0% of bandwidth |" in text
  )
  lines = text.splitlines()
  assert lines.index(
    "| jvp | float32 | 1024x1024 |  | pallax | 4 ms |  |  | 1.00x |  |"
  ) > lines.index(
    "| fwd+bwd | float32 | 1024x1024 |  | pallax | 1 ms | 3e+03 GB/s | 90.0% of bandwidth "
    "| 1.00x |  |"
  )
  assert "## Peers that raised" in text
  assert "- `test_norm[tokamax-jvp]`: TypeError: can't apply jvp" in text


def test_plots(tmp_path):
  from PIL import Image  # matplotlib's dependency

  rows, _ = _results(tmp_path)
  (png,) = bench.plot(rows, tmp_path)
  assert png.name == "rms_norm.png"
  width, height = Image.open(png).size
  assert width > 3 * height  # three panels side by side: fwd, fwd+bwd, jvp


def test_unknown_op_is_refused(capsys):
  with pytest.raises(SystemExit):
    bench.main(["--ops", "rms_norm,nope", "--out", "unused"])
  assert "unknown ops ['nope']" in capsys.readouterr().err


# Collects each op's cases in one process (``pytest.main`` per op: JAX and the
# bench modules imported once), each op's output after an ``@@@ op`` line.
_COLLECT_EACH = """
import sys, pytest
for op, path, keyword in zip(*[iter(sys.argv[1:])] * 3):
  print("@@@", op, flush=True)
  code = pytest.main(["-p", "no:cacheprovider", "-q", "--collect-only", "-n", "0", path, "-k",
                      keyword, "--peers"])
  print("@@@ exit", int(code), flush=True)
"""


def test_every_suite_selects_cases():
  """Each op's ``-k`` expression selects cases of its suite (pytest --collect-only)."""
  bench_dir = Path(bench.__file__).resolve().parents[1] / "bench"
  args = [str(a) for op, (f, kw) in bench.SUITES.items() for a in (op, bench_dir / f, kw)]
  out = subprocess.run(
    [sys.executable, "-c", _COLLECT_EACH, *args],
    cwd=bench_dir.parent,
    env=outside_xdist(),
    capture_output=True,
    text=True,
    timeout=600,
  )
  blocks = out.stdout.split("@@@ ")[1:]
  assert len(blocks) == 2 * len(bench.SUITES), (out.stdout[-2000:], out.stderr[-2000:])
  for (op, (file, _)), block, end in zip(bench.SUITES.items(), blocks[::2], blocks[1::2]):
    cases = [line for line in block.splitlines() if "::" in line]
    assert block.startswith(op) and end.strip() == "exit 0" and cases, (op, block[-2000:])
    assert all(file in line for line in cases)
