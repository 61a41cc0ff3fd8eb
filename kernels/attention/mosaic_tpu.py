"""The attention kernels on Pallas-Mosaic TPU.

Grids put the reduction last and sequential ("arbitrary"), with float32
accumulators in VMEM scratch:

* forward, tangent and the backward's ``dq`` kernel: ``(B, N, query blocks,
  key blocks)``;
* the backward's ``dk, dv`` kernel: ``(B, N, key blocks, query blocks)``, per
  query head (GQA partials are summed afterwards).

The lengths (and, with segment ids, the flattened ``common.segment_tables``)
are prefetched scalars; the index maps clamp the reduction index into the
range of blocks a block can see (``common.key_range`` / ``query_range``), so a
skipped step fetches nothing new, and ``pl.when`` skips its compute, also for
blocks inside the range whose segment ranges do not meet. Edge blocks are
padded by Mosaic with undefined values: they are hidden by position and zeroed
before every product that sums over them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Call, block_dot
from pallax.kernels.attention.config import AttentionConfig
from pallax.op.signature import Named


@dataclasses.dataclass(frozen=True)
class _Grid(common.Blocks):
  """One kernel's grid ``(B, N, outer, inner)`` and the BlockSpecs of its operands.

  ``query_major``: the outer axis walks query blocks and the inner one the key
  blocks they see (forward, tangent, dq); otherwise the reverse (dk, dv).
  """

  query_major: bool

  @property
  def shape(self) -> tuple[int, ...]:
    p = self.p
    blocks = (self.nq, self.nk) if self.query_major else (self.nk, self.nq)
    return (p.batch, p.kv_heads * p.groups, *blocks)

  def entry(self, tabs, query_side: bool, b, block, column: int):
    """An entry of a flattened (B, blocks, 4) segment table among the prefetched ``tabs``."""
    n = self.nq if query_side else self.nk
    return tabs[0 if query_side else 1][(b * n + block) * 4 + column]

  def range(self, b, outer, q_len_ref, kv_len_ref, *tabs):
    """``[lo, hi)`` of the inner blocks the outer block ``outer`` meets."""
    lens = (q_len_ref[b], kv_len_ref[b]) if self.p.has_lengths else (None, None)
    seg = None
    if tabs:
      cols = (common.SEG_LO, common.SEG_HI)
      seg = tuple(self.entry(tabs, self.query_major, b, outer, c) for c in cols)
    if self.query_major:
      return common.key_range(self.p, outer * self.bq, self.bq, self.bk, *lens, seg)
    return common.query_range(self.p, outer * self.bk, self.bq, self.bk, *lens, seg)

  def meets(self, b, i, j, tabs):
    """Whether query block ``i`` and key block ``j`` have segments that meet."""
    cols = (common.SEG_MIN, common.SEG_MAX)
    q_bounds = (self.entry(tabs, True, b, i, c) for c in cols)
    k_bounds = (self.entry(tabs, False, b, j, c) for c in cols)
    return common.segments_meet(*q_bounds, *k_bounds)

  def _blocks(self, b, outer, inner, *prefetch):
    """(query block, key block) of a step; the inner one clamped into the visible range."""
    lo, hi = self.range(b, outer, *prefetch)
    inner = jnp.clip(inner, lo, jnp.maximum(hi - 1, lo))
    return (outer, inner) if self.query_major else (inner, outer)

  def query_side(self, width):
    """A (B, K, G, T, width) operand's block (width 1: row statistics)."""

    def index(b, n, outer, inner, *lens):
      i, _ = self._blocks(b, outer, inner, *lens)
      return (b, *self.heads(n), i, 0)

    return pl.BlockSpec((None, None, None, self.bq, width), index)

  def key_side(self, width):
    """A (B, K, S, width) operand's block."""

    def index(b, n, outer, inner, *lens):
      _, j = self._blocks(b, outer, inner, *lens)
      return (b, self.heads(n)[0], j, 0)

    return pl.BlockSpec((None, None, self.bk, width), index)

  def tile(self, aval, clamp: bool = True):
    """A bias-like (Bb, Kb, Gb, T, S) operand's (block_q, block_k) tile."""

    def index(b, n, outer, inner, *lens):
      if clamp:
        i, j = self._blocks(b, outer, inner, *lens)
      else:
        i, j = (outer, inner) if self.query_major else (inner, outer)
      return (*common.extra_lead(aval, b, *self.heads(n)), i, j)

    return pl.BlockSpec((None, None, None, self.bq, self.bk), index)

  def segments(self, query_side: bool):
    """Segment ids: ``(B, T, 1)`` query blocks (columns) or ``(B, 1, S)`` key blocks (rows)."""

    def index(b, n, outer, inner, *prefetch):
      i, j = self._blocks(b, outer, inner, *prefetch)
      return (b, i, 0) if query_side else (b, 0, j)

    return pl.BlockSpec((None, self.bq, 1) if query_side else (None, 1, self.bk), index)

  def per_head_keys(self, width):
    """A (B, K, G, S, width) result of the dk/dv kernel."""
    return pl.BlockSpec(
      (None, None, None, self.bk, width),
      lambda b, n, outer, inner, *lens: (b, *self.heads(n), outer, 0),
    )


