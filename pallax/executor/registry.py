"""What each kernel tells the executor: config class, heuristic, search space.

Targets name where a kernel call runs: ``cpu``, ``cuda``, ``rocm``, ``tpu``, or
``interpret-triton`` / ``interpret-mosaic_tpu`` under the interpret switch. On
``cpu`` a ``"pallas"`` config runs the Triton-flavoured kernel interpreted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional

from pallax.executor.config import KernelConfig

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
TARGETS = PLATFORMS + ("interpret-triton", "interpret-mosaic_tpu")
_BACKEND = {
  "cpu": "triton",
  "cuda": "triton",
  "rocm": "triton",
  "tpu": "mosaic_tpu",
  "interpret-triton": "triton",
  "interpret-mosaic_tpu": "mosaic_tpu",
}


def target_of(platform: str, interpret: Optional[str]) -> str:
  """The target of a call lowered for ``platform`` with the interpret switch at ``interpret``."""
  return f"interpret-{interpret}" if interpret else platform


def platform_of(target: str) -> str:
  """The platform whose devices run ``target``: interpreted kernels run on the CPU."""
  return "cpu" if target.startswith("interpret-") else target


def kernel_backend(target: str) -> str:
  """The Pallas backend whose kernel a ``"pallas"`` config runs on ``target``."""
  return _BACKEND[target]


def interpreted(target: str) -> bool:
  """Whether a ``"pallas"`` config runs interpreted on ``target``."""
  return target == "cpu" or target.startswith("interpret-")


def xla_allowed(target: str) -> bool:
  """The interpret switch asks for kernels: the XLA program is not a choice there."""
  return not target.startswith("interpret-")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """One kernel's contract with the executor.

  heuristic: ``(avals, target, **params) -> config``, cheap and always legal.
  candidates: ``(avals, target, **params) -> [config]``, the autotuning space.
  supports: ``(avals, target, config, **params) -> reason or None``: why this
    config cannot run this call (unsupported dtype, illegal block), if so.
  version: bump when the kernel's config changes meaning; stale cache entries
    are then ignored.
  implementations: the kernel implementations it has besides the XLA
    program: ``"pallas"``, and ``"triton_raw"`` where it has a raw Triton
    kernel.
  """

  op: str
  config_cls: type[KernelConfig]
  heuristic: Callable[..., KernelConfig]
  candidates: Callable[..., Sequence[KernelConfig]]
  supports: Callable[..., Optional[str]]
  version: int = 1
  implementations: tuple[str, ...] = ("pallas",)


_SPECS: dict[str, KernelSpec] = {}


def register_kernel(spec: KernelSpec) -> None:
  """Registers ``spec`` under ``spec.op``; ``pallax.op.define_primitive`` does it for ops.

  Raises:
    ValueError: another spec is registered under the same name.
  """
  known = _SPECS.get(spec.op)
  if known is not None and known != spec:
    raise ValueError(f"a kernel is already registered as {spec.op!r}: op names must be unique")
  _SPECS[spec.op] = spec


def kernel_spec(op: str) -> KernelSpec:
  try:
    return _SPECS[op]
  except KeyError:
    raise KeyError(f"no kernel registered as {op!r}; known: {sorted(_SPECS)}") from None


def registered_ops() -> list[str]:
  return sorted(_SPECS)


def describe_avals(avals: Sequence[Any]) -> str:
  """``f32[4096,1024];bf16[1024]``: the shape part of a cache key."""
  return ";".join(
    f"{a.dtype.name if hasattr(a.dtype, 'name') else a.dtype}[{','.join(map(str, a.shape))}]"
    for a in avals
  )
