"""Verify results cached by what decides them: kernel source, config, call, target, compilers.

A result is reused only while the kernel's family sources (``kernels/<family>/``),
the primitives, the ``pallax`` package (framework, executor, this checker), the
target's description, the compiler packages, ``ptxas`` and ``XLA_FLAGS`` are
unchanged. Timeouts and crashes are not cached.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import pathlib
import subprocess
from typing import Optional

import pallax
from pallax.executor.cache import default_cache_dir
from pallax.executor.registry import kernel_spec
from pallax.verify.targets import TARGETS, ptxas

_PACKAGES = (
  "jax",
  "jaxlib",
  "libtpu",
  "jax-cuda12-plugin",
  "jax-cuda12-pjrt",
  "nvidia-cuda-nvcc-cu12",
  "triton",
  "jax-triton",
)


def _hash_files(paths) -> str:
  digest = hashlib.sha256()
  for path in sorted(paths):
    digest.update(path.name.encode())
    digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache
def _framework_hash() -> str:
  """The hash of the ``pallax`` package (framework, executor, verify) and the primitives."""
  root = pathlib.Path(pallax.__file__).parent
  primitives = pathlib.Path(inspect.getfile(pallax.primitives)).parent
  return _hash_files([*root.rglob("*.py"), *primitives.glob("*.py")])


@functools.cache
def _family_hash(kernel: str) -> str:
  # The family's config module (unwrapped from Kernel.of_family's binding) and
  # every module beside and below it (the Mosaic GPU subpackage).
  family = pathlib.Path(inspect.getfile(inspect.unwrap(kernel_spec(kernel).heuristic))).parent
  return _hash_files(family.rglob("*.py"))


@functools.cache
def _versions() -> str:
  """The compiler packages, the ptxas in use and the XLA flags workers inherit."""
  assembler = ptxas()
  found = ["ptxas=none"]
  if assembler:
    version = subprocess.run([assembler, "--version"], capture_output=True, text=True, check=False)
    found = [f"ptxas={assembler}:{version.stdout.strip()}"]
  found.append(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
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
    if result["status"] in ("timeout", "crashed"):  # may not happen again (memory, load)
      return
    path = self._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
