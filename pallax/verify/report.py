"""The verify report: one row per kernel and target, the failures, and JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Optional

BAD = ("spills", "failed", "timeout", "crashed")


@dataclasses.dataclass
class Summary:
  """What the compiles of one kernel on one target showed."""

  kernel: str
  target: str
  implementation: str = "pallas"
  jobs: int = 0
  ok: int = 0
  spills: int = 0
  failed: int = 0
  max_registers: Optional[int] = None
  max_smem_bytes: Optional[int] = None
  max_vmem_bytes: Optional[int] = None
  compile_s: float = 0.0


def _max(current: Optional[int], value: Optional[int]) -> Optional[int]:
  if value is None:
    return current
  return value if current is None else max(current, value)


def summarize(results: Sequence[dict]) -> list[Summary]:
  """One ``Summary`` per kernel, target and implementation (Pallas, raw Triton) of ``results``."""
  rows: dict[tuple[str, str, str], Summary] = {}
  for r in results:
    impl = r["config"].get("implementation", "pallas")
    row = rows.setdefault((r["kernel"], r["target"], impl), Summary(r["kernel"], r["target"], impl))
    row.jobs += 1
    row.ok += r["status"] == "ok"
    row.spills += r["status"] == "spills"
    row.failed += r["status"] in ("failed", "timeout", "crashed")
    row.compile_s += r.get("compile_s", 0.0)
    for k in r.get("kernels", ()):
      row.max_registers = _max(row.max_registers, k.get("registers"))
      row.max_smem_bytes = _max(row.max_smem_bytes, k.get("smem_bytes"))
      row.max_vmem_bytes = _max(row.max_vmem_bytes, k.get("vmem_bytes"))
  return sorted(rows.values(), key=lambda s: (s.kernel, s.implementation, s.target))


def _kib(n: Optional[int]) -> str:
  if n is None:
    return "-"
  return f"{n} B" if n < 1024 else f"{n / 1024:,.0f} KiB"


@dataclasses.dataclass
class VerifyReport:
  """Every job's result; ``ok`` when none failed, spilled, timed out or crashed.

  results: one record per job: ``target``, ``kernel``, ``config``, ``sources``,
    ``cases``, ``status``, ``error``, ``compile_s`` (``cached`` when it came
    from the result cache) and ``kernels`` (per compiled kernel: ``registers``,
    ``spill_bytes``, ``threads``, ``smem_bytes`` on CUDA; ``vmem_bytes`` on
    TPU); ``kernels_from`` (kernel name -> config) where other configs'
    compiles gave its kernels (``sweep.Job.kernels_from``).
  unavailable: targets left out, with the reason.
  unswept: pallax kernels no case of the sweep calls (a gap in the sweep).
  wall_s: the run's wall time.
  """

  results: list[dict]
  unavailable: dict[str, str]
  unswept: list[str]
  wall_s: float

  @property
  def failures(self) -> list[dict]:
    return [r for r in self.results if r["status"] in BAD]

  @property
  def ok(self) -> bool:
    """Something was compiled, and nothing failed or was left unswept."""
    return bool(self.results) and not self.failures and not self.unswept

  def summary(self) -> list[Summary]:
    return summarize(self.results)

  def table(self) -> str:
    """The Markdown table of ``summary()``."""
    lines = [
      "| kernel | target | configs compiled | spills | failed | max registers "
      "| max shared memory | max scoped VMEM | compile s |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in self.summary():
      kernel = s.kernel if s.implementation == "pallas" else f"{s.kernel} ({s.implementation})"
      lines.append(
        f"| {kernel} | {s.target} | {s.ok}/{s.jobs} | {s.spills} | {s.failed} "
        f"| {s.max_registers if s.max_registers is not None else '-'} "
        f"| {_kib(s.max_smem_bytes)} | {_kib(s.max_vmem_bytes)} | {s.compile_s:.0f} |"
      )
    return "\n".join(lines)

  def __str__(self) -> str:
    parts = [self.table()]
    for name, reason in self.unavailable.items():
      parts.append(f"target {name} left out: {reason}")
    for kernel in self.unswept:
      parts.append(f"kernel {kernel} is registered but no case of the sweep calls it")
    for r in self.failures:
      parts.append(
        f"{r['status'].upper()} {r['kernel']} on {r['target']} config {r['config']}\n"
        f"  in {r['cases'][0]} ({len(r['cases'])} cases): {r.get('error', '')}"
      )
    n = len(self.results)
    cached = sum(bool(r.get("cached")) for r in self.results)
    shared = sum("kernels_from" in r for r in self.results)
    verdict = "all compiled, no spills" if self.ok else f"{len(self.failures)} failing"
    if not self.results:
      verdict = "nothing to compile"
    of = f"; {shared} more configs of kernels those compiled" if shared else ""
    took = f"in {self.wall_s:.0f} s: {verdict}"
    parts.append(f"{n - shared} compiles ({cached} from the cache{of}) {took}")
    return "\n".join(parts)

  def to_json(self) -> str:
    return json.dumps(
      {
        "ok": self.ok,
        "wall_s": round(self.wall_s, 1),
        "unavailable": self.unavailable,
        "unswept": self.unswept,
        "summary": [dataclasses.asdict(s) for s in self.summary()],
        "results": self.results,
      },
      indent=1,
      default=sorted,
    )
