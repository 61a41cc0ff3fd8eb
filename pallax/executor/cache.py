"""The persistent config cache: one JSON file per device kind and op.

``<dir>/<device-kind>/<op>.json`` holds ``{"format", "op", "op_version",
"entries": {key: {"config": {...}, "time_s": ..., ...}}}``; the files shipped in
the package (``shipped_file``) may also hold ``"rejected"``, the compiler
verdicts of ``pallax.executor.facts``, which a merge keeps. Writes take a file
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
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from pallax.executor.implementation import short_device_kind

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


def device_name(device_kind: str) -> str:
  """The shipped files' name of a device kind: ``NVIDIA H100 80GB HBM3`` and ``h100`` -> ``h100``.

  The executor's short name (``implementation.short_device_kind``: ``TPU v5
  lite`` -> ``v5e``), also of a ``slug`` (``nvidia_h100_80gb_hbm3``, as
  ``pallax.tune`` names device kinds).
  """
  return short_device_kind(device_kind.replace("_", " ")) or "unknown"


def _read(text: str, op: str, op_version: int, where: str) -> dict[str, Any]:
  """A cache file's data; {} (with a warning) if unusable."""
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
  return data


def _parse(text: str, op: str, op_version: int, where: str) -> dict[str, dict[str, Any]]:
  """The entries of a cache file's text; {} (with a warning) if unusable."""
  return _read(text, op, op_version, where).get("entries", {})


class DiskCache:
  """Tuned configs on disk, shared by every process on the machine."""

  def __init__(self, directory: Optional[os.PathLike] = None):
    self.directory = Path(directory) if directory is not None else default_cache_dir()
    self.writable = True
    # The package's shipped files (``pallax.tune --import --into`` there) use short names.
    shipped = self.directory.resolve() == defaults_dir().resolve()
    self._dirname = device_name if shipped else slug

  def path(self, device_kind: str, op: str) -> Path:
    return self.directory / self._dirname(device_kind) / f"{op}.json"

  def load(self, device_kind: str, op: str, op_version: int) -> dict[str, dict[str, Any]]:
    return self._load_file(device_kind, op, op_version).get("entries", {})

  def _load_file(self, device_kind: str, op: str, op_version: int) -> dict[str, Any]:
    path = self.path(device_kind, op)
    try:
      text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
      return {}
    except OSError as err:
      _warn_once(str(path), f"pallax: cannot read config cache {path}: {err}")
      return {}
    return _read(text, op, op_version, str(path))

  def store(
    self, device_kind: str, op: str, op_version: int, entries: dict[str, dict[str, Any]]
  ) -> bool:
    """Merges ``entries`` into the file; False (memory-only from now on) if it cannot.

    The file's other fields (a shipped file's ``"rejected"``) are kept.
    """
    if not self.writable:
      return False
    path = self.path(device_kind, op)
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      with _locked(path.with_suffix(".json.lock")):
        data = self._load_file(device_kind, op, op_version)
        data.update(format=FORMAT, op=op, op_version=op_version)
        data["entries"] = {**data.get("entries", {}), **entries}
        _write(path, data)
      return True
    except OSError as err:
      self.writable = False
      _warn_once(
        str(self.directory),
        f"pallax: config cache {self.directory} is not "
        f"writable ({err}); keeping tuned configs in memory only",
      )
      return False


def _write(path: Path, data: dict[str, Any]) -> None:
  """Writes ``data`` to ``path`` atomically: a temporary file renamed over it."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, sort_keys=True)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
    raise


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
  with open(lock_path, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def shipped_file(device_kind: str, op: str, op_version: int) -> dict[str, Any]:
  """The file shipped in the package for ``op`` on a device: ``defaults/<device>/<op>.json``.

  ``<device>`` is ``device_name(device_kind)``. Its ``"entries"`` are tuned
  configs (``shipped_defaults``), its ``"rejected"`` compiler verdicts
  (``pallax.executor.facts``); {} if there is none. Package data does not
  change while the process runs, so each file is read once.
  """
  defaults = resources.files("pallax.executor").joinpath("defaults")
  return read_shipped(defaults, device_kind, op, op_version)


def read_shipped(directory: Any, device_kind: str, op: str, op_version: int) -> dict[str, Any]:
  """The data of ``<directory>/<device>/<op>.json`` (``update_shipped``'s), {} if unusable.

  ``directory``: a path, or the package's resource folder.
  """
  name = device_name(device_kind)
  root = Path(directory) if isinstance(directory, (str, os.PathLike)) else directory
  res = root.joinpath(name, f"{op}.json")
  if not res.is_file():
    return {}
  return _read(res.read_text(), op, op_version, f"shipped file {name}/{op}.json")


def shipped_defaults(device_kind: str, op: str, op_version: int) -> dict[str, dict[str, Any]]:
  """Configs shipped in the package for ``op`` on a device (``shipped_file``'s entries)."""
  return shipped_file(device_kind, op, op_version).get("entries", {})


def defaults_dir() -> Path:
  """The package's shipped-files directory, ``pallax/executor/defaults`` (where it is writable)."""
  return Path(str(resources.files("pallax.executor").joinpath("defaults")))


def update_shipped(
  directory: os.PathLike,
  device_kind: str,
  op: str,
  op_version: int,
  change: Callable[[dict[str, Any]], None],
) -> Path:
  """Rewrites a shipped file, ``<directory>/<device>/<op>.json``, with ``change`` applied.

  ``change`` edits the file's data in place (``"entries"``, ``"rejected"``);
  a file of another format or op version starts empty. For the commands that
  produce shipped files (``pallax.verify --write-facts``), not for kernel calls.
  """
  path = Path(directory) / device_name(device_kind) / f"{op}.json"
  data = read_shipped(directory, device_kind, op, op_version)
  data.update(format=FORMAT, op=op, op_version=op_version)
  data.setdefault("entries", {})
  change(data)
  path.parent.mkdir(parents=True, exist_ok=True)
  _write(path, data)
  return path
