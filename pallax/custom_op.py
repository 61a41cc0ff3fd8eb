"""``pallax.custom_op``: a user's own kernel (Pallas or raw Triton) as a pallax op.

pallax's own ops are JAX primitives declared through ``pallax.op``
(``define_primitive``, ``define_residual_op``): a reference XLA program, the
kernels per backend with a config space, einsum-like sharding dims and a
batching rule. ``custom_op`` is the same declaration for code outside pallax,
with defaults for the parts every op writes alike:

* the output shapes: ``jax.eval_shape`` of the reference;
* the outputs' shardings: from the sharding dims;
* vmap: the vmapped axis folded into a batch-like dim the dims name (or into
  the leading ``...``), else a grid axis; one kernel either way;
* AD: the kernel computes the primal output; the tangent differentiates the
  reference (XLA), or a JVP linear in the tangents, or a residual declaration
  whose backward is a kernel of its own (``ResidualJVP``). No ``custom_vjp``:
  ``jax.jvp``, ``jax.grad`` and their compositions all work.

Example (a raw Triton kernel; ``examples/swiglu.py`` is the complete version)::

  op = pallax.custom_op(
    "my_swiglu",
    reference=lambda x, y: jax.nn.silu(x) * y,
    kernels={"triton_raw": swiglu_raw},
    config=pallax.ConfigSpace(SwigluConfig, heuristic=swiglu_heuristic),
    dims="... c, ... c -> ... c",
  )
  z = op(x, y)

Kernels run where the executor selects them: the XLA reference runs on the CPU
(and wherever a kernel cannot run the call, with a log line and a note in
``pallax.explain``); raw Triton kernels run compiled on ``cuda``/``rocm`` and
interpreted on the CPU in a process started with ``TRITON_INTERPRET=1``;
Pallas kernels run on their platform and interpreted under
``pallax.interpret``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching

from pallax import triton_raw
from pallax.batching_utils import NOT_MAPPED, axis_size
from pallax.executor.config import KernelConfig
from pallax.executor.implementation import PALLAS, XLA, implementations, kernel_backend, resolve
from pallax.executor.registry import ConfigSpace, registered_ops
from pallax.op import (
  FRAMEWORK_PARAMS,
  Dims,
  Kernel,
  KernelPrimitive,
  PrimitiveSpec,
  bind,
  define_primitive,
  define_residual_op,
  derived_aval,
  full_spec,
  instantiate,
  match_manual_axes,
  op_params,
)

__all__ = ["custom_op", "CustomOp", "ConfigSpace", "KernelStage", "ResidualJVP"]

# Short names a custom op's kernels may be given under, besides the registered
# implementations' names (``pallax.executor.implementation``).
_KERNEL_ALIASES = {"triton": "pallas_triton", "mosaic_tpu": "pallas_mosaic_tpu"}
# The primitive param that says the operands carry one leading grid-batch axis
# (a vmapped call that could not be folded, or any vmapped call with
# ``batching="grid"``). Like the framework's params, it is not the user's.
BATCHED = "batched"
_RESERVED = FRAMEWORK_PARAMS + (BATCHED,)
# Factor names the framework adds to a dims string: "_e0", "_e1", ... for the
# dims of "...", counted from the right (so operands broadcast like numpy's),
# and the grid-batch axis.
_ELLIPSIS_FACTOR = "_e{}"
_BATCH_FACTOR = "_batch"

DimsArg = Union[str, Dims, Callable[..., Dims]]
BatchingArg = Union[Literal["fold", "grid"], Callable[..., tuple]]


@dataclasses.dataclass(frozen=True)
class KernelStage:
  """The tangent or backward stage of a ``ResidualJVP``: a primitive of its own.

  Attributes:
    reference: ``(*operands, **params) -> array(s)``, the stage's XLA program.
    kernels: the stage's kernels, as ``custom_op``'s ``kernels``; none: the
      reference runs on every platform.
    config: its config space; None: the op's. A pinned config goes to every
      stage, so the config class must be the op's.
    dims: its sharding dims; None: derived from the op's dims string.
    replicated: as ``custom_op``'s (with ``dims``).
    abstract_eval: as ``custom_op``'s.
  """

  reference: Callable[..., Any]
  kernels: Optional[Mapping[str, Callable[..., Any]]] = None
  config: Optional[ConfigSpace] = None
  dims: Optional[DimsArg] = None
  replicated: Sequence[str] = ()
  abstract_eval: Optional[Callable[..., Any]] = None


@dataclasses.dataclass(frozen=True)
class ResidualJVP:
  """AD through a tangent primitive whose transpose is a backward kernel.

  The pattern of ``pallax.op.define_residual_op`` (and of pallax's norms,
  softmax, attention): the forward may return residuals for its derivatives
  (``residuals`` trailing results of the reference and kernels, hidden from
  the op's caller); the JVP binds the tangent stage, linear in its tangents;
  ``grad`` transposes it into the backward stage. ``grad`` thus costs one
  forward and one backward kernel, ``jvp`` one forward and one tangent.

  Operands, for an op with operands ``xs`` (n of them), outputs ``ys`` and
  residuals ``rs``:

  * tangent stage: ``(*xs, *rs, *x_dots) -> y_dots`` (one per output),
    linear in ``x_dots``;
  * backward stage: ``(*xs, *rs, *y_cts) -> x_cts`` (one per operand).

  Attributes:
    tangent: the tangent stage; None: ``jax.jvp`` of the op's reference (an
      XLA program, linear in the tangents).
    bwd: the backward stage; None: the tangent stage is its own transpose
      (then ``tangent`` must be given).
    residuals: how many trailing results of the forward are residuals.
  """

  tangent: Optional[KernelStage] = None
  bwd: Optional[KernelStage] = None
  residuals: int = 0


# ----------------------------------------------------------------------------
# Sharding dims.


@dataclasses.dataclass(frozen=True)
class _Labels:
  """One operand's or result's factor names; ``ellipsis``: they follow a leading ``...``."""

  names: tuple[str, ...]
  ellipsis: bool = False

  def expand(self, ndim: int) -> tuple[str, ...]:
    extra = ndim - len(self.names)
    lead = tuple(_ELLIPSIS_FACTOR.format(extra - 1 - j) for j in range(extra))
    return lead + self.names

  def __str__(self) -> str:
    return " ".join(("...",) * self.ellipsis + self.names)


def _parse_labels(text: str, what: str) -> _Labels:
  tokens = text.split()
  ellipsis = bool(tokens) and tokens[0] == "..."
  names = tuple(tokens[1:] if ellipsis else tokens)
  for name in names:
    if name == "...":
      raise ValueError(f"dims: '...' may only lead an operand's or result's dims; got {what}")
    if not name.isidentifier() or name.startswith("_"):
      raise ValueError(
        f"dims: factor names are identifiers not starting with '_'; got {name!r} in {what}"
      )
  if len(set(names)) != len(names):
    raise ValueError(f"dims: a factor may name one dim of an array; got {what}")
  return _Labels(names, ellipsis)


class _DimsRule:
  """The sharding dims of one primitive: a parsed string, a fixed ``Dims`` or a callable."""

  def __init__(self, dims: DimsArg, replicated: Sequence[str] = (), *, what: str = "dims"):
    self.operands: Optional[tuple[_Labels, ...]] = None
    self.results: Optional[tuple[_Labels, ...]] = None
    self.fixed: Optional[Dims] = None
    self.fn: Optional[Callable[..., Dims]] = None
    self.replicated = tuple(replicated) if not isinstance(replicated, str) else (replicated,)
    if isinstance(dims, str):
      if dims.count("->") != 1:
        raise ValueError(
          f"{what}: expected 'operands -> results' such as '... c, ... c -> ... c', got {dims!r}"
        )
      left, right = dims.split("->")
      self.operands = tuple(_parse_labels(t, repr(dims)) for t in left.split(","))
      self.results = tuple(_parse_labels(t, repr(dims)) for t in right.split(","))
      used = {n for labels in self.operands + self.results for n in labels.names}
      unknown = [f for f in self.replicated if f not in used]
      if unknown:
        raise ValueError(f"replicated: {unknown} name no factor of {what} {dims!r}")
    elif self.replicated:
      raise ValueError(
        f"replicated: only with a dims string; a {type(dims).__name__} names its own "
        "(Dims.replicated)"
      )
    elif isinstance(dims, Dims):
      self.fixed = dims
      self.operands = tuple(_Labels(tuple(d)) for d in dims.operands)
      self.results = tuple(_Labels(tuple(d)) for d in dims.results)
    elif callable(dims):
      self.fn = dims
    else:
      raise TypeError(
        f"{what} must be a string ('... c, ... c -> ... c'), a pallax.op.Dims or a callable "
        f"(*avals, **params) -> Dims; got {type(dims).__name__}"
      )

  @property
  def arity(self) -> Optional[int]:
    return None if self.operands is None else len(self.operands)

  def __str__(self) -> str:
    if self.operands is None:
      return "<dims callable>"
    return f"{', '.join(map(str, self.operands))} -> {', '.join(map(str, self.results))}"

  def check_operands(self, op: str, avals: Sequence[Any]) -> None:
    """ValueError unless ``avals`` fit the labels: ranks, and one size per factor."""
    if self.operands is None:
      return
    sizes: dict[str, tuple[int, int]] = {}
    for i, (labels, a) in enumerate(zip(self.operands, avals)):
      need = len(labels.names)
      if (a.ndim < need) if labels.ellipsis else (a.ndim != need):
        rank = f"at least {need}" if labels.ellipsis else f"{need}"
        raise ValueError(
          f"{op}: operand {i} must have rank {rank} (dims {self}); got shape {a.shape}"
        )
      for factor, size in zip(labels.expand(a.ndim), a.shape):
        seen = sizes.setdefault(factor, (i, size))
        if seen[1] != size:
          raise ValueError(
            f"{op}: factor {_describe(factor)} of dims {self} has size {seen[1]} in operand "
            f"{seen[0]} (shape {avals[seen[0]].shape}) but {size} in operand {i} (shape {a.shape})"
          )

  def __call__(self, avals_in: Sequence[Any], avals_out: Sequence[Any], params: dict) -> Dims:
    """The ``Dims`` of a call with these per-example operand and result avals."""
    if self.fn is not None:
      dims = self.fn(*_structs(avals_in), **params)
      if not isinstance(dims, Dims):
        raise TypeError(f"dims callable must return a pallax.op.Dims, got {type(dims).__name__}")
      return dims
    if self.fixed is not None:
      return self.fixed
    if len(avals_out) != len(self.results):
      raise ValueError(
        f"dims {self} names {len(self.results)} results; the op returns {len(avals_out)}"
      )
    for labels, a in zip(self.results, avals_out):
      if (a.ndim < len(labels.names)) if labels.ellipsis else (a.ndim != len(labels.names)):
        raise ValueError(f"dims {self}: result of shape {a.shape} does not fit {labels}")
    return Dims(
      operands=tuple(lab.expand(a.ndim) for lab, a in zip(self.operands, avals_in)),
      results=tuple(lab.expand(a.ndim) for lab, a in zip(self.results, avals_out)),
      replicated=self.replicated,
    )

  def stage(self, layout: Sequence[tuple[str, int]], results: Sequence[tuple[str, int]]):
    """The dims string of a residual stage: operands picked from the op's operands/results."""
    if self.operands is None:
      return None
    pick = {"operand": self.operands, "result": self.results}
    left = ", ".join(str(pick[k][i]) for k, i in layout)
    right = ", ".join(str(pick[k][i]) for k, i in results)
    return _DimsRule(f"{left} -> {right}", self.replicated)


