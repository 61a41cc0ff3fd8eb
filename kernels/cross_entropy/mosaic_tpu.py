"""The cross-entropy kernels on Pallas-Mosaic TPU.

Grids put the reductions last and sequential ("arbitrary"), with float32
accumulators in VMEM scratch:

* forward and tangent: ``(G, token blocks, vocabulary blocks, hidden
  blocks)`` (no hidden axis without ``linear``): the logits tile (and its
  tangent) is accumulated over the hidden blocks, then folded into the
  running statistics (``common.stats_update`` / ``common.tangent_update``);
* backward with ``linear``: two kernels that each recompute the logits tile
  from all of ``D`` (TPUs have no atomics): ``dx`` on ``(G, token blocks,
  vocabulary blocks)`` with a ``(block_n, D)`` accumulator, and ``dw``
  (``db``) on ``(G, vocabulary blocks, token blocks)`` with a ``(D,
  block_v)`` (``(block_v, D)`` for a transposed weight) accumulator;
* backward without ``linear``: one elementwise kernel over ``(G, token
  blocks, vocabulary blocks)``.

The per-token statistics and labels travel as ``(G, N, 1)`` columns (blocks
``(block_n, 1)``), the bias as ``(G, 1, V)`` rows. Edge blocks hold undefined
values past the arrays' ends: columns past ``V`` never reach a sum (their
logits are replaced before the tile math, their weights zeroed before a
product over the vocabulary), hidden entries past ``D`` are zeroed in both
factors of a product, and rows past ``N`` are zeroed before the products
that sum over tokens (``dw``, ``db``); elsewhere they stay in their own rows,
which are never written back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.kernels.cross_entropy import common
from pallax.kernels.cross_entropy.common import Problem
from pallax.kernels.cross_entropy.config import TPU_VMEM_LIMIT, CrossEntropyConfig
from pallax.op.signature import Named, Signature
from pallax.pallas_utils import in_bounds, masked

_F32 = jnp.float32


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
  """A 2-D ``dot_general`` contracting ``a``'s dim ``contract[0]`` with ``b``'s ``contract[1]``.

  Accumulates in float32, at full float32 precision for float32 operands.
  """
  dtype = jnp.promote_types(a.dtype, b.dtype)
  precision = lax.Precision.HIGHEST if dtype == _F32 else None
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(
    a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=_F32
  )


@dataclasses.dataclass(frozen=True)
class _Layout(common.Blocks):
  """A call's blocks (no larger than the arrays) and the BlockSpecs of its operands."""

  @classmethod
  def of(cls, p: Problem, config: CrossEntropyConfig, full_hidden: bool = False) -> _Layout:
    bd = p.hidden if full_hidden or not p.linear else min(config.block_d, p.hidden)
    return cls(p, min(config.block_n, p.tokens), min(config.block_v, p.vocab), bd)

  # Masks of a block's entries inside the arrays (None: the block is whole).

  def rows_ok(self, i) -> Optional[jax.Array]:
    """``(bn, 1)``: the token rows of block ``i`` inside ``N``."""
    return in_bounds(i, self.bn, self.p.tokens, (self.bn, 1), 0)

  def cols_ok(self, j, shape=None, axis: int = 1) -> Optional[jax.Array]:
    """The vocabulary entries of block ``j`` inside ``V`` (default: a ``(1, bv)`` row)."""
    return in_bounds(j, self.bv, self.p.vocab, shape or (1, self.bv), axis)

  def hidden_ok(self, k, shape, axis: int) -> Optional[jax.Array]:
    """The hidden entries of block ``k`` inside ``D`` (a block of ``shape``, D along ``axis``)."""
    return in_bounds(k, self.bd, self.p.hidden, shape, axis)

  def hit(self, j, labels: jax.Array) -> jax.Array:
    """``(bn, bv)``: where a column of block ``j`` is its row's label."""
    return j * self.bv + lax.broadcasted_iota(jnp.int32, (self.bn, self.bv), 1) == labels

  # BlockSpecs. Index maps take (g, i, j, [k]) for the forward and tangent
  # grids and the dx / logits-only backward, and (g, j, i) for dw (``vocab_major``).

  def _ij(self, idx, vocab_major: bool):
    g, a, b, *k = idx
    i, j = (b, a) if vocab_major else (a, b)
    return g, i, j, (k[0] if k else 0)

  def x_spec(self, vocab_major: bool = False) -> pl.BlockSpec:
    """``x``-like ``(G, N, D)`` operands (the logits ``(G, N, V)`` without ``linear``)."""
    if not self.p.linear:
      return pl.BlockSpec((None, self.bn, self.bv), lambda *idx: self._ij(idx, vocab_major)[:3])

    def index(*idx):
      g, i, _, k = self._ij(idx, vocab_major)
      return g, i, k

    return pl.BlockSpec((None, self.bn, self.bd), index)

  def w_spec(self, vocab_major: bool = False) -> pl.BlockSpec:
    """``w``-like ``(G, D, V)`` (or ``(G, V, D)``) operands."""

    def index(*idx):
      g, _, j, k = self._ij(idx, vocab_major)
      return (g, j, k) if self.p.transposed_weight else (g, k, j)

    block = (self.bv, self.bd) if self.p.transposed_weight else (self.bd, self.bv)
    return pl.BlockSpec((None, *block), index)

  def b_spec(self, vocab_major: bool = False) -> pl.BlockSpec:
    """Bias-like ``(G, 1, V)`` operands."""

    def index(*idx):
      g, _, j, _ = self._ij(idx, vocab_major)
      return g, 0, j

    return pl.BlockSpec((None, 1, self.bv), index)

  def col_spec(self, vocab_major: bool = False) -> pl.BlockSpec:
    """Per-token ``(G, N, 1)`` columns: labels and statistics."""

    def index(*idx):
      g, i, _, _ = self._ij(idx, vocab_major)
      return g, i, 0

    return pl.BlockSpec((None, self.bn, 1), index)

  # Tiles inside a kernel.

  def logits_part(self, x: jax.Array, w: jax.Array, k) -> jax.Array:
    """``x @ w`` of hidden block ``k`` (``(bn, bv)`` float32), its entries past ``D`` zeroed."""
    t = self.p.transposed_weight
    x = masked(x, self.hidden_ok(k, x.shape, 1))
    w = masked(w, self.hidden_ok(k, w.shape, 1 if t else 0))
    return _dot(x, w, (1, 1) if t else (1, 0))


