"""What ``pallax.verify`` compiles: op cases, their kernel calls, and the configs to try.

A case is one public op at one size and dtype, in one stage: ``fwd`` (the op),
``bwd`` (its gradient: forward and backward kernels; log_softmax's backward
alone, as it takes the input) or ``jvp`` (forward and
tangent kernels). Tracing a case gives its kernel calls; a job is one kernel
call compiled for one target with one config the executor can choose there:
the heuristic's, every autotuning candidate ``supports`` accepts, and shipped
defaults. Identical jobs from different cases (the forward kernel appears in
most stages) are compiled once.

The heuristic's config is compiled at every case; the candidates at every
case only in an exhaustive sweep, else at each op's candidate cases (its first
size in float32: the bench's shape with the largest blocks' footprint). A
cold exhaustive sweep of every op takes about an hour on 2 cores, the default
one under 20 minutes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn

from pallax import family
from pallax.executor.cache import shipped_defaults
from pallax.executor.config import KernelConfig
from pallax.executor.executor import (
  cache_key,
  candidate_configs,
  device_target,
  heuristic_config,
  unsupported_reason,
)
from pallax.executor.implementation import implementation
from pallax.executor.registry import kernel_spec, registered_ops
from pallax.executor.tools import kernel_calls
from pallax.op import op_params
from pallax.verify.targets import Target

STAGES = family.STAGES
DTYPES = ("float32", "bfloat16", "float16")

# A public op as the sweep calls it (``pallax.verify.Op``).
Op = family.SweepOp

# Every public op's entries, each op family's from its ``kernels/<family>/tools.py``
# (``pallax.family``); ``register_op`` adds a user's.
OPS: dict[str, Op] = family.sweep_ops()


# pallax's own ops: the sweep when no ops are named (``register_op`` adds others).
LIBRARY_OPS = tuple(OPS)
MODULES_ENV = "PALLAX_VERIFY_MODULES"


def register_op(name: str, op: Op) -> None:
  """Adds a user's op (``pallax.custom_op``) to the sweep under ``name``.

  Call it when the op's module is imported; ``import_modules`` (the command
  line's ``--module``) imports that module here and in the compile workers.

  Raises:
    ValueError: another op is registered under ``name``.
  """
  if not isinstance(op, Op):
    raise TypeError(f"op must be a pallax.verify.Op, got {type(op).__name__}")
  if OPS.get(name, op) is not op:
    raise ValueError(f"name: an op is already registered as {name!r} in pallax.verify")
  OPS[name] = op


def import_modules(names: Sequence[str]) -> None:
  """Imports modules that register ops (``register_op``), here and in the compile workers.

  The workers, started from this process's environment, import the modules
  named in ``PALLAX_VERIFY_MODULES`` (``worker.py``).
  """
  known = [n for n in os.environ.get(MODULES_ENV, "").split(",") if n]
  for name in names:
    importlib.import_module(name)
    if name not in known:
      known.append(name)
  os.environ[MODULES_ENV] = ",".join(known)


@dataclasses.dataclass(frozen=True)
class Case:
  """One op at one size and dtype in one stage; ``id`` names it in jobs and reports."""

  op: str
  stage: str
  size: tuple[int, ...]
  dtype: str

  @property
  def id(self) -> str:
    return f"{self.op}:{self.stage}:{'x'.join(map(str, self.size))}:{self.dtype}"

  @classmethod
  def from_id(cls, case_id: str) -> Case:
    op, stage, size, dtype = case_id.split(":")
    return cls(op, stage, tuple(int(n) for n in size.split("x")), dtype)

  def structs(self) -> list[jax.ShapeDtypeStruct]:
    op = OPS[self.op]
    shapes = op.shapes(*self.size)
    floats = len(shapes) - op.masks - op.ints
    dtypes = [self.dtype] * floats + ["int32"] * op.ints + ["bool"] * op.masks
    return [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]

  def function(self) -> Callable:
    """The case as a function of its op's arrays (masks last)."""
    op = OPS[self.op]
    if self.stage == "fwd":
      return op.fn
    n = len(self.structs()) - op.masks - op.ints
    if self.stage == "jvp":
      return lambda *args: jax.jvp(lambda *x: op.fn(*x, *args[n:]), args[:n], args[:n])
    loss = lambda *args: sum(jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(op.fn(*args)))
    return jax.grad(loss, argnums=tuple(range(n)))


