"""How a sequence's tokens are laid out over the devices that shard it (context parallelism).

A sequence dim sharded over ``P`` devices gives device ``d`` the ``d``-th
slice of the array. Which tokens that slice holds is the layout's choice:

* ``contiguous``: tokens ``[d L/P, (d+1) L/P)``, the array in natural order.
  With a causal mask the first device sees a sliver of the keys and the last
  all of them, so the devices' work ranges from ``1/P`` to all of it.
* ``zigzag``: the sequence cut in ``2P`` chunks, device ``d`` holding chunks
  ``d`` and ``2P-1-d``: under a causal mask every device does the same work.
* ``striped``: token ``t`` on device ``t mod P`` (device ``d`` holds
  ``d, d+P, d+2P, ...``): even work too, and each key block a device visits
  is a band of the causal mask (Striped Attention).

The array handed to ``pallax.dot_product_attention(..., sequence_layout=)``
holds the tokens in the layout's order; ``context_parallel`` permutes
tokens, positions, segment ids or labels into a layout and back. A layout
names its shard count, so an array in zigzag order for 8 devices means the
same thing sharded over 8 devices, gathered on one, or on a single device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SequenceLayout", "context_parallel", "KINDS"]

KINDS = ("contiguous", "zigzag", "striped")


class Piece(NamedTuple):
  """A run of a device's local tokens at evenly spaced global positions.

  start: its first local index; length: how many tokens; first: the global
  position of its first token; stride: the global distance between
  consecutive tokens (1, or ``P`` in the striped layout).
  """

  start: int
  length: int
  first: int
  stride: int


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
  """The order of a sequence's tokens for ``shards`` devices (``KINDS``; see the module doc).

  Attributes:
    kind: ``"contiguous"``, ``"zigzag"`` or ``"striped"``.
    shards: the number of devices the sequence is sharded over.
  """

  kind: str = "contiguous"
  shards: int = 1

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"SequenceLayout: kind must be one of {KINDS}, got {self.kind!r}")
    if isinstance(self.shards, bool) or not isinstance(self.shards, (int, np.integer)):
      raise TypeError(f"SequenceLayout: shards must be an int, got {self.shards!r}")
    if self.shards < 1:
      raise ValueError(f"SequenceLayout: shards must be positive, got {self.shards}")
    object.__setattr__(self, "shards", int(self.shards))

  @property
  def natural(self) -> bool:
    """Whether the array holds the tokens in natural order (contiguous, or one shard)."""
    return self.kind == "contiguous" or self.shards == 1

  @property
  def stride(self) -> int:
    """The global distance between a device's consecutive tokens within a piece."""
    return self.shards if self.kind == "striped" and self.shards > 1 else 1

  def check(self, length: int, what: str = "sequence") -> None:
    """ValueError unless a sequence of ``length`` tokens splits evenly into this layout."""
    unit = 2 * self.shards if self.kind == "zigzag" else self.shards
    if length % unit:
      raise ValueError(
        f"{what}: a {self.kind} layout over {self.shards} shards needs a length divisible by "
        f"{unit}, got {length}"
      )

  def pieces(self, device: int, length: int) -> tuple[Piece, ...]:
    """The pieces of device ``device``'s slice of a ``length``-token sequence."""
    self.check(length)
    p = self.shards
    if self.kind == "zigzag":
      c = length // (2 * p)
      return (Piece(0, c, device * c, 1), Piece(c, c, (2 * p - 1 - device) * c, 1))
    n = length // p
    if self.kind == "striped":
      return (Piece(0, n, device, p),)
    return (Piece(0, n, device * n, 1),)

  def order(self, length: int) -> np.ndarray:
    """The global position of the token at each index of an array in this layout."""
    return _order(self, length)

  def inverse_order(self, length: int) -> np.ndarray:
    """The index, in an array in this layout, of the token at each global position."""
    return _inverse(self, length)

  def to_layout(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """``x``'s ``axis`` (natural order) permuted into this layout."""
    return jnp.take(x, self.order(x.shape[axis]), axis=axis)

  def from_layout(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """``x``'s ``axis`` (in this layout) permuted back into natural order."""
    return jnp.take(x, self.inverse_order(x.shape[axis]), axis=axis)


@functools.lru_cache(maxsize=64)
def _order(layout: SequenceLayout, length: int) -> np.ndarray:
  order = np.concatenate(
    [
      np.arange(piece.first, piece.first + piece.stride * piece.length, piece.stride)
      for device in range(layout.shards)
      for piece in layout.pieces(device, length)
    ]
  ).astype(np.int32)
  order.flags.writeable = False
  return order


@functools.lru_cache(maxsize=64)
def _inverse(layout: SequenceLayout, length: int) -> np.ndarray:
  inverse = np.argsort(_order(layout, length)).astype(np.int32)
  inverse.flags.writeable = False
  return inverse


def context_parallel(
  layout: SequenceLayout, *arrays: jax.Array, axis: int = 1, inverse: bool = False
) -> tuple[jax.Array, ...]:
  """``arrays`` permuted along ``axis`` into ``layout`` (with ``inverse``, back to natural order).

  Permute every array indexed by token the same way: the query, key and
  value, positions (``layout.order(length)`` are the positions of an array in
  the layout), segment ids, labels and masks; the attention output comes
  back in the layout and ``inverse=True`` restores it.

  Args:
    layout: the layout, e.g. ``SequenceLayout("zigzag", shards=8)``.
    *arrays: arrays with the sequence at ``axis`` (``(B, T, ...)`` by default).
    axis: the sequence dim.
    inverse: permute from the layout back to natural order.

  Returns:
    The permuted arrays, a tuple even for one.
  """
  if not isinstance(layout, SequenceLayout):
    raise TypeError(f"context_parallel: layout must be a SequenceLayout, got {layout!r}")
  move = layout.from_layout if inverse else layout.to_layout
  out = []
  for i, x in enumerate(arrays):
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
      raise ValueError(
        f"context_parallel: axis {axis} is out of range for array {i} of shape {x.shape}"
      )
    layout.check(x.shape[axis], f"context_parallel: array {i} of shape {x.shape}")
    out.append(move(x, axis % x.ndim))
  return tuple(out)