class _Step:
  """What a grid step sees: its refs, its blocks' positions, and whether it runs.

  Refs by name as ``_pallas`` binds them: ``st.q``, ``st.out``, ``st.dq_acc``.
  """

  def __init__(self, grid: _Grid, refs: Named):
    p = self.p = grid.p
    self.grid, self.refs = grid, refs
    tabs = (refs.q_tab, refs.k_tab) if p.has_segments else ()
    prefetch = (refs.q_len, refs.kv_len, *tabs)
    self.segs = (refs.q_seg, refs.kv_seg) if p.has_segments else None
    b, outer, inner = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    self.lens = (refs.q_len[b], refs.kv_len[b]) if p.has_lengths else (None, None)
    lo, hi = grid.range(b, outer, *prefetch)
    self.first, self.last = inner == 0, inner == pl.num_programs(3) - 1
    self.runs = (inner >= lo) & (inner < hi)
    i, j = (outer, inner) if grid.query_major else (inner, outer)
    if tabs:
      self.runs = self.runs & grid.meets(b, i, j, tabs)
    self.t0, self.s0 = i * grid.bq, j * grid.bk
    tile = (grid.bq, grid.bk)
    self.t_pos = self.t0 + lax.broadcasted_iota(jnp.int32, tile, 0)
    self.s_pos = self.s0 + lax.broadcasted_iota(jnp.int32, tile, 1)
    self.t_ok = self.t0 + lax.broadcasted_iota(jnp.int32, (grid.bq, 1), 0) < p.t
    self.s_ok = self.s0 + lax.broadcasted_iota(jnp.int32, (grid.bk, 1), 0) < p.s

  def __getattr__(self, name: str):
    if name == "refs":  # not set yet
      raise AttributeError(name)
    return getattr(self.refs, name)

  def rows(self, ref, ok):
    """A block with its padded rows zeroed (they hold undefined values)."""
    return jnp.where(ok, ref[...], 0)

  def scores(self, q, k):
    """The block's logits and the soft cap's derivative (``common.scores``)."""
    p = self.p
    segs = (None, None) if self.segs is None else (self.segs[0][...], self.segs[1][...])
    keep = common.visible(p, self.t_pos, self.s_pos, *self.lens, *segs)
    keep = (self.s_pos < p.s) & (self.t_pos < p.t) & (True if keep is None else keep)
    if self.mask is not None:
      keep = keep & (self.mask[...] != 0)
    bias = None if self.bias is None else self.bias[...]
    return common.scores(p, block_dot, q, k, bias, keep, cap_grad=True)


# The refs a kernel may lack: the op's optional inputs, the segment ids and
# tables, the bias' tangent and the logits' gradient.
_OPTIONAL = ("bias", "mask", "q_seg", "kv_seg", "q_tab", "k_tab", "bias_dot", "ds")