def _describe(factor: str) -> str:
  return "'...'" if factor.startswith("_e") else repr(factor)


def _structs(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _lead(avals: Sequence[Any], size: int) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct((size, *a.shape), a.dtype) for a in avals]


def _strip(avals: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in avals]


def _as_list(outs: Any, what: str) -> list:
  if isinstance(outs, (list, tuple)):
    return list(outs)
  if isinstance(outs, (jax.Array, jax.core.Tracer, jax.ShapeDtypeStruct)):
    return [outs]
  raise TypeError(f"{what} must return an array or a sequence of arrays, got {type(outs).__name__}")


# ----------------------------------------------------------------------------
# One primitive: reference, kernels, config space, dims, batching.


@dataclasses.dataclass
class _Stage:
  """Everything one primitive of a custom op is built from."""

  name: str
  reference: Callable[..., Any]
  kernels: Mapping[str, Callable[..., Any]]
  config: Optional[ConfigSpace]
  dims: _DimsRule
  batching: BatchingArg
  abstract_eval: Optional[Callable[..., Any]] = None
  _shapes: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def grid(self) -> bool:
    """Whether the kernels take a leading batch axis (``batching="grid"``)."""
    return self.batching == "grid"

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
    structs = _structs(avals)
    if self.abstract_eval is not None:
      outs, what = self.abstract_eval(*structs, **params), f"{self.name}: abstract_eval"
    else:
      outs = jax.eval_shape(functools.partial(self.reference, **params), *structs)
      what = f"{self.name}: reference"
    single = not isinstance(outs, (list, tuple))
    outs = _as_list(outs, what)
    for o in outs:
      if not (hasattr(o, "shape") and hasattr(o, "dtype")):
        raise TypeError(f"{what} must give arrays or jax.ShapeDtypeStructs, got {o!r}")
    return [jax.ShapeDtypeStruct(tuple(o.shape), o.dtype) for o in outs], single

  def example_avals(self, avals: Sequence[Any], batched: bool) -> list:
    """The per-example operand avals of a primitive call."""
    return _strip(avals) if batched else _structs(avals)

  def call_dims(self, avals: Sequence[Any], params: dict) -> Dims:
    """The ``Dims`` of a primitive call (the grid-batch axis a factor of its own)."""
    batched = params[BATCHED]
    own = op_params(params)
    own.pop(BATCHED)
    per = self.example_avals(avals, batched)
    dims = self.dims(per, self.out_structs(per, own)[0], own)
    if not batched:
      return dims
    lead = lambda d: tuple((_BATCH_FACTOR, *names) for names in d)
    return dataclasses.replace(dims, operands=lead(dims.operands), results=lead(dims.results))

  def abstract(self, *avals, **params) -> list:
    """The primitive's abstract eval: shapes from the user, shardings from the dims."""
    batched = params[BATCHED]
    own = op_params(params)
    own.pop(BATCHED)
    per = self.example_avals(avals, batched)
    outs = self.out_structs(per, own)[0]
    if batched:
      outs = _lead(outs, avals[0].shape[0])
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
    batched = params.pop(BATCHED)
    fn = lambda *a: _as_list(self.reference(*a, **params), f"{self.name}: reference")
    return list(jax.vmap(fn)(*arrays) if batched else fn(*arrays))

  def impl(self, backend: str) -> Callable[..., list]:
    user = self.kernels[backend]

    def run(*arrays, config, interpret, **params):
      batched = params.pop(BATCHED)
      what = f"{self.name}: the {backend} kernel"
      call = lambda *a: _as_list(user(*a, config=config, interpret=interpret, **params), what)
      if self.grid:  # the kernel takes a leading batch axis: always give it one
        if batched:
          return call(*arrays)
        return [o[0] for o in call(*(a[None] for a in arrays))]
      if not batched:
        return call(*arrays)
      # A vmapped call that could not be folded: Pallas turns vmap of a
      # pallas_call into one pallas_call with a grid axis more (raw Triton
      # calls cannot be vmapped: ``supports`` refuses them).
      return list(jax.vmap(call)(*arrays))

    return run

  def kernel_avals(self, avals: Sequence[Any], batched: bool) -> list:
    """The operands' structs as the kernel function sees them."""
    if self.grid:
      return _structs(avals) if batched else _lead(avals, 1)
    return self.example_avals(avals, batched)

  def kernel(self) -> Optional[Kernel]:
    if not self.kernels:
      return None
    space = self.config
    user_candidates = space.candidates or (
      lambda avals, target, **p: [space.heuristic(avals, target, **p)]
    )

    def checked(config: Any, what: str) -> KernelConfig:
      if not isinstance(config, space.config_cls):
        raise TypeError(
          f"{self.name}: {what} must return a {space.config_cls.__name__}, "
          f"got {type(config).__name__}"
        )
      return config

    @functools.wraps(space.heuristic)  # keeps the user's module: not one of pallax's kernels
    def heuristic(avals, target, **params):
      batched = params.pop(BATCHED)
      config = space.heuristic(self.kernel_avals(avals, batched), target, **params)
      return checked(config, "ConfigSpace.heuristic")

    @functools.wraps(user_candidates)
    def candidates(avals, target, **params):
      batched = params.pop(BATCHED)
      configs = user_candidates(self.kernel_avals(avals, batched), target, **params)
      return [checked(c, "ConfigSpace.candidates") for c in configs]

    @functools.wraps(space.supports or space.heuristic)
    def supports(avals, target, config, **params):
      batched = params.pop(BATCHED)
      if not isinstance(config, space.config_cls):
        return f"{self.name} takes a {space.config_cls.__name__}, not a {type(config).__name__}"
      raw = config.implementation == triton_raw.IMPLEMENTATION
      if resolve(config.implementation, target, tuple(self.kernels)) not in self.kernels:
        wanted = (
          kernel_backend(target) if config.implementation == PALLAS else config.implementation
        )
        return f"{self.name} has no {wanted} kernel (it has: {', '.join(sorted(self.kernels))})"
      if raw and batched and not self.grid:
        return (
          f"{self.name}: this vmapped call cannot be folded into a batch-like dim of "
          f"dims {self.dims}, and a raw Triton kernel cannot be vmapped; declare "
          "batching='grid' with a kernel that takes a leading batch axis"
        )
      if space.supports is None:
        return None
      return space.supports(self.kernel_avals(avals, batched), target, config, **params)

    impls = {b: self.impl(b) for b in self.kernels}
    return Kernel(impls, space.config_cls, heuristic, candidates, supports, space.version)

  # Batching -------------------------------------------------------------------

  def batching_rule(self) -> Callable[..., tuple]:
    if callable(self.batching):
      return self.batching

    def rule(prim, args, bdims, **params):
      size = axis_size(args, bdims)
      if not params[BATCHED] and not self.grid:
        folded = self._fold(prim, args, bdims, size, params)
        if folded is not None:
          return folded
      return self._grid(prim, args, bdims, size, params)

    return rule

  def _grid(self, prim, args, bdims, size, params):
    """The vmapped axis as the leading grid-batch axis, merged with one already there."""
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, bdims)]
    if not params[BATCHED]:
      outs = prim.bind(*args, **{**params, BATCHED: True})
      return outs, [0] * len(outs)
    inner = args[0].shape[1]
    args = [a.reshape((size * inner, *a.shape[2:])) for a in args]
    outs = prim.bind(*args, **params)
    return [o.reshape((size, inner, *o.shape[1:])) for o in outs], [0] * len(outs)

  def _fold(self, prim, args, bdims, size, params):
    """The vmapped axis folded into a batch-like dim of every operand holding it, if it can be.

    Where every mapped operand and every result have a leading ``...`` of one
    length, the axis becomes one more leading dim of each ``...`` (unmapped
    operands with ``...`` are broadcast). Else it is merged into the first
    batch-like factor (in every result, not replicated) that every mapped
    operand has: moved next to it and reshaped into it. None: neither.
    """
    mapped = [d is not NOT_MAPPED for d in bdims]
    per = [
      jax.ShapeDtypeStruct(a.shape if d is NOT_MAPPED else a.shape[:d] + a.shape[d + 1 :], a.dtype)
      for a, d in zip(args, bdims)
    ]
    own = {k: v for k, v in op_params(params).items() if k != BATCHED}
    outs = self.out_structs(per, own)[0]
    if self.dims.operands is not None and self.dims.fixed is None:
      lengths = {
        a.ndim - len(lab.names)
        for lab, a in list(zip(self.dims.operands, per)) + list(zip(self.dims.results, outs))
        if lab.ellipsis
      }
      if (
        all(r.ellipsis for r in self.dims.results)
        and all(lab.ellipsis for lab, m in zip(self.dims.operands, mapped) if m)
        and len(lengths) == 1
      ):
        new = [
          a
          if not lab.ellipsis
          else (
            jnp.moveaxis(a, d, 0) if d is not NOT_MAPPED else batching.broadcast(a, size, 0, None)
          )
          for a, d, lab in zip(args, bdims, self.dims.operands)
        ]
        out = prim.bind(*new, **params)
        return out, [0] * len(out)
    dims = self.dims(per, outs, own)
    refused = set(dims.replicated) | set(dims.refused) | dims.program_factors
    order = [f for names in dims.operands + dims.results for f in names]
    for f in dict.fromkeys(order):
      if f in refused or any(names.count(f) > 1 for names in dims.operands + dims.results):
        continue
      if all(f in names for names in dims.results) and all(
        f in names for names, m in zip(dims.operands, mapped) if m
      ):
        return self._merge(prim, args, bdims, size, params, dims, f, outs)
    return None

  def _merge(self, prim, args, bdims, size, params, dims, factor, outs):
    new = []
    for a, d, names in zip(args, bdims, dims.operands):
      if factor in names:
        p = names.index(factor)
        a = batching.broadcast(a, size, p, None) if d is NOT_MAPPED else jnp.moveaxis(a, d, p)
        a = a.reshape((*a.shape[:p], size * a.shape[p + 1], *a.shape[p + 2 :]))
      new.append(a)
    results = prim.bind(*new, **params)
    out_dims = [names.index(factor) for names in dims.results]
    split = [
      o.reshape((*o.shape[:q], size, per.shape[q], *o.shape[q + 1 :]))
      for o, q, per in zip(results, out_dims, outs)
    ]
    return split, out_dims

  def spec(self) -> PrimitiveSpec:
    return PrimitiveSpec(
      abstract_eval=self.abstract,
      xla=self.xla,
      kernel=self.kernel(),
      dims=lambda *avals, **params: self.call_dims(avals, params),
      batching=self.batching_rule(),
    )


