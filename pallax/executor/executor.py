"""The executor: which implementation and config each kernel call uses.

Selection happens once per (op, final avals, params, target) at lowering time,
in this order (design.md section 3):

1. ``pinned``: the op's ``config=`` argument, or ``Executor.override``;
2. ``overlay``: ``with executor.overlay({op: config}):``;
3. ``memory``: configs this executor tuned or loaded;
4. ``disk``: the persistent cache (``pallax.executor.cache``);
5. ``default``: configs shipped in the package;
6. on a miss, by policy: ``"heuristic"`` (default) uses the kernel's
   heuristic, ``"autotune"`` times the candidates on this device and stores
   the winner, ``"error"`` raises ``LookupError``.

The XLA program is the executor's business, not the kernels': a kernel's spec
describes only its kernel (``"pallas"`` configs). The executor picks the XLA
program by heuristic on ``cpu`` (interpreted kernels are for testing, not
speed), adds it to the autotuning candidates wherever it may run, and never
asks a kernel whether it supports an ``"xla"`` config: the XLA program runs
every call. A selected ``"pallas"`` config the kernel cannot run (say float64
on TPU) is replaced by the XLA program, visibly: a log line and a note in
``explain``. Under the interpret switch the executor never picks the XLA
program (a pinned ``"xla"`` config still runs it). Interpreted kernels are a
test device: autotuning times them only under the interpret switch.
Heuristic picks are never written to disk; pinned configs never stored.

Which executor and overlays apply is a JAX config flag in the trace context, so
entering an overlay re-traces jitted functions; persistent changes (override,
policy, default executor) clear JAX's caches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Optional

import jax

from pallax import _jax_private
from pallax.executor import autotune as autotune_lib
from pallax.executor.cache import DiskCache, shipped_defaults
from pallax.executor.config import KernelConfig
from pallax.executor.implementation import (
  PALLAS,
  XLA,
  Target,
  implementation,
  platform_of,
  short_device_kind,
  xla_allowed,
)
from pallax.executor.registry import (
  KernelSpec,
  describe_avals,
  kernel_implementations,
  kernel_spec,
  resolved,
)

log = logging.getLogger("pallax.executor")

POLICIES = ("heuristic", "autotune", "error")
_NO_DEVICE = " (no device)"


@dataclasses.dataclass(frozen=True)
class Selection:
  """The outcome of one selection, as ``pallax.explain`` shows it."""

  op: str
  key: str
  target: str
  device_kind: str
  config: KernelConfig
  source: str
  note: str = ""

  @property
  def implementation(self) -> str:
    return self.config.implementation


@dataclasses.dataclass(frozen=True)
class Scope:
  """What a traced op call carries to its lowering: the executor and overlays in force."""

  executor: Optional[Executor] = None
  overlays: tuple[tuple[str, KernelConfig], ...] = ()

  def resolve(self) -> Executor:
    return self.executor if self.executor is not None else default_executor()


_SCOPE = _jax_private.object_flag(
  "pallax_executor_scope",
  Scope(),
  help="The pallax executor and config overlays in force (set by their context managers).",
)


def current_scope() -> Scope:
  return _SCOPE.value


def _device_kind(target: str) -> str:
  if isinstance(target, Target) and target.device_kind:
    return target.device_kind  # a device named by the caller (``explain(..., target=)``)
  platform = platform_of(target)
  kind = _local_device_kind(platform)
  if kind is not None:
    return kind
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None and abstract.platform == platform:
    return abstract.device_kind
  return f"{platform}{_NO_DEVICE}"


@functools.cache
def _local_device_kind(platform: str) -> Optional[str]:
  try:
    return jax.devices(platform)[0].device_kind
  except RuntimeError:
    return None


def device_target(target: str, kind: Optional[str] = None) -> Target:
  """``target`` as a ``Target`` carrying its device kind (a short name; ``""`` for none)."""
  if isinstance(target, Target) and target.device_kind:
    return target
  kind = _device_kind(target) if kind is None else kind
  return Target(target, "" if kind.endswith(_NO_DEVICE) else short_device_kind(kind))


def _target_runs_here(target: str) -> bool:
  return _local_device_kind(platform_of(target)) is not None


def heuristic_config(
  spec: KernelSpec, avals: Sequence[Any], target: str, params: Mapping
) -> KernelConfig:
  """The kernel's heuristic config (``heuristic_choice`` without its note)."""
  return heuristic_choice(spec, avals, target, params)[0]


