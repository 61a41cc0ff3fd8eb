"""The cross-entropy XLA programs: the CPU path and the float64 reference's twin.

Each stage walks the vocabulary in chunks of ``chunk`` columns (a loop over
the whole chunks, then the remainder), so no more than ``(G, N, chunk)``
logits are ever held: the forward keeps running statistics, the tangent
running sums, the backward accumulates ``dx`` and writes each chunk's ``dw``
and ``db`` columns. The chunk is picked by size (``chunk_of``). The tile math
is ``common.py``'s, shared with the kernels.

``value_and_grad`` is the CPU's fused program for a scalar loss: chunks of
tokens over the whole vocabulary, so each chunk's ``lse`` is known at once and
its logits' cotangent follows without a second pass (three matmuls in all,
where the forward and backward stages take four).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallax.kernels.cross_entropy import common
from pallax.kernels.cross_entropy.common import BWD_STATS, SIGNATURE, Problem, operands
from pallax.op.signature import Named

# Logit elements per chunk: 4M float32 (16 MiB) keeps a chunk's logits and
# cotangents in the CPU's caches' reach while its matmuls stay large.
_CHUNK_ELEMENTS = 1 << 22
_MIN_CHUNK, _MAX_CHUNK = 128, 8192


def chunk_of(p: Problem) -> int:
  """Vocabulary columns per chunk: about ``_CHUNK_ELEMENTS`` logits, a multiple of 128."""
  rows = max(1, p.groups * p.tokens)
  chunk = max(_MIN_CHUNK, min(_MAX_CHUNK, _CHUNK_ELEMENTS // rows // 128 * 128))
  return min(chunk, p.vocab)


def _problem(ops, params) -> Problem:
  return Problem.of([jax.typeof(o) for o in ops], **params)


def _chunks(p: Problem, body, carry, *, total=None, size=None):
  """``body(start, size, carry)`` over chunks: a loop over the whole ones, then the remainder.

  The vocabulary's chunks of ``chunk_of(p)`` columns unless ``total`` and
  ``size`` say otherwise.
  """
  total, size = (p.vocab, chunk_of(p)) if total is None else (total, size)
  whole, rest = divmod(total, size)
  if whole:
    carry = lax.fori_loop(0, whole, lambda i, c: body(i * size, size, c), carry)
  if rest:
    carry = body(whole * size, rest, carry)
  return carry


def _w_chunk(o: Named, p: Problem, start, size):
  axis = 1 if p.transposed_weight else 2
  return lax.dynamic_slice_in_dim(o.w, start, size, axis)


def _dot(a, b, spec: str, dtype):
  return jnp.einsum(spec, a, b, preferred_element_type=dtype, precision=lax.Precision.HIGHEST)


def _logits(o: Named, p: Problem, start, size):
  """The chunk's raw logits ``(G, N, size)`` in the stats dtype."""
  st = p.stat_dtype
  if not p.linear:
    return lax.dynamic_slice_in_dim(o.x, start, size, 2).astype(st)
  spec = "gnd,gvd->gnv" if p.transposed_weight else "gnd,gdv->gnv"
  z = _dot(o.x, _w_chunk(o, p, start, size), spec, st)
  if o.b is not None:
    z = z + lax.dynamic_slice_in_dim(o.b, start, size, 1)[:, None, :].astype(st)
  return z


def _hit(o: Named, start, size):
  cols = start + lax.broadcasted_iota(jnp.int32, (1, 1, size), 2)
  return cols == o.labels[:, :, None]


def _label_logit(zc, labels, start):
  """Each row's logit at its label, 0 where the label is outside this chunk of columns.

  ``zc (..., rows, size)`` holds columns ``start`` to ``start + size``;
  ``labels (..., rows)`` are int32 (the public functions cast them), so
  ``labels - start`` cannot wrap. A gather of one logit a row, where
  comparing every column with the label would be a pass over the chunk
  (XLA:CPU writes that select out before reducing it).
  """
  size = zc.shape[-1]
  col = labels[..., None] - start
  picked = jnp.take_along_axis(zc, jnp.clip(col, 0, size - 1), axis=-1)
  return jnp.where((col >= 0) & (col < size), picked, 0)


def _rows(f, *tiles):
  """Applies a tile function written for ``(rows, cols)`` tiles to ``(G, N, cols)`` ones."""
  return jax.vmap(f)(*tiles)


