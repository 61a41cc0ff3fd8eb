"""What every attention implementation shares: the call's static facts and the block math.

The primitives' operands (``primitives/attention.py`` builds them):

* ``q (B, K, G, T, H)``: query heads grouped by the kv head they read
  (``N = K * G``; query head ``n`` is ``(n // G, n % G)``);
* ``k (B, K, S, H)``, ``v (B, K, S, Hv)``;
* ``q_len``, ``kv_len`` ``(B,)`` int32, clipped to ``[0, T]`` / ``[0, S]``;
* optional ``bias (Bb, Kb, Gb, T, S)`` and bool ``mask`` of the same layout,
  where ``Bb`` is 1 or ``B`` and ``(Kb, Gb)`` is ``(1, 1)`` or ``(K, G)``:
  broadcasting over batch and heads stays in the index maps;
* optional segment ids ``q_seg (B, T)``, ``kv_seg (B, S)`` int32 (packed
  sequences: a query sees only keys of its segment);
* optional ``sinks (Bs, K, G)`` (``Bs`` 1 or ``B``): a logit per query head
  that joins every row's softmax denominator and attends to nothing. The
  kernels never see it: ``with_sinks`` applies it around them, exactly;
* ``out (B, K, G, T, Hv)`` and ``lse (B, K, G, T)`` float32: the forward's
  results (natural-log logsumexp of a row's visible logits; -inf for a row
  with no visible key, whose output is 0).

Query ``t`` sees key ``s`` iff ``t < q_len``, ``s < kv_len`` (with lengths),
``t - left <= s <= t + right`` (the window; causal is ``right = 0``), their
segment ids are equal and the mask allows it. Logits are ``scale * q k^T``,
soft-capped (``cap * tanh(x / cap)``) with ``soft_cap``, plus the bias.
The block math below is written once, on arrays with any leading dims, and
runs in the XLA programs and inside both kernels; ``dot`` is the
implementation's matmul ``(a, b, kind) -> stats dtype`` of kind ``"qk"``
(``a b^T``), ``"pv"`` (``a b``), ``"tn"`` (``a^T b``) or ``"qk2"`` (on pairs,
``a0 b0^T + a1 b1^T``: the logits' tangent).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax.op.signature import Named, Operand, ResidualSignature, Signature
from pallax.pallas_utils import stat_dtype

NEG_INF = float("-inf")

# The op's operands by name (``pallax.op.signature``): the inputs lead every
# stage's operands; the tangent stage adds out, lse and the inputs' tangents
# (q_dot, k_dot, v_dot, bias_dot, sinks_dot), the backward stage out, lse,
# dout and dlse, returning dq, dk, dv, dbias and dsinks.
SIGNATURE = ResidualSignature(
  inputs=(
    Operand("q", differentiable=True),
    Operand("k", differentiable=True),
    Operand("v", differentiable=True),
    Operand("q_len"),
    Operand("kv_len"),
    # A constant bias (its tangent a symbolic zero) is not differentiated:
    # no tangent of it read, no (T, S) gradient of it written.
    Operand(
      "bias", when="has_bias", differentiable=True, broadcast=True, tangent_when="bias_tangent"
    ),
    Operand("mask", when="has_mask", broadcast=True),
    Operand("q_seg", when="has_segments"),
    Operand("kv_seg", when="has_segments"),
    Operand("sinks", when="has_sinks", differentiable=True, broadcast=True),
  ),
  outputs=(Operand("out", differentiable=True), Operand("lse", differentiable=True)),
)


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts of one attention call."""

  batch: int
  kv_heads: int
  groups: int
  t: int
  s: int
  head_dim: int
  value_dim: int
  dtype: Any
  scale: float
  left: Optional[int]
  right: Optional[int]
  has_lengths: bool
  has_bias: bool
  has_mask: bool
  has_segments: bool
  has_sinks: bool
  soft_cap: Optional[float]
  bias_batch: bool  # the bias (and mask) vary over the batch
  bias_heads: bool  # ... and over the heads
  bias_dtype: Any = None  # the bias' (None without one)
  bias_tangent: bool = True  # the tangent and backward stages differentiate the bias (if any)

  @classmethod
  def of(cls, avals: Sequence[Any], **params) -> Problem:
    """The facts of a call of any stage, from its operands' avals and its params."""
    return cls.of_inputs(inputs(avals, params), params)

  @classmethod
  def of_inputs(cls, ops: Mapping[str, Any], params: Mapping[str, Any]) -> Problem:
    """The facts of a call, from its inputs (arrays or avals) by name and its params."""
    q, k, v = ops["q"], ops["k"], ops["v"]
    b, kh, g, t, h = q.shape
    extra = ops.get("bias")
    extra = ops.get("mask") if extra is None else extra
    return cls(
      b,
      kh,
      g,
      t,
      k.shape[2],
      h,
      v.shape[3],
      q.dtype,
      params["scale"],
      params["window_left"],
      params["window_right"],
      params["has_lengths"],
      params["has_bias"],
      params["has_mask"],
      params["has_segments"],
      params["has_sinks"],
      params["logits_soft_cap"],
      extra is not None and extra.shape[0] > 1,
      extra is not None and varies_over_heads(extra),
      None if ops.get("bias") is None else ops["bias"].dtype,
      params.get("bias_tangent", True),
    )

  @property
  def differentiates_bias(self) -> bool:
    """Whether the call differentiates its bias (not a constant one).

    The tangent then reads the bias' tangent, and the backward returns its
    gradient (the logits' gradient, summed).
    """
    return self.has_bias and self.bias_tangent

  @property
  def stat(self) -> jnp.dtype:
    """Dtype of logits, softmax statistics and accumulators."""
    return stat_dtype(self.dtype)

  @property
  def last_query_tile_first(self) -> bool:
    """Whether the GPU kernels' query tiles run last to first: under a causal mask.

    A GPU starts blocks of threads in the grid's order, and under a causal
    mask (a window's right bound alone) a later query tile sees more keys, so
    the query tiles run last to first there: the longest start first and the
    shortest fill the last wave, as FlashAttention's schedulers order causal
    tiles. In a greedy model of 132 SMs taking blocks of threads in order (a
    tile's time its key blocks plus one), the Mosaic GPU causal forward at
    B=4, S=4096, 16 heads (2048 blocks of threads, heads innermost) left the
    SMs 5.7% idle first to last and 0.9% last to first; at B=2, S=8192, 5.8%
    and 0.4%. The Triton grids take a head's query blocks innermost, so the
    order turns within each head there and gains less (``docs/mosaic_gpu.md``).
    Key tiles need no turning: under a causal mask the first see the most
    queries.
    """
    return self.right is not None and self.left is None

  def query_tile(self, index, tiles: int):
    """Grid index ``index``'s query tile of ``tiles`` (``last_query_tile_first``)."""
    return tiles - 1 - index if self.last_query_tile_first else index


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A call cut into (block_q, block_k) blocks, as the kernels' grids see it."""

  p: Problem
  bq: int
  bk: int

  @property
  def nq(self) -> int:
    return -(-self.p.t // self.bq)

  @property
  def nk(self) -> int:
    return -(-self.p.s // self.bk)

  def query_block(self, index):
    """The query block the grid's index ``index`` computes (``Problem.query_tile``)."""
    return self.p.query_tile(index, self.nq)

  def query_start(self, index):
    """The first query of the block the grid's index ``index`` computes."""
    return self.query_block(index) * self.bq

  def heads(self, n):
    """``(kv head, group)`` of the grid's query head ``n``."""
    g = jnp.int32(self.p.groups)
    return lax.div(n, g), lax.rem(n, g)

  def grid(self, blocks: int) -> tuple[int, int, int]:
    """(``blocks``, query heads, batch): the grid of the Triton kernels."""
    return (blocks, self.p.kv_heads * self.p.groups, self.p.batch)


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a stage of an implementation, as its kernels see it.

  Attributes:
    sig: the stage's operand and result names for the call's params.
    p: its static facts, built once here and passed down to every helper.
    ops: its operands by name (an absent optional one is None).
  """

  sig: Signature
  p: Problem
  ops: Named

  @classmethod
  def of(cls, stage: str, operands: Sequence[Any], params: Mapping[str, Any]) -> Call:
    """The call of ``stage`` (``"fwd"``, ``"jvp"`` or ``"bwd"``) on ``operands`` with ``params``."""
    sig = SIGNATURE.stage(stage, params)
    ops = sig.unpack(operands)
    return cls(sig, Problem.of_inputs(ops, params), ops)

  def results(self, named: Mapping[str, Any]) -> list:
    """The stage's results from ``named`` (absent optional ones may be left out or None)."""
    return self.sig.pack(named, results=True)


# A kernel's inputs or outputs by name: per name an array (an output's shape)
# and its BlockSpec, in the order the kernel binds them.
Bound = dict[str, tuple[Any, Any]]


def unzip(bound: Bound) -> tuple[list, list]:
  """The arrays (or shapes) and the BlockSpecs of ``bound``, in its order."""
  return [x for x, _ in bound.values()], [spec for _, spec in bound.values()]


def by_name(kernel: Callable[[Named], None], names: Sequence[str], optional: Sequence[str] = ()):
  """``kernel``, which takes its refs by name, as Pallas calls it: refs in the order of ``names``.

  ``optional``: names a call may lack, which then read as None.
  """

  @functools.wraps(kernel)
  def body(*refs):
    return kernel(Named(zip(names, refs, strict=True), optional=optional))

  return body


def inputs(operands: Sequence[Any], params) -> Named:
  """The op's inputs by name, from the operands (or avals) of any of its stages, which they lead."""
  fwd = SIGNATURE.stage("fwd", params)
  return fwd.unpack(operands[: len(fwd.operands)])


def varies_over_heads(extra) -> bool:
  """Whether a bias-like (Bb, Kb, Gb, T, S) operand has its own tile per query head."""
  return extra.shape[1] * extra.shape[2] > 1


def extra_lead(extra, b, kv_head, group) -> tuple:
  """The leading block indices of a bias-like operand for batch ``b`` and that query head."""
  heads = (kv_head, group) if varies_over_heads(extra) else (0, 0)
  return (b if extra.shape[0] > 1 else 0, *heads)


def visible(
  p: Problem, t_pos, s_pos, q_len=None, kv_len=None, q_seg=None, kv_seg=None
) -> Optional[jax.Array]:
  """Which (query, key) positions see each other; None: all of them.

  ``t_pos``, ``s_pos``: int32 positions broadcasting against each other (a
  column and a row of a block); ``q_seg``/``kv_seg`` the segment ids at those
  positions, shaped alike (read with segments only). ``q_len``/``kv_len`` are
  only read with lengths. Positions past the arrays' ends are the caller's to
  mask. A ``q_len`` of None leaves queries past their length visible (a
  kernel that hides them otherwise).
  """
  out = None

  def both(a, b):
    return b if a is None else a & b

  if p.has_segments:
    out = q_seg == kv_seg
  if p.has_lengths:  # both lengths in one `&` of two comparisons, as ever: a
    # reordering of this expression spilled 76 bytes in Triton's dk/dv on A100.
    inside = s_pos < kv_len if q_len is None else (t_pos < q_len) & (s_pos < kv_len)
    out = both(out, inside)
  if p.left is not None:
    out = both(out, s_pos >= t_pos - p.left)
  if p.right is not None:
    out = both(out, s_pos <= t_pos + p.right)
  return out


def block_unmasked(
  p: Problem, t0, s0, block_q: int, block_k: int, q_len=None, kv_len=None, one_segment=None
):
  """Whether every query of a block sees every key of it (its logits need no mask).

  Python False with a user mask (it is data); otherwise a traced bool from the
  window, lengths (the shortest example's, for a block shared by a batch) and,
  with segments, ``one_segment``: whether the block's queries and keys all
  share one segment. Keys past ``S`` count as masked.
  """
  if p.has_mask:
    return False
  ok = s0 + block_k <= p.s
  if p.has_segments:
    ok = ok & one_segment
  if p.has_lengths:
    ok = ok & (t0 + block_q <= q_len) & (s0 + block_k <= kv_len)
  if p.left is not None:
    ok = ok & (s0 >= t0 + block_q - 1 - p.left)
  if p.right is not None:
    ok = ok & (s0 + block_k - 1 <= t0 + p.right)
  return ok


def _div(a, b: int):
  """``a // b`` of a non-negative int32 scalar (``lax.div``: Triton has no floor division)."""
  return lax.div(a, jnp.int32(b))


def _visible_blocks(start, own: int, other: int, extent: int, ahead, behind, own_len, other_len):
  """``[lo, hi)`` of the other side's blocks that a block of ``own`` rows at ``start`` meets.

  ``ahead``/``behind``: how far past (before) its own positions the block sees
  (None: unbounded); ``own_len``/``other_len``: the lengths (None: whole).
  """
  start = jnp.asarray(start, jnp.int32)
  hi_pos = jnp.int32(extent)
  if other_len is not None:
    hi_pos = jnp.minimum(hi_pos, other_len)
  if ahead is not None:
    hi_pos = jnp.minimum(hi_pos, start + (own + ahead))
  lo = jnp.int32(0)
  if behind is not None:
    lo = _div(jnp.maximum(start - behind, 0), other)
  hi = _div(jnp.maximum(hi_pos, 0) + (other - 1), other)
  if own_len is not None:
    hi = jnp.where(start < own_len, hi, 0)
  return lo, jnp.maximum(hi, lo)


def _intersect(r, other):
  if other is None:
    return r
  lo = jnp.maximum(r[0], other[0])
  return lo, jnp.maximum(jnp.minimum(r[1], other[1]), lo)


def key_range(p: Problem, t0, block_q: int, block_k: int, q_len=None, kv_len=None, seg=None):
  """``[lo, hi)`` of the key blocks a query block starting at ``t0`` can see.

  Blocks outside are entirely hidden (causal, window, lengths) and skipped;
  ``seg``: the ``[lo, hi)`` of the key blocks its segments meet (``SEG_LO``,
  ``SEG_HI`` of its row of ``segment_tables``), intersected with the rest.
  """
  lens = (q_len, kv_len) if p.has_lengths else (None, None)
  return _intersect(_visible_blocks(t0, block_q, block_k, p.s, p.right, p.left, *lens), seg)


def query_range(p: Problem, s0, block_q: int, block_k: int, q_len=None, kv_len=None, seg=None):
  """``[lo, hi)`` of the query blocks that can see a key block starting at ``s0``."""
  lens = (kv_len, q_len) if p.has_lengths else (None, None)
  return _intersect(_visible_blocks(s0, block_k, block_q, p.t, p.left, p.right, *lens), seg)


# Columns of ``segment_tables``' rows.
SEG_MIN, SEG_MAX, SEG_LO, SEG_HI = range(4)


def _block_bounds(seg, block: int):
  """Per-block min and max of ``(B, L)`` segment ids; the last block padded with its edge."""
  n = -(-seg.shape[1] // block)
  seg = jnp.pad(seg, ((0, 0), (0, n * block - seg.shape[1])), mode="edge")
  seg = seg.reshape(seg.shape[0], n, block)
  return jnp.min(seg, axis=-1), jnp.max(seg, axis=-1)


def segments_meet(q_min, q_max, k_min, k_max):
  """Whether a query block's and a key block's segment ranges intersect (else: skip it)."""
  return (q_min <= k_max) & (k_min <= q_max)


def one_segment(q_min, q_max, k_min, k_max):
  """Whether a block's queries and keys all share one segment (no segment mask needed)."""
  return (q_min == q_max) & (k_min == k_max) & (q_min == k_min)


def segment_blocks(q_seg, kv_seg, block_q: int, block_k: int):
  """``(meets, one)``, ``(B, nq, nk)`` bools: which blocks' segments meet / are one."""
  q_bounds = tuple(x[:, :, None] for x in _block_bounds(q_seg, block_q))
  k_bounds = tuple(x[:, None, :] for x in _block_bounds(kv_seg, block_k))
  return segments_meet(*q_bounds, *k_bounds), one_segment(*q_bounds, *k_bounds)


def _first_last(meets, axis: int):
  """``[lo, hi)`` spanning the True entries along ``axis`` (``[0, 0)`` where none)."""
  n = meets.shape[axis]
  lo = jnp.argmax(meets, axis=axis)
  hi = n - jnp.argmax(jnp.flip(meets, axis=axis), axis=axis)
  found = jnp.any(meets, axis=axis)
  return jnp.where(found, lo, 0), jnp.where(found, hi, 0)


def meeting_runs(meets):
  """Per query block the ``[lo, hi)`` of the key blocks it meets, and per key block its own.

  ``meets (..., nq, nk)``: which (query block, key block) pairs meet.
  """
  return _first_last(meets, meets.ndim - 1), _first_last(meets, meets.ndim - 2)


def segment_tables(q_seg, kv_seg, block_q: int, block_k: int):
  """The segment ids' per-block facts, computed once per call (int32).

  ``q_tab (B, nq, 4)``: per query block its min and max segment id
  (``SEG_MIN``, ``SEG_MAX``) and the ``[SEG_LO, SEG_HI)`` of the key blocks
  whose segment ranges meet it; ``k_tab (B, nk, 4)`` the same for key blocks
  and query blocks. Sorted (packed) ids meet in one contiguous run of blocks;
  the kernels loop over that run and skip blocks inside it that do not meet.
  """
  q_min, q_max = _block_bounds(q_seg, block_q)
  k_min, k_max = _block_bounds(kv_seg, block_k)
  meets = segments_meet(q_min[:, :, None], q_max[:, :, None], k_min[:, None, :], k_max[:, None, :])
  key_run, query_run = meeting_runs(meets)
  q_tab = jnp.stack([q_min, q_max, *key_run], axis=-1)
  k_tab = jnp.stack([k_min, k_max, *query_run], axis=-1)
  return q_tab.astype(jnp.int32), k_tab.astype(jnp.int32)


def soft_cap(s, cap: Optional[float]):
  """``cap * tanh(s / cap)`` (Gemma 2's logit soft-capping); ``s`` itself without a cap."""
  return s if cap is None else cap * jnp.tanh(s / cap)


def logits(p: Problem, dot, q, k):
  """``scale * q k^T``, soft-capped, and the cap's derivative (None without a cap)."""
  z = dot(q, k, "qk") * p.scale
  if p.soft_cap is None:
    return z, None
  t = jnp.tanh(z / p.soft_cap)
  return p.soft_cap * t, 1.0 - t * t


def scores(p: Problem, dot, q, k, bias=None, keep=None, cap_grad: bool = False):
  """``logits + bias`` in the stats dtype, -inf where ``keep`` is False.

  With ``cap_grad``, ``(scores, g)`` where ``g`` is the soft cap's derivative
  (None without a cap): the backward and tangent scale the logits' gradient
  (tangent) by it on its way to (from) ``q`` and ``k``.
  """
  s, g = logits(p, dot, q, k)
  if bias is not None:
    s = s + bias.astype(s.dtype)
  s = s if keep is None else jnp.where(keep, s, NEG_INF)
  return (s, g) if cap_grad else s


def _through_cap(ds, g):
  return ds if g is None else ds * g


def online_init(p: Problem, shape_rows, width: int):
  """The forward's accumulators for rows of shape ``shape_rows``: max, sum, output."""
  return (
    jnp.full((*shape_rows, 1), NEG_INF, p.stat),
    jnp.zeros((*shape_rows, 1), p.stat),
    jnp.zeros((*shape_rows, width), p.stat),
  )


def online_step(carry, s, v, dot):
  """One key block of the online softmax: ``s`` the block's scores, ``v`` its values."""
  m, denom, acc = carry
  m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing visible yet
  alpha = jnp.exp(m - m_safe)
  e = jnp.exp(s - m_safe)
  denom = alpha * denom + jnp.sum(e, axis=-1, keepdims=True)
  acc = alpha * acc + dot(e.astype(v.dtype), v, "pv")
  return m_new, denom, acc


def online_finish(carry):
  """``(out, lse)`` from the accumulators: 0 and -inf where nothing was visible.

  ``lse`` is a column (rows, 1), as every function here takes it.
  """
  m, denom, acc = carry
  empty = denom == 0.0
  out = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, denom))
  lse = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, denom)))
  return out, lse


