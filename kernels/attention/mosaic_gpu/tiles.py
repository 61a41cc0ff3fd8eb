"""What the Mosaic GPU attention kernels share: block ranges, masks, logits, the step loops.

A consumer warpgroup owns a tile of rows (queries in the forward and the dq
kernel, keys in the dk/dv kernel) and walks the ring's blocks of the other
side that its block of threads sees (``[lo, hi)``). Of those, it computes
the ones its own rows see (``own``), without a mask where every pair of the
block is visible (``unmasked``), and releases the others without computing,
so that every consumer observes every step of the ring.

What bounds those ranges besides the window: the example's lengths (read
from GMEM as scalars) and, with segment ids, the runs of blocks a tile's
segments meet and of blocks all in its one segment (``segment_runs``, by
XLA once a call). The mask of a block needs the segment ids of its rows and
columns: the kernels bring those to SMEM with TMA (``Layout`` loads from
GMEM do not compile), the own side's once, the streamed side's in the ring.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Problem
from pallax.pallas_mosaic_gpu import plgpu

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def _div(a, b: int):
  return lax.div(a, jnp.int32(b))


def _ceil_div(a, b: int):
  return _div(jnp.maximum(a, 0) + (b - 1), b)


def _clamp(u_lo, u_hi, lo, hi):
  """``[u_lo, u_hi)`` clamped inside ``[lo, hi)`` (empty where it does not meet it)."""
  u_hi = jnp.maximum(jnp.minimum(u_hi, hi), lo)
  return jnp.minimum(jnp.maximum(u_lo, lo), u_hi), u_hi


def column_share(axis, chunks: int, cols: int):
  """A grid axis's index over ``chunks`` blocks of threads a tile, and their result columns.

  Blocks of threads that split a tile's result columns (``config.out_cols``)
  are adjacent on the axis (they read the same operands from L2). Returns the
  axis's index without the split and the block's ``cols`` columns (a slice),
  or ``(axis, None)`` when one block of threads computes them all.
  """
  if chunks == 1:
    return axis, None
  share = lax.rem(axis, jnp.int32(chunks))
  return _div(axis, chunks), pl.ds(pl.multiple_of(share * cols, cols), cols)


def query_tile_start(p: Problem, tp: int, rows: int):
  """The first query of this block of threads' tile of ``rows`` (``Problem.query_tile``)."""
  return p.query_tile(lax.axis_index("q"), tp // rows) * rows


# Columns of a ``segment_runs`` row: the blocks a tile's segments meet, and
# those all in one segment with it.
MEET_LO, MEET_HI, ONE_LO, ONE_HI = range(4)


def segment_runs(q_seg, kv_seg, bq: int, bk: int, queries_own: bool) -> jax.Array:
  """``(B, n, 4)`` int32: per own tile, the runs of the other side's blocks that bound its steps.

  Own tiles are query blocks of ``bq`` rows (``queries_own``) or key blocks of
  ``bk``. Per tile: ``[MEET_LO, MEET_HI)``, the other side's blocks whose
  segment ranges meet its own (sorted ids meet in one run), and
  ``[ONE_LO, ONE_HI)``, those all in the one segment of all its rows (empty
  unless they form one run): the blocks that need no segment mask.
  """
  meets, one = common.segment_blocks(q_seg, kv_seg, bq, bk)
  side = 0 if queries_own else 1
  meet_lo, meet_hi = common.meeting_runs(meets)[side]
  one_lo, one_hi = common.meeting_runs(one)[side]
  whole = jnp.sum(one, axis=one.ndim - 1 - side) == one_hi - one_lo
  runs = (meet_lo, meet_hi, jnp.where(whole, one_lo, 0), jnp.where(whole, one_hi, 0))
  return jnp.stack(runs, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A call's query blocks of ``bq`` rows and key blocks of ``bk`` rows (traced int32 starts).

  Inside a kernel, ``at`` gives the tiles of one example: its lengths
  (``q_len``, ``kv_len``, traced, with lengths) and its rows of the segment
  runs (``runs``: tile height -> ``(n, 4)`` ref, with segment ids).
  ``cut_keys``: the keys' padded length, where padded keys must be hidden
  (0: they need not be).
  """

  p: Problem
  bq: int
  bk: int
  q_len: Any = None
  kv_len: Any = None
  runs: Optional[dict] = None
  cut_keys: int = 0

  @property
  def hides_padded_keys(self) -> bool:
    """Whether the key side's masks hide padded keys (``cut_keys``, where there are any).

    The dk/dv kernel leaves them visible (their dK and dV are cut off) unless
    it also computes dQ: there a padded key's probability, ``exp2(-lse)``, could
    overflow, and ``inf`` times its zero K is NaN. A tile of padded keys alone
    sees no query (``query_blocks``) unless its consumer takes every step of
    its block of threads (``shares_dq``): then its steps are masked.
    """
    return self.cut_keys > self.p.s

  def inputs(self, ops, segs, heights: tuple[int, ...], queries_own: bool) -> list:
    """What ``at`` reads, as kernel operands: the lengths, then per own tile height its runs.

    ``ops``: the call's operands by name; ``segs``: its segment ids padded to
    the kernel's tiles (``padded_segments``); ``heights``: the own tile
    heights whose ranges the kernel asks for (a block of threads' and a
    consumer's).
    """
    out = [ops.q_len, ops.kv_len] if self.p.has_lengths else []
    if self.p.has_segments:
      for rows in dict.fromkeys(heights):
        bq, bk = (rows, self.bk) if queries_own else (self.bq, rows)
        out.append(segment_runs(*segs, bq, bk, queries_own))
    return out

  def at(self, refs, b, heights: tuple[int, ...]) -> Tiles:
    """These tiles for example ``b``, from the refs of ``inputs``' operands."""
    refs = list(refs)
    lens = {}
    if self.p.has_lengths:
      lens = {"q_len": refs.pop(0)[b], "kv_len": refs.pop(0)[b]}
    runs = None
    if self.p.has_segments:
      runs = {rows: ref.at[b] for rows, ref in zip(dict.fromkeys(heights), refs)}
    return dataclasses.replace(self, **lens, runs=runs)

  def _lens(self, *order: str) -> tuple:
    return tuple(getattr(self, n) for n in order)

  def _run(self, t0, rows: int, lo: int):
    """Columns ``lo``, ``lo + 1`` of the segment runs of the own tile at ``t0`` (None without)."""
    if self.runs is None:
      return None
    row = self.runs[rows].at[_div(t0, rows)]
    return row[lo], row[lo + 1]

  def _one_segment(self, t0, rows: int, u_lo, u_hi):
    """``[u_lo, u_hi)`` within the blocks all in the own tile's one segment (with segments)."""
    one = self._run(t0, rows, ONE_LO)
    return (u_lo, u_hi) if one is None else (jnp.maximum(u_lo, one[0]), jnp.minimum(u_hi, one[1]))

  # Queries own the rows (the forward and dq kernels): blocks of keys.

  def key_blocks(self, t0, rows: int):
    """``[lo, hi)``: the key blocks queries ``[t0, t0 + rows)`` see."""
    lens = self._lens("q_len", "kv_len")
    return common.key_range(self.p, t0, rows, self.bk, *lens, self._run(t0, rows, MEET_LO))

  def unmasked_keys(self, t0, lo, hi):
    """Key blocks of ``[lo, hi)`` that every query of ``[t0, t0 + bq)`` sees whole.

    A block past the keys' end is masked.
    """
    p = self.p
    ends = (jnp.int32(p.s // self.bk), self.q_len, self.kv_len)
    return self._unmasked(t0, self.bq, self.bk, lo, hi, p.right, p.left, *ends)

  def keep_keys(self, form: mgpu.Form, t0, j, segs=None) -> Optional[jax.Array]:
    """Which (query, key) pairs of queries ``[t0, t0 + bq)`` and key block ``j`` are visible.

    ``segs``: the queries' and the block's keys' segment id vectors (with segments).
    """
    shape = (self.bq, self.bk)
    t_pos, s_pos = _positions(form, t0, shape, 0), _positions(form, j * self.bk, shape, 1)
    keep = common.visible(self.p, t_pos, s_pos, self.q_len, self.kv_len, *_tiles(segs, shape))
    return _inside(keep, s_pos, self.p.s) if self.p.s % self.bk else keep

  # Keys own the rows (the dk/dv kernel): blocks of queries. Padded queries
  # need no mask there (a padded query's lse is +inf: its probabilities 0),
  # nor padded keys unless ``cut_keys`` (their gradients are cut off).

  def query_blocks(self, s0, rows: int):
    """``[lo, hi)``: the query blocks that see keys ``[s0, s0 + rows)``.

    With ``cut_keys`` a tile of padded keys alone sees none.
    """
    lens = self._lens("q_len", "kv_len")
    lo, hi = common.query_range(self.p, s0, self.bq, rows, *lens, self._run(s0, rows, MEET_LO))
    return (lo, jnp.where(s0 < self.p.s, hi, lo)) if self.hides_padded_keys else (lo, hi)

  def unmasked_queries(self, s0, lo, hi):
    """Query blocks of ``[lo, hi)`` that see every key of ``[s0, s0 + bk)``."""
    p = self.p
    u_lo, u_hi = self._unmasked(
      s0, self.bk, self.bq, lo, hi, p.left, p.right, hi, self.kv_len, self.q_len
    )
    if self.hides_padded_keys:  # a tile with padded keys has every block masked
      u_hi = jnp.where(s0 + self.bk <= p.s, u_hi, u_lo)
    return u_lo, u_hi

  def _unmasked(self, start, own, other, lo, hi, ahead, behind, u_hi, own_len, other_len):
    """Blocks of ``other`` rows in ``[lo, hi)`` every own row of ``[start, start + own)`` sees.

    ``ahead``/``behind``: how far past (before) its position a row sees (None:
    unbounded); ``u_hi``: the end of the blocks that can be whole; the
    lengths: the own side's and the other's (read with lengths). Rows past
    their length see nothing: a tile holding one has every block masked.
    """
    if ahead is not None:
      u_hi = jnp.minimum(u_hi, _div(start + (ahead + 1), other))
    if self.p.has_lengths:
      u_hi = jnp.minimum(u_hi, _div(other_len, other))
      u_hi = jnp.where(start + own <= own_len, u_hi, 0)
    u_lo = lo if behind is None else _ceil_div(start + (own - 1 - behind), other)
    return _clamp(*self._one_segment(start, own, u_lo, u_hi), lo, hi)

  def keep_queries(self, form: mgpu.Form, s0, i, segs=None, t_vec=None) -> Optional[jax.Array]:
    """Which (key, query) pairs of keys ``[s0, s0 + bk)`` and query block ``i`` are visible.

    ``segs``: the keys' and the block's queries' segment id vectors (with segments).
    ``t_vec``: the block's query positions as a vector read from SMEM, where
    positions computed in registers would be loop invariants ptxas keeps
    live (``masks_every_step``); by default computed.
    Queries past their length are left visible: ``lse2`` gives them an lse
    of +inf, their probabilities 0 (a mask column less to hold: at head dim
    128 its registers spilled).
    """
    shape = (self.bk, self.bq)
    s_pos = _positions(form, s0, shape, 0)
    if t_vec is None:
      t_pos = _positions(form, i * self.bq, shape, 1)
    else:
      t_pos = broadcast(t_vec, shape, 1)
    kv_seg, q_seg = _tiles(segs, shape)
    keep = common.visible(self.p, t_pos, s_pos, None, self.kv_len, q_seg, kv_seg)
    return _inside(keep, s_pos, self.p.s) if self.hides_padded_keys else keep


def padded_segments(ops, tp: int, sp: int) -> Optional[tuple[jax.Array, jax.Array]]:
  """The segment ids padded to ``tp`` queries and ``sp`` keys with their last id (None without).

  Padded positions are masked as before (past ``S``) or inert (past ``T``).
  """
  if ops.q_seg is None:
    return None
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge").astype(jnp.int32)
  return pad(ops.q_seg, tp), pad(ops.kv_seg, sp)


def logit_bias(ops, dtype, tp: int, sp: int) -> Optional[jax.Array]:
  """The bias and the mask as one ``(Bb, Kb, Gb, tp, sp)`` bias of ``dtype`` (None without either).

  -inf where the mask hides a pair, the bias (0 without one) elsewhere,
  padded with 0 (the kernels mask padded keys; padded queries are cut off).
  A bias and a mask that broadcast over different dims take the union's
  shape (one copy, by XLA). A finite bias below -2.36e38 (``finfo.min``, an
  additive mask of some models) hides its pair as -inf does: in base 2
  (times log2 e) it overflows to -inf, so a row it hides entirely gives 0
  and lse -inf, as a masked row does, where XLA's softmax averages V.
  """
  bias, mask = ops.bias, ops.mask
  if bias is None and mask is None:
    return None
  x = jnp.zeros((), dtype) if bias is None else bias.astype(dtype)
  if mask is not None:
    x = jnp.where(mask, x, jnp.asarray(NEG_INF, dtype))
  return pad(x, {3: tp, 4: sp})


def row_tile(ref, bias: jax.Array, b, kv_head, group, rows, keys):
  """The GMEM tile of ``logit_bias``-like ``ref`` at ``rows`` and ``keys`` of a query head.

  ``bias``: the operand ``ref`` holds (its shape says which dims it
  broadcasts over).
  """
  return ref.at[(*common.extra_lead(bias, b, kv_head, group), rows, keys)]


def bias_smem(bias: Optional[jax.Array], ring: tuple[int, int, int]) -> Optional[Any]:
  """SMEM for ``logit_bias``' tiles in the ring's slots, ``(stages, rows, block)`` (None without).

  Swizzled: a ``wgmma``-layout load of an unswizzled tile has no transfer
  pattern free of bank conflicts (Mosaic GPU refuses it).
  """
  if bias is None:
    return None
  return plgpu.SMEM(ring, bias.dtype, transforms=mgpu.swizzle_transforms(bias.dtype, ring[-1]))


def segment_smem(segs, own: tuple[int, int], ring: tuple[int, int]) -> Optional[list]:
  """SMEM for the segment ids of a kernel's own rows and of its ring's slots (None without).

  ``own``: ``(consumers, rows)``; ``ring``: ``(stages, block)``.
  """
  if segs is None:
    return None
  return [plgpu.SMEM(own, jnp.int32), plgpu.SMEM(ring, jnp.int32)]


def _positions(form: mgpu.Form, start, shape: tuple[int, int], dim: int) -> jax.Array:
  """Positions ``start, start + 1, ...`` along ``dim`` of a tile of ``shape``.

  A vector broadcast to the tile: a mask compared from two of them holds
  fewer registers than from two ``iota`` tiles (compiled for H100: with
  ``iota`` tiles the forward's 192-key blocks with masks spilled 200-2136
  bytes at head dim 64).
  """
  return broadcast(start + form.positions(shape[dim], dim), shape, dim)


def _inside(keep: Optional[jax.Array], s_pos: jax.Array, s: int) -> jax.Array:
  """``keep`` (None: every pair) and the keys before ``s``: padded keys hidden."""
  inside = s_pos < s
  return inside if keep is None else keep & inside


def _tiles(segs, shape) -> tuple:
  """A tile's row and column vectors broadcast to it (``(None, None)`` without)."""
  if segs is None:
    return None, None
  rows, cols = segs
  return broadcast(rows, shape, 0), broadcast(cols, shape, 1)


def logits2(p: Problem, x: jax.Array, cap_grad: bool = False):
  """``scale * x`` soft-capped, in base 2 (times log2 e); with ``cap_grad`` also the cap's slope.

  The slope ``1 - tanh^2`` (None without a cap) scales the logits' gradient
  on its way back to ``x``.
  """
  y, factor = logits2_factors(p, x)
  z = y * factor
  return (z, None if p.soft_cap is None else 1.0 - y * y) if cap_grad else z


def logits2_factors(p: Problem, x: jax.Array) -> tuple[jax.Array, float]:
  """``logits2`` as ``y * factor``: ``x`` (soft-capped: ``tanh``) and a positive constant.

  For ``softmax_stats``, which then takes a row's maximum of ``y`` before the
  product and fuses the product into the exponent's subtraction (one ``fma``
  an element where ``logits2`` takes a multiply and a subtraction). A scale
  of 0 or below gives the product itself and a factor of 1: the maximum
  commutes with a positive factor only.
  """
  if p.soft_cap is not None:
    return jnp.tanh(x * (p.scale / p.soft_cap)), p.soft_cap * LOG2E
  if p.scale > 0:
    return x, p.scale * LOG2E
  return x * (p.scale * LOG2E), 1.0


def cap_slope(p: Problem, z: jax.Array) -> Optional[jax.Array]:
  """The soft cap's slope ``1 - tanh^2`` from ``logits2``'s capped logits (None without a cap).

  Hidden logits (-inf) give 0, and so do the saturated ends (``|t|`` clipped
  to 1: ``z / bound`` rounds a few ulps past it). For a kernel where ``z`` stays live anyway:
  the slope is then not held beside it (the dk/dv kernel's registers).
  """
  if p.soft_cap is None:
    return None
  bound = p.soft_cap * LOG2E
  t = jnp.clip(z * (1.0 / bound), -1.0, 1.0)
  return 1.0 - t * t


def softmax_init(form: mgpu.Form, rows: int, width: int) -> tuple[jax.Array, ...]:
  """The online softmax's start in ``wgmma`` layouts: output accumulator, row maxima, row sums.

  A float32 ``(rows, width)`` tile of zeros, maxima -inf and sums 0.
  """
  wgmma = plgpu.Layout.WGMMA
  return (
    form.zeros((rows, width)),
    form.layout(jnp.full((rows,), NEG_INF, jnp.float32), wgmma.reduce(1)),
    form.layout(jnp.zeros((rows,), jnp.float32), wgmma.reduce(1)),
  )


def softmax_step(
  carry: tuple[jax.Array, ...], y: jax.Array, factor: float, hidden: bool = True
) -> tuple:
  """One block of base-2 logits ``y * factor`` into the online softmax ``carry = (acc, m, denom)``.

  ``y, factor``: ``logits2_factors``' (``factor > 0``, so a row's maximum of
  ``y`` times ``factor`` is that of the logits, bit for bit), ``y`` -inf where
  hidden. Returns the block's unnormalised probabilities ``e``, the
  accumulator rescaled to the new maxima, the new maxima and the new sums.
  ``hidden``: ``y`` may hide a whole row (-inf), whose maximum is then taken as 0.
  """
  acc, m, denom = carry
  e, alpha, m_new, denom = softmax_stats(m, denom, y, factor, hidden)
  return e, acc * broadcast(alpha, acc.shape, 0), m_new, denom


def softmax_stats(
  m: jax.Array, denom: jax.Array, y: jax.Array, factor: float, hidden: bool = True
) -> tuple:
  """``softmax_step`` without the accumulator: ``e``, the accumulator's factor, maxima, sums."""
  m_new = jnp.maximum(m, y.max(axis=1) * factor)
  m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if hidden else m_new
  alpha = jnp.exp2(m - m_use)
  e = jnp.exp2(y * factor - broadcast(m_use, y.shape, 0))
  return e, alpha, m_new, denom * alpha + e.sum(axis=1)


def add_values(form: mgpu.Form, acc, weights, values, overlap: Callable[[], None]) -> jax.Array:
  """``acc + weights @ values`` on ``wgmma`` (``P V``), ``overlap()`` issued while it runs."""

  def product(acc_ref):
    plgpu.wgmma(acc_ref, weights, values)
    overlap()

  return form.accumulate(acc, product)


def masked(z: jax.Array, keep: Optional[jax.Array]) -> jax.Array:
  return z if keep is None else jnp.where(keep, z, NEG_INF)


def hiding(
  is_masked: Union[bool, jax.Array], keep: Callable[[], Optional[jax.Array]]
) -> Callable[[jax.Array], jax.Array]:
  """A step's ``z -> z`` with -inf where ``keep()`` hides a pair: the identity on unmasked steps.

  ``is_masked``: a Python bool (``over_steps``' loops of masked or unmasked
  steps), or a traced one in one loop of both (``over_steps``' or the dk/dv
  kernel's): then ``lax.cond`` picks.
  """
  hide = lambda z: masked(z, keep())
  if isinstance(is_masked, bool):
    return hide if is_masked else lambda z: z
  return lambda z: lax.cond(is_masked, hide, lambda z: z, z)


def broadcast(x: jax.Array, shape, dim: int) -> jax.Array:
  """A row (``dim`` 0) or column (``dim`` 1) statistic broadcast to a tile."""
  return lax.broadcast_in_dim(x, shape, [dim])


def lse2(lse: jax.Array, q_len: Optional[jax.Array] = None) -> jax.Array:
  """The forward's ``lse (B, K, G, T)`` in base 2 for the backward: +inf where a row saw no key.

  ``exp2(z - lse2)`` is then the probability, 0 on such rows. With ``q_len
  (B,)`` also +inf past each example's length, whatever the forward's lse
  there (sinks make it finite: the sink's logit).
  """
  out = jnp.where(lse == NEG_INF, jnp.inf, lse) * LOG2E
  if q_len is None:
    return out
  return jnp.where(jnp.arange(lse.shape[-1]) < q_len[:, None, None, None], out, jnp.inf)


def over_steps(
  lo,
  own: tuple[Any, Any],
  unmasked: tuple[Any, Any],
  hi,
  skip: Callable,
  step: Callable,
  carry,
  one_loop: bool = False,
  ends: Optional[tuple[Callable, Callable]] = None,
):
  """Steps ``[lo, hi)``: ``skip(j, carry)`` outside ``own``, ``step(j, carry, masked=)`` in it.

  ``masked`` is a Python bool: the masked and the unmasked steps of ``own``
  run in loops of their own. With ``one_loop`` they share one, ``masked`` a
  traced bool: a kernel whose accumulators leave no registers to move them
  between loops (ptxas spilled at the loops' edges) takes that.
  ``ends``: ``(first, last)`` of a software pipeline, where a step finishes
  the work of the step before it: ``first(j, carry, masked=)`` runs own's
  first step in place of ``step``, and ``last(j, carry)`` after own's last
  step ``j`` (both where own is not empty).
  """
  own_lo, own_hi = own
  if one_loop and ends is not None:
    raise ValueError("over_steps: a software pipeline (ends) runs its steps in loops of their own")
  carry = lax.fori_loop(lo, own_lo, skip, carry)
  if one_loop:
    body = lambda j, carry: step(j, carry, masked=masked_step(j, unmasked))
    carry = lax.fori_loop(own_lo, own_hi, body, carry)
    return lax.fori_loop(own_hi, hi, skip, carry)
  if ends is None:
    carry = _split_steps(own_lo, own_hi, unmasked, step, carry)
    return lax.fori_loop(own_hi, hi, skip, carry)
  first, last = ends
  second, once = jnp.minimum(own_lo + 1, own_hi), (own_lo < own_hi).astype(jnp.int32)
  carry = _split_steps(own_lo, second, _clamp(*unmasked, own_lo, second), first, carry)
  carry = _split_steps(second, own_hi, _clamp(*unmasked, second, own_hi), step, carry)
  carry = lax.fori_loop(own_hi - once, own_hi, last, carry)
  return lax.fori_loop(own_hi, hi, skip, carry)


def _split_steps(lo, hi, unmasked: tuple[Any, Any], step: Callable, carry):
  """``step(j, carry, masked=)`` over ``[lo, hi)``: masked, unmasked (within it), masked."""
  (u_lo, u_hi), masked = unmasked, functools.partial(step, masked=True)
  carry = lax.fori_loop(lo, u_lo, masked, carry)
  carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
  return lax.fori_loop(u_hi, hi, masked, carry)


def masked_step(j, unmasked: tuple[Any, Any]) -> jax.Array:
  """Whether step ``j`` is outside the unmasked steps ``[u_lo, u_hi)``: ``hiding``'s flag."""
  return (j < unmasked[0]) | (j >= unmasked[1])


def own_range(lo, hi, own):
  """A consumer's own ``[lo, hi)`` clamped inside its block of threads' (``own`` within it)."""
  own_lo = jnp.minimum(jnp.maximum(own[0], lo), hi)
  return own_lo, jnp.minimum(jnp.maximum(own[1], own_lo), hi)


def pad(x: jax.Array, sizes: dict[int, int], value: float = 0.0) -> jax.Array:
  """``x`` padded at the end of each axis in ``sizes`` to that size."""
  widths = [(0, sizes[i] - d if i in sizes else 0) for i, d in enumerate(x.shape)]
  return jnp.pad(x, widths, constant_values=value)


# The kernels read and write the sequences' tiles in the layout JAX's arrays
# have, positions before heads: q (B, T, K, G, h), k (B, S, K, h); TMA copies
# a tile's rows with the heads' stride. The primitive's operands are
# (B, K, G, T, h) and (B, K, S, h), transposes of the caller's arrays, and XLA
# folds a transpose of a transpose away: no copy runs around the kernels (the
# copies took 16% of a forward's time on an H200).
def sequence_first(x: jax.Array) -> jax.Array:
  """``(B, K, [G,] T, h)`` -> ``(B, T, K, [G,] h)``."""
  return jnp.moveaxis(x, x.ndim - 2, 1)


def heads_first(x: jax.Array) -> jax.Array:
  """``(B, T, K, [G,] h)`` -> ``(B, K, [G,] T, h)``: ``sequence_first``'s inverse."""
  return jnp.moveaxis(x, 1, x.ndim - 2)


def transposed(x: jax.Array) -> jax.Array:
  """``(B, K, [G,] T, h)`` -> ``(B, K, [G,] h, T)``: the interpreted form's transposed tiles.

  The GPU interpreter's ``wgmma`` takes no transposed operand, so a tile read
  transposed (``plgpu.transpose_ref`` on a GPU) is copied from this there.
  """
  return jnp.swapaxes(x, -2, -1)
