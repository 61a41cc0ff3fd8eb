"""Measured compiler facts: the kernel configs that spill or overflow on-chip memory, per device.

``python -m pallax.verify --write-facts`` compiles kernels for H100, A100, TPU
v5e and v6e and records each config whose compile spilled registers or
overflowed shared memory / VMEM in that device's shipped file,
``pallax/executor/defaults/<device>/<kernel>.json`` (``cache.shipped_file``,
beside the tuned configs of ``"entries"``), as one ``"rejected"`` verdict:

  ``{"config": {...}, "when": {...}, "reason": "..."}``

config: the config fields the verdict is about, a subset of the config's
  ``to_dict()`` (a verdict on blocks alone holds at every ``num_warps``; one
  without ``implementation`` holds for the Pallas and the raw Triton kernel).
when: the facts of the calls it holds for, in the kernel family's terms
  (``call_facts`` of its ``config.py``: say the operand width and padded head
  dim); a call whose facts include these. ``{}``: every call.
reason: what the compiler reported.

A kernel family's candidate lists and ``supports`` ask ``rejection``. Code
holds the models (the space of configs, in order of preference); this data
holds what the compilers said about them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any, Optional, Union

from pallax.executor.cache import device_name, shipped_file
from pallax.executor.config import KernelConfig
from pallax.executor.registry import kernel_backend, kernel_spec

# The devices ``pallax.verify`` measures, per Pallas backend: a target that
# names no device (``cuda``, ``rocm``, ``tpu``, the interpreters) takes the
# verdicts of all of its backend's, so that its configs compile on each of
# them (the heuristic is the same on every target of a backend).
DEVICES = {"triton": ("h100", "a100"), "mosaic_tpu": ("v5e", "v6e")}
KNOWN_DEVICES = tuple(d for devices in DEVICES.values() for d in devices)
# Set (to anything) while ``ignored()``; inherited by verify's compile workers.
_IGNORE_ENV = "PALLAX_IGNORE_FACTS"


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One ``"rejected"`` record: ``config`` fails to compile cleanly for calls ``when``."""

  config: Mapping[str, Any]
  when: Mapping[str, Any]
  reason: str

  def holds(self, config: Mapping[str, Any], call: Mapping[str, Any]) -> bool:
    """Whether this verdict is about ``config`` (its fields) in a call with facts ``call``."""
    return _within(self.config, config) and _within(self.when, call)

  def to_dict(self) -> dict[str, Any]:
    return {"config": dict(self.config), "when": dict(self.when), "reason": self.reason}

  @classmethod
  def from_dict(cls, record: Mapping[str, Any]) -> Verdict:
    return cls(record["config"], record.get("when", {}), record["reason"])


def _within(part: Mapping[str, Any], whole: Mapping[str, Any]) -> bool:
  return all(key in whole and whole[key] == value for key, value in part.items())


def devices_of(target: str, implementation: str = "pallas") -> tuple[str, ...]:
  """The devices whose verdicts hold on ``target``: its device's, or all of its backend's.

  A target's ``device_kind`` (``pallax.executor.Target``) or a device kind
  itself: ``h100``, ``NVIDIA H100 80GB HBM3`` or ``Target("cuda", "h100")`` ->
  ``("h100",)``. A target of a device pallax has no verdicts for, or of none:
  ``cuda`` (or ``Target("cuda", "b200")``) -> ``("h100", "a100")``, ``tpu`` ->
  ``("v5e", "v6e")``; ``()`` where no Pallas kernel runs. A raw Triton config
  (``implementation``) runs on Triton's devices only: on a target that names
  none of them, theirs.
  """
  name = device_name(getattr(target, "device_kind", "") or target)
  if name in KNOWN_DEVICES:
    return (name,)
  if implementation == "triton_raw":
    return DEVICES["triton"]
  try:
    return DEVICES.get(kernel_backend(target), ())
  except (KeyError, ValueError):  # a target no Pallas kernel runs on
    return ()


@functools.cache
def verdicts(device: str, kernel: str) -> tuple[Verdict, ...]:
  """The shipped verdicts of ``kernel`` on ``device`` (a short name: ``h100``)."""
  data = shipped_file(device, kernel, kernel_spec(kernel).version)
  return tuple(Verdict.from_dict(r) for r in data.get("rejected", ()))


def rejection(
  target: str,
  kernel: str,
  config: Union[KernelConfig, Mapping[str, Any]],
  call: Mapping[str, Any],
) -> Optional[str]:
  """Why ``config`` is known not to compile cleanly for a call of ``kernel`` on ``target``, if so.

  Args:
    target: an executor target (``cuda``, ``tpu``, ...) or a device kind.
    kernel: the registered kernel name (``dot_product_attention_fwd``).
    config: a config, or the fields of one (a dict).
    call: the call's facts (the family's ``call_facts``).

  Returns:
    ``"<device>: <reason>"`` of the first verdict that holds, or None (also
    while ``ignored()``).
  """
  if os.environ.get(_IGNORE_ENV):
    return None
  fields = config.to_dict() if isinstance(config, KernelConfig) else config
  for device in devices_of(target, fields.get("implementation", "pallas")):
    for verdict in verdicts(device, kernel):
      if verdict.holds(fields, call):
        return f"{device}: {verdict.reason}"
  return None


@contextlib.contextmanager
def ignored() -> Iterator[None]:
  """Within the block (and in processes started in it), no verdict rejects a config.

  ``pallax.verify --write-facts`` compiles the whole space this way, so that it
  measures again the configs the current verdicts leave out.
  """
  before = os.environ.get(_IGNORE_ENV)
  os.environ[_IGNORE_ENV] = "1"
  try:
    yield
  finally:
    if before is None:
      del os.environ[_IGNORE_ENV]
    else:
      os.environ[_IGNORE_ENV] = before
