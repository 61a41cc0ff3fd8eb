"""The op framework: the declarations that turn an op's pieces into JAX primitives.

An op author writes the pieces (abstract eval, XLA program, Pallas kernels per
backend, sharding dims, batching rule) and declares them here, once:

* ``define_primitive(name, PrimitiveSpec(...))`` builds one primitive: the
  public primitive (the one users' jaxprs hold), whose lowering wraps the
  kernel primitive in ``custom_partitioning`` so that sharded inputs are
  partitioned, not gathered; and the kernel primitive, lowered per platform as
  the executor's config says: the XLA program, or the Pallas kernel (Triton on
  ``cuda``/``rocm``, Mosaic on ``tpu``, interpreted on ``cpu``). It registers
  the batching rule and the kernel's ``KernelSpec`` under ``name`` with the
  executor, so a kernel cannot be left unregistered or registered under
  another name. Pallas' interpreter fills padding and unwritten outputs with
  NaN, so a kernel that leaves elements unwritten, or lets padded rows or
  columns leak into a reduction, fails the tests.
* ``define_residual_op(name, fwd=..., tangent=..., bwd=..., ...)`` builds the
  forward, tangent and backward primitives of an op with residuals and
  registers its AD: the JVP, the transpose (the backward kernel) and the
  second-order JVPs (design.md section 2).
* ``define_composite(name, ...)`` builds a primitive that means a composition
  of pallax primitives, optionally with its own JVP rule and a fused XLA
  program for the CPU.
* ``Kernel.of_family`` reads a ``kernels/<family>/`` package: the kernel
  function of each backend module and the config space of ``config.py``.

Every primitive has ``multiple_results=True`` and three framework params, set
by ``bind`` when the public function is traced: ``config`` (None or a pinned
``KernelConfig``), ``interpret`` (the interpret switch) and ``executor`` (the
executor scope: executor and overlays). They are params rather than globals
read at lowering so that the jaxpr, and with it JAX's lowering cache key,
changes with them. The kernel's config is selected at lowering time, from the
final (vmapped, per-shard) shapes. Rules that bind further primitives pass all
three on.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from pallax import _jax_private, triton_raw
from pallax.executor import KernelConfig, KernelSpec, Scope, Selection, current_scope
from pallax.executor.registry import (
  PLATFORMS,
  interpreted,
  kernel_backend,
  register_kernel,
  target_of,
)
from pallax.interpret import interpret_backend

FRAMEWORK_PARAMS = ("config", "interpret", "executor")


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


@dataclasses.dataclass(frozen=True)
class Kernel:
  """An op's Pallas kernel and what it tells the executor.

  impls: per kernel backend (``"triton"``, ``"mosaic_tpu"``, and
    ``"triton_raw"`` where the op has a raw Triton kernel), the kernel
    ``(*arrays, config, interpret, **params) -> [array]`` (``interpret`` goes
    to ``pallas_call`` as is).
  config_cls, heuristic, candidates, supports, version: the kernel's
    ``KernelSpec`` without its name, which is the primitive's (see
    ``registry.KernelSpec``). They describe the kernel only: the executor adds
    the XLA program as a choice of its own.
  """

  impls: Mapping[str, Callable[..., Sequence[jax.Array]]]
  config_cls: type[KernelConfig]
  heuristic: Callable[..., KernelConfig]
  candidates: Callable[..., Sequence[KernelConfig]]
  supports: Callable[..., str | None]
  version: int = 1

  @property
  def implementations(self) -> tuple[str, ...]:
    """``"pallas"`` where there is a Pallas kernel, ``"triton_raw"`` where there is a raw one."""
    pallas = ("pallas",) if set(self.impls) - {triton_raw.IMPLEMENTATION} else ()
    raw = (triton_raw.IMPLEMENTATION,) if triton_raw.IMPLEMENTATION in self.impls else ()
    return pallas + raw

  @classmethod
  def of_family(cls, name: str, *, config: Any, backends: Mapping[str, Any], **bound) -> Kernel:
    """The kernel ``name`` of a ``kernels/<family>/`` package.

    Args:
      name: the kernel function's name in each backend module.
      config: the family's ``config`` module: ``CONFIG_CLS``, ``heuristic``,
        ``candidates``, ``supports`` (and optionally ``VERSION``).
      backends: kernel backend name -> the family's module for it; a
        backend whose module lacks ``name`` has no kernel for it (a raw Triton
        module, ``triton_raw.LazyKernels``, may have some stages only).
      **bound: static arguments bound to every backend's kernel function.
    """
    impls = {
      b: functools.partial(getattr(m, name), **bound)
      for b, m in backends.items()
      if hasattr(m, name)
    }
    return cls(
      impls,
      config.CONFIG_CLS,
      config.heuristic,
      config.candidates,
      config.supports,
      getattr(config, "VERSION", 1),
    )

  @classmethod
  def of_stage(cls, stage: str, *, config: Any, backends: Mapping[str, Any]) -> Kernel:
    """The kernel function ``stage`` of a family whose config space takes ``stage=``.

    For ops with several stages (forward, tangent, backward) sharing one config
    module whose ``heuristic``, ``candidates`` and ``supports`` take a
    ``stage`` keyword.
    """

    def bound(f):
      return functools.wraps(f)(lambda *args, **kw: f(*args, stage=stage, **kw))

    space = types.SimpleNamespace(
      CONFIG_CLS=config.CONFIG_CLS,
      heuristic=bound(config.heuristic),
      candidates=bound(config.candidates),
      supports=bound(config.supports),
      VERSION=getattr(config, "VERSION", 1),
    )
    return cls.of_family(stage, config=space, backends=backends)


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
        name, k.config_cls, k.heuristic, k.candidates, k.supports, k.version, k.implementations
      )
    )
  batching.primitive_batchers[prim] = functools.partial(spec.batching, prim)

  def xla_lowering(ctx, *args, **params):
    # Traced from unvarying avals like the kernels (``_unvarying``): the XLA
    # programs' loops start from constants that vary over no shard_map axis.
    fn = mlir.lower_fun(functools.partial(spec.xla, **params), multiple_results=True)
    with _jax_private.without_vma_checks():
      return fn(_unvarying(ctx), *args)

  def platform_lowering(platform):
    def rule(ctx, *args, config, interpret, executor, **params):
      if spec.kernel is None:
        return xla_lowering(ctx, *args, **params)
      target = target_of(platform, interpret)
      chosen = select_config(
        prim, ctx.avals_in, target, params, config=config, interpret=interpret, scope=executor
      )
      if chosen.implementation == "xla":
        return xla_lowering(ctx, *args, **params)
      raw = chosen.implementation == triton_raw.IMPLEMENTATION
      if raw and interpreted(target) and _jax_private.lowering_a_partition(ctx):
        raise NotImplementedError(
          f"{name}: an interpreted raw Triton kernel runs as a host callback, which JAX "
          "drops when it partitions the call across devices (jax-ml/jax#23620): shard it "
          "with shard_map instead, or run it on one device"
        )
      fn = functools.partial(
        spec.kernel.impls[triton_raw.IMPLEMENTATION if raw else kernel_backend(target)],
        config=chosen.config,
        interpret=interpreted(target),
        **params,
      )
      with _jax_private.without_vma_checks():
        return mlir.lower_fun(fn, multiple_results=True)(_unvarying(ctx), *args)

    return rule

  for platform in PLATFORMS:
    mlir.register_lowering(kernel, platform_lowering(platform), platform=platform)

  def partitioned_lowering(ctx, *args, **params):
    rewrite = spec.rewrite(args, ctx.avals_in, params) if spec.rewrite is not None else None
    if rewrite is None:
      fn = _partitioned(kernel, spec.dims(*ctx.avals_in, **params), params)
      return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    def rewritten(*values):
      ops = rewrite.prepare(*values)
      dims = spec.dims(*(jax.typeof(o) for o in ops), **rewrite.params)
      return rewrite.finish(list(_partitioned(kernel, dims, rewrite.params)(*ops)))

    lower = mlir.lower_fun(rewritten, multiple_results=True)
    return lower(ctx.replace(avals_in=tuple(rewrite.avals)), *rewrite.values)

  mlir.register_lowering(prim, partitioned_lowering, cacheable=spec.rewrite is None)
  return prim


@dataclasses.dataclass(frozen=True)
class ResidualOp:
  """The primitives of an op defined by ``define_residual_op``."""

  fwd: KernelPrimitive
  tangent: KernelPrimitive
  bwd: KernelPrimitive


def define_residual_op(
  name: str,
  *,
  fwd: PrimitiveSpec,
  tangent: PrimitiveSpec,
  bwd: PrimitiveSpec | None = None,
  linear: slice | Callable[..., slice],
  tangent_operands: Callable[..., Sequence[Any]],
  residual_tangents: Callable[..., Sequence[Any]] | None = None,
  fwd_only_params: Sequence[str] = (),
) -> ResidualOp:
  """Defines an op's forward, tangent and backward primitives and their AD rules.

  The pattern of design.md section 2: the forward primitive returns the
  residuals its derivatives need; its JVP binds the tangent primitive, which is
  linear in a block of its operands; the transpose of the tangent primitive is
  the backward primitive. ``grad`` thus costs one forward and one backward
  kernel, ``jvp`` one forward and one tangent kernel. Second-order AD
  (HVPs, ``jacfwd`` of ``grad``) differentiates the XLA programs of the tangent
  and backward primitives.

  The contract between the three primitives:

  * ``tangent``'s operands are residuals (primal operands or forward results)
    with one contiguous block, ``linear``, of tangents, in which it is linear;
    its results are the tangents of the forward's first results.
  * ``bwd`` takes ``tangent``'s operands with the ``linear`` block replaced by
    the cotangents of ``tangent``'s results, and returns one cotangent per
    operand of the ``linear`` block, in order.
  * Without ``bwd`` the tangent primitive is its own transpose (softmax).

  The primitives are named ``{name}_fwd``, ``{name}_jvp`` and ``{name}_bwd``
  (``{name}_fwd`` and ``{name}_bwd`` when the tangent is its own transpose).

  Args:
    name: the op's name, the prefix of its primitives' names.
    fwd: the forward primitive.
    tangent: the tangent primitive.
    bwd: the backward primitive; None when ``tangent`` is its own transpose.
    linear: the block of ``tangent``'s operands it is linear in, or a function
      of the primitives' params giving it (where optional operands move it).
    tangent_operands: ``(primals, outs, tangents, **params) -> operands`` of ``tangent``
      from the forward's operands, its results and its operands' tangents
      (symbolic zeros included: ``instantiate`` those used).
    residual_tangents: ``(primals, outs, operands, **params) -> tangents`` of the
      forward results after those ``tangent`` returns (statistics), from the
      tangent's ``operands``; needed where the forward has such results.
    fwd_only_params: the forward's params that the other two do not take.
  """
  fwd_p = define_primitive(f"{name}_fwd", fwd)
  tangent_p = define_primitive(f"{name}_{'bwd' if bwd is None else 'jvp'}", tangent)
  bwd_p = tangent_p if bwd is None else define_primitive(f"{name}_bwd", bwd)

  def fwd_jvp_rule(primals, tangents, **params):
    outs = fwd_p.bind(*primals, **params)
    operands = list(tangent_operands(primals, outs, tangents, **params))
    shared = {k: v for k, v in params.items() if k not in fwd_only_params}
    out_tangents = list(tangent_p.bind(*operands, **shared))
    if residual_tangents is not None:
      out_tangents += residual_tangents(primals, outs, operands, **params)
    return outs, out_tangents

  def tangent_transpose_rule(cts, *args, **params):
    block = range(len(args))[linear(**params) if callable(linear) else linear]
    wanted = [i in block and ad.is_undefined_primal(a) for i, a in enumerate(args)]
    if any(ad.is_undefined_primal(a) for i, a in enumerate(args) if i not in block):
      raise NotImplementedError(
        f"{tangent_p.name} is linear in operands {block.start}:{block.stop} only"
      )
    if all(type(ct) is ad.Zero for ct in cts):
      return [ad.Zero(a.aval) if w else None for w, a in zip(wanted, args)]
    grads = bwd_p.bind(*args[: block.start], *instantiate(cts), *args[block.stop :], **params)
    return [grads[i - block.start] if w else None for i, w in enumerate(wanted)]

  ad.primitive_jvps[fwd_p] = fwd_jvp_rule
  ad.primitive_transposes[tangent_p] = tangent_transpose_rule
  for p in {tangent_p, bwd_p}:
    _register_jvp_by_xla(p)
  return ResidualOp(fwd_p, tangent_p, bwd_p)


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
          return fn(_unvarying(ctx), *args)
    return reference_lowering(ctx, *args, **framework, **params)

  batching.primitive_batchers[prim] = batching_rule
  ad.primitive_jvps[prim] = jvp or _jvp_by_differentiating(reference, all_params=True)
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


def _unvarying(ctx):
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


def _partitioned(kernel: Primitive, dims: Dims, params: dict) -> Callable:
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


def bind(prim: Primitive, *args, config=None, **params) -> list:
  """Binds ``prim`` from a public function: adds the framework params."""
  return prim.bind(
    *args, config=config, interpret=interpret_backend(), executor=current_scope(), **params
  )


def op_params(params: dict) -> dict:
  """``params`` without the framework's: the op's own static params."""
  return {k: v for k, v in params.items() if k not in FRAMEWORK_PARAMS}


def full_spec(aval) -> tuple:
  """``aval``'s sharding spec with one entry per dimension (None: not sharded)."""
  spec = tuple(aval.sharding.spec)
  return spec + (None,) * (aval.ndim - len(spec))


