"""The ragged-paged-attention XLA program: the work list's items in a loop, the CPU path.

A ``fori_loop`` over the used items (``common.work_list``); each item's
``block_q * G`` query rows walk the keys they see between them
(``common.key_range``) in blocks of ``BLOCK_TOKENS``, gathered token by token
through the sequence's page table (16-bit pools through an integer view, as
``paged_attention``'s program), one step of the online softmax a block. A
prefill chunk's keys are read once per item, not once per token; memory is
``O(K block H)`` beyond the pools and the items' results.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallax import pallas_utils as pu
from pallax.kernels.attention.common import online_finish, online_init, online_step
from pallax.kernels.paged_attention.common import logits
from pallax.kernels.paged_attention.xla import einsum_dot, gatherable, restore
from pallax.kernels.ragged_paged_attention import common
from pallax.kernels.ragged_paged_attention.config import block_q_for

BLOCK_TOKENS = 512

# An item's rows (K, rows, H) against a block of keys (K, block, H).
_dot = einsum_dot({"qk": "krh,kbh->krb", "pv": "krb,kbh->krh"})


def ragged_paged_attention(*operands, config=None, **params):
  """``[out, lse]``; ``config``'s ``block_q`` if given, else ``config.block_q_for``."""
  p = common.Problem.of(operands, **params)
  block_q = config.block_q if config is not None else block_q_for(p)
  block = min(BLOCK_TOKENS, pu.next_pow2(max(p.max_len, 1)))
  rows = block_q * p.groups

  def items_kernel(q_items, k_pages, v_pages, items, table):
    pools = [gatherable(x) for x in (k_pages, v_pages)]

    def item(i, results):
      q0, q_len, kv_len = items.q0[i], items.q_len[i], items.kv_len[i]
      positions, live = common.row_positions(q0, q_len, kv_len, rows, p.groups)
      lo, hi = common.key_range(p, q0, q_len, kv_len, block_q)

      def step(j, carry):
        keys = lo + j * block + jnp.arange(block, dtype=jnp.int32)
        ok = keys < hi
        page = table[i, jnp.clip(keys // p.page_size, 0, p.pages_per_sequence - 1)]
        row = keys % p.page_size
        k = restore(pools[0][:, page, row], p.dtype)
        v = jnp.where(ok[None, :, None], restore(pools[1][:, page, row], p.dtype), 0)
        keep = common.visible(p, positions, live, keys[None, :], kv_len) & ok[None, :]
        return online_step(carry, logits(p, _dot, q_items[i], k, keep[None]), v, _dot)

      init = online_init(p, (p.kv_heads, rows), p.value_dim)
      steps = (hi - lo + block - 1) // block
      out, lse = online_finish(lax.fori_loop(0, steps, step, init))
      return (results[0].at[i].set(out.astype(p.dtype)), results[1].at[i].set(lse[..., 0]))

    n = q_items.shape[0]
    init = (
      jnp.zeros((n, p.kv_heads, rows, p.value_dim), p.dtype),
      jnp.full((n, p.kv_heads, rows), -jnp.inf, p.stat),
    )
    return lax.fori_loop(0, jnp.sum(items.q_len > 0), item, init)

  return common.run_items(p, block_q, operands, items_kernel)
