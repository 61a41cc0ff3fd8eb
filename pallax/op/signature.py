"""Named operands: an op declares its operands and results once, by name.

An op with optional operands (a bias, a mask, segment ids, sinks) binds a
different number of arrays per call, and every layer that walks them by
position ends up with index arithmetic. Instead the op declares them here,
and each layer asks for what it needs by name:

* ``Operand``: one declared operand or result: its name, the static param
  that says whether the call has it, whether it is differentiable (and the
  param that says whether a call differentiates it), whether it leads with 1
  (broadcast over the batch) rather than the batch.
* ``ResidualSignature``: the declaration of an op built by
  ``define_residual_op``: its inputs and outputs. The names of all three
  stages follow from it: the forward takes the inputs and returns the
  outputs; the tangent takes the residuals and the tangents ``{x}_dot`` of the
  differentiable inputs and returns the tangents of the differentiable
  outputs; the backward takes the residuals and the cotangents ``d{y}`` of
  those outputs and returns the gradients ``d{x}`` of the inputs.
* ``Signature``: one stage's names for one call (optional ones resolved from
  its params), with ``unpack`` (arrays, avals or refs by name: ``Named``) and
  ``pack`` (the reverse), and each name's declared ``Operand``, from which
  batching rules and sharding dims read how a derived operand (``x_dot``,
  ``dx``) is laid out: like the operand it derives from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, Optional

STAGES = ("fwd", "jvp", "bwd")


@dataclasses.dataclass(frozen=True)
class Operand:
  """One declared operand or result.

  Attributes:
    name: its name.
    when: the boolean static param that says a call has it (None: always).
    differentiable: an input with a tangent and a gradient, or an output with
      a tangent and a cotangent; other outputs are statistics the tangent and
      backward stages may read as residuals.
    broadcast: it leads with 1 or with the op's batch dim (broadcast over the
      batch), not always with the batch.
    tangent_when: for an optional differentiable input, the boolean static param that
      says a call differentiates it (absent from the params: it does). Where
      its tangent is a symbolic zero (a constant bias) the tangent rule sets
      it False (``ResidualSignature.zero_tangent_params``): the tangent stage
      then takes no tangent of it and the backward returns no gradient of it,
      so no kernel reads a zero ``(T, S)`` tangent or writes an unused one.
  """

  name: str
  when: Optional[str] = None
  differentiable: bool = False
  broadcast: bool = False
  tangent_when: Optional[str] = None

  def present(self, params: Mapping[str, Any]) -> bool:
    """Whether a call with static ``params`` has this operand."""
    return self.when is None or bool(params[self.when])

  def differentiated(self, params: Mapping[str, Any]) -> bool:
    """Whether a call with static ``params`` has this operand and differentiates it."""
    wanted = self.tangent_when is None or bool(params.get(self.tangent_when, True))
    return self.differentiable and self.present(params) and wanted


def tangent_name(name: str) -> str:
  """The name of ``name``'s tangent: ``x`` -> ``x_dot``."""
  return f"{name}_dot"


def cotangent_name(name: str) -> str:
  """The name of ``name``'s cotangent or gradient: ``x`` -> ``dx``."""
  return f"d{name}"


class Named(Mapping):
  """Values by name, as ``Signature.unpack`` gives them; an absent optional one is None."""

  def __init__(self, values: Mapping[str, Any], optional: Sequence[str] = ()):
    self._values = dict(values)
    self._optional = frozenset(optional)

  def __getitem__(self, name: str) -> Any:
    return self._values[name]

  def __getattr__(self, name: str) -> Any:
    if name.startswith("_"):
      raise AttributeError(name)
    try:
      return self._values[name]
    except KeyError:
      if name in self._optional:
        return None
      raise AttributeError(
        f"no operand or result named {name!r}; have {list(self._values)}"
      ) from None

  def __iter__(self) -> Iterator[str]:
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def __repr__(self) -> str:
    return f"Named({', '.join(self._values)})"


@dataclasses.dataclass(frozen=True)
class Signature:
  """One stage's operand and result names for one call, in binding order.

  Attributes:
    operands, results: the names.
    declared: every name of the op's declaration (present or not, derived
      ones included) -> the declared ``Operand`` it is or derives from.
  """

  operands: tuple[str, ...]
  results: tuple[str, ...]
  declared: Mapping[str, Operand]

  @classmethod
  def declare(
    cls, operands: Sequence[Operand], results: Sequence[Operand], params: Mapping[str, Any]
  ) -> Signature:
    """The names of one call, with static ``params``, of a primitive declaring these."""
    present = lambda declared: tuple(o.name for o in declared if o.present(params))
    return cls(present(operands), present(results), {o.name: o for o in (*operands, *results)})

  def unpack(self, values: Sequence[Any], *, results: bool = False) -> Named:
    """``values`` (one per operand, or per result with ``results``) by name."""
    names = self.results if results else self.operands
    if len(values) != len(names):
      raise ValueError(f"expected {len(names)} values ({', '.join(names)}), got {len(values)}")
    return Named(zip(names, values), optional=self.optional)

  def unpack_all(self, values: Sequence[Any]) -> Named:
    """``values``: the operands followed by the results (a kernel's refs), by name."""
    names = self.operands + self.results
    if len(values) != len(names):
      raise ValueError(f"expected {len(names)} values ({', '.join(names)}), got {len(values)}")
    return Named(zip(names, values), optional=self.optional)

  @property
  def optional(self) -> tuple[str, ...]:
    """The names (derived ones included) of operands a call may lack: ``Named`` gives None."""
    return tuple(n for n, o in self.declared.items() if o.when is not None)

  def pack(self, named: Mapping[str, Any], *, results: bool = False) -> list:
    """The values of ``named`` in the order of the operands (or results)."""
    return [named[n] for n in (self.results if results else self.operands)]

  def operand(self, name: str) -> Operand:
    """The declared operand ``name`` is or derives from."""
    return self.declared[name]

  def index(self, name: str, *, results: bool = False) -> int:
    """Where ``name`` is among the operands (or results)."""
    return (self.results if results else self.operands).index(name)


