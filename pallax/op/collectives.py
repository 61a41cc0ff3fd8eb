"""Per-shard programs: how an op computes a call whose sharded factor its kernel cannot split.

A kernel computes one device's block of a call when the call is sharded along
batch-like factors. When a factor it cannot split is sharded (a matmul's
contracted K, a loss's vocabulary, attention's key sequence), the op supplies
one or more ``Program``s for that factor: functions run on each device, inside
the partitioning rule's per-device body where the mesh axes are bound, that
combine the kernel's work on local blocks with JAX collectives (``psum``,
``ppermute``, ``all_gather``, ``all_to_all``) over the mesh axes holding the
factor. Where several programs can compute a call, each states its cost for
the call's shapes and mesh (bytes moved, latency) and the cheapest runs. The
choice is logged (logger ``pallax.sharding``, level DEBUG) and recorded:
``explain_programs`` compiles a function and returns each choice with every
candidate's cost.

A program is plain JAX, so JAX's own rules for the collectives apply to it:
``Program.jvp`` and ``Program.vjp`` derive the programs of an op's tangent and
backward stages (``ppermute`` transposes to the inverse permutation,
``all_gather`` to ``psum_scatter``), which keeps ``grad`` and ``jvp`` on the
ring or the gather that the forward used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

log = logging.getLogger("pallax.sharding")


@dataclasses.dataclass(frozen=True)
class Shards:
  """What a per-shard program knows of how its call is partitioned.

  factors: each sharded factor's mesh axes.
  summed: per result, the mesh axes it is summed over (those of the reduced
    factors that are sharded).
  mesh_shape: the size of each mesh axis.
  shared: the factors sharded over mesh axes that another factor of the call
    also uses (each device then holds a diagonal block: queries and keys split
    over the same sequence axis).
  """

  factors: Mapping[str, tuple[str, ...]]
  summed: Sequence[tuple[str, ...]]
  mesh_shape: Mapping[str, int] = dataclasses.field(default_factory=dict)
  shared: frozenset[str] = frozenset()

  def psum(self, x: jax.Array, i: int) -> jax.Array:
    """``x`` summed across the devices that result ``i`` is summed over."""
    return jax.lax.psum(x, self.summed[i]) if self.summed[i] else x

  def axes(self, factor: str) -> tuple[str, ...]:
    """The mesh axes ``factor`` is sharded over (empty: not sharded)."""
    return tuple(self.factors.get(factor) or ())

  def size(self, factor: str) -> int:
    """How many blocks ``factor`` is split into (1: not sharded)."""
    return math.prod(self.mesh_shape[a] for a in self.axes(factor))


@dataclasses.dataclass(frozen=True)
class Program:
  """A per-shard program for calls in which some of ``factors`` are sharded.

  Attributes:
    name: how logs and ``explain_programs`` name it (``"ring"``,
      ``"all_gather"``).
    factors: the factors it computes sharded, in any combination; a call in
      which one of them is sharded runs a program whose ``factors`` hold every
      sharded one of them.
    run: ``(shards, *args) -> results``: one device's results from its blocks
      of the operands, with collectives over ``shards.axes(factor)``.
    cost: ``(shards, *avals) -> float``: what the program costs on one device
      (``avals`` are the per-device operand shapes), in any unit the op's
      programs share (bytes moved, with latency as bytes). None: 0, for an
      op with one program.
    shares_axes: whether it also computes calls in which one of its factors
      is sharded over mesh axes that another factor already uses (a ring over
      the key blocks while each device holds one query block of the same
      axis); otherwise such a factor is replicated.
    takes_params: ``run`` is called as ``run(shards, *args, params=...)``
      with the primitive call's full params (a ``custom_op``'s program binds
      its kernel with them: ``op.primitive.kernel.bind(*args, **params)``).
  """

  name: str
  factors: tuple[str, ...]
  run: Callable[..., Sequence[jax.Array]]
  cost: Callable[..., float] | None = None
  shares_axes: bool = False
  takes_params: bool = False

  def jvp(self, primals: int) -> Program:
    """The tangent stage's program: ``(shards, *primals, *tangents) -> tangents of the results``.

    JAX's JVP of ``run``: the collectives' own JVP rules apply (a ring of the
    operands rings their tangents too). The cost is the forward's, called with
    the stage's operands (the primals lead).
    """
    return dataclasses.replace(self, run=functools.partial(_jvp_run, self.run, primals))

  def vjp(self, primals: int) -> Program:
    """The backward stage's program: ``(shards, *primals, *cotangents) -> cotangents of primals``.

    JAX's VJP of ``run``: each collective is transposed by JAX's rule (a
    ``ppermute`` ring carries the cotangents around the inverse ring, an
    ``all_gather`` becomes a ``psum_scatter``). The forward is recomputed. The
    cost is the forward's, called with the stage's operands (the primals lead).
    """
    return dataclasses.replace(self, run=functools.partial(_vjp_run, self.run, primals))


def _jvp_run(run, primals: int, shards: Shards, *args, **kw) -> list:
  fn = lambda *p: tuple(run(shards, *p, **kw))
  return list(jax.jvp(fn, args[:primals], args[primals:])[1])


def _vjp_run(run, primals: int, shards: Shards, *args, **kw) -> list:
  outs, pullback = jax.vjp(lambda *p: tuple(run(shards, *p, **kw)), *args[:primals])
  cts = tuple(args[primals:])
  if len(cts) != len(outs):
    raise ValueError(
      f"Program.vjp: {len(cts)} cotangents after {primals} primals for a program with "
      f"{len(outs)} results"
    )
  return list(pullback(cts))


def ragged_all_to_all(
  operand: jax.Array,
  output: jax.Array,
  input_offsets: jax.Array,
  send_sizes: jax.Array,
  output_offsets: jax.Array,
  recv_sizes: jax.Array,
  *,
  axis_name: str | tuple[str, ...],
) -> jax.Array:
  """``jax.lax.ragged_all_to_all`` on GPU and TPU; on CPU (XLA lacks it) a padded ``all_to_all``.

  Each device sends rows ``operand[input_offsets[j]:][:send_sizes[j]]`` to
  device ``j``, where they land at ``output[output_offsets[j]:]`` (offsets
  in the receiver's ``output``, given by the sender), and receives
  ``recv_sizes[i]`` rows from device ``i``; rows of ``output`` that nothing
  lands on keep their values. The CPU program sends every device a block of
  ``operand``'s row count (the bytes of an ``all_gather`` of ``operand``)
  with the sizes masking it, and scatters what arrives; the two lower per
  platform (``lax.platform_dependent``), so one program compiles for all.
  One slice a device: the offset and size arrays have one entry per device
  of ``axis_name``.
  """
  args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  devices = lax.axis_size(axis_name)
  for name, a in zip(("input_offsets", "send_sizes", "output_offsets", "recv_sizes"), args[2:]):
    if a.shape != (devices,):
      raise ValueError(
        f"ragged_all_to_all: {name} must have one entry per device of {axis_name} "
        f"({devices}), got shape {a.shape}"
      )
  return lax.platform_dependent(
    *args,
    cpu=functools.partial(_padded_all_to_all, axis_name=axis_name),
    default=functools.partial(lax.ragged_all_to_all, axis_name=axis_name),
  )


def _padded_all_to_all(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
) -> jax.Array:
  rows, devices = operand.shape[0], send_sizes.shape[0]
  step = jnp.arange(rows, dtype=jnp.int32)
  take = jnp.clip(input_offsets[:, None] + step, 0, max(rows - 1, 0))
  sent = step < send_sizes[:, None]
  blocks = jnp.where(sent.reshape(*sent.shape, *[1] * (operand.ndim - 1)), operand[take], 0)
  got = lax.all_to_all(blocks.astype(operand.dtype), axis_name, 0, 0, tiled=True)
  lands = lax.all_to_all(output_offsets[:, None], axis_name, 0, 0, tiled=True)[:, 0]
  into = jnp.where(step < recv_sizes[:, None], lands[:, None] + step, output.shape[0])
  got = got.reshape(devices * rows, *operand.shape[1:])
  return output.at[into.reshape(-1)].set(got, mode="drop")


@dataclasses.dataclass(frozen=True)
class Choice:
  """Which per-shard program computes a partitioned call, and why.

  op: the op's name.
  sharded: the sharded factors that needed a program, with their mesh axes.
  program: the name of the program that runs.
  costs: every candidate's cost, by name (candidates cover the sharded
    factors; the cheapest runs, the first declared on a tie).
  reason: one line saying why.
  """

  op: str
  sharded: Mapping[str, tuple[str, ...]]
  program: str
  costs: Mapping[str, float]
  reason: str

  def __str__(self) -> str:
    return f"{self.op}: {self.reason}"


def program_factors(programs: Sequence[Program]) -> frozenset[str]:
  """The factors some program of ``programs`` computes sharded."""
  return frozenset(f for p in programs for f in p.factors)


def choose(
  op: str, programs: Sequence[Program], shards: Shards, avals: Sequence[Any]
) -> Program | None:
  """The program that computes a call partitioned as ``shards`` says; None: the kernel does.

  Args:
    op: the op's name, for errors and the record.
    programs: the op's programs (``Dims.programs``).
    shards: how the call is partitioned.
    avals: the per-device operand shapes.

  Raises:
    ValueError: factors are sharded that no single program computes together.
  """
  sharded = {f: shards.axes(f) for f in sorted(program_factors(programs)) if shards.axes(f)}
  if not sharded:
    return None
  shared = shards.shared & set(sharded)
  candidates = [
    p for p in programs if set(sharded) <= set(p.factors) and (p.shares_axes or not shared)
  ]
  if not candidates:
    raise ValueError(
      f"{op}: factors {sharded} are sharded and no per-shard program computes them together "
      f"(programs: {', '.join(f'{p.name} for {p.factors}' for p in programs)}); "
      "shard fewer of them"
    )
  costs = {p.name: float(p.cost(shards, *avals)) if p.cost else 0.0 for p in candidates}
  best = min(candidates, key=lambda p: costs[p.name])
  where = ", ".join(f"{f} over {axes}" for f, axes in sharded.items())
  if len(candidates) == 1:
    why = "the only program for this sharding"
  else:
    others = ", ".join(f"{n} {c:.4g}" for n, c in costs.items() if n != best.name)
    why = f"cost {costs[best.name]:.4g} against {others}"
  choice = Choice(op, sharded, best.name, costs, f"{where}: program {best.name} ({why})")
  log.debug("%s", choice)
  for record in _RECORDS:
    record.append(choice)
  return best


# The lists that ``recording`` contexts collect choices into, innermost last.
_RECORDS: list[list[Choice]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[Choice]]:
  """Collects the program choices made while the context is open (at compile time)."""
  record: list[Choice] = []
  _RECORDS.append(record)
  try:
    yield record
  finally:
    del _RECORDS[next(i for i, r in enumerate(_RECORDS) if r is record)]


def explain_programs(fn: Callable, *args: Any, **kwargs: Any) -> list[Choice]:
  """The per-shard programs that compiling ``jax.jit(fn)(*args, **kwargs)`` chooses, and why.

  Programs are chosen when XLA partitions the program, so this lowers and
  compiles (nothing runs); the function is wrapped afresh so that JAX's
  caches of earlier compilations do not hide the choices.

  Args:
    fn: the function, called with ``args`` placed as they would be
      (``NamedSharding``-ed arrays or ``jax.ShapeDtypeStruct``s with a
      sharding).
    *args: its positional arguments.
    **kwargs: its keyword arguments (static).

  Returns:
    One ``Choice`` per partitioned call that needed a program, in order.
  """
  fresh = jax.jit(lambda *a: fn(*a, **kwargs))
  with recording() as record:
    fresh.lower(*args).compile()
  return record
