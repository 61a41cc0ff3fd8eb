"""Sharding: an op's einsum-like factor names and the ``custom_partitioning`` rule built from them.

``Dims`` says which operand and result dimensions are the same factor; a
primitive call lowered under a mesh is wrapped by ``partitioned`` so that each
device runs the kernel on its shard (batch-like factors), or a per-shard
program (a sharded reduced factor), never on gathered operands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.extend.core import Primitive
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class Dims:
  """Einsum-like factor names per operand and result dimension.

  A factor shared by operands and a result is batch-like and shards freely; a
  factor in ``replicated`` must not be sharded (e.g. the normalised axis); a
  factor present in an operand but absent from a result is reduced, so a result
  computed from a sharded factor is summed across the devices holding it.

  ``per_shard`` is for ops whose results are not plain sums over a reduced
  factor (a matmul with a fused bias or activation must sum the partial
  products before the epilogue; a loss combines per-shard log-sum-exps):
  ``(shards, *args) -> results`` runs on each device instead of the kernel
  when a reduced factor is sharded, where ``shards`` (a ``Shards``) sums a
  result across the devices it is summed over and names each factor's mesh
  axes. None: the kernel runs and its results are summed as they are.

  ``indexed`` names factors that ``per_shard`` must see sharded even where no
  result is summed over them: operands hold global indices into them (labels
  into a sharded vocabulary), which each shard must offset.

  ``refused`` maps factors that the op cannot shard (yet) to the error a
  sharded one raises, instead of being gathered quietly.
  """

  operands: tuple[tuple[str, ...], ...]
  results: tuple[tuple[str, ...], ...]
  replicated: tuple[str, ...] = ()
  per_shard: Callable[..., Sequence[Any]] | None = None
  indexed: tuple[str, ...] = ()
  refused: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Shards:
  """What a ``Dims.per_shard`` function knows of how its call is partitioned.

  factors: each sharded factor's mesh axes.
  summed: per result, the mesh axes it is summed over (those of the reduced
    factors that are sharded).
  """

  factors: Mapping[str, tuple[str, ...]]
  summed: Sequence[tuple[str, ...]]

  def psum(self, x: jax.Array, i: int) -> jax.Array:
    """``x`` summed across the devices that result ``i`` is summed over."""
    return jax.lax.psum(x, self.summed[i]) if self.summed[i] else x

  def axes(self, factor: str) -> tuple[str, ...]:
    """The mesh axes ``factor`` is sharded over (empty: not sharded)."""
    return tuple(self.factors.get(factor) or ())


def partitioned(kernel: Primitive, dims: Dims, params: dict) -> Callable:
  """``kernel.bind`` wrapped in ``custom_partitioning`` with a rule from ``dims``."""

  @custom_partitioning
  def call(*args):
    return tuple(kernel.bind(*args, **params))

  def shardings(mesh, arg_shapes):
    factors = _factor_axes(mesh, dims, arg_shapes)
    spec = lambda names: NamedSharding(mesh, PartitionSpec(*(factors.get(f) for f in names)))
    return (factors, tuple(spec(d) for d in dims.operands), tuple(spec(d) for d in dims.results))

  def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
    return shardings(mesh, arg_shapes)[2]

  def partition(mesh, arg_shapes, result_shape):
    factors, arg_shardings, out_shardings = shardings(mesh, arg_shapes)
    in_factors = {f for d in dims.operands for f in d}

    summed = [
      tuple(a for f in sorted(in_factors - set(names)) for a in factors.get(f) or ())
      for names in dims.results
    ]

    shards = Shards(factors, summed)

    def lower_fn(*args):
      if dims.per_shard is not None and (any(summed) or any(f in factors for f in dims.indexed)):
        return tuple(dims.per_shard(shards, *args))
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


def _factor_axes(mesh, dims: Dims, arg_shapes) -> dict[str, tuple[str, ...]]:
  """Mesh axes each factor is sharded over, taken from the operands.

  A factor keeps the first sharding seen for it, provided its mesh axes are not
  already used by another factor and they divide its size evenly (uneven
  shards would feed padding into reductions); everything else is replicated.
  """
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
      count = 1
      for a in axes:
        count *= mesh.shape[a]
      if used.isdisjoint(axes) and size % count == 0:
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