# ----------------------------------------------------------------------------
# The public op.


class CustomOp:
  """A user's op as ``custom_op`` declared it; call it like a function.

  ``op(*arrays, config=None, **params)``: ``arrays`` are the operands,
  ``params`` static keyword arguments (hashable: Python numbers, strings,
  tuples) passed to the reference, the kernels and the config space;
  ``config`` pins a config instead of letting the executor choose.

  Attributes:
    name: the op's name (the primitive's, and the executor's for its kernel).
    reference: the reference ``(*arrays, **params)``, the XLA program.
    primitive: the primitive a call binds (the forward one with ``ResidualJVP``).
    primitives: all of the op's primitives (forward, tangent, backward).
    config_cls: the config class, or None for an op without kernels.
  """

  def __init__(
    self,
    name: str,
    stage: _Stage,
    primitives: tuple[KernelPrimitive, ...],
    residuals: int,
  ):
    self.name = name
    self.reference = stage.reference
    self.primitive = primitives[0]
    self.primitives = primitives
    self.config_cls = stage.config.config_cls if stage.config is not None else None
    self.__name__ = self.__qualname__ = name
    self._stage = stage
    self._residuals = residuals

  def __repr__(self) -> str:
    return f"pallax.custom_op({self.name!r}, dims={str(self._stage.dims)!r})"

  def __call__(self, *args: Any, config: Optional[KernelConfig] = None, **params: Any) -> Any:
    arity = self._stage.dims.arity
    if arity is not None and len(args) != arity:
      raise TypeError(
        f"{self.name}: takes {arity} array operand(s) (dims {self._stage.dims}), got {len(args)}"
      )
    if not args:
      raise TypeError(f"{self.name}: takes at least one array operand")
    arrays = []
    for i, a in enumerate(args):
      try:
        arrays.append(jnp.asarray(a))
      except TypeError as e:
        raise TypeError(f"{self.name}: operand {i} must be an array, got {type(a).__name__}") from e
    self._stage.dims.check_operands(self.name, arrays)
    if config is not None:
      if self.config_cls is None:
        raise TypeError(f"{self.name}: has no kernels, so config must be None; got {config!r}")
      if not isinstance(config, self.config_cls):
        raise TypeError(
          f"{self.name}: config must be a {self.config_cls.__name__}, got {type(config).__name__}"
        )
    for key, value in params.items():
      if key in _RESERVED:
        raise ValueError(f"{self.name}: {key!r} is reserved, not a param of the op")
      if isinstance(value, (jax.Array, jax.core.Tracer, np.ndarray)):
        raise TypeError(
          f"{self.name}: param {key} must be static, not an array; pass arrays as operands"
        )
      try:
        hash(value)
      except TypeError:
        raise TypeError(
          f"{self.name}: param {key}={value!r} must be hashable (static): a Python number, "
          "string or tuple"
        ) from None
    single = self._stage.out_structs(arrays, params)[1]
    outs = bind(self.primitive, *match_manual_axes(*arrays), config=config, batched=False, **params)
    if self._residuals:  # hidden; one output left is returned as an array
      outs, single = outs[: len(outs) - self._residuals], True
    return outs[0] if single and len(outs) == 1 else tuple(outs)


