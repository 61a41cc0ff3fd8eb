"""The cross-entropy kernels on Pallas-Triton.

* ``fwd`` and ``jvp``: one program per (token block, group) looping over the
  vocabulary's blocks; with ``linear`` each ``(block_n, block_v)`` logits tile
  (and, in ``jvp``, its tangent ``dx w + x dw + db``) is accumulated in
  float32 over ``block_d``-deep slices of ``x`` and ``w``, so the ``(N, V)``
  logits never exist outside the program's registers;
* ``bwd`` with ``linear``: a ``dx`` kernel (per token block: recompute each
  logits tile, its cotangent ``g``, then ``dx += g w^T`` slice by slice of D)
  and a ``dw, db`` kernel (per vocabulary block: loop over the token blocks,
  ``dw += x^T g``, ``db += sum_n g``). Each program owns its output block and
  accumulates into it in float32 (read-modify-write of its own rows or
  columns, no atomics: deterministic), cast to the operands' dtypes after;
* ``bwd`` without ``linear``: one program per token block writes ``g`` tile
  by tile (``lse`` is given, one pass).

``w`` is read in its own layout (``(D, V)``, or ``(V, D)`` with
``transposed_weight``) and contracted on D by the dots themselves. Blocks are
powers of two (``tl.dot`` takes no less than 16) that overhang N, V and D
where those are not multiples; Pallas-Triton does not bound-check, so every
load and store along such a dim is masked by hand (rows past N load as 0 and
never reach ``dw``/``db``; columns past V are masked out of every statistic).
The tile math is ``common.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallax.kernels.cross_entropy import common
from pallax.kernels.cross_entropy.common import Problem
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
from pallax.op.signature import Named, Signature
from pallax.pallas_triton import tile_mask, triton_call
from pallax.pallas_utils import in_bounds, load, next_pow2, store

_F32 = jnp.float32


def _dot(a, b, contract: tuple[int, int]) -> jax.Array:
  """``a . b`` contracting ``a``'s and ``b``'s dims ``contract``, accumulated in float32.

  float32 operands get ``HIGHEST`` (IEEE float32 on Triton, as the other
  kernels), lower precisions their own MMA.
  """
  precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


@dataclasses.dataclass(frozen=True)
class _Layout(common.Blocks):
  """A call's blocks (powers of two, overhanging the arrays) and the BlockSpecs of its operands."""

  @classmethod
  def of(cls, p: Problem, config: CrossEntropyConfig) -> _Layout:
    fit = lambda block, extent: min(block, max(16, next_pow2(extent)))
    return cls(
      p,
      fit(config.block_n, p.tokens),
      fit(config.block_v, p.vocab),
      fit(config.block_d, max(p.hidden, 1)),
    )

  def grid(self, blocks: int) -> tuple[int, int]:
    """(``blocks``, groups): the grid of every kernel."""
    return (blocks, self.p.groups)

  def rows_ok(self, i) -> Optional[jax.Array]:
    """Which tokens of token block ``i`` exist (None: all)."""
    return in_bounds(i, self.bn, self.p.tokens, (self.bn,), 0)

  def cols_ok(self, j) -> Optional[jax.Array]:
    """Which columns of vocabulary block ``j`` exist (None: all)."""
    return in_bounds(j, self.bv, self.p.vocab, (self.bv,), 0)

  def d_ok(self, k) -> Optional[jax.Array]:
    """Which hidden columns of D block ``k`` exist (None: all)."""
    return in_bounds(k, self.bd, self.p.hidden, (self.bd,), 0)

  @property
  def compute(self):
    """The dtype the logits' dots take their operands in."""
    return jnp.promote_types(self.p.dtype, self.p.w_dtype)

  # BlockSpecs. ``per``: the program's block along that dim (else the whole,
  # padded dim); ``axis`` of the grid holding the block index.

  def spec_rows(self, width: int, per_block: bool = True):
    """A (G, N, width) operand: the program's token block (or all tokens), all of width."""
    rows = self.bn if per_block else self.nn * self.bn
    return pl.BlockSpec((None, rows, width), lambda i, g: (g, i if per_block else 0, 0))

  def spec_tokens(self, per_block: bool = True):
    """A (G, N) operand: the program's token block, or all tokens."""
    rows = self.bn if per_block else self.nn * self.bn
    return pl.BlockSpec((None, rows), lambda i, g: (g, i if per_block else 0))

  def spec_vocab(self, per_block: bool):
    """A (G, V) operand (the bias): the program's vocabulary block, or all of it."""
    cols = self.bv if per_block else self.nv * self.bv
    return pl.BlockSpec((None, cols), lambda j, g: (g, j if per_block else 0))

  def spec_w(self, per_block: bool):
    """``w`` (or a tangent / cotangent of it): all of D, one vocabulary block or all."""
    cols = self.bv if per_block else self.nv * self.bv
    d = self.nd * self.bd
    if self.p.transposed_weight:
      return pl.BlockSpec((None, cols, d), lambda j, g: (g, j if per_block else 0, 0))
    return pl.BlockSpec((None, d, cols), lambda j, g: (g, 0, j if per_block else 0))


