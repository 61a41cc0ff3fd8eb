"""Verify results cached by what decides them: kernel source, config, call, target, compilers.

A result is reused only while the kernel's family sources (``kernels/<family>/``),
the primitives, the op framework (``pallax/*.py``), the target's description
and the compiler packages are unchanged. Timeouts are not cached.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import pathlib
from typing import Optional

import pallax
from pallax.executor.cache import default_cache_dir
from pallax.executor.registry import kernel_spec
from pallax.verify.targets import TARGETS

_PACKAGES = (
  "jax",
  "jaxlib",
  "libtpu",
  "jax-cuda12-plugin",
  "jax-cuda12-pjrt",
  "nvidia-cuda-nvcc-cu12",
)


def _hash_files(paths) -> str:
  digest = hashlib.sha256()
  for path in sorted(paths):
    digest.update(path.name.encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache
def _framework_hash() -> str:
  root = pathlib.Path(pallax.__file__).parent
  primitives = pathlib.Path(inspect.getfile(pallax.primitives)).parent
  return _hash_files([*root.glob("*.py"), *primitives.glob("*.py")])


@functools.cache
def _family_hash(kernel: str) -> str:
  family = pathlib.Path(inspect.getfile(kernel_spec(kernel).heuristic)).parent
  return _hash_files(family.glob("*.py"))


@functools.cache
def _versions() -> str:
  found = []
  for name in _PACKAGES:
    try:
      found.append(f"{name}={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
      found.append(f"{name}=none")
  return ",".join(found)


def fingerprint(job_id: str, kernel: str, target: str) -> str:
  """The cache key of a job: everything its result depends on."""
  target_facts = TARGETS[target].target_config if TARGETS[target].gpu_config else target
  parts = [job_id, _family_hash(kernel), _framework_hash(), _versions(), target_facts]
  return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class ResultCache:
  """One JSON file per result under ``directory`` (default ``<pallax cache>/verify``)."""

  def __init__(self, directory: Optional[pathlib.Path] = None):
    self.directory = pathlib.Path(directory or default_cache_dir() / "verify")

  def _path(self, key: str) -> pathlib.Path:
    return self.directory / key[:2] / f"{key}.json"

  def get(self, key: str) -> Optional[dict]:
    try:
      return json.loads(self._path(key).read_text())
    except (OSError, ValueError):
      return None

  def put(self, key: str, result: dict) -> None:
    if result["status"] == "timeout":
      return
    path = self._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