def _check_kernels(kernels: Any, what: str) -> dict[str, Callable[..., Any]]:
  if kernels is None:
    return {}
  if not isinstance(kernels, Mapping):
    raise TypeError(
      f"{what} must be a mapping backend -> kernel function, e.g. "
      f"{{'triton_raw': fn}}; got {type(kernels).__name__}"
    )
  known = [*_KERNEL_ALIASES, *(name for name in implementations() if name != XLA)]
  for backend, fn in kernels.items():
    if backend not in known:
      raise ValueError(f"{what}: unknown backend {backend!r}; kernels are for {', '.join(known)}")
    if not callable(fn):
      raise TypeError(f"{what}[{backend!r}] must be callable, got {type(fn).__name__}")
  return {_KERNEL_ALIASES.get(backend, backend): fn for backend, fn in kernels.items()}


def _check_name(name: Any, what: str = "name") -> str:
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"{what} must be an identifier such as 'swiglu', got {name!r}")
  if name in registered_ops() or name in _DECLARED:
    raise ValueError(f"{what}: an op is already registered as {name!r}; op names must be unique")
  return name


def _check_callable(value: Any, what: str, optional: bool = True) -> None:
  if (value is not None or not optional) and not callable(value):
    raise TypeError(f"{what} must be callable, got {type(value).__name__}")


