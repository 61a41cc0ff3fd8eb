"""The matmul kernel on Pallas-Triton.

Grid ``(*batch, M/bm, N/bn)``, a loop over K in the kernel. Blocks are powers
of two >= 16 (``tl.dot``'s minimum) and overhang odd dims; Pallas-Triton does
not mask block edges, so loads and stores along a dim that is not a multiple
of its block are masked (out-of-range K is loaded as zero in both operands).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.kernels.matmul import common
from pallax.kernels.matmul.config import MatmulConfig
from pallax.kernels.matmul.layout import Problem, acc_dtype
from pallax.pallas_utils import in_bounds, load, store, triton_compiler_params


def _kernel(*refs, args: common.KernelArgs, block_k: int):
  prob, transpose_a, transpose_b = args.prob, args.transpose_a, args.transpose_b
  r = args.refs(refs)
  a_ref, b_ref = r.a, r.b
  bm, bn = r.out.shape
  rank = len(prob.grid_batch) + 2
  row_ok = in_bounds(pl.program_id(rank - 2), bm, prob.m, (bm,), 0)
  col_ok = in_bounds(pl.program_id(rank - 1), bn, prob.n, (bn,), 0)
  compute = jnp.promote_types(a_ref.dtype, b_ref.dtype)

  def load_tile(ref, start, k_ok, other_ok, k_first: bool):
    """A ``block_k``-deep slice of a row/column panel; out-of-range entries load as 0."""
    if k_first:
      view = ref.at[pl.ds(start, block_k), :]
      mask = common.tile_mask(k_ok, other_ok, view.shape)
    else:
      view = ref.at[:, pl.ds(start, block_k)]
      mask = common.tile_mask(other_ok, k_ok, view.shape)
    return load(view, mask).astype(compute)

  def step(s, acc):
    k_ok = in_bounds(s, block_k, prob.k, (block_k,), 0)
    a = load_tile(a_ref, s * block_k, k_ok, row_ok, k_first=transpose_a)
    b = load_tile(b_ref, s * block_k, k_ok, col_ok, k_first=not transpose_b)
    return acc + args.product(a, b, acc.dtype)

  acc = lax.fori_loop(
    0, pl.cdiv(prob.k, block_k), step, jnp.zeros((bm, bn), acc_dtype(a_ref.dtype, b_ref.dtype))
  )
  bias = [] if r.bias is None else [load(r.bias, common.tile_mask(None, col_ok, (1, bn)))]
  mask = common.tile_mask(row_ok, col_ok, (bm, bn))
  args.store(r, args.finish(acc, bias, r.out.dtype), lambda ref, value: store(ref, value, mask))


def _plan(prob: Problem, config: MatmulConfig, args: common.KernelArgs, acc) -> common.Plan:
  """Whole-K panels; the kernel loops over K in ``block_k`` steps."""
  return common.Plan(
    blocks=(config.block_m, config.block_n, prob.k),
    grid=(pl.cdiv(prob.m, config.block_m), pl.cdiv(prob.n, config.block_n)),
    kernel=functools.partial(_kernel, args=args, block_k=config.block_k),
    call_args=dict(compiler_params=triton_compiler_params(config)),
    k_steps=False,
  )


matmul = functools.partial(common.matmul, plan=_plan)
