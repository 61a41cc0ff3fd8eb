"""The ragged-paged-attention kernel on Pallas Mosaic GPU (Hopper): TMA page gathers, ``wgmma``.

One block of threads per (item of the work list, kv head, split), two
warpgroups:

* a producer warpgroup streams the item's key blocks of ``block_k`` tokens
  into a ``num_stages``-deep SMEM ring (``pallax.pallas_mosaic_gpu.Ring``),
  each block gathered through the sequence's page table as one TMA copy per
  page it spans (or one slice of a page larger than the block);
* a consumer warpgroup holds the item's rows (``block_q`` tokens times the kv
  head's ``G`` query heads, padded to ``wgmma``'s 64: one TMA copy of 64
  consecutive rows of the kv head's query rows, which XLA lays out
  token-major once a call) and issues ``S = Q K^T`` and ``O += P V`` on the
  tensor cores with asynchronous ``wgmma``, the online softmax (in base 2)
  in between, waiting for the next block's keys while its ``P V`` runs.

Blocks the item's queries cannot see (``common.key_range``) are never
loaded; the causal (bottom-right) and window masks apply to the blocks at
the range's edges only (one loop, a traced flag: ``tiles.hiding``). A block
overhanging the sequence's cache holds rows of no token of it (another
sequence's, or unwritten: NaN in the tests), whose values would poison
``P V`` even at probability 0: the consumer zeroes them in SMEM first. The
splits' partial softmaxes (flash-decoding's split of a few long items) are
combined by XLA (``paged_attention``'s ``combine_splits``), and each token
gathers its result from its item's (``common.run_items``).

Interpreted (the CPU check), the kernel takes the key pool transposed in
GMEM and stages ``P`` through SMEM (``pallax.pallas_mosaic_gpu.Form``).

Selection: the heuristic returns None, so the executor keeps the Triton
kernel on an H100 and these configs are autotuning candidates: the kernel is
checked interpreted and compiled for H100, and has not run on a GPU yet.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax import pallas_utils as pu
from pallax.executor.config import KernelConfig
from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.tiles import LN2, broadcast
from pallax.kernels.paged_attention.common import combine_splits
from pallax.kernels.paged_attention.config import split_space, splits_for
from pallax.kernels.ragged_paged_attention import common
from pallax.pallas_mosaic_gpu import plgpu

IMPLEMENTATION = mgpu.IMPLEMENTATION
ROWS = mgpu.WGMMA_ROWS  # an item's rows, padded: one warpgroup's wgmma M
# The fewest rows of a TMA copy into a swizzled SMEM tile: a page's rows at least.
_PAGE_QUANTUM = 8
# Columns of the float32 output tile that leave SMEM at a time: a whole one
# at head dim 256 took SMEM the ring needs.
_OUT_COLS = 128
# The head dims it takes (each a whole number of ``_OUT_COLS`` or less).
_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class MosaicGpuRaggedPagedAttentionConfig(KernelConfig):
  """Blocks of the Mosaic GPU ragged-paged-attention kernel.

  block_q: query tokens per item of the work list; ``block_q * G`` rows at most 64.
  block_k: keys a step, a multiple of 64 up to 256 that is a multiple of the
    page size or divides it.
  num_stages: slots of the producer's SMEM ring (at least 2).
  num_splits: parts of an item's keys run by blocks of their own, combined after.
  """

  block_q: int = 1
  block_k: int = 64
  num_stages: int = 4
  num_splits: int = 1
  implementation: str = dataclasses.field(default=IMPLEMENTATION, kw_only=True)


CONFIG_CLS = MosaicGpuRaggedPagedAttentionConfig


def smem_bytes(p: common.Problem, config: MosaicGpuRaggedPagedAttentionConfig) -> int:
  """SMEM of a block of threads: Q, the ring's K and V blocks, the float32 output and stats."""
  c = config
  return mgpu.smem_bytes(
    ((ROWS, p.head_dim), p.dtype),
    ((c.num_stages, c.block_k, p.head_dim + p.value_dim), p.dtype),
    ((ROWS, min(p.value_dim, _OUT_COLS) + 2), jnp.float32),
  )