# The primitive names of the custom ops declared so far (those without kernels
# are not in the executor's registry).
_DECLARED: set[str] = set()


def custom_op(
  name: str,
  *,
  reference: Callable[..., Any],
  dims: DimsArg,
  kernels: Optional[Mapping[str, Callable[..., Any]]] = None,
  config: Optional[ConfigSpace] = None,
  abstract_eval: Optional[Callable[..., Any]] = None,
  replicated: Sequence[str] = (),
  batching: BatchingArg = "fold",
  jvp: Union[None, Callable[..., Any], ResidualJVP] = None,
) -> CustomOp:
  """Turns a user's kernel (Pallas or raw Triton) into a pallax op.

  The op is a JAX primitive (two with ``ResidualJVP``: three), like pallax's
  own: ``jit``, ``vmap`` (one kernel), ``grad``/``jvp``, sharded ``jit``
  (batch-like dims shard without gathers), the executor's selection and
  autotuning (``pallax.autotune``, ``pallax.explain``, persistent caches),
  ``pallax.verify`` compilation and interpret-mode tests all work.

  Args:
    name: the op's name: the primitive's and the executor's (an identifier,
      unique among registered ops). With ``ResidualJVP`` the primitives are
      ``{name}_fwd``, ``{name}_jvp`` and ``{name}_bwd``.
    reference: ``(*arrays, **params) -> array or tuple of arrays``: the XLA
      program (plain jnp). It runs on the CPU and wherever no kernel can run
      a call, and defines what the op computes: test the kernels against an
      independent float64 reference and it.
    dims: the sharding labels, einsum-like: ``"... c, ... c -> ... c"``
      names each operand's and result's dims, comma-separated, ``->``
      between operands and results; a leading ``...`` stands for any number
      of leading dims (aligned from the right, like numpy's broadcasting). A
      factor in operands and a result is batch-like: it shards freely and
      vmap folds into it. A factor of operands only is reduced: a result
      computed from a sharded one is summed across the devices holding it.
      Or a ``pallax.op.Dims`` (fixed ranks, per-shard ``programs``), or a
      callable ``(*avals, **params) -> Dims``.
    kernels: backend -> kernel function ``(*arrays, config, interpret,
      **params) -> array or sequence of arrays``: ``"triton"``/``"mosaic_tpu"``
      (short for ``"pallas_triton"``/``"pallas_mosaic_tpu"``: Pallas kernels,
      ``interpret`` goes to ``pallas_call``), any other registered
      implementation (``pallax.executor.implementation``), and
      ``"triton_raw"`` (a raw Triton kernel started with
      ``pallax.triton_raw.launch(..., interpret=interpret)``). None: the
      reference runs everywhere.
    config: the kernels' ``ConfigSpace`` (required with kernels).
    abstract_eval: ``(*structs, **params) -> ShapeDtypeStruct(s)``, the
      results' shapes and dtypes; None: ``jax.eval_shape`` of ``reference``.
    replicated: factors of a ``dims`` string that must not be sharded (a dim
      the kernel reduces over within a block, such as a normalised axis).
    batching: how ``vmap`` reaches the kernel, as one call: ``"fold"``
      (default) folds the vmapped axis into the leading ``...`` or a
      batch-like factor of every mapped operand (unmapped operands holding it
      are broadcast), or else adds a leading grid-batch axis (Pallas kernels
      get it as a grid axis: ``jax.vmap`` of ``pallas_call``; a raw Triton
      kernel cannot, and the executor runs the reference for that call,
      saying so). ``"grid"``: every kernel takes one leading batch axis on
      every operand and result, always (size 1 for an unvmapped call), and
      vmap only grows it. Or a JAX batching rule ``(prim, args, dims,
      **params) -> (outs, out_dims)`` binding ``prim`` with ``params``.
    jvp: None: the tangent is ``jax.jvp`` of ``reference`` (XLA), the primal
      output the kernel's. A callable ``(primals, tangents, out, **params) ->
      tangent_out`` (``out`` the op's result, the structure of
      ``tangent_out``): jnp or pallax code linear in ``tangents``, so that
      ``grad`` transposes it. A ``ResidualJVP``: tangent and backward stages
      of their own, the backward possibly a kernel.

  Returns:
    The op: call it as ``op(*arrays, config=None, **params)``.

  Raises:
    ValueError, TypeError: a malformed declaration (naming the argument).
  """
  name = _check_name(name)
  _check_callable(reference, "reference", optional=False)
  _check_callable(abstract_eval, "abstract_eval")
  kernels = _check_kernels(kernels, "kernels")
  if kernels and config is None:
    raise ValueError(
      "config: an op with kernels needs a pallax.ConfigSpace (config class and heuristic)"
    )
  if config is not None and not isinstance(config, ConfigSpace):
    raise TypeError(f"config must be a pallax.ConfigSpace, got {type(config).__name__}")
  if config is not None and not kernels:
    raise ValueError("config: given without kernels; the reference needs no config")
  if batching not in ("fold", "grid") and not callable(batching):
    raise ValueError(f"batching must be 'fold', 'grid' or a batching rule, got {batching!r}")
  if jvp is not None and not isinstance(jvp, ResidualJVP) and not callable(jvp):
    raise TypeError(
      f"jvp must be None, a callable (primals, tangents, out, **params) or a "
      f"pallax.ResidualJVP; got {type(jvp).__name__}"
    )
  rule = _DimsRule(dims, replicated)
  stage = _Stage(name, reference, kernels, config, rule, batching, abstract_eval)
  if isinstance(jvp, ResidualJVP):
    return _residual_op(name, stage, jvp)
  prim = define_primitive(name, stage.spec())
  ad.primitive_jvps[prim] = _jvp_rule(prim, stage, jvp)
  _DECLARED.add(name)
  return CustomOp(name, stage, (prim,), 0)


