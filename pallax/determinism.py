"""Whether the user asked XLA for deterministic GPU ops, which pallax's kernels honour too.

XLA's GPU programs may run scatters, GEMMs and its cuDNN attention in no
fixed order of float additions unless ``--xla_gpu_exclude_nondeterministic_ops``
(or the older ``--xla_gpu_deterministic_ops``) is set in ``XLA_FLAGS``
(XLA's ``docs/determinism.md``). pallax follows the same switch: a kernel
whose result depends on the order of its atomic adds (the fused attention
backward's dQ reduce-adds) is an autotuning candidate and runs where a
config asks for it, unless one of these flags is on; then the executor
refuses it and picks a deterministic kernel.
"""

from __future__ import annotations

import os
import shlex

FLAGS = ("xla_gpu_exclude_nondeterministic_ops", "xla_gpu_deterministic_ops")
_TRUE = ("", "true", "1")


def required() -> bool:
  """Whether ``XLA_FLAGS`` turns on one of ``FLAGS`` (``--flag``, ``--flag=true`` or ``=1``).

  Read at each call (XLA reads its flags once a process; the executor keeps
  a process's selections in memory). As XLA: a value that does not start
  with ``-`` names a file of flags, parsing stops at the first word that is
  not a flag, and values may be quoted.
  """
  settings = {}
  for word in _words(os.environ.get("XLA_FLAGS", "").strip()):
    if not word.startswith("-"):
      break
    name, _, value = word.lstrip("-").partition("=")
    if name in FLAGS:
      settings[name] = value.lower() in _TRUE  # a flag's last setting wins, as in XLA
  return any(settings.values())


def _words(flags: str) -> list[str]:
  """``XLA_FLAGS``' words, quotes removed; read from the file it names if it is not flags."""
  if flags and not flags.startswith("-"):
    try:
      with open(flags) as f:
        flags = f.read()
    except OSError:
      return []
  try:
    return shlex.split(flags)
  except ValueError:  # an unbalanced quote
    return flags.split()


def reason() -> str:
  """Why a kernel that adds in no fixed order cannot run now (for ``supports``)."""
  flags = " or ".join(f"--{flag}" for flag in FLAGS)
  return f"XLA_FLAGS asks for deterministic ops ({flags})"
