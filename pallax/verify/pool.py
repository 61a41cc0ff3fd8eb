"""Runs compile jobs in worker processes, each job with a timeout.

A compiler can abort its process (LLVM's fatal errors) or never finish, so
jobs never run in the caller's process: long-lived workers (a fresh process
per job would add a second of start-up to each) take one job at a time; a
worker that crashes or overruns its job's timeout is killed and replaced, and
the job is reported as ``crashed`` or ``timeout``.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO, Optional

from pallax.verify.targets import compile_env

_STDERR_TAIL = 800


class _Worker:
  """One worker process and the job it is running."""

  def __init__(self):
    self.log: IO = tempfile.TemporaryFile(mode="w+", errors="replace")
    self.proc = subprocess.Popen(  # its own process group: a kill takes its ptxas too
      [sys.executable, "-m", "pallax.verify.worker"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=self.log,
      env=compile_env(),
      text=True,
      bufsize=1,
      start_new_session=True,
    )
    self.ready = False
    self.job: Optional[dict] = None
    self.deadline = float("inf")

  def send(self, job: dict, timeout_s: float) -> None:
    self.job = job
    self.deadline = time.monotonic() + timeout_s
    self.proc.stdin.write(json.dumps(job) + "\n")
    self.proc.stdin.flush()

  def stderr_tail(self) -> str:
    self.log.seek(0)
    lines = [line for line in self.log.read().splitlines() if line.strip()]
    return "\n".join(lines)[-_STDERR_TAIL:]

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.proc.wait()
    self.log.close()


def run_jobs(
  jobs: Sequence[dict],
  workers: int = 2,
  timeout_s: float = 300.0,
  on_result: Optional[Callable[[dict], None]] = None,
) -> list[dict]:
  """Compiles ``jobs`` (worker messages) on ``workers`` processes; returns their results.

  Each result has the job's ``id`` and a ``status``: ``ok``, ``spills``,
  ``failed``, ``timeout`` (the job ran past ``timeout_s`` seconds; a fresh
  worker's first job also pays its start, a few seconds) or ``crashed`` (the
  worker process died; the end of its stderr is the ``error``). ``on_result``
  sees each as it arrives.
  """
  if not jobs:
    return []
  pending = collections.deque(jobs)
  results: list[dict] = []
  selector = selectors.DefaultSelector()
  live: list[_Worker] = []

  def finish(worker: _Worker, result: dict) -> None:
    worker.job, worker.deadline = None, float("inf")
    results.append(result)
    if on_result is not None:
      on_result(result)

  def start() -> None:
    worker = _Worker()
    live.append(worker)
    selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)

  def replace(worker: _Worker) -> None:
    selector.unregister(worker.proc.stdout)
    live.remove(worker)
    worker.kill()
    if pending:
      start()

  def dispatch(worker: _Worker) -> None:
    if pending and worker.ready and worker.job is None:
      worker.send(pending.popleft(), timeout_s)

  for _ in range(max(1, min(workers, len(jobs)))):
    start()
  try:
    while pending or any(w.job is not None for w in live):
      now = time.monotonic()
      wait = min((w.deadline for w in live), default=now + 1) - now
      for key, _ in selector.select(timeout=max(0.0, min(wait, 1.0))):
        worker = key.data
        line = worker.proc.stdout.readline()
        if not line:  # the process died
          if worker.job is not None:
            finish(
              worker,
              {"id": worker.job["id"], "status": "crashed", "error": worker.stderr_tail()},
            )
          elif not worker.ready:
            raise RuntimeError(f"a verify worker failed to start:\n{worker.stderr_tail()}")
          replace(worker)
          continue
        try:
          message = json.loads(line)
        except ValueError:  # a partial line: the process died writing it
          if worker.job is not None:
            error = f"unreadable result {line[:200]!r}\n{worker.stderr_tail()}"
            finish(worker, {"id": worker.job["id"], "status": "crashed", "error": error})
          replace(worker)
          continue
        if message.get("ready"):
          worker.ready = True
        else:
          finish(worker, message)
        dispatch(worker)
      for worker in list(live):
        if worker.job is not None and time.monotonic() > worker.deadline:
          finish(
            worker,
            {
              "id": worker.job["id"],
              "status": "timeout",
              "error": f"no result after {timeout_s:g} s",
              "compile_s": timeout_s,
            },
          )
          replace(worker)
  finally:
    for worker in live:
      worker.kill()
    selector.close()
  return results


def cpu_count() -> int:
  """Cores this process may use."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1