def _col(a: jax.Array) -> jax.Array:
  """A ``(G, N)`` per-token operand as ``(G, N, 1)`` columns."""
  return a[..., None]


# The backward kernels' grids: groups and one block index in parallel, the last sequential.
_SEQUENTIAL_LAST = ("parallel", "parallel", "arbitrary")


def _params(semantics: tuple[str, ...]) -> pltpu.CompilerParams:
  return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=TPU_VMEM_LIMIT)


def _reduction_grid(lay: _Layout) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """The forward and tangent grid: ``(G, N blocks, V blocks[, D blocks])``."""
  grid = (lay.p.groups, lay.nn, lay.nv) + ((lay.nd,) if lay.p.linear else ())
  return grid, ("parallel", "parallel") + ("arbitrary",) * (len(grid) - 2)


def _over_hidden(lay: _Layout, scratch, parts: Callable[[], tuple], finish: Callable) -> None:
  """Calls ``finish(*tiles)`` with the logits tiles summed over the hidden blocks.

  ``parts()`` gives the current hidden block's terms; with several hidden
  blocks they are accumulated in the float32 ``scratch`` refs until the last.
  """
  if lay.nd == 1:
    finish(*parts())
    return
  k = pl.program_id(3)
  terms = parts()

  @pl.when(k == 0)
  def _():
    for ref, term in zip(scratch, terms):
      ref[...] = term

  @pl.when((k > 0) & (k < lay.nd - 1))
  def _():
    for ref, term in zip(scratch, terms):
      ref[...] += term

  @pl.when(k == lay.nd - 1)
  def _():
    finish(*(ref[...] + term for ref, term in zip(scratch, terms)))


def _last_step(lay: _Layout):
  """Whether this step is the last one of its token block (last V and D blocks)."""
  last = pl.program_id(2) == lay.nv - 1
  return last & (pl.program_id(3) == lay.nd - 1) if lay.p.linear else last


def _first_step(lay: _Layout):
  first = pl.program_id(2) == 0
  return first & (pl.program_id(3) == 0) if lay.p.linear else first


def _stat_outputs(lay: _Layout) -> list[jax.ShapeDtypeStruct]:
  p = lay.p
  return [jax.ShapeDtypeStruct((p.groups, p.tokens, 1), p.stat_dtype)] * 3


