"""What each kernel tells the executor: config class, heuristic, search space, kernels.

Targets and implementations are ``pallax.executor.implementation``'; this
module holds, per kernel (a primitive's name), its ``KernelSpec`` and its
kernel functions by implementation name. An implementation may be added to a
registered kernel from outside pallax (``register_kernel_implementation``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Optional

from pallax.executor.config import KernelConfig
from pallax.executor.implementation import (
  PALLAS,
  PLATFORMS,
  Target,
  implementation,
  interpreted,
  interpreters,
  kernel_backend,
  platform_of,
  resolve,
  target_of,
  xla_allowed,
)

__all__ = [
  "PLATFORMS",
  "TARGETS",
  "ConfigSpace",
  "KernelSpec",
  "Target",
  "describe_avals",
  "interpreted",
  "kernel_backend",
  "kernel_function",
  "kernel_implementations",
  "kernel_spec",
  "platform_of",
  "register_kernel",
  "register_kernel_implementation",
  "registered_ops",
  "resolved",
  "target_of",
  "xla_allowed",
]

# The platforms, and the CPU under each backend of the interpret switch.
TARGETS = PLATFORMS + tuple(f"interpret-{backend}" for backend in interpreters())


@dataclasses.dataclass(frozen=True)
class ConfigSpace:
  """A kernel's config class and how the executor chooses among its configs.

  Each callable sees the call as the kernel does: ``avals`` are
  ``jax.ShapeDtypeStruct``s of the kernel's operands (after vmap folding, per
  shard), ``target`` an executor target (``"cuda"``, ``"tpu"``, ``"cpu"``,
  ``"interpret-triton"``, ...; ``pallax.executor.registry``) and ``params``
  the op's static keyword arguments.

  Attributes:
    config_cls: the config class, a frozen dataclass subclassing
      ``pallax.KernelConfig`` (block sizes, ``num_warps``, ...). Its
      ``implementation`` names the kernel a config runs: ``"pallas"`` (the
      Pallas kernel of the target's backend), ``"triton_raw"`` (the raw
      Triton kernel) or another registered implementation
      (``pallax.executor.implementation``); an op with only a raw kernel
      should default it to ``"triton_raw"``.
    heuristic: ``(avals, target, **params) -> config``: cheap, always legal.
    candidates: ``(avals, target, **params) -> [config]``: the autotuning
      space; None: the heuristic's config alone.
    supports: ``(avals, target, config, **params) -> reason or None``: why
      ``config`` cannot run this call, if it cannot; None: every config can.
    version: bump when a config's meaning changes (stale cached configs are
      then ignored).
    inputs: ``(avals, seed, **params) -> [array]``: the operands autotuning
      times the candidates on (of the avals and params the kernel is called
      with), for a kernel whose integer operands are structure (lengths,
      offsets, page tables) that random ones would not stand for; None:
      random ones (``autotune.random_inputs``). A kernel's own space's: an
      added implementation is timed on the kernel's operands.
    kernel_keys: ``(avals, target, config, **params) -> {name: key}``: for
      configs that run several kernels (Pallas calls), what each kernel is
      built from, by the name its Pallas call gives it: two configs of one
      call whose keys for a name are equal run the same kernel there, so
      ``pallax.verify`` compiles it once (the Mosaic GPU attention backward's
      dq and dk/dv kernels, which its config space crosses). It must name
      every kernel a config runs and key each by all it is built from: a
      config's result is then the records of compiles of other configs.
      None, or no name: every config's kernels are its own.

  It is a custom op's config space (``pallax.custom_op``) and the space of an
  implementation added to a registered kernel (``register_kernel_implementation``).
  """

  config_cls: type[KernelConfig]
  heuristic: Callable[..., KernelConfig]
  candidates: Optional[Callable[..., Sequence[KernelConfig]]] = None
  supports: Optional[Callable[..., Optional[str]]] = None
  version: int = 1
  inputs: Optional[Callable[..., Sequence[Any]]] = None
  kernel_keys: Optional[Callable[..., Mapping[str, Hashable]]] = None

  def __post_init__(self):
    if not (isinstance(self.config_cls, type) and issubclass(self.config_cls, KernelConfig)):
      raise TypeError(
        "ConfigSpace: config_cls must be a subclass of pallax.KernelConfig, "
        f"got {self.config_cls!r}"
      )
    for name in ("heuristic", "candidates", "supports", "inputs", "kernel_keys"):
      value = getattr(self, name)
      if (value is not None or name == "heuristic") and not callable(value):
        raise TypeError(f"ConfigSpace: {name} must be callable, got {type(value).__name__}")
    if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
      raise ValueError(f"ConfigSpace: version must be a positive int, got {self.version!r}")

  def configs(self, avals: Sequence[Any], target: str, **params) -> list[KernelConfig]:
    """The autotuning candidates (the heuristic's config alone without ``candidates``)."""
    if self.candidates is None:
      return [self.heuristic(avals, target, **params)]
    return list(self.candidates(avals, target, **params))

  def reason(self, avals: Sequence[Any], target: str, config: KernelConfig, **params):
    """Why ``config`` cannot run this call, if it cannot (never, without ``supports``)."""
    return None if self.supports is None else self.supports(avals, target, config, **params)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """One kernel's contract with the executor.

  Its config space (``config_cls``, ``heuristic``, ``candidates``,
  ``supports``) is that of the kernel's own implementations: its Pallas
  kernels and their raw Triton twins, whose candidates are the Pallas ones
  relabelled. An implementation added from outside may bring a space of its
  own (``spaces``).

  heuristic: ``(avals, target, **params) -> config``, cheap and always legal.
  candidates: ``(avals, target, **params) -> [config]``, the autotuning space.
  supports: ``(avals, target, config, **params) -> reason or None``: why this
    config cannot run this call (unsupported dtype, illegal block), if so.
  version: bump when the kernel's config changes meaning; stale cache entries
    are then ignored.
  implementations: the kernel implementations it has besides the XLA
    program, as configs name them: ``"pallas"`` (a Pallas kernel for one or
    more of the Pallas implementations), ``"triton_raw"`` where it has a raw
    Triton kernel, and any added with ``register_kernel_implementation``.
  spaces: implementation name -> its own ``ConfigSpace``, where it has one.
  inputs: the operands autotuning times candidates on (``ConfigSpace.inputs``).
  kernel_keys: what each kernel of a config is built from (``ConfigSpace.kernel_keys``).
  """

  op: str
  config_cls: type[KernelConfig]
  heuristic: Callable[..., KernelConfig]
  candidates: Callable[..., Sequence[KernelConfig]]
  supports: Callable[..., Optional[str]]
  version: int = 1
  implementations: tuple[str, ...] = (PALLAS,)
  spaces: Mapping[str, ConfigSpace] = dataclasses.field(default_factory=dict)
  inputs: Optional[Callable[..., Sequence[Any]]] = None
  kernel_keys: Optional[Callable[..., Mapping[str, Hashable]]] = None

  def space(self, name: str) -> Any:
    """The config space of implementation ``name``: its own, or the kernel's."""
    return self.spaces.get(name, self)

  def config_from_dict(self, data: Mapping[str, Any]) -> KernelConfig:
    """A config of this kernel from its ``to_dict()``, in its implementation's class."""
    return self.space(data.get("implementation", PALLAS)).config_cls.from_dict(dict(data))

  def config_classes(self) -> tuple[type[KernelConfig], ...]:
    """Every config class a config of this kernel may have."""
    return tuple(dict.fromkeys([self.config_cls, *(s.config_cls for s in self.spaces.values())]))


_SPECS: dict[str, KernelSpec] = {}
# (kernel, implementation name) -> ``(*arrays, config, interpret, **params) -> [array]``.
_KERNELS: dict[tuple[str, str], Callable[..., Sequence[Any]]] = {}


def register_kernel(
  spec: KernelSpec, kernels: Mapping[str, Callable[..., Sequence[Any]]] = {}
) -> None:
  """Registers ``spec`` under ``spec.op``; ``pallax.op.define_primitive`` does it for ops.

  Args:
    spec: the kernel's contract.
    kernels: implementation name (``"pallas_triton"``, ``"triton_raw"``, ...)
      -> the kernel function that implementation runs.

  Raises:
    ValueError: another spec is registered under the same name.
  """
  known = _SPECS.get(spec.op)
  if known is not None and known != spec:
    raise ValueError(f"a kernel is already registered as {spec.op!r}: op names must be unique")
  for name in kernels:
    implementation(name)  # registered, or a KeyError naming the known ones
  _SPECS[spec.op] = spec
  _KERNELS.update({(spec.op, name): fn for name, fn in kernels.items()})


def register_kernel_implementation(
  op: str,
  name: str,
  kernel: Callable[..., Sequence[Any]],
  space: Optional[ConfigSpace] = None,
) -> None:
  """Gives the registered kernel ``op`` a kernel of implementation ``name``, from anywhere.

  The executor then offers it where the implementation can run: by heuristic
  on the CPU (where the kernel's own Pallas implementations run only
  interpreted; elsewhere the kernel's own heuristic decides), to autotuning
  everywhere it runs compiled, and to ``config=`` pins naming it.

  Args:
    op: a registered kernel (a primitive's name, e.g. ``"rms_norm_fwd"``).
    name: a registered implementation (``implementation.register_implementation``).
    kernel: ``(*arrays, config, interpret, **params) -> [array]``.
    space: the implementation's config space; None: the kernel's own, its
      configs naming ``name``.
  """
  import jax  # noqa: PLC0415 (selections made before this one may change)

  spec = kernel_spec(op)
  implementation(name)
  if name == PALLAS or name in ("xla",):
    raise ValueError(f"{op}: {name!r} is not an implementation a kernel can be added as")
  if space is not None and space.inputs is not None:
    raise ValueError(
      f"{op}: an added implementation is timed on the kernel's operands; its space takes no inputs"
    )
  spaces = dict(spec.spaces)
  if space is not None:
    spaces[name] = space
  names = spec.implementations + ((name,) if name not in spec.implementations else ())
  _SPECS[op] = dataclasses.replace(spec, implementations=names, spaces=spaces)
  _KERNELS[(op, name)] = kernel
  jax.clear_caches()


def kernel_function(op: str, name: str) -> Callable[..., Sequence[Any]]:
  """The kernel function of implementation ``name`` (resolved, not ``"pallas"``) of ``op``."""
  try:
    return _KERNELS[(op, name)]
  except KeyError:
    raise KeyError(f"{op} has no {name} kernel") from None


def kernel_implementations(op: str) -> tuple[str, ...]:
  """The implementation names ``op`` has kernel functions for (``"pallas"`` resolved)."""
  return tuple(name for kernel, name in _KERNELS if kernel == op)


def resolved(op: str, name: str, target: str) -> Optional[str]:
  """The implementation a config of ``op`` naming ``name`` runs on ``target``, if any.

  A kernel registered without kernel functions (a spec alone, as tests make)
  may resolve ``"pallas"`` to any Pallas implementation.
  """
  return resolve(name, target, kernel_implementations(op) or None)


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
