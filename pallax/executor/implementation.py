"""The implementation registry: which kinds of kernel exist, and where each one runs.

An implementation is a named way to run an op: ``xla`` (the op's XLA
program), ``pallas_triton``, ``pallas_mosaic_tpu``, ``pallas_mosaic_gpu``,
``triton_raw``, or one a user registers. Each entry says on which platforms it
runs compiled, which device kinds it needs there, which interpret-switch
backend runs it on the CPU, and any further availability check. An op's
kernels are keyed by implementation name (``pallax.op.Kernel``), so giving an
op a new backend is one kernel module and one ``register_implementation``
call, with no edit to the framework or the executor.

A config's ``implementation`` field names the entry that runs it; the name
``"pallas"`` stands for the Pallas implementation the target runs by default
(``pallas_triton`` on ``cuda``/``rocm`` and, interpreted, on ``cpu``;
``pallas_mosaic_tpu`` on ``tpu``; the interpreted backend under the
interpret switch).

Targets name where a kernel call runs: ``cpu``, ``cuda``, ``rocm``, ``tpu``,
or ``interpret-<backend>`` under the interpret switch (``pallax.interpret``).
A ``Target`` is that name as a string, and also carries the device kind
(``h100``, ``a100``, ``b200``, ``v5e``, ``v6e``, ...), so that heuristics,
candidate lists and availability may depend on the device.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Optional

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
PALLAS = "pallas"
XLA = "xla"

# Device kinds as JAX reports them -> short names (the first pattern that matches).
_DEVICE_KINDS = (
  (r"\bh100\b|\bh800\b", "h100"),
  (r"\bh200\b", "h200"),
  (r"\bgh200\b", "h200"),
  (r"\bb200\b|\bgb200\b", "b200"),
  (r"\ba100\b|\ba800\b", "a100"),
  (r"\bl4\b", "l4"),
  (r"v5 lite|v5litepod|v5e", "v5e"),
  (r"v5p|\bv5\b", "v5p"),
  (r"v6 lite|v6e|trillium", "v6e"),
  (r"\bv4\b", "v4"),
  (r"mi300", "mi300"),
)


def short_device_kind(kind: str) -> str:
  """``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``, ``"TPU v5 lite"`` -> ``"v5e"``.

  A kind no pattern knows is lower-cased with runs of other characters as
  ``-``; ``""`` stays ``""`` (no device known).
  """
  text = kind.lower()
  for pattern, short in _DEVICE_KINDS:
    if re.search(pattern, text):
      return short
  return re.sub(r"[^a-z0-9.]+", "-", text).strip("-")


class Target(str):
  """An executor target: its name (``"cuda"``, ``"interpret-triton"``, ...) and device kind.

  It is the name as a ``str`` (so ``target == "cuda"`` and cache keys are as
  before) with the device kind in ``device_kind``: a short name from
  ``short_device_kind``, or ``""`` when no device is known (lowering for a
  platform this machine does not have, without an abstract device).
  """

  device_kind: str

  def __new__(cls, name: str, device_kind: str = "") -> Target:
    target = super().__new__(cls, name)
    target.device_kind = device_kind
    return target

  def __repr__(self) -> str:
    kind = f", device_kind={self.device_kind!r}" if self.device_kind else ""
    return f"Target({str(self)!r}{kind})"

  def __reduce__(self):
    return (Target, (str(self), self.device_kind))

  @property
  def platform(self) -> str:
    """The platform whose devices run this target: interpreted kernels run on the CPU."""
    return platform_of(self)

  @property
  def interpreter(self) -> Optional[str]:
    """The interpret-switch backend of an ``interpret-*`` target, else None."""
    return self[len("interpret-") :] if self.startswith("interpret-") else None


def platform_of(target: str) -> str:
  """The platform whose devices run ``target``: interpreted kernels run on the CPU."""
  return "cpu" if target.startswith("interpret-") else target


def target_of(platform: str, interpret: Optional[str], device_kind: str = "") -> Target:
  """The target of a call lowered for ``platform`` with the interpret switch at ``interpret``."""
  return Target(f"interpret-{interpret}" if interpret else platform, device_kind)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One registered kind of kernel.

  Attributes:
    name: the name configs give in ``implementation`` and kernels are keyed by.
    platforms: where it runs compiled.
    backend: the kernel flavour its configs are shaped for (``"triton"``:
      power-of-two blocks with masking; ``"mosaic_tpu"``: (8, 128)-aligned
      blocks; ...), which an op's heuristic reads through ``kernel_backend``.
    interpreter: the interpret-switch backend that runs it on the CPU
      (``pallax.interpret``), None if it has no interpreter there.
    device_kinds: the device kinds it needs on its platforms (short names);
      None: every device of those platforms.
    pallas: a Pallas implementation, one the name ``"pallas"`` may stand for.
    tuning_only: the executor offers it to autotuning but never picks it by
      heuristic (a raw Triton twin of the Pallas kernel).
    check: ``target -> reason or None``: a further availability check
      (installed packages, process state).
    unpartitionable_interpreted: why the interpreted kernel cannot run in a
      call JAX partitions across devices, where it cannot (a host callback
      that JAX drops); None: it can.
    preferred: where it runs (a device of ``device_kinds``, or its
      interpreter's switch), the executor's heuristic tries a kernel's config
      space of this implementation before the kernel's own (``Kernel``'s
      ``spaces``), and takes it for the calls that space supports.
    fallback: under its interpreter's switch, the Pallas implementation that
      ``"pallas"`` stands for (what the device runs where this one refuses).
  """

  name: str
  platforms: tuple[str, ...]
  backend: str
  interpreter: Optional[str] = None
  device_kinds: Optional[tuple[str, ...]] = None
  pallas: bool = False
  tuning_only: bool = False
  check: Optional[Callable[[Target], Optional[str]]] = None
  unpartitionable_interpreted: Optional[str] = None
  preferred: bool = False
  fallback: Optional[str] = None

  def prefers(self, target: str) -> bool:
    """Whether its own config spaces come before a kernel's on ``target`` (``preferred``).

    Under the interpret switch: its own interpreter's. Elsewhere: a known
    device of its kinds where it is available.
    """
    if not self.preferred:
      return False
    interpreter = Target(target).interpreter
    if interpreter is not None:
      return interpreter == self.interpreter and self.unavailable_reason(target) is None
    kind = getattr(target, "device_kind", "")
    known = bool(kind) and (self.device_kinds is None or kind in self.device_kinds)
    return known and not self.interpreted(target) and self.unavailable_reason(target) is None

  def interpreted(self, target: str) -> bool:
    """Whether this implementation runs interpreted on ``target``."""
    return platform_of(target) == "cpu" and "cpu" not in self.platforms

  def unavailable_reason(self, target: Target) -> Optional[str]:
    """Why it cannot run a call on ``target``, if it cannot."""
    reason = self.check(target) if self.check is not None else None
    if reason is not None:
      return reason
    if self.interpreted(target):
      return None if self.interpreter else f"{self.name} has no interpreter on the CPU"
    if platform_of(target) not in self.platforms:
      return f"{self.name} runs on {', '.join(self.platforms)}, not {target}"
    kind = getattr(target, "device_kind", "")
    if self.device_kinds is not None and kind and kind not in self.device_kinds:
      return f"{self.name} runs on {', '.join(self.device_kinds)}, not {kind}"
    return None


