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
from pallax.kernels.cross_entropy.common import Operands, Problem
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
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


def _logits(lay: _Layout, t: _Tile, x_ref, w_ref, b_ref, tangent_refs=None):
  """The tile's raw logits (float32), and with ``tangent_refs`` their tangent.

  ``tangent_refs``: ``(dx, dw, db or None)`` refs laid out like ``x``, ``w``,
  ``b`` (``linear``), or ``(dlogits,)``.
  """
  p = lay.p
  if not p.linear:
    view = lambda ref: ref.at[pl.ds(t.n0, lay.bn), pl.ds(t.v0, lay.bv)]
    mask = tile_mask(t.rows_ok, t.cols_ok)
    z = load(view(x_ref), mask).astype(_F32)
    if tangent_refs is None:
      return z
    return z, load(view(tangent_refs[0]), mask).astype(_F32)

  zeros = jnp.zeros((lay.bn, lay.bv), _F32)
  if tangent_refs is None:
    step = lambda k, z: z + _xw(lay, _x_tile(lay, x_ref, t, k), _w_tile(lay, w_ref, t, k))
    z = lax.fori_loop(0, lay.nd, step, zeros)
    return z if b_ref is None else z + _bias(lay, b_ref, t)

  dx_ref, dw_ref, db_ref = tangent_refs

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


def _setup(ops, config: CrossEntropyConfig, params) -> tuple[Problem, Operands, _Layout]:
  p = Problem.of([jax.typeof(o) for o in ops], **params)
  if p.stat_dtype != _F32:
    raise NotImplementedError("the Triton cross-entropy kernels compute in float32 only")
  return p, Operands.of(ops, **params), _Layout.of(p, config)


def _primal_specs(lay: _Layout, per_token_block: bool) -> list:
  """Specs of the primals except the labels: the row side per block or whole, ``w`` whole."""
  p = lay.p
  if not p.linear:
    return [lay.spec_rows(lay.nv * lay.bv, per_token_block)]
  specs = [lay.spec_rows(lay.nd * lay.bd, per_token_block), lay.spec_w(not per_token_block)]
  if p.has_bias:
    specs.append(lay.spec_vocab(not per_token_block))
  return specs


def _split_primals(p: Problem, refs):
  """``(x, w, b, labels), rest`` from a kernel's refs (None where absent)."""
  if not p.linear:
    return (refs[0], None, None, refs[1]), refs[2:]
  x, w = refs[:2]
  b = refs[2] if p.has_bias else None
  return (x, w, b, refs[2 + p.has_bias]), refs[3 + p.has_bias :]


def _row_tile(lay: _Layout, j, rows_ok) -> _Tile:
  """Vocabulary block ``j`` of a token-block program's rows."""
  return _Tile(0, j * lay.bv, j * lay.bv, rows_ok, lay.cols_ok(j))


def _stats_shapes(p: Problem, count: int) -> list:
  return [jax.ShapeDtypeStruct((p.groups, p.tokens), _F32)] * count


def fwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(lse, zy, zsum)``, each ``(G, N)`` float32."""
  p, o, lay = _setup(ops, config, params)

  def kernel(*refs):
    (x_ref, w_ref, b_ref, labels_ref), (lse_ref, zy_ref, zsum_ref) = _split_primals(p, refs)
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(labels_ref, rows_ok, other=-1)[:, None]

    def body(j, acc):
      t = _row_tile(lay, j, rows_ok)
      zc, _ = common.capped(_logits(lay, t, x_ref, w_ref, b_ref), p.soft_cap)
      return common.stats_update(acc, zc, t.hit(labels, lay.bv), t.valid)

    acc = lax.fori_loop(0, lay.nv, body, common.stats_init(lay.bn, _F32))
    for ref, stat in zip((lse_ref, zy_ref, zsum_ref), common.stats_finish(acc)):
      store(ref, stat[:, 0], rows_ok)

  return triton_call(
    kernel,
    lay.grid(lay.nn),
    [*o.primals(), o.labels],
    [*_primal_specs(lay, True), lay.spec_tokens()],
    _stats_shapes(p, 3),
    [lay.spec_tokens()] * 3,
    config,
    interpret,
    "cross_entropy_fwd",
  )


def jvp(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(dlse, dzy, dzsum)``, each ``(G, N)`` float32, linear in the tangents."""
  p, o, lay = _setup(ops, config, params)
  lse, *tangents = o.rest

  def kernel(*refs):
    (x_ref, w_ref, b_ref, labels_ref), rest = _split_primals(p, refs)
    lse_ref, *tangent_refs = rest[: 1 + len(tangents)]
    out_refs = rest[1 + len(tangents) :]
    if p.linear and not p.has_bias:
      tangent_refs.append(None)
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(labels_ref, rows_ok, other=-1)[:, None]
    lse_blk = load(lse_ref, rows_ok)[:, None]

    def body(j, acc):
      t = _row_tile(lay, j, rows_ok)
      z, dz = _logits(lay, t, x_ref, w_ref, b_ref, tangent_refs)
      zc, c = common.capped(z, p.soft_cap)
      return common.tangent_update(acc, zc, c, lse_blk, dz, t.hit(labels, lay.bv), t.valid)

    zero = jnp.zeros((lay.bn, 1), _F32)
    acc = lax.fori_loop(0, lay.nv, body, (zero, zero, zero))
    for ref, stat in zip(out_refs, acc):
      store(ref, stat[:, 0], rows_ok)

  return triton_call(
    kernel,
    lay.grid(lay.nn),
    [*o.primals(), o.labels, lse, *tangents],
    [*_primal_specs(lay, True), lay.spec_tokens(), lay.spec_tokens(), *_primal_specs(lay, True)],
    _stats_shapes(p, 3),
    [lay.spec_tokens()] * 3,
    config,
    interpret,
    "cross_entropy_jvp",
  )


def _g_tile(lay: _Layout, t: _Tile, prim_refs, labels, stats) -> jax.Array:
  """The tile's logits cotangent ``g`` (float32), 0 in rows and columns outside the arrays."""
  x_ref, w_ref, b_ref, _ = prim_refs
  zc, c = common.capped(_logits(lay, t, x_ref, w_ref, b_ref), lay.p.soft_cap)
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


def _bwd_logits(p, o, lay, config, interpret):
  """``dlogits``: per token block, ``g`` tile by tile."""
  lse, *cots = o.rest

  def kernel(x_ref, labels_ref, *refs):
    stat_refs, out_ref = refs[:4], refs[4]
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(labels_ref, rows_ok, other=-1)[:, None]
    stats = [load(r, rows_ok)[:, None] for r in stat_refs]

    def body(j, carry):
      t = _row_tile(lay, j, rows_ok)
      g = _g_tile(lay, t, (x_ref, None, None, None), labels, stats)
      view = out_ref.at[:, pl.ds(t.v0, lay.bv)]
      store(view, g.astype(out_ref.dtype), tile_mask(rows_ok, t.cols_ok))
      return carry

    lax.fori_loop(0, lay.nv, body, 0)

  return triton_call(
    kernel,
    lay.grid(lay.nn),
    [o.x, o.labels, lse, *cots],
    [*_primal_specs(lay, True), *[lay.spec_tokens()] * 5],
    [jax.ShapeDtypeStruct(o.x.shape, o.x.dtype)],
    [lay.spec_rows(lay.nv * lay.bv)],
    config,
    interpret,
    "cross_entropy_bwd",
  )


