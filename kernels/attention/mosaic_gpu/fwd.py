"""The attention forward on Pallas Mosaic GPU (Hopper), with FlashAttention-3's structure.

One block of threads per (query head, tile of ``consumers * block_q``
queries, batch), three warpgroups (two where one consumer runs):

* a producer warpgroup gives up most of its registers and issues TMA loads
  of the K and V blocks the tile can see into a ``num_stages``-deep SMEM
  ring (``pallax.pallas_mosaic_gpu.Ring``);
* two consumer warpgroups, ``block_q`` queries each, issue ``S = Q K^T`` and
  ``O += P V`` on the tensor cores with asynchronous ``wgmma`` and run the
  online softmax (in base 2) in between. A schedule barrier makes them take
  turns (ping-pong): one's softmax overlaps the other's matmuls. Each waits
  for the next block's K while its ``P V`` runs. With a soft cap and masks
  above head dim 128 one consumer runs, without the ping-pong
  (``config.fwd_consumers``: two spill there). With ``config.fwd_overlap``
  (an autotuning candidate) each consumer overlaps within itself too, as
  FlashAttention-3 does: a step issues block j's ``S`` and block j - 1's
  ``P V`` together and runs block j's softmax while ``P V`` runs
  (``Form.pipeline_after``); own's first ``S`` and last ``P V`` run alone
  (``tiles.over_steps``' ends).

Blocks that causality, a window, the lengths or the segment ids hide entirely
are never loaded (segment ids: outside the run of blocks a tile's segments
meet); those that are partly hidden, and the block overhanging the keys' end,
are masked; the rest run without a mask (``tiles.over_steps``). GQA reads the
kv head of the query head (never repeated). A bias and a mask come as one
bias (``tiles.logit_bias``: -inf where the mask hides, in the bias' dtype or
the call's for a mask alone); the producer brings its tile of the block of
threads' rows with each key block, and each step adds it to the logits in
float32 (an autotuning candidate until timed on a GPU: ``config.heuristic``).
Q, K, V and the output are read and written sequence first, in the caller's
layout (``tiles.sequence_first``: no transposes run around the kernel). Head
dims are padded to a multiple of 64 and the query and key lengths to whole
tiles, by XLA, where they are not (one copy each then).

Interpreted (the CPU check), the kernel takes K transposed in GMEM and stages
``P`` through SMEM (``pallax.pallas_mosaic_gpu.Form``); the tile maths, the
warpgroups, the ring and the barriers are the same.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention.common import NEG_INF
from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.config import (
  MosaicGpuAttentionConfig,
  call_of,
  fwd_consumers,
  head,
  logit_bias_dtype,
  round_up,
)
from pallax.kernels.attention.mosaic_gpu.tiles import LN2, LOG2E, broadcast
from pallax.pallas_mosaic_gpu import plgpu


def fwd(*operands, config: MosaicGpuAttentionConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(out, lse)``."""
  c, p, form = call_of("fwd", operands, params, interpret)
  bq, bk, stages = config.block_q, config.block_k, config.num_stages
  consumers = fwd_consumers(p)
  h, rows = head(p), consumers * bq
  tp, sp = round_up(p.t, rows), round_up(p.s, bk)
  q = tiles.sequence_first(tiles.pad(c.ops.q, {3: tp, 4: h}))
  k = tiles.pad(c.ops.k, {2: sp, 3: h})
  v = tiles.sequence_first(tiles.pad(c.ops.v, {2: sp, 3: h}))
  k = tiles.sequence_first(k) if form.hopper else tiles.transposed(k)
  segs = tiles.padded_segments(c.ops, tp, sp)
  seg_ops = [] if segs is None else list(segs)
  bias = tiles.logit_bias(c.ops, logit_bias_dtype(p), tp, sp)
  bias_ops = [] if bias is None else [bias]
  call_tiles = tiles.Tiles(p, bq, bk)
  facts = call_tiles.inputs(c.ops, segs, (rows, bq), queries_own=True)

  def body(q_ref, k_ref, v_ref, *refs):
    seg_refs = refs[: len(seg_ops)]
    bias_refs = refs[len(seg_ops) : len(seg_ops) + len(bias_ops)]
    *fact_refs, out_ref, lse_ref, scoped = refs[len(seg_ops) + len(bias_ops) :]
    smem, q_full, (full, consumed), schedule = scoped
    qo_smem, k_smem, v_smem, lse_smem, p_smem, seg_smem, bias_smem = smem
    n, b = lax.axis_index("heads"), lax.axis_index("batch")
    kh, g = lax.div(n, jnp.int32(p.groups)), lax.rem(n, jnp.int32(p.groups))
    t_tile = tiles.query_tile_start(p, tp, rows)
    blocks = call_tiles.at(fact_refs, b, (rows, bq))
    lo, hi = blocks.key_blocks(t_tile, rows)
    ring = mgpu.Ring(stages, lo, hi, full, consumed)

    def take_turn():  # ping-pong: one consumer's turn ends, the other's begins
      if consumers > 1:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def wait_keys(j):
      pl.when(j < hi)(lambda: ring.wait(0, j))

    def _consumer(wg):
      t0 = t_tile + wg * bq
      q_smem = qo_smem.at[wg]
      mine = pl.ds(t0, bq)
      plgpu.copy_gmem_to_smem(q_ref.at[b, mine, kh, g], q_smem, q_full.at[wg])
      if seg_refs:  # the queries' segment ids
        plgpu.copy_gmem_to_smem(seg_refs[0].at[b, mine], seg_smem[0].at[wg], q_full.at[wg])
      plgpu.barrier_wait(q_full.at[wg])
      q_seg = form.vector(seg_smem[0].at[wg], 0) if seg_refs else None
      own = tiles.own_range(lo, hi, blocks.key_blocks(t0, bq))

      def skip(j, carry):  # its K already waited for
        ring.wait(1, j)
        ring.release(0, j)
        ring.release(1, j)
        take_turn()
        take_turn()
        wait_keys(j + 1)
        return carry

      def issue_scores(j, acc_ref):  # S = Q K^T of block j
        s = ring.slot(j)
        keys = plgpu.transpose_ref(k_smem.at[s], (1, 0)) if form.hopper else k_smem.at[s]
        # With segment ids Q's index is read in each step: at a constant index
        # its wgmma descriptors (32 registers at head dim 256) were held across
        # the loop and spilled 8-76 bytes, compiled for H100 (``Form.opaque_zero``).
        # Without them the code stays as it was timed on an H200.
        queries = qo_smem.at[wg + form.opaque_zero()] if seg_refs else q_smem
        plgpu.wgmma(acc_ref, queries, keys)

      def probabilities(j, qk, m, denom, masked: bool):
        """Block ``j``'s ``S`` into the softmax (``e``, ``alpha``, maxima, sums); frees its K."""
        keep = None
        if masked:  # the keys' ids are in the slot until it is released
          ids = None if q_seg is None else (q_seg, form.vector(seg_smem[1].at[ring.slot(j)], 1))
          keep = blocks.keep_keys(form, t0, j, ids)
        logit_bias = None
        if bias_refs:  # the consumer's rows of the block's bias (-inf where a mask hides)
          logit_bias = form.tile(bias_smem.at[ring.slot(j), pl.ds(wg * bq, bq)])
        ring.release(0, j)
        y, factor = tiles.logits2_factors(p, qk)
        # Masked (and biased) steps take the product first: fused into the exponent
        # there, a causal step of 256 keys at head dim 64 spilled 88 bytes (H100).
        hidden = keep is not None or logit_bias is not None  # a bias may hide whole rows
        if hidden:
          y, factor = y * factor, 1.0
        if logit_bias is not None:
          y = y + logit_bias.astype(jnp.float32) * LOG2E
        y = tiles.masked(y, keep)
        return tiles.softmax_stats(m, denom, y, factor, hidden=hidden)

      def scores(j):  # the other consumer's turn while they run
        return mgpu.fresh_product((bq, bk), lambda ref: (issue_scores(j, ref), take_turn()))

      def our_turn(j):  # block j's values in their slot, the tensor cores ours
        ring.wait(1, j)
        if consumers > 1:
          plgpu.barrier_wait(schedule)

      def turn_ends():  # done with the softmax
        if consumers > 1:
          plgpu.barrier_arrive(schedule)

      def step(j, carry, masked: bool):
        acc, m, denom = carry
        e, alpha, m, denom = probabilities(j, scores(j), m, denom, masked)
        acc, e16 = acc * broadcast(alpha, acc.shape, 0), e.astype(p.dtype)
        acc, denom, m, e16 = form.barrier((acc, denom, m, e16))
        turn_ends()
        our_turn(j)
        acc = add_values(j, acc, e16, lambda: wait_keys(j + 1))
        return acc, m, denom

      def add_values(j, acc, e16, overlap):
        acc = tiles.add_values(
          form, acc, form.operand(e16, p_smem, wg), v_smem.at[ring.slot(j)], overlap
        )
        ring.release(1, j)
        return acc

      # ``config.fwd_overlap``: block j's S beside block j - 1's P V.
      def first(j, carry, masked: bool):  # own's first block: its S, its P V in the next step
        acc, m, denom, e16 = carry
        e, _, m, denom = probabilities(j, scores(j), m, denom, masked)  # acc is 0
        e16, m, denom = form.barrier((e.astype(p.dtype), m, denom))
        turn_ends()
        wait_keys(j + 1)
        return acc, m, denom, e16

      def pipelined(j, carry, masked: bool):
        acc, m, denom, e_prev = carry
        our_turn(j - 1)

        def values(refs, read, ready):  # P V, block j's softmax beside it
          plgpu.wgmma(refs[0], form.operand(e_prev, p_smem, wg), v_smem.at[ring.slot(j - 1)])
          take_turn()
          return ready(1)

        def softmax(qk):
          results = probabilities(j, qk, m, denom, masked)
          turn_ends()
          wait_keys(j + 1)
          return results

        # e leaves in float32: converted while P V reads the registers of e_prev,
        # ptxas serialized every wgmma of the kernel (C7513), as FlashAttention-3
        # converts after its wait.
        like = (form.zeros((bq, bk)), m, m, denom)
        (acc,), (e, alpha, m_new, denom) = form.pipeline_after(
          (bq, bk), lambda ref: issue_scores(j, ref), softmax, True, lambda: (acc,), values, like
        )
        ring.release(1, j - 1)
        acc, e = form.barrier((acc, e))  # after the wait: no conversion hoisted before it
        return acc * broadcast(alpha, acc.shape, 0), m_new, denom, e.astype(p.dtype)

      def last(j, carry):  # own's last block's P V
        acc, m, denom, e16 = carry
        our_turn(j)
        return add_values(j, acc, e16, lambda: None), m, denom, e16

      init = tiles.softmax_init(form, bq, h)
      wait_keys(lo)
      pl.when(wg == 1)(take_turn)
      unmasked = blocks.unmasked_keys(t0, *own)
      if config.fwd_overlap:
        e16 = form.zeros((bq, bk), p.dtype)
        acc, m, denom, _ = tiles.over_steps(
          lo, own, unmasked, hi, skip, pipelined, (*init, e16), ends=(first, last)
        )
      else:
        acc, m, denom = tiles.over_steps(lo, own, unmasked, hi, skip, step, init)
      pl.when(wg == 0)(take_turn)

      empty = denom == 0.0
      denom = jnp.where(empty, 1.0, denom)
      acc = acc * broadcast(1.0 / denom, acc.shape, 0)
      q_smem[...] = acc.astype(p.dtype)
      lse_smem.at[wg][...] = jnp.where(empty, NEG_INF, m * LN2 + jnp.log(denom))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, mine, kh, g])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, kh, g, mine])
      plgpu.wait_smem_to_gmem(0)

    def _producer():
      def copies(j, s):
        keys = pl.ds(j * bk, bk)
        k_block = k_ref.at[b, keys, kh] if form.hopper else k_ref.at[b, kh, :, keys]
        key_copies = [(k_block, k_smem.at[s])]
        if seg_refs:  # and their segment ids
          key_copies.append((seg_refs[1].at[b, keys], seg_smem[1].at[s]))
        if bias_refs:  # and the bias' tile of the block of threads' rows
          tile = tiles.row_tile(bias_refs[0], bias, b, kh, g, pl.ds(t_tile, rows), keys)
          key_copies.append((tile, bias_smem.at[s]))
        return [key_copies, [(v_ref.at[b, keys, kh], v_smem.at[s])]]

      ring.produce(copies)

    # One copy for all consumers: copies of their own (``Form.warpgroups``)
    # gained nothing here (an unmasked step at head dim 128: 470 instructions
    # against 467, compiled for H100).
    form.warpgroups(consumers, _consumer, _producer, copies=False)

  swizzled = mgpu.swizzle_transforms(p.dtype)
  k_tile = (bk, h) if form.hopper else (h, bk)
  scratch = [
    [
      plgpu.SMEM((consumers, bq, h), p.dtype, transforms=swizzled),
      plgpu.SMEM((stages, *k_tile), p.dtype, transforms=swizzled),
      plgpu.SMEM((stages, bk, h), p.dtype, transforms=swizzled),
      plgpu.SMEM((consumers, bq), jnp.float32),
      form.staging((consumers, bq, bk), p.dtype),
      tiles.segment_smem(segs, (consumers, bq), (stages, bk)),
      tiles.bias_smem(bias, (stages, rows, bk)),
    ],
    plgpu.Barrier(num_arrivals=1 + bool(seg_ops), num_barriers=consumers),
    mgpu.Ring.barriers((1 + bool(seg_ops) + bool(bias_ops), 1), stages, consumers),
    plgpu.Barrier(num_arrivals=consumers),
  ]
  out_type = jax.ShapeDtypeStruct((p.batch, tp, p.kv_heads, p.groups, h), p.dtype)
  lse_type = jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, tp), jnp.float32)
  out, lse = form.launch(
    body,
    (q, k, v, *seg_ops, *bias_ops, *facts),
    (out_type, lse_type),
    grid=(p.kv_heads * p.groups, tp // rows, p.batch),
    grid_names=("heads", "q", "batch"),
    scratch=scratch,
    name="dot_product_attention_fwd",
    approx_math=p.soft_cap is None,  # tanh.approx errs by 2^-11 relative
    consumers=consumers,
  )
  out = tiles.heads_first(out)[..., : p.t, : p.value_dim]
  return c.results({"out": out, "lse": lse[..., : p.t]})
