"""What each op family gives pallax's tools: self-check, verify sweep, bench suite, work model.

Every package under ``pallax.kernels`` is one op family, and its ``tools.py``
module declares ``TOOLS``: one ``OpTools`` per public op of the family, with
the op's self-check case (``python -m pallax``), its ``pallax.verify`` sweep
entries, its ``python -m pallax.bench`` suite and its FLOP/byte model
(``pallax.roofline``). The tools read them through ``registered()``, which
imports every family's ``tools.py`` the first time a tool asks, so adding an
op edits its own family's files and no central table, and ``import pallax``
imports none of them.

Families come in alphabetical order, each family's ops in the order of its
``TOOLS``: the order of the self-check report, the sweep and the benches.
A ``tools.py`` imports this module, its primitives and ``pallax.roofline``,
never the tools themselves (``pallax.selfcheck``, ``pallax.verify``,
``pallax.bench``): they read ``registered()`` when they are imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "BenchSuite",
  "OpTools",
  "STAGES",
  "SelfCheck",
  "SweepOp",
  "bench_suites",
  "registered",
  "self_checks",
  "sweep_ops",
  "work_models",
]

STAGES = ("fwd", "bwd", "jvp")


@dataclasses.dataclass(frozen=True)
class SelfCheck:
  """One op's self-check.

  make_args: ``(rng, dtype, small) -> args``; ``small`` for interpret runs and quick mode.
  op: the pallax function. reference: the same maths in plain jnp; run in
    float64 it is the oracle, in the input dtype it is the timing baseline.
    Integer arguments (lengths, page tables) stay integers in both.
  dtypes: the floating dtypes checked.
  differentiable: False for an inference op: no gradient is checked and the
    report's gradient column reads ``—``.
  """

  name: str
  make_args: Callable[[np.random.Generator, jnp.dtype, bool], Sequence[jax.Array]]
  op: Callable
  reference: Callable
  dtypes: tuple = (jnp.float32, jnp.bfloat16)
  differentiable: bool = True


@dataclasses.dataclass(frozen=True)
class SweepOp:
  """A public op as ``pallax.verify``'s sweep calls it: ``fn(*arrays)`` with shapes from a size.

  ``pallax.verify.Op`` is this class. The last ``masks`` arrays are boolean
  masks, and the ``ints`` arrays before them int32 (lengths, indices): neither
  is differentiated. ``stages``: those the op has (an inference op has no
  ``bwd`` or ``jvp``). ``candidates``: whether the default sweep compiles the
  autotuning candidates at the first size (``candidate_cases``).
  """

  fn: Callable
  shapes: Callable[..., list[tuple[int, ...]]]
  sizes: tuple[tuple[int, ...], ...]
  quick: tuple[tuple[int, ...], ...]
  masks: int = 0
  ints: int = 0
  stages: tuple[str, ...] = STAGES
  candidates: bool = True


@dataclasses.dataclass(frozen=True)
class BenchSuite:
  """An op's cases in ``bench/``: the pytest file and the ``-k`` expression selecting them.

  unit: what a case's ``shape`` multiplies out to, for the plots' axis
    (``"M x K x N"``); None: the elements of ``x``.
  """

  file: str
  keyword: str
  unit: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class OpTools:
  """Everything the tools know of one public op, ``pallax.<op>``.

  check: its self-check case, named ``op``.
  sweep: its ``pallax.verify`` sweep entries by name (the op plain, and its
    features: masks, segments, soft caps...); names are unique across ops.
  bench: its ``python -m pallax.bench`` suite.
  work: its FLOP/byte model, ``pallax.roofline.<work.__name__>``.
  aliases: other public functions that run this op's kernels (a peer's
    signature of the same op), covered by its tools.
  composites: public functions built on this op (``pallax.moe`` on
    ``ragged_dot``) by name, each with a bench suite of its own; their
    kernels are this op's, so its check and sweep cover them.
  """

  op: str
  check: SelfCheck
  sweep: Mapping[str, SweepOp]
  bench: BenchSuite
  work: Callable
  aliases: tuple[str, ...] = ()
  composites: Mapping[str, BenchSuite] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.check.name != self.op:
      raise ValueError(f"{self.op}: check is named {self.check.name!r}, not after the op")
    if not self.sweep:
      raise ValueError(f"{self.op}: sweep must name at least one entry")


def _family_tools(package: str) -> tuple[OpTools, ...]:
  """The ``TOOLS`` of family ``package``'s ``tools.py``, checked."""
  tools = importlib.import_module(f"pallax.kernels.{package}.tools").TOOLS
  if not tools or not all(isinstance(t, OpTools) for t in tools):
    raise TypeError(f"pallax.kernels.{package}.tools.TOOLS must be a non-empty tuple of OpTools")
  return tuple(tools)


@functools.cache
def registered() -> tuple[OpTools, ...]:
  """Every family's ``OpTools``: families alphabetically, each in its ``TOOLS`` order.

  Imports ``tools.py`` of every package under ``pallax.kernels`` (once).

  Raises:
    ValueError: two ops, aliases or sweep entries share a name.
  """
  import pallax.kernels

  found: list[OpTools] = []
  for module in sorted(pkgutil.iter_modules(pallax.kernels.__path__), key=lambda m: m.name):
    if module.ispkg:
      found += _family_tools(module.name)
  for kind, names in (
    ("op", [n for t in found for n in (t.op, *t.aliases, *t.composites)]),
    ("sweep entry", [n for t in found for n in t.sweep]),
  ):
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
      raise ValueError(f"pallax.kernels: {kind} names registered twice: {twice}")
  return tuple(found)


def self_checks() -> tuple[SelfCheck, ...]:
  """Every op's self-check case, in report order."""
  return tuple(t.check for t in registered())


def sweep_ops() -> dict[str, SweepOp]:
  """Every op's sweep entries by name, a new dict each call."""
  return {name: entry for t in registered() for name, entry in t.sweep.items()}


def bench_suites() -> dict[str, BenchSuite]:
  """Every op's bench suite, and its composites', by name (each op before its composites)."""
  suites = {}
  for t in registered():
    suites.update({t.op: t.bench, **t.composites})
  return suites


def work_models() -> dict[str, Callable]:
  """Every op's FLOP/byte model by its function name (ops may share one)."""
  return {t.work.__name__: t.work for t in registered()}
