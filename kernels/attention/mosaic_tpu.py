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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Operands, Problem, block_dot
from pallax.kernels.attention.config import AttentionConfig


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
  """What a grid step sees: refs by role, its blocks' positions, and whether it runs."""

  def __init__(self, grid: _Grid, refs, n_rest: int):
    p = self.p = grid.p
    self.grid = grid
    n_prefetch = 4 if p.has_segments else 2
    prefetch, (q, k, v, *rest) = refs[:n_prefetch], refs[n_prefetch:]
    q_len, kv_len, *tabs = prefetch
    self.q, self.k, self.v = q, k, v
    self.bias = rest.pop(0) if p.has_bias else None
    self.mask = rest.pop(0) if p.has_mask else None
    self.segs = (rest.pop(0), rest.pop(0)) if p.has_segments else None
    self.rest, self.outs = rest[:n_rest], rest[n_rest:]
    b, outer, inner = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    self.lens = (q_len[b], kv_len[b]) if p.has_lengths else (None, None)
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


def _pallas(
  kernel,
  grid: _Grid,
  ops: Operands,
  rest,
  rest_specs,
  out_shapes,
  out_specs,
  scratch,
  interpret,
  name,
):
  p = grid.p
  mask = None if ops.mask is None else ops.mask.astype(jnp.int8)
  extras = [x for x in (ops.bias, mask) if x is not None]
  in_specs = [
    grid.query_side(p.head_dim),
    grid.key_side(p.head_dim),
    grid.key_side(p.value_dim),
    *(grid.tile(x) for x in extras),
  ]
  prefetch = [ops.q_len, ops.kv_len]
  if p.has_segments:
    tabs = common.segment_tables(ops.q_seg, ops.kv_seg, grid.bq, grid.bk)
    prefetch += [tab.reshape(-1) for tab in tabs]
    extras += [ops.q_seg[:, :, None], ops.kv_seg[:, None, :]]
    in_specs += [grid.segments(True), grid.segments(False)]
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch),
      grid=grid.shape,
      in_specs=in_specs + list(rest_specs),
      out_specs=out_specs,
      scratch_shapes=scratch,
    ),
    out_shape=out_shapes,
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    ),
    interpret=interpret,
    name=name,
  )(*prefetch, ops.q, ops.k, ops.v, *extras, *rest)


def _setup(operands, config: AttentionConfig, params, query_major=True):
  p = Problem.of(operands, **params)
  grid = _Grid(p, min(config.block_q, p.t), min(config.block_k, p.s), query_major)
  return p, Operands.of(p, operands), grid


def _stats(x):
  """A (B, K, G, T) statistic as (B, K, G, T, 1): its blocks are (block_q, 1) columns."""
  return x[..., None]


def _accumulate(step: _Step, scratch, init, update, finish):
  """The reduction over the inner axis: init at its first step, ``update`` where it runs."""

  @pl.when(step.first)
  def _():
    for ref, value in zip(scratch, init):
      ref[...] = value

  @pl.when(step.runs)
  def _():
    values = update(tuple(ref[...] for ref in scratch))
    for ref, value in zip(scratch, values):
      ref[...] = value

  @pl.when(step.last)
  def _():
    finish(tuple(ref[...] for ref in scratch))


def fwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out, lse)``."""
  p, ops, grid = _setup(operands, config, params)

  def kernel(*refs):
    st = _Step(grid, refs[:-3], 0)
    out_ref, lse_ref = st.outs

    def update(carry):
      v = st.rows(st.v, st.s_ok)
      s, _ = st.scores(st.q[...], st.k[...])
      return common.online_step(carry, s, v, block_dot)

    def finish(carry):
      out, lse = common.online_finish(carry)
      out_ref[...] = out.astype(out_ref.dtype)
      lse_ref[...] = lse

    _accumulate(st, refs[-3:], common.online_init(p, (grid.bq,), p.value_dim), update, finish)

  rows = (p.batch, p.kv_heads, p.groups, p.t)
  out, lse = _pallas(
    kernel,
    grid,
    ops,
    [],
    [],
    [jax.ShapeDtypeStruct((*rows, p.value_dim), p.dtype), jax.ShapeDtypeStruct((*rows, 1), p.stat)],
    [grid.query_side(p.value_dim), grid.query_side(1)],
    [
      pltpu.VMEM((grid.bq, 1), p.stat),
      pltpu.VMEM((grid.bq, 1), p.stat),
      pltpu.VMEM((grid.bq, p.value_dim), p.stat),
    ],
    interpret,
    "attention_fwd",
  )
  return [out, lse[..., 0]]


def jvp(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(out_dot, lse_dot)``."""
  p, ops, grid = _setup(operands, config, params)
  out, lse, dq, dk, dv, *dbias = ops.rest
  st_dtype = p.stat

  def kernel(*refs):
    st = _Step(grid, refs[:-3], 5 + len(dbias))
    out_ref, lse_ref, dq_ref, dk_ref, dv_ref, *dbias_ref = st.rest
    dout_ref, dlse_ref = st.outs

    def update(carry):
      k, v, dk_blk, dv_blk = (st.rows(r, st.s_ok) for r in (st.k, st.v, dk_ref, dv_ref))
      db = dbias_ref[0][...] if dbias_ref else None
      q = st.q[...]
      s, g = st.scores(q, k)
      blk = (q, k, v, s, lse_ref[...], dq_ref[...], dk_blk, dv_blk, db, g)
      terms = common.tangent_block(p, block_dot, *blk)
      return tuple(a + b for a, b in zip(carry, terms))

    def finish(carry):
      pdsv, rows, pdv = carry
      dout = pdsv - rows * out_ref[...].astype(st_dtype) + pdv
      dout_ref[...] = dout.astype(dout_ref.dtype)
      dlse_ref[...] = rows

    init = (
      jnp.zeros((grid.bq, p.value_dim), st_dtype),
      jnp.zeros((grid.bq, 1), st_dtype),
      jnp.zeros((grid.bq, p.value_dim), st_dtype),
    )
    _accumulate(st, refs[-3:], init, update, finish)

  rest_specs = [
    grid.query_side(p.value_dim),
    grid.query_side(1),
    grid.query_side(p.head_dim),
    grid.key_side(p.head_dim),
    grid.key_side(p.value_dim),
    *(grid.tile(d) for d in dbias),
  ]
  rows = (p.batch, p.kv_heads, p.groups, p.t)
  dout, dlse = _pallas(
    kernel,
    grid,
    ops,
    [out, _stats(lse), dq, dk, dv, *dbias],
    rest_specs,
    [
      jax.ShapeDtypeStruct((*rows, p.value_dim), p.dtype),
      jax.ShapeDtypeStruct((*rows, 1), st_dtype),
    ],
    [grid.query_side(p.value_dim), grid.query_side(1)],
    [
      pltpu.VMEM((grid.bq, p.value_dim), st_dtype),
      pltpu.VMEM((grid.bq, 1), st_dtype),
      pltpu.VMEM((grid.bq, p.value_dim), st_dtype),
    ],
    interpret,
    "attention_jvp",
  )
  return [dout, dlse[..., 0]]


def _bwd_pallas(kernel, grid: _Grid, ops, stats, out_shapes, out_specs, scratch, interpret, name):
  """``_pallas`` of a backward kernel, whose own operands are ``stats``: ``(lse, delta, do)``."""
  lse, delta, do = stats
  specs = [grid.query_side(1), grid.query_side(1), grid.query_side(grid.p.value_dim)]
  rest = [_stats(lse), _stats(delta), do]
  return _pallas(kernel, grid, ops, rest, specs, out_shapes, out_specs, scratch, interpret, name)


