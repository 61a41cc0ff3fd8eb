"""``define_primitive``: one op's public and kernel primitives, lowered per platform.

The public primitive is the one users' jaxprs hold; its lowering wraps the
kernel primitive in ``custom_partitioning`` (``pallax.op.sharding``). The
kernel primitive lowers as the executor's selection says: the XLA program or a
kernel of the selected implementation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from pallax import _jax_private
from pallax.executor import KernelSpec, current_scope
from pallax.executor.implementation import PLATFORMS, XLA, implementation, target_of
from pallax.executor.registry import kernel_function, register_kernel, resolved
from pallax.interpret import interpret_backend
from pallax.op.kernel import Kernel, select_config
from pallax.op.sharding import Dims, partitioned, run_in_shard_map

FRAMEWORK_PARAMS = ("config", "interpret", "executor")


@dataclasses.dataclass(frozen=True)
class PrimitiveSpec:
  """Everything ``define_primitive`` needs to build one primitive.

  abstract_eval: ``(*avals, **params) -> [aval]``; build outputs with
    ``derived_aval`` so sharding and manual-axis information is kept.
  xla: ``(*arrays, **params) -> [array]``, plain jnp; the CPU lowering.
  kernel: the Pallas kernel, or None where the XLA program runs on every
    platform.
  dims: ``(*avals, **params) -> Dims``, the sharding description.
  batching: ``(prim, args, dims, **params) -> (outs, out_dims)``, the vmap
    rule (from ``pallax.batching_rules``).
  rewrite: optional ``(values, avals, params) -> Rewrite | None``, a peephole
    on the lowered operands (``ir.Value``s of the enclosing program): it may
    read an operand where it was produced, e.g. a transposed table in place.
    With one, the primitive is lowered inline (not through JAX's lowering
    cache, which hides the operands' producers).
  """

  abstract_eval: Callable[..., Sequence[Any]]
  xla: Callable[..., Sequence[jax.Array]]
  kernel: Kernel | None
  dims: Callable[..., Dims]
  batching: Callable[..., tuple[Sequence[Any], Sequence[Any]]]
  rewrite: Callable[..., Rewrite | None] | None = None


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """A primitive call rewritten at lowering (``PrimitiveSpec.rewrite``).

  values, avals: the operands to lower with instead, and their avals.
  params: the primitive's params for the rewritten call.
  prepare: ``(*arrays) -> [array]``, jnp from ``values`` to the primitive's
    operands under ``params``.
  finish: ``([array]) -> [array]``, jnp from the rewritten call's results to
    the original call's.
  """

  values: Sequence[Any]
  avals: Sequence[Any]
  params: dict
  prepare: Callable[..., Sequence[jax.Array]]
  finish: Callable[[list], Sequence[jax.Array]]


def produced_by(value: Any, op_name: str, **attributes: Sequence[int]) -> Any:
  """The first operand of the op that produced ``value``, if it is ``op_name`` with ``attributes``.

  ``value`` is an ``ir.Value`` of the program being lowered; returns None for
  a block argument or another producer. ``attributes`` are integer-array
  attributes that must match (``permutation=(1, 0)``).
  """
  owner = getattr(value.owner, "operation", None)  # a Block for block arguments
  if owner is None or owner.name != op_name:
    return None
  for name, want in attributes.items():
    if name not in owner.attributes or list(owner.attributes[name]) != list(want):
      return None
  return owner.operands[0]


class KernelPrimitive(Primitive):
  """A pallax primitive: knows its XLA program and its kernel primitive."""

  xla_impl: Callable[..., Sequence[jax.Array]]
  kernel: Primitive
  has_kernel: bool  # False where the XLA program runs on every platform


def define_primitive(name: str, spec: PrimitiveSpec) -> KernelPrimitive:
  """Builds the public and the kernel primitive of one op and registers its rules.

  The kernel's ``KernelSpec`` is registered with the executor under ``name``,
  so the op's name is written once: here.

  Args:
    name: primitive name, also the executor's op name.
    spec: the primitive's pieces.
  """
  kernel = Primitive(name + "_kernel")
  prim = KernelPrimitive(name)
  prim.xla_impl, prim.kernel, prim.has_kernel = spec.xla, kernel, spec.kernel is not None
  for p in (prim, kernel):
    p.multiple_results = True
    p.def_impl(functools.partial(_jax_private.apply_primitive, p))
    p.def_abstract_eval(spec.abstract_eval)
    _jax_private.require_devices_during_lowering(p)
  if spec.kernel is not None:
    k = spec.kernel
    register_kernel(
      KernelSpec(
        name,
        k.space.config_cls,
        k.space.heuristic,
        k.space.candidates,
        k.space.supports,
        k.space.version,
        k.implementations,
        dict(k.spaces),
        k.space.inputs,
        k.space.kernel_keys,
      ),
      k.impls,
    )
  batching.primitive_batchers[prim] = functools.partial(spec.batching, prim)

  def xla_lowering(ctx, *args, **params):
    # Traced from unvarying avals like the kernels (``unvarying``): the XLA
    # programs' loops start from constants that vary over no shard_map axis.
    fn = mlir.lower_fun(functools.partial(spec.xla, **params), multiple_results=True)
    with _jax_private.without_vma_checks():
      return fn(unvarying(ctx), *args)

  def platform_lowering(platform):
    def rule(ctx, *args, config, interpret, executor, **params):
      if spec.kernel is None:
        return xla_lowering(ctx, *args, **params)
      target = target_of(platform, interpret)
      chosen = select_config(
        prim, ctx.avals_in, target, params, config=config, interpret=interpret, scope=executor
      )
      if chosen.implementation == XLA:
        return xla_lowering(ctx, *args, **params)
      # The selection's target carries the device kind the executor chose for.
      impl = implementation(resolved(name, chosen.implementation, chosen.target))
      refused = impl.unpartitionable_interpreted
      if refused and impl.interpreted(target) and _jax_private.lowering_a_partition(ctx):
        raise NotImplementedError(f"{name}: {refused}")
      fn = functools.partial(
        kernel_function(name, impl.name),
        config=chosen.config,
        interpret=impl.interpreted(target),
        **params,
      )
      with _jax_private.without_vma_checks():
        return mlir.lower_fun(fn, multiple_results=True)(unvarying(ctx), *args)

    return rule

  for platform in PLATFORMS:
    mlir.register_lowering(kernel, platform_lowering(platform), platform=platform)

  def partitioned_lowering(ctx, *args, **params):
    rewrite = spec.rewrite(args, ctx.avals_in, params) if spec.rewrite is not None else None
    if rewrite is None:
      dims = spec.dims(*ctx.avals_in, **params)
      if dims.split:
        fn = functools.partial(run_in_shard_map, name, dims, dims.split)
      else:
        fn = partitioned(kernel, dims, params)
      return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    def rewritten(*values):
      ops = rewrite.prepare(*values)
      dims = spec.dims(*(jax.typeof(o) for o in ops), **rewrite.params)
      return rewrite.finish(list(partitioned(kernel, dims, rewrite.params)(*ops)))

    lower = mlir.lower_fun(rewritten, multiple_results=True)
    return lower(ctx.replace(avals_in=tuple(rewrite.avals)), *rewrite.values)

  mlir.register_lowering(prim, partitioned_lowering, cacheable=spec.rewrite is None)
  return prim


def unvarying(ctx):
  """``ctx`` with avals that vary over no ``shard_map`` axis, for tracing a kernel or program.

  The primitive's abstract eval has already fixed how its results vary. Inside
  the kernel, constants and loop carries vary over nothing while ``shard_map``
  operands vary over its axes, and Pallas (its interpreter's loops in
  particular) does not reconcile the two; traced from unvarying avals, with
  the checks off (Pallas wants every output type annotated otherwise), the
  kernel is consistent.
  """
  strip = lambda avals: [jax.core.ShapedArray(a.shape, a.dtype, a.weak_type) for a in avals]
  return ctx.replace(avals_in=strip(ctx.avals_in), avals_out=strip(ctx.avals_out))


def bind(prim: Primitive, *args, config=None, **params) -> list:
  """Binds ``prim`` from a public function: adds the framework params."""
  return prim.bind(
    *args, config=config, interpret=interpret_backend(), executor=current_scope(), **params
  )


def op_params(params: dict) -> dict:
  """``params`` without the framework's: the op's own static params."""
  return {k: v for k, v in params.items() if k not in FRAMEWORK_PARAMS}