def heuristic_choice(
  spec: KernelSpec, avals: Sequence[Any], target: str, params: Mapping
) -> tuple[KernelConfig, str]:
  """The kernel's heuristic config, and a note on which implementation and why.

  Where a preferred implementation with a space of its own runs (Mosaic GPU
  on Hopper: ``Implementation.preferred``), its heuristic's config if that
  space supports the call, else (saying why) the kernel's own; a preferred
  space's heuristic returning None leaves the call to the kernel's own
  heuristic, its configs candidates for autotuning only. On ``cpu``,
  where the kernel's own implementations run interpreted: an implementation
  added to it that runs compiled there, else the XLA program with the
  heuristic's blocks.
  """
  if target == "cpu":
    for name in _runnable(spec, target):
      if not implementation(name).tuning_only:
        return _named(spec.space(name).heuristic(avals, target, **params), name), ""
    return _named(spec.heuristic(avals, target, **params), XLA), ""
  refusals = []
  where = target if Target(target).interpreter else getattr(target, "device_kind", "") or target
  for name in _preferred(spec, target):
    space = spec.spaces[name]
    config = space.heuristic(avals, target, **params)
    if config is None:  # the space leaves this call to timing (autotuning) alone
      refusals.append(f"{name} (preferred on {where}) leaves this call to autotuning")
      continue
    config = _named(config, name)
    reason = space.reason(avals, target, config, **params)
    if reason is None:
      return config, f"{name} preferred on {where}"
    refusals.append(f"{name} (preferred on {where}) refuses this call: {reason}")
  return spec.heuristic(avals, target, **params), "; ".join(refusals)


def candidate_configs(
  spec: KernelSpec, avals: Sequence[Any], target: str, params: Mapping
) -> list[KernelConfig]:
  """The autotuning candidates: the kernel's own, those of its other implementations, XLA's.

  Every other implementation the kernel has that runs compiled on ``target``
  adds its own space's candidates, or, sharing the kernel's space (a raw
  Triton twin), the Pallas candidates relabelled. The XLA program comes last, once, wherever
  it may run: a candidate XLA config from the kernel's own list stands for it
  if there is one; otherwise it is the heuristic's config made ``"xla"``.
  """
  configs = list(dict.fromkeys(spec.candidates(avals, target, **params)))
  own = [c for c in configs if c.implementation != XLA]
  kernels = list(own)
  for name in dict.fromkeys([*_preferred(spec, target), *_runnable(spec, target)]):
    if name in spec.spaces:
      kernels += [_named(c, name) for c in spec.spaces[name].configs(avals, target, **params)]
    else:
      kernels += [_named(c, name) for c in own if c.implementation == PALLAS]
  kernels = list(dict.fromkeys(kernels))
  if not xla_allowed(target):
    return kernels
  xla = next((c for c in configs if c.implementation == XLA), None)
  if xla is None:
    xla = _named(spec.heuristic(avals, target, **params), XLA)
  return kernels + [xla]


def unsupported_reason(
  spec: KernelSpec, avals: Sequence[Any], target: str, config: KernelConfig, params: Mapping
) -> Optional[str]:
  """Why ``config`` cannot run this call, if it cannot: the XLA program always can."""
  if config.implementation == XLA:
    return None
  if config.implementation not in spec.implementations and not _names_own_pallas(spec, config):
    return f"{spec.op} has no {config.implementation} kernel"
  name = resolved(spec.op, config.implementation, target)
  if name is None:
    return f"{spec.op} has no Pallas kernel that runs on {target}"
  reason = implementation(name).unavailable_reason(target)
  if reason is not None:
    return reason
  space = spec.space(config.implementation)
  if not isinstance(config, space.config_cls):
    return f"{config.implementation} takes a {space.config_cls.__name__}"
  if config.implementation in spec.spaces:
    return space.reason(avals, target, config, **params)
  return spec.supports(avals, target, config, **params)


