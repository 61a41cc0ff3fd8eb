"""``pallax.ragged_dot_general``: ``jax.lax.ragged_dot_general``'s three modes on pallax's products.

Each mode is brought to the grouped products of ``pallax.ragged_dot`` by
transposes and reshapes, and its batch dims and the lhs dims outer to the
ragged one by ``vmap`` (one primitive: ``ragged_dot``'s batching rules):

1. ragged non-contracting (``rhs`` has a group dim): the grouped GEMM, the
   lhs free dims inner to the ragged one folded into its rows;
2. ragged contracting (no group dim): the ragged-contracting product
   (``tgmm``), a leading group dim in the result; the contracting dims inner
   to the ragged one folded into its rows, the outer ones summed;
3. ragged batch: XLA's semantics make it a plain ``dot_general`` (the
   groups do not change the product), which runs as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax.kernels.ragged_dot import RaggedDotConfig
from pallax.primitives.ragged_dot import gmm_op, int_array, product, tgmm_op
from pallax.validation import check_floating

__all__ = ["ragged_dot_general"]

_OP = "ragged_dot_general"


def _dims(ndim: int, dims: Sequence[int], name: str) -> list[int]:
  out = [d + ndim if d < 0 else d for d in dims]
  if any(not 0 <= d < ndim for d in out) or len(set(out)) != len(out):
    raise ValueError(f"{_OP}: {name} {tuple(dims)} must be distinct dims of a rank-{ndim} array")
  return out


def _rows(x: jax.Array, lead: int, rows: Sequence[int], cols: Sequence[int]) -> jax.Array:
  """``x`` (already transposed) with its dims after ``lead`` merged into rows, then columns."""
  shape = x.shape[:lead]
  return x.reshape(*shape, math.prod(rows), math.prod(cols))


def _vmapped(fn, lhs_axes: int, rhs_axes: int, total: int):
  """``fn`` vmapped over ``total`` leading axes: the first ``rhs_axes`` of them also ``rhs``'s."""
  for i in reversed(range(total)):
    fn = jax.vmap(fn, in_axes=(0, 0 if i < rhs_axes else None, 0))
  return fn