def cases(ops: Optional[Iterable[str]] = None, quick: bool = False) -> list[Case]:
  """The sweep of ``ops`` (default: pallax's own): each size in float32 and bfloat16.

  The first size is also swept in float16.

  ``quick``: two sizes, the first in float32 and the second in bfloat16.
  """
  out = []
  for name in ops or LIBRARY_OPS:
    op = OPS[name]
    if quick:
      sized = [(op.quick[0], "float32"), (op.quick[1], "bfloat16")]
    else:
      sized = [(s, d) for s in op.sizes for d in DTYPES[:2]] + [(op.sizes[0], "float16")]
    out += [Case(name, stage, size, dtype) for size, dtype in sized for stage in op.stages]
  return out


def candidate_cases(case_list: Sequence[Case]) -> set[str]:
  """The ids of the cases of ``case_list`` at their op's first size in float32.

  Ops with ``candidates=False`` have none.
  """
  return {
    case.id
    for case in case_list
    if OPS[case.op].candidates and case.size == OPS[case.op].sizes[0] and case.dtype == "float32"
  }


@functools.cache
def kernel_calls_of(case_id: str) -> tuple:
  """The kernel calls (jaxpr equations) of a case, in trace order."""
  case = Case.from_id(case_id)
  return tuple(kernel_calls(jax.make_jaxpr(case.function())(*case.structs()).jaxpr))


@dataclasses.dataclass
class Job:
  """One kernel call compiled for one target with one config.

  ``case`` and ``call`` locate the call (the ``call``-th kernel call of the
  case's trace), so a worker process can rebuild it. ``sources`` says why the
  config is tried (``heuristic``, ``candidate``, ``default``, ``pinned``) and
  ``cases`` every case that has this call. ``kernel_keys``: what each of the
  config's kernels is built from (``ConfigSpace.kernel_keys``);
  ``kernels_from``: where other jobs of the call compile every one of them,
  the job compiling each, by kernel name: this job's result is theirs
  (``shared_result``), and it is not compiled itself.
  """

  target: str
  kernel: str
  key: str
  config: dict
  case: str
  call: int
  sources: set = dataclasses.field(default_factory=set)
  cases: list = dataclasses.field(default_factory=list)
  kernel_keys: dict = dataclasses.field(default_factory=dict)
  kernels_from: Optional[dict[str, str]] = None

  @property
  def id(self) -> str:
    return f"{self.target}|{self.key}|{json.dumps(self.config, sort_keys=True)}"

  def message(self) -> dict:
    """What a worker needs to compile it."""
    return {
      "id": self.id,
      "target": self.target,
      "case": self.case,
      "call": self.call,
      "config": self.config,
    }


def configs_for(
  eqn: JaxprEqn, target: Target, heuristic_only: bool = False, preferred: bool = False
) -> list[tuple[str, KernelConfig]]:
  """The kernel configs the executor can choose for ``eqn`` on ``target``, with sources.

  As the executor chooses on a device of the target's kind (Mosaic GPU
  preferred on an H100). ``preferred``: with ``heuristic_only``, the
  candidates of the preferred implementations (``Implementation.preferred``)
  still. Configs ``supports`` rejects are left out: the executor never runs
  them.
  """
  spec = kernel_spec(eqn.primitive.name)
  avals = [v.aval for v in eqn.invars]
  params = op_params(eqn.params)
  where = device_target(target.platform, target.device_kind)
  found = [("heuristic", heuristic_config(spec, avals, where, params))]
  if not heuristic_only or preferred:
    candidates = candidate_configs(spec, avals, where, params)
    if heuristic_only:
      candidates = [c for c in candidates if _preferred(c.implementation)]
    found += [("candidate", c) for c in candidates]
  if not heuristic_only:
    entry = shipped_defaults(target.device_kind, spec.op, spec.version).get(
      cache_key(spec, avals, target.platform, params)
    )
    if entry is not None:
      found.append(("default", spec.config_from_dict(entry["config"])))
  return [
    (source, config)
    for source, config in found
    if config.implementation != "xla"
    and unsupported_reason(spec, avals, where, config, params) is None
  ]


def _preferred(name: str) -> bool:
  return name not in ("pallas", "xla") and implementation(name).preferred


def call_key(eqn: JaxprEqn, target: Target) -> str:
  """The executor's cache key of kernel call ``eqn`` on ``target``: kernel, avals, params."""
  spec = kernel_spec(eqn.primitive.name)
  return cache_key(spec, [v.aval for v in eqn.invars], target.platform, op_params(eqn.params))


