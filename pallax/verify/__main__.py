"""``python -m pallax.verify``: compile every kernel for H100, A100, TPU v5e and v6e here.

Prints a table per kernel and target (configs compiled, spills, failures,
largest register count, shared memory and scoped VMEM, compile time), then
every failure; exits 1 if any compile failed, spilled, timed out or crashed,
2 if a target cannot be compiled for here (a missing package) or an argument
is wrong. ``--write-facts`` records the spills and memory overflows as the
shipped verdicts of ``pallax.executor.facts`` (``verdicts.py``) instead of
failing on them.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
from collections.abc import Sequence
from typing import Optional

import jax

from pallax.executor import facts
from pallax.executor.cache import defaults_dir
from pallax.verify import TARGETS, verify
from pallax.verify.pool import cpu_count
from pallax.verify.sweep import OPS, import_modules
from pallax.verify.verdicts import write_facts


def _names(text: str) -> list[str]:
  return [name for name in text.split(",") if name]


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Parses ``argv``, runs the compiles, prints the report; returns the exit status."""
  parser = argparse.ArgumentParser(
    prog="python -m pallax.verify",
    description="Compile every pallax kernel (forward, backward, tangent) with every config "
    "the executor can choose, for GPUs and TPUs, without the hardware.",
  )
  parser.add_argument(
    "--module",
    action="append",
    default=[],
    help="import this module first (repeatable): it registers its own ops "
    "(pallax.verify.register_op), e.g. examples.swiglu",
  )
  parser.add_argument(
    "--ops", type=_names, help=f"comma-separated, of: {', '.join(OPS)} and the modules' ops"
  )
  parser.add_argument(
    "--targets", type=_names, help=f"comma-separated, of: {', '.join(TARGETS)} (default: all)"
  )
  parser.add_argument("--quick", action="store_true", help="two sizes per op")
  parser.add_argument(
    "--exhaustive",
    action="store_true",
    help="the autotuning candidates at every size and dtype, not only at each op's first size "
    "in float32 (about an hour on 2 cores)",
  )
  parser.add_argument(
    "--heuristic-only", action="store_true", help="only the heuristic's configs, no candidates"
  )
  parser.add_argument(
    "--workers",
    type=int,
    default=min(2, cpu_count()),
    help="compile processes (default: 2, or 1 on one core)",
  )
  parser.add_argument(
    "--implementation",
    action="append",
    choices=("pallas", "triton_raw", "pallas_mosaic_gpu"),
    help="only the configs of this kernel implementation (repeatable; default: all)",
  )
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds per compile")
  parser.add_argument("--no-cache", action="store_true", help="recompile cached results")
  parser.add_argument("--json", type=pathlib.Path, help="write every result to this file")
  parser.add_argument(
    "--write-facts",
    nargs="?",
    const=defaults_dir(),
    type=pathlib.Path,
    metavar="DIR",
    help="compile the configs the shipped verdicts leave out too, and merge this run's "
    "verdicts (spills, memory overflows) into DIR/<device>/<kernel>.json (default: the "
    "package's pallax/executor/defaults); exits 0 when every failure became a verdict",
  )
  args = parser.parse_args(argv)
  try:
    import_modules(args.module)
  except ImportError as err:
    parser.error(f"--module: {err}")
  # This process only traces (workers compile): the CPU spares it initialising GPU plugins.
  jax.config.update("jax_platforms", "cpu")
  try:
    with facts.ignored() if args.write_facts else contextlib.nullcontext():
      report = verify(
        args.ops,
        args.targets,
        quick=args.quick,
        exhaustive=args.exhaustive,
        heuristic_only=args.heuristic_only,
        implementations=args.implementation,
        workers=args.workers,
        timeout_s=args.timeout,
        cache=not args.no_cache,
      )
  except ValueError as err:  # an unknown op or target
    parser.error(str(err))
  print(report)
  if args.json:
    args.json.write_text(report.to_json())
  if report.unavailable:
    return 2
  if args.write_facts:
    written = write_facts(report.results, args.write_facts)
    print(written)
    return 1 if written.unrecorded or not report.results or report.unswept else 0
  return 0 if report.ok else 1


if __name__ == "__main__":
  sys.exit(main())