@dataclasses.dataclass(frozen=True)
class ResidualSignature:
  """The named operands of an op with forward, tangent and backward stages.

  Attributes:
    inputs: the forward's operands.
    outputs: the forward's results.
    residuals: the names of inputs and outputs the tangent and backward stages
      take first, in order (absent optional ones are left out); None: every
      input, then every output.
  """

  inputs: tuple[Operand, ...]
  outputs: tuple[Operand, ...]
  residuals: Optional[tuple[str, ...]] = None

  def __post_init__(self):
    names = [o.name for o in self.inputs + self.outputs]
    if len(set(names)) != len(names):
      raise ValueError(f"operand names must be unique, got {names}")
    derived = [
      d
      for o in self.inputs + self.outputs
      if o.differentiable
      for d in (tangent_name(o.name), cotangent_name(o.name))
    ]
    clash = sorted(set(derived) & set(names))
    if clash:
      raise ValueError(f"operand names {clash} are also tangent or cotangent names")
    unknown = [n for n in self.residuals or () if n not in names]
    if unknown:
      raise ValueError(f"residuals {unknown} name no input or output (have {names})")
    # A dropped tangent reads as an absent optional operand (None), so only those may be.
    optional = lambda o: o.differentiable and o.when is not None
    misplaced = [o.name for o in self.inputs if o.tangent_when and not optional(o)]
    misplaced += [o.name for o in self.outputs if o.tangent_when]
    if misplaced:
      raise ValueError(f"tangent_when is for optional differentiable inputs, not {misplaced}")

  def _declared(self) -> dict[str, Operand]:
    declared = {}
    for o in self.inputs + self.outputs:
      declared[o.name] = o
      if o.differentiable:
        declared[tangent_name(o.name)] = o
        declared[cotangent_name(o.name)] = o
    return declared

  def _residuals(self, params: Mapping[str, Any]) -> tuple[str, ...]:
    by_name = {o.name: o for o in self.inputs + self.outputs}
    names = self.residuals if self.residuals is not None else tuple(by_name)
    return tuple(n for n in names if by_name[n].present(params))

  def _differentiable(self, operands: Sequence[Operand], params) -> tuple[str, ...]:
    return tuple(o.name for o in operands if o.differentiated(params))

  def zero_tangent_params(self, zero: Collection[str], params: Mapping[str, Any]) -> dict:
    """The params that drop the inputs named in ``zero`` (symbolic-zero tangents) where they may.

    Those of them declared with a ``tangent_when`` param, which is set False.
    """
    return {
      o.tangent_when: False
      for o in self.inputs
      if o.tangent_when is not None and o.name in zero and o.differentiated(params)
    }

  def stage(self, stage: str, params: Mapping[str, Any]) -> Signature:
    """The names of ``stage`` (``"fwd"``, ``"jvp"`` or ``"bwd"``) for a call with ``params``."""
    inputs = self._differentiable(self.inputs, params)
    outputs = self._differentiable(self.outputs, params)
    if stage == "fwd":
      operands = tuple(o.name for o in self.inputs if o.present(params))
      results = tuple(o.name for o in self.outputs if o.present(params))
    elif stage == "jvp":
      operands = self._residuals(params) + tuple(map(tangent_name, inputs))
      results = tuple(map(tangent_name, outputs))
    elif stage == "bwd":
      operands = self._residuals(params) + tuple(map(cotangent_name, outputs))
      results = tuple(map(cotangent_name, inputs))
    else:
      raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return Signature(operands, results, self._declared())

  def linear(self, params: Mapping[str, Any]) -> slice:
    """The block of the tangent stage's operands it is linear in: the tangents."""
    return slice(len(self._residuals(params)), None)

  def tangent_operands(self, primals, outs, tangents, params) -> list:
    """The tangent stage's operands from the forward's operands, results and their tangents.

    Symbolic-zero tangents are left for the caller to instantiate.
    """
    fwd = self.stage("fwd", params)
    values = {**fwd.unpack(primals), **fwd.unpack(outs, results=True)}
    tangent_of = fwd.unpack(tangents)
    inputs = self._differentiable(self.inputs, params)
    return [values[n] for n in self._residuals(params)] + [tangent_of[n] for n in inputs]