def ragged_dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  ragged_dot_dimension_numbers: lax.RaggedDotDimensionNumbers,
  precision=None,
  preferred_element_type=None,
  group_offset: Optional[jax.Array] = None,
  *,
  config: Optional[RaggedDotConfig] = None,
) -> jax.Array:
  """Ragged matmul in ``jax.lax.ragged_dot_general``'s three modes, on pallax's grouped products.

  Args:
    lhs: floating, with one ragged dim.
    rhs: floating, with at most one group dim.
    group_sizes: integers ``[g]``, or ``[b..., x..., g]`` as
      ``lax.ragged_dot_general`` says (per batch index and per lhs dim outer
      to the ragged one, among the ragged dim's kind).
    ragged_dot_dimension_numbers: a ``lax.RaggedDotDimensionNumbers``.
    precision: as ``lax.ragged_dot_general``'s.
    preferred_element_type: the result's dtype (default: promoted inputs').
    group_offset: ``[1]``: ragged non-contracting mode only, as
      ``pallax.ragged_dot``'s.
    config: pin the kernels' ``RaggedDotConfig``.

  Returns:
    ``dot_general``'s result, with a leading group dim in the ragged
    contracting mode.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  check_floating(_OP, "lhs", lhs)
  check_floating(_OP, "rhs", rhs)
  dn = ragged_dot_dimension_numbers
  (lc, rc), (lb, rb) = dn.dot_dimension_numbers
  lc, lb = _dims(lhs.ndim, lc, "lhs contracting dims"), _dims(lhs.ndim, lb, "lhs batch dims")
  rc, rb = _dims(rhs.ndim, rc, "rhs contracting dims"), _dims(rhs.ndim, rb, "rhs batch dims")
  groups = _dims(rhs.ndim, dn.rhs_group_dimensions, "rhs group dims")
  ragged = _dims(lhs.ndim, dn.lhs_ragged_dimensions, "lhs ragged dims")
  if len(ragged) != 1 or len(groups) > 1 or len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(
      f"{_OP}: one lhs ragged dim, at most one rhs group dim and paired contracting and batch "
      f"dims; got {dn}"
    )
  for a, b, what in ((lc, rc, "contracting"), (lb, rb, "batch")):
    if [lhs.shape[i] for i in a] != [rhs.shape[i] for i in b]:
      raise ValueError(f"{_OP}: the {what} dims differ in size: lhs {lhs.shape}, rhs {rhs.shape}")
  (r,) = ragged
  lfree = [d for d in range(lhs.ndim) if d not in lc + lb]
  rfree = [d for d in range(rhs.ndim) if d not in rc + rb + groups]
  if r in lb:
    if groups:
      raise ValueError(f"{_OP}: a ragged batch dim takes no rhs group dim; got {dn}")
    return lax.dot_general(
      lhs, rhs, ((lc, rc), (lb, rb)), precision, preferred_element_type=preferred_element_type
    )
  contracting = r in lc
  if contracting == bool(groups):
    need = "no rhs group dim" if contracting else "an rhs group dim"
    raise ValueError(f"{_OP}: a ragged {'contracting' if contracting else 'free'} dim needs {need}")
  if contracting and group_offset is not None:
    raise ValueError(f"{_OP}: group_offset is for the ragged non-contracting mode only")
  own = lc if contracting else lfree
  outer = [d for d in own if d < r]
  inner = [d for d in own if d > r]
  batch = [lhs.shape[d] for d in lb]
  outer_shape = [lhs.shape[d] for d in outer]
  sizes = jnp.asarray(group_sizes)
  sizes = int_array("group_sizes", sizes, "[b..., x..., g]", max(sizes.ndim, 1), _OP)
  if sizes.shape[:-1] not in ((), (*batch, *outer_shape)):
    raise ValueError(
      f"{_OP}: group_sizes must have shape [g] or {(*batch, *outer_shape)} + [g]; got {sizes.shape}"
    )
  sizes = jnp.broadcast_to(sizes, (*batch, *outer_shape, sizes.shape[-1]))
  sizes = sizes * math.prod(lhs.shape[d] for d in inner)
  lead = len(lb) + len(outer)
  if not contracting:
    (gd,) = groups
    if rhs.shape[gd] != sizes.shape[-1] and group_offset is None:
      raise ValueError(
        f"{_OP}: group_sizes has {sizes.shape[-1]} groups, rhs's group dim {rhs.shape[gd]}"
      )
    offset = jnp.zeros((1,), jnp.int32)
    if group_offset is not None:
      offset = int_array("group_offset", group_offset, "[1]", 1, _OP)
    a = _rows(
      jnp.transpose(lhs, lb + outer + [r] + inner + lc),
      lead,
      [lhs.shape[d] for d in [r] + inner],
      [lhs.shape[d] for d in lc],
    )
    w = jnp.transpose(rhs, rb + [gd] + rc + rfree)
    w = w.reshape(*batch, rhs.shape[gd], math.prod(rhs.shape[d] for d in rc), -1)
    fn = lambda a, w, s: product(gmm_op, a, w, s, offset, precision, preferred_element_type, config)
    out = _vmapped(fn, lead, len(lb), lead)(a, w, sizes)
    free = [lhs.shape[d] for d in outer + [r] + inner] + [rhs.shape[d] for d in rfree]
    return out.reshape(*batch, *free)
  rr = [rc[lc.index(d)] for d in [r] + inner]
  r_outer = [rc[lc.index(d)] for d in outer]
  a = _rows(
    jnp.transpose(lhs, lb + outer + [r] + inner + lfree),
    lead,
    [lhs.shape[d] for d in [r] + inner],
    [lhs.shape[d] for d in lfree],
  )
  b = _rows(
    jnp.transpose(rhs, rb + r_outer + rr + rfree),
    lead,
    [rhs.shape[d] for d in rr],
    [rhs.shape[d] for d in rfree],
  )
  zero = jnp.zeros((1,), jnp.int32)
  # Products over outer contracting dims are summed: in float32 (at least) first.
  dtype = jnp.result_type(lhs, rhs) if preferred_element_type is None else preferred_element_type
  wide = jnp.promote_types(dtype, jnp.float32) if outer else dtype
  fn = lambda a, b, s: product(tgmm_op, a, b, s, zero, precision, wide, config, groups=s.shape[-1])
  out = _vmapped(fn, lead, lead, lead)(a, b, sizes)
  if outer:
    out = jnp.sum(out, axis=tuple(range(len(lb), lead))).astype(dtype)
  out = jnp.moveaxis(out, len(lb), 0)
  free = [lhs.shape[d] for d in lfree] + [rhs.shape[d] for d in rfree]
  return out.reshape(sizes.shape[-1], *batch, *free)