def _problem(stage: str, ops, params) -> tuple[Problem, Signature, Named]:
  """The call's problem (checked), ``stage``'s names and its operands by name."""
  p = Problem.of([jax.typeof(o) for o in ops], **params)
  if p.stat_dtype != _F32:
    raise NotImplementedError(f"the Mosaic TPU cross-entropy kernels take no {p.dtype} operands")
  sig = common.SIGNATURE.stage(stage, params)
  return p, sig, sig.unpack(ops)


def _call(
  kernel, lay, sig: Signature, o: Named, grid, semantics, out: dict, name, *, interpret, **kw
):
  """Runs ``kernel(r, scratch)`` (``r``: the refs of ``sig`` by name) on ``grid``.

  Its operands are ``o``'s, laid out by ``_inputs`` (``kw``: its
  ``vocab_major`` and ``columns``); ``out``: ``pallas_call``'s ``out_specs``,
  ``out_shape`` and ``scratch_shapes``.
  """
  in_specs, args = _inputs(lay, sig, o, **kw)
  by_name = lambda *refs: kernel(*common.kernel_refs(sig, refs))
  spec = dict(grid=grid, in_specs=in_specs, compiler_params=_params(semantics), **out)
  return pl.pallas_call(by_name, interpret=interpret, name=name, **spec)(*args)


def _stats_call(kernel, lay: _Layout, sig: Signature, o: Named, scratch, interpret, name: str):
  """The ``(G, N)`` results of a forward or tangent ``kernel`` on the reduction grid."""
  grid, semantics = _reduction_grid(lay)
  out = dict(
    out_specs=[lay.col_spec()] * len(sig.results),
    out_shape=_stat_outputs(lay),
    scratch_shapes=scratch,
  )
  stats = _call(kernel, lay, sig, o, grid, semantics, out, name, interpret=interpret)
  return [s[..., 0] for s in stats]


def fwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(lse, zy, zsum)``, each ``(G, N)`` float32."""
  p, sig, o = _problem("fwd", ops, params)
  lay = _Layout.of(p, config)

  def kernel(r, scratch):
    x_ref, w_ref, b_ref, labels_ref = r.x, r.w, r.b, r.labels
    stats, acc = scratch[:4], scratch[4:]
    j = pl.program_id(2)

    @pl.when(_first_step(lay))
    def _():
      for ref, value in zip(stats, common.stats_init(lay.bn, _F32)):
        ref[...] = value

    def parts():
      if not p.linear:
        return (x_ref[...].astype(_F32),)
      return (lay.logits_part(x_ref[...], w_ref[...], pl.program_id(3)),)

    def finish(z):
      if b_ref is not None:
        z = z + b_ref[...].astype(_F32)
      zc, _ = common.capped(z, p.soft_cap)
      old = tuple(ref[...] for ref in stats)
      new = common.stats_update(old, zc, lay.hit(j, labels_ref[...]), lay.cols_ok(j))
      for ref, value in zip(stats, new):
        ref[...] = value

      @pl.when(j == lay.nv - 1)
      def _():
        for name, value in zip(sig.results, common.stats_finish(new)):
          r[name][...] = value

    _over_hidden(lay, acc, parts, finish)

  scratch = [pltpu.VMEM((lay.bn, 1), _F32) for _ in range(4)]
  scratch += [pltpu.VMEM((lay.bn, lay.bv), _F32)] if lay.nd > 1 else []
  return _stats_call(kernel, lay, sig, o, scratch, interpret, "cross_entropy_fwd")


def jvp(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(dlse, dzy, dzsum)``, each ``(G, N)`` float32."""
  p, sig, o = _problem("jvp", ops, params)
  lay = _Layout.of(p, config)

  def kernel(r, scratch):
    x_ref, w_ref, b_ref, labels_ref = r.x, r.w, r.b, r.labels
    dx_ref, dw_ref, db_ref = r.x_dot, r.w_dot, r.b_dot
    sums, acc = scratch[:3], scratch[3:]
    j = pl.program_id(2)

    @pl.when(_first_step(lay))
    def _():
      for ref in sums:
        ref[...] = jnp.zeros(ref.shape, _F32)

    def parts():
      if not p.linear:
        return x_ref[...].astype(_F32), dx_ref[...].astype(_F32)
      k = pl.program_id(3)
      x, w = x_ref[...], w_ref[...]
      z = lay.logits_part(x, w, k)
      dz = lay.logits_part(dx_ref[...], w, k) + lay.logits_part(x, dw_ref[...], k)
      return z, dz

    def finish(z, dz):
      if b_ref is not None:
        z = z + b_ref[...].astype(_F32)
        dz = dz + db_ref[...].astype(_F32)
      valid = lay.cols_ok(j)
      # Columns past V: finite logits, so that p = exp(z' - lse) there is finite (and unused).
      zc, c = common.capped(masked(z, valid), p.soft_cap)
      hit = lay.hit(j, labels_ref[...])
      old = tuple(ref[...] for ref in sums)
      new = common.tangent_update(old, zc, c, r.lse[...], dz, hit, valid)
      for ref, value in zip(sums, new):
        ref[...] = value

      @pl.when(j == lay.nv - 1)
      def _():
        for name, value in zip(sig.results, new):
          r[name][...] = value

    _over_hidden(lay, acc, parts, finish)

  scratch = [pltpu.VMEM((lay.bn, 1), _F32) for _ in range(3)]
  scratch += [pltpu.VMEM((lay.bn, lay.bv), _F32) for _ in range(2 if lay.nd > 1 else 0)]
  return _stats_call(kernel, lay, sig, o, scratch, interpret, "cross_entropy_jvp")


