"""The matmul kernel on Pallas-Mosaic TPU.

Grid ``(*batch, M/bm, N/bn, K/bk)``, K "arbitrary" with a VMEM accumulator.
Each block is a whole dim or a multiple of 128 (TPU tiling); the K tail of the
last step is zeroed in both operands, edge blocks of the output are clipped
when written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.matmul import common
from pallax.kernels.matmul.config import MatmulConfig, mosaic_blocks
from pallax.kernels.matmul.layout import Problem


def _zero_k_tail(x: jax.Array, left, axis: int) -> jax.Array:
  """``x`` with entries at K offsets >= ``left`` (past the end of K) set to zero."""
  return jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, axis) < left, x, 0)


def _put(ref, value) -> None:
  ref[...] = value


def _kernel(*refs, args: common.KernelArgs, block_k: int):
  prob = args.prob
  *refs, acc_ref = refs  # the accumulator: the kernel's VMEM scratch
  r = args.refs(refs)
  a_ref, b_ref = r.a, r.b
  k_axis = len(prob.grid_batch) + 2
  s = pl.program_id(k_axis)

  @pl.when(s == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  compute = jnp.promote_types(a_ref.dtype, b_ref.dtype)
  a, b = a_ref[...].astype(compute), b_ref[...].astype(compute)
  if prob.k % block_k:  # the last step's block overhangs K: zero it in both operands
    left = prob.k - s * block_k
    a = _zero_k_tail(a, left, 0 if args.transpose_a else 1)
    b = _zero_k_tail(b, left, 1 if args.transpose_b else 0)
  acc_ref[...] += args.product(a, b, acc_ref.dtype)

  @pl.when(s == pl.num_programs(k_axis) - 1)
  def _finish():
    bias = [] if r.bias is None else [r.bias[...]]
    args.store(r, args.finish(acc_ref[...], bias, r.out.dtype), _put)


def _plan(prob: Problem, config: MatmulConfig, args: common.KernelArgs, acc) -> common.Plan:
  """K as the last, sequential grid axis; the accumulator in VMEM scratch."""
  blocks = mosaic_blocks(prob, config)
  semantics = ("parallel",) * (len(prob.grid_batch) + 2) + ("arbitrary",)
  return common.Plan(
    blocks=blocks,
    grid=tuple(pl.cdiv(d, x) for d, x in zip((prob.m, prob.n, prob.k), blocks)),
    kernel=functools.partial(_kernel, args=args, block_k=blocks[2]),
    call_args=dict(
      scratch_shapes=[pltpu.VMEM(blocks[:2], acc)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
    ),
    k_steps=True,
  )


matmul = functools.partial(common.matmul, plan=_plan)
