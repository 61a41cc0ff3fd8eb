"""``Declaration``: one primitive declared from a reference program, kernels and dims.

The form in which ``pallax.custom_op`` declares an op, a user's and pallax's
own alike (``primitives/paged_attention.py``). From the pieces an author
writes, a ``Declaration`` derives the ``PrimitiveSpec`` that
``define_primitive`` / ``define_residual_op`` build primitives from:

* abstract eval: the results' shapes from ``abstract_eval`` or
  ``jax.eval_shape`` of the reference, their shardings from the dims;
* the XLA program: the reference (vmapped over a grid-batch axis);
* the ``Kernel``: the kernels per implementation with the ``ConfigSpace``'s
  heuristic, candidates and support check (each config's class checked, a
  config naming a kernel the op lacks refused with the reason);
* the sharding dims: a ``DimsRule`` (``pallax.op.dims_rule``);
* the batching rule: the fold rule of ``pallax.op.fold`` (``"fold"`` or
  ``"grid"``), or the op's own rule;
* the JVP rule: ``jax.jvp`` of the reference, or a rule linear in the tangents.

An op with its own batching rule binds its params as they are; one with the
fold rule binds them with ``batched`` (``pallax.op.fold.BATCHED``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import jax
import jax.numpy as jnp

from pallax import triton_raw
from pallax.executor.config import KernelConfig
from pallax.executor.implementation import PALLAS, kernel_backend, resolve
from pallax.executor.registry import ConfigSpace
from pallax.op.autodiff import instantiate
from pallax.op.dims_rule import DimsRule
from pallax.op.fold import (
  BATCHED,
  batched_dims,
  example_avals,
  fold_rule,
  lead,
  split_params,
  structs,
)
from pallax.op.kernel import Kernel
from pallax.op.primitive import KernelPrimitive, PrimitiveSpec
from pallax.op.sharding import derived_aval, full_spec

BatchingArg = Union[Literal["fold", "grid"], Callable[..., tuple]]


def as_list(outs: Any, what: str) -> list:
  """A function's result(s) as a list; TypeError naming ``what`` for anything but arrays."""
  if isinstance(outs, (list, tuple)):
    return list(outs)
  if isinstance(outs, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)):
    return [outs]
  raise TypeError(f"{what} must return an array or a sequence of arrays, got {type(outs).__name__}")


def per_example(fn: Callable, batched: bool) -> Callable:
  """``fn`` vmapped over the grid-batch axis of a ``batched`` call."""
  return jax.vmap(fn) if batched else fn