@dataclasses.dataclass(frozen=True)
class _Tile:
  """Where a ``(bn, bv)`` logits tile lies.

  n0, v0: its first token / column in the program's refs (which may be one
  block or the whole dim); col0: its first column in the vocabulary;
  rows_ok, cols_ok: which of its tokens / columns exist (None: all).
  """

  n0: Any
  v0: Any
  col0: Any
  rows_ok: Optional[jax.Array]
  cols_ok: Optional[jax.Array]

  @property
  def valid(self) -> Optional[jax.Array]:
    return None if self.cols_ok is None else self.cols_ok[None, :]

  def hit(self, labels: jax.Array, bv: int) -> jax.Array:
    """Each row's label column (``labels`` a ``(bn, 1)`` column)."""
    return self.col0 + lax.broadcasted_iota(jnp.int32, (1, bv), 1) == labels


def _x_tile(lay: _Layout, ref, t: _Tile, k) -> jax.Array:
  """``x[n0 : n0 + bn, k-th D block]`` (0 outside the array), in the compute dtype."""
  view = ref.at[pl.ds(t.n0, lay.bn), pl.ds(k * lay.bd, lay.bd)]
  return load(view, tile_mask(t.rows_ok, lay.d_ok(k))).astype(lay.compute)


def _w_tile(lay: _Layout, ref, t: _Tile, k) -> jax.Array:
  """``w``'s tile of D block ``k`` and the tile's columns, in its own layout, 0 outside."""
  d_ok = lay.d_ok(k)
  if lay.p.transposed_weight:
    view = ref.at[pl.ds(t.v0, lay.bv), pl.ds(k * lay.bd, lay.bd)]
    mask = tile_mask(t.cols_ok, d_ok)
  else:
    view = ref.at[pl.ds(k * lay.bd, lay.bd), pl.ds(t.v0, lay.bv)]
    mask = tile_mask(d_ok, t.cols_ok)
  return load(view, mask).astype(lay.compute)


def _xw(lay: _Layout, x, w) -> jax.Array:
  """``x @ w`` of a ``(bn, bd)`` and a ``w`` tile: ``(bn, bv)`` float32."""
  return _dot(x, w, (1, 1) if lay.p.transposed_weight else (1, 0))


def _bias(lay: _Layout, ref, t: _Tile) -> jax.Array:
  return load(ref.at[pl.ds(t.v0, lay.bv)], t.cols_ok).astype(_F32)[None, :]