def _per_example(fn: Callable, batched: bool) -> Callable:
  return jax.vmap(fn) if batched else fn


def _jvp_rule(prim: KernelPrimitive, stage: _Stage, jvp: Optional[Callable]) -> Callable:
  """The primitive's JVP: the kernel's outputs, tangents from ``jvp`` or the reference."""

  def rule(primals, tangents, **params):
    outs = prim.bind(*primals, **params)
    own = op_params(params)
    batched = own.pop(BATCHED)
    tangents = instantiate(tangents)
    if jvp is None:
      fn = lambda p, t: jax.jvp(lambda *a: _as_list(stage.reference(*a, **own), "reference"), p, t)[
        1
      ]
      return outs, list(_per_example(fn, batched)(tuple(primals), tuple(tangents)))
    single = stage.out_structs(stage.example_avals(primals, batched), own)[1]

    def user(p, t, o):
      got = jvp(p, t, o[0] if single else tuple(o), **own)
      return _as_list(got, f"{stage.name}: jvp")

    out_tangents = _per_example(user, batched)(tuple(primals), tuple(tangents), tuple(outs))
    if len(out_tangents) != len(outs):
      raise ValueError(
        f"{stage.name}: jvp returned {len(out_tangents)} tangents for {len(outs)} results"
      )
    return outs, list(out_tangents)

  return rule


