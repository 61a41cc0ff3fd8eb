"""The ragged-paged-attention kernel on Pallas-Mosaic TPU.

Grid ``(I, K, steps)`` over the work list's items (``common.work_list``), the
last axis sequential with float32 accumulators in VMEM scratch; each step
covers ``pages_per_block`` pages of the item's sequence. The items' query
offsets and lengths and their page-table rows are scalar-prefetched into
SMEM, and the pools are passed once per page slot of a step, each with an
index map that picks the physical page: the slot's logical page clamped to
the pages the item's keys span (``common.key_range``), so steps outside them
ask for a block already there and fetch nothing, and ``pl.when`` skips their
compute (as ``paged_attention``'s TPU kernel).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.attention.common import ScratchSoftmax, block_dot, stack_pages
from pallax.kernels.paged_attention.common import logits
from pallax.kernels.ragged_paged_attention import common


def ragged_paged_attention(*operands, config, interpret: Any, **params):
  """``[out, lse]``."""
  p = common.Problem.of(operands, **params)
  block_q = config.block_q
  rows = block_q * p.groups
  per_step = min(config.pages_per_block, p.pages_per_sequence)
  steps = -(-p.pages_per_sequence // per_step)
  block = per_step * p.page_size

  def item_range(i, q0_ref, qlen_ref, kvlen_ref):
    return common.key_range(p, q0_ref[i], qlen_ref[i], kvlen_ref[i], block_q)

  def page_spec(width: int, slot: int) -> pl.BlockSpec:
    def index(i, k, j, q0_ref, qlen_ref, kvlen_ref, table_ref):
      lo, hi = item_range(i, q0_ref, qlen_ref, kvlen_ref)
      first = lax.div(lo, jnp.int32(p.page_size))
      last = jnp.maximum(lax.div(hi + (p.page_size - 1), jnp.int32(p.page_size)) - 1, first)
      logical = jnp.clip(j * per_step + slot, first, last)
      return (k, table_ref[i * p.pages_per_sequence + logical], 0, 0)

    return pl.BlockSpec((None, None, p.page_size, width), index)

  def kernel(q0_ref, qlen_ref, kvlen_ref, table_ref, q_ref, *refs):
    k_refs, v_refs = refs[:per_step], refs[per_step : 2 * per_step]
    out_ref, lse_ref, *scratch = refs[2 * per_step :]
    softmax = ScratchSoftmax(scratch)
    i, j = pl.program_id(0), pl.program_id(2)
    lo, hi = item_range(i, q0_ref, qlen_ref, kvlen_ref)

    pl.when(j == 0)(lambda: softmax.init(p, (rows,), p.value_dim))

    @pl.when((j * block < hi) & ((j + 1) * block > lo))
    def _():
      k, v = stack_pages(k_refs), stack_pages(v_refs)
      keys = j * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)
      positions, live = common.row_positions(q0_ref[i], qlen_ref[i], kvlen_ref[i], rows, p.groups)
      keep = common.visible(p, positions, live, keys, kvlen_ref[i])
      s = logits(p, block_dot, q_ref[...], k, keep)
      # Rows outside the item's keys hold other pages or whatever the pool has: zeroed.
      column = j * block + lax.broadcasted_iota(jnp.int32, (block, 1), 0)
      v = jnp.where((column >= lo) & (column < hi), v, 0).astype(v.dtype)
      softmax.step(s, v, block_dot)

    @pl.when(j == steps - 1)
    def _():
      out, lse = softmax.finish()
      out_ref[...] = out.astype(out_ref.dtype)
      lse_ref[...] = lse

  def items_kernel(q_items, k_pages, v_pages, items, table):
    n = q_items.shape[0]
    row_block = lambda width: pl.BlockSpec(
      (None, None, rows, width), lambda i, k, j, *_: (i, k, 0, 0)
    )
    out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(n, p.kv_heads, steps),
        in_specs=[
          row_block(p.head_dim),
          *[page_spec(p.head_dim, s) for s in range(per_step)],
          *[page_spec(p.value_dim, s) for s in range(per_step)],
        ],
        out_specs=[row_block(p.value_dim), row_block(1)],
        scratch_shapes=[
          pltpu.VMEM((rows, 1), p.stat),
          pltpu.VMEM((rows, 1), p.stat),
          pltpu.VMEM((rows, p.value_dim), p.stat),
        ],
      ),
      out_shape=[
        jax.ShapeDtypeStruct((n, p.kv_heads, rows, p.value_dim), p.dtype),
        jax.ShapeDtypeStruct((n, p.kv_heads, rows, 1), p.stat),
      ],
      compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary")
      ),
      interpret=interpret,
      name="ragged_paged_attention",
    )(
      items.q0,
      items.q_len,
      items.kv_len,
      table.reshape(-1),
      q_items,
      *[k_pages] * per_step,
      *[v_pages] * per_step,
    )
    return out, lse[..., 0]

  return common.run_items(p, block_q, operands, items_kernel)
