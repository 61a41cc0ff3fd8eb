"""A query-side Mosaic GPU attention kernel: consumers own queries, the producer streams keys.

The backward's dq kernel and the tangent kernel share this frame; they
differ in what each consumer keeps of its queries (``own_tiles``,
``own_stats``), which key-side operands the ring streams, the step, and what
they write. One block of threads per (query head, ``consumers * 64``
queries, batch); each consumer loads its 64 queries' tiles and statistics
once, walks the key blocks its block of threads sees (``tiles.over_steps``:
blocks its own rows do not see are released without computing) and writes
its outputs through SMEM. A kernel may split its tile outputs' columns over
blocks of threads (``cols``: the backward's dq and the tangent above head
dim 128).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention.common import Problem
from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.config import DQ_ROWS, head
from pallax.pallas_mosaic_gpu import plgpu


@dataclasses.dataclass
class Step:
  """What a consumer's step sees: its own queries' refs and values, the ring's slot.

  own: name -> the consumer's SMEM tile of that own operand; stats: name ->
  its row statistic's value (broadcast along dim 0). ``tile(name)`` is the
  ring's slot of a streamed operand, ``tile_t(name)`` the same transposed
  (a view on a GPU, the transposed copy interpreted), ``out_tile(name)`` its
  columns of the block of threads' outputs (``cols``: a slice, or None for all;
  not of a ``shared`` operand, whose slot holds those columns alone).
  ``masked``: the step's ``over_steps`` flag: a Python bool in loops of
  masked or unmasked steps, traced in one loop of both (``one_loop``).
  ``row_tile(name)`` loads the consumer's rows of a ``row_tiles`` operand's
  slot (read before the keys' group is released); ``write_tile(name, j, x)``
  stores ``x``, its float32 tile of key block ``j``, to the ``logit_outs``
  result ``name``.
  """

  kernel: QueryKernel
  wg: Any
  own: dict
  stats: dict
  ring_refs: dict
  transposed_refs: dict
  row_refs: dict
  staging: Any
  ring: mgpu.Ring = None
  slot: Any = None
  cols: Any = None
  masked: Any = None
  write_tile: Optional[Callable[[str, Any, jax.Array], None]] = None

  def tile(self, name: str):
    return self.ring_refs[name].at[self.slot]

  def out_tile(self, name: str):
    return self.tile(name) if self.cols is None else self.tile(name).at[:, self.cols]

  def row_tile(self, name: str) -> jax.Array:
    rows = pl.ds(self.wg * DQ_ROWS, DQ_ROWS)
    return self.kernel.form.tile(self.row_refs[name].at[self.slot, rows])

  def tile_t(self, name: str):
    if self.kernel.form.hopper:
      return plgpu.transpose_ref(self.ring_refs[name].at[self.slot], (1, 0))
    return self.transposed_refs[name].at[self.slot]

  def pipeline(
    self, starts: Callable[[], tuple], issue: Callable, hide: Callable, like: tuple = ()
  ) -> tuple[tuple, tuple]:
    """``Form.pipeline_after`` the step's ``S = Q K^T``, ``ready(pending)`` its softmax.

    ``ready`` returns ``P = exp2(z - lse)`` (``z``: the logits, plus the
    ``"bias"`` row tile's times log2 e with one, ``hide`` masking them) and
    the soft cap's slope (None without a cap). In a step
    the loops know to be unmasked (``masked`` False) S is issued first in
    the pipeline and its softmax runs beside the products ``issue`` issues
    after it; else S and its softmax come first (beside a product in flight
    the mask's registers spilled: compiled for H100, the dq kernel 8 bytes
    with a soft cap in two consumers, 96 at head dim 256). ``starts()``
    makes the accumulators and waits for the ring slots the later products
    read: before S in an unmasked step, after its softmax in a masked one.
    """
    p, shape = self.kernel.p, (DQ_ROWS, self.kernel.bk)

    def softmax(x):
      z, slope = tiles.logits2(p, x, cap_grad=True)
      if "bias" in self.row_refs:  # after the cap, as the reference adds it
        z = z + self.row_tile("bias").astype(jnp.float32) * tiles.LOG2E
      return jnp.exp2(hide(z) - tiles.broadcast(self.stats["lse"], shape, 0)), slope

    scores = lambda acc_ref: plgpu.wgmma(acc_ref, self.own["q"], self.tile_t("k"))
    form = self.kernel.form
    return form.pipeline_after(shape, scores, softmax, self.masked is False, starts, issue, like)

  def operand(self, x: jax.Array, k: int = 0):
    """``x`` as a ``wgmma`` left operand (interpreted, staged through SMEM slot ``k``)."""
    return self.kernel.form.operand(x, self.staging, self.wg, k)


@dataclasses.dataclass
class QueryKernel:
  """One query-side kernel of a call.

  Attributes:
    p, form, stages: the call, the kernel's form, the ring's slots.
    ops: the call's operands by name (its lengths and segment ids).
    bk: keys a ring step.
    consumers: consumer warpgroups (of 64 queries each).
    own_tiles: name -> ``(B, K, G, Tp, h)`` operand each consumer keeps (read
      sequence first: ``tiles.sequence_first``).
    own_stats: name -> ``(B, K, G, Tp)`` float32 statistic each keeps.
    ring: name -> ``(B, K, Sp, h)`` operand streamed (likewise), one ring group each;
      ``transposed``: those of them a step reads transposed; ``shared``: those
      streamed in the block of threads' column share (``cols``) alone.
    row_tiles: name -> ``(Bb, Kb, Gb, Tp, Sp)`` operand (``tiles.logit_bias``'
      shape) whose tile of the block of threads' rows streams with the keys,
      in their group; ``"bias"`` is added to the logits (``Step.pipeline``).
    logit_outs: names of float32 ``(B, K, G, Tp, Sp)`` results, zero before
      the kernel, to which a step stores its consumer's tile of a key block
      (``Step.write_tile``; the first column share alone): blocks no step
      computes stay 0 (the backward's dS, the bias' gradient).
    outs: name -> (dtype, tile?): the outputs, a ``(Tp, h)`` tile or a
      ``(Tp,)`` vector per query head, written through SMEM.
    name: the kernel's name.
    one_loop: masked and unmasked steps in one loop (``tiles.over_steps``).
    cols: columns of the tile outputs a block of threads computes (a divisor
      of the head dim; None: all), its share chosen by the grid's heads axis.
      Every share computes the vector outputs; the first writes them.
    staged: register ``wgmma`` operands a step issues before it waits for
      the first (the interpreted form stages each through an SMEM slot of
      its own).
  """

  p: Problem
  ops: Any
  form: mgpu.Form
  stages: int
  bk: int
  consumers: int
  own_tiles: Mapping[str, jax.Array]
  own_stats: Mapping[str, jax.Array]
  ring: Mapping[str, jax.Array]
  transposed: Sequence[str]
  outs: Mapping[str, tuple[Any, bool]]
  name: str
  one_loop: bool = False
  cols: Optional[int] = None
  staged: int = 1
  shared: Sequence[str] = ()
  row_tiles: Mapping[str, jax.Array] = dataclasses.field(default_factory=dict)
  logit_outs: Sequence[str] = ()

  def _tile(self, lead: int, rows: int, cols: int, dtype=None, swizzled: Optional[int] = None):
    """SMEM tiles of ``rows x cols``, swizzled within ``swizzled`` columns (default all)."""
    dtype = self.p.dtype if dtype is None else dtype
    swizzle = mgpu.swizzle_transforms(dtype, cols if swizzled is None else swizzled)
    return plgpu.SMEM((lead, rows, cols), dtype, transforms=swizzle)

  def _ring_tile(self, name: str, h: int, cols: int):
    """A ring slot's tiles of ``name``: its columns' share or whole.

    Swizzled within a step's keys (``wgmma`` contracts over them: ``P V``),
    but for those read transposed (contracted over their columns, swizzled
    as the own tiles they meet: ``Q K^T``).
    """
    width = cols if name in self.shared else h
    swizzled = width if name in self.transposed else math.gcd(self.bk, width)
    return self._tile(self.stages, self.bk, width, swizzled=swizzled)

  def __call__(
    self,
    init: Callable[[Step], Any],
    step: Callable[[Step, Any, Any, bool], Any],
    finish: Callable[[Step, Any], dict],
    tp: int,
    h: int,
  ) -> list[jax.Array]:
    """Runs the kernel: ``step(ctx, j, carry, hide)`` a key block, ``finish`` its outputs.

    The first ring group (the keys) is in its slot when ``step`` runs;
    ``hide(z)`` masks the block's logits (``tiles.hiding``). ``finish(ctx,
    carry)`` returns the consumer's outputs by name (float32 values, cast to
    their dtypes here). Returns the ``outs``, then the ``logit_outs``.
    """
    p, form, stages, bk = self.p, self.form, self.stages, self.bk
    assert not set(self.shared) & set(self.transposed), "a shared operand is read whole"
    bq, rows = DQ_ROWS, self.consumers * DQ_ROWS
    cols = h if self.cols is None else self.cols
    chunks = h // cols
    assert chunks * cols == h, f"{cols} columns a share do not divide head dim {h}"
    own_names, stat_names = list(self.own_tiles), list(self.own_stats)
    ring_names, out_names, row_names = list(self.ring), list(self.outs), list(self.row_tiles)
    operands = [
      *map(tiles.sequence_first, self.own_tiles.values()),
      *self.own_stats.values(),
      *map(tiles.sequence_first, self.ring.values()),
      *self.row_tiles.values(),
    ]
    if not form.hopper:
      operands += [tiles.transposed(self.ring[n]) for n in self.transposed]
    n_t = len(operands)
    sp = next(iter(self.ring.values())).shape[2]
    segs = tiles.padded_segments(self.ops, tp, sp)
    seg_ops = [] if segs is None else list(segs)
    operands += seg_ops + tiles.Tiles(p, bq, bk).inputs(self.ops, segs, (rows, bq), True)
    n_in, n_sums = len(operands), len(self.logit_outs)

    def body(*refs):
      ins, outs, scoped = refs[:n_t], refs[n_in + n_sums : -1], refs[-1]
      seg_refs, fact_refs = refs[n_t : n_t + len(seg_ops)], refs[n_t + len(seg_ops) : n_in]
      sum_refs = dict(zip(self.logit_outs, refs[n_in : n_in + n_sums]))
      smem, own_full, ring_bars = scoped
      own_smem, stat_smem, ring_smem, row_smem, t_smem, out_smem, staging, *tail = smem
      seg_smem, *logit_smem = tail
      own_refs = dict(zip(own_names + stat_names, ins))
      streamed = iter(ins[len(own_refs) :])
      ring_gmem = dict(zip(ring_names, streamed))
      row_gmem = dict(zip(row_names, streamed))
      t_gmem = dict(zip(self.transposed, streamed))
      ring_refs, t_refs = dict(zip(ring_names, ring_smem)), dict(zip(self.transposed, t_smem))
      row_refs = dict(zip(row_names, row_smem))
      n, b = lax.axis_index("heads"), lax.axis_index("batch")
      n, out_cols = tiles.column_share(n, chunks, cols)
      kh, g = lax.div(n, jnp.int32(p.groups)), lax.rem(n, jnp.int32(p.groups))
      t_tile = tiles.query_tile_start(p, tp, rows)
      blocks = tiles.Tiles(p, bq, bk).at(fact_refs, b, (rows, bq))
      lo, hi = blocks.key_blocks(t_tile, rows)
      ring = mgpu.Ring(stages, lo, hi, *ring_bars)

      def _consumer(wg):
        t0 = t_tile + wg * bq
        mine = pl.ds(t0, bq)
        bufs = dict(zip(own_names + stat_names, (*own_smem, *stat_smem)))
        for name, ref in own_refs.items():
          at = (b, mine, kh, g) if name in own_names else (b, kh, g, mine)
          plgpu.copy_gmem_to_smem(ref.at[at], bufs[name].at[wg], own_full.at[wg])
        if seg_refs:  # the queries' segment ids
          plgpu.copy_gmem_to_smem(seg_refs[0].at[b, mine], seg_smem[0].at[wg], own_full.at[wg])
        plgpu.barrier_wait(own_full.at[wg])
        q_seg = form.vector(seg_smem[0].at[wg], 0) if seg_refs else None
        first_share = out_cols is None or out_cols.start == 0

        def write_tile(name, j, x):
          tile = logit_smem[self.logit_outs.index(name)].at[wg]

          def store():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read it
            tile[...] = x
            plgpu.commit_smem()
            form.store_to(tile, sum_refs[name], (b, kh, g, mine, pl.ds(j * bk, bk)))

          pl.when(first_share)(store)

        ctx = Step(
          self,
          wg,
          {name: bufs[name].at[wg] for name in own_names},
          {name: form.vector(bufs[name].at[wg], 0) for name in stat_names},
          ring_refs,
          t_refs,
          row_refs,
          staging,
          ring,
          cols=out_cols,
          write_tile=write_tile,
        )
        own = tiles.own_range(lo, hi, blocks.key_blocks(t0, bq))

        def skip(j, carry):
          ring.skip(j)
          return carry

        def run(j, carry, masked):
          ring.wait(0, j)

          def keep():
            ids = None if q_seg is None else (q_seg, form.vector(seg_smem[1].at[ring.slot(j)], 1))
            return blocks.keep_keys(form, t0, j, ids)

          hide = tiles.hiding(masked, keep)
          fields = dict(slot=ring.slot(j), masked=masked)
          # With segment ids above head dim 128 own tiles sit at an index read
          # in the step (``Form.opaque_zero``): their ``wgmma`` descriptors,
          # held across the loop, spilled (the dq kernel 48 bytes at 256). At
          # 128 and below they fit, and the read took 4-8 instructions a step.
          if seg_refs and head(p) > 128:
            zero = form.opaque_zero()
            fields["own"] = {name: bufs[name].at[wg + zero] for name in own_names}
          return step(dataclasses.replace(ctx, **fields), j, carry, hide)

        unmasked = blocks.unmasked_keys(t0, *own)
        carry = tiles.over_steps(lo, own, unmasked, hi, skip, run, init(ctx), self.one_loop)
        results = finish(ctx, carry)
        for buf, name in zip(out_smem, out_names):
          buf.at[wg][...] = results[name].astype(self.outs[name][0])
        plgpu.commit_smem()
        for buf, ref, (_, is_tile) in zip(out_smem, outs, self.outs.values()):
          if not is_tile:
            write = functools.partial(plgpu.copy_smem_to_gmem, buf.at[wg], ref.at[b, kh, g, mine])
            pl.when(out_cols is None or out_cols.start == 0)(write)
          else:
            at = (b, mine, kh, g) if out_cols is None else (b, mine, kh, g, out_cols)
            plgpu.copy_smem_to_gmem(buf.at[wg], ref.at[at])
        plgpu.wait_smem_to_gmem(0)

      def _producer():
        def copies(j, s):
          block = pl.ds(j * bk, bk)
          groups = []
          for name in ring_names:
            at = (
              (b, block, kh, out_cols)
              if name in self.shared and out_cols is not None
              else (b, block, kh)
            )
            group = [(ring_gmem[name].at[at], ring_refs[name].at[s])]
            if name in t_gmem:
              group.append((t_gmem[name].at[b, kh, :, block], t_refs[name].at[s]))
            groups.append(group)
          if seg_refs:  # the keys' segment ids, with the keys
            groups[0].append((seg_refs[1].at[b, block], seg_smem[1].at[s]))
          for name, ref in row_gmem.items():  # and the row tiles' of the block of threads
            tile = tiles.row_tile(ref, self.row_tiles[name], b, kh, g, pl.ds(t_tile, rows), block)
            groups[0].append((tile, row_refs[name].at[s]))
          return groups

        ring.produce(copies)

      # One copy for all consumers: as copies of their own (``Form.warpgroups``)
      # the dq kernel's two spilled 4-8 bytes at head dim 128 with a causal
      # mask, segment ids, a soft cap and GQA (compiled for H100).
      form.warpgroups(self.consumers, _consumer, _producer, copies=False)

    c = self.consumers
    scratch = [
      [
        [self._tile(c, bq, h) for _ in own_names],
        [plgpu.SMEM((c, bq), jnp.float32) for _ in stat_names],
        [self._ring_tile(name, h, cols) for name in ring_names],
        [tiles.bias_smem(x, (stages, rows, bk)) for x in self.row_tiles.values()],
        [] if form.hopper else [self._tile(stages, h, bk) for _ in self.transposed],
        [
          self._tile(c, bq, cols, dtype) if is_tile else plgpu.SMEM((c, bq), dtype)
          for dtype, is_tile in self.outs.values()
        ],
        form.staging((c, self.staged, bq, bk), p.dtype),
        tiles.segment_smem(segs, (c, bq), (stages, bk)),
        *[self._tile(c, bq, bk, jnp.float32) for _ in self.logit_outs],
      ],
      plgpu.Barrier(num_arrivals=len(own_names) + len(stat_names) + bool(segs), num_barriers=c),
      mgpu.Ring.barriers(
        [
          1 + (not form.hopper and n in self.transposed) + (i == 0) * (bool(segs) + len(row_names))
          for i, n in enumerate(ring_names)
        ],
        stages,
        c,
      ),
    ]
    heads = (p.kv_heads, p.groups)
    out_types = [
      jax.ShapeDtypeStruct((p.batch, tp, *heads, h) if is_tile else (p.batch, *heads, tp), dtype)
      for dtype, is_tile in self.outs.values()
    ]
    results = form.launch(
      body,
      operands,
      out_types,
      grid=(p.kv_heads * p.groups * chunks, tp // rows, p.batch),
      grid_names=("heads", "q", "batch"),
      scratch=scratch,
      name=self.name,
      approx_math=p.soft_cap is None,
      consumers=self.consumers,
      sums=[jax.ShapeDtypeStruct((p.batch, *heads, tp, sp), jnp.float32)] * n_sums,
    )
    outs = zip(results, self.outs.values())
    return [tiles.heads_first(x) if t else x for x, (_, t) in outs] + results[len(self.outs) :]