def _residual_op(name: str, fwd: _Stage, spec: ResidualJVP) -> CustomOp:
  """The op through ``define_residual_op``: forward, tangent and backward primitives."""
  if not isinstance(spec.residuals, int) or isinstance(spec.residuals, bool) or spec.residuals < 0:
    raise ValueError(f"jvp: ResidualJVP.residuals must be an int >= 0, got {spec.residuals!r}")
  if spec.tangent is None and spec.bwd is None:
    raise ValueError(
      "jvp: a ResidualJVP needs a bwd stage (or a tangent stage that is its own transpose)"
    )
  for what, s in (("tangent", spec.tangent), ("bwd", spec.bwd)):
    if s is not None and not isinstance(s, KernelStage):
      raise TypeError(
        f"jvp: ResidualJVP.{what} must be a pallax.KernelStage, got {type(s).__name__}"
      )
  n = fwd.dims.arity
  if n is None or fwd.dims.results is None:
    raise ValueError(
      "dims: an op with a ResidualJVP needs its dims as a string or a pallax.op.Dims "
      "(the stages' operands are laid out from them)"
    )
  outputs = len(fwd.dims.results) - spec.residuals
  if outputs < 1:
    raise ValueError(
      f"jvp: ResidualJVP.residuals={spec.residuals} leaves no output of dims {fwd.dims}"
    )
  for suffix in ("fwd", "jvp", "bwd"):
    _check_name(f"{name}_{suffix}", "name")
  residual = [("result", outputs + i) for i in range(spec.residuals)]
  operands = [("operand", i) for i in range(n)]
  results = [("result", i) for i in range(outputs)]
  tangent_layout = operands + residual + operands
  bwd_layout = operands + residual + results

  def stage(s: Optional[KernelStage], what: str, layout, outs) -> _Stage:
    if s is None:  # the tangent: jax.jvp of the forward's reference

      def reference(*args, **params):
        primals, dots = args[:n], args[n + spec.residuals :]
        _, t = jax.jvp(
          lambda *a: tuple(_as_list(fwd.reference(*a, **params), "reference")), primals, dots
        )
        return list(t[:outputs])

      s = KernelStage(reference)
    _check_callable(s.reference, f"jvp: ResidualJVP.{what}.reference", optional=False)
    _check_callable(s.abstract_eval, f"jvp: ResidualJVP.{what}.abstract_eval")
    kernels = _check_kernels(s.kernels, f"jvp: ResidualJVP.{what}.kernels")
    space = s.config if s.config is not None else fwd.config
    if kernels and space is None:
      raise ValueError(
        f"jvp: ResidualJVP.{what} has kernels but neither it nor the op has a config"
      )
    if space is not None and not isinstance(space, ConfigSpace):
      raise TypeError(f"jvp: ResidualJVP.{what}.config must be a pallax.ConfigSpace")
    if (
      s.config is not None
      and fwd.config is not None
      and space.config_cls is not fwd.config.config_cls
    ):
      raise ValueError(
        f"jvp: ResidualJVP.{what}.config must use the op's config class "
        f"{fwd.config.config_cls.__name__} (a pinned config goes to every stage)"
      )
    if s.dims is not None:
      rule = _DimsRule(s.dims, s.replicated, what=f"ResidualJVP.{what}.dims")
    else:
      rule = fwd.dims.stage(layout, outs)
      if rule is None:
        raise ValueError(f"jvp: ResidualJVP.{what}.dims is needed: the op's dims are not a string")
    return _Stage(
      f"{name}_{what}",
      s.reference,
      kernels,
      space if kernels else None,
      rule,
      fwd.batching,
      s.abstract_eval,
    )

  tangent = stage(spec.tangent, "tangent", tangent_layout, results)
  bwd = None if spec.bwd is None else stage(spec.bwd, "bwd", bwd_layout, operands)

  def tangent_operands(primals, outs, tangents, **params):
    return [*primals, *outs[outputs:], *instantiate(tangents)]

  def residual_tangents(primals, outs, operands, **params):
    # The residuals' tangents (second-order AD differentiates the backward
    # stage with respect to them): jax.jvp of the forward's reference.
    own = op_params(params)
    batched = own.pop(BATCHED)
    dots = operands[n + spec.residuals :]
    fn = lambda p, t: jax.jvp(
      lambda *a: tuple(_as_list(fwd.reference(*a, **own), "reference")), p, t
    )[1]
    return list(_per_example(fn, batched)(tuple(primals), tuple(dots))[outputs:])

  prims = define_residual_op(
    name,
    fwd=fwd.spec(),
    tangent=tangent.spec(),
    bwd=None if bwd is None else bwd.spec(),
    linear=slice(n + spec.residuals, None),
    tangent_operands=tangent_operands,
    residual_tangents=residual_tangents if spec.residuals else None,
  )
  unique = tuple(dict.fromkeys((prims.fwd, prims.tangent, prims.bwd)))
  _DECLARED.update(p.name for p in unique)
  _DECLARED.add(name)
  return CustomOp(name, fwd, unique, spec.residuals)
