"""The attention XLA programs: blockwise online softmax, the CPU path.

Memory is ``O(T x block)``: no program holds a ``[T, S]`` array (except the
bias gradient, which is one). Each query block loops over only the key
blocks it can see (``common.key_range``), and the backward's key blocks over
only the query blocks that see them, so a causal forward does about half the
work of the dense one. Operands are padded to whole blocks; padded keys are
hidden, padded queries cut off.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallax.kernels.attention.common import (
  NEG_INF,
  Call,
  Problem,
  block_unmasked,
  bwd_delta,
  bwd_dkdv,
  bwd_dq,
  bwd_probs,
  key_range,
  meeting_runs,
  online_finish,
  online_init,
  online_step,
  query_range,
  reduce_bias_grad,
  scores,
  segment_blocks,
  tangent_block,
  visible,
)
from pallax.op.signature import Named

# Blocks of the XLA programs: CPU matmuls of (512 x 64) @ (64 x 512) per head
# run near the machine's peak, and a block's logits stay in cache.
BLOCK_Q = 512
BLOCK_K = 512

_EINSUM = {"qk": "bkgmd,bknd->bkgmn", "pv": "bkgmn,bknd->bkgmd", "tn": "bkgnm,bkgnd->bkmd"}


def _dot(a, b, kind):
  """The block matmuls on (B, K, G, rows, cols) and (B, K, rows, cols) blocks.

  ``"qk2"``, ``a0 b0^T + a1 b1^T``, is one product over the concatenated
  contraction: also a workaround, as the sum of the two products gave
  uninitialised values in a jit'd jvp of grouped-query attention on XLA:CPU
  (jax 0.10.2; the algebraic simplifier's rewrite of it, which
  ``--xla_disable_hlo_passes=algsimp`` avoided).
  """
  if kind == "qk2":
    a, b, kind = jnp.concatenate(a, axis=-1), jnp.concatenate(b, axis=-1), "qk"
  st = jnp.promote_types(a.dtype, jnp.float32)
  precision = lax.Precision.HIGHEST if a.dtype == b.dtype == st else None
  return jnp.einsum(_EINSUM[kind], a, b, preferred_element_type=st, precision=precision)


class _Blocks:
  """The call cut into (block_q, block_k) blocks; slices with positions and visibility."""

  def __init__(self, p: Problem, ops: Named):
    self.p, self.ops = p, ops
    self.bq, self.bk = min(p.t, BLOCK_Q), min(p.s, BLOCK_K)
    self.nq, self.nk = -(-p.t // self.bq), -(-p.s // self.bk)
    self.tp, self.sp = self.nq * self.bq, self.nk * self.bk
    lengths = ops.q_len, ops.kv_len
    # Block ranges are shared by the batch: the longest example's.
    self.max_len = tuple(jnp.max(a) for a in lengths) if p.has_lengths else (None, None)
    self.min_len = tuple(jnp.min(a) for a in lengths) if p.has_lengths else (None, None)
    self.len5 = tuple(a[:, None, None, None, None] for a in lengths)
    self.bias = self.pad_ts(ops.bias)
    self.mask = self.pad_ts(ops.mask)
    self.meets = self.one = self.runs = None
    if p.has_segments:
      # Blocks span the batch: a block runs where any example's segments meet.
      meets, one = segment_blocks(ops.q_seg, ops.kv_seg, self.bq, self.bk)
      self.meets, self.one = jnp.any(meets, axis=0), jnp.all(one, axis=0)
      self.runs = meeting_runs(self.meets)
      self.q_seg = self.pad(ops.q_seg, 1, self.tp)[:, None, None, :, None]
      self.kv_seg = self.pad(ops.kv_seg, 1, self.sp)[:, None, None, None, :]

  def pad(self, x, axis: int, to: int, value=0):
    """``x`` padded with ``value`` to ``to`` along ``axis``."""
    if x is None or x.shape[axis] == to:
      return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)

  def pad_ts(self, x):
    return self.pad(self.pad(x, 3, self.tp), 4, self.sp)

  def pad_t(self, x, axis=3, value=0):
    return self.pad(x, axis, self.tp, value)

  def pad_s(self, x):
    return self.pad(x, 2, self.sp)

  def keep(self, t0, s0):
    """Visibility of the block at (t0, s0), shape broadcasting to (B, K, G, bq, bk)."""
    t_pos = t0 + lax.broadcasted_iota(jnp.int32, (self.bq, 1), 0)
    s_pos = s0 + lax.broadcasted_iota(jnp.int32, (1, self.bk), 1)
    segs = (None, None)
    if self.p.has_segments:
      segs = (_slice(self.q_seg, t0, self.bq, 3), _slice(self.kv_seg, s0, self.bk, 4))
    out = visible(self.p, t_pos, s_pos, *self.len5, *segs)
    if self.sp != self.p.s:
      out = s_pos < self.p.s if out is None else out & (s_pos < self.p.s)
    if self.mask is not None:
      blk = lax.dynamic_slice_in_dim(
        lax.dynamic_slice_in_dim(self.mask, t0, self.bq, 3), s0, self.bk, 4
      )
      out = blk if out is None else out & blk
    return out

  def bias_block(self, t0, s0):
    if self.bias is None:
      return None
    return lax.dynamic_slice_in_dim(
      lax.dynamic_slice_in_dim(self.bias, t0, self.bq, 3), s0, self.bk, 4
    )

  def scores(self, q_blk, k_blk, t0, s0):
    """The block's logits and the soft cap's derivative (``common.scores``).

    Blocks every query sees whole skip the mask's arithmetic.
    """
    bias = self.bias_block(t0, s0)
    keep = self.keep(t0, s0)
    run = lambda keep: scores(self.p, _dot, q_blk, k_blk, bias, keep, cap_grad=True)
    if keep is None:
      return run(None)
    one = None if self.one is None else self.one[t0 // self.bq, s0 // self.bk]
    unmasked = block_unmasked(self.p, t0, s0, self.bq, self.bk, *self.min_len, one)
    if unmasked is False:
      return run(keep)
    return lax.cond(unmasked, lambda: run(None), lambda: run(keep))

  def skip_unmet(self, step, t0, s0):
    """``step(carry)`` where the block's segments meet, else the carry unchanged."""
    if self.meets is None:
      return step
    meets = self.meets[t0 // self.bq, s0 // self.bk]
    return lambda carry: lax.cond(meets, step, lambda c: c, carry)

  def key_range(self, t0):
    seg = None if self.runs is None else tuple(r[t0 // self.bq] for r in self.runs[0])
    return key_range(self.p, t0, self.bq, self.bk, *self.max_len, seg)

  def query_range(self, s0):
    seg = None if self.runs is None else tuple(r[s0 // self.bk] for r in self.runs[1])
    return query_range(self.p, s0, self.bq, self.bk, *self.max_len, seg)


def _slice(x, start, size, axis):
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _update(buf, blk, start, axis):
  return lax.dynamic_update_slice_in_dim(buf, blk, start, axis)


def _per_query_block(blocks: _Blocks, q, step, init, finish, outs):
  """Runs ``step`` over each query block's visible key blocks; writes ``finish`` into ``outs``.

  ``step(carry, q_blk, t0, s0, j) -> carry``; ``finish(carry, t0) -> blocks``
  (one per buffer of ``outs``, each with T on axis 3).
  """
  bq = blocks.bq

  def q_block(i, bufs):
    t0 = i * bq
    q_blk = _slice(q, t0, bq, 3)
    lo, hi = blocks.key_range(t0)

    def body(j, carry):
      s0 = j * blocks.bk
      return blocks.skip_unmet(lambda c: step(c, q_blk, t0, s0), t0, s0)(carry)

    carry = lax.fori_loop(lo, hi, body, init)
    return tuple(_update(b, x, t0, 3) for b, x in zip(bufs, finish(carry, t0)))

  return lax.fori_loop(0, blocks.nq, q_block, outs)


def attention_fwd(*operands, **params):
  """``(out, lse)``: the forward."""
  c = Call.of("fwd", operands, params)
  p, ops = c.p, c.ops
  blocks = _Blocks(p, ops)
  q, k, v = blocks.pad_t(ops.q), blocks.pad_s(ops.k), blocks.pad_s(ops.v)
  b, kh, g = p.batch, p.kv_heads, p.groups

  def step(carry, q_blk, t0, s0):
    s, _ = blocks.scores(q_blk, _slice(k, s0, blocks.bk, 2), t0, s0)
    return online_step(carry, s, _slice(v, s0, blocks.bk, 2), _dot)

  def finish(carry, t0):
    out, lse = online_finish(carry)
    return out.astype(p.dtype), lse[..., 0]

  outs = (
    jnp.zeros((b, kh, g, blocks.tp, p.value_dim), p.dtype),
    jnp.zeros((b, kh, g, blocks.tp), p.stat),
  )
  init = online_init(p, (b, kh, g, blocks.bq), p.value_dim)
  out, lse = _per_query_block(blocks, q, step, init, finish, outs)
  return c.results({"out": out[:, :, :, : p.t], "lse": lse[..., : p.t]})


def attention_jvp(*operands, **params):
  """``(out_dot, lse_dot)``: the tangents, linear in ``(dq, dk, dv[, dbias])``."""
  c = Call.of("jvp", operands, params)
  p, ops = c.p, c.ops
  # A barrier keeps XLA from seeing constant (zero) tangents: its algebraic
  # simplifier's rewrites of them gave uninitialised values on the CPU.
  own = [n for n in ("out", "lse", "q_dot", "k_dot", "v_dot", "bias_dot") if n in ops]
  barred = dict(zip(own, lax.optimization_barrier([ops[n] for n in own]), strict=True))
  blocks = _Blocks(p, ops)
  q, dq, out = blocks.pad_t(ops.q), blocks.pad_t(barred["q_dot"]), blocks.pad_t(barred["out"])
  lse = blocks.pad_t(barred["lse"], value=NEG_INF)
  k, v, dk, dv = (blocks.pad_s(x) for x in (ops.k, ops.v, barred["k_dot"], barred["v_dot"]))
  dbias = blocks.pad_ts(barred.get("bias_dot"))
  b, kh, g, bq, bk = p.batch, p.kv_heads, p.groups, blocks.bq, blocks.bk

  def step(carry, q_blk, t0, s0):
    cut = lambda x: _slice(x, s0, bk, 2)
    s, g = blocks.scores(q_blk, cut(k), t0, s0)
    db = None if dbias is None else _slice(_slice(dbias, t0, bq, 3), s0, bk, 4)
    lse_blk, dq_blk = _slice(lse, t0, bq, 3)[..., None], _slice(dq, t0, bq, 3)
    blk = (q_blk, cut(k), cut(v), s, lse_blk, dq_blk, cut(dk), cut(dv), db, g)
    terms = tangent_block(p, _dot, *blk)
    return tuple(a + t for a, t in zip(carry, terms))

  def finish(carry, t0):
    pdsv, rows, pdv = carry
    out_blk = _slice(out, t0, bq, 3).astype(p.stat)
    return (pdsv - rows * out_blk + pdv).astype(p.dtype), rows[..., 0]

  st = p.stat
  init = (
    jnp.zeros((b, kh, g, bq, p.value_dim), st),
    jnp.zeros((b, kh, g, bq, 1), st),
    jnp.zeros((b, kh, g, bq, p.value_dim), st),
  )
  outs = (
    jnp.zeros((b, kh, g, blocks.tp, p.value_dim), p.dtype),
    jnp.zeros((b, kh, g, blocks.tp), st),
  )
  dout, dlse = _per_query_block(blocks, q, step, init, finish, outs)
  return c.results({"out_dot": dout[:, :, :, : p.t], "lse_dot": dlse[..., : p.t]})


def attention_bwd(*operands, **params):
  """``(dq, dk, dv[, dbias])``: the backward, per key block over the query blocks seeing it."""
  c = Call.of("bwd", operands, params)
  p, ops = c.p, c.ops
  blocks = _Blocks(p, ops)
  st = p.stat
  delta = bwd_delta(st, ops.out, ops.dout, ops.dlse)
  q, do, delta = blocks.pad_t(ops.q), blocks.pad_t(ops.dout), blocks.pad_t(delta)
  lse = blocks.pad_t(ops.lse, value=NEG_INF)
  k, v = blocks.pad_s(ops.k), blocks.pad_s(ops.v)
  b, kh, g, bq, bk = p.batch, p.kv_heads, p.groups, blocks.bq, blocks.bk

  def k_block(j, bufs):  # dbias_buf: None without a bias
    dq_buf, dk_buf, dv_buf, dbias_buf = bufs
    s0 = j * bk
    k_blk, v_blk = _slice(k, s0, bk, 2), _slice(v, s0, bk, 2)

    def q_block(i, carry):
      dk_acc, dv_acc, dq_buf, dbias_buf = carry
      t0 = i * bq
      cut = lambda x: _slice(x, t0, bq, 3)
      q_blk = cut(q)
      s, g = blocks.scores(q_blk, k_blk, t0, s0)
      do_blk = cut(do)
      pr, ds = bwd_probs(p, _dot, v_blk, do_blk, s, cut(lse)[..., None], cut(delta)[..., None])
      dq_c = bwd_dq(p, _dot, ds, k_blk, g)
      dk_c, dv_c = bwd_dkdv(p, _dot, pr, ds, q_blk, do_blk, g)
      dq_buf = _update(dq_buf, cut(dq_buf) + dq_c, t0, 3)
      if dbias_buf is not None:
        dbias_buf = _update(dbias_buf, _update(cut(dbias_buf), ds, s0, 4), t0, 3)
      return (dk_acc + dk_c, dv_acc + dv_c, dq_buf, dbias_buf)

    lo, hi = blocks.query_range(s0)
    init = (
      jnp.zeros((b, kh, bk, p.head_dim), st),
      jnp.zeros((b, kh, bk, p.value_dim), st),
      dq_buf,
      dbias_buf,
    )
    skipping = lambda i, c: blocks.skip_unmet(lambda c: q_block(i, c), i * bq, s0)(c)
    dk_blk, dv_blk, dq_buf, dbias_buf = lax.fori_loop(lo, hi, skipping, init)
    dk_buf = _update(dk_buf, dk_blk.astype(dk_buf.dtype), s0, 2)
    dv_buf = _update(dv_buf, dv_blk.astype(dv_buf.dtype), s0, 2)
    return (dq_buf, dk_buf, dv_buf, dbias_buf)

  bufs = (
    jnp.zeros((b, kh, g, blocks.tp, p.head_dim), st),
    jnp.zeros((b, kh, blocks.sp, p.head_dim), p.dtype),
    jnp.zeros((b, kh, blocks.sp, p.value_dim), p.dtype),
    jnp.zeros((b, kh, g, blocks.tp, blocks.sp), st) if p.differentiates_bias else None,
  )
  dq, dk, dv, dbias = lax.fori_loop(0, blocks.nk, k_block, bufs)
  grads = {"dq": dq[:, :, :, : p.t].astype(p.dtype), "dk": dk[:, :, : p.s], "dv": dv[:, :, : p.s]}
  if dbias is not None:
    grads["dbias"] = reduce_bias_grad(dbias[..., : p.t, : p.s], ops.bias)
  return c.results(grads)
