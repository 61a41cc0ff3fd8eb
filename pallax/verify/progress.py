"""A progress line on stderr for long runs: a bar on a terminal, a line a minute otherwise."""

from __future__ import annotations

import sys
import time
from typing import IO, Optional


class Progress:
  """Counts finished jobs out of ``total`` and shows it on ``stream`` after ``delay_s``."""

  def __init__(self, total: int, label: str, stream: Optional[IO] = None, delay_s: float = 3.0):
    self.total, self.label = total, label
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()
    self.start = self.last = time.monotonic()
    self.delay_s = delay_s
    self.done = self.bad = 0

  def update(self, bad: bool) -> None:
    self.done += 1
    self.bad += bad
    now = time.monotonic()
    if now - self.start < self.delay_s:
      return
    if self.tty and now - self.last >= 0.2 or now - self.last >= 60 or self.done == self.total:
      self.last = now
      self._show(now)

  def _show(self, now: float) -> None:
    elapsed = now - self.start
    eta = elapsed / self.done * (self.total - self.done)
    width = 30
    bar = "#" * (width * self.done // self.total)
    line = (
      f"{self.label} [{bar:<{width}}] {self.done}/{self.total} ({self.bad} failing) "
      f"{elapsed:.0f} s, about {eta:.0f} s left"
    )
    end = "" if self.tty and self.done < self.total else "\n"
    self.stream.write(("\r" if self.tty else "") + line + end)
    self.stream.flush()
