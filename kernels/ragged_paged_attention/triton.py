"""The ragged-paged-attention kernel on Pallas-Triton.

One program per (item of the work list, kv head, split): the item's
``block_q`` queries times the kv head's ``G`` query heads are one block of
rows (padded to a power of two >= 16: up to 16, a decode item's, read
straight from q's tokens, more from a gathered copy), which walks its split's share of the
keys the item sees (``common.key_range``) in blocks of ``block_k`` tokens with
the online softmax, gathering each block token by token through the
sequence's page table (``paged_attention``'s ``gather_tokens``): a prefill
chunk reads its keys once per item, a decode token once. The causal
(bottom-right) and window masks come from the rows' positions
(``common.visible``). With ``num_splits > 1`` (few items, long caches: the
flash-decoding split that fills the GPU) the splits' partial softmaxes are
combined by XLA (``paged_attention``'s ``combine_splits``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallax.kernels.attention.common import block_dot, online_init, online_step
from pallax.kernels.paged_attention.common import combine_splits, logits
from pallax.kernels.paged_attention.triton import gather_tokens
from pallax.kernels.ragged_paged_attention import common
from pallax.pallas_triton import padded_ok, tile_mask
from pallax.pallas_utils import load, next_pow2, store, triton_compiler_params

# The most rows (after padding) an item reads straight from q's tokens.
_DIRECT_ROWS = 16


def ragged_paged_attention(*operands, config, interpret: Any, **params):
  """``[out, lse]``."""
  p = common.Problem.of(operands, **params)
  block_q, bk = config.block_q, config.block_k
  rows = block_q * p.groups
  rp = next_pow2(max(rows, 16))
  hp, hvp = (next_pow2(max(x, 16)) for x in (p.head_dim, p.value_dim))

  splits = config.num_splits
  # Decode-sized items read their rows straight from q's tokens (on an H200
  # the XLA gather of a copy took 4.3 us of a 32-sequence decode step's 89);
  # larger ones read that copy: the direct read's pointers spilled at 64 rows
  # on A100, and 32 are not measured (verify --exhaustive is clean with 16).
  direct = rp <= _DIRECT_ROWS

  def queries(q_ref, start, live, r_ok, h_ok):
    """The item's query rows ``(rp, hp)``; rows not ``live`` are the mask's to drop.

    ``start``: the token of the item's first query (read by the direct form only).
    """
    if not direct:
      return load(q_ref, tile_mask(r_ok, h_ok))
    # Row j G + g is query head g of token start + j.
    row = lax.broadcasted_iota(jnp.int32, (rp, 1), 0)
    token = start + lax.div(row, jnp.int32(p.groups))
    head = lax.rem(row, jnp.int32(p.groups))
    cols = lax.broadcasted_iota(jnp.int32, (1, hp), 1)
    at = q_ref.at[token, head, cols]
    return pltriton.load(at, mask=tile_mask(live[:, 0], h_ok), other=0)

  def kernel(
    q_ref, k_ref, v_ref, start_ref, q0_ref, qlen_ref, kvlen_ref, table_ref, m_ref, l_ref, acc_ref
  ):
    r_ok, h_ok, hv_ok = padded_ok(rp, rows), padded_ok(hp, p.head_dim), padded_ok(hvp, p.value_dim)
    q0, q_len, kv_len = q0_ref[0], qlen_ref[0], kvlen_ref[0]
    positions, live = common.row_positions(q0, q_len, kv_len, rp, p.groups)
    if r_ok is not None:
      live &= r_ok[:, None]
    q_blk = queries(q_ref, start_ref[0], live, r_ok, h_ok)
    lo, hi = common.key_range(p, q0, q_len, kv_len, block_q)
    # This split's share: whole blocks of the item's keys.
    share = lax.div(lax.div(hi - lo + (bk - 1), jnp.int32(bk)) + (splits - 1), jnp.int32(splits))
    lo = jnp.minimum(lo + pl.program_id(2) * share * bk, hi)
    hi = jnp.minimum(lo + share * bk, hi)

    def body(j, carry):
      keys = lo + j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
      ok = keys < hi
      k, v = gather_tokens(k_ref, v_ref, table_ref, keys, ok, p.page_size, (h_ok, hv_ok))
      keep = common.visible(p, positions, live, keys[None, :], kv_len) & ok[None, :]
      return online_step(carry, logits(p, block_dot, q_blk, k, keep), v, block_dot)

    steps = lax.div(hi - lo + (bk - 1), jnp.int32(bk))
    m, denom, acc = lax.fori_loop(0, steps, body, online_init(p, (rp,), hvp))
    store(m_ref, m[:, 0], r_ok)
    store(l_ref, denom[:, 0], r_ok)
    store(acc_ref, acc, tile_mask(r_ok, hv_ok))

  if direct:  # the tokens' q (T, K, G, H)
    q_spec = pl.BlockSpec((p.tokens, None, p.groups, hp), lambda i, k, s: (0, k, 0, 0))
  else:  # the items' rows (I, K, rows, H)
    q_spec = pl.BlockSpec((None, None, rp, hp), lambda i, k, s: (i, k, 0, 0))

  def items_kernel(q, k_pages, v_pages, items, table):
    n = items.q0.shape[0]
    pool = lambda width: pl.BlockSpec(
      (None, p.total_pages, p.page_size, width), lambda i, k, s: (k, 0, 0, 0)
    )
    scalar = pl.BlockSpec((1,), lambda i, k, s: (i,))
    stat = pl.BlockSpec((None, None, None, rp), lambda i, k, s: (i, k, s, 0))
    stats = jax.ShapeDtypeStruct((n, p.kv_heads, splits, rows), p.stat)
    m, denom, acc = pl.pallas_call(
      kernel,
      grid=(n, p.kv_heads, splits),
      in_specs=[
        q_spec,
        pool(hp),
        pool(hvp),
        scalar,
        scalar,
        scalar,
        scalar,
        pl.BlockSpec((None, p.pages_per_sequence), lambda i, k, s: (i, 0)),
      ],
      out_specs=[
        stat,
        stat,
        pl.BlockSpec((None, None, None, rp, hvp), lambda i, k, s: (i, k, s, 0, 0)),
      ],
      out_shape=[
        stats,
        stats,
        jax.ShapeDtypeStruct((n, p.kv_heads, splits, rows, p.value_dim), p.stat),
      ],
      compiler_params=triton_compiler_params(config),
      interpret=interpret,
      name="ragged_paged_attention",
    )(q, k_pages, v_pages, items.start, items.q0, items.q_len, items.kv_len, table)
    return combine_splits(m, denom, acc, p.dtype)

  return common.run_items(p, block_q, operands, items_kernel, gather_queries=not direct)
