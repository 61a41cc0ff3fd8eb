"""The attention kernels on Pallas-Triton (FlashAttention-2).

* forward and tangent: one program per (query block, query head, batch),
  looping over the key blocks the query block can see (``common.key_range``);
  GQA reads the kv head of the query head, K/V are never repeated;
* backward: a ``dq`` kernel of the same shape (it also writes the bias
  gradient) and a ``dk, dv`` kernel, one program per (key block, query head,
  batch) looping over the query blocks that see the key block
  (``common.query_range``); with GQA its per-query-head partials are summed
  over each kv head's query heads afterwards.

With segment ids, each program reads its block's row of the segment tables
(``common.segment_tables``: min/max id and the run of blocks it meets) and the
other side's whole table, loops over that run only and skips (``lax.cond``)
blocks inside it whose segment ranges do not meet.

Blocks are powers of two; head dims are padded to one (80 -> 128) and every
load and store along a dim its block overhangs is masked by hand (Pallas-Triton
does not bound-check). The key-side (or, in the dk/dv kernel, query-side)
operand is one block spanning the whole sequence, sliced per step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Call, Problem, block_dot
from pallax.kernels.attention.config import AttentionConfig
from pallax.op.signature import Named
from pallax.pallas_triton import padded_ok, tile_mask, triton_call
from pallax.pallas_utils import and_masks, load, next_pow2, store


@dataclasses.dataclass(frozen=True)
class _Layout(common.Blocks):
  """Blocks of a call and the BlockSpecs of each operand role."""

  def width(self, x: int) -> int:
    return next_pow2(max(x, 16))

  def cols_ok(self, x: int) -> Optional[jax.Array]:
    """Which columns of a dim of ``x`` padded to ``width(x)`` exist (None: all)."""
    return padded_ok(self.width(x), x)

  def rows(self, x: int, per_block: bool):
    """A (B, K, G, T, x) operand: a query block, or all queries (``per_block=False``)."""
    rows = self.bq if per_block else self.nq * self.bq

    def index(i, n, b):
      return (b, *self.heads(n), self.query_block(i) if per_block else 0, 0)

    return pl.BlockSpec((None, None, None, rows, self.width(x)), index)

  def row_stats(self, per_block: bool):
    """A (B, K, G, T) operand (lse, delta)."""
    rows = self.bq if per_block else self.nq * self.bq
    return pl.BlockSpec(
      (None, None, None, rows),
      lambda i, n, b: (b, *self.heads(n), self.query_block(i) if per_block else 0),
    )

  def keys(self, x: int, per_block: bool):
    """A (B, K, S, x) operand: a key block, or all keys."""
    rows = self.bk if per_block else self.nk * self.bk
    return pl.BlockSpec(
      (None, None, rows, self.width(x)),
      lambda i, n, b: (b, self.heads(n)[0], i if per_block else 0, 0),
    )

  def _program_block(self, query_side: bool):
    """``i ->`` the block of the grid's side (queries or keys) that grid index ``i`` computes."""
    return self.query_block if query_side else lambda i: i

  def length(self):
    return pl.BlockSpec((1,), lambda i, n, b: (b,))

  def segments(self, query_side: bool, per_block: bool):
    """A (B, T) or (B, S) segment-id operand: the program's block, or the whole row."""
    rows = self.bq if query_side else self.bk
    if not per_block:
      rows *= self.nq if query_side else self.nk
    block = self._program_block(query_side)
    return pl.BlockSpec((None, rows), lambda i, n, b: (b, block(i) if per_block else 0))

  def table(self, query_side: bool, per_block: bool):
    """A (B, blocks, 4) segment table: the program's block's row, or the whole table."""
    if per_block:
      block = self._program_block(query_side)
      return pl.BlockSpec((None, None, 4), lambda i, n, b: (b, block(i), 0))
    rows = self.nq if query_side else self.nk
    return pl.BlockSpec((None, rows, 4), lambda i, n, b: (b, 0, 0))

  def tile(self, aval, query_blocks: bool):
    """A bias-like (Bb, Kb, Gb, T, S) operand: a query block's rows or a key block's columns."""
    shape = (self.bq, self.nk * self.bk) if query_blocks else (self.nq * self.bq, self.bk)

    def index(i, n, b):
      lead = common.extra_lead(aval, b, *self.heads(n))
      return (*lead, self.query_block(i), 0) if query_blocks else (*lead, 0, i)

    return pl.BlockSpec((None, None, None, *shape), index)


def _positions(start, size: int, extent: int):
  """Positions of a block and which are inside the array (None: all)."""
  pos = start + lax.broadcasted_iota(jnp.int32, (size,), 0)
  return pos, (None if extent % size == 0 else pos < extent)