def _bwd_dx(p, o, lay, config, interpret) -> jax.Array:
  """``dx`` in float32: per token block, ``sum_v g w^T`` accumulated in its own output block."""
  lse, *cots = o.rest
  d_view = lambda ref, k: ref.at[:, pl.ds(k * lay.bd, lay.bd)]

  def kernel(*refs):
    prim_refs, rest = _split_primals(p, refs)
    stat_refs, dx_ref = rest[:4], rest[4]
    w_ref = prim_refs[1]
    rows_ok = lay.rows_ok(pl.program_id(0))
    labels = load(prim_refs[3], rows_ok, other=-1)[:, None]
    stats = [load(r, rows_ok)[:, None] for r in stat_refs]
    dx_mask = lambda k: tile_mask(rows_ok, lay.d_ok(k))
    _zero_out(dx_ref, lay.nd, d_view, dx_mask, (lay.bn, lay.bd))
    _sync(interpret)

    def body(j, carry):
      t = _row_tile(lay, j, rows_ok)
      g = _g_tile(lay, t, prim_refs, labels, stats).astype(lay.compute)

      part = lambda k: _dot(g, _w_tile(lay, w_ref, t, k), (1, 0) if p.transposed_weight else (1, 1))
      _add_over_hidden(lay, dx_ref, d_view, dx_mask, part, interpret)
      return carry

    lax.fori_loop(0, lay.nv, body, 0)

  out = jax.ShapeDtypeStruct(o.x.shape, _F32)
  return triton_call(
    kernel,
    lay.grid(lay.nn),
    [*o.primals(), o.labels, lse, *cots],
    [*_primal_specs(lay, True), *[lay.spec_tokens()] * 5],
    [out],
    [lay.spec_rows(lay.nd * lay.bd)],
    config,
    interpret,
    "cross_entropy_bwd_dx",
  )[0]


def _bwd_dw(p, o, lay, config, interpret) -> list[jax.Array]:
  """``dw`` (and ``db``) in float32: per vocabulary block, ``sum_n x^T g`` in its own block."""
  lse, *cots = o.rest
  if p.transposed_weight:
    d_view = lambda ref, k: ref.at[:, pl.ds(k * lay.bd, lay.bd)]
    shape = (lay.bv, lay.bd)
  else:
    d_view = lambda ref, k: ref.at[pl.ds(k * lay.bd, lay.bd), :]
    shape = (lay.bd, lay.bv)

  def kernel(*refs):
    prim_refs, rest = _split_primals(p, refs)
    stat_refs, out_refs = rest[:4], rest[4:]
    dw_ref, db_ref = out_refs[0], (out_refs[1] if p.has_bias else None)
    x_ref = prim_refs[0]
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
      labels = load(rows(prim_refs[3]), rows_ok, other=-1)[:, None]
      stats = [load(rows(r), rows_ok)[:, None] for r in stat_refs]
      g = _g_tile(lay, t, prim_refs, labels, stats)
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

  out_shapes = [jax.ShapeDtypeStruct(o.w.shape, _F32)]
  out_specs = [lay.spec_w(True)]
  if p.has_bias:
    out_shapes.append(jax.ShapeDtypeStruct(o.b.shape, _F32))
    out_specs.append(lay.spec_vocab(True))
  return triton_call(
    kernel,
    lay.grid(lay.nv),
    [*o.primals(), o.labels, lse, *cots],
    [*_primal_specs(lay, False), lay.spec_tokens(False), *[lay.spec_tokens(False)] * 4],
    out_shapes,
    out_specs,
    config,
    interpret,
    "cross_entropy_bwd_dw",
  )


def bwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """The primals' cotangents ``(dx, dw[, db])`` or ``(dlogits,)`` in their dtypes."""
  p, o, lay = _setup(ops, config, params)
  if not p.linear:
    return _bwd_logits(p, o, lay, config, interpret)
  dx = _bwd_dx(p, o, lay, config, interpret)
  dw, *db = _bwd_dw(p, o, lay, config, interpret)
  return [dx.astype(o.x.dtype), dw.astype(o.w.dtype), *(d.astype(o.b.dtype) for d in db)]