def _logits(lay: _Layout, t: _Tile, r: Named, tangent: bool = False):
  """The tile's raw logits (float32) from the refs ``r``, and with ``tangent`` their tangent.

  The tangent from the refs ``x_dot``, ``w_dot`` and ``b_dot`` (where the
  call has them), laid out like ``x``, ``w`` and ``b``.
  """
  p = lay.p
  x_ref, w_ref, b_ref = r.x, r.w, r.b
  if not p.linear:
    view = lambda ref: ref.at[pl.ds(t.n0, lay.bn), pl.ds(t.v0, lay.bv)]
    mask = tile_mask(t.rows_ok, t.cols_ok)
    z = load(view(x_ref), mask).astype(_F32)
    if not tangent:
      return z
    return z, load(view(r.x_dot), mask).astype(_F32)

  zeros = jnp.zeros((lay.bn, lay.bv), _F32)
  if not tangent:
    step = lambda k, z: z + _xw(lay, _x_tile(lay, x_ref, t, k), _w_tile(lay, w_ref, t, k))
    z = lax.fori_loop(0, lay.nd, step, zeros)
    return z if b_ref is None else z + _bias(lay, b_ref, t)

  dx_ref, dw_ref, db_ref = r.x_dot, r.w_dot, r.b_dot

  def step(k, acc):
    z, dz = acc
    x, w = _x_tile(lay, x_ref, t, k), _w_tile(lay, w_ref, t, k)
    dz = dz + _xw(lay, _x_tile(lay, dx_ref, t, k), w) + _xw(lay, x, _w_tile(lay, dw_ref, t, k))
    return z + _xw(lay, x, w), dz

  z, dz = lax.fori_loop(0, lay.nd, step, (zeros, zeros))
  if b_ref is not None:
    z = z + _bias(lay, b_ref, t)
  if db_ref is not None:
    dz = dz + _bias(lay, db_ref, t)
  return z, dz


def _setup(stage: str, ops, config: CrossEntropyConfig, params):
  """The call's problem, ``stage``'s names, its operands by name and its blocks."""
  p = Problem.of([jax.typeof(o) for o in ops], **params)
  if p.stat_dtype != _F32:
    raise NotImplementedError("the Triton cross-entropy kernels compute in float32 only")
  sig = common.SIGNATURE.stage(stage, params)
  return p, sig, sig.unpack(ops), _Layout.of(p, config)


def _specs(lay: _Layout, sig: Signature, names, per_token_block: bool) -> list:
  """The BlockSpec of each of ``names`` (operands or results of ``sig``).

  Token-side ones (``x``-like rows, per-token columns) hold the program's
  token block (``per_token_block``) or all tokens; ``w``- and ``b``-like ones
  the program's vocabulary block or all of it, the other way round.
  """
  width = lay.nd * lay.bd if lay.p.linear else lay.nv * lay.bv
  by_input = {
    "x": lambda: lay.spec_rows(width, per_token_block),
    "w": lambda: lay.spec_w(not per_token_block),
    "b": lambda: lay.spec_vocab(not per_token_block),
  }
  tokens = lambda: lay.spec_tokens(per_token_block)
  return [by_input.get(sig.operand(n).name, tokens)() for n in names]


def _row_tile(lay: _Layout, j, rows_ok) -> _Tile:
  """Vocabulary block ``j`` of a token-block program's rows."""
  return _Tile(0, j * lay.bv, j * lay.bv, rows_ok, lay.cols_ok(j))


def _stats_shapes(p: Problem, count: int) -> list:
  return [jax.ShapeDtypeStruct((p.groups, p.tokens), _F32)] * count


def _call(kernel, lay: _Layout, sig: Signature, o: Named, per_token_block, out_shapes, *call):
  """Runs ``kernel`` on ``sig``'s operands ``o``: a program per token block or vocabulary block.

  ``kernel`` takes the refs by name (``sig``'s operands and results);
  ``per_token_block``: a program per (token block, group), else per
  (vocabulary block, group), with the BlockSpecs that go with it (``_specs``);
  ``call``: ``(config, interpret, name)`` as ``triton_call`` takes them.
  """
  return triton_call(
    lambda *refs: kernel(common.kernel_refs(sig, refs)[0]),
    lay.grid(lay.nn if per_token_block else lay.nv),
    sig.pack(o),
    _specs(lay, sig, sig.operands, per_token_block),
    out_shapes,
    _specs(lay, sig, sig.results, per_token_block),
    *call,
  )


def fwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(lse, zy, zsum)``, each ``(G, N)`` float32."""
  p, sig, o, lay = _setup("fwd", ops, config, params)

  def kernel(r):
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(r.labels, rows_ok, other=-1)[:, None]

    def body(j, acc):
      t = _row_tile(lay, j, rows_ok)
      zc, _ = common.capped(_logits(lay, t, r), p.soft_cap)
      return common.stats_update(acc, zc, t.hit(labels, lay.bv), t.valid)

    acc = lax.fori_loop(0, lay.nv, body, common.stats_init(lay.bn, _F32))
    for name, stat in zip(sig.results, common.stats_finish(acc)):
      store(r[name], stat[:, 0], rows_ok)

  shapes = _stats_shapes(p, len(sig.results))
  return _call(kernel, lay, sig, o, True, shapes, config, interpret, "cross_entropy_fwd")


def jvp(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(dlse, dzy, dzsum)``, each ``(G, N)`` float32, linear in the tangents."""
  p, sig, o, lay = _setup("jvp", ops, config, params)

  def kernel(r):
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(r.labels, rows_ok, other=-1)[:, None]
    lse_blk = load(r.lse, rows_ok)[:, None]

    def body(j, acc):
      t = _row_tile(lay, j, rows_ok)
      z, dz = _logits(lay, t, r, tangent=True)
      zc, c = common.capped(z, p.soft_cap)
      return common.tangent_update(acc, zc, c, lse_blk, dz, t.hit(labels, lay.bv), t.valid)

    zero = jnp.zeros((lay.bn, 1), _F32)
    acc = lax.fori_loop(0, lay.nv, body, (zero, zero, zero))
    for name, stat in zip(sig.results, acc):
      store(r[name], stat[:, 0], rows_ok)

  shapes = _stats_shapes(p, len(sig.results))
  return _call(kernel, lay, sig, o, True, shapes, config, interpret, "cross_entropy_jvp")


def _g_tile(lay: _Layout, t: _Tile, r: Named, labels, stats) -> jax.Array:
  """The tile's logits cotangent ``g`` (float32), 0 in rows and columns outside the arrays."""
  zc, c = common.capped(_logits(lay, t, r), lay.p.soft_cap)
  g = common.cotangent(zc, c, *stats[:1], t.hit(labels, lay.bv), t.valid, *stats[1:])
  return g if t.rows_ok is None else jnp.where(t.rows_ok[:, None], g, 0)


def _zero_out(ref, tiles: int, view, mask_of, shape) -> None:
  """Zeroes ``tiles`` tiles ``view(ref, k)`` of ``shape`` (masked by ``mask_of(k)``)."""

  def body(k, carry):
    store(view(ref, k), jnp.zeros(shape, ref.dtype), mask_of(k))
    return carry

  lax.fori_loop(0, tiles, body, 0)


def _sync(interpret) -> None:
  """A barrier between a program's stores to its output block and its reads of them.

  The read-modify-write accumulations load each tile in the layout Triton
  picks for the load (or copy it through shared memory when it pipelines the
  load), not necessarily in the threads that stored it: ``__syncthreads``
  makes the stores visible to the whole program. Interpreted, memory is
  sequential (and the barrier has no interpretation).
  """
  if not interpret:
    pltriton.debug_barrier()


def _add_over_hidden(lay: _Layout, ref, view, mask_of, part, interpret) -> None:
  """Adds ``part(k)`` to the tile ``view(ref, k)`` of each D block ``k`` (masked by ``mask_of(k)``).

  A read-modify-write of the program's own output block, then ``_sync``.
  """

  def body(k, carry):
    term = part(k)
    tile, mask = view(ref, k), mask_of(k)
    store(tile, load(tile, mask) + term, mask)
    return carry

  lax.fori_loop(0, lay.nd, body, 0)
  _sync(interpret)


def _bwd_logits(p, sig, o, lay, config, interpret):
  """``dlogits``: per token block, ``g`` tile by tile."""

  def kernel(r):
    out_ref = r.dx
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(r.labels, rows_ok, other=-1)[:, None]
    stats = [load(r[n], rows_ok)[:, None] for n in common.BWD_STATS]

    def body(j, carry):
      t = _row_tile(lay, j, rows_ok)
      g = _g_tile(lay, t, r, labels, stats)
      view = out_ref.at[:, pl.ds(t.v0, lay.bv)]
      store(view, g.astype(out_ref.dtype), tile_mask(rows_ok, t.cols_ok))
      return carry

    lax.fori_loop(0, lay.nv, body, 0)

  shapes = [jax.ShapeDtypeStruct(o.x.shape, o.x.dtype)]
  return _call(kernel, lay, sig, o, True, shapes, config, interpret, "cross_entropy_bwd")