class ScratchSoftmax:
  """The online softmax's accumulators (max, sum, output) in a kernel's scratch refs.

  For the paged TPU kernels, whose grid's last axis walks the key blocks
  with the accumulators in VMEM between steps.
  """

  def __init__(self, refs: Sequence[Any]):
    self.refs = refs

  def _store(self, values) -> None:
    for ref, value in zip(self.refs, values):
      ref[...] = value

  def init(self, p: Problem, shape_rows, width: int) -> None:
    """``online_init``'s accumulators, stored."""
    self._store(online_init(p, shape_rows, width))

  def step(self, s, v, dot) -> None:
    """``online_step`` of the stored accumulators with a key block, stored back."""
    self._store(online_step(tuple(ref[...] for ref in self.refs), s, v, dot))

  def finish(self):
    """``(out, lse)``: ``online_finish`` of the accumulators."""
    return online_finish(tuple(ref[...] for ref in self.refs))


def stack_pages(refs: Sequence[Any]) -> jax.Array:
  """The pages a step fetched, one ref each, stacked along the keys."""
  return refs[0][...] if len(refs) == 1 else jnp.concatenate([r[...] for r in refs], 0)


def probs(s, lse):
  """``exp(s - lse)``, the softmax recomputed from the saved ``lse`` column (0 on empty rows)."""
  return jnp.exp(s - jnp.where(lse == NEG_INF, jnp.inf, lse))


