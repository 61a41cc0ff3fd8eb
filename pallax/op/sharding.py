"""Sharding: an op's einsum-like factor names and the ``custom_partitioning`` rule built from them.

``Dims`` says which operand and result dimensions are the same factor; a
primitive call lowered under a mesh is wrapped by ``partitioned`` so that each
device runs the kernel on its shard (batch-like factors), or one of the op's
per-shard programs with collectives (a factor the kernel cannot split:
``pallax.op.collectives``), never on gathered operands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.extend.core import Primitive
from jax.sharding import NamedSharding, PartitionSpec

from pallax import _jax_private
from pallax.op.collectives import Program, Shards, choose, program_factors


@dataclasses.dataclass(frozen=True)
class Dims:
  """Einsum-like factor names per operand and result dimension.

  A factor shared by operands and a result is batch-like and shards freely; a
  factor in ``replicated`` must not be sharded (e.g. the normalised axis); a
  factor present in an operand but absent from a result is reduced, so a result
  computed from a sharded factor is summed across the devices holding it.

  ``programs`` are for factors the kernel cannot split (``Program``): when
  one of their factors is sharded, the cheapest program that computes it
  runs on each device instead of the kernel (a matmul with a fused bias or
  activation sums the partial products before the epilogue; a loss combines
  per-shard log-sum-exps; attention rings the key blocks). Such a factor is
  never a plain sum: it needs its program even where no result is reduced
  over it (labels into a sharded vocabulary are offset per shard). For a
  reduced factor that no program names, the kernel runs and its results are
  summed as they are.

  ``refused`` maps factors that the op cannot shard (yet) to the error a
  sharded one raises, instead of being gathered quietly.

  ``split`` names factors that the call's operands hold split over the
  manual axes of an enclosing ``shard_map`` (each factor's mesh axes; the
  caller says so, e.g. through an op argument, since a local block cannot
  show it): the call then runs a program for them (``run_in_shard_map``)
  instead of the kernel.
  """

  operands: tuple[tuple[str, ...], ...]
  results: tuple[tuple[str, ...], ...]
  replicated: tuple[str, ...] = ()
  programs: tuple[Program, ...] = ()
  refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
  split: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  @property
  def program_factors(self) -> frozenset[str]:
    """The factors that a program computes when sharded (never folded or summed as is)."""
    return program_factors(self.programs)


def partitioned(kernel: Primitive, dims: Dims, params: dict) -> Callable:
  """``kernel.bind`` wrapped in ``custom_partitioning`` with a rule from ``dims``."""
  op = kernel.name.removesuffix("_kernel")

  @custom_partitioning
  def call(*args):
    return tuple(kernel.bind(*args, **params))

  def shardings(mesh, arg_shapes):
    factors = _factor_axes(mesh, dims, arg_shapes)
    spec = lambda names: NamedSharding(mesh, PartitionSpec(*(factors.get(f) for f in names)))
    return factors, tuple(spec(d) for d in dims.operands), tuple(spec(d) for d in dims.results)

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return shardings(mesh, arg_shapes)[2]

  def partition(mesh, arg_shapes, result_shape):
    factors, arg_shardings, out_shardings = shardings(mesh, arg_shapes)
    shards = _shards(dims, factors, mesh.shape)
    local = [
      jax.ShapeDtypeStruct(s.shard_shape(a.shape), a.dtype)
      for a, s in zip(arg_shapes, arg_shardings)
    ]
    program = choose(op, dims.programs, shards, local)

    def lower_fn(*args):
      if program is not None:
        with _jax_private.one_source_location():
          return tuple(program.run(shards, *args))
      return tuple(shards.psum(out, i) for i, out in enumerate(kernel.bind(*args, **params)))

    return mesh, lower_fn, out_shardings, arg_shardings

  call.def_partition(
    partition=partition,
    infer_sharding_from_operands=infer_sharding_from_operands,
    sharding_rule=SdyShardingRule(
      operand_mappings=dims.operands,
      result_mappings=dims.results,
      need_replication_factors=dims.replicated,
    ),
  )
  return call


def run_in_shard_map(
  op: str, dims: Dims, factors: Mapping[str, str | Sequence[str]], *args: jax.Array
) -> list[jax.Array]:
  """One device's results of a call whose ``factors`` are split over ``shard_map``'s manual axes.

  Inside ``shard_map`` a primitive sees only its local blocks and cannot know
  that a factor is split; a caller that knows runs the op's per-shard program
  here, chosen by cost as under ``jit``. The program is plain JAX, so ``grad``,
  ``jvp`` and ``vmap`` of the ``shard_map`` go through its collectives by
  JAX's own rules.

  Args:
    op: the op's name, for the record and errors.
    dims: the call's ``Dims`` (its ``programs``).
    factors: each split factor's manual mesh axes (a name or a tuple).
    *args: this device's blocks of the operands.

  Results are this device's, summed over nothing: inside ``shard_map`` an
  operand replicated over a manual axis is cast to varying
  (``match_manual_axes``), whose transpose sums its per-device cotangents.

  Raises:
    ValueError: no program computes the split factors, or an axis is not a
      manual axis of the enclosing ``shard_map``.
  """
  mesh = jax.sharding.get_abstract_mesh()
  factors = {f: (a,) if isinstance(a, str) else tuple(a) for f, a in factors.items()}
  for f, axes in factors.items():
    if not set(axes) <= set(mesh.manual_axes):
      raise ValueError(
        f"{op}: factor {f} is split over {axes}, which are not manual axes of the enclosing "
        f"shard_map (manual: {tuple(mesh.manual_axes)})"
      )
  shards = dataclasses.replace(
    _shards(dims, factors, mesh.shape), summed=[() for _ in dims.results]
  )
  local = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
  program = choose(op, dims.programs, shards, local)
  if program is None:
    raise ValueError(f"{op}: no per-shard program computes factors {tuple(factors)} split")
  with _jax_private.one_source_location():
    return list(program.run(shards, *args))


def _shards(dims: Dims, factors: Mapping[str, tuple[str, ...]], mesh_shape) -> Shards:
  """The ``Shards`` of a call: results are summed over the sharded factors they lack.

  Each mesh axis once, also where two such factors share it (a ring's query
  and key sequences).
  """
  in_factors = {f for d in dims.operands for f in d}
  summed = [
    tuple(dict.fromkeys(a for f in sorted(in_factors - set(names)) for a in factors.get(f) or ()))
    for names in dims.results
  ]
  others = lambda f: {a for g, axes in factors.items() if g != f for a in axes}
  shared = {f for f, axes in factors.items() if others(f) & set(axes)}
  return Shards(factors, summed, dict(mesh_shape), frozenset(shared))


def _factor_axes(mesh, dims: Dims, arg_shapes) -> dict[str, tuple[str, ...]]:
  """Mesh axes each factor is sharded over, taken from the operands.

  A factor keeps the first sharding seen for it, provided its mesh axes are not
  already used by another factor and they divide its size evenly (uneven
  shards would feed padding into reductions); everything else is replicated.
  A factor that a program with ``shares_axes`` computes may reuse mesh axes
  another factor holds (its program visits the blocks the device does not
  hold).
  """
  sharing = {f for p in dims.programs if p.shares_axes for f in p.factors}
  factors: dict[str, tuple[str, ...]] = {}
  used: set[str] = set()
  for names, shape in zip(dims.operands, arg_shapes):
    sharding = shape.sharding
    if not isinstance(sharding, NamedSharding):
      continue
    for f, size, axes in zip(names, shape.shape, full_spec(shape)):
      if f in dims.refused and axes is not None:
        raise ValueError(dims.refused[f])
      if f in dims.replicated or f in factors or axes is None:
        continue
      axes = (axes,) if isinstance(axes, str) else tuple(axes)
      if size % math.prod(mesh.shape[a] for a in axes):
        continue
      if used.isdisjoint(axes) or f in sharing:
        factors[f] = axes
        used.update(axes)
  return factors


def full_spec(aval) -> tuple:
  """``aval``'s sharding spec with one entry per dimension (None: not sharded)."""
  spec = tuple(aval.sharding.spec)
  return spec + (None,) * (aval.ndim - len(spec))


def derived_aval(aval, shape: Sequence[int], dtype, spec: Sequence[Any]):
  """``aval`` with a new shape, dtype and sharding spec; manual axes are kept."""
  sharding = aval.sharding.update(spec=PartitionSpec(*spec))
  return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)


def match_manual_axes(*args: jax.Array) -> list[jax.Array]:
  """Casts operands to vary over the same ``shard_map`` axes, as lax ops do.

  Inside ``shard_map`` an operand that is invariant over a manual axis (a
  replicated weight) next to one that varies (sharded activations) must be
  cast to varying, so that its cotangent is summed over that axis on the way
  back instead of silently staying per-shard.
  """
  varying = [frozenset(getattr(jax.typeof(a).mat, "varying", ())) for a in args]
  union = frozenset().union(*varying)
  return [
    jax.lax.pcast(a, tuple(sorted(union - v)), to="varying") if union - v else a
    for a, v in zip(args, varying)
  ]