def jobs_for(
  case_list: Sequence[Case],
  targets: Sequence[Target],
  heuristic_only: bool = False,
  pinned: Optional[dict[str, KernelConfig]] = None,
  candidates_at: Optional[set[str]] = None,
  implementations: Optional[Sequence[str]] = None,
) -> list[Job]:
  """The deduplicated jobs of ``case_list`` on ``targets``.

  ``pinned`` maps kernel names to a config to compile instead of the
  executor's choices (for checking a config by hand). ``candidates_at``: the
  ids of the cases whose calls get the candidates too (default: every case).
  ``implementations``: only configs of these (``"pallas"``, ``"triton_raw"``,
  ``"pallas_mosaic_gpu"``). The preferred implementations' candidates (Mosaic
  GPU's, which take no float32 and whose SMEM and registers vary with the head
  dim) are compiled at every case.
  """
  jobs: dict[str, Job] = {}
  configs: dict[tuple, list] = {}  # per call and target: the forward is in every stage
  for case in case_list:
    only = heuristic_only or (candidates_at is not None and case.id not in candidates_at)
    preferred = not heuristic_only
    for index, eqn in enumerate(kernel_calls_of(case.id)):
      name = eqn.primitive.name
      if pinned is not None and name not in pinned:
        continue
      for target in targets:
        key = call_key(eqn, target)
        if (target.name, key, only, preferred) not in configs:
          configs[target.name, key, only, preferred] = (
            [("pinned", pinned[name])]
            if pinned is not None
            else configs_for(eqn, target, only, preferred)
          )
        for source, config in configs[target.name, key, only, preferred]:
          if implementations is not None and config.implementation not in implementations:
            continue
          job = Job(target.name, name, key, config.to_dict(), case.id, index)
          if job.id not in jobs:
            jobs[job.id] = dataclasses.replace(job, kernel_keys=_kernel_keys(eqn, target, config))
          job = jobs[job.id]
          job.sources.add(source)
          if case.id not in job.cases:
            job.cases.append(case.id)
  return _share_kernels(list(jobs.values()))


def _kernel_keys(eqn: JaxprEqn, target: Target, config: KernelConfig) -> dict:
  """What each kernel of ``config`` is built from on this call (``ConfigSpace.kernel_keys``)."""
  keys = kernel_spec(eqn.primitive.name).space(config.implementation).kernel_keys
  if keys is None:
    return {}
  where = device_target(target.platform, target.device_kind)
  return dict(keys([v.aval for v in eqn.invars], where, config, **op_params(eqn.params)))


def _share_kernels(jobs: list[Job]) -> list[Job]:
  """Chooses the jobs that compile the kernels configs of one call share: sets ``kernels_from``.

  Per call and target, greedily, the job compiling the most kernels no chosen
  one does (the heuristic's config first, then the earlier on a tie); every
  other job takes its kernels from those.
  """
  calls: dict[tuple[str, str], list[Job]] = {}
  for job in jobs:
    if job.kernel_keys:
      calls.setdefault((job.target, job.key), []).append(job)
  for group in calls.values():
    compiled: dict[tuple, str] = {}  # (kernel name, key) -> the job compiling it
    kernels = {item for job in group for item in job.kernel_keys.items()}
    fresh = lambda job: sum(item not in compiled for item in job.kernel_keys.items())
    chosen = set()
    while len(compiled) < len(kernels):
      job = max(group, key=lambda job: (fresh(job), "heuristic" in job.sources))
      chosen.add(job.id)
      compiled.update({item: job.id for item in job.kernel_keys.items() if item not in compiled})
    for job in group:
      if job.id not in chosen:
        job.kernels_from = {name: compiled[name, key] for name, key in job.kernel_keys.items()}
  return jobs


def library_kernels() -> list[str]:
  """The registered kernels of pallax's own ops (not those a user or a test registers)."""
  return [
    op for op in registered_ops() if kernel_spec(op).heuristic.__module__.startswith("pallax.")
  ]


def unswept_kernels(case_list: Sequence[Case]) -> list[str]:
  """The kernels of pallax's ops that no case of ``case_list`` calls."""
  called = {eqn.primitive.name for case in case_list for eqn in kernel_calls_of(case.id)}
  return sorted(set(library_kernels()) - called)