def call_reason(p: common.Problem) -> Optional[str]:
  """Why the kernel cannot run this call whatever its blocks, if it cannot."""
  if jnp.dtype(p.dtype) not in mgpu.GEMM_INPUTS:
    return f"the Mosaic GPU kernel takes bfloat16 and float16, not {jnp.dtype(p.dtype)}"
  if p.head_dim not in _HEAD_DIMS or p.value_dim not in _HEAD_DIMS:
    # Padding a head dim would copy the whole page pool.
    return f"head dims (q/k {p.head_dim}, v {p.value_dim}) must be 64, 128 or 256 on Mosaic GPU"
  if p.page_size % _PAGE_QUANTUM:
    return f"page_size {p.page_size} must be a multiple of {_PAGE_QUANTUM} on Mosaic GPU (TMA rows)"
  if p.groups > ROWS:
    return f"{p.groups} query heads a kv head: at most {ROWS} on Mosaic GPU"
  return None


def _config_reason(p: common.Problem, c: MosaicGpuRaggedPagedAttentionConfig) -> Optional[str]:
  if c.block_q * p.groups > ROWS:
    return f"block_q {c.block_q} x {p.groups} query heads a kv head > {ROWS} rows"
  if c.block_k % 64 or c.block_k > 256:
    return f"block_k={c.block_k} must be a multiple of 64 up to 256 on Mosaic GPU"
  if c.block_k % p.page_size and p.page_size % c.block_k:
    return f"block_k={c.block_k} and page_size {p.page_size}: one must divide the other"
  if c.num_stages < 2:
    return f"num_stages={c.num_stages}: the ring needs at least 2 slots"
  smem = smem_bytes(p, c)
  if smem > mgpu.SMEM_BUDGET:
    return f"{c} needs {smem} bytes of SMEM, over {mgpu.SMEM_BUDGET}"
  return None


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuRaggedPagedAttentionConfig, **params
) -> Optional[str]:
  """Why the kernel cannot run this call with ``config``, if it cannot."""
  p = common.Problem.of(avals, **params)
  reason = call_reason(p)
  return reason if reason is not None else _config_reason(p, config)


def heuristic(avals: Sequence[Any], target: str, **params) -> None:
  """None: the executor keeps Pallas-Triton; these configs are autotuning candidates.

  Why: the module's docstring (not yet measured on a GPU).
  """
  return None