class _Refs:
  """A kernel's refs by name (``_call``: ``r.q``, ``r.out``, ...), and the lengths as scalars.

  With segments: ``own_seg``/``other_seg`` the segment ids of the program's
  block and of the whole other side, ``own_tab``/``other_tab`` their tables.
  """

  def __init__(self, p: Problem, refs: Named):
    self.refs = refs
    self.lens = (refs.q_len[0], refs.kv_len[0]) if p.has_lengths else (None, None)

  def __getattr__(self, name: str):
    if name == "refs":  # not set yet
      raise AttributeError(name)
    return getattr(self.refs, name)

  def run(self):
    """``[lo, hi)`` of the other side's blocks the program's segments meet (None: all)."""
    if self.own_tab is None:
      return None
    return self.own_tab[common.SEG_LO], self.own_tab[common.SEG_HI]

  def meets(self, j):
    """Whether the other side's block ``j`` meets the program's segments (None: yes)."""
    if self.own_tab is None:
      return None
    own = (self.own_tab[common.SEG_MIN], self.own_tab[common.SEG_MAX])
    return common.segments_meet(
      *own, self.other_tab[j, common.SEG_MIN], self.other_tab[j, common.SEG_MAX]
    )


def _keep(p: Problem, t_pos, s_pos, s_ok, lens, mask_blk, segs=(None, None)):
  q_seg, kv_seg = (None, None) if segs[0] is None else (segs[0][:, None], segs[1][None, :])
  keep = common.visible(p, t_pos[:, None], s_pos[None, :], *lens, q_seg, kv_seg)
  return and_masks(keep, None if s_ok is None else s_ok[None, :], mask_blk)


def _skipping(r: _Refs, body, skipped=None):
  """``body(j, carry)`` run only where block ``j``'s segments meet; else ``skipped(j)``."""

  def run(j, carry):
    meets = r.meets(j)
    if meets is None:
      return body(j, carry)

    def skip(carry):
      if skipped is not None:
        skipped(j)
      return carry

    return lax.cond(meets, lambda c: body(j, c), skip, carry)

  return run


def _tile(ref, ok):
  return None if ref is None else load(ref, ok)


def _over_key_blocks(lay: _Layout, r: _Refs, step, init, extra_loads=(), skipped=None):
  """The query-block programs' loop: ``step(carry, s, g, q, k, v, tile_ok, s0, *extra)``.

  Per visible key block: ``s`` are the block's masked, scaled, biased logits,
  ``g`` the soft cap's derivative; ``extra_loads`` are more key-side refs
  (tangents of k and v) loaded per block like ``v``; ``skipped(j)`` runs for
  the blocks in the loop's range whose segments do not meet.
  """
  p = lay.p
  t0 = lay.query_start(pl.program_id(0))
  t_pos, t_ok = _positions(t0, lay.bq, p.t)
  h_ok, hv_ok = lay.cols_ok(p.head_dim), lay.cols_ok(p.value_dim)
  q = load(r.q, tile_mask(t_ok, h_ok))
  q_seg = load(r.own_seg, t_ok) if p.has_segments else None

  def body(j, carry):
    s0 = j * lay.bk
    s_pos, s_ok = _positions(s0, lay.bk, p.s)
    cut = lambda ref: ref.at[pl.ds(s0, lay.bk), :]
    k = load(cut(r.k), tile_mask(s_ok, h_ok))
    v = load(cut(r.v), tile_mask(s_ok, hv_ok))
    ok = tile_mask(t_ok, s_ok)
    cols = lambda ref: None if ref is None else ref.at[:, pl.ds(s0, lay.bk)]
    mask = _tile(cols(r.mask), ok)
    segs = (q_seg, load(r.other_seg.at[pl.ds(s0, lay.bk)], s_ok)) if p.has_segments else (None,) * 2
    keep = _keep(p, t_pos, s_pos, s_ok, r.lens, None if mask is None else mask != 0, segs)
    s, g = common.scores(p, block_dot, q, k, _tile(cols(r.bias), ok), keep, cap_grad=True)
    extra = [
      load(cut(ref), tile_mask(s_ok, h_ok if i == 0 else hv_ok))
      for i, ref in enumerate(extra_loads)
    ]
    return step(carry, s, g, q, k, v, ok, s0, *extra)

  lo, hi = common.key_range(p, t0, lay.bq, lay.bk, *r.lens, r.run())
  loop = lax.fori_loop(lo, hi, _skipping(r, body, skipped), init)
  return loop, (t_ok, h_ok, hv_ok), (lo, hi)