def fwd(*ops, **params):
  o, p = operands("fwd", ops, params), _problem(ops, params)

  def body(start, size, acc):
    zc, _ = common.capped(_logits(o, p, start, size), p.soft_cap)
    m, s, zy, zsum = _rows(common.stats_update, acc, zc, None, None)
    return m, s, zy + _label_logit(zc, o.labels, start), zsum

  init = jax.vmap(lambda _: common.stats_init(p.tokens, p.stat_dtype))(jnp.arange(p.groups))
  return [s[..., 0] for s in common.stats_finish(_chunks(p, body, init))]


def _tangent_logits(o: Named, p: Problem, start, size):
  """The chunk's logits tangent ``dx w + x dw + db`` (or ``dlogits``)."""
  st = p.stat_dtype
  if not p.linear:
    return lax.dynamic_slice_in_dim(o.x_dot, start, size, 2).astype(st)
  dx, dw, db = o.x_dot, o.w_dot, o.b_dot
  spec = "gnd,gvd->gnv" if p.transposed_weight else "gnd,gdv->gnv"
  axis = 1 if p.transposed_weight else 2
  dz = _dot(dx, _w_chunk(o, p, start, size), spec, st)
  dz = dz + _dot(o.x, lax.dynamic_slice_in_dim(dw, start, size, axis), spec, st)
  if db is not None:
    dz = dz + lax.dynamic_slice_in_dim(db, start, size, 1)[:, None, :].astype(st)
  return dz


def jvp(*ops, **params):
  o, p = operands("jvp", ops, params), _problem(ops, params)
  lse = o.lse[..., None].astype(p.stat_dtype)

  def body(start, size, acc):
    zc, c = common.capped(_logits(o, p, start, size), p.soft_cap)
    dz = _tangent_logits(o, p, start, size)
    return _rows(common.tangent_update, acc, zc, c, lse, dz, _hit(o, start, size), None)

  zero = jnp.zeros((p.groups, p.tokens, 1), p.stat_dtype)
  return [t[..., 0] for t in _chunks(p, body, (zero, zero, zero))]


def bwd(*ops, **params):
  o, p = operands("bwd", ops, params), _problem(ops, params)
  st = p.stat_dtype
  lse, a_lse, a_zy, a_sum = (o[n][..., None].astype(st) for n in BWD_STATS)

  def g_of(start, size):
    zc, c = common.capped(_logits(o, p, start, size), p.soft_cap)
    hit = _hit(o, start, size)
    return _rows(common.cotangent, zc, c, lse, hit, None, a_lse, a_zy, a_sum)

  if not p.linear:

    def body(start, size, out):
      return lax.dynamic_update_slice_in_dim(out, g_of(start, size).astype(out.dtype), start, 2)

    return [_chunks(p, body, jnp.zeros(o.x.shape, o.x.dtype))]

  w_axis = 1 if p.transposed_weight else 2
  spec_dx = "gnv,gvd->gnd" if p.transposed_weight else "gnv,gdv->gnd"
  spec_dw = "gnv,gnd->gvd" if p.transposed_weight else "gnd,gnv->gdv"

  def body(start, size, carry):
    dx, dw, db = carry
    g = g_of(start, size)
    w = _w_chunk(o, p, start, size)
    dx = dx + _dot(g, w, spec_dx, st)
    args = (g, o.x) if p.transposed_weight else (o.x, g)
    dw_chunk = _dot(*args, spec_dw, st)
    dw = lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, w_axis)
    if db is not None:
      db = lax.dynamic_update_slice_in_dim(db, jnp.sum(g, axis=1).astype(db.dtype), start, 1)
    return dx, dw, db

  db0 = None if o.b is None else jnp.zeros(o.b.shape, o.b.dtype)
  dx, dw, db = _chunks(p, body, (jnp.zeros(o.x.shape, st), jnp.zeros(o.w.shape, o.w.dtype), db0))
  grads = dict(dx=dx.astype(o.x.dtype), dw=dw, db=db)
  return [grads[n] for n in SIGNATURE.stage("bwd", params).results]


# Logits per token chunk of ``value_and_grad``: 32M float32 (128 MiB). Each
# chunk adds x_chunk^T g to the whole dw, so larger chunks pass over dw fewer
# times; on the project's 2-core CPU, N x D x V = 8192 x 1024 x 131072 float32
# took 49 s with 16M-logit chunks and 43 s with 32M (the stages: 57 s).
_FUSED_ELEMENTS = 1 << 25


