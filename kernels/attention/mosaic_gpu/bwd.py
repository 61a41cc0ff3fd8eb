"""The attention backward on Pallas Mosaic GPU (Hopper): dq, dk and dv from the saved ``lse``.

Two kernels of the forward's structure (a TMA producer warpgroup filling an
SMEM ring, ``wgmma`` consumer warpgroups), neither recomputing the
forward's softmax statistics nor using atomics (unless ``fuse_dq``, below):

* the dq kernel: one block of threads per (query head, 64 queries a
  consumer, batch), one consumer warpgroup or two (``config.dq_consumers``);
  each keeps its queries' Q, dO, lse and ``-delta`` (``delta =
  rowsum(dO O) - dlse``) in SMEM and streams K and V blocks:
  ``P = exp2(S - lse)``, ``dP = dO V^T``, ``dS = P (dP - delta)``,
  ``dQ += dS K``;
* the dk/dv kernel: one block of threads per (kv head, 64 keys a consumer,
  batch), two consumers up to head dim 64, one above, or two where a config
  asks (``dkdv_steps`` in ``config.py``: 32- or 64-query steps), each a copy
  of its own (``Form.warpgroups``); each keeps its keys' K and V and streams,
  for every query head of the kv head (GQA sums in the accumulators, never
  a partial per query head), the blocks of Q, dO, lse and -delta that see its keys:
  ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dK += dS^T Q``.

Above head dim 128 (and in the dk/dv kernel above 64 with a soft cap) a
block of threads computes a share of its results' columns
(``config.out_cols``: 128 or 64 of dQ's, 64 of dK's and dV's): S and dP over the
whole head dim, then ``dQ``'s (or ``dK``'s and ``dV``'s) columns from the
same columns of K (of Q and dO), a column slice of the tile in SMEM as
``wgmma``'s operand. The shares' blocks of threads are adjacent on the
grid's heads axis.

With ``config.fuse_dq`` (an autotuning candidate unless XLA's flags ask
for deterministic ops: ``pallax.determinism``) the dk/dv kernel computes dQ too, and the
dq kernel does not run: 5 matrix products where the two kernels do 7. Its
steps take 32 queries (``FUSED_ROWS``: S^T, dP^T and a dQ^T tile take 16
registers a thread each; 64 spilled 112-248 bytes beside dK's and dV's
accumulators; but FlashAttention-3's tile, below), in one consumer above head dim 64 or, with
``dkdv_consumers=2``, two (FlashAttention-3's shape: 128 keys a block of
threads), and per 64 of dQ's columns ``dQ^T = K^T dS^T`` (K's columns
transposed, dS^T staged in SMEM) goes through a float32 SMEM tile to a TMA
reduce-add into a float32 dQ^T (``Form.add_to``; interpreted, a part of its
own per key tile, summed after the kernel). Two consumers at head dim 128
share dQ's columns (``config.shares_dq``): each computes 64 of them over
both consumers' keys, from both dS^T tiles once a barrier says both are
stored, and reduce-adds half the tiles. With ``dkdv_rows=64`` they take
FlashAttention-3's tile (``fused_wide_steps``): 64-query steps, P^T stored
to SMEM beside dS^T and dV's and dK's products reading both there, so a
consumer holds only accumulators beside its products in flight (in
``mgpu.WIDE_REGISTERS``' 240 a thread: at 232, 4 bytes spilled; P^T and
dS^T as register operands spilled 316-384 bytes in 64-query steps). Where
two consumers' masked and unmasked steps in loops of their own spilled
(FlashAttention-3's tile with any mask or padded keys, 32-query steps with
lengths, segment ids or a window, and unfused 64-query steps with lengths,
segment ids, a window, a bias or a mask) every step is masked, in one loop, from its
queries' positions that the ring brings (``masks_every_step``), in 240
registers a thread. The dk/dv kernel's products read its consumer's K and V
at an index loaded in the step (``mgpu.Form.opaque_zero``): their ``wgmma``
descriptors, held in registers across the loop at a constant index, spilled
the shared fused kernels with segment ids, windows or lengths. The adds'
order varies, so dq is not bitwise reproducible; padded keys are masked
there (their probability could overflow, and ``inf`` times their zero K is
NaN).

Within a consumer, products run while it computes (``Form.pipeline``):
the dk/dv kernel issues S^T and dP^T at once in the steps its loops know
to be unmasked (a loop of unmasked steps, ``tiles.over_steps``), computes
P^T beside dP^T, issues ``P^T dO`` before it waits for dP^T (else ptxas
moves the exponentials below that wait; not where that spilled:
``dv_first``) and ``dS^T Q`` beside ``P^T dO``; the dq kernel issues S
and dP at once in such steps. Other steps compute S's mask before dP^T
(or dP): beside it in flight their registers spilled (but where every
step is masked, ``masks_every_step``, whose mask reads its positions from
SMEM).

A bias or a mask (``tiles.logit_bias``: -inf where the mask hides) streams
in both kernels, unfused (``fuse_dq`` refuses them): the dq kernel's tile
of its consumers' rows with the keys (``QueryKernel.row_tiles``, added to
the base-2 logits after the soft cap), the dk/dv kernel's tile of its keys
with each step's queries, from the bias transposed by XLA (one more copy
of it: ``wgmma``'s layout loads no SMEM tile transposed). Where the bias
is differentiated (``Problem.differentiates_bias``) the dq kernel writes
its gradient, the logits' ``dS = P (dP - delta)`` before the cap's slope,
a float32 ``(B, K, G, T, S)`` result through a staging tile a consumer
(``QueryKernel.logit_outs``: zero in the blocks no step computes, those
hidden entirely by a causal mask, a window, lengths or segment ids; pairs
the mask hides are computed, P = 0), which XLA sums over the dims the bias
broadcasts.

Blocks hidden entirely (causal, window, lengths, outside the segments' runs)
are not loaded; partly hidden ones are masked. The soft cap's slope scales
``dS``. Padded queries
carry an lse of +inf (probability 0); padded keys give gradients that are
cut off (with ``fuse_dq`` they are masked). Q, K, V, dO, dq, dk and dv are
read and written sequence first, in the caller's layout
(``tiles.sequence_first``), as in the forward.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention import common
from pallax.kernels.attention.common import Problem
from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.config import (
  BWD_BLOCKS,
  DKDV_KERNEL,
  DQ_KERNEL,
  DQ_ROWS,
  FUSED_DQ_COLS,
  MosaicGpuAttentionConfig,
  bwd_lengths,
  call_of,
  dkdv_steps,
  fused_dq_tiles,
  fused_wide_steps,
  has_masks,
  head,
  logit_bias_dtype,
  masks_every_step,
  out_cols,
  shares_dq,
  two_wide_consumers,
)
from pallax.kernels.attention.mosaic_gpu.query_side import QueryKernel
from pallax.kernels.attention.mosaic_gpu.tiles import broadcast
from pallax.pallas_mosaic_gpu import plgpu


def bwd(*operands, config: MosaicGpuAttentionConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(dq, dk, dv[, dbias])``: dbias where the bias is differentiated."""
  c, p, form = call_of("bwd", operands, params, interpret)
  ops = c.ops
  h = head(p)
  (bq, _), bk = dkdv_steps(p, config), BWD_BLOCKS[1]
  tp, sp = bwd_lengths(p, config)
  delta = common.bwd_delta(p.stat, ops.out, ops.dout, ops.dlse).astype(jnp.float32)
  # Rows past their length get an lse of +inf: the dk/dv kernel's mask leaves them.
  lse = tiles.lse2(ops.lse.astype(jnp.float32), ops.q_len if p.has_lengths else None)
  queries = {
    "q": tiles.pad(ops.q, {3: tp, 4: h}),
    "do": tiles.pad(ops.dout.astype(p.dtype), {3: tp, 4: h}),
    "lse": tiles.pad(lse, {3: tp}, jnp.inf),
    "neg_delta": tiles.pad(-delta, {3: tp}),
  }
  keys = {"k": tiles.pad(ops.k, {2: sp, 3: h}), "v": tiles.pad(ops.v, {2: sp, 3: h})}
  blocks = tiles.Tiles(p, bq, bk, cut_keys=sp if config.fuse_dq else 0)
  bias = tiles.logit_bias(ops, logit_bias_dtype(p), tp, sp)
  kernels = _Kernels(p, ops, form, blocks, config, bias)
  dk, dv, dq = kernels.dkdv(queries, keys, tp, sp)
  ds = None
  if dq is None:
    dq, ds = kernels.dq(queries, keys, tp)
  cut = lambda x, n, d: x[..., :n, :d]
  named = {"dq": cut(dq, p.t, p.head_dim), "dk": cut(dk, p.s, p.head_dim)}
  dbias = None if ds is None else common.reduce_bias_grad(cut(ds, p.t, p.s), ops.bias)
  return c.results({**named, "dv": cut(dv, p.s, p.value_dim), "dbias": dbias})