def _bwd_dx(p, sig, o, lay, config, interpret) -> jax.Array:
  """``dx`` in float32: per token block, ``sum_v g w^T`` accumulated in its own output block."""
  sig = common.returning(sig, "dx")
  d_view = lambda ref, k: ref.at[:, pl.ds(k * lay.bd, lay.bd)]

  def kernel(r):
    dx_ref, w_ref = r.dx, r.w
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(r.labels, rows_ok, other=-1)[:, None]
    stats = [load(r[n], rows_ok)[:, None] for n in common.BWD_STATS]
    dx_mask = lambda k: tile_mask(rows_ok, lay.d_ok(k))
    _zero_out(dx_ref, lay.nd, d_view, dx_mask, (lay.bn, lay.bd))
    _sync(interpret)

    def body(j, carry):
      t = _row_tile(lay, j, rows_ok)
      g = _g_tile(lay, t, r, labels, stats).astype(lay.compute)

      part = lambda k: _dot(g, _w_tile(lay, w_ref, t, k), (1, 0) if p.transposed_weight else (1, 1))
      _add_over_hidden(lay, dx_ref, d_view, dx_mask, part, interpret)
      return carry

    lax.fori_loop(0, lay.nv, body, 0)

  shapes = [jax.ShapeDtypeStruct(o.x.shape, _F32)]
  return _call(kernel, lay, sig, o, True, shapes, config, interpret, "cross_entropy_bwd_dx")[0]


def _bwd_dw(p, sig, o, lay, config, interpret) -> Named:
  """``dw`` (and ``db``) in float32 by name: per vocabulary block, ``sum_n x^T g`` in its block."""
  sig = common.returning(sig, "dw", "db")
  if p.transposed_weight:
    d_view = lambda ref, k: ref.at[:, pl.ds(k * lay.bd, lay.bd)]
    shape = (lay.bv, lay.bd)
  else:
    d_view = lambda ref, k: ref.at[pl.ds(k * lay.bd, lay.bd), :]
    shape = (lay.bd, lay.bv)

  def kernel(r):
    dw_ref, db_ref, x_ref = r.dw, r.db, r.x
    j = pl.program_id(0)
    cols_ok = lay.cols_ok(j)
    if p.transposed_weight:
      dw_mask = lambda k: tile_mask(cols_ok, lay.d_ok(k))
    else:
      dw_mask = lambda k: tile_mask(lay.d_ok(k), cols_ok)
    _zero_out(dw_ref, lay.nd, d_view, dw_mask, shape)
    _sync(interpret)

    def body(i, db):
      n0 = i * lay.bn
      rows_ok = lay.rows_ok(i)
      t = _Tile(n0, 0, j * lay.bv, rows_ok, cols_ok)
      rows = lambda ref: ref.at[pl.ds(n0, lay.bn)]
      labels = load(rows(r.labels), rows_ok, other=-1)[:, None]
      stats = [load(rows(r[n]), rows_ok)[:, None] for n in common.BWD_STATS]
      g = _g_tile(lay, t, r, labels, stats)
      db = db if db is None else db + jnp.sum(g, axis=0)  # before the D loop: g then dies
      gc = g.astype(lay.compute)

      def part(k):
        x = _x_tile(lay, x_ref, t, k)
        return _dot(gc, x, (0, 0)) if p.transposed_weight else _dot(x, gc, (0, 0))

      _add_over_hidden(lay, dw_ref, d_view, dw_mask, part, interpret)
      return db

    db0 = jnp.zeros((lay.bv,), _F32) if p.has_bias else None
    db = lax.fori_loop(0, lay.nn, body, db0)
    if db_ref is not None:
      store(db_ref, db, cols_ok)

  shapes = [jax.ShapeDtypeStruct(o[sig.operand(n).name].shape, _F32) for n in sig.results]
  outs = _call(kernel, lay, sig, o, False, shapes, config, interpret, "cross_entropy_bwd_dw")
  return sig.unpack(outs, results=True)


def bwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """The primals' cotangents ``(dx, dw[, db])`` or ``(dlogits,)`` in their dtypes."""
  p, sig, o, lay = _setup("bwd", ops, config, params)
  if not p.linear:
    return _bwd_logits(p, sig, o, lay, config, interpret)
  grads = {"dx": _bwd_dx(p, sig, o, lay, config, interpret)}
  grads.update(_bwd_dw(p, sig, o, lay, config, interpret))
  return [grads[n].astype(o[sig.operand(n).name].dtype) for n in sig.results]
