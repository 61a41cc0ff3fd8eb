"""``python -m pallax.bench``: run the benchmark suites, then write plots and a Markdown table.

The suites are the pytest-benchmark files of a source checkout's ``bench/``
directory (they are not in the wheel); each op's cases in them are named by
its family's ``kernels/<family>/tools.py`` (``pallax.family``). Per suite it writes the
pytest-benchmark JSON to ``--out``; then, per op, a PNG of the median time
against problem size, one line per implementation and dtype, one panel per
mode (``fwd``, ``fwd+bwd``, ``jvp``, ``hvp``); and ``summary.md``: every
case's median, achieved throughput and fraction of the device's peak
(``pallax.roofline``), and the peers that raised. Plots need matplotlib
(the ``bench`` extra).

  python -m pallax.bench --ops rms_norm,softmax,matmul --peers --out bench-results
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from pallax import family

__all__ = ["SUITES", "UNITS", "main", "markdown", "plot", "run_suites"]

# op -> (suite file in bench/, pytest -k expression selecting its cases): each op
# family's, from its ``kernels/<family>/tools.py`` (``pallax.family``).
SUITES = {op: (suite.file, suite.keyword) for op, suite in family.bench_suites().items()}
# What a case's ``shape`` multiplies out to, per op (default: the elements of x).
UNITS = {op: suite.unit for op, suite in family.bench_suites().items() if suite.unit}
MODES = ("fwd", "fwd+bwd", "jvp", "hvp")


def _bench_dir() -> Path:
  bench = Path(__file__).resolve().parents[1] / "bench"
  if not (bench / "conftest.py").is_file():
    raise SystemExit(
      "python -m pallax.bench runs the suites of a source checkout's bench/ directory, "
      f"which {bench} is not: clone the repository and install it with pip install -e '.[bench]'"
    )
  return bench


def run_suites(ops: Sequence[str], out: Path, *, peers: bool, extra: Sequence[str]) -> list[Path]:
  """Runs the suites of ``ops``, one pytest process per file; returns the JSON files written."""
  bench = _bench_dir()
  by_file: dict[str, list[str]] = defaultdict(list)
  for op in ops:
    file, keyword = SUITES[op]
    by_file[file].append(f"({keyword})")
  written = []
  for file, keywords in by_file.items():
    path = out / f"{Path(file).stem}.json"
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-q"]
    command += [str(bench / file), "-k", " or ".join(keywords), "--benchmark-json", str(path)]
    command += ["--peers"] * peers + list(extra)
    print(f"pallax.bench: {' '.join(command[3:])}", file=sys.stderr, flush=True)
    result = subprocess.run(command, cwd=bench.parent)
    if result.returncode != 0:
      raise SystemExit(f"pallax.bench: {file} failed (exit {result.returncode})")
    written.append(path)
  return written


def _rows(paths: Sequence[Path]) -> tuple[list[dict], list[dict]]:
  """The benchmarks' cases (from ``extra_info``) and the peers that raised."""
  rows, raised = [], []
  for path in paths:
    data = json.loads(path.read_text())
    raised += data.get("raised", [])
    for b in data["benchmarks"]:
      info = b["extra_info"]
      if "op" not in info:
        continue
      rows.append(dict(info, median_s=b["stats"]["median"], name=b["name"]))
  return rows, raised


def _size(row: dict) -> int:
  return math.prod(row["shape"])


