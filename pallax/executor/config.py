"""Kernel configs: frozen, hashable, JSON-serialisable block-size choices.

A config is a static parameter of a primitive (so it must hash) and is stored
in the persistent cache (so it must round-trip through JSON). Every config
names its implementation: ``"pallas"`` (the target's Pallas kernel;
interpreted on CPU), ``"xla"`` (the op's XLA program), or any registered
implementation (``"triton_raw"``, ``"pallas_mosaic_gpu"``, a user's; see
``pallax.executor.implementation``), so choosing between them is config
selection like any other.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from pallax.executor.implementation import implementation_names

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Base class of every kernel's config: validation and JSON round-trip.

  Every field a subclass annotates ``int`` (block sizes, warps, stages) must be
  a positive int.
  """

  implementation: str = dataclasses.field(default="pallas", kw_only=True)

  def __post_init__(self):
    if self.implementation not in implementation_names():
      raise ValueError(
        f"{type(self).__name__}.implementation must be one of "
        f"{implementation_names()}, got {self.implementation!r}"
      )
    for name in (f.name for f in dataclasses.fields(self) if f.type in (int, "int")):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")

  def __str__(self) -> str:
    if self.implementation == "xla":
      return "xla"
    fields = ", ".join(
      f"{f.name}={getattr(self, f.name)}"
      for f in dataclasses.fields(self)
      if f.name != "implementation"
    )
    return f"{self.implementation}({fields})"

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_dict(cls: type[C], data: dict[str, Any]) -> C:
    return cls(**data)

  @classmethod
  def from_json(cls: type[C], text: str) -> C:
    return cls.from_dict(json.loads(text))
