"""The attention forward and backward as raw Triton kernels (FlashAttention-2).

The same operands and results as the Pallas kernels of ``triton.py``, written
in Triton's own language and launched through ``pallax.triton_raw``, with
what Pallas-Triton does not let a kernel choose: the loop structure, the
tiles' orientation and the exponentials' base. Each loop over the other
side's blocks is split in three (``_ranges``): the blocks at its ends that
the window, the lengths or the arrays' ends cut are computed with the mask,
the blocks between them, which every row sees whole, without one. Logits are
kept in log2 units (the scale folded with ``log2 e``, ``exp2`` on the
multi-function unit); ``lse`` is stored in natural log, as the contract wants.

* forward: one program per (query block, query head, batch), an online
  softmax in float32 over the key blocks the query block can see; GQA reads
  the kv head of the query head, K/V are never repeated.
* backward: ``delta = rowsum(out * do) - dlse`` in jnp, then a ``dq``
  kernel shaped like the forward and a ``dk, dv`` kernel, one program per
  (key block, query head, batch) looping over the query blocks that see the
  key block on transposed (key by query) tiles; with GQA its per-query-head
  partials (float32) are summed over each kv head's query heads afterwards.

Blocks are read through pointer tiles masked where they overhang the
sequence or the head dim (padded to a power of two: 80 -> 128). Not block
pointers: Triton 3.9 removed ``tl.make_block_ptr``, and the tensor
descriptors that replace it are built by the kernel in global scratch memory
on Hopper, which jax-triton's launch does not allocate. Dots accumulate in
float32; float32 operands multiply at IEEE precision (the Pallas kernels'
HIGHEST), 16-bit ones on the tensor cores. A bias, a mask and segment ids are
refused (``config.raw_feature_reason``); sinks are applied around these
kernels by ``common.with_sinks``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from pallax import triton_raw
from pallax.kernels.attention import common
from pallax.kernels.attention.common import Call, Problem
from pallax.kernels.attention.config import AttentionConfig, raw_feature_reason
from pallax.pallas_utils import next_pow2

triton, tl = triton_raw.import_triton(__name__)

LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))
NEG_INF = tl.constexpr(float("-inf"))


# ------------------------------------------------------------------------------
# Block math shared by the kernels.


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
  """``a @ b`` accumulated in float32.

  ``PRECISION``: "ieee" for float32 operands; None for 16-bit ones (the
  tensor cores); "bf16-interpreted" for bfloat16 ones under Triton's
  interpreter, whose bfloat16 dots multiply the raw bits (Triton 3.9): they
  are multiplied as float32 instead, exactly as the tensor cores do.
  """
  if PRECISION == "bf16-interpreted":
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
  else:
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _to(x, dtype, PRECISION: tl.constexpr):
  """``x.to(dtype)``, rounded to nearest even (see ``_dot`` for ``PRECISION``).

  Under the interpreter float32 -> bfloat16 casts truncate (Triton 3.9); they
  are rounded by hand there, as a GPU rounds them.
  """
  if PRECISION == "bf16-interpreted" and dtype == tl.bfloat16:
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000
    x = bits.to(tl.float32, bitcast=True)
  return x.to(dtype)


@triton.jit
def _load(ptr, pos, ROWS: tl.constexpr, WIDTH: tl.constexpr, BW: tl.constexpr, EDGE: tl.constexpr):
  """Rows ``pos`` of a ``(ROWS, WIDTH)`` row-major matrix at ``ptr``, ``BW`` columns, zero-padded.

  ``EDGE``: some of the rows may lie past ``ROWS`` (else only the columns
  past ``WIDTH`` are masked, where there are any).
  """
  cols = tl.arange(0, BW)
  ptrs = ptr + pos[:, None] * WIDTH + cols[None, :]
  if EDGE:
    return tl.load(ptrs, mask=(pos[:, None] < ROWS) & (cols[None, :] < WIDTH), other=0.0)
  elif BW == WIDTH:
    return tl.load(ptrs)
  else:
    return tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0.0)


@triton.jit
def _store(
  ptr,
  pos,
  value,
  ROWS: tl.constexpr,
  WIDTH: tl.constexpr,
  BW: tl.constexpr,
  PRECISION: tl.constexpr,
):
  """Writes the rows ``pos`` of a ``(ROWS, WIDTH)`` matrix at ``ptr`` that lie inside it."""
  cols = tl.arange(0, BW)
  mask = (pos[:, None] < ROWS) & (cols[None, :] < WIDTH)
  value = _to(value, ptr.dtype.element_ty, PRECISION)
  tl.store(ptr + pos[:, None] * WIDTH + cols[None, :], value, mask=mask)


@triton.jit
def _tanh(x):
  """``tanh`` from one exponential of ``-2|x|`` (Triton has no tanh of its own)."""
  e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
  t = (1.0 - e) / (1.0 + e)
  return tl.where(x < 0, -t, t)


@triton.jit
def _logits(qk, SCALE: tl.constexpr, CAP: tl.constexpr):
  """The logits of ``qk = q k^T`` in log2 units, and the soft cap's derivative (1 without one)."""
  if CAP is not None:
    t = _tanh(qk * (SCALE / CAP))
    return t * (CAP * LOG2E), 1.0 - t * t
  else:
    return qk * (SCALE * LOG2E), 1.0