_IMPLEMENTATIONS: dict[str, Implementation] = {}


def register_implementation(impl: Implementation) -> Implementation:
  """Registers ``impl`` under ``impl.name`` (the same entry twice is a no-op).

  Raises:
    ValueError: another entry is registered under that name, or it is a
      reserved name (``"pallas"`` stands for the target's Pallas
      implementation, ``"xla"`` is the XLA program).
  """
  if impl.name == PALLAS:
    raise ValueError(f"{PALLAS!r} names the target's Pallas implementation; choose another name")
  known = _IMPLEMENTATIONS.get(impl.name)
  if known is not None and known != impl:
    raise ValueError(f"an implementation is already registered as {impl.name!r}")
  _IMPLEMENTATIONS[impl.name] = impl
  return impl


def implementation(name: str) -> Implementation:
  """The registered implementation ``name``."""
  try:
    return _IMPLEMENTATIONS[name]
  except KeyError:
    raise KeyError(
      f"no implementation registered as {name!r}; known: {', '.join(_IMPLEMENTATIONS)}"
    ) from None


def implementations() -> dict[str, tuple[str, ...]]:
  """Every registered implementation -> the platforms it runs on compiled (registration order)."""
  return {name: impl.platforms for name, impl in _IMPLEMENTATIONS.items()}


def implementation_names() -> tuple[str, ...]:
  """The names a config's ``implementation`` may take: the registered ones and ``"pallas"``."""
  return (PALLAS, *_IMPLEMENTATIONS)


def interpreters() -> tuple[str, ...]:
  """The interpret switch's backends: those of the Pallas and the preferred implementations."""
  return tuple(
    dict.fromkeys(
      i.interpreter
      for i in _IMPLEMENTATIONS.values()
      if (i.pallas or i.preferred) and i.interpreter
    )
  )


def preferred_interpreters() -> dict[str, str]:
  """Interpret-switch backend -> the preferred implementation it interprets (``mosaic_gpu``)."""
  return {i.interpreter: i.name for i in _IMPLEMENTATIONS.values() if i.preferred and i.interpreter}