def _cotangent_tile(lay: _Layout, z, j, labels_ref, stat_refs, b_ref=None) -> jax.Array:
  """The logits' cotangent ``g`` of a ``(bn, bv)`` tile (0 in the columns past ``V``)."""
  if b_ref is not None:
    z = z + b_ref[...].astype(_F32)
  zc, c = common.capped(z, lay.p.soft_cap)
  lse, a_lse, a_zy, a_sum = (ref[...] for ref in stat_refs)
  hit = lay.hit(j, labels_ref[...])
  return common.cotangent(zc, c, lse, hit, lay.cols_ok(j), a_lse, a_zy, a_sum)


def bwd(*ops, config: CrossEntropyConfig, interpret: Any, **params) -> list[jax.Array]:
  """The cotangents of the floating primals: ``dlogits``, or ``dx, dw[, db]``."""
  p, sig, o = _problem("bwd", ops, params)
  # The statistics and their cotangents as float32 columns, shared by the kernels.
  columns = {n: _col(o[n].astype(_F32)) for n in common.BWD_STATS}
  if not p.linear:
    return [_bwd_logits(p, sig, o, columns, config, interpret)]
  lay = _Layout.of(p, config, full_hidden=True)
  grads = {"dx": _bwd_dx(lay, sig, o, columns, interpret)}
  grads.update(_bwd_dw(lay, sig, o, columns, interpret))
  return [grads[n] for n in sig.results]


def _bwd_logits(p: Problem, sig: Signature, o: Named, columns, config, interpret) -> jax.Array:
  """``dlogits``, tile by tile."""
  lay = _Layout.of(p, config)

  def kernel(r, _):
    stat_refs = [r[n] for n in common.BWD_STATS]
    g = _cotangent_tile(lay, r.x[...].astype(_F32), pl.program_id(2), r.labels, stat_refs)
    r.dx[...] = g.astype(r.dx.dtype)

  grid = (p.groups, lay.nn, lay.nv)
  out = dict(out_specs=lay.x_spec(), out_shape=jax.ShapeDtypeStruct(o.x.shape, o.x.dtype))
  semantics = ("parallel",) * 3
  name = "cross_entropy_bwd"
  return _call(
    kernel, lay, sig, o, grid, semantics, out, name, columns=columns, interpret=interpret
  )


def _inputs(
  lay: _Layout, sig: Signature, o: Named, vocab_major: bool = False, columns=None
) -> tuple[list, list]:
  """The BlockSpecs and arrays of a kernel's operands ``sig.operands``, from ``o`` by name.

  ``x``- and ``w``-like ones (the inputs and their tangents) go as they are,
  ``b``-like ones as ``(G, 1, V)`` rows, per-token ones as ``(G, N, 1)``
  columns: the labels, and the statistics and their cotangents in float32,
  taken from ``columns`` (name -> column) where given there.
  """
  columns = columns or {}
  specs, args = [], []
  for name in sig.operands:
    declared = sig.operand(name).name
    if declared == "x":
      specs.append(lay.x_spec(vocab_major))
      args.append(o[name])
    elif declared == "w":
      specs.append(lay.w_spec(vocab_major))
      args.append(o[name])
    elif declared == "b":
      specs.append(lay.b_spec(vocab_major))
      args.append(o[name][:, None, :])
    else:
      specs.append(lay.col_spec(vocab_major))
      if name in columns:
        args.append(columns[name])
      elif declared == "labels":
        args.append(_col(o[name]))
      else:
        args.append(_col(o[name].astype(_F32)))
  return specs, args


