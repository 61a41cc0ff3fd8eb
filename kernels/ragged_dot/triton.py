"""The grouped matmuls on Pallas-Triton.

* ``gmm``: grid ``(M / block_m, N / block_n)``: each program owns one output
  tile and loops over the groups meeting its rows (``common.tile_groups``,
  computed by XLA once a call), each a loop over K of tile products with the
  other groups' rows loaded as zeros. Every output row is written once, by
  one program: no zero-fill pass, no atomics, and rows of no held group
  (past ``sum(group_sizes)``, or another device's groups) come out 0. The
  extra work is one tile product per group boundary inside a tile.
* ``tgmm``: grid ``(G, K / block_k, N / block_n)``: each program owns one
  tile of one group's ``[K, N]`` and reduces over that group's rows only,
  ``block_m`` at a time (its first and last row blocks masked). Empty groups
  write zeros.

Blocks overhanging a dim are masked on load and store (Pallas-Triton does
not bounds-check them).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.activations import activate_in_kernel
from pallax.kernels.ragged_dot.common import (
  acc_dtype,
  epilogue,
  gemm_params,
  held_bounds,
  kernel_name,
  tile_dot,
  tile_groups,
)
from pallax.kernels.ragged_dot.config import RaggedDotConfig
from pallax.pallas_triton import tile_mask
from pallax.pallas_utils import in_bounds, load, store, triton_compiler_params


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
  """The whole of a small operand (group bounds), in every program."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def gmm(lhs, rhs, group_sizes, group_offset, *, config: RaggedDotConfig, interpret: Any, **params):
  """``[M, N]``: each row of ``lhs`` times its group's ``rhs[g - offset]``, then the epilogue.

  Gated (``rhs [G, K, 2N]``): the two halves' products accumulate side by
  side from one load of the rows, and ``act(a) * b`` is stored.
  """
  out_dtype, precision, activation, gated = gemm_params(params)
  (m, k), (local, _, width) = lhs.shape, rhs.shape
  n = width // 2 if gated else width
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  starts, ends = held_bounds(group_sizes, group_offset, m, local)
  lo, hi = tile_groups(ends, m, bm)
  acc = acc_dtype(lhs.dtype, rhs.dtype)
  steps = pl.cdiv(k, bk)
  if gated:  # the halves as [G, K, 2, N] (a free reshape), one block spec each
    weights = [rhs.reshape(local, k, 2, n)] * 2
    weight_specs = [
      pl.BlockSpec((local, k, None, bn), lambda t, j, h=h: (0, 0, h, j)) for h in (0, 1)
    ]
  else:
    weights, weight_specs = [rhs], [pl.BlockSpec((local, k, bn), lambda t, j: (0, 0, j))]

  def kernel(lhs_ref, *refs):
    *w_refs, lo_ref, hi_ref, starts_ref, ends_ref, out_ref = refs
    tile, col = pl.program_id(0), pl.program_id(1)
    rows = tile * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
    col_ok = in_bounds(col, bn, n, (bn,), 0)

    def step(j, outs):  # the K step ``j % steps`` of the tile's ``j // steps``-th group
      g, s = lo_ref[0] + lax.div(j, jnp.int32(steps)), lax.rem(j, jnp.int32(steps))
      mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
      k_ok = in_bounds(s, bk, k, (bk,), 0)
      a = load(lhs_ref.at[:, pl.ds(s * bk, bk)], tile_mask(mine, k_ok))
      return tuple(
        out
        + tile_dot(
          a, load(w.at[g, pl.ds(s * bk, bk), :], tile_mask(k_ok, col_ok)), (1, 0), precision, acc
        )
        for out, w in zip(outs, w_refs)
      )

    # One loop over (group, K step) pairs (Triton rejects the nested form's bounds).
    pairs = jnp.maximum(hi_ref[0] - lo_ref[0] + 1, 0) * steps
    zeros = tuple(jnp.zeros((bm, bn), acc) for _ in w_refs)
    out = epilogue(lax.fori_loop(0, pairs, step, zeros), activation, activate_in_kernel)
    store(out_ref, out.astype(out_ref.dtype), tile_mask(rows < m, col_ok))

  return pl.pallas_call(
    kernel,
    grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
    in_specs=[
      pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
      *weight_specs,
      pl.BlockSpec((1,), lambda t, j: (t,)),
      pl.BlockSpec((1,), lambda t, j: (t,)),
      _whole((local,)),
      _whole((local,)),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    compiler_params=triton_compiler_params(config),
    interpret=interpret,
    name=kernel_name(params),
  )(lhs, *weights, lo, hi, starts, ends)


def tgmm(lhs, rhs, group_sizes, group_offset, *, config: RaggedDotConfig, interpret: Any, **params):
  """``[groups, K, N]``: per held group ``lhs[rows of g]^T @ rhs[rows of g]``."""
  out_dtype, precision, _, _ = gemm_params(params)
  groups = params["groups"]
  (m, k), n = lhs.shape, rhs.shape[1]
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  starts, ends = held_bounds(group_sizes, group_offset, m, groups)
  acc = acc_dtype(lhs.dtype, rhs.dtype)

  def kernel(lhs_ref, rhs_ref, starts_ref, ends_ref, out_ref):
    g = pl.program_id(0)
    k_ok = in_bounds(pl.program_id(1), bk, k, (bk,), 0)
    col_ok = in_bounds(pl.program_id(2), bn, n, (bn,), 0)
    start, end = starts_ref[g], ends_ref[g]

    def step(r, out):
      rows = r * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
      mine = (rows >= start) & (rows < end)
      a = load(lhs_ref.at[pl.ds(r * bm, bm), :], tile_mask(mine, k_ok))
      b = load(rhs_ref.at[pl.ds(r * bm, bm), :], tile_mask(mine, col_ok))
      return out + tile_dot(a, b, (0, 0), precision, acc)

    first = lax.div(start, jnp.int32(bm))
    last = jnp.where(end > start, pl.cdiv(end, jnp.int32(bm)), first)
    out = lax.fori_loop(first, last, step, jnp.zeros((bk, bn), acc))
    store(out_ref, out.astype(out_ref.dtype), tile_mask(k_ok, col_ok))

  return pl.pallas_call(
    kernel,
    grid=(groups, pl.cdiv(k, bk), pl.cdiv(n, bn)),
    in_specs=[
      pl.BlockSpec((m, bk), lambda g, i, j: (0, i)),
      pl.BlockSpec((m, bn), lambda g, i, j: (0, j)),
      _whole((groups,)),
      _whole((groups,)),
    ],
    out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
    out_shape=jax.ShapeDtypeStruct((groups, k, n), out_dtype),
    compiler_params=triton_compiler_params(config),
    interpret=interpret,
    name="ragged_dot_tgmm",
  )(lhs, rhs, starts, ends)
