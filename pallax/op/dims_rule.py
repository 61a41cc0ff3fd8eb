"""``DimsRule``: an op's sharding dims written once, as an einsum-like string.

``"... c, ... c -> ... c"`` names each operand's and result's dims,
comma-separated, ``->`` between operands and results; a leading ``...``
stands for any number of leading dims (factors ``_e0``, ``_e1``, ... counted
from the right, so operands broadcast like numpy's). From the string follow
the ``Dims`` of every call (``pallax.op.sharding``), the check of the
operands' ranks and of one size per factor, the fold batching rule's
batch-like factors (``pallax.op.fold``) and the dims of an op's tangent and
backward stages. A ``DimsRule`` may also hold a fixed ``Dims`` (fixed ranks,
per-shard programs) or a callable ``(*avals, **params) -> Dims``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import jax

from pallax.op.sharding import Dims
from pallax.op.signature import Signature

# The factor names of the dims of a "...", counted from the right.
ELLIPSIS_FACTOR = "_e{}"

DimsArg = Union[str, Dims, Callable[..., Dims]]


@dataclasses.dataclass(frozen=True)
class Labels:
  """One operand's or result's factor names; ``ellipsis``: they follow a leading ``...``."""

  names: tuple[str, ...]
  ellipsis: bool = False

  def expand(self, ndim: int) -> tuple[str, ...]:
    """The factor of each of ``ndim`` dims: the ``...`` ones first."""
    extra = ndim - len(self.names)
    lead = tuple(ELLIPSIS_FACTOR.format(extra - 1 - j) for j in range(extra))
    return lead + self.names

  def fits(self, ndim: int) -> bool:
    """Whether an array of rank ``ndim`` has these dims."""
    return ndim >= len(self.names) if self.ellipsis else ndim == len(self.names)

  def __str__(self) -> str:
    return " ".join(("...",) * self.ellipsis + self.names)


def _parse_labels(text: str, what: str) -> Labels:
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
  return Labels(names, ellipsis)


class DimsRule:
  """The sharding dims of one primitive: a parsed string, a fixed ``Dims`` or a callable.

  Attributes:
    operands, results: each operand's and result's ``Labels`` (None for a
      callable, whose dims depend on the call).
    fixed: the ``Dims`` given as is, or None.
    fn: the callable, or None.
    replicated: the factors of a string that must not be sharded.
  """

  def __init__(self, dims: DimsArg, replicated: Sequence[str] = (), *, what: str = "dims"):
    """Reads ``dims`` (``what`` names it in errors) with ``replicated`` factors of a string.

    Raises:
      ValueError: a malformed string, or replicated factors it does not name.
      TypeError: ``dims`` is neither a string, a ``Dims`` nor callable.
    """
    self.operands: Optional[tuple[Labels, ...]] = None
    self.results: Optional[tuple[Labels, ...]] = None
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
      self.operands = tuple(Labels(tuple(d)) for d in dims.operands)
      self.results = tuple(Labels(tuple(d)) for d in dims.results)
    elif callable(dims):
      self.fn = dims
    else:
      raise TypeError(
        f"{what} must be a string ('... c, ... c -> ... c'), a pallax.op.Dims or a callable "
        f"(*avals, **params) -> Dims; got {type(dims).__name__}"
      )

  @property
  def arity(self) -> Optional[int]:
    """The number of operands (None for a callable)."""
    return None if self.operands is None else len(self.operands)

  @property
  def parsed(self) -> bool:
    """Whether the dims came from a string (their ``...`` may hold a vmapped axis)."""
    return self.operands is not None and self.fixed is None

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
      if not labels.fits(a.ndim):
        need = len(labels.names)
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
    """The ``Dims`` of a call with these (per-example) operand and result avals."""
    if self.fn is not None:
      structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals_in]
      dims = self.fn(*structs, **params)
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
      if not labels.fits(a.ndim):
        raise ValueError(f"dims {self}: result of shape {a.shape} does not fit {labels}")
    return Dims(
      operands=tuple(lab.expand(a.ndim) for lab, a in zip(self.operands, avals_in)),
      results=tuple(lab.expand(a.ndim) for lab, a in zip(self.results, avals_out)),
      replicated=self.replicated,
    )

  def derived(self, forward: Signature, stage: Signature) -> Optional[DimsRule]:
    """The dims of another stage of an op whose ``forward`` stage has these dims.

    ``forward`` and ``stage`` are a ``ResidualSignature``'s stages
    (``pallax.op.signature``): each operand and result of ``stage`` (a
    residual, a tangent, a cotangent) has the dims of the forward's operand
    or result it is or derives from; a fixed ``Dims``' replicated and refused
    factors hold there too. None where the dims are a callable, or a fixed
    ``Dims`` with per-shard programs (their tangent and backward programs
    are the stage's own to give).
    """
    if self.operands is None or (self.fixed is not None and self.fixed.programs):
      return None
    labels = dict(zip(forward.operands, self.operands))
    labels.update(zip(forward.results, self.results))
    if self.fixed is not None:
      of = lambda names: tuple(labels[stage.operand(n).name].names for n in names)
      return DimsRule(
        Dims(
          operands=of(stage.operands),
          results=of(stage.results),
          replicated=self.fixed.replicated,
          refused=self.fixed.refused,
        )
      )
    of = lambda names: ", ".join(str(labels[stage.operand(n).name]) for n in names)
    return DimsRule(f"{of(stage.operands)} -> {of(stage.results)}", self.replicated)


def _describe(factor: str) -> str:
  return "'...'" if factor.startswith("_e") else repr(factor)