def bwd_probs(p: Problem, dot, v, do, s, lse, delta):
  """One block of the backward: the probabilities and the logits' gradient ``ds``.

  ``delta = rowsum(do * out)`` and ``lse`` are columns; ``ds`` is also the
  bias' gradient.
  """
  pr = probs(s, lse)
  return pr, pr * (dot(do, v, "qk") - delta)


def bwd_delta(stat, out, do, dlse):
  """``rowsum(do * out) - dlse`` in the stats dtype ``stat``.

  With ``lse``'s cotangent ``dlse``, ``ds = P (dp - delta)`` still.
  """
  return jnp.sum(do.astype(stat) * out.astype(stat), axis=-1) - dlse.astype(stat)


def reduce_bias_grad(ds: jax.Array, bias) -> jax.Array:
  """The logits' gradient ``(B, K, G, T, S)`` summed over the dims ``bias`` broadcasts."""
  axes = tuple(d for d in range(3) if bias.shape[d] == 1 and ds.shape[d] != 1)
  return jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)


def backward(c: Call, dq_pass, dkdv_pass) -> list[jax.Array]:
  """The backward stage's results (``dq, dk, dv``, ``dbias``) of a kernel backend from its passes.

  Both passes take ``(lse, delta, dout)`` and give their results by name:
  ``dq_pass`` gives ``dq`` and, with a bias, ``ds``, the logits' gradient
  ``(B, K, G, T, S)``; ``dkdv_pass`` gives ``dk`` and ``dv`` per query head
  ``(B, K, G, S, x)``, summed here over each kv head's query heads.
  """
  p, ops = c.p, c.ops
  delta = bwd_delta(p.stat, ops.out, ops.dout, ops.dlse)
  dq = dq_pass(ops.lse, delta, ops.dout)
  dkdv = dkdv_pass(ops.lse, delta, ops.dout)
  dk, dv = (jnp.sum(dkdv[n], axis=2).astype(p.dtype) for n in ("dk", "dv"))
  ds = dq.get("ds")
  dbias = None if ds is None else reduce_bias_grad(ds, ops.bias)
  return c.results({"dq": dq["dq"], "dk": dk, "dv": dv, "dbias": dbias})