def _dq(p, ops, grid, interpret, *stats):
  """``dq`` and, with a bias, the logits' gradient (zero on skipped blocks)."""
  st_dtype = p.stat
  n_scratch = 1

  def kernel(*refs):
    st = _Step(grid, refs[:-n_scratch], 3)
    lse_ref, delta_ref, do_ref = st.rest
    dq_ref, *ds_ref = st.outs

    def update(carry):
      (acc,) = carry
      v, k = st.rows(st.v, st.s_ok), st.rows(st.k, st.s_ok)
      s, g = st.scores(st.q[...], k)
      _, ds = common.bwd_probs(p, block_dot, v, do_ref[...], s, lse_ref[...], delta_ref[...])
      if ds_ref:
        ds_ref[0][...] = ds.astype(ds_ref[0].dtype)
      return (acc + common.bwd_dq(p, block_dot, ds, k, g),)

    def finish(carry):
      dq_ref[...] = carry[0].astype(dq_ref.dtype)

    if ds_ref:

      @pl.when(jnp.logical_not(st.runs))
      def _():
        ds_ref[0][...] = jnp.zeros(ds_ref[0].shape, ds_ref[0].dtype)

    _accumulate(
      st, refs[-n_scratch:], (jnp.zeros((grid.bq, p.head_dim), st_dtype),), update, finish
    )

  rows = (p.batch, p.kv_heads, p.groups, p.t)
  out_shapes = [jax.ShapeDtypeStruct((*rows, p.head_dim), p.dtype)]
  out_specs = [grid.query_side(p.head_dim)]
  if p.has_bias:
    out_shapes.append(jax.ShapeDtypeStruct((*rows, p.s), st_dtype))
    out_specs.append(grid.tile(out_shapes[-1], clamp=False))
  scratch = [pltpu.VMEM((grid.bq, p.head_dim), st_dtype)]
  return _bwd_pallas(
    kernel, grid, ops, stats, out_shapes, out_specs, scratch, interpret, "attention_bwd_dq"
  )


def _dkdv(p, ops, grid, interpret, *stats):
  """``dk, dv`` per query head, float32 (summed over a kv head's query heads by ``backward``)."""
  st_dtype = p.stat

  def kernel(*refs):
    st = _Step(grid, refs[:-2], 3)
    lse_ref, delta_ref, do_ref = st.rest
    dk_ref, dv_ref = st.outs

    def update(carry):
      q, do = st.rows(st.q, st.t_ok), st.rows(do_ref, st.t_ok)
      s, g = st.scores(q, st.k[...])
      lse = jnp.where(st.t_ok, lse_ref[...], NEG_INF)
      delta = st.rows(delta_ref, st.t_ok)
      pr, ds = common.bwd_probs(p, block_dot, st.rows(st.v, st.s_ok), do, s, lse, delta)
      dk, dv = common.bwd_dkdv(p, block_dot, pr, ds, q, do, g)
      return carry[0] + dk, carry[1] + dv

    def finish(carry):
      dk_ref[...] = carry[0]
      dv_ref[...] = carry[1]

    init = (jnp.zeros((grid.bk, p.head_dim), st_dtype), jnp.zeros((grid.bk, p.value_dim), st_dtype))
    _accumulate(st, refs[-2:], init, update, finish)

  shape = lambda x: jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.s, x), st_dtype)
  widths = (p.head_dim, p.value_dim)
  return _bwd_pallas(
    kernel,
    grid,
    ops,
    stats,
    [shape(x) for x in widths],
    [grid.per_head_keys(x) for x in widths],
    [pltpu.VMEM((grid.bk, x), st_dtype) for x in widths],
    interpret,
    "attention_bwd_dkdv",
  )


def bwd(*operands, config: AttentionConfig, interpret: Any, **params):
  """``(dq, dk, dv[, dbias])``."""
  p, ops, grid = _setup(operands, config, params)
  key_grid = dataclasses.replace(grid, query_major=False)
  dq_pass = functools.partial(_dq, p, ops, grid, interpret)
  return common.backward(p, ops, dq_pass, functools.partial(_dkdv, p, ops, key_grid, interpret))