@dataclasses.dataclass
class Declaration:
  """Everything one primitive is built from.

  Attributes:
    name: the primitive's name (and the executor's, for its kernel).
    reference: ``(*arrays, **params) -> array(s)``, the XLA program.
    kernels: implementation name -> kernel ``(*arrays, config, interpret,
      **params) -> array(s)``; empty: the reference runs everywhere.
    config: the kernels' ``ConfigSpace`` (None without kernels).
    dims: the sharding dims.
    batching: ``"fold"``, ``"grid"`` (kernels take a leading batch axis) or a
      batching rule ``(prim, args, bdims, **params) -> (outs, out_dims)``.
    abstract_eval: ``(*structs, **params) -> ShapeDtypeStruct(s)``; None:
      ``jax.eval_shape`` of the reference.
    own_configs: implementation name -> the config space of its own that
      implementation's kernel has (``Kernel.spaces``: the Mosaic GPU
      kernels'), instead of ``config``; its heuristic may return None (the
      executor chooses another implementation, its configs candidates).
  """

  name: str
  reference: Callable[..., Any]
  kernels: Mapping[str, Callable[..., Any]]
  config: Optional[ConfigSpace]
  dims: DimsRule
  batching: BatchingArg
  abstract_eval: Optional[Callable[..., Any]] = None
  own_configs: Mapping[str, ConfigSpace] = dataclasses.field(default_factory=dict)
  _shapes: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def grid(self) -> bool:
    """Whether the kernels take a leading batch axis (``batching="grid"``)."""
    return self.batching == "grid"

  @property
  def folds(self) -> bool:
    """Whether vmap goes through the fold rule, so calls bind the ``batched`` param."""
    return not callable(self.batching)

  def bind_params(self) -> dict:
    """The params a call adds to the op's own: ``batched=False`` under the fold rule."""
    return {BATCHED: False} if self.folds else {}

  # Shapes ------------------------------------------------------------------

  def out_structs(self, avals: Sequence[Any], params: dict) -> tuple[list, bool]:
    """Per-example result structs and whether the op returns one array (not a sequence)."""
    key = (
      tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in avals),
      tuple(sorted(params.items())),
    )
    if key not in self._shapes:
      self._shapes[key] = self._out_structs(avals, params)
    outs, single = self._shapes[key]
    return list(outs), single

  def _out_structs(self, avals: Sequence[Any], params: dict) -> tuple[list, bool]:
    if self.abstract_eval is not None:
      outs, what = self.abstract_eval(*structs(avals), **params), f"{self.name}: abstract_eval"
    else:
      outs = jax.eval_shape(functools.partial(self.reference, **params), *structs(avals))
      what = f"{self.name}: reference"
    single = not isinstance(outs, (list, tuple))
    outs = as_list(outs, what)
    for o in outs:
      if not (hasattr(o, "shape") and hasattr(o, "dtype")):
        raise TypeError(f"{what} must give arrays or jax.ShapeDtypeStructs, got {o!r}")
    return [jax.ShapeDtypeStruct(tuple(o.shape), o.dtype) for o in outs], single

  def call_dims(self, avals: Sequence[Any], params: dict):
    """The ``Dims`` of a primitive call (the grid-batch axis a factor of its own).

    The per-shard programs that take params (``Program.takes_params``) get
    the call's full ``params`` bound: what binding the kernel primitive on
    the local blocks takes.
    """
    own, batched = split_params(params)
    per = example_avals(avals, batched)
    dims = batched_dims(self.dims(per, self.out_structs(per, own)[0], own), batched)

    def bound(p):
      if not p.takes_params:
        return p
      return dataclasses.replace(p, run=functools.partial(p.run, params=params), takes_params=False)

    return dataclasses.replace(dims, programs=tuple(map(bound, dims.programs)))

  def abstract(self, *avals, **params) -> list:
    """The primitive's abstract eval: shapes from the declaration, shardings from the dims."""
    own, batched = split_params(params)
    outs = self.out_structs(example_avals(avals, batched), own)[0]
    if batched:
      outs = lead(outs, avals[0].shape[0])
    dims = self.call_dims(avals, params)
    spec: dict[str, Any] = {}  # per factor, the first operand's mesh axes that no other took
    used: set[str] = set()
    for names, a in zip(dims.operands, avals):
      for f, axes in zip(names, full_spec(a)):
        mesh_axes = {axes} if isinstance(axes, str) else set(axes or ())
        if mesh_axes and f not in spec and f not in dims.replicated and used.isdisjoint(mesh_axes):
          spec[f] = axes
          used |= mesh_axes
    return [
      derived_aval(avals[0], o.shape, o.dtype, [spec.get(f) for f in names])
      for o, names in zip(outs, dims.results)
    ]

  # Programs and kernels -------------------------------------------------------

  def xla(self, *arrays, **params) -> list:
    """The reference, vmapped over the grid-batch axis where there is one."""
    batched = params.pop(BATCHED, False)
    fn = lambda *a: as_list(self.reference(*a, **params), f"{self.name}: reference")
    return list(per_example(fn, batched)(*arrays))

  def _impl(self, backend: str) -> Callable[..., list]:
    user = self.kernels[backend]

    def run(*arrays, config, interpret, **params):
      batched = params.pop(BATCHED, False)
      what = f"{self.name}: the {backend} kernel"
      call = lambda *a: as_list(user(*a, config=config, interpret=interpret, **params), what)
      if self.grid:  # the kernel takes a leading batch axis: always give it one
        if batched:
          return call(*arrays)
        return [o[0] for o in call(*(a[None] for a in arrays))]
      # A vmapped call that could not be folded: Pallas turns vmap of a
      # pallas_call into one pallas_call with a grid axis more (raw Triton
      # calls cannot be vmapped: ``supports`` refuses them).
      return list(per_example(call, batched)(*arrays))

    return run

  def _kernel_avals(self, avals: Sequence[Any], batched: bool) -> list:
    """The operands' structs as the kernel function sees them."""
    if self.grid:
      return structs(avals) if batched else lead(avals, 1)
    return example_avals(avals, batched)

  def kernel(self) -> Optional[Kernel]:
    """The op's ``Kernel`` for the executor; None without kernels."""
    if not self.kernels:
      return None
    impls = {b: self._impl(b) for b in self.kernels}
    own = {name: self._space(space, own=True) for name, space in self.own_configs.items()}
    return Kernel(impls, self._space(self.config), own)

  def _space(self, space: ConfigSpace, own: bool = False) -> ConfigSpace:
    """``space`` over the kernel's operands (the grid-batch axis taken off), its configs checked.

    ``own``: an implementation's own space, whose heuristic may return None.
    """

    def checked(config: Any, what: str, maybe_none: bool = False) -> KernelConfig:
      if not isinstance(config, space.config_cls) and not (maybe_none and config is None):
        raise TypeError(
          f"{self.name}: {what} must return a {space.config_cls.__name__}, "
          f"got {type(config).__name__}"
        )
      return config

    def kernel_avals(avals, params: dict):
      """The kernel's operands of ``avals``; takes the batched flag out of ``params``."""
      return self._kernel_avals(avals, params.pop(BATCHED, False))

    @functools.wraps(space.heuristic)  # keeps its module: the family's, or the user's
    def heuristic(avals, target, **params):
      config = space.heuristic(kernel_avals(avals, params), target, **params)
      return checked(config, "ConfigSpace.heuristic", maybe_none=own)

    @functools.wraps(space.candidates or space.heuristic)
    def candidates(avals, target, **params):
      configs = space.configs(kernel_avals(avals, params), target, **params)
      # An own space without candidates gives its heuristic's config, maybe None.
      configs = [c for c in configs if not (own and space.candidates is None and c is None)]
      return [checked(c, "ConfigSpace.candidates") for c in configs]

    @functools.wraps(space.supports or space.heuristic)
    def supports(avals, target, config, **params):
      batched = params.pop(BATCHED, False)
      if not isinstance(config, space.config_cls):
        return f"{self.name} takes a {space.config_cls.__name__}, not a {type(config).__name__}"
      if resolve(config.implementation, target, tuple(self.kernels)) not in self.kernels:
        wanted = (
          kernel_backend(target) if config.implementation == PALLAS else config.implementation
        )
        return f"{self.name} has no {wanted} kernel (it has: {', '.join(sorted(self.kernels))})"
      if config.implementation == triton_raw.IMPLEMENTATION and batched and not self.grid:
        return (
          f"{self.name}: this vmapped call cannot be folded into a batch-like dim of "
          f"dims {self.dims}, and a raw Triton kernel cannot be vmapped; declare "
          "batching='grid' with a kernel that takes a leading batch axis"
        )
      return space.reason(self._kernel_avals(avals, batched), target, config, **params)

    inputs = None
    if space.inputs is not None:
      if own:
        raise ValueError(f"{self.name}: an implementation's own space takes no inputs")

      @functools.wraps(space.inputs)
      def inputs(avals, seed, **params):  # the operands as the kernel is called, batched or not
        params.pop(BATCHED, False)
        return space.inputs(avals, seed, **params)

    kernel_keys = None
    if space.kernel_keys is not None:

      @functools.wraps(space.kernel_keys)
      def kernel_keys(avals, target, config, **params):
        return space.kernel_keys(kernel_avals(avals, params), target, config, **params)

    return ConfigSpace(
      space.config_cls, heuristic, candidates, supports, space.version, inputs, kernel_keys
    )

  def spec(self) -> PrimitiveSpec:
    """The ``PrimitiveSpec`` that ``define_primitive`` builds the primitive from."""
    batching = self.batching
    if self.folds:
      per_example_outs = lambda per, own: self.out_structs(per, own)[0]
      batching = fold_rule(self.dims, per_example_outs, grid=self.grid)
    return PrimitiveSpec(
      abstract_eval=self.abstract,
      xla=self.xla,
      kernel=self.kernel(),
      dims=lambda *avals, **params: self.call_dims(avals, params),
      batching=batching,
    )

  # AD -------------------------------------------------------------------------

  def reference_tangents(self, primals, tangents, own: dict, batched: bool) -> list:
    """The reference's output tangents (``jax.jvp`` of it: an XLA program)."""
    reference = lambda *a: tuple(as_list(self.reference(*a, **own), f"{self.name}: reference"))
    fn = lambda p, t: jax.jvp(reference, p, t)[1]
    return list(per_example(fn, batched)(tuple(primals), tuple(tangents)))

  def jvp_rule(self, prim: KernelPrimitive, jvp: Optional[Callable] = None) -> Callable:
    """The primitive's JVP: the kernel's outputs, tangents from ``jvp`` or the reference.

    ``jvp``: ``(primals, tangents, out, **params) -> tangent(s)``, linear in
    ``tangents`` (``out`` the op's result, one array for a single-result op).
    """

    def rule(primals, tangents, **params):
      outs = prim.bind(*primals, **params)
      own, batched = split_params(params)
      tangents = instantiate(tangents)
      if jvp is None:
        return outs, self.reference_tangents(primals, tangents, own, batched)
      single = self.out_structs(example_avals(primals, batched), own)[1]

      def user(p, t, o):
        return as_list(jvp(p, t, o[0] if single else tuple(o), **own), f"{self.name}: jvp")

      out_tangents = per_example(user, batched)(tuple(primals), tuple(tangents), tuple(outs))
      if len(out_tangents) != len(outs):
        raise ValueError(
          f"{self.name}: jvp returned {len(out_tangents)} tangents for {len(outs)} results"
        )
      return outs, list(out_tangents)

    return rule