def bwd_dq(p: Problem, dot, ds, k, g=None):
  """A key block's contribution to ``dq`` (``g``: the soft cap's derivative)."""
  return dot(_through_cap(ds, g).astype(k.dtype), k, "pv") * p.scale


def bwd_dkdv(p: Problem, dot, pr, ds, q, do, g=None):
  """A query block's contributions to ``dk`` and ``dv``."""
  dk = dot(_through_cap(ds, g).astype(q.dtype), q, "tn") * p.scale
  return dk, dot(pr.astype(do.dtype), do, "tn")


def block_dot(a, b, kind: str):
  """``dot`` of the kernels, on 2-D blocks, accumulating in the stats dtype."""
  if kind == "qk2":
    return block_dot(a[0], b[0], "qk") + block_dot(a[1], b[1], "qk")
  if kind == "qk":
    dims, (a, b) = (((1,), (1,)), ((), ())), (a, b)
  else:  # "pv", and "tn" as a transposed "pv" (Mosaic's dots want the lhs contracted last)
    dims, (a, b) = (((1,), (0,)), ((), ())), (a.T if kind == "tn" else a, b)
  st = stat_dtype(a.dtype)
  precision = lax.Precision.HIGHEST if a.dtype == st else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=st)


def tangent_block(p: Problem, dot, q, k, v, s, lse, dq, dk, dv, dbias=None, g=None):
  """One key block of the tangent: ``(sum P dS v, rowsum P dS, P dv)``, stats dtype.

  ``dS = g scale (dq k^T + q dk^T) + dbias`` is the logits' tangent (``g`` the
  soft cap's derivative); over the blocks, the output's tangent is
  ``sum P dS v - rowsum(P dS) out + P dv`` and ``lse``'s is ``rowsum(P dS)``.
  """
  pr = probs(s, lse)
  ds = _through_cap(dot((dq, q), (k, dk), "qk2") * p.scale, g)
  if dbias is not None:
    ds = ds + dbias.astype(ds.dtype)
  pds = pr * ds
  return (
    dot(pds.astype(v.dtype), v, "pv"),
    jnp.sum(pds, axis=-1, keepdims=True),
    dot(pr.astype(dv.dtype), dv, "pv"),
  )