def _names_own_pallas(spec: KernelSpec, config: KernelConfig) -> bool:
  """Whether ``config`` names one of the kernel's Pallas implementations explicitly."""
  name = config.implementation
  return PALLAS in spec.implementations and name in kernel_implementations(spec.op)


def _runnable(spec: KernelSpec, target: str) -> list[str]:
  """The kernel's implementations besides ``"pallas"`` that run compiled on ``target``."""
  return [
    name
    for name in spec.implementations
    if name != PALLAS
    and not implementation(name).interpreted(target)
    and implementation(name).unavailable_reason(target) is None
  ]


def _preferred(spec: KernelSpec, target: str) -> list[str]:
  """The kernel's implementations with spaces of their own preferred on ``target``."""
  return [
    name
    for name in spec.spaces
    if name in spec.implementations and implementation(name).prefers(target)
  ]


def _interpreted_outside_switch(
  spec: KernelSpec, target: str, config: KernelConfig
) -> Optional[str]:
  """Why autotuning does not time ``config`` on ``target``, if it would run interpreted there.

  Interpreted kernels say nothing about the hardware's speed: only under the
  interpret switch, where nothing else may run, are they timed. This holds
  for the kernel functions the op registered (a spec alone, as tests make,
  runs whatever its ``make_fn`` runs).
  """
  if not xla_allowed(target) or config.implementation == XLA:
    return None
  name = resolved(spec.op, config.implementation, target)
  if name not in kernel_implementations(spec.op) or not implementation(name).interpreted(target):
    return None
  return f"{name} runs interpreted on {target} (timed only under pallax.interpret)"


def _named(config: KernelConfig, name: str) -> KernelConfig:
  return (
    config if config.implementation == name else dataclasses.replace(config, implementation=name)
  )


def cache_key(spec: KernelSpec, avals: Sequence[Any], target: str, params: Mapping) -> str:
  static = ",".join(f"{k}={params[k]!r}" for k in sorted(params))
  return f"{spec.op}@v{spec.version}|{target}|{describe_avals(avals)}|{static}"


