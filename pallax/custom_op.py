"""``pallax.custom_op``: an op, a user's or pallax's own, declared in one call.

The public face of ``pallax.op``'s declarations: ``custom_op`` validates its
arguments, builds a ``pallax.op.Declaration`` (reference, kernels and
``ConfigSpace``, ``DimsRule``, batching) and hands its ``PrimitiveSpec`` to
``define_primitive``, or the three stages' to ``define_residual_op``. A
built-in op is declared the same way (``primitives/paged_attention.py``).
The defaults are those every op writes alike:

* the output shapes: ``jax.eval_shape`` of the reference;
* the outputs' shardings: from the sharding dims;
* vmap: the vmapped axis folded into a batch-like dim the dims name (or into
  the leading ``...``), else a grid axis; one kernel either way
  (``pallax.op.fold``);
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from pallax.executor.config import KernelConfig
from pallax.executor.implementation import XLA, implementations
from pallax.executor.registry import ConfigSpace, registered_ops
from pallax.op import (
  FRAMEWORK_PARAMS,
  Declaration,
  DimsRule,
  KernelPrimitive,
  Operand,
  ResidualSignature,
  bind,
  define_primitive,
  define_residual_op,
  match_manual_axes,
)
from pallax.op.declaration import BatchingArg
from pallax.op.dims_rule import DimsArg
from pallax.op.fold import BATCHED, split_params
from pallax.op.signature import STAGES

__all__ = ["custom_op", "CustomOp", "ConfigSpace", "KernelStage", "ResidualJVP"]

# Short names a custom op's kernels may be given under, besides the registered
# implementations' names (``pallax.executor.implementation``).
_KERNEL_ALIASES = {"triton": "pallas_triton", "mosaic_tpu": "pallas_mosaic_tpu"}
# Params a call may not set: the framework's, and the fold rule's ``batched``.
_RESERVED = FRAMEWORK_PARAMS + (BATCHED,)


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
    declaration: Declaration,
    primitives: tuple[KernelPrimitive, ...],
    residuals: int,
  ):
    self.name = name
    self.reference = declaration.reference
    self.primitive = primitives[0]
    self.primitives = primitives
    self.config_cls = declaration.config.config_cls if declaration.config is not None else None
    own = tuple(space.config_cls for space in declaration.own_configs.values())
    self._config_classes = (self.config_cls, *own) if self.config_cls is not None else ()
    self.__name__ = self.__qualname__ = name
    self._declaration = declaration
    self._residuals = residuals

  def __repr__(self) -> str:
    return f"pallax.custom_op({self.name!r}, dims={str(self._declaration.dims)!r})"

  def __call__(self, *args: Any, config: Optional[KernelConfig] = None, **params: Any) -> Any:
    dims = self._declaration.dims
    if dims.arity is not None and len(args) != dims.arity:
      raise TypeError(
        f"{self.name}: takes {dims.arity} array operand(s) (dims {dims}), got {len(args)}"
      )
    if not args:
      raise TypeError(f"{self.name}: takes at least one array operand")
    arrays = []
    for i, a in enumerate(args):
      try:
        arrays.append(jnp.asarray(a))
      except TypeError as e:
        raise TypeError(f"{self.name}: operand {i} must be an array, got {type(a).__name__}") from e
    dims.check_operands(self.name, arrays)
    if config is not None:
      if self.config_cls is None:
        raise TypeError(f"{self.name}: has no kernels, so config must be None; got {config!r}")
      if not isinstance(config, self._config_classes):
        names = " or ".join(c.__name__ for c in self._config_classes)
        raise TypeError(f"{self.name}: config must be a {names}, got {type(config).__name__}")
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
    single = self._declaration.out_structs(arrays, params)[1]
    extra = self._declaration.bind_params()
    outs = bind(self.primitive, *match_manual_axes(*arrays), config=config, **extra, **params)
    if self._residuals:  # hidden; one output left is returned as an array
      outs, single = outs[: len(outs) - self._residuals], True
    return outs[0] if single and len(outs) == 1 else tuple(outs)


def _by_backend(value: Any, what: str, expected: str, check) -> dict[str, Any]:
  """``value``, a mapping backend -> item (None: empty), checked, aliases resolved.

  ``check(backend, item)`` raises on a bad entry; ``expected`` says what the
  mapping should be, for the error.
  """
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise TypeError(f"{what} must be a mapping {expected}; got {type(value).__name__}")
  for backend, item in value.items():
    check(backend, item)
  return {_KERNEL_ALIASES.get(backend, backend): item for backend, item in value.items()}


def _check_own_configs(own_configs: Any, kernels: Mapping[str, Any]) -> dict[str, ConfigSpace]:
  def check(name, space):
    if _KERNEL_ALIASES.get(name, name) not in kernels:
      raise ValueError(f"own_configs: {name!r} is not one of the kernels ({', '.join(kernels)})")
    if not isinstance(space, ConfigSpace):
      raise TypeError(f"own_configs[{name!r}] must be a pallax.ConfigSpace, got {space!r}")

  return _by_backend(own_configs, "own_configs", "implementation -> pallax.ConfigSpace", check)


def _check_kernels(kernels: Any, what: str) -> dict[str, Callable[..., Any]]:
  known = [*_KERNEL_ALIASES, *(name for name in implementations() if name != XLA)]

  def check(backend, fn):
    if backend not in known:
      raise ValueError(f"{what}: unknown backend {backend!r}; kernels are for {', '.join(known)}")
    if not callable(fn):
      raise TypeError(f"{what}[{backend!r}] must be callable, got {type(fn).__name__}")

  expected = "backend -> kernel function, e.g. {'triton_raw': fn}"
  return _by_backend(kernels, what, expected, check)


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
  own_configs: Optional[Mapping[str, ConfigSpace]] = None,
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
      callable ``(*avals, **params) -> Dims``. A program declared with
      ``takes_params=True`` is called as ``run(shards, *blocks,
      params=...)``, with the call's full params:
      ``op.primitive.kernel.bind(*blocks, **params)`` runs the kernel on a
      device's blocks.
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
    own_configs: implementation name (a key of ``kernels``) -> a
      ``ConfigSpace`` of that kernel's own, instead of ``config`` (a config
      class, heuristic, candidates and legality of its own, as pallax's
      Mosaic GPU kernels have); its heuristic may return None: the executor
      then chooses among the other implementations, and its configs are
      autotuning candidates.

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
  own_configs = _check_own_configs(own_configs, kernels)
  declaration = Declaration(
    name,
    reference,
    kernels,
    config,
    DimsRule(dims, replicated),
    batching,
    abstract_eval,
    own_configs,
  )
  if isinstance(jvp, ResidualJVP):
    return _residual_op(name, declaration, jvp)
  prim = define_primitive(name, declaration.spec())
  ad.primitive_jvps[prim] = declaration.jvp_rule(prim, jvp)
  _DECLARED.add(name)
  return CustomOp(name, declaration, (prim,), 0)


def _residual_op(name: str, fwd: Declaration, spec: ResidualJVP) -> CustomOp:
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
  for suffix in STAGES:
    _check_name(f"{name}_{suffix}", "name")
  signature = _signature(n, outputs, spec.residuals)

  def stage(s: Optional[KernelStage], what: str, names: str) -> Declaration:
    if s is None:  # the tangent: jax.jvp of the forward's reference

      def reference(*args, **params):
        primals, dots = args[:n], args[n + spec.residuals :]
        return fwd.reference_tangents(primals, dots, params, False)[:outputs]

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
      rule = DimsRule(s.dims, s.replicated, what=f"ResidualJVP.{what}.dims")
    else:
      rule = fwd.dims.derived(signature.stage("fwd", {}), signature.stage(names, {}))
      if rule is None:
        raise ValueError(
          f"jvp: ResidualJVP.{what}.dims is needed: the op's dims are a callable, or a Dims "
          "with per-shard programs (the stage gives its own)"
        )
    return Declaration(
      f"{name}_{what}",
      s.reference,
      kernels,
      space if kernels else None,
      rule,
      fwd.batching,
      s.abstract_eval,
    )

  tangent = stage(spec.tangent, "tangent", "jvp")
  bwd = None if spec.bwd is None else stage(spec.bwd, "bwd", "bwd")

  def residual_tangents(primals, outs, operands, **params):
    # The residuals' tangents (second-order AD differentiates the backward
    # stage with respect to them): jax.jvp of the forward's reference.
    own, batched = split_params(params)
    dots = operands[n + spec.residuals :]
    return fwd.reference_tangents(primals, dots, own, batched)[outputs:]

  prims = define_residual_op(
    name,
    fwd=fwd.spec(),
    tangent=tangent.spec(),
    bwd=None if bwd is None else bwd.spec(),
    signature=signature,
    residual_tangents=residual_tangents if spec.residuals else None,
  )
  unique = tuple(dict.fromkeys((prims.fwd, prims.tangent, prims.bwd)))
  _DECLARED.update(p.name for p in unique)
  _DECLARED.add(name)
  return CustomOp(name, fwd, unique, spec.residuals)


def _signature(inputs: int, outputs: int, residuals: int) -> ResidualSignature:
  """A residual op's named operands: every input and output differentiable, residuals not.

  The tangent and backward stages take the inputs and the residuals first.
  """
  xs = tuple(Operand(f"x{i}", differentiable=True) for i in range(inputs))
  ys = tuple(Operand(f"y{i}", differentiable=True) for i in range(outputs))
  rs = tuple(Operand(f"r{i}") for i in range(residuals))
  return ResidualSignature(xs, ys + rs, residuals=tuple(o.name for o in xs + rs))