def candidates(
  avals: Sequence[Any], target: str, **params
) -> list[MosaicGpuRaggedPagedAttentionConfig]:
  """Tokens an item (decode's 1, the mean query length's), key blocks, ring depths, splits."""
  p = common.Problem.of(avals, **params)
  if call_reason(p) is not None:
    return []
  mean = -(-p.tokens // max(1, p.max_seqs))
  qs = {1, max(1, min(pu.next_pow2(mean), ROWS // p.groups))}
  out = []
  for bq, bk, st in itertools.product(sorted(qs), (64, 128), (2, 4)):
    # Splits filling the GPU, as the Triton kernel's (the items counted as T / block_q).
    items = -(-p.tokens // bq) * p.kv_heads
    for sp in split_space(splits_for(items, p.max_len, bk)):
      out.append(
        MosaicGpuRaggedPagedAttentionConfig(block_q=bq, block_k=bk, num_stages=st, num_splits=sp)
      )
  return [c for c in out if _config_reason(p, c) is None]


def ragged_paged_attention(
  *operands, config: MosaicGpuRaggedPagedAttentionConfig, interpret: Any, **params
):
  """``[out, lse]``."""
  p = common.Problem.of(operands, **params)
  reason = supports(operands, "", config, **params)
  if reason is not None:
    raise NotImplementedError(f"ragged_paged_attention: {reason}")
  form = mgpu.Form.of(interpret)
  bq, bk, stages, splits = config.block_q, config.block_k, config.num_stages, config.num_splits
  rows, ps, h, hv = bq * p.groups, p.page_size, p.head_dim, p.value_dim
  # The rows that leave the kernel: the item's, rounded up to whole 32-byte
  # TMA rows of the float32 statistics (the 64 the consumer computes are padding past them).
  kept = mgpu.round_up(rows, 8)
  # Each step's keys arrive as ``copies`` TMA copies of ``span`` rows of one page.
  span = min(bk, ps)
  copies = bk // span

  def body(facts_ref, table_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, scoped):
    smem, q_full, (full, consumed) = scoped
    q_smem, k_smem, v_smem, o_smem, stat_smem, p_smem = smem
    i, kh, split = lax.axis_index("item"), lax.axis_index("kv"), lax.axis_index("split")
    wg = lax.axis_index("wg")
    q0, q_len, kv_len, start = (facts_ref[f, i] for f in range(4))
    lo, hi = common.key_range(p, q0, q_len, kv_len, bq)
    # This split's share of the item's key blocks.
    first, last = lax.div(lo, jnp.int32(bk)), lax.div(hi + (bk - 1), jnp.int32(bk))
    share = lax.div(last - first + (splits - 1), jnp.int32(splits))
    j_lo = jnp.minimum(first + split * share, last)
    j_hi = jnp.minimum(j_lo + share, last)
    ring = mgpu.Ring(stages, j_lo, j_hi, full, consumed)

    def wait_keys(j):
      pl.when(j < j_hi)(lambda: ring.wait(0, j))

    # Two warpgroups fit the register file at 255 registers a thread each: no
    # rebalancing (``setmaxnreg``). Held to 24, the producer's page-table
    # arithmetic spilled (compiled for H100). The branches are this kernel's
    # own: through ``Form.warpgroups`` (the same code,
    # the warpgroup's index read in each) 6 of its 54 configs spilled.

    @pl.when(wg == 0)
    def _consumer():
      # Row r is query head r % G of token start + r // G: row start * G + r
      # of the kv head's rows, the 64 from there in one copy.
      plgpu.copy_gmem_to_smem(q_ref.at[kh, pl.ds(start * p.groups, ROWS)], q_smem, q_full)
      plgpu.barrier_wait(q_full)
      # Row r is query q0 + r // G; rows past the item's are dropped after.
      positions = kv_len - q_len + q0 + lax.div(form.positions(ROWS, 0), jnp.int32(p.groups))
      # Key blocks every row sees whole: below the first query's position,
      # within the last's window and the cache.
      u_hi = jnp.minimum(kv_len - q_len + q0 + 1, kv_len)
      u_lo = lo if p.window is None else hi - p.window

      def keep(j):
        keys = broadcast(j * bk + form.positions(bk, 1), (ROWS, bk), 1)
        return common.visible(p, broadcast(positions, (ROWS, bk), 0), True, keys, kv_len)

      def step(j, carry):
        s = ring.slot(j)
        keys = plgpu.transpose_ref(k_smem.at[s], (1, 0)) if form.hopper else k_smem.at[s]

        qk = mgpu.fresh_product((ROWS, bk), lambda acc_ref: plgpu.wgmma(acc_ref, q_smem, keys))
        ring.release(0, j)
        is_masked = (j * bk < u_lo) | ((j + 1) * bk > u_hi)
        y, factor = tiles.logits2_factors(p, qk)
        y = tiles.hiding(is_masked, lambda: keep(j))(y)
        e, acc, m_new, denom = tiles.softmax_step(carry, y, factor)
        weights = form.operand(e.astype(p.dtype), p_smem)
        ring.wait(1, j)
        pl.when((j + 1) * bk > kv_len)(lambda: _zero_past(form, v_smem.at[s], j * bk, kv_len))
        acc = tiles.add_values(form, acc, weights, v_smem.at[s], lambda: wait_keys(j + 1))
        ring.release(1, j)
        return acc, m_new, denom

      wait_keys(j_lo)
      acc, m, denom = lax.fori_loop(j_lo, j_hi, step, tiles.softmax_init(form, ROWS, hv))
      stat_smem.at[0][...] = m * LN2  # the natural log's max, as combine_splits takes
      stat_smem.at[1][...] = denom
      for c0 in range(0, hv, o_smem.shape[1]):
        if c0:
          plgpu.wait_smem_to_gmem(0)  # the last part has left
        o_smem[...] = acc[:, c0 : c0 + o_smem.shape[1]]
        plgpu.commit_smem()
        part = pl.ds(c0, o_smem.shape[1])
        plgpu.copy_smem_to_gmem(o_smem.at[:kept], acc_ref.at[i, kh, split, :, part])
      plgpu.copy_smem_to_gmem(stat_smem.at[0, :kept], m_ref.at[i, kh, split])
      plgpu.copy_smem_to_gmem(stat_smem.at[1, :kept], l_ref.at[i, kh, split])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
      def step_copies(j, s):
        keys, values = [], []
        for c in range(copies):
          key = j * bk + c * span
          page = table_ref[i, jnp.minimum(lax.div(key, jnp.int32(ps)), p.pages_per_sequence - 1)]
          rows_in = pl.ds(lax.rem(key, jnp.int32(ps)), span)
          into = pl.ds(c * span, span)
          if form.hopper:
            keys.append((k_ref.at[kh, page, rows_in], k_smem.at[s, into]))
          else:
            keys.append((k_ref.at[kh, page, :, rows_in], k_smem.at[s, :, into]))
          values.append((v_ref.at[kh, page, rows_in], v_smem.at[s, into]))
        return [keys, values]

      ring.produce(step_copies)

  def items_kernel(q, k_pages, v_pages, items, table):
    n = items.q0.shape[0]
    # Each kv head's query rows token-major, (K, T * G + 64, H): every item's
    # 64 rows one box, past the last token zeros (a copy of q, not of the
    # items' padded rows).
    q = jnp.swapaxes(q, 0, 1).reshape(p.kv_heads, p.tokens * p.groups, h)
    q = jnp.pad(q, ((0, 0), (0, ROWS), (0, 0)))
    k = k_pages if form.hopper else jnp.swapaxes(k_pages, 2, 3)  # no transposed wgmma operand
    facts = jnp.stack([items.q0, items.q_len, items.kv_len, items.start]).astype(jnp.int32)
    swizzled = mgpu.swizzle_transforms(p.dtype)
    k_tile = (bk, h) if form.hopper else (h, bk)
    scratch = [
      [
        plgpu.SMEM((ROWS, h), p.dtype, transforms=swizzled),
        plgpu.SMEM((stages, *k_tile), p.dtype, transforms=swizzled),
        plgpu.SMEM((stages, bk, hv), p.dtype, transforms=swizzled),
        plgpu.SMEM((ROWS, min(hv, _OUT_COLS)), jnp.float32),
        plgpu.SMEM((2, ROWS), jnp.float32),
        form.staging((ROWS, bk), p.dtype),
      ],
      plgpu.Barrier(num_arrivals=1),
      mgpu.Ring.barriers((copies, copies), stages, 1),
    ]
    stats = jax.ShapeDtypeStruct((n, p.kv_heads, splits, kept), jnp.float32)
    m, denom, acc = form.launch(
      body,
      (facts, table, q, k, v_pages),
      (stats, stats, jax.ShapeDtypeStruct((n, p.kv_heads, splits, kept, hv), jnp.float32)),
      grid=(n, p.kv_heads, splits),
      grid_names=("item", "kv", "split"),
      scratch=scratch,
      name="ragged_paged_attention",
      consumers=1,
      approx_math=p.soft_cap is None,  # tanh.approx errs by 2^-11 relative
    )
    live = slice(0, rows)
    return combine_splits(m[..., live], denom[..., live], acc[..., live, :], p.dtype)

  return common.run_items(p, bq, operands, items_kernel, gather_queries=False)


def _zero_past(form: mgpu.Form, v_ref, start, kv_len) -> None:
  """Zeroes the rows of a value block (keys from ``start``) at or past ``kv_len``, in SMEM.

  64 rows at a time: a whole 128-row block in registers beside the
  accumulator and ``P`` spilled (compiled for H100).
  """
  rows, width = v_ref.shape
  for r0 in range(0, rows, ROWS):
    part = v_ref.at[pl.ds(r0, ROWS)]
    keys = broadcast(start + r0 + form.positions(ROWS, 0), (ROWS, width), 0)
    v = form.tile(part)
    part[...] = jnp.where(keys < kv_len, v, jnp.zeros_like(v))
  plgpu.commit_smem()
