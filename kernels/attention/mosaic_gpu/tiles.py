"""What the Mosaic GPU attention kernels share: block ranges, masks, logits, the step loops.

A consumer warpgroup owns a tile of rows (queries in the forward and the dq
kernel, keys in the dk/dv kernel) and walks the ring's blocks of the other
side that its block of threads sees (``[lo, hi)``). Of those, it computes
the ones its own rows see (``own``), without a mask where every pair of the
block is visible (``unmasked``), and releases the others without computing,
so that every consumer observes every step of the ring.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Problem

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def _div(a, b: int):
  return lax.div(a, jnp.int32(b))


def _ceil_div(a, b: int):
  return _div(jnp.maximum(a, 0) + (b - 1), b)


def _clamp(u_lo, u_hi, lo, hi):
  """``[u_lo, u_hi)`` clamped inside ``[lo, hi)`` (empty where it does not meet it)."""
  u_hi = jnp.maximum(jnp.minimum(u_hi, hi), lo)
  return jnp.minimum(jnp.maximum(u_lo, lo), u_hi), u_hi


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A call's query blocks of ``bq`` rows and key blocks of ``bk`` rows (traced int32 starts)."""

  p: Problem
  bq: int
  bk: int

  # Queries own the rows (the forward and dq kernels): blocks of keys.

  def key_blocks(self, t0, rows: int):
    """``[lo, hi)``: the key blocks queries ``[t0, t0 + rows)`` see."""
    return common.key_range(self.p, t0, rows, self.bk)

  def unmasked_keys(self, t0, lo, hi):
    """Key blocks of ``[lo, hi)`` that every query of ``[t0, t0 + bq)`` sees whole."""
    p, bk = self.p, self.bk
    u_hi = jnp.int32(p.s // bk)  # a block past the keys' end is masked
    if p.right is not None:
      u_hi = jnp.minimum(u_hi, _div(t0 + (p.right + 1), bk))
    u_lo = lo if p.left is None else _ceil_div(t0 + (self.bq - 1 - p.left), bk)
    return _clamp(u_lo, u_hi, lo, hi)

  def keep_keys(self, form: mgpu.Form, t0, j) -> Optional[jax.Array]:
    """Which (query, key) pairs of queries ``[t0, t0 + bq)`` and key block ``j`` are visible."""
    shape = (self.bq, self.bk)
    t_pos, s_pos = t0 + form.iota(shape, 0), j * self.bk + form.iota(shape, 1)
    keep = common.visible(self.p, t_pos, s_pos)
    if self.p.s % self.bk:
      inside = s_pos < self.p.s
      keep = inside if keep is None else keep & inside
    return keep

  # Keys own the rows (the dk/dv kernel): blocks of queries. Padded queries
  # and keys need no mask there: a padded query's lse is +inf (its
  # probabilities 0), a padded key's gradients are cut off.

  def query_blocks(self, s0, rows: int):
    """``[lo, hi)``: the query blocks that see keys ``[s0, s0 + rows)``."""
    return common.query_range(self.p, s0, self.bq, rows)

  def unmasked_queries(self, s0, lo, hi):
    """Query blocks of ``[lo, hi)`` that see every key of ``[s0, s0 + bk)``."""
    p, bq = self.p, self.bq
    u_hi = hi if p.left is None else _div(s0 + (p.left + 1), bq)
    u_lo = lo if p.right is None else _ceil_div(s0 + (self.bk - 1 - p.right), bq)
    return _clamp(u_lo, u_hi, lo, hi)

  def keep_queries(self, form: mgpu.Form, s0, i) -> Optional[jax.Array]:
    """Which (key, query) pairs of keys ``[s0, s0 + bk)`` and query block ``i`` are visible."""
    shape = (self.bk, self.bq)
    s_pos, t_pos = s0 + form.iota(shape, 0), i * self.bq + form.iota(shape, 1)
    return common.visible(self.p, t_pos, s_pos)


def logits2(p: Problem, x: jax.Array, cap_grad: bool = False):
  """``scale * x`` soft-capped, in base 2 (times log2 e); with ``cap_grad`` also the cap's slope.

  The slope ``1 - tanh^2`` (None without a cap) scales the logits' gradient
  on its way back to ``x``.
  """
  if p.soft_cap is None:
    z, slope = x * (p.scale * LOG2E), None
  else:
    t = jnp.tanh(x * (p.scale / p.soft_cap))
    z, slope = t * (p.soft_cap * LOG2E), 1.0 - t * t
  return (z, slope) if cap_grad else z


def masked(z: jax.Array, keep: Optional[jax.Array]) -> jax.Array:
  return z if keep is None else jnp.where(keep, z, NEG_INF)


def broadcast(x: jax.Array, shape, dim: int) -> jax.Array:
  """A row (``dim`` 0) or column (``dim`` 1) statistic broadcast to a tile."""
  return lax.broadcast_in_dim(x, shape, [dim])


def lse2(lse: jax.Array) -> jax.Array:
  """The forward's ``lse`` in base 2 for the backward: +inf where a row saw no key.

  ``exp2(z - lse2)`` is then the probability, 0 on such rows.
  """
  return jnp.where(lse == NEG_INF, jnp.inf, lse) * LOG2E


def over_steps(
  lo, own: tuple[Any, Any], unmasked: tuple[Any, Any], hi, skip: Callable, step: Callable, carry
):
  """Steps ``[lo, hi)``: ``skip(j, carry)`` outside ``own``, ``step(j, carry, masked=)`` in it."""
  (own_lo, own_hi), (u_lo, u_hi) = own, unmasked
  carry = lax.fori_loop(lo, own_lo, skip, carry)
  carry = lax.fori_loop(own_lo, u_lo, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(u_hi, own_hi, functools.partial(step, masked=True), carry)
  return lax.fori_loop(own_hi, hi, skip, carry)


def own_range(lo, hi, own):
  """A consumer's own ``[lo, hi)`` clamped inside its block of threads' (``own`` within it)."""
  own_lo = jnp.minimum(jnp.maximum(own[0], lo), hi)
  return own_lo, jnp.minimum(jnp.maximum(own[1], own_lo), hi)


def pad(x: jax.Array, sizes: dict[int, int], value: float = 0.0) -> jax.Array:
  """``x`` padded at the end of each axis in ``sizes`` to that size."""
  widths = [(0, sizes[i] - d if i in sizes else 0) for i, d in enumerate(x.shape)]
  return jnp.pad(x, widths, constant_values=value)
