"""The paged-attention kernel on Pallas-Triton: flash-decoding.

One program per (sequence, kv head, split): the key axis is cut into
``num_splits`` contiguous shares of the page table, and each program walks
its share in blocks of ``block_k`` tokens with the online softmax, for the
kv head's ``G`` query heads at once (one block of rows, padded to 16: Triton's
dots need 16). It writes a partial ``(max, sum, output)``; an XLA reduction
combines the splits (``common.combine_splits``).

Page indices and lengths are read inside the kernel. Each block's keys are
gathered token by token (row ``s % page_size`` of page ``table[s //
page_size]``) with loads masked to the tokens below the sequence's length,
so pages past it are never read and a block may span pages of any size.
Head dims are padded to a power of two and masked.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallax.kernels.attention.common import block_dot, online_init, online_step
from pallax.kernels.paged_attention.common import Problem, combine_splits, logits
from pallax.kernels.paged_attention.config import PagedAttentionConfig, rows
from pallax.pallas_triton import padded_ok, tile_mask
from pallax.pallas_utils import load, next_pow2, store, triton_compiler_params


def split_tokens(p: Problem, config: PagedAttentionConfig) -> tuple[int, int, int]:
  """``(block_k, tokens per split, splits)``: each split a whole number of blocks, none empty."""
  bk = min(config.block_k, max(16, next_pow2(p.max_len)))
  per_split = -(-p.max_len // config.num_splits)
  per_split = -(-per_split // bk) * bk
  return bk, per_split, -(-p.max_len // per_split)


def gather_tokens(k_ref, v_ref, table_ref, pos, ok, page_size: int, cols_ok):
  """The keys and values at positions ``pos`` (a vector) through a page-table row's ref.

  Token ``s`` is row ``s % page_size`` of page ``table_ref[s // page_size]``;
  where ``ok`` is False nothing is read and the rows are 0. ``cols_ok``: the
  key and value blocks' column masks (None: unpadded). The pool refs are a kv
  head's ``(P, page_size, width)`` with the widths padded to the blocks.
  """
  page = pltriton.load(table_ref.at[lax.div(pos, page_size)], mask=ok, other=0)
  row = lax.rem(pos, page_size)

  def gather(ref, cols_ok):
    cols = lax.broadcasted_iota(jnp.int32, (1, ref.shape[-1]), 1)
    mask = tile_mask(ok, cols_ok)
    return pltriton.load(ref.at[page[:, None], row[:, None], cols], mask=mask, other=0)

  return gather(k_ref, cols_ok[0]), gather(v_ref, cols_ok[1])


def paged_attention(
  q, k_pages, v_pages, lengths, page_indices, *, config, interpret: Any, **params
):
  """``[out]``: the split kernel, then the XLA reduction over splits."""
  p = Problem.of((q, k_pages, v_pages, lengths, page_indices), **params)
  gp = rows(p)
  hp, hvp = (next_pow2(max(x, 16)) for x in (p.head_dim, p.value_dim))
  bk, per_split, splits = split_tokens(p, config)

  def kernel(q_ref, k_ref, v_ref, len_ref, table_ref, m_ref, l_ref, acc_ref):
    g_ok, h_ok = padded_ok(gp, p.groups), padded_ok(hp, p.head_dim)
    hv_ok = padded_ok(hvp, p.value_dim)
    start = pl.program_id(2) * per_split
    end = jnp.minimum(len_ref[0], start + per_split)
    q_blk = load(q_ref, tile_mask(g_ok, h_ok))

    def body(j, carry):
      pos = start + j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
      ok = pos < end
      k, v = gather_tokens(k_ref, v_ref, table_ref, pos, ok, p.page_size, (h_ok, hv_ok))
      s = logits(p, block_dot, q_blk, k, ok[None, :])
      return online_step(carry, s, v, block_dot)

    blocks = lax.div(jnp.maximum(end - start, 0) + (bk - 1), jnp.int32(bk))
    m, denom, acc = lax.fori_loop(0, blocks, body, online_init(p, (gp,), hvp))
    store(m_ref, m[:, 0], g_ok)
    store(l_ref, denom[:, 0], g_ok)
    store(acc_ref, acc, tile_mask(g_ok, hv_ok))

  pool = lambda width: pl.BlockSpec(
    (None, p.total_pages, p.page_size, width), lambda b, k, s: (k, 0, 0, 0)
  )
  stats = jax.ShapeDtypeStruct((p.batch, p.kv_heads, splits, p.groups), p.stat)
  m, denom, acc = pl.pallas_call(
    kernel,
    grid=(p.batch, p.kv_heads, splits),
    in_specs=[
      pl.BlockSpec((None, None, gp, hp), lambda b, k, s: (b, k, 0, 0)),
      pool(hp),
      pool(hvp),
      pl.BlockSpec((1,), lambda b, k, s: (b,)),
      pl.BlockSpec((None, p.pages_per_sequence), lambda b, k, s: (b, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, gp), lambda b, k, s: (b, k, s, 0)),
      pl.BlockSpec((None, None, None, gp), lambda b, k, s: (b, k, s, 0)),
      pl.BlockSpec((None, None, None, gp, hvp), lambda b, k, s: (b, k, s, 0, 0)),
    ],
    out_shape=[
      stats,
      stats,
      jax.ShapeDtypeStruct((p.batch, p.kv_heads, splits, p.groups, p.value_dim), p.stat),
    ],
    compiler_params=triton_compiler_params(config),
    interpret=interpret,
    name="paged_attention",
  )(q, k_pages, v_pages, lengths, page_indices)
  return [combine_splits(m, denom, acc, p.dtype)[0]]