# The refs a kernel may lack: the op's optional inputs, the segment ids and
# tables, the bias' tangent and the logits' gradient.
_OPTIONAL = ("bias", "mask", "own_seg", "other_seg", "own_tab", "other_tab", "bias_dot", "ds")


def _inputs(lay: _Layout, ops: Named, query_blocks: bool) -> common.Bound:
  """The inputs every kernel reads by name, each with its BlockSpec.

  The mask travels as int8 (bool refs are not portable); segment ids as the
  program's side per block and the other whole, with their tables.
  """
  p = lay.p
  ins = {
    "q": (ops.q, lay.rows(p.head_dim, query_blocks)),
    "k": (ops.k, lay.keys(p.head_dim, not query_blocks)),
    "v": (ops.v, lay.keys(p.value_dim, not query_blocks)),
    "q_len": (ops.q_len, lay.length()),
    "kv_len": (ops.kv_len, lay.length()),
  }
  if ops.bias is not None:
    ins["bias"] = (ops.bias, lay.tile(ops.bias, query_blocks))
  if ops.mask is not None:
    ins["mask"] = (ops.mask.astype(jnp.int8), lay.tile(ops.mask, query_blocks))
  if p.has_segments:
    q_tab, k_tab = common.segment_tables(ops.q_seg, ops.kv_seg, lay.bq, lay.bk)
    q_side, k_side = (ops.q_seg, q_tab), (ops.kv_seg, k_tab)
    own, other = (q_side, k_side) if query_blocks else (k_side, q_side)
    ins["own_seg"] = (own[0], lay.segments(query_blocks, True))
    ins["other_seg"] = (other[0], lay.segments(not query_blocks, False))
    ins["own_tab"] = (own[1], lay.table(query_blocks, True))
    ins["other_tab"] = (other[1], lay.table(not query_blocks, False))
  return ins


def _call(
  kernel: Callable[[_Refs], None],
  lay: _Layout,
  blocks: int,
  ins: common.Bound,
  outs: common.Bound,
  config: AttentionConfig,
  interpret: Any,
  name: str,
) -> dict[str, jax.Array]:
  """``triton_call`` of ``kernel`` over ``blocks`` blocks, its refs and results by name.

  ``kernel`` takes the ``_Refs`` of ``ins`` and ``outs``.
  """
  body = common.by_name(lambda refs: kernel(_Refs(lay.p, refs)), (*ins, *outs), _OPTIONAL)
  args = (*common.unzip(ins), *common.unzip(outs))  # inputs, their specs, out shapes, specs
  results = triton_call(body, lay.grid(blocks), *args, config, interpret, name)
  return dict(zip(outs, results, strict=True))


def _setup(stage: str, operands, config: AttentionConfig, params) -> tuple[Call, _Layout]:
  c = Call.of(stage, operands, params)
  bq = min(config.block_q, next_pow2(max(c.p.t, 16)))
  bk = min(config.block_k, next_pow2(max(c.p.s, 16)))
  return c, _Layout(c.p, bq, bk)


def _row_shape(p: Problem, x: int, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.t, x), dtype)


def _stat_shape(p: Problem) -> jax.ShapeDtypeStruct:
  """A (B, K, G, T) statistic (lse and its tangent)."""
  return jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.t), p.stat)


def fwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out, lse)``."""
  c, lay = _setup("fwd", operands, config, params)
  p = c.p

  def kernel(r: _Refs):
    carry, (t_ok, _, hv_ok), _ = _over_key_blocks(
      lay,
      r,
      lambda c, s, g, q, k, v, *_: common.online_step(c, s, v, block_dot),
      common.online_init(p, (lay.bq,), lay.width(p.value_dim)),
    )
    out, lse = common.online_finish(carry)
    store(r.out, out.astype(r.out.dtype), tile_mask(t_ok, hv_ok))
    store(r.lse, lse[:, 0], t_ok)

  outs = {
    "out": (_row_shape(p, p.value_dim, p.dtype), lay.rows(p.value_dim, True)),
    "lse": (_stat_shape(p), lay.row_stats(True)),
  }
  ins = _inputs(lay, c.ops, True)
  return c.results(_call(kernel, lay, lay.nq, ins, outs, config, interpret, "attention_fwd"))


def jvp(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out_dot, lse_dot)``: the tangents, one pass over the visible key blocks."""
  c, lay = _setup("jvp", operands, config, params)
  p, ops = c.p, c.ops
  st = p.stat

  def kernel(r: _Refs):
    t0 = lay.query_start(pl.program_id(0))
    _, t_ok = _positions(t0, lay.bq, p.t)
    h_ok = lay.cols_ok(p.head_dim)
    lse_blk = load(r.lse, t_ok, other=NEG_INF)[:, None]
    dq_blk = load(r.q_dot, tile_mask(t_ok, h_ok))

    def step(carry, s, g, q, k, v, ok, s0, dk_blk, dv_blk):
      bias_dot = r.bias_dot
      db = None if bias_dot is None else load(bias_dot.at[:, pl.ds(s0, lay.bk)], ok)
      blk = (q, k, v, s, lse_blk, dq_blk, dk_blk, dv_blk, db, g)
      terms = common.tangent_block(p, block_dot, *blk)
      return tuple(a + b for a, b in zip(carry, terms))

    init = (
      jnp.zeros((lay.bq, lay.width(p.value_dim)), st),
      jnp.zeros((lay.bq, 1), st),
      jnp.zeros((lay.bq, lay.width(p.value_dim)), st),
    )
    tangents = (r.k_dot, r.v_dot)
    (pdsv, rows, pdv), (t_ok, _, hv_ok), _ = _over_key_blocks(lay, r, step, init, tangents)
    mask = tile_mask(t_ok, hv_ok)
    dout = pdsv - rows * load(r.out, mask).astype(st) + pdv
    store(r.out_dot, dout.astype(r.out_dot.dtype), mask)
    store(r.lse_dot, rows[:, 0], t_ok)

  ins = _inputs(lay, ops, True)
  ins["out"] = (ops.out, lay.rows(p.value_dim, True))
  ins["lse"] = (ops.lse, lay.row_stats(True))
  ins["q_dot"] = (ops.q_dot, lay.rows(p.head_dim, True))
  ins["k_dot"] = (ops.k_dot, lay.keys(p.head_dim, False))
  ins["v_dot"] = (ops.v_dot, lay.keys(p.value_dim, False))
  if ops.bias_dot is not None:
    ins["bias_dot"] = (ops.bias_dot, lay.tile(ops.bias_dot, True))
  outs = {
    "out_dot": (_row_shape(p, p.value_dim, p.dtype), lay.rows(p.value_dim, True)),
    "lse_dot": (_stat_shape(p), lay.row_stats(True)),
  }
  return c.results(_call(kernel, lay, lay.nq, ins, outs, config, interpret, "attention_jvp"))


def _bwd_call(kernel, lay: _Layout, ops, query_blocks: bool, stats, outs, config, interpret, name):
  """``_call`` of a backward kernel over query blocks (dq) or key blocks (dk, dv).

  Its own operands are ``stats``: ``(lse, delta, dout)``, whole or per query
  block; ``outs``: its outputs' shapes and BlockSpecs by name.
  """
  p = lay.p
  lse, delta, dout = stats
  ins = _inputs(lay, ops, query_blocks)
  ins["lse"] = (lse, lay.row_stats(query_blocks))
  ins["delta"] = (delta, lay.row_stats(query_blocks))
  ins["dout"] = (dout, lay.rows(p.value_dim, query_blocks))
  blocks = lay.nq if query_blocks else lay.nk
  return _call(kernel, lay, blocks, ins, outs, config, interpret, name)


def _dq(c: Call, lay: _Layout, config, interpret, *stats) -> dict[str, jax.Array]:
  """``dq`` and, with a differentiated bias, ``ds``, the logits' gradient: per query block."""
  p = c.p
  st = p.stat

  def kernel(r: _Refs):
    ds_ref = r.ds
    t0 = lay.query_start(pl.program_id(0))
    _, t_ok = _positions(t0, lay.bq, p.t)
    hv_ok = lay.cols_ok(p.value_dim)
    lse_blk = load(r.lse, t_ok, other=NEG_INF)[:, None]
    delta_blk = load(r.delta, t_ok)[:, None]
    do_blk = load(r.dout, tile_mask(t_ok, hv_ok))

    def step(acc, s, g, q, k, v, ok, s0):
      _, ds = common.bwd_probs(p, block_dot, v, do_blk, s, lse_blk, delta_blk)
      if ds_ref is not None:
        store(ds_ref.at[:, pl.ds(s0, lay.bk)], ds.astype(ds_ref.dtype), ok)
      return acc + common.bwd_dq(p, block_dot, ds, k, g)

    def clear(j):  # a key block the loop skips has a zero bias gradient
      _, s_ok = _positions(j * lay.bk, lay.bk, p.s)
      zeros = jnp.zeros((lay.bq, lay.bk), ds_ref.dtype)
      store(ds_ref.at[:, pl.ds(j * lay.bk, lay.bk)], zeros, tile_mask(t_ok, s_ok))

    init = jnp.zeros((lay.bq, lay.width(p.head_dim)), st)
    skipped = None if ds_ref is None else clear
    acc, (t_ok, h_ok, _), (lo, hi) = _over_key_blocks(lay, r, step, init, skipped=skipped)
    store(r.dq, acc.astype(r.dq.dtype), tile_mask(t_ok, h_ok))
    if ds_ref is not None:
      clearing = lambda j, carry: clear(j) or carry
      lax.fori_loop(0, lo, clearing, 0)
      lax.fori_loop(hi, lay.nk, clearing, 0)

  outs = {"dq": (_row_shape(p, p.head_dim, p.dtype), lay.rows(p.head_dim, True))}
  if p.differentiates_bias:
    ds = jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.t, p.s), st)
    outs["ds"] = (ds, lay.tile(ds, True))
  return _bwd_call(kernel, lay, c.ops, True, stats, outs, config, interpret, "attention_bwd_dq")


