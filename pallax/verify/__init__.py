"""Compile every kernel, with every config the executor can choose, for real hardware targets.

Lowering a Pallas kernel does not run the Triton or Mosaic compilers, so it
cannot see shared-memory or VMEM overflow, register spills or Mosaic layout
failures. ``verify`` runs the real compilers for H100 (sm_90a), A100 (sm_80),
TPU v5e and TPU v6e on a machine without any of them (``targets``), for each
kernel call of a shape sweep over every op, forward, backward and tangent
(``sweep``), with the heuristic's config and the autotuning candidates. It
reports registers, spill bytes and shared memory per kernel (``ptxas -v``)
and scoped VMEM (the compiled TPU program), and fails on any compile error or
spill. ``python -m pallax.verify`` is the command line; with ``--write-facts``
it records the spills and memory overflows as the shipped verdicts the
configs' candidate lists consult (``verdicts.py``, ``pallax.executor.facts``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Optional

from pallax.executor.config import KernelConfig
from pallax.verify import sweep
from pallax.verify.cache import ResultCache, fingerprint
from pallax.verify.compile import shared_result
from pallax.verify.pool import run_jobs
from pallax.verify.progress import Progress
from pallax.verify.report import BAD, VerifyReport
from pallax.verify.targets import TARGETS, Target

__all__ = ["verify", "VerifyReport", "Case", "Op", "TARGETS", "Target", "register_op"]

Case = sweep.Case
Op = sweep.Op
register_op = sweep.register_op


def _targets(names: Optional[Iterable[str]]) -> tuple[list[Target], dict[str, str]]:
  chosen, unavailable = [], {}
  for name in names or TARGETS:
    if name not in TARGETS:
      raise ValueError(f"targets: unknown target {name!r}; known: {', '.join(TARGETS)}")
    reason = TARGETS[name].unavailable_reason()
    if reason is None:
      chosen.append(TARGETS[name])
    else:
      unavailable[name] = reason
  return chosen, unavailable


def verify(
  ops: Optional[Sequence[str]] = None,
  targets: Optional[Sequence[str]] = None,
  *,
  quick: bool = False,
  exhaustive: bool = False,
  cases: Optional[Sequence[sweep.Case]] = None,
  heuristic_only: bool = False,
  pinned: Optional[dict[str, KernelConfig]] = None,
  implementations: Optional[Sequence[str]] = None,
  workers: int = 2,
  timeout_s: float = 300.0,
  cache: bool = True,
  progress: bool = True,
) -> VerifyReport:
  """Compiles the sweep's kernel calls for ``targets``; returns the report.

  Args:
    ops: public op names (``sweep.OPS``: pallax's and those ``register_op``
      added); default pallax's own.
    targets: names in ``TARGETS``; default all that the installed packages
      allow (the others are listed in the report's ``unavailable``).
    quick: two sizes per op instead of the full sweep.
    exhaustive: the autotuning candidates at every case of the sweep, not only
      at each op's candidate cases (``sweep.candidate_cases``).
    cases: these cases instead of the sweep's (``ops`` and ``quick`` unused);
      the candidates are compiled at each.
    heuristic_only: only the heuristic's config, not the autotuning candidates.
    pinned: kernel name -> config: compile these configs for those kernels
      instead of the executor's choices (to check a config by hand).
    implementations: only the configs of these implementations (``"pallas"``,
      ``"triton_raw"``); default all.
    workers: compile processes (each runs one compile at a time).
    timeout_s: per-compile limit; an overrun is a failure.
    cache: reuse and store results (``cache.ResultCache``).
    progress: a progress line on stderr for runs longer than a few seconds.
  """
  for name in ops or ():
    if name not in sweep.OPS:
      raise ValueError(f"ops: unknown op {name!r}; known: {', '.join(sweep.OPS)}")
  start = time.monotonic()
  chosen, unavailable = _targets(targets)
  swept = cases is None
  cases = sweep.cases(ops, quick=quick) if swept else list(cases)
  candidates_at = None if exhaustive or not swept else sweep.candidate_cases(cases)
  jobs = sweep.jobs_for(
    cases,
    chosen,
    heuristic_only=heuristic_only,
    pinned=pinned,
    candidates_at=candidates_at,
    implementations=implementations,
  )
  store = ResultCache() if cache else None
  results: dict[str, dict] = {}

  def compile_jobs(batch: list[sweep.Job], label: str) -> None:
    """Results of ``batch`` into ``results``: from the cache, else compiled and stored."""
    keys = {job.id: fingerprint(job.id, job.kernel, job.target) for job in batch}
    for job in batch:
      hit = store.get(keys[job.id]) if store else None
      if hit is not None:
        results[job.id] = dict(hit, cached=True)
    todo = [job for job in batch if job.id not in results]
    bar = Progress(len(todo), label) if progress else None

    def arrived(result: dict) -> None:
      if store is not None:
        store.put(keys[result["id"]], result)
      if bar is not None:
        bar.update(result["status"] in BAD)

    for result in run_jobs([job.message() for job in todo], workers, timeout_s, arrived):
      results[result["id"]] = result

  compile_jobs([job for job in jobs if job.kernels_from is None], "pallax.verify")
  configs = {job.id: job.config for job in jobs}
  unshared = []  # their kernels' jobs did not compile them: compiled themselves
  for job in jobs:
    if job.kernels_from is not None:
      shared = shared_result(job.kernels_from, results, TARGETS[job.target])
      if shared is None:
        unshared.append(job)
        continue
      from_configs = {name: configs[owner] for name, owner in job.kernels_from.items()}
      results[job.id] = {**shared, "compile_s": 0.0, "kernels_from": from_configs}
  compile_jobs(unshared, "pallax.verify (configs whose kernels did not compile)")
  records = []
  for job in jobs:
    record = {
      "target": job.target,
      "kernel": job.kernel,
      "call": job.key,
      "config": job.config,
      "sources": sorted(job.sources),
      "cases": job.cases,
    }
    record.update({k: v for k, v in results[job.id].items() if k != "id"})
    records.append(record)
  unswept = sweep.unswept_kernels(cases) if swept and not ops and not pinned else []
  return VerifyReport(records, unavailable, unswept, time.monotonic() - start)