def pallas_implementation(target: str, names: Optional[tuple[str, ...]] = None) -> Optional[str]:
  """The Pallas implementation ``"pallas"`` stands for on ``target``.

  Under the interpret switch, the Pallas implementation that backend
  interprets (under a preferred implementation's: its ``fallback``);
  elsewhere the first registered Pallas implementation that can run on
  ``target`` (on the CPU: the first with an interpreter). ``names``
  restricts the choice to the implementations an op has kernels for.
  """
  interpreter = target[len("interpret-") :] if target.startswith("interpret-") else None
  for impl in _IMPLEMENTATIONS.values():
    preferred = impl.preferred and impl.fallback is not None
    if preferred and interpreter is not None and impl.interpreter == interpreter:
      # The switch of an implementation with spaces of its own: "pallas" is its fallback.
      return impl.fallback if names is None or impl.fallback in names else None
  for impl in _IMPLEMENTATIONS.values():
    if not impl.pallas or (names is not None and impl.name not in names):
      continue
    if interpreter is not None:
      if impl.interpreter == interpreter:
        return impl.name
    elif impl.interpreted(target):
      if impl.interpreter is not None:
        return impl.name
    elif impl.unavailable_reason(target) is None:
      return impl.name
  return None


def resolve(name: str, target: str, names: Optional[tuple[str, ...]] = None) -> Optional[str]:
  """The implementation a config naming ``name`` runs on ``target`` (``"pallas"`` resolved)."""
  return pallas_implementation(target, names) if name == PALLAS else name


def kernel_backend(target: str) -> str:
  """The kernel flavour a ``"pallas"`` config is shaped for on ``target`` (``"triton"``, ...)."""
  name = pallas_implementation(target)
  if name is None:
    raise ValueError(f"no Pallas implementation runs on {target}")
  return _IMPLEMENTATIONS[name].backend


def interpreted(target: str) -> bool:
  """Whether a ``"pallas"`` config runs interpreted on ``target``."""
  name = pallas_implementation(target)
  return name is None or _IMPLEMENTATIONS[name].interpreted(target)


def xla_allowed(target: str) -> bool:
  """The interpret switch asks for kernels: the XLA program is not a choice there."""
  return not target.startswith("interpret-")


def _mosaic_gpu_check(target: Target) -> Optional[str]:
  from pallax import pallas_mosaic_gpu  # noqa: PLC0415 (imports jax; this module is imported by it)

  return pallas_mosaic_gpu.unavailable_reason()


def _raw_triton_check(target: Target) -> Optional[str]:
  from pallax import triton_raw  # noqa: PLC0415 (imports jax; this module is imported by it)

  return triton_raw.unavailable_reason(target)


register_implementation(Implementation(XLA, PLATFORMS, backend="xla"))
register_implementation(
  Implementation("pallas_triton", ("cuda", "rocm"), "triton", interpreter="triton", pallas=True)
)
register_implementation(
  Implementation("pallas_mosaic_tpu", ("tpu",), "mosaic_tpu", interpreter="mosaic_tpu", pallas=True)
)
# Hopper only (wgmma, TMA): A100s and B200s keep the Triton kernels. Its
# kernels have config classes of their own, so "pallas" never stands for it:
# on those devices the executor tries its spaces first, and the Triton kernels
# run what it refuses. Interpreted (``pallax.interpret("mosaic_gpu")``) the
# same choice is made, the Triton kernels interpreted where it refuses.
register_implementation(
  Implementation(
    "pallas_mosaic_gpu",
    ("cuda",),
    "mosaic_gpu",
    interpreter="mosaic_gpu",
    device_kinds=("h100", "h200"),  # wgmma: sm_90a only (sm_100a has tcgen05 instead)
    preferred=True,
    fallback="pallas_triton",
    check=_mosaic_gpu_check,
    unpartitionable_interpreted=(
      "an interpreted Mosaic GPU kernel runs as a host callback (JAX's GPU interpreter), which "
      "JAX drops when it partitions the call across devices (jax-ml/jax#23620): shard it with "
      "shard_map instead, or run it on one device"
    ),
  )
)
register_implementation(
  Implementation(
    "triton_raw",
    ("cuda", "rocm"),
    "triton",
    interpreter="triton_raw",
    tuning_only=True,
    check=_raw_triton_check,
    unpartitionable_interpreted=(
      "an interpreted raw Triton kernel runs as a host callback, which JAX drops when it "
      "partitions the call across devices (jax-ml/jax#23620): shard it with shard_map "
      "instead, or run it on one device"
    ),
  )
)