def _sink_probs(sinks, lse):
  """``exp(sink - lse)``, each row's probability of its head's sink (0 where lse is -inf)."""
  sink = sinks.astype(lse.dtype)[..., None]
  return jnp.where(lse == NEG_INF, 0.0, jnp.exp(sink - jnp.where(lse == NEG_INF, 0.0, lse)))


def with_sinks(stage: str, fn):
  """``fn``, one stage of an implementation that knows no sinks, taking them.

  A sink is a logit of value 0 in every row's softmax. With ``out0``, ``lse0``
  the results without it, ``lse = logaddexp(lse0, sink)`` and
  ``out = out0 exp(lse0 - lse)``: an exact rescaling of the output rows. Given
  these ``out`` and ``lse``, the implementation's tangent and backward are
  already right for q, k, v and bias (they recompute ``P`` from ``lse``); the
  sink's own terms use ``P_sink = exp(sink - lse)``: the tangent adds
  ``P_sink dsink`` to ``lse``'s tangent and subtracts it times ``out`` from
  the output's, and ``dsink = -sum_rows P_sink (rowsum(do * out) - dlse)``.
  """

  def run(*operands, **params):
    if not params["has_sinks"]:
      return fn(*operands, **params)
    sig = SIGNATURE.stage(stage, params)
    ops = sig.unpack(operands)
    inner = dict(params, has_sinks=False)
    inner_sig = SIGNATURE.stage(stage, inner)
    base = inner_sig.unpack(fn(*inner_sig.pack(ops), **inner), results=True)
    st = stat_dtype(ops.q.dtype)
    if stage == "fwd":
      lse = jnp.logaddexp(base.lse, ops.sinks.astype(st)[..., None])
      empty = base.lse == NEG_INF
      rescale = jnp.where(empty, 0.0, jnp.exp(jnp.where(empty, 0.0, base.lse) - lse))
      out = (base.out.astype(st) * rescale[..., None]).astype(base.out.dtype)
      return sig.pack({"out": out, "lse": lse}, results=True)
    if stage == "jvp":
      r = _sink_probs(ops.sinks, ops.lse) * ops.sinks_dot.astype(st)[..., None]
      out_dot = base.out_dot.astype(st) - r[..., None] * ops.out.astype(st)
      named = {"out_dot": out_dot.astype(ops.out.dtype), "lse_dot": base.lse_dot + r}
      return sig.pack(named, results=True)
    sink_probs = _sink_probs(ops.sinks, ops.lse)
    dsinks = -jnp.sum(sink_probs * bwd_delta(st, ops.out, ops.dout, ops.dlse), axis=-1)
    if ops.sinks.shape[0] == 1:
      dsinks = jnp.sum(dsinks, axis=0, keepdims=True)
    return sig.pack({**base, "dsinks": dsinks.astype(ops.sinks.dtype)}, results=True)

  return run
