"""An op's kernels as the executor sees them, and the executor's selection for one call."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from pallax.executor import Scope, Selection
from pallax.executor.implementation import PALLAS, implementation
from pallax.executor.registry import ConfigSpace

if TYPE_CHECKING:
  from pallax.op.primitive import KernelPrimitive


@dataclasses.dataclass(frozen=True)
class Kernel:
  """An op's kernels and what they tell the executor.

  impls: per implementation (``"pallas_triton"``, ``"pallas_mosaic_tpu"``,
    ``"triton_raw"``, ...: ``pallax.executor.implementation``), the kernel
    ``(*arrays, config, interpret, **params) -> [array]`` (``interpret`` goes
    to ``pallas_call`` as is).
  space: the kernels' config space (``ConfigSpace``), the ``KernelSpec``
    without its name, which is the primitive's (see ``registry.KernelSpec``).
    It describes the kernels only: the executor adds the XLA program as a
    choice of its own.
  spaces: implementation name -> the config space of its own that kernel
    has (a config class, heuristic, candidates and legality of its own:
    the Mosaic GPU kernels'), instead of ``space``.
  """

  impls: Mapping[str, Callable[..., Sequence[jax.Array]]]
  space: ConfigSpace
  spaces: Mapping[str, ConfigSpace] = dataclasses.field(default_factory=dict)

  @property
  def implementations(self) -> tuple[str, ...]:
    """The implementations as configs name them: ``"pallas"`` for every Pallas one, the others."""
    names = [PALLAS if implementation(name).pallas else name for name in self.impls]
    return tuple(dict.fromkeys(names))

  @classmethod
  def of_family(
    cls,
    name: str,
    *,
    config: Any,
    backends: Mapping[str, Any],
    space_params: Mapping[str, Any] = types.MappingProxyType({}),
    own_configs: Mapping[str, Any] = types.MappingProxyType({}),
    **bound,
  ) -> Kernel:
    """The kernel ``name`` of a ``kernels/<family>/`` package.

    Args:
      name: the kernel function's name in each backend module.
      config: the family's ``config`` module: ``CONFIG_CLS``, ``heuristic``,
        ``candidates``, ``supports`` (and optionally ``VERSION``,
        ``kernel_keys``, ``ConfigSpace.kernel_keys``, and ``tune_inputs``,
        ``ConfigSpace.inputs``; ``own_configs``' modules take all but
        ``tune_inputs``).
      backends: implementation name -> the family's module for it; an
        implementation whose module lacks ``name`` has no kernel for it (a raw
        Triton module, ``triton_raw.LazyKernels``, may have some stages only).
      space_params: keyword arguments bound to ``heuristic``, ``candidates``
        and ``supports`` (a family whose config module serves several kernels
        is told which one: its stage, its kernel's name).
      own_configs: implementation name -> the module of a backend whose
        configs are not the family's: its kernels, and its own config space
        (the same names; ``Kernel.spaces``) where it has the kernel.
      **bound: static arguments bound to every backend's kernel function.
    """
    impls = {
      b: functools.partial(getattr(m, name), **bound)
      for b, m in {**backends, **own_configs}.items()
      if hasattr(m, name)
    }

    def given(f):
      return functools.wraps(f)(lambda *args, **kw: f(*args, **space_params, **kw))

    def space(module, inputs=None) -> ConfigSpace:
      return ConfigSpace(
        module.CONFIG_CLS,
        given(module.heuristic),
        given(module.candidates),
        given(module.supports),
        getattr(module, "VERSION", 1),
        inputs and given(inputs),
        getattr(module, "kernel_keys", None) and given(module.kernel_keys),
      )

    spaces = {b: space(m) for b, m in own_configs.items() if b in impls}
    return cls(impls, space(config, getattr(config, "tune_inputs", None)), spaces)

  @classmethod
  def of_stage(cls, stage: str, **family: Any) -> Kernel:
    """The kernel function ``stage`` of a family whose config space takes ``stage=``.

    For ops with several stages (forward, tangent, backward) sharing one config
    module whose ``heuristic``, ``candidates`` and ``supports`` take a
    ``stage`` keyword (``own_configs``' modules too). ``family``: the other
    arguments of ``of_family`` (``config``, ``backends``, ``own_configs``).
    """
    return cls.of_family(stage, space_params={"stage": stage}, **family)


def select_config(
  prim: KernelPrimitive,
  avals: Sequence[Any],
  target: str,
  params: dict,
  *,
  config,
  interpret,
  scope: Scope,
  executor=None,
  **kw,
) -> Selection:
  """The executor's selection for one call of ``prim`` (its framework params given apart).

  ``executor`` defaults to the one in ``scope``; ``kw`` goes to ``Executor.select``.
  """
  return (executor or scope.resolve()).select(
    prim.name,
    avals,
    target,
    params,
    pinned=config,
    overlays=scope.overlays,
    make_fn=kernel_runner(prim, params, interpret),
    **kw,
  )


def kernel_runner(prim: KernelPrimitive, params: dict, interpret) -> Callable:
  """``config -> function`` running ``prim``'s kernel with that config (for autotuning)."""
  return lambda cfg: functools.partial(
    prim.kernel.bind, config=cfg, interpret=interpret, executor=Scope(), **params
  )
