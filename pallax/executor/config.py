"""Kernel configs: frozen, hashable, JSON-serialisable block-size choices.

A config is a static parameter of a primitive (so it must hash) and will be
stored in the persistent cache (so it must round-trip through JSON).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="KernelConfig")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Base class of every kernel's config: validation and JSON round-trip."""

  # Fields that must be positive integers; subclasses extend this.
  positive_fields: ClassVar[tuple[str, ...]] = ()

  def __post_init__(self):
    for name in self.positive_fields:
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{type(self).__name__}.{name} must be a positive int, got {value!r}")

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls: type[C], text: str) -> C:
    data: dict[str, Any] = json.loads(text)
    return cls(**data)