def token_chunk_of(p: Problem) -> int:
  """Tokens per chunk of ``value_and_grad``: about ``_FUSED_ELEMENTS`` logits, at least 8."""
  return max(1, min(p.tokens, max(8, _FUSED_ELEMENTS // p.vocab)))


def value_and_grad(*ops, ignore_index, label_smoothing, z_loss, reduction, **params):
  """A scalar loss and its gradients in one pass: ``(loss (G,), dx, dw[, db])``.

  For ``linear`` calls with a ``"mean"`` or ``"sum"`` reduction: each chunk
  of tokens computes its logits over the whole vocabulary once, its
  statistics, its loss, the statistics' cotangents (``jax.vjp`` of
  ``common.token_loss``), and from the logits' cotangent ``g`` its rows of
  ``dx = g w^T`` and its share of ``dw = x^T g`` and ``db``.
  """
  p = _problem(ops, params)
  options = dict(
    vocab=p.vocab, ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss
  )
  o = operands("fwd", ops, params)
  tokens = o.labels.shape[1:]
  flat = lambda a: a.reshape(p.groups, p.tokens, *a.shape[1 + len(tokens) :])
  per_group = [
    _value_and_grad_group(
      flat(o.x)[i],
      o.w[i],
      None if o.b is None else o.b[i],
      flat(o.labels)[i],
      p,
      options,
      reduction,
    )
    for i in range(p.groups)
  ]
  stacked = {n: jnp.stack([group[n] for group in per_group]) for n in per_group[0]}
  stacked["dx"] = stacked["dx"].reshape(o.x.shape)
  return [stacked["loss"], *(stacked[n] for n in SIGNATURE.stage("bwd", params).results)]


def _value_and_grad_group(x, w, b, labels, p: Problem, options: dict, reduction: str):
  """``value_and_grad`` of one group by name (``loss``, ``dx``, ``dw``[, ``db``]): ``x (N, D)``."""
  st = p.stat_dtype
  scale = common.mean_scale(labels[None], options["ignore_index"], reduction, st)[0]
  z_spec = "nd,vd->nv" if p.transposed_weight else "nd,dv->nv"
  dx_spec = "nv,vd->nd" if p.transposed_weight else "nv,dv->nd"
  # dw = x^T g: XLA's CPU dot contracting both operands' leading dim ran at
  # half speed (one 8192 x 1024 x 32768 dot: 7.3 s against 3.8 s; this whole
  # program: 15.3 s against 10.8 s), so x^T is materialised once and each
  # chunk's share is a plain matmul.
  xt = None if p.transposed_weight else lax.optimization_barrier(x.T)

  def chunk_loss(yc, lse, zy, zsum):
    return jnp.sum(common.token_loss(lse, zy, zsum, yc, **options)) * scale

  def body(start, size, carry):
    total, dx, dw, db = carry
    xc = lax.dynamic_slice_in_dim(x, start, size, 0)
    yc = lax.dynamic_slice_in_dim(labels, start, size, 0)
    z = _dot(xc, w, z_spec, st)
    if b is not None:
      z = z + b.astype(st)
    zc, c = common.capped(z, p.soft_cap)
    hit = lax.broadcasted_iota(jnp.int32, zc.shape, 1) == yc[:, None]
    m, s, zy, zsum = common.stats_update(common.stats_init(size, st), zc, None, None)
    stats = common.stats_finish((m, s, zy + _label_logit(zc, yc, 0), zsum))
    loss, pull = jax.vjp(functools.partial(chunk_loss, yc), *(s[:, 0] for s in stats))
    a_lse, a_zy, a_sum = (a[:, None] for a in pull(jnp.ones((), st)))
    g = common.cotangent(zc, c, stats[0], hit, None, a_lse, a_zy, a_sum)
    dx = lax.dynamic_update_slice_in_dim(dx, _dot(g, w, dx_spec, st).astype(dx.dtype), start, 0)
    if p.transposed_weight:
      dw = dw + _dot(g, xc, "nv,nd->vd", st)
    else:
      dw = dw + _dot(lax.dynamic_slice_in_dim(xt, start, size, 1), g, "dn,nv->dv", st)
    if db is not None:
      db = db + jnp.sum(g, axis=0)
    return total + loss, dx, dw, db

  db0 = None if b is None else jnp.zeros(b.shape, st)
  init = (jnp.zeros((), st), jnp.zeros(x.shape, x.dtype), jnp.zeros(w.shape, st), db0)
  total, dx, dw, db = _chunks(p, body, init, total=p.tokens, size=token_chunk_of(p))
  out = dict(loss=total, dx=dx, dw=dw.astype(w.dtype))
  if db is not None:
    out["db"] = db.astype(b.dtype)
  return out