def plot(rows: Sequence[dict], out: Path) -> list[Path]:
  """One PNG per op: median time against problem size; returns the files."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []
  for op in sorted({r["op"] for r in rows}):
    mine = [r for r in rows if r["op"] == op and "shape" in r]
    modes = [m for m in MODES if any(r["mode"] == m for r in mine)]
    fig, axes = plt.subplots(1, len(modes), figsize=(4.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
      lines = defaultdict(list)
      for r in mine:
        if r["mode"] == mode:
          label = " ".join(filter(None, (r["impl"], r.get("variant"), r["dtype"])))
          lines[label].append((_size(r), r["median_s"] * 1e3))
      for label, points in sorted(lines.items()):
        points.sort()
        style = "-" if label.startswith("pallax") else "--"
        ax.plot(*zip(*points), style, marker="o", label=label)
      ax.set_xscale("log")
      ax.set_yscale("log")
      unit = UNITS.get(op, "elements of x")
      ax.set_xlabel(f"problem size ({unit})")
      ax.set_ylabel("median time (ms)")
      ax.set_title(f"{op}: {mode}")
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / f"{op}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written


def _rate(row: dict) -> str:
  if row.get("tflop_per_s") is not None:
    return f"{row['tflop_per_s']:.3g} TFLOP/s"
  if row.get("gbyte_per_s") is not None:
    return f"{row['gbyte_per_s']:.3g} GB/s"
  return ""


def _fraction(row: dict) -> str:
  parts = []
  if "fraction_of_peak_flops" in row:
    parts.append(f"{100 * row['fraction_of_peak_flops']:.1f}% of FLOP/s")
  if "fraction_of_peak_bandwidth" in row:
    parts.append(f"{100 * row['fraction_of_peak_bandwidth']:.1f}% of bandwidth")
  return ", ".join(parts)


def _memory(row: dict) -> str:
  """XLA's allocation for the call (arguments, outputs, temporaries), and the measured peak.

  The measured figure: the device's peak on a GPU/TPU, the resident set's
  growth during one call on the CPU.
  """
  memory = row.get("memory")
  if not memory:
    return ""
  text = f"{memory['peak'] / 2**20:,.1f} MiB"
  if memory.get("device_peak") is not None:
    text += f" (device peak {memory['device_peak'] / 2**20:,.1f} MiB)"
  if memory.get("rss_growth") is not None:
    text += f" (RSS +{memory['rss_growth'] / 2**20:,.1f} MiB)"
  return text


def markdown(rows: Sequence[dict], raised: Sequence[dict]) -> str:
  """The summary table: per case and implementation, median, rate, of peak, ratio, memory."""
  lines = []
  key = lambda r: (r["op"], MODES.index(r["mode"]), r["dtype"], _size(r), r["impl"])
  cases = defaultdict(list)
  for r in sorted(rows, key=key):
    cases[(r["op"], r["mode"], r["dtype"], tuple(r["shape"]), r.get("variant"))].append(r)
  for op in sorted({r["op"] for r in rows}):
    lines += [f"## {op}", ""]
    lines += [
      "| mode | dtype | shape | variant | impl | median | throughput | of peak | vs pallax "
      "| memory |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|---|"]
    for (case_op, mode, dtype, shape, variant), impls in cases.items():
      if case_op != op:
        continue
      ours = next((r["median_s"] for r in impls if r["impl"] == "pallax"), None)
      for r in impls:
        ratio = f"{r['median_s'] / ours:.2f}x" if ours else ""
        lines.append(
          f"| {mode} | {dtype} | {'x'.join(map(str, shape))} | {variant or ''} | {r['impl']} | "
          f"{r['median_s'] * 1e3:.3g} ms | {_rate(r)} | {_fraction(r)} | {ratio} "
          f"| {_memory(r)} |"
        )
    lines.append("")
  if raised:
    lines += ["## Peers that raised", ""]
    lines += [f"- `{r['name']}`: {r['error']}" for r in raised]
    lines.append("")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m pallax.bench", description=__doc__.split("\n")[0]
  )
  parser.add_argument(
    "--ops", default=",".join(SUITES), help=f"comma-separated: {', '.join(SUITES)}"
  )
  parser.add_argument("--peers", action="store_true", help="also time the peers (bench extra)")
  parser.add_argument("--out", default="bench-results", help="directory for JSON, PNGs, summary")
  parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
  ns = parser.parse_args(argv)
  ops = [op.strip() for op in ns.ops.split(",") if op.strip()]
  unknown = sorted(set(ops) - set(SUITES))
  if unknown:
    parser.error(f"unknown ops {unknown}; choose from {', '.join(SUITES)}")
  out = Path(ns.out)
  out.mkdir(parents=True, exist_ok=True)
  rows, raised = _rows(run_suites(ops, out, peers=ns.peers, extra=ns.pytest_args))
  rows = [r for r in rows if r["op"] in ops]
  (out / "summary.md").write_text(markdown(rows, raised))
  pngs = plot(rows, out)
  print(f"pallax.bench: wrote {out / 'summary.md'} and {', '.join(p.name for p in pngs)}")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONUNBUFFERED", "1")
  sys.exit(main())