class _Consts(NamedTuple):
  """The constexprs every kernel takes, passed as one ``C: tl.constexpr``.

  T, S: the query and key sequence lengths; H, HV: the head dims of q/k and
  v; HEADS: the query heads, GROUPS: the query heads per kv head; BQ, BK:
  the query and key blocks; BH, BHV: the head dims padded to powers of two;
  SCALE, CAP: the logits' scale and soft cap (None: none); LEFT, RIGHT: the
  window (None: unbounded); HAS_LENGTHS: whether lengths are read (else T
  and S are the lengths); PRECISION: the dots' (see ``_dot``);
  LAST_FIRST: the query blocks run last to first
  (``Problem.last_query_tile_first``).
  """

  T: int
  S: int
  H: int
  HV: int
  HEADS: int
  GROUPS: int
  BQ: int
  BK: int
  BH: int
  BHV: int
  SCALE: float
  CAP: Optional[float]
  LEFT: Optional[int]
  RIGHT: Optional[int]
  HAS_LENGTHS: bool
  PRECISION: Optional[str]
  LAST_FIRST: bool


@triton.jit
def _keep(t_pos, s_pos, q_len, kv_len, C: tl.constexpr):
  """Which (query, key) pairs see each other (``common.visible``), keys past ``S`` hidden.

  ``t_pos`` and ``s_pos`` broadcast against each other: a column and a row of
  a block, or a row and a column in the ``dk, dv`` kernel's transposed one.
  """
  keep = s_pos < C.S
  if C.HAS_LENGTHS:
    keep = keep & (t_pos < q_len) & (s_pos < kv_len)
  if C.LEFT is not None:
    keep = keep & (s_pos >= t_pos - C.LEFT)
  if C.RIGHT is not None:
    keep = keep & (s_pos <= t_pos + C.RIGHT)
  return keep


