"""The persistent config cache: one JSON file per device kind and op.

``<dir>/<device-kind>/<op>.json`` holds ``{"format", "op", "op_version",
"entries": {key: {"config": {...}, "time_s": ..., ...}}}``. Writes take a file
lock, merge with whatever another process wrote meanwhile, write a temporary
file and rename it over the old one, so concurrent tuners never lose each
other's entries and readers never see half a file. A corrupt, truncated or
other-version file is ignored with one warning; an unwritable directory makes
the cache memory-only with one warning. Nothing here ever fails a kernel call.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Optional

FORMAT = 1

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def default_cache_dir() -> Path:
  """``$PALLAX_CACHE_DIR``, else ``~/.cache/pallax``."""
  env = os.environ.get("PALLAX_CACHE_DIR")
  return Path(env) if env else Path.home() / ".cache" / "pallax"


def slug(name: str) -> str:
  """A device kind as a directory name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``."""
  return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


def _parse(text: str, op: str, op_version: int, where: str) -> dict[str, dict[str, Any]]:
  """The entries of a cache file's text; {} (with a warning) if unusable."""
  try:
    data = json.loads(text)
    ok = isinstance(data, dict) and isinstance(data.get("entries"), dict) and data.get("op") == op
  except json.JSONDecodeError:
    ok = False
  if not ok:
    _warn_once(where, f"pallax: ignoring corrupt config cache file {where}")
    return {}
  if data.get("format") != FORMAT or data.get("op_version") != op_version:
    _warn_once(
      where,
      f"pallax: ignoring config cache file {where} written for "
      f"format {data.get('format')} / {op} version {data.get('op_version')} "
      f"(this pallax: format {FORMAT} / version {op_version})",
    )
    return {}
  return data["entries"]


class DiskCache:
  """Tuned configs on disk, shared by every process on the machine."""

  def __init__(self, directory: Optional[os.PathLike] = None):
    self.directory = Path(directory) if directory is not None else default_cache_dir()
    self.writable = True

  def path(self, device_kind: str, op: str) -> Path:
    return self.directory / slug(device_kind) / f"{op}.json"

  def load(self, device_kind: str, op: str, op_version: int) -> dict[str, dict[str, Any]]:
    path = self.path(device_kind, op)
    try:
      text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
      return {}
    except OSError as err:
      _warn_once(str(path), f"pallax: cannot read config cache {path}: {err}")
      return {}
    return _parse(text, op, op_version, str(path))

  def store(
    self, device_kind: str, op: str, op_version: int, entries: dict[str, dict[str, Any]]
  ) -> bool:
    """Merges ``entries`` into the file; False (memory-only from now on) if it cannot."""
    if not self.writable:
      return False
    path = self.path(device_kind, op)
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      with _locked(path.with_suffix(".json.lock")):
        merged = self.load(device_kind, op, op_version)
        merged.update(entries)
        data = {"format": FORMAT, "op": op, "op_version": op_version, "entries": merged}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{op}.", suffix=".tmp")
        try:
          with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
          os.replace(tmp, path)
        except BaseException:
          with contextlib.suppress(OSError):
            os.unlink(tmp)
          raise
      return True
    except OSError as err:
      self.writable = False
      _warn_once(
        str(self.directory),
        f"pallax: config cache {self.directory} is not "
        f"writable ({err}); keeping tuned configs in memory only",
      )
      return False


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
  with open(lock_path, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def shipped_defaults(device_kind: str, op: str, op_version: int) -> dict[str, dict[str, Any]]:
  """Configs shipped in the package: ``pallax/executor/defaults/<device-kind>/<op>.json``.

  Package data does not change while the process runs, so each file is read once.
  """
  res = resources.files("pallax.executor").joinpath("defaults", slug(device_kind), f"{op}.json")
  if not res.is_file():
    return {}
  return _parse(res.read_text(), op, op_version, f"package defaults {slug(device_kind)}/{op}.json")