def derived_aval(aval, shape: Sequence[int], dtype, spec: Sequence[Any]):
  """``aval`` with a new shape, dtype and sharding spec; manual axes are kept."""
  sharding = aval.sharding.update(spec=PartitionSpec(*spec))
  return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)


def instantiate(tangents: Sequence[Any]) -> list:
  """Symbolic-zero tangents as arrays."""
  return [ad.instantiate_zeros(t) for t in tangents]


def _register_jvp_by_xla(prim: KernelPrimitive) -> None:
  """JVP of ``prim`` by differentiating its XLA program.

  Used for the secondary primitives (tangent and backward kernels), whose
  derivatives are only needed for second-order AD (Hessian-vector products,
  ``jacfwd`` of ``grad``).
  """
  ad.primitive_jvps[prim] = _jvp_by_differentiating(prim.xla_impl, all_params=False)


def _jvp_by_differentiating(fn: Callable, *, all_params: bool) -> Callable:
  """A JVP rule: ``jax.jvp`` of ``fn(*primals, **params)``.

  The framework's params are passed only with ``all_params``.
  """

  def jvp(primals, tangents, **params):
    outs, out_tangents = jax.jvp(
      functools.partial(fn, **(params if all_params else op_params(params))),
      tuple(primals),
      tuple(instantiate(tangents)),
    )
    return list(outs), list(out_tangents)

  return jvp


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