@triton.jit
def _ranges(
  start,
  own_len,
  other_len,
  OWN: tl.constexpr,
  OTHER: tl.constexpr,
  OWN_EXTENT: tl.constexpr,
  OTHER_EXTENT: tl.constexpr,
  AHEAD: tl.constexpr,
  BEHIND: tl.constexpr,
):
  """The other side's blocks that a block of ``OWN`` rows at ``start`` meets.

  Returns ``(lo, full_lo, full_hi, hi)``, ``lo <= full_lo <= full_hi <= hi``:
  ``[lo, hi)`` are the blocks it sees at all (``common.key_range``,
  ``common.query_range``), and ``[full_lo, full_hi)`` those that all of its
  rows, inside the array and their length, see whole: they need no mask.
  Part ``i`` of the loop over them is ``[bounds[i], bounds[i + 1])``: the
  masked blocks before the whole ones, the whole ones, the masked ones
  after. ``AHEAD``/``BEHIND``: how far past (before) its own positions the
  block sees (None: unbounded); ``own_len``/``other_len``: the lengths (the
  extents without lengths).
  """
  hi_pos = tl.minimum(other_len, OTHER_EXTENT)
  full_pos = hi_pos
  lo = 0
  full_lo = 0
  if AHEAD is not None:
    hi_pos = tl.minimum(hi_pos, start + (OWN + AHEAD))
    full_pos = tl.minimum(full_pos, start + (AHEAD + 1))
  if BEHIND is not None:
    lo = tl.maximum(start - BEHIND, 0) // OTHER
    full_lo = tl.cdiv(tl.maximum(start + (OWN - 1 - BEHIND), 0), OTHER)
  hi = tl.where(start < own_len, tl.cdiv(tl.maximum(hi_pos, 0), OTHER), 0)
  hi = tl.maximum(hi, lo)
  whole = start + OWN <= tl.minimum(own_len, OWN_EXTENT)
  full_hi = tl.where(whole, full_pos // OTHER, 0)
  full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
  full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
  return lo, full_lo, full_hi, hi


@triton.jit
def _program(q_len_ptr, kv_len_ptr, C: tl.constexpr):
  """A program's ``(row, kv, q_len, kv_len)``.

  The grid is (block, query head, batch): ``row`` indexes its query head's
  matrices among the (B, K, G) ones, ``kv`` its kv head's among the (B, K)
  ones (int64: offsets may pass 2^31); the batch's lengths are ``T`` and
  ``S`` without lengths.
  """
  n = tl.program_id(1)
  b = tl.program_id(2)
  row = (b * C.HEADS + n).to(tl.int64)
  kv = (b * (C.HEADS // C.GROUPS) + n // C.GROUPS).to(tl.int64)
  if C.HAS_LENGTHS:
    return row, kv, tl.load(q_len_ptr + b), tl.load(kv_len_ptr + b)
  else:
    return row, kv, C.T, C.S


@triton.jit
def _query_block(q_ptr, k_ptr, v_ptr, q_len_ptr, kv_len_ptr, C: tl.constexpr):
  """A query-block program's (forward, dq) matrix row, positions and key blocks' ``_ranges``.

  Returns ``(row, t_pos, bounds, qb)``; ``qb``, what ``_key_block`` reads:
  ``(q, t_pos, k_ptr, v_ptr, q_len, kv_len)``, the block's queries and the
  pointers at its kv head's keys and values.
  """
  row, kv, q_len, kv_len = _program(q_len_ptr, kv_len_ptr, C)
  block = tl.program_id(0)
  if C.LAST_FIRST:  # the grid's size a constant: tl.num_programs spilled 12 bytes (H100)
    block = tl.cdiv(C.T, C.BQ) - 1 - block
  t0 = block * C.BQ
  t_pos = t0 + tl.arange(0, C.BQ)
  bounds = _ranges(t0, q_len, kv_len, C.BQ, C.BK, C.T, C.S, C.RIGHT, C.LEFT)
  q = _load(q_ptr + row * (C.T * C.H), t_pos, C.T, C.H, C.BH, True)
  k_ptr += kv * (C.S * C.H)
  v_ptr += kv * (C.S * C.HV)
  return row, t_pos, bounds, (q, t_pos, k_ptr, v_ptr, q_len, kv_len)


@triton.jit
def _key_block(qb, j, C: tl.constexpr, MASKED: tl.constexpr):
  """Key block ``j`` of query block ``qb``: its keys, values, logits and soft cap derivative.

  The logits in log2 units, -inf where hidden (``MASKED``: the block is not
  seen whole).
  """
  q, t_pos, k_ptr, v_ptr, q_len, kv_len = qb
  s_pos = tl.arange(0, C.BK) + j * C.BK
  k = _load(k_ptr, s_pos, C.S, C.H, C.BH, MASKED)
  v = _load(v_ptr, s_pos, C.S, C.HV, C.BHV, MASKED)
  s, g = _logits(_dot(q, tl.trans(k), C.PRECISION), C.SCALE, C.CAP)
  if MASKED:
    keep = _keep(t_pos[:, None], s_pos[None, :], q_len, kv_len, C)
    s = tl.where(keep, s, NEG_INF)
  return k, v, s, g


@triton.jit
def _lse2(lse):
  """``lse`` in log2 units, +inf on rows that see nothing (their probabilities are 0)."""
  return tl.where(lse == NEG_INF, float("inf"), lse * LOG2E)


# ------------------------------------------------------------------------------
# Forward.


@triton.jit
def _fwd_blocks(carry_m, carry_l, acc, qb, start, stop, C: tl.constexpr, MASKED: tl.constexpr):
  """The online softmax over key blocks ``[start, stop)`` (masked, or all seen whole)."""
  for j in range(start, stop):
    _, v, s, _ = _key_block(qb, j, C, MASKED)
    m = tl.maximum(carry_m, tl.max(s, 1))
    m_safe = m
    if MASKED:  # rows that have seen no key yet
      m_safe = tl.where(m == NEG_INF, 0.0, m)
    alpha = tl.math.exp2(carry_m - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    carry_l = carry_l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_to(p, v.dtype, C.PRECISION), v, C.PRECISION)
    carry_m = m
  return carry_m, carry_l, acc


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, q_len_ptr, kv_len_ptr, out_ptr, lse_ptr, C: tl.constexpr):
  """``out``, ``lse`` of one query block of one query head."""
  row, t_pos, bounds, qb = _query_block(q_ptr, k_ptr, v_ptr, q_len_ptr, kv_len_ptr, C)
  m = tl.full([C.BQ], NEG_INF, tl.float32)
  denom = tl.zeros([C.BQ], tl.float32)
  acc = tl.zeros([C.BQ, C.BHV], tl.float32)
  for part in tl.static_range(3):  # the masked blocks before and after the whole ones
    m, denom, acc = _fwd_blocks(m, denom, acc, qb, bounds[part], bounds[part + 1], C, part != 1)

  empty = denom == 0.0
  safe = tl.where(empty, 1.0, denom)
  out = tl.where(empty[:, None], 0.0, acc / safe[:, None])
  _store(out_ptr + row * (C.T * C.HV), t_pos, out, C.T, C.HV, C.BHV, C.PRECISION)
  lse = tl.where(empty, NEG_INF, (m + tl.math.log2(safe)) * LN2)
  tl.store(lse_ptr + row * C.T + t_pos, lse, mask=t_pos < C.T)


# ------------------------------------------------------------------------------
# Backward.


@triton.jit
def _dq_blocks(acc, qb, do, lse2, delta, start, stop, C: tl.constexpr, MASKED: tl.constexpr):
  """``dq`` (unscaled) summed over key blocks ``[start, stop)``."""
  for j in range(start, stop):
    k, v, s, g = _key_block(qb, j, C, MASKED)
    p = tl.math.exp2(s - lse2[:, None])
    ds = p * (_dot(do, tl.trans(v), C.PRECISION) - delta[:, None]) * g
    acc += _dot(_to(ds, k.dtype, C.PRECISION), k, C.PRECISION)
  return acc


@triton.jit
def _dq_kernel(
  q_ptr, k_ptr, v_ptr, q_len_ptr, kv_len_ptr, lse_ptr, delta_ptr, do_ptr, dq_ptr, C: tl.constexpr
):
  """``dq`` of one query block of one query head."""
  row, t_pos, bounds, qb = _query_block(q_ptr, k_ptr, v_ptr, q_len_ptr, kv_len_ptr, C)
  do = _load(do_ptr + row * (C.T * C.HV), t_pos, C.T, C.HV, C.BHV, True)
  lse2 = _lse2(tl.load(lse_ptr + row * C.T + t_pos, mask=t_pos < C.T, other=NEG_INF))
  delta = tl.load(delta_ptr + row * C.T + t_pos, mask=t_pos < C.T, other=0.0)

  acc = tl.zeros([C.BQ, C.BH], tl.float32)
  for part in tl.static_range(3):  # the masked blocks before and after the whole ones
    acc = _dq_blocks(acc, qb, do, lse2, delta, bounds[part], bounds[part + 1], C, part != 1)
  _store(dq_ptr + row * (C.T * C.H), t_pos, acc * C.SCALE, C.T, C.H, C.BH, C.PRECISION)


@triton.jit
def _dkdv_blocks(
  dk,
  dv,
  k,
  v,
  s_pos,
  q_ptr,
  do_ptr,
  lse_ptr,
  delta_ptr,
  start,
  stop,
  q_len,
  kv_len,
  C: tl.constexpr,
  MASKED: tl.constexpr,
):
  """``dk`` (unscaled), ``dv`` of a key block summed over query blocks ``[start, stop)``.

  On transposed tiles (keys by queries), as FlashAttention-2's backward: the
  probabilities come out shaped for ``p^T do`` and ``ds^T q`` directly.
  """
  for i in range(start, stop):
    t_pos = tl.arange(0, C.BQ) + i * C.BQ
    q = _load(q_ptr, t_pos, C.T, C.H, C.BH, MASKED)
    do = _load(do_ptr, t_pos, C.T, C.HV, C.BHV, MASKED)
    if MASKED:
      lse2 = _lse2(tl.load(lse_ptr + t_pos, mask=t_pos < C.T, other=NEG_INF))
      delta = tl.load(delta_ptr + t_pos, mask=t_pos < C.T, other=0.0)
    else:
      lse2 = _lse2(tl.load(lse_ptr + t_pos))
      delta = tl.load(delta_ptr + t_pos)
    s, g = _logits(_dot(k, tl.trans(q), C.PRECISION), C.SCALE, C.CAP)
    if MASKED:
      keep = _keep(t_pos[None, :], s_pos[:, None], q_len, kv_len, C)
      s = tl.where(keep, s, NEG_INF)
    p = tl.math.exp2(s - lse2[None, :])
    dv += _dot(_to(p, do.dtype, C.PRECISION), do, C.PRECISION)
    ds = p * (_dot(v, tl.trans(do), C.PRECISION) - delta[None, :]) * g
    dk += _dot(_to(ds, q.dtype, C.PRECISION), q, C.PRECISION)
  return dk, dv


@triton.jit
def _dkdv_kernel(
  q_ptr,
  k_ptr,
  v_ptr,
  q_len_ptr,
  kv_len_ptr,
  lse_ptr,
  delta_ptr,
  do_ptr,
  dk_ptr,
  dv_ptr,
  C: tl.constexpr,
):
  """``dk``, ``dv`` of one key block from one query head (its share with GQA)."""
  row, kv, q_len, kv_len = _program(q_len_ptr, kv_len_ptr, C)
  s0 = tl.program_id(0) * C.BK
  s_pos = s0 + tl.arange(0, C.BK)
  bounds = _ranges(s0, kv_len, q_len, C.BK, C.BQ, C.S, C.T, C.LEFT, C.RIGHT)
  k = _load(k_ptr + kv * (C.S * C.H), s_pos, C.S, C.H, C.BH, True)
  v = _load(v_ptr + kv * (C.S * C.HV), s_pos, C.S, C.HV, C.BHV, True)
  q_ptr += row * (C.T * C.H)
  do_ptr += row * (C.T * C.HV)
  lse_ptr += row * C.T
  delta_ptr += row * C.T

  dk = tl.zeros([C.BK, C.BH], tl.float32)
  dv = tl.zeros([C.BK, C.BHV], tl.float32)
  for part in tl.static_range(3):  # the masked blocks before and after the whole ones
    dk, dv = _dkdv_blocks(
      dk, dv, k, v, s_pos, q_ptr, do_ptr, lse_ptr, delta_ptr, bounds[part], bounds[part + 1],
      q_len, kv_len, C, part != 1,
    )  # fmt: skip
  _store(dk_ptr + row * (C.S * C.H), s_pos, dk * C.SCALE, C.S, C.H, C.BH, C.PRECISION)
  _store(dv_ptr + row * (C.S * C.HV), s_pos, dv, C.S, C.HV, C.BHV, C.PRECISION)


# ------------------------------------------------------------------------------
# Launches.


@dataclasses.dataclass(frozen=True)
class _Launch(common.Blocks):
  """A call cut into blocks, the call itself, and the constexprs every kernel takes."""

  call: Call

  @classmethod
  def of(cls, call: Call, config: AttentionConfig) -> _Launch:
    p = call.p
    reason = raw_feature_reason(p)
    if reason is not None:
      raise NotImplementedError(reason)
    bq = min(config.block_q, next_pow2(max(p.t, 16)))
    bk = min(config.block_k, next_pow2(max(p.s, 16)))
    return cls(p, bq, bk, call)

  def consts(self, interpret: bool) -> _Consts:
    p = self.p
    return _Consts(
      T=p.t,
      S=p.s,
      H=p.head_dim,
      HV=p.value_dim,
      HEADS=p.kv_heads * p.groups,
      GROUPS=p.groups,
      BQ=self.bq,
      BK=self.bk,
      BH=next_pow2(max(p.head_dim, 16)),
      BHV=next_pow2(max(p.value_dim, 16)),
      SCALE=p.scale,
      CAP=p.soft_cap,
      LEFT=p.left,
      RIGHT=p.right,
      HAS_LENGTHS=p.has_lengths,
      PRECISION=_precision(p.dtype, interpret),
      LAST_FIRST=p.last_query_tile_first,
    )

  def launch(self, kernel, args, out_shape, blocks: int, config, interpret):
    return triton_raw.launch(
      kernel,
      *args,
      out_shape=out_shape,
      grid=self.grid(blocks),
      num_warps=config.num_warps,
      num_stages=config.num_stages,
      interpret=interpret,
      C=self.consts(interpret),
    )


def _precision(dtype, interpret: bool) -> Optional[str]:
  """The dots' ``PRECISION`` constexpr (see ``_dot``)."""
  if jnp.dtype(dtype) == jnp.float32:
    return "ieee"
  return "bf16-interpreted" if interpret and jnp.dtype(dtype) == jnp.bfloat16 else None


def _rows_shape(p: Problem, length: int, width: int, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, length, width), dtype)


def fwd(*operands, config: AttentionConfig, interpret: bool, **params) -> list[jax.Array]:
  """``(out, lse)``."""
  c = _Launch.of(Call.of("fwd", operands, params), config)
  p, ops = c.p, c.call.ops
  out_shape = [
    _rows_shape(p, p.t, p.value_dim, p.dtype),
    jax.ShapeDtypeStruct((p.batch, p.kv_heads, p.groups, p.t), p.stat),
  ]
  args = (ops.q, ops.k, ops.v, ops.q_len, ops.kv_len)
  out, lse = c.launch(_fwd_kernel, args, out_shape, c.nq, config, interpret)
  return c.call.results({"out": out, "lse": lse})


def bwd(*operands, config: AttentionConfig, interpret: bool, **params) -> list[jax.Array]:
  """``(dq, dk, dv)``: the dq kernel and the dk/dv kernel."""
  c = _Launch.of(Call.of("bwd", operands, params), config)
  p, ops = c.p, c.call.ops
  inputs = lambda lse, delta, dout: (ops.q, ops.k, ops.v, ops.q_len, ops.kv_len, lse, delta, dout)

  def dq_pass(*stats):
    shape = [_rows_shape(p, p.t, p.head_dim, p.dtype)]
    (dq,) = c.launch(_dq_kernel, inputs(*stats), shape, c.nq, config, interpret)
    return {"dq": dq}

  def dkdv_pass(*stats):
    partial = p.dtype if p.groups == 1 else p.stat
    shapes = [_rows_shape(p, p.s, x, partial) for x in (p.head_dim, p.value_dim)]
    dk, dv = c.launch(_dkdv_kernel, inputs(*stats), shapes, c.nk, config, interpret)
    return {"dk": dk, "dv": dv}

  return common.backward(c.call, dq_pass, dkdv_pass)