def _pallas(
  kernel: Callable[[_Step], None],
  grid: _Grid,
  ops: Named,
  own: common.Bound,
  outs: common.Bound,
  scratch: dict[str, Any],
  interpret: Any,
  name: str,
) -> dict[str, jax.Array]:
  """``pallas_call`` of ``kernel`` over ``grid``, its refs and results by name.

  Every kernel reads the inputs (the lengths and, with segments, the
  flattened segment tables ``q_tab``, ``k_tab`` prefetched; the mask as int8;
  segment ids as ``(B, T, 1)`` and ``(B, 1, S)``); ``own``: the stage's own
  operands with their BlockSpecs; ``outs``: per output its shape and
  BlockSpec; ``scratch``: per scratch buffer its shape. ``kernel`` takes the
  ``_Step`` of them all.
  """
  p = grid.p
  prefetch = {"q_len": ops.q_len, "kv_len": ops.kv_len}
  ins = {
    "q": (ops.q, grid.query_side(p.head_dim)),
    "k": (ops.k, grid.key_side(p.head_dim)),
    "v": (ops.v, grid.key_side(p.value_dim)),
  }
  if ops.bias is not None:
    ins["bias"] = (ops.bias, grid.tile(ops.bias))
  if ops.mask is not None:
    ins["mask"] = (ops.mask.astype(jnp.int8), grid.tile(ops.mask))
  if p.has_segments:
    q_tab, k_tab = common.segment_tables(ops.q_seg, ops.kv_seg, grid.bq, grid.bk)
    prefetch["q_tab"], prefetch["k_tab"] = q_tab.reshape(-1), k_tab.reshape(-1)
    ins["q_seg"] = (ops.q_seg[:, :, None], grid.segments(True))
    ins["kv_seg"] = (ops.kv_seg[:, None, :], grid.segments(False))
  ins.update(own)
  names = (*prefetch, *ins, *outs, *scratch)
  body = common.by_name(lambda refs: kernel(_Step(grid, refs)), names, _OPTIONAL)
  (arrays, in_specs), (out_shapes, out_specs) = common.unzip(ins), common.unzip(outs)
  results = pl.pallas_call(
    body,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=grid.shape,
      in_specs=in_specs,
      out_specs=out_specs,
      scratch_shapes=list(scratch.values()),
    ),
    out_shape=out_shapes,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name=name,
  )(*prefetch.values(), *arrays)
  return dict(zip(outs, results, strict=True))


def _setup(stage: str, operands, config: AttentionConfig, params) -> tuple[Call, _Grid]:
  c = Call.of(stage, operands, params)
  return c, _Grid(c.p, min(config.block_q, c.p.t), min(config.block_k, c.p.s), True)


def _stats(x):
  """A (B, K, G, T) statistic as (B, K, G, T, 1): its blocks are (block_q, 1) columns."""
  return x[..., None]


def _accumulate(step: _Step, scratch: Sequence[str], init, update, finish):
  """The reduction over the inner axis, carried in the ``scratch`` refs (names).

  ``init`` at its first step, ``update`` where it runs, ``finish`` at its last.
  """
  refs = [step.refs[n] for n in scratch]

  @pl.when(step.first)
  def _():
    for ref, value in zip(refs, init):
      ref[...] = value

  @pl.when(step.runs)
  def _():
    values = update(tuple(ref[...] for ref in refs))
    for ref, value in zip(refs, values):
      ref[...] = value

  @pl.when(step.last)
  def _():
    finish(tuple(ref[...] for ref in refs))


def fwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out, lse)``."""
  c, grid = _setup("fwd", operands, config, params)
  p = c.p
  scratch = {
    "m": pltpu.VMEM((grid.bq, 1), p.stat),
    "denom": pltpu.VMEM((grid.bq, 1), p.stat),
    "acc": pltpu.VMEM((grid.bq, p.value_dim), p.stat),
  }

  def kernel(st: _Step):
    def update(carry):
      v = st.rows(st.v, st.s_ok)
      s, _ = st.scores(st.q[...], st.k[...])
      return common.online_step(carry, s, v, block_dot)

    def finish(carry):
      out, lse = common.online_finish(carry)
      st.out[...] = out.astype(st.out.dtype)
      st.lse[...] = lse

    _accumulate(st, scratch, common.online_init(p, (grid.bq,), p.value_dim), update, finish)

  rows = (p.batch, p.kv_heads, p.groups, p.t)
  outs = {
    "out": (jax.ShapeDtypeStruct((*rows, p.value_dim), p.dtype), grid.query_side(p.value_dim)),
    "lse": (jax.ShapeDtypeStruct((*rows, 1), p.stat), grid.query_side(1)),
  }
  res = _pallas(kernel, grid, c.ops, {}, outs, scratch, interpret, "attention_fwd")
  return c.results({"out": res["out"], "lse": res["lse"][..., 0]})


def jvp(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out_dot, lse_dot)``."""
  c, grid = _setup("jvp", operands, config, params)
  p, ops = c.p, c.ops
  st_dtype = p.stat
  scratch = {
    "pdsv": pltpu.VMEM((grid.bq, p.value_dim), st_dtype),
    "rows": pltpu.VMEM((grid.bq, 1), st_dtype),
    "pdv": pltpu.VMEM((grid.bq, p.value_dim), st_dtype),
  }

  def kernel(st: _Step):
    def update(carry):
      k, v, dk_blk, dv_blk = (st.rows(r, st.s_ok) for r in (st.k, st.v, st.k_dot, st.v_dot))
      db = None if st.bias_dot is None else st.bias_dot[...]
      q = st.q[...]
      s, g = st.scores(q, k)
      blk = (q, k, v, s, st.lse[...], st.q_dot[...], dk_blk, dv_blk, db, g)
      terms = common.tangent_block(p, block_dot, *blk)
      return tuple(a + b for a, b in zip(carry, terms))

    def finish(carry):
      pdsv, rows, pdv = carry
      dout = pdsv - rows * st.out[...].astype(st_dtype) + pdv
      st.out_dot[...] = dout.astype(st.out_dot.dtype)
      st.lse_dot[...] = rows

    init = (
      jnp.zeros((grid.bq, p.value_dim), st_dtype),
      jnp.zeros((grid.bq, 1), st_dtype),
      jnp.zeros((grid.bq, p.value_dim), st_dtype),
    )
    _accumulate(st, scratch, init, update, finish)

  own = {
    "out": (ops.out, grid.query_side(p.value_dim)),
    "lse": (_stats(ops.lse), grid.query_side(1)),
    "q_dot": (ops.q_dot, grid.query_side(p.head_dim)),
    "k_dot": (ops.k_dot, grid.key_side(p.head_dim)),
    "v_dot": (ops.v_dot, grid.key_side(p.value_dim)),
  }
  if ops.bias_dot is not None:
    own["bias_dot"] = (ops.bias_dot, grid.tile(ops.bias_dot))
  rows = (p.batch, p.kv_heads, p.groups, p.t)
  outs = {
    "out_dot": (jax.ShapeDtypeStruct((*rows, p.value_dim), p.dtype), grid.query_side(p.value_dim)),
    "lse_dot": (jax.ShapeDtypeStruct((*rows, 1), st_dtype), grid.query_side(1)),
  }
  res = _pallas(kernel, grid, ops, own, outs, scratch, interpret, "attention_jvp")
  return c.results({"out_dot": res["out_dot"], "lse_dot": res["lse_dot"][..., 0]})


def _bwd_pallas(kernel, grid: _Grid, ops, stats, outs, scratch, interpret, name):
  """``_pallas`` of a backward kernel, whose own operands are ``stats``: ``(lse, delta, dout)``."""
  lse, delta, dout = stats
  own = {
    "lse": (_stats(lse), grid.query_side(1)),
    "delta": (_stats(delta), grid.query_side(1)),
    "dout": (dout, grid.query_side(grid.p.value_dim)),
  }
  return _pallas(kernel, grid, ops, own, outs, scratch, interpret, name)


