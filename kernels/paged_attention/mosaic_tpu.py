"""The paged-attention kernel on Pallas-Mosaic TPU.

Grid ``(B, K, steps)``, the last axis sequential ("arbitrary") with float32
accumulators in VMEM scratch; each step covers ``pages_per_block`` pages of
the sequence's page table. ``lengths`` and the (flattened) ``page_indices``
are scalar-prefetched into SMEM, and the pools are passed once per page slot
of a step, each with its own index map that picks the physical page: the
slot's logical page clamped to the sequence's last page, so steps past the
length ask for the block already there and fetch nothing new (a sequence of
length 0 fetches its first page once), and ``pl.when`` skips their compute.
Every block is a whole ``(page_size, H)`` page (full dims, as Mosaic wants);
a step's pages are stacked along sublanes (``config.supports`` asks for a
page size of whole sublane tiles when there are several).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.attention.common import ScratchSoftmax, block_dot, stack_pages
from pallax.kernels.paged_attention.common import Problem, logits
from pallax.kernels.paged_attention.config import PagedAttentionConfig


def paged_attention(
  q,
  k_pages,
  v_pages,
  lengths,
  page_indices,
  *,
  config: PagedAttentionConfig,
  interpret: Any,
  **params,
):
  """``[out]``."""
  p = Problem.of((q, k_pages, v_pages, lengths, page_indices), **params)
  per_step = min(config.pages_per_block, p.pages_per_sequence)
  steps = -(-p.pages_per_sequence // per_step)
  block = per_step * p.page_size

  def page_spec(width: int, slot: int) -> pl.BlockSpec:
    def index(b, k, i, len_ref, table_ref):
      last = jnp.maximum(lax.div(len_ref[b] + (p.page_size - 1), jnp.int32(p.page_size)) - 1, 0)
      logical = jnp.minimum(i * per_step + slot, last)
      return (k, table_ref[b * p.pages_per_sequence + logical], 0, 0)

    return pl.BlockSpec((None, None, p.page_size, width), index)

  def kernel(len_ref, table_ref, q_ref, *refs):
    k_refs, v_refs = refs[:per_step], refs[per_step : 2 * per_step]
    out_ref, *scratch = refs[2 * per_step :]
    softmax = ScratchSoftmax(scratch)
    b, i = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    pl.when(i == 0)(lambda: softmax.init(p, (p.groups,), p.value_dim))

    @pl.when(i * block < length)
    def _():
      k, v = stack_pages(k_refs), stack_pages(v_refs)
      keep = i * block + lax.broadcasted_iota(jnp.int32, (1, block), 1) < length
      v_keep = i * block + lax.broadcasted_iota(jnp.int32, (block, 1), 0) < length
      s = logits(p, block_dot, q_ref[...], k, keep)
      # Rows past the length hold whatever the pool has there: zeroed before the product.
      softmax.step(s, jnp.where(v_keep, v, 0).astype(v.dtype), block_dot)

    @pl.when(i == steps - 1)
    def _():
      out, _ = softmax.finish()
      out_ref[...] = out.astype(out_ref.dtype)

  in_specs = [pl.BlockSpec((None, None, p.groups, p.head_dim), lambda b, k, i, *_: (b, k, 0, 0))]
  in_specs += [page_spec(p.head_dim, j) for j in range(per_step)]
  in_specs += [page_spec(p.value_dim, j) for j in range(per_step)]
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(p.batch, p.kv_heads, steps),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, p.groups, p.value_dim), lambda b, k, i, *_: (b, k, 0, 0)),
      scratch_shapes=[
        pltpu.VMEM((p.groups, 1), p.stat),
        pltpu.VMEM((p.groups, 1), p.stat),
        pltpu.VMEM((p.groups, p.value_dim), p.stat),
      ],
    ),
    out_shape=jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.value_dim), p.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=interpret,
    name="paged_attention",
  )(lengths, page_indices.reshape(-1), q, *[k_pages] * per_step, *[v_pages] * per_step)
  return [out]