def _dkdv(c: Call, lay: _Layout, config, interpret, *stats) -> dict[str, jax.Array]:
  """``dk, dv`` per query head (summed over a kv head's query heads by ``common.backward``)."""
  p = c.p
  st = p.stat
  out_dtype = p.dtype if p.groups == 1 else st

  def kernel(r: _Refs):
    s0 = pl.program_id(0) * lay.bk
    s_pos, s_ok = _positions(s0, lay.bk, p.s)
    h_ok, hv_ok = lay.cols_ok(p.head_dim), lay.cols_ok(p.value_dim)
    k = load(r.k, tile_mask(s_ok, h_ok))
    v = load(r.v, tile_mask(s_ok, hv_ok))
    kv_seg = load(r.own_seg, s_ok) if p.has_segments else None

    def body(i, carry):
      t0 = i * lay.bq
      t_pos, t_ok = _positions(t0, lay.bq, p.t)
      rows = lambda ref: ref.at[pl.ds(t0, lay.bq)]
      q = load(r.q.at[pl.ds(t0, lay.bq), :], tile_mask(t_ok, h_ok))
      do_blk = load(r.dout.at[pl.ds(t0, lay.bq), :], tile_mask(t_ok, hv_ok))
      ok = tile_mask(t_ok, s_ok)
      tile = lambda ref: None if ref is None else load(ref.at[pl.ds(t0, lay.bq), :], ok)
      mask = tile(r.mask)
      segs = (
        (load(r.other_seg.at[pl.ds(t0, lay.bq)], t_ok), kv_seg) if p.has_segments else (None,) * 2
      )
      keep = _keep(p, t_pos, s_pos, s_ok, r.lens, None if mask is None else mask != 0, segs)
      s, g = common.scores(p, block_dot, q, k, tile(r.bias), keep, cap_grad=True)
      pr, ds = common.bwd_probs(
        p,
        block_dot,
        v,
        do_blk,
        s,
        load(rows(r.lse), t_ok, other=NEG_INF)[:, None],
        load(rows(r.delta), t_ok)[:, None],
      )
      dk, dv = common.bwd_dkdv(p, block_dot, pr, ds, q, do_blk, g)
      return carry[0] + dk, carry[1] + dv

    lo, hi = common.query_range(p, s0, lay.bq, lay.bk, *r.lens, r.run())
    init = (
      jnp.zeros((lay.bk, lay.width(p.head_dim)), st),
      jnp.zeros((lay.bk, lay.width(p.value_dim)), st),
    )
    dk, dv = lax.fori_loop(lo, hi, _skipping(r, body), init)
    store(r.dk, dk.astype(r.dk.dtype), tile_mask(s_ok, h_ok))
    store(r.dv, dv.astype(r.dv.dtype), tile_mask(s_ok, hv_ok))

  def per_head(x):
    return pl.BlockSpec(
      (None, None, None, lay.bk, lay.width(x)), lambda j, n, b: (b, *lay.heads(n), j, 0)
    )

  shape = lambda x: jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.s, x), out_dtype)
  outs = {n: (shape(x), per_head(x)) for n, x in (("dk", p.head_dim), ("dv", p.value_dim))}
  name = "attention_bwd_dkdv"
  return _bwd_call(kernel, lay, c.ops, False, stats, outs, config, interpret, name)


def bwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(dq, dk, dv[, dbias])``: the dq kernel and the dk/dv kernel."""
  c, lay = _setup("bwd", operands, config, params)
  passes = (functools.partial(f, c, lay, config, interpret) for f in (_dq, _dkdv))
  return common.backward(c, *passes)