def _dq(c: Call, grid: _Grid, interpret, *stats) -> dict[str, jax.Array]:
  """``dq`` and, with a differentiated bias, ``ds``, the logits' gradient (0 on skipped blocks)."""
  p = c.p
  st_dtype = p.stat
  scratch = {"dq_acc": pltpu.VMEM((grid.bq, p.head_dim), st_dtype)}

  def kernel(st: _Step):
    def update(carry):
      (acc,) = carry
      v, k = st.rows(st.v, st.s_ok), st.rows(st.k, st.s_ok)
      s, g = st.scores(st.q[...], k)
      _, ds = common.bwd_probs(p, block_dot, v, st.dout[...], s, st.lse[...], st.delta[...])
      if st.ds is not None:
        st.ds[...] = ds.astype(st.ds.dtype)
      return (acc + common.bwd_dq(p, block_dot, ds, k, g),)

    def finish(carry):
      st.dq[...] = carry[0].astype(st.dq.dtype)

    if st.ds is not None:

      @pl.when(jnp.logical_not(st.runs))
      def _():
        st.ds[...] = jnp.zeros(st.ds.shape, st.ds.dtype)

    _accumulate(st, scratch, (jnp.zeros((grid.bq, p.head_dim), st_dtype),), update, finish)

  rows = (p.batch, p.kv_heads, p.groups, p.t)
  outs = {"dq": (jax.ShapeDtypeStruct((*rows, p.head_dim), p.dtype), grid.query_side(p.head_dim))}
  if p.differentiates_bias:
    ds = jax.ShapeDtypeStruct((*rows, p.s), st_dtype)
    outs["ds"] = (ds, grid.tile(ds, clamp=False))
  return _bwd_pallas(kernel, grid, c.ops, stats, outs, scratch, interpret, "attention_bwd_dq")


def _dkdv(c: Call, grid: _Grid, interpret, *stats) -> dict[str, jax.Array]:
  """``dk, dv`` per query head, float32 (summed over a kv head's query heads by ``backward``)."""
  p = c.p
  st_dtype = p.stat
  scratch = {
    "dk_acc": pltpu.VMEM((grid.bk, p.head_dim), st_dtype),
    "dv_acc": pltpu.VMEM((grid.bk, p.value_dim), st_dtype),
  }

  def kernel(st: _Step):
    def update(carry):
      q, do = st.rows(st.q, st.t_ok), st.rows(st.dout, st.t_ok)
      s, g = st.scores(q, st.k[...])
      lse = jnp.where(st.t_ok, st.lse[...], NEG_INF)
      delta = st.rows(st.delta, st.t_ok)
      pr, ds = common.bwd_probs(p, block_dot, st.rows(st.v, st.s_ok), do, s, lse, delta)
      dk, dv = common.bwd_dkdv(p, block_dot, pr, ds, q, do, g)
      return carry[0] + dk, carry[1] + dv

    def finish(carry):
      st.dk[...] = carry[0]
      st.dv[...] = carry[1]

    init = (jnp.zeros((grid.bk, p.head_dim), st_dtype), jnp.zeros((grid.bk, p.value_dim), st_dtype))
    _accumulate(st, scratch, init, update, finish)

  shape = lambda x: jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.s, x), st_dtype)
  outs = {
    n: (shape(x), grid.per_head_keys(x)) for n, x in (("dk", p.head_dim), ("dv", p.value_dim))
  }
  name = "attention_bwd_dkdv"
  return _bwd_pallas(kernel, grid, c.ops, stats, outs, scratch, interpret, name)


def bwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(dq, dk, dv[, dbias])``."""
  c, grid = _setup("bwd", operands, config, params)
  key_grid = dataclasses.replace(grid, query_major=False)
  dq_pass = functools.partial(_dq, c, grid, interpret)
  return common.backward(c, dq_pass, functools.partial(_dkdv, c, key_grid, interpret))
