"""The paged-attention XLA program: blockwise over the page table, the CPU path.

A ``fori_loop`` walks the page table in blocks of about ``BLOCK_TOKENS``
tokens, up to the batch's longest sequence (blocks past it are never
gathered); each step gathers only that block's pages of every sequence (one
XLA gather per pool, ``(K, B, block)`` rows) and runs one step of the online
softmax. The whole table is never gathered: memory is ``O(B K block H)``
beyond the pool (and, for 16-bit pools, one same-width integer view of each:
``gatherable``). Tokens past a sequence's length are hidden; in a block that
straddles it, the shorter sequences' trailing pages are read (clamped to the
pool) and masked.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallax.kernels.attention.common import online_finish, online_init, online_step
from pallax.kernels.paged_attention.common import Problem, logits

# Tokens per step: a (B, K, G, 512) block of logits stays in cache, and the
# gathered (K, B, 512, H) keys amortise the loop's overhead.
BLOCK_TOKENS = 512


def einsum_dot(specs: dict[str, str]):
  """The online softmax's ``dot(a, b, kind)``: ``specs[kind]`` as an einsum, in the stats dtype.

  float32 operands multiply at ``HIGHEST`` precision (XLA:CPU's default
  would too; a GPU's would use TF32).
  """

  def dot(a, b, kind):
    st = jnp.promote_types(a.dtype, jnp.float32)
    precision = lax.Precision.HIGHEST if a.dtype == b.dtype == st else None
    return jnp.einsum(specs[kind], a, b, preferred_element_type=st, precision=precision)

  return dot


# Gathered pages come out as (K, B, tokens, H): the products read that layout.
_dot = einsum_dot({"qk": "bkgd,kbnd->bkgn", "pv": "bkgn,kbnd->bkgd"})


def gatherable(pages):
  """The pool as XLA:CPU gathers it without upcasting it whole.

  XLA:CPU has no 16-bit float gather: its float normalisation computes the
  gather in float32, converting the *whole* pool first (a float32 copy of
  both pools, 4x their size in temporaries). A gather of an unsigned view
  of the same width needs no conversion; the view itself costs one 16-bit
  copy of each pool per call, the CPU path's memory floor for 16-bit pools.
  """
  if jnp.dtype(pages.dtype).itemsize != 2:
    return pages
  return lax.bitcast_convert_type(pages, jnp.uint16)


def restore(block, dtype):
  return block if block.dtype == dtype else lax.bitcast_convert_type(block, dtype)


def pages_per_step(p: Problem) -> int:
  """Pages gathered per loop step."""
  return max(1, min(p.pages_per_sequence, BLOCK_TOKENS // p.page_size))


def paged_attention(q, k_pages, v_pages, lengths, page_indices, **params):
  """``[out]``: ``softmax(soft_cap(scale q k^T)) v`` over each sequence's pages."""
  p = Problem.of((q, k_pages, v_pages, lengths, page_indices), **params)
  per_step = pages_per_step(p)
  block = per_step * p.page_size
  steps = -(-p.pages_per_sequence // per_step)
  table = page_indices
  if steps * per_step != p.pages_per_sequence:
    table = jnp.pad(table, ((0, 0), (0, steps * per_step - p.pages_per_sequence)))
  needed = (jnp.max(lengths, initial=0) + block - 1) // block  # the longest sequence's steps
  lens = lengths[:, None, None, None]
  pools = [gatherable(x) for x in (k_pages, v_pages)]

  def gather(pages, idx):
    """``(K, B, block, width)``: the block's tokens of every sequence."""
    return pages[:, idx].reshape(p.kv_heads, p.batch, block, pages.shape[3])

  def step(j, carry):
    idx = lax.dynamic_slice_in_dim(table, j * per_step, per_step, 1)
    pos = j * block + lax.broadcasted_iota(jnp.int32, (1, 1, 1, block), 3)
    s = logits(p, _dot, q, restore(gather(pools[0], idx), p.dtype), pos < lens)
    # Rows past a length hold whatever the pool has there: zeroed before the product.
    v = jnp.where(
      (pos[0, 0] < lengths[:, None])[None, :, :, None], restore(gather(pools[1], idx), p.dtype), 0
    )
    return online_step(carry, s, v, _dot)

  init = online_init(p, (p.batch, p.kv_heads, p.groups), p.value_dim)
  out, _ = online_finish(lax.fori_loop(0, needed, step, init))
  return [out.astype(p.dtype)]
