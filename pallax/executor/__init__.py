"""Config selection for kernels.

Each kernel registers its config class and a heuristic; ``select_config``
resolves the config a kernel call uses from the final abstract shapes and the
target backend. This is the minimal first link of the executor chain of
design.md section 3 (pinned config -> heuristic).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

from pallax.executor.config import KernelConfig

log = logging.getLogger("pallax.executor")

Heuristic = Callable[..., KernelConfig]


@dataclasses.dataclass(frozen=True)
class KernelEntry:
  config_cls: type[KernelConfig]
  heuristic: Heuristic


_KERNELS: dict[str, KernelEntry] = {}


def register_kernel(op: str, config_cls: type[KernelConfig],
                    heuristic: Heuristic) -> None:
  """Registers ``op``'s config class and its heuristic ``(avals, backend, **params)``."""
  _KERNELS[op] = KernelEntry(config_cls, heuristic)


def select_config(op: str, avals: Sequence[Any], backend: str,
                  pinned: Optional[KernelConfig] = None, **params) -> KernelConfig:
  """The config for one kernel call: the pinned one if given, else the heuristic's."""
  entry = _KERNELS[op]
  if pinned is not None:
    if not isinstance(pinned, entry.config_cls):
      raise TypeError(f"config for {op} must be a {entry.config_cls.__name__}, "
                      f"got {type(pinned).__name__}")
    source, config = "pinned", pinned
  else:
    source, config = "heuristic", entry.heuristic(avals, backend, **params)
  log.debug("%s %s on %s: %s (%s)", op,
            [f"{a.dtype}{list(a.shape)}" for a in avals], backend, config, source)
  return config
