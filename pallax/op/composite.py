"""``define_composite``: a primitive that means a composition of pallax primitives."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from pallax import _jax_private
from pallax.op.autodiff import jvp_by_differentiating
from pallax.op.kernel import select_config
from pallax.op.primitive import KernelPrimitive, unvarying


class CompositePrimitive(Primitive):
  """A primitive defined by ``define_composite``: knows the composition it means.

  The executor's tools (``pallax.explain``, ``autotune``, ``vmap_with_config``)
  trace ``reference`` to find the kernel calls inside.
  """

  reference: Callable[..., Sequence[jax.Array]]


def define_composite(
  name: str,
  *,
  abstract_eval: Callable[..., Sequence[Any]],
  reference: Callable[..., Sequence[jax.Array]],
  jvp: Callable[..., tuple[list, list]] | None = None,
  fused: Callable[..., Sequence[jax.Array]] | None = None,
  decided_by: KernelPrimitive | None = None,
  own_params: Sequence[str] = (),
) -> Primitive:
  """A primitive that means a composition of pallax primitives.

  ``reference(*args, **params)`` binds other pallax primitives (``params``
  with the framework's): it is what the primitive means, how it lowers (inline,
  so the composed primitives' rewrites see the operands' producers) and how it
  vmaps (``jax.vmap`` of it: its primitives' batching rules). It
  differentiates as ``jax.jvp`` of it, unless ``jvp`` gives another rule: a
  scalar loss whose tangent is its gradient dotted with the tangents, so that
  ``grad`` computes the gradient in the forward pass.

  ``fused(*args, **op_params)`` is one XLA program computing the same, which a
  CPU runs faster than the composition (a loss and its gradients in one pass
  where the composition recomputes). It is lowered where the executor would
  run ``decided_by``'s XLA program anyway: on the CPU, the interpret switch
  off, no config pinned, and a program that is not partitioned across devices
  (the composed primitives shard by their own rules; inside a fully manual
  ``shard_map`` or on one device, the fused program is the same computation).

  Args:
    name: the primitive's name.
    abstract_eval: ``(*avals, **params) -> [aval]``.
    reference: the composition.
    jvp: ``(primals, tangents, **params) -> (outs, tangents)``, a JVP rule
      (tangents may be ``ad.Zero``); None: ``jax.jvp`` of ``reference``.
    fused: the CPU program, or None.
    decided_by: the primitive whose executor selection (on the same operands
      and params) must be its XLA program for ``fused`` to be lowered.
    own_params: this primitive's params that ``decided_by`` does not take.
  """
  prim = CompositePrimitive(name)
  prim.reference = reference
  prim.multiple_results = True
  prim.def_impl(functools.partial(_jax_private.apply_primitive, prim))
  prim.def_abstract_eval(abstract_eval)
  _jax_private.require_devices_during_lowering(prim)

  def batching_rule(args, dims, **params):
    outs = jax.vmap(functools.partial(reference, **params), in_axes=list(dims))(*args)
    return outs, [0] * len(outs)

  def reference_lowering(ctx, *args, **params):
    return mlir.lower_fun(functools.partial(reference, **params), multiple_results=True)(ctx, *args)

  def cpu_lowering(ctx, *args, config, interpret, executor, **params):
    framework = dict(config=config, interpret=interpret, executor=executor)
    if config is None and not interpret and _one_program(ctx.module_context.axis_context):
      shared = {k: v for k, v in params.items() if k not in own_params}
      chosen = select_config(
        decided_by, ctx.avals_in, "cpu", shared, config=None, interpret=None, scope=executor
      )
      if chosen.implementation == "xla":
        fn = mlir.lower_fun(functools.partial(fused, **params), multiple_results=True)
        with _jax_private.without_vma_checks():
          return fn(unvarying(ctx), *args)
    return reference_lowering(ctx, *args, **framework, **params)

  batching.primitive_batchers[prim] = batching_rule
  ad.primitive_jvps[prim] = jvp or jvp_by_differentiating(reference, all_params=True)
  # Inline, not through JAX's lowering cache: the composed primitives may read
  # their operands' producers (``PrimitiveSpec.rewrite``).
  mlir.register_lowering(prim, reference_lowering, cacheable=False)
  if fused is not None:
    mlir.register_lowering(prim, cpu_lowering, platform="cpu", cacheable=False)
  return prim


def _one_program(axis_context) -> bool:
  """Whether a lowering is not partitioned across devices: one device, or all axes manual."""
  if isinstance(axis_context, mlir.ShardingContext):
    return axis_context.num_devices == 1
  if isinstance(axis_context, mlir.SPMDAxisContext):
    return set(axis_context.manual_axes) == set(axis_context.mesh.axis_names)
  return False
