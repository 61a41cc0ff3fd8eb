"""The grouped matmuls as XLA programs: a sorted-tile work list, no G-fold work.

``lax.ragged_dot`` on CPU and GPU expands to a masked dense product over
every group, G times the FLOPs. Here the rows, sorted by group, are cut into
tiles of ``tile`` rows; the work list holds one item per (tile, group) pair
that meet, at most ``tiles + groups - 1`` of them (neighbouring groups share
at most one tile). One ``fori_loop`` walks it: each item multiplies its
tile's rows of its group (the others masked to zero) by the group's weight
and adds the product into its tile of a float32 accumulator. A tile's row
belongs to one group, so each output row gets one product and zeros: exact.

Two programs, the forward and the weight gradient:

* ``gmm(lhs [M, K], rhs [G, K, N])``: ``out[rows of g] = lhs[rows of g] @ rhs[g]``;
* ``tgmm(lhs [M, K], rhs [M, N])``: ``out[g] = lhs[rows of g]^T @ rhs[rows of g]``
  (the ragged-contracting product, ``[G, K, N]``).

``group_sizes [Gt]`` may list more groups than ``rhs`` (``gmm``) or the
result (``tgmm``) holds: ``group_offset [1]`` is the first group of those
(expert parallelism: a device holds groups ``[offset, offset + G)``). Rows of
other groups, and rows past ``sum(group_sizes)``, give zeros.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pallax.activations import activate
from pallax.kernels.ragged_dot.common import WorkList, acc_dtype, epilogue, tile_dot, zero_like


def row_tile(m: int, groups: int) -> int:
  """Rows a tile: the power of two at most a quarter of a group's mean rows, in [32, 512].

  Each group boundary inside a tile computes that tile twice, so the extra
  work is at most ``(groups - 1) * tile`` rows, a quarter of ``m`` (unless
  the 32-row floor applies: fewer than 128 rows a group);
  smaller tiles cost more per row. Measured on a CPU, time over a dense
  GEMM's, float32 (even / halving / random group sizes; random ones are
  what routing gives, a boundary in nearly every group's last tile):
  M=8192, K=1024, N=2048, G=8: 512-row tiles 1.01 / 1.09 / 1.33, 256-row
  (this rule) 1.06 / 1.07 / 1.26, 64-row 1.46 / 2.01 / 1.54; M=4096, K=512,
  N=2048, G=8: 512-row 0.69 / 0.96 / 1.12, 128-row (this rule) 0.70 / 0.83
  / 0.79.
  """
  quarter = max(m // (4 * max(groups, 1)), 1)
  return min(512, max(32, 1 << (quarter.bit_length() - 1)))


def _padded_rows(x: jax.Array, tile: int) -> jax.Array:
  pad = -x.shape[0] % tile
  return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def gmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  out_dtype: Any,
  precision: Any = None,
) -> jax.Array:
  """``[M, N]``: each row of ``lhs`` times its group's ``rhs[g - offset]`` (``[G, K, N]``)."""
  m, k = lhs.shape
  local, _, n = rhs.shape
  if m == 0 or local == 0:  # no row, or no group: no work list to walk
    return jnp.zeros((m, n), out_dtype)
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  work = WorkList.by_group(group_sizes, group_offset, m, local, row_tile(m, local))
  x = _padded_rows(lhs, work.tile)

  def item(i, out):
    start, rows = work.rows(x, i)
    w = lax.dynamic_index_in_dim(rhs, work.slots[i], 0, keepdims=False)
    product = tile_dot(rows, w, (1, 0), precision, acc)
    return lax.dynamic_update_slice(
      out, work.tile_of(out, start) + product, (start, zero_like(start))
    )

  out = lax.fori_loop(0, work.count, item, jnp.zeros((x.shape[0], n), acc))
  return out[:m].astype(out_dtype)


def tgmm(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  groups: int,
  out_dtype: Any,
  precision: Any = None,
) -> jax.Array:
  """``[groups, K, N]``: per group ``g - offset``, ``lhs[rows of g]^T @ rhs[rows of g]``."""
  m, k = lhs.shape
  n = rhs.shape[1]
  if m == 0 or groups == 0:
    return jnp.zeros((groups, k, n), out_dtype)
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  work = WorkList.by_group(group_sizes, group_offset, m, groups, row_tile(m, groups))
  x, y = _padded_rows(lhs, work.tile), _padded_rows(rhs, work.tile)

  def item(i, out):
    start, rows = work.rows(x, i)
    product = tile_dot(rows, work.tile_of(y, start), (0, 0), precision, acc)
    return out.at[work.slots[i]].add(product)

  out = lax.fori_loop(0, work.count, item, jnp.zeros((groups, k, n), acc))
  return out.astype(out_dtype)


def gmm_epilogue(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  group_offset: jax.Array,
  *,
  activation: Any,
  gated: bool,
  out_dtype: Any,
  precision: Any = None,
) -> jax.Array:
  """``gmm`` with its epilogue: ``act(h)``, or ``act(a) * b`` for a gated ``[G, K, 2N]`` weight."""
  h = gmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_dtype=acc_dtype(lhs.dtype, rhs.dtype),
    precision=precision,
  )
  products = jnp.split(h, 2, axis=-1) if gated else [h]
  return epilogue(products, activation, activate).astype(out_dtype)