class Executor:
  """Selects kernel configs; holds the in-memory cache and the disk cache.

  Args:
    policy: what to do on a cache miss: ``"heuristic"``, ``"autotune"`` or
      ``"error"``. Default: ``$PALLAX_POLICY`` or ``"heuristic"``.
    cache_dir: persistent cache directory (default ``$PALLAX_CACHE_DIR`` or
      ``~/.cache/pallax``); ``False`` for memory only.
    timer: replaces wall-clock timing when autotuning: ``timer(config) ->
      seconds``, raising for a candidate that cannot run (for tests).
  """

  def __init__(
    self,
    policy: Optional[str] = None,
    cache_dir=None,
    timer: Optional[autotune_lib.Timer] = None,
  ):
    self._policy = self._check_policy(policy or os.environ.get("PALLAX_POLICY", "heuristic"))
    self.disk = None if cache_dir is False else DiskCache(cache_dir)
    self.timer = timer
    self._pins: dict[str, KernelConfig] = {}
    self._memory: dict[tuple[str, str], Selection] = {}
    self._disk_files: dict[tuple[str, str], dict[str, dict]] = {}
    self._lock = threading.RLock()
    self._entered = threading.local()
    self.tune_log: list[tuple[Selection, autotune_lib.TuneResult]] = []

  # -- configuration -----------------------------------------------------------

  @staticmethod
  def _check_policy(policy: str) -> str:
    if policy not in POLICIES:
      raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy

  @property
  def policy(self) -> str:
    return self._policy

  @policy.setter
  def policy(self, policy: str) -> None:
    self._policy = self._check_policy(policy)
    jax.clear_caches()

  def override(self, op: str, config: Optional[KernelConfig]) -> None:
    """Pins ``config`` for every call of kernel ``op`` (None removes the pin)."""
    if config is None:
      self._pins.pop(op, None)
    else:
      self._check_config(kernel_spec(op), config)
      self._pins[op] = config
    jax.clear_caches()

  @contextlib.contextmanager
  def overlay(self, configs: Mapping[str, KernelConfig]) -> Iterator[Executor]:
    """Within the block, kernel ``op`` uses ``configs[op]`` (after pins)."""
    for op, config in configs.items():
      self._check_config(kernel_spec(op), config)
    outer = current_scope()
    base = outer.overlays if outer.executor is self else ()
    with _SCOPE(Scope(self, base + tuple(configs.items()))):
      yield self

  @contextlib.contextmanager
  def _as_current(self) -> Iterator[Executor]:
    with _SCOPE(Scope(self)):
      yield self

  def __enter__(self) -> Executor:
    cm = self._as_current()
    self._entered.__dict__.setdefault("stack", []).append(cm)
    return cm.__enter__()

  def __exit__(self, *exc) -> None:
    self._entered.stack.pop().__exit__(*exc)

  def __call__(self, op: Callable, *args, **kwargs):
    """Runs ``op(*args, **kwargs)`` with this executor (ejkernel-style call)."""
    with self:
      return op(*args, **kwargs)

  @staticmethod
  def _check_config(spec: KernelSpec, config: KernelConfig) -> None:
    classes = spec.config_classes()
    if not isinstance(config, classes):
      names = " or ".join(c.__name__ for c in classes)
      raise TypeError(f"config for {spec.op} must be a {names}, got {type(config).__name__}")

  # -- selection ---------------------------------------------------------------

  def select(
    self,
    op: str,
    avals: Sequence[Any],
    target: str,
    params: Mapping,
    *,
    pinned: Optional[KernelConfig] = None,
    overlays: Sequence[tuple[str, KernelConfig]] = (),
    make_fn: Optional[Callable[[KernelConfig], Callable]] = None,
    dry_run: bool = False,
  ) -> Selection:
    """The config of one kernel call.

    Args:
      op: kernel name.
      avals: its operands' final avals.
      target: see ``registry.TARGETS``.
      params: its static params.
      pinned: the call's ``config=``: a config, or an implementation's name
        (``"pallas"``, ``"xla"``) with the heuristic's blocks.
      overlays: the scope's overlays.
      make_fn: ``config -> function of the operands`` running the kernel with
        that config, for autotuning.
      dry_run: never autotune (``explain``).
    """
    spec = kernel_spec(op)
    key = cache_key(spec, avals, target, params)
    kind = _device_kind(target)
    target = device_target(target, kind)
    make = functools.partial(Selection, op, key, target, kind)

    pinned = pinned if pinned is not None else self._pins.get(op)
    if isinstance(pinned, str):  # an implementation pinned by name, its blocks the heuristic's
      config = _named(spec.space(pinned).heuristic(avals, target, **params), pinned)
      return self._validated(spec, avals, target, params, make(config, "pinned"), strict=True)
    if pinned is not None:
      return self._validated(spec, avals, target, params, make(pinned, "pinned"), strict=True)
    for name, config in reversed(tuple(overlays)):
      if name == op:
        return self._validated(spec, avals, target, params, make(config, "overlay"), strict=True)
    stale = []  # cached configs this call cannot run (e.g. under XLA's determinism flags)
    with self._lock:
      hit = self._memory.get((kind, key))
      if hit is not None:
        return hit
      for source, entries in (
        ("disk", self._disk_entries(kind, spec)),
        ("default", shipped_defaults(kind, spec.op, spec.version)),
      ):
        config = self._from_entry(spec, entries.get(key))
        if config is None:
          continue
        reason = unsupported_reason(spec, avals, target, config, params)
        if reason is not None:
          stale.append(f"{source} config {config} skipped: {reason}")
          log.info("%s (%s): %s", spec.op, key, stale[-1])
          continue
        chosen = make(config, source, "; ".join(stale))
        self._memory[(kind, key)] = dataclasses.replace(chosen, source="memory")
        return chosen
      if self.policy == "error":
        raise LookupError(
          f"pallax: no cached config for {key} on {kind!r} that this call can run"
          f"{''.join(f' ({s})' for s in stale)} and the executor policy is 'error'"
          " (autotune it with pallax.autotune)"
        )
      if self.policy == "autotune" and not dry_run:
        if make_fn is not None and _target_runs_here(target):
          return self._tune(spec, avals, target, params, key, kind, make_fn)
        note = f"autotune needs a {target} device here; used the heuristic"
      else:
        note = ""
      heuristic, why = heuristic_choice(spec, avals, target, params)
      note = "; ".join(n for n in (*stale, note, why) if n)
      return self._validated(spec, avals, target, params, make(heuristic, "heuristic", note))

  def _validated(self, spec, avals, target, params, chosen: Selection, strict=False) -> Selection:
    """``chosen``, or the XLA program if its kernel cannot run this call."""
    reason = unsupported_reason(spec, avals, target, chosen.config, params)
    if reason is None:
      return chosen
    if strict:
      raise ValueError(
        f"pallax: {chosen.source} config {chosen.config} cannot run {spec.op} on {target}: {reason}"
      )
    if not xla_allowed(target):
      raise NotImplementedError(f"pallax: {spec.op} has no {target} kernel for this call: {reason}")
    skipped = f"{chosen.config.implementation} skipped: {reason}; running the XLA program"
    note = "; ".join(n for n in (chosen.note, skipped) if n)
    log.info("%s (%s): %s", spec.op, chosen.key, note)
    config = _named(chosen.config, XLA)
    return dataclasses.replace(chosen, config=config, note=note)

  def _disk_entries(self, kind: str, spec: KernelSpec) -> dict[str, dict]:
    if self.disk is None:
      return {}
    entries = self._disk_files.get((kind, spec.op))
    if entries is None:
      entries = self._disk_files[(kind, spec.op)] = self.disk.load(kind, spec.op, spec.version)
    return entries

  @staticmethod
  def _from_entry(spec: KernelSpec, entry: Optional[dict]) -> Optional[KernelConfig]:
    if entry is None:
      return None
    try:
      return spec.config_from_dict(entry["config"])
    except (AttributeError, KeyError, TypeError, ValueError) as err:
      log.warning("ignoring unreadable cached config for %s: %s (%s)", spec.op, entry, err)
      return None

  # -- autotuning --------------------------------------------------------------

  def _tune(self, spec, avals, target, params, key, kind, make_fn) -> Selection:
    candidates = []
    failures = []
    for config in candidate_configs(spec, avals, target, params):
      reason = unsupported_reason(spec, avals, target, config, params)
      untimed = None if reason else _interpreted_outside_switch(spec, target, config)
      if reason is None and untimed is None:
        candidates.append(config)
      else:
        failures.append((config, f"not supported: {reason}" if reason else f"not timed: {untimed}"))
    if self.timer is not None:
      benchmark = autotune_lib.timer_benchmark(self.timer)
    else:
      inputs = spec.inputs and (lambda avals, seed: spec.inputs(avals, seed, **params))
      benchmark = autotune_lib.wall_clock_benchmark(make_fn, avals, inputs=inputs)
    result = autotune_lib.tune(spec.op, candidates, benchmark)
    result = dataclasses.replace(result, failures=tuple(failures) + result.failures)
    chosen = Selection(
      spec.op,
      key,
      target,
      kind,
      result.best,
      "autotune",
      f"fastest of {len(result.timings)} candidates "
      f"({len(result.failures)} skipped): {result.time_s * 1e6:.1f} us",
    )
    self._memory[(kind, key)] = dataclasses.replace(chosen, source="memory")
    self.tune_log.append((chosen, result))
    if self.disk is not None:
      entry = {
        "config": result.best.to_dict(),
        "time_s": result.time_s,
        "candidates": len(result.timings),
        "skipped": len(result.failures),
      }
      self._disk_entries(kind, spec)[key] = entry
      self.disk.store(kind, spec.op, spec.version, {key: entry})
    return chosen

  def tune(
    self,
    op: str,
    avals: Sequence[Any],
    target: str,
    params: Mapping,
    make_fn: Callable[[KernelConfig], Callable],
  ) -> Selection:
    """Autotunes one kernel call now, whatever is cached, and stores the winner."""
    spec = kernel_spec(op)
    kind = _device_kind(target)
    target = device_target(target, kind)
    with self._lock:
      return self._tune(
        spec, avals, target, params, cache_key(spec, avals, target, params), kind, make_fn
      )


_default: Optional[Executor] = None


def default_executor() -> Executor:
  """The executor used where no other is in scope (created on first use)."""
  global _default
  if _default is None:
    _default = Executor()
  return _default


def set_default_executor(executor: Executor) -> None:
  global _default
  _default = executor
  jax.clear_caches()