def _bwd_dx(lay: _Layout, sig: Signature, o: Named, columns, interpret) -> jax.Array:
  """``dx = g @ w^T``: grid ``(G, N blocks, V blocks)``, V sequential."""
  p = lay.p
  t = p.transposed_weight
  sig = common.returning(sig, "dx")

  def kernel(r, scratch):
    (acc_ref,) = scratch
    x_ref, w_ref, b_ref, labels_ref, out_ref = r.x, r.w, r.b, r.labels, r.dx
    stat_refs = [r[n] for n in common.BWD_STATS]
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    w = w_ref[...]
    g = _cotangent_tile(lay, lay.logits_part(x_ref[...], w, 0), j, labels_ref, stat_refs, b_ref)
    # Weights past V hold undefined values: zeroed, as g is, before summing over V.
    w = masked(w, lay.cols_ok(j, w.shape, 0 if t else 1))
    acc_ref[...] += _dot(g.astype(w.dtype), w, (1, 0) if t else (1, 1))

    @pl.when(j == lay.nv - 1)
    def _():
      out_ref[...] = acc_ref[...].astype(out_ref.dtype)

  grid = (p.groups, lay.nn, lay.nv)
  out_shape = jax.ShapeDtypeStruct(o.x.shape, o.x.dtype)
  scratch = [pltpu.VMEM((lay.bn, p.hidden), _F32)]
  out = dict(out_specs=lay.x_spec(), out_shape=out_shape, scratch_shapes=scratch)
  name = "cross_entropy_bwd_dx"
  return _call(
    kernel, lay, sig, o, grid, _SEQUENTIAL_LAST, out, name, columns=columns, interpret=interpret
  )


def _bwd_dw(lay: _Layout, sig: Signature, o: Named, columns, interpret) -> dict:
  """``dw = x^T @ g`` (transposed: ``g^T @ x``) and ``db = sum_n g``, by name.

  Grid ``(G, V blocks, N blocks)``, N sequential.
  """
  p = lay.p
  t = p.transposed_weight
  sig = common.returning(sig, "dw", "db")

  def kernel(r, scratch):
    x_ref, w_ref, b_ref, labels_ref = r.x, r.w, r.b, r.labels
    stat_refs = [r[n] for n in common.BWD_STATS]
    acc = dict(zip(sig.results, scratch))  # a float32 accumulator per result
    j, i = pl.program_id(1), pl.program_id(2)

    @pl.when(i == 0)
    def _():
      for ref in acc.values():
        ref[...] = jnp.zeros(ref.shape, _F32)

    # Rows past N hold undefined values: zeroed in x and g before summing over tokens.
    rows = lay.rows_ok(i)
    x = masked(x_ref[...], rows)
    g = _cotangent_tile(lay, lay.logits_part(x, w_ref[...], 0), j, labels_ref, stat_refs, b_ref)
    g = masked(g, rows)
    gx = g.astype(x.dtype)
    acc["dw"][...] += _dot(gx, x, (0, 0)) if t else _dot(x, gx, (0, 0))
    if p.has_bias:
      acc["db"][...] += jnp.sum(g, axis=0, keepdims=True)

    @pl.when(i == lay.nn - 1)
    def _():
      for name in sig.results:
        r[name][...] = acc[name][...].astype(r[name].dtype)

  specs = {"dw": lay.w_spec(vocab_major=True), "db": lay.b_spec(vocab_major=True)}
  shapes = {"dw": o.w.shape, "db": (p.groups, 1, p.vocab)}  # the bias as (G, 1, V) rows
  blocks = {"dw": (lay.bv, p.hidden) if t else (p.hidden, lay.bv), "db": (1, lay.bv)}
  dtype = lambda n: o[sig.operand(n).name].dtype
  out = dict(
    out_specs=[specs[n] for n in sig.results],
    out_shape=[jax.ShapeDtypeStruct(shapes[n], dtype(n)) for n in sig.results],
    scratch_shapes=[pltpu.VMEM(blocks[n], _F32) for n in sig.results],  # float32 accumulators
  )
  grid = (p.groups, lay.nv, lay.nn)
  outs = _call(
    kernel,
    lay,
    sig,
    o,
    grid,
    _SEQUENTIAL_LAST,
    out,
    "cross_entropy_bwd_dw",
    vocab_major=True,
    columns=columns,
    interpret=interpret,
  )
  grads = dict(sig.unpack(outs, results=True))
  if "db" in grads:
    grads["db"] = grads["db"][:, 0, :]  # (G, 1, V) rows back to (G, V)
  return grads