class _Kernels:
  """The two backward kernels of one call."""

  def __init__(
    self,
    p: Problem,
    ops,
    form: mgpu.Form,
    blocks: tiles.Tiles,
    config: MosaicGpuAttentionConfig,
    bias: Optional[jax.Array],
  ):
    self.p, self.ops, self.form, self.blocks, self.config = p, ops, form, blocks, config
    self.h, self.bias = head(p), bias

  def _tile(self, lead: int, rows: int, cols: int):
    """SMEM tiles swizzled within a step's queries: ``wgmma`` contracts over a swizzle's width."""
    swizzle = mgpu.swizzle_transforms(self.p.dtype, math.gcd(cols, self.blocks.bq))
    return plgpu.SMEM((lead, rows, cols), self.p.dtype, transforms=swizzle)

  def _transposed(self, x: jax.Array):
    """``(B, K, G, h, Tp)``: ``x``'s tiles transposed, for the interpreted form (None on a GPU)."""
    return None if self.form.hopper else tiles.transposed(x)

  def _t(self, tiles_ref, transposed_ref, slot):
    """Ring slot ``slot``'s tile transposed for ``wgmma``: a view on a GPU, else its copy."""
    if self.form.hopper:
      return plgpu.transpose_ref(tiles_ref.at[slot], (1, 0))
    return transposed_ref.at[slot]

  def dq(self, queries: dict, keys: dict, tp: int) -> tuple[jax.Array, Optional[jax.Array]]:
    """``dq (B, K, G, Tp, h)``: per query tile, the key blocks it sees; and ``dS`` or None.

    With a bias (or mask) its tile of the consumers' rows streams with the
    keys (``QueryKernel.row_tiles``); a differentiated bias has its
    gradient, ``dS = P (dP - delta)`` before the soft cap's slope, written
    as a float32 ``(B, K, G, Tp, Sp)`` result, 0 in the blocks no step sees.
    """
    p, form, h, bk = self.p, self.form, self.h, self.blocks.bk
    writes_ds = p.differentiates_bias
    kernel = QueryKernel(
      p,
      self.ops,
      form,
      self.config.num_stages,
      bk,
      self.config.dq_consumers,
      own_tiles={"q": queries["q"], "do": queries["do"]},
      own_stats={"lse": queries["lse"], "neg_delta": queries["neg_delta"]},
      ring={"k": keys["k"], "v": keys["v"]},
      transposed=("k", "v"),
      outs={"dq": (p.dtype, True)},
      name=DQ_KERNEL,
      cols=out_cols(p, "dq"),
      row_tiles={} if self.bias is None else {"bias": self.bias},
      logit_outs=("ds",) if writes_ds else (),
    )

    def step(ctx, j, dq, hide):
      def starts():
        # V's wait here: before an unmasked step's S, after a masked step's
        # softmax (an unmasked step's S issued before V's wait spilled 8 bytes
        # at head dim 256, causal with a soft cap). dP's accumulator starts
        # from -delta: dS = P (dP - delta).
        ctx.ring.wait(1, j)
        return broadcast(ctx.stats["neg_delta"], (DQ_ROWS, bk), 0), dq

      def grads(refs, read, ready):
        """dP, S's softmax beside it where S runs with it, then dQ += dS K."""
        dp_ref, dq_ref = refs
        plgpu.wgmma(dp_ref, ctx.own["do"], ctx.tile_t("v"))
        probs, slope = ready(1)
        ds = probs * read(0, 0)
        if writes_ds:  # the bias' gradient: the logits', after the cap (as the bias is added)
          ctx.write_tile("ds", j, ds)
        ctx.ring.release(1, j)
        ds = ctx.operand((ds if slope is None else ds * slope).astype(p.dtype))
        plgpu.wgmma(dq_ref, ds, ctx.out_tile("k"))

      (_, dq), _ = ctx.pipeline(starts, grads, hide)
      ctx.ring.release(0, j)
      return dq

    cols = out_cols(p, "dq")
    init = lambda ctx: form.zeros((DQ_ROWS, cols))
    dq, *ds = kernel(init, step, lambda ctx, dq: {"dq": dq * p.scale}, tp, h)
    return dq, (ds[0] if writes_ds else None)

  def dkdv(self, queries: dict, keys: dict, tp: int, sp: int) -> tuple:
    """``dk, dv (B, K, Sp, h)`` and with ``fuse_dq`` ``dq (B, K, G, Tp, h)``, else None.

    Per key tile, every query head's query blocks that see it. With
    ``fuse_dq`` each step (``FUSED_ROWS`` queries, ``dkdv_rows`` in two
    consumers sharing dQ's columns) also adds its keys' share
    of dQ, ``dQ^T = K^T dS^T`` in ``FUSED_DQ_COLS`` of its columns a product,
    to a float32 dQ^T (``Form.add_to``): of every column, or (``shares_dq``)
    of the consumer's columns, both consumers' keys.
    """
    p, form, blocks, h = self.p, self.form, self.blocks, self.h
    bq, bk, stages, fuse_dq = blocks.bq, blocks.bk, self.config.num_stages, self.config.fuse_dq
    consumers = dkdv_steps(p, self.config)[1]
    cols = out_cols(p, "dkdv")
    chunks = h // cols
    assert chunks * cols == h, f"{cols} columns a share do not divide head dim {h}"
    assert not fuse_dq or chunks == 1, "a share of dK's and dV's columns has no whole dQ"
    # Consumers that split dQ's columns (``shares_dq``) take every step of
    # their block of threads (a consumer's hidden keys masked): each one's
    # dS^T feeds both dQ^T products, in one of two SMEM buffers by step.
    shared = fuse_dq and shares_dq(h, consumers)
    dq_tiles = fused_dq_tiles(h, consumers)  # a consumer adds a step
    # FlashAttention-3's tile: 64-query steps whose P^T and dS^T go to SMEM
    # for dV's and dK's products.
    wide = fused_wide_steps(p, self.config)
    # Two consumers above head dim 64 may mask every step in one loop, from the
    # positions of the step's queries that the ring brings (``masks_every_step``).
    mask_all = masks_every_step(p, self.config)
    # A step issues P^T dO before dS^T waits for dP^T: ptxas moves work below
    # a wait it does not feed (P^T's exponentials after dP^T's wait: 26 of 32
    # a thread), not below the issue of a product that reads it. dS^T comes
    # first where that spilled (compiled for H100): two consumers above head
    # dim 64 with masks, fused (16 bytes, causal) or of 64-query steps (24);
    # not where every step is masked (there FlashAttention-3's tile spilled
    # 28 with dS^T first; the unfused 64-query steps fit either way).
    dv_first = mask_all or not (two_wide_consumers(p, self.config) and has_masks(p))
    rows = consumers * bk
    q_t, do_t = self._transposed(queries["q"]), self._transposed(queries["do"])
    # dP^T's accumulator starts from -delta broadcast over the keys: no delta
    # column (16 registers a thread) next to the tiles (a masked head dim 128 spilled).
    stats = [queries["lse"], queries["neg_delta"]]
    tensors = [keys["k"], keys["v"], queries["q"], queries["do"]]
    operands = [tiles.sequence_first(x) for x in tensors] + stats
    transposed = [] if form.hopper else [q_t, do_t]
    k_t = fuse_dq and not form.hopper  # the interpreted form's K^T, dQ^T's left operand
    if k_t:
      transposed.append(tiles.transposed(keys["k"]))
    segs = tiles.padded_segments(self.ops, tp, sp)
    seg_ops = [] if segs is None else list(segs)
    facts = blocks.inputs(self.ops, segs, (rows, bk), queries_own=False)
    positions = [jnp.arange(tp, dtype=jnp.int32)] if mask_all else []
    # The bias (and mask) transposed, (Bb, Kb, Gb, Sp, Tp): a tile of the
    # block of threads' keys streams with each step's queries.
    bias_t = None if self.bias is None else jnp.swapaxes(self.bias, -1, -2)
    biases = [] if bias_t is None else [bias_t]
    operands += transposed + seg_ops + positions + biases + facts
    ends = list(itertools.accumulate(map(len, (transposed, seg_ops, positions, biases))))

    def body(k_ref, v_ref, q_ref, do_ref, lse_ref, neg_delta_ref, *rest):
      transposed, seg_refs, pos_refs, bias_refs = (
        rest[start:end] for start, end in zip([0, *ends], ends)
      )
      *fact_refs, dk_ref, dv_ref, scoped = rest[ends[-1] :]
      if fuse_dq:
        *fact_refs, dq_ref = fact_refs
      smem, own_full, (full, consumed), ds_ready = scoped
      k_smem, v_smem, q_smem, do_smem, lse_smem, neg_delta_smem, *others = smem
      qt_smem, dot_smem, st_smem, seg_smem, out_smem, ds_smem, kt_smem, dq_smem, *tail = others
      t_smem, *bias_smem = tail
      kh, b = lax.axis_index("heads"), lax.axis_index("batch")
      kh, share = tiles.column_share(kh, chunks, cols)
      columns = lambda ref: ref if share is None else ref.at[:, share]
      s_tile = lax.axis_index("k") * rows
      blocks = self.blocks.at(fact_refs, b, (rows, bk))
      lo, hi = blocks.query_blocks(s_tile, rows)
      count = hi - lo
      # Step u = g * count + (i - lo): query block i of query head g of the kv head.
      ring = mgpu.Ring(stages, jnp.int32(0), p.groups * count, full, consumed)

      def _consumer(wg: int):
        s0 = s_tile + wg * bk
        mine = pl.ds(s0, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, mine, kh], k_smem.at[wg], own_full.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[b, mine, kh], v_smem.at[wg], own_full.at[wg])
        if seg_refs:  # the keys' segment ids
          plgpu.copy_gmem_to_smem(seg_refs[1].at[b, mine], seg_smem[0].at[wg], own_full.at[wg])
        if k_t:
          plgpu.copy_gmem_to_smem(transposed[2].at[b, kh, :, mine], kt_smem.at[wg], own_full.at[wg])
        plgpu.barrier_wait(own_full.at[wg])
        k_seg = form.vector(seg_smem[0].at[wg], 0) if seg_refs else None
        own = (lo, hi) if shared else tiles.own_range(lo, hi, blocks.query_blocks(s0, bk))
        unmasked = blocks.unmasked_queries(s0, *own)
        if shared:  # the step's buffer; this consumer's columns of dQ
          ds_tile = lambda u, c: ds_smem.at[lax.rem(u, 2) * consumers + c]
          own_cols = pl.ds(wg * FUSED_DQ_COLS, FUSED_DQ_COLS)
        else:
          ds_tile = lambda u, c: ds_smem.at[c]

        def both_ready():  # shared: both consumers' dS^T stored (and the last read)
          plgpu.barrier_arrive(ds_ready)
          plgpu.barrier_wait(ds_ready)

        # The other consumer's K: its TMA waited for by that consumer, which
        # arrived at ``ds_ready`` after it, before this one reads it.
        def dq_product(u, zero, dq_cols, sources, acc_ref):
          """Issues step ``u``'s ``K^T dS^T`` over ``sources``' keys: dQ^T's columns ``dq_cols``.

          ``zero``: the step's ``opaque_zero``, K's tiles' index.
          """
          for src in sources:
            if form.hopper:  # K^T's rows: a view of K's columns transposed
              k_rows = plgpu.transpose_ref(k_smem.at[src + zero].at[:, dq_cols], (1, 0))
            else:
              k_rows = kt_smem.at[src].at[dq_cols]
            plgpu.wgmma(acc_ref, k_rows, ds_tile(u, src))

        def add_dq(g, i, n, dq_cols, dq_t):
          """Adds ``dq_t``, dQ^T's columns ``dq_cols`` of query block ``i`` of query head ``g``.

          Through this consumer's float32 SMEM tile ``n`` (of ``dq_tiles``).
          """
          part = None if form.hopper else lax.axis_index("k") * consumers + wg  # its key tile
          # This tile's last step's reduce-add has read it.
          plgpu.wait_smem_to_gmem(dq_tiles - 1, wait_read_only=True)
          dq_smem.at[wg, n][...] = dq_t
          plgpu.commit_smem()
          form.add_to(dq_smem.at[wg, n], dq_ref, (b, kh, g, dq_cols, pl.ds(i * bq, bq)), part)

        def step(u, g, i, carry, masked):
          dk, dv = carry
          s = ring.slot(u)
          column = lambda ref: broadcast(form.vector(ref.at[s], 1), (bk, bq), 1)
          # This consumer's K and V at an index read in the step: no descriptors
          # held across the loop (``opaque_zero``).
          zero = form.opaque_zero()
          keys, values = k_smem.at[wg + zero], v_smem.at[wg + zero]
          s_t = lambda acc_ref: plgpu.wgmma(acc_ref, keys, self._t(q_smem, qt_smem, s))
          dp_t = lambda acc_ref: plgpu.wgmma(acc_ref, values, self._t(do_smem, dot_smem, s))

          def keep():
            ids = None if k_seg is None else (k_seg, form.vector(seg_smem[1].at[s], 1))
            t_vec = form.vector(t_smem.at[s], 1) if mask_all else None
            return blocks.keep_queries(form, s0, i, ids, t_vec)

          logits = lambda x: tiles.hiding(masked, keep)(tiles.logits2(p, x))
          ring.wait(0, u)

          def starts():
            # dO's and lse's waits here: before an unmasked step's S^T, after
            # a masked step's mask. dP^T's accumulator starts from -delta:
            # dS^T = P^T (dP^T - delta).
            ring.wait(1, u)
            ring.wait(2, u)
            dq_t = [form.zeros((FUSED_DQ_COLS, bq))] if shared else []
            return column(neg_delta_smem), dv, dk, *dq_t

          def grads(refs, read, ready):
            """dP^T beside S^T's logits, P^T dO beside dS^T (``dv_first``), then dS^T Q.

            Shared (``shares_dq``): then, once both consumers' dS^T are
            stored, this consumer's columns of dQ^T beside dS^T Q.
            """
            dp_ref, dv_ref, dk_ref, *dq_ref = refs
            dp_t(dp_ref)
            z = ready(1)
            if bias_refs:  # after the cap, as the reference adds it (the slope reads z alone)
              bias = form.tile(bias_smem[0].at[s, pl.ds(wg * bk, bk)]).astype(jnp.float32)
              probs = jnp.exp2(z + bias * tiles.LOG2E - column(lse_smem))
            else:
              probs = jnp.exp2(z - column(lse_smem))
            ds = None if dv_first else probs * read(0, 0)  # P (dP - delta)
            weights = form.operand(probs.astype(p.dtype), st_smem, wg, 0, smem=wide)
            plgpu.wgmma(dv_ref, weights, columns(do_smem.at[s]))
            ds = probs * read(0, 1) if dv_first else ds
            ds = (ds if p.soft_cap is None else ds * tiles.cap_slope(p, z)).astype(p.dtype)
            if fuse_dq:  # dS^T to SMEM too: dQ^T's right operand
              ds_tile(u, wg)[...] = ds
              plgpu.commit_smem()
            left = ds_tile(u, wg) if wide else form.operand(ds, st_smem, wg, 1)
            plgpu.wgmma(dk_ref, left, columns(q_smem.at[s]))
            if shared:
              both_ready()
              dq_product(u, zero, own_cols, range(consumers), dq_ref[0])

          # In steps the loops know to be unmasked (``masked`` False: not the
          # one-consumer loop of a masked call) and in ``mask_all``'s S^T runs
          # with dP^T; else S^T and its mask come first: beside dP^T in flight
          # they spilled. (``mask_all``'s mask reads the step's positions, ring
          # group 2: S^T with dP^T, ``starts`` has waited for them.)
          (_, dv, dk, *dq_t), _ = form.pipeline_after(
            (bk, bq), s_t, logits, masked is False or mask_all, starts, grads
          )
          ring.release(2, u)
          ring.release(1, u)
          ring.release(0, u)
          if shared:
            add_dq(g, i, 0, own_cols, dq_t[0])
          elif fuse_dq:  # its own keys' share of every column
            for c in range(dq_tiles):
              dq_cols = pl.ds(c * FUSED_DQ_COLS, FUSED_DQ_COLS)
              dq_t = mgpu.fresh_product(
                (FUSED_DQ_COLS, bq), functools.partial(dq_product, u, zero, dq_cols, [wg])
              )
              add_dq(g, i, c, dq_cols, dq_t)
          return dk, dv

        def per_group(g, carry):
          base = g * count - lo

          def skip(i, carry):
            ring.skip(base + i)
            return carry

          group_step = lambda i, carry, masked: step(base + i, g, i, carry, masked)
          return tiles.over_steps(lo, own, unmasked, hi, skip, group_step, carry)

        def flat(u, carry):
          g, i = lax.div(u, count), lo + lax.rem(u, count)
          # Without masks no step is masked: no lax.cond of two identities.
          masks = has_masks(p) or blocks.hides_padded_keys
          masked = mask_all or (tiles.masked_step(i, unmasked) if masks else False)
          return step(u, g, i, carry, masked)

        zeros = lambda: form.zeros((bk, cols))
        if consumers == 1 or mask_all:
          # One consumer (above head dim 64: 64-query steps, fused 32), or consumers
          # masking every step: dK and dV take up to 128 registers a thread: one
          # loop over every query head's blocks, masked or not (the consumer
          # owns its block of threads' range; two masking every step each take
          # all of it, their own keys' hidden steps masked). Loops
          # per query head and per kind of step spilled at their edges (with
          # GQA, compiled for H100).
          dk, dv = lax.fori_loop(0, p.groups * count, flat, (zeros(), zeros()))
        else:
          dk, dv = lax.fori_loop(0, p.groups, per_group, (zeros(), zeros()))
        if shared:  # the other consumer's last dQ^T has read this one's K
          both_ready()
        results = ((dk * p.scale, dk_ref, k_smem), (dv, dv_ref, v_smem))
        if share is None:  # through K's and V's SMEM
          for result, _, buf in results:
            buf.at[wg][...] = result.astype(p.dtype)
          plgpu.commit_smem()
          for _, ref, buf in results:
            plgpu.copy_smem_to_gmem(buf.at[wg], ref.at[b, mine, kh])
          plgpu.wait_smem_to_gmem(0)
        else:  # through one tile of the share's columns, dK's then dV's
          for result, ref, _ in results:
            out_smem.at[wg][...] = result.astype(p.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], ref.at[b, mine, kh, share])
            plgpu.wait_smem_to_gmem(0)

      def _producer():
        def copies(u, s):
          g = lax.div(u, count)
          block = pl.ds((lo + lax.rem(u, count)) * bq, bq)
          groups = [
            [(q_ref.at[b, block, kh, g], q_smem.at[s])],
            [(do_ref.at[b, block, kh, g], do_smem.at[s])],
            [(lse_ref.at[b, kh, g, block], lse_smem.at[s])],
          ]
          groups[2].append((neg_delta_ref.at[b, kh, g, block], neg_delta_smem.at[s]))
          if pos_refs:  # the queries' positions, with their statistics
            groups[2].append((pos_refs[0].at[block], t_smem.at[s]))
          if seg_refs:  # the queries' segment ids, with the queries
            groups[0].append((seg_refs[0].at[b, block], seg_smem[1].at[s]))
          if bias_refs:  # and the bias' tile of the block of threads' keys
            tile = tiles.row_tile(bias_refs[0], bias_t, b, kh, g, pl.ds(s_tile, rows), block)
            groups[0].append((tile, bias_smem[0].at[s]))
          for group, ref, buf in zip(groups, transposed[:2], (qt_smem, dot_smem)):
            group.append((ref.at[b, kh, g, :, block], buf.at[s]))
          return groups

        ring.produce(copies)

      # Consumers sharing dQ's columns, or masking every step, take all the
      # producer can spare: at 232 FlashAttention-3's tile spilled 4 bytes,
      # 32-query steps 24 with a causal mask at 4 query heads on one kv head,
      # the unfused 64-query steps masking every step 16-44 (none at 240).
      registers = mgpu.WIDE_REGISTERS if shared or mask_all else mgpu.REGISTERS
      form.warpgroups(consumers, _consumer, _producer, registers=registers)

    copies = 1 if form.hopper else 2
    scratch = [
      [
        self._tile(consumers, bk, h),
        self._tile(consumers, bk, h),
        self._tile(stages, bq, h),
        self._tile(stages, bq, h),
        plgpu.SMEM((stages, bq), jnp.float32),
        plgpu.SMEM((stages, bq), jnp.float32),
        None if form.hopper else self._tile(stages, h, bq),
        None if form.hopper else self._tile(stages, h, bq),
        form.staging((consumers, 2 - wide, bk, bq), p.dtype, smem=wide),  # P^T, dS^T
        tiles.segment_smem(segs, (consumers, bk), (stages, bq)),
        None if chunks == 1 else self._tile(consumers, bk, cols),
        self._tile((1 + shared) * consumers, bk, bq) if fuse_dq else None,
        self._tile(consumers, h, bk) if k_t else None,
        plgpu.SMEM(
          (consumers, dq_tiles, FUSED_DQ_COLS, bq),
          jnp.float32,
          transforms=mgpu.swizzle_transforms(jnp.float32, bq),
        )
        if fuse_dq
        else None,
        plgpu.SMEM((stages, bq), jnp.int32) if mask_all else None,
        *([] if bias_t is None else [tiles.bias_smem(bias_t, (stages, rows, bq))]),
      ],
      plgpu.Barrier(num_arrivals=2 + bool(segs) + k_t, num_barriers=consumers),
      mgpu.Ring.barriers(
        (copies + bool(segs) + bool(biases), copies, 2 + mask_all), stages, consumers
      ),
      plgpu.Barrier(num_arrivals=consumers) if shared else None,
    ]
    shape = jax.ShapeDtypeStruct((p.batch, sp, p.kv_heads, h), p.dtype)
    dq_sum = jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, h, tp), jnp.float32)
    dk, dv, *dq = form.launch(
      body,
      operands,
      (shape, shape),
      grid=(p.kv_heads * chunks, sp // rows, p.batch),
      grid_names=("heads", "k", "batch"),
      scratch=scratch,
      name=DKDV_KERNEL,
      approx_math=p.soft_cap is None,
      consumers=consumers,
      sums=[dq_sum] if fuse_dq else [],
      parts=sp // bk,
    )
    dq = (jnp.swapaxes(dq[0], -2, -1) * p.scale).astype(p.dtype) if fuse_dq else None
    return tiles.heads_first(dk), tiles.heads_first(dv), dq
