"""``python -m pallax.verify --write-facts``: a run's compiler verdicts into the shipped files.

Each compile that spilled registers or overflowed shared memory or VMEM
becomes a ``"rejected"`` verdict (``pallax.executor.facts``) in its device's
file, ``pallax/executor/defaults/<device>/<kernel>.json``: its config, the
call's facts (``call_facts(avals, **params)`` of the kernel family's config
module) and what the compiler said. A compile that passed refutes the
verdicts that held for it, so a verdict wider than the compiler's finding
(say one on blocks alone, at every warp count) gives way to the ones this run
measured. Kernels whose family defines no ``call_facts`` get no verdicts (their
failures stay failures of the report).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from pallax.executor.cache import update_shipped
from pallax.executor.facts import Verdict
from pallax.executor.registry import kernel_spec
from pallax.op import op_params
from pallax.verify.report import BAD
from pallax.verify.sweep import call_key, kernel_calls_of
from pallax.verify.targets import TARGETS

# A failed compile that is a memory verdict, not a bug: ``compile.judge``'s
# shared-memory check, libtpu's scoped VMEM overflow.
_OVERFLOW = re.compile(r"shared memory|vmem|scoped memory", re.IGNORECASE)
_REASON_CHARS = 300


@dataclasses.dataclass
class FactsWritten:
  """What ``write_facts`` did: files written, verdicts added and refuted, failures left out."""

  paths: list[Path] = dataclasses.field(default_factory=list)
  added: int = 0
  refuted: int = 0
  unrecorded: list[dict] = dataclasses.field(default_factory=list)

  def __str__(self) -> str:
    lines = [
      f"facts: {self.added} verdicts added, {self.refuted} refuted, in {len(self.paths)} files"
    ]
    lines += [
      f"  not a verdict: {r['status']} {r['kernel']} on {r['target']} config {r['config']}"
      for r in self.unrecorded
    ]
    return "\n".join(lines)


def verdict_reason(record: dict) -> Optional[str]:
  """What a failed result's compiler said, if it is a verdict (a spill, a memory overflow)."""
  if record["status"] == "spills":
    spilled = [k for k in record.get("kernels", ()) if k.get("spill_bytes")]
    return "ptxas: " + "; ".join(
      f"{k['spill_bytes']} bytes spilled at {k['registers']} registers in {k['name']}"
      for k in spilled
    )
  error = record.get("error", "")
  if record["status"] == "failed" and _OVERFLOW.search(error):
    return error.strip().splitlines()[0][:_REASON_CHARS]
  return None


def call_facts(record: dict) -> Optional[dict[str, Any]]:
  """The facts of a result's kernel call, by its family's ``call_facts`` (None: it has none)."""
  spec = kernel_spec(record["kernel"])
  family = sys.modules[inspect.unwrap(spec.heuristic).__module__]
  facts_of = getattr(family, "call_facts", None)
  if facts_of is None:
    return None
  target = TARGETS[record["target"]]
  for case in record["cases"]:
    for eqn in kernel_calls_of(case):
      if eqn.primitive.name == record["kernel"] and call_key(eqn, target) == record["call"]:
        return facts_of([v.aval for v in eqn.invars], **op_params(eqn.params))
  raise LookupError(f"no kernel call {record['call']} in the cases {record['cases']}")


def write_facts(results: Sequence[dict], directory: os.PathLike) -> FactsWritten:
  """Merges the verdicts of verify ``results`` (``VerifyReport.results``) into ``directory``.

  Args:
    results: verify result records.
    directory: the shipped-files directory (``cache.defaults_dir()`` for pallax's own).

  Returns:
    What was written; ``unrecorded`` holds the failures that are not verdicts
    (compile errors, timeouts, crashes, families without ``call_facts``).
  """
  written = FactsWritten()
  found: dict[tuple[str, str], list[tuple[dict, dict, Optional[str]]]] = {}
  for record in results:
    reason = verdict_reason(record) if record["status"] in BAD else None
    call = call_facts(record) if record["status"] == "ok" or reason is not None else None
    if call is None:
      if record["status"] in BAD:
        written.unrecorded.append(record)
      continue
    found.setdefault((record["target"], record["kernel"]), []).append(
      (record["config"], call, reason)
    )
  for (device, kernel), measured in sorted(found.items()):
    failed = any(reason is not None for *_, reason in measured)
    if not failed and not (Path(directory) / device / f"{kernel}.json").is_file():
      continue  # nothing known, nothing found

    def change(data: dict, measured=measured) -> None:
      known = [Verdict.from_dict(r) for r in data.get("rejected", ())]
      passed = [(config, call) for config, call, reason in measured if reason is None]
      kept = [v for v in known if not any(v.holds(config, call) for config, call in passed)]
      written.refuted += len(known) - len(kept)
      for config, call, reason in measured:
        if reason is not None and not any(v.holds(config, call) for v in kept):
          kept.append(Verdict(config, call, reason))
          written.added += 1
      data["rejected"] = [v.to_dict() for v in kept]

    written.paths.append(
      update_shipped(directory, device, kernel, kernel_spec(kernel).version, change)
    )
  return written
