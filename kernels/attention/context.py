"""Attention over a sequence sharded across devices: the per-shard programs (context parallelism).

When the query sequence ``t`` or the key sequence ``s`` is sharded, each
device holds a block of the queries and a block of the keys, and no kernel
call on its own blocks gives its rows' attention. Two programs compute it
from the same kernels (``pallax.op.collectives``), for each of the three
stages:

* ``ring``: the key-side blocks (``k``, ``v``, their segment ids and
  tangents) travel round a ``ppermute`` ring over the sequence axes; at each
  step a device runs the stage's kernel on its queries against the block it
  holds, while the next block is already on its way. The forward merges the
  partial ``(out, lse)`` by log-sum-exp; the tangent and the backward are
  given the merged ``out`` and ``lse``, with which every key block's share is
  exact (``P`` recomputed from ``lse``), so the tangent sums the shares and
  the backward's ``dk``/``dv`` accumulators travel with their block and come
  home after one more hop. Nothing is recomputed and K/V are never gathered;
  under GQA only the kv heads travel.
* ``all_gather``: K/V (and what travels with them) are gathered once and
  each device runs its queries against the whole sequence; the backward's
  ``dk``/``dv`` are reduce-scattered back. Cheap when K/V are small (few kv
  heads, short blocks): one collective start-up instead of ``P - 1``.

Masks follow global positions. A device's local tokens are ``Piece``s of the
sequence layout (``pallax.sequence_layout``): runs of tokens at evenly spaced
global positions. For a query piece and a key piece the causal mask and the
local window become a window of their own on local indices, with bounds that
depend on which devices hold them; each (step, piece pair) precomputes the
window for every device and switches between the distinct ones
(``lax.switch`` on the device index), so a pair that masking hides on a
device is skipped there, not computed, and a fully visible one runs without a
mask. Lengths become per-piece lengths, segment ids are sliced with their
tokens, a bias or mask is sharded with the queries (its key dim replicated)
and sliced per key block. Sinks join once, around the program
(``with_sinks``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallax.kernels.attention.common import NEG_INF, SIGNATURE, Problem, with_sinks
from pallax.op import Program, Shards
from pallax.sequence_layout import Piece, SequenceLayout

__all__ = ["in_layout", "programs", "LATENCY_BYTES"]

# What one collective's start-up costs, in bytes of transfer (about 10 us at
# the tens of GB/s of a device link): the unit the two programs' costs share.
LATENCY_BYTES = 256 * 1024

# The most K/V (with what travels with them) the all-gather may hold on one
# device; above it only the ring, whose memory stays one block, is a candidate.
GATHER_LIMIT_BYTES = 2 * 1024**3

# The query-sequence and key-sequence dims of the operands and results,
# by the name of the input (or output) each is or derives from.
_SEQ_DIMS = {
  "q": (3, None),
  "k": (None, 2),
  "v": (None, 2),
  "q_seg": (1, None),
  "kv_seg": (None, 1),
  "bias": (3, 4),
  "mask": (3, 4),
  "out": (3, None),
  "lse": (3, None),
}
_KEY_SIDE = ("k", "v", "kv_seg", "k_dot", "v_dot")


def _dims_of(sig, name: str) -> tuple[Optional[int], Optional[int]]:
  return _SEQ_DIMS.get(sig.operand(name).name, (None, None))


def _take(x, dims, indices) -> jax.Array:
  """``x`` with its ``(t, s)`` dims reindexed by ``indices`` (None: left as is)."""
  for dim, index in zip(dims, indices):
    if dim is not None and index is not None:
      x = jnp.take(x, index, axis=dim)
  return x


def in_layout(stage: str, fn: Callable) -> Callable:
  """``fn``, one stage of an implementation in natural token order, taking a sequence layout.

  With ``sequence_layout`` a non-natural ``SequenceLayout``, the operands'
  sequence dims are permuted to natural order, ``fn`` runs, and the results
  are permuted back: a layout means the same on one device as sharded.
  """

  def run(*operands, **params):
    layout = params.get("sequence_layout")
    if layout is None or layout.natural:
      return fn(*operands, **params)
    sig = SIGNATURE.stage(stage, params)
    lengths = (operands[0].shape[3], operands[1].shape[2])
    orders = tuple(layout.order(n) for n in lengths)
    inverse = tuple(layout.inverse_order(n) for n in lengths)
    ops = [_take(x, _dims_of(sig, n), inverse) for n, x in zip(sig.operands, operands)]
    outs = fn(*ops, **dict(params, sequence_layout=None))
    return [_take(x, _dims_of(sig, n), orders) for n, x in zip(sig.results, outs)]

  return run


# ----------------------------------------------------------------------------
# Where a device's tokens are: pieces and the windows between them.


def _local_window(left, right, q: Piece, k: Piece):
  """The window ``(left, right)`` on local indices of a query and a key piece (same stride).

  Global positions ``q.first + σ t`` and ``k.first + σ s`` see each other
  iff ``-left <= k_pos - q_pos <= right``, that is
  ``-floor((left + k.first - q.first) / σ) <= s - t`` and
  ``s - t <= floor((right + q.first - k.first) / σ)``.
  """
  step = q.stride
  new_left = None if left is None else (left + k.first - q.first) // step
  new_right = None if right is None else (right + q.first - k.first) // step
  return new_left, new_right


HIDDEN = "hidden"


def _variant(left, right, q: Piece, k: Piece):
  """``HIDDEN``, or the static window the kernel runs the pair with (None: unbounded)."""
  left, right = _local_window(left, right, q, k)
  if (right is not None and right < 1 - q.length) or (left is not None and left < 1 - k.length):
    return HIDDEN
  if right is not None and right >= k.length - 1:
    right = None
  if left is not None and left >= q.length - 1:
    left = None
  return (left, right)


@dataclasses.dataclass(frozen=True)
class _Side:
  """One side's local tokens: their pieces for each value of the device index that places them.

  ``pieces[i]`` for index value ``i`` (a single entry: the same on every
  device); every entry has the same starts and lengths, only the global
  positions differ.
  """

  pieces: tuple[tuple[Piece, ...], ...]

  def firsts(self, j: int) -> np.ndarray:
    """The global position of piece ``j``'s first token, per index value."""
    return np.array([ps[j].first for ps in self.pieces], np.int32)


def _whole(layout: SequenceLayout, length: int) -> tuple[Piece, ...]:
  """The pieces of a whole sequence on one device, as ``_gathered_order`` leaves it.

  Natural order (one piece) unless the layout is strided (striped): then the
  layout's device blocks, each a piece with their stride.
  """
  if layout.stride == 1:
    return (Piece(0, length, 0, 1),)
  n = length // layout.shards
  return tuple(
    Piece(j * n + p.start, p.length, p.first, p.stride)
    for j in range(layout.shards)
    for p in layout.pieces(j, length)
  )


def _natural_index(layout: SequenceLayout, length: int) -> Optional[np.ndarray]:
  """The reindexing that puts a whole sequence held in ``layout`` into ``_whole``'s order."""
  if layout.natural or layout.stride != 1:
    return None
  return layout.inverse_order(length)


def _layout_index(layout: SequenceLayout, length: int) -> Optional[np.ndarray]:
  """The reindexing that undoes ``_natural_index`` (None where that is None)."""
  return None if _natural_index(layout, length) is None else layout.order(length)


def _block_layout(layout: SequenceLayout, blocks: int, what: str) -> SequenceLayout:
  """The layout of a side sharded in ``blocks``; ValueError if ``layout`` names another count."""
  if layout.natural:
    return SequenceLayout("contiguous", blocks)
  if layout.shards != blocks:
    raise ValueError(
      f"dot_product_attention: sequence_layout {layout} is for {layout.shards} shards but the "
      f"{what} sequence is sharded over {blocks} devices"
    )
  return layout


# ----------------------------------------------------------------------------
# The stages' per-pair work: what a pair of pieces adds to the accumulators.


def _count(length, first, stride: int, n: int):
  """How many of a piece's ``n`` tokens (global ``first + stride i``) lie below ``length``."""
  return jnp.clip(-((first - length) // stride), 0, n).astype(jnp.int32)


def _cut(x, dim: int, start, size: int):
  return lax.dynamic_slice_in_dim(x, start, size, axis=dim)


def _merge_fwd(state, res):
  """``(out, lse)`` accumulated with a pair's ``(out, lse)`` by log-sum-exp."""
  out, lse = state
  part_out, part_lse = res
  merged = jnp.logaddexp(lse, part_lse)
  safe = jnp.where(merged == NEG_INF, 0.0, merged)
  w_old = jnp.where(lse == NEG_INF, 0.0, jnp.exp(lse - safe))
  w_new = jnp.where(part_lse == NEG_INF, 0.0, jnp.exp(part_lse - safe))
  return out * w_old[..., None] + part_out.astype(out.dtype) * w_new[..., None], merged


@dataclasses.dataclass
class _Run:
  """One program run of one stage on one device: the operands, the sides and the kernel."""

  stage: str
  sig: Any
  ops: dict
  params: dict
  p: Problem
  kernel: Callable
  q_side: _Side
  q_index: Any  # the device index placing the queries (None: static)

  def pair(self, q: Piece, k: Piece, keys: dict, col, window, q0, k0):
    """The stage kernel's results for query piece ``q`` against key piece ``k`` of ``keys``.

    ``col``: where ``keys``' block starts in a bias' key dim; ``q0``/``k0``:
    the pieces' first global positions (traced), for the lengths.
    """
    ops, named = self.ops, {}
    for name in self.sig.operands:
      x = keys[name] if name in keys else ops[name]
      t_dim, s_dim = _dims_of(self.sig, name)
      if t_dim is not None:
        x = lax.slice_in_dim(x, q.start, q.start + q.length, axis=t_dim)
      if s_dim is not None:
        start = k.start if name in keys else col + k.start
        x = _cut(x, s_dim, start, k.length)
      named[name] = x
    b = self.p.batch
    if self.params["has_lengths"]:
      named["q_len"] = _count(ops["q_len"], q0, q.stride, q.length)
      named["kv_len"] = _count(ops["kv_len"], k0, k.stride, k.length)
    else:
      named["q_len"] = jnp.full((b,), q.length, jnp.int32)
      named["kv_len"] = jnp.full((b,), k.length, jnp.int32)
    params = dict(self.params, window_left=window[0], window_right=window[1])
    return self.kernel(*self.sig.pack(named), **params)


def _pairs(run: _Run, key_side: _Side, left, right):
  """Per (query piece, key piece): the distinct variants and each device's choice among them."""
  out = []
  for qi in range(len(run.q_side.pieces[0])):
    for kj in range(len(key_side.pieces[0])):
      n = max(len(run.q_side.pieces), len(key_side.pieces))
      per_device = [
        _variant(
          left,
          right,
          run.q_side.pieces[i % len(run.q_side.pieces)][qi],
          key_side.pieces[i % len(key_side.pieces)][kj],
        )
        for i in range(n)
      ]
      distinct = list(dict.fromkeys(per_device))
      if distinct == [HIDDEN]:
        continue
      table = np.array([distinct.index(v) for v in per_device], np.int32)
      out.append((qi, kj, distinct, table))
  return out


def _visit(run: _Run, state, update, keys: dict, key_side: _Side, col):
  """``state`` updated with every visible (query piece, key piece) pair of one key block.

  ``update(state, qi, kj, results) -> state`` folds a pair's kernel results
  in; a pair hidden on this device leaves it as is.
  """
  left, right = run.params["window_left"], run.params["window_right"]
  index = run.q_index
  for qi, kj, distinct, table in _pairs(run, key_side, left, right):
    q, k = run.q_side.pieces[0][qi], key_side.pieces[0][kj]
    q0, k0 = _lookup(run.q_side.firsts(qi), index), _lookup(key_side.firsts(kj), index)

    def branch(variant, state, qi=qi, kj=kj, q=q, k=k, q0=q0, k0=k0):
      if variant == HIDDEN:
        return state
      res = run.pair(q, k, keys, col, variant, q0, k0)
      return update(state, qi, kj, res)

    if len(distinct) == 1:
      state = branch(distinct[0], state)
    else:
      which = _lookup(table, index)
      state = lax.switch(which, [functools.partial(branch, v) for v in distinct], state)
  return state


def _lookup(table: np.ndarray, index):
  """``table[index]`` for a traced device index (``table[0]`` where ``index`` is None)."""
  if index is None or len(table) == 1:
    return jnp.int32(table[0])
  return jnp.asarray(table)[index]


# ----------------------------------------------------------------------------
# The three stages' accumulators.


def _stage_state(run: _Run, key_block: dict):
  """The accumulators a stage starts from: per query piece, and for the backward per key block."""
  p, st = run.p, run.p.stat
  b, kh, g = p.batch, p.kv_heads, p.groups
  rows = [q.length for q in run.q_side.pieces[0]]
  if run.stage == "fwd":
    return tuple(
      (jnp.zeros((b, kh, g, n, p.value_dim), st), jnp.full((b, kh, g, n), NEG_INF, st))
      for n in rows
    )
  if run.stage == "jvp":
    return tuple(
      (jnp.zeros((b, kh, g, n, p.value_dim), st), jnp.zeros((b, kh, g, n), st)) for n in rows
    )
  dq = tuple(jnp.zeros((b, kh, g, n, p.head_dim), st) for n in rows)
  dbias = jnp.zeros(run.ops["bias"].shape, st) if p.differentiates_bias else None
  return dq, _key_grads(key_block, st), dbias


def _key_grads(key_block: dict, st) -> tuple[jax.Array, jax.Array]:
  return tuple(jnp.zeros(key_block[n].shape, st) for n in ("k", "v"))


def _updater(run: _Run, key_side: _Side, col):
  """``update(state, qi, kj, results)`` of the stage."""
  if run.stage == "fwd":
    return lambda s, qi, kj, res: _replace(s, qi, _merge_fwd(s[qi], res))
  if run.stage == "jvp":
    return lambda s, qi, kj, res: _replace(
      s, qi, (s[qi][0] + res[0].astype(s[qi][0].dtype), s[qi][1] + res[1])
    )

  def bwd(state, qi, kj, res):
    dq, (dk, dv), dbias = state
    k = key_side.pieces[0][kj]
    dq = _replace(dq, qi, dq[qi] + res[0].astype(dq[qi].dtype))
    add = lambda acc, x: lax.dynamic_update_slice_in_dim(
      acc, _cut(acc, 2, k.start, k.length) + x.astype(acc.dtype), k.start, axis=2
    )
    dk, dv = add(dk, res[1]), add(dv, res[2])
    if dbias is not None:
      q = run.q_side.pieces[0][qi]
      rows = lax.slice_in_dim(dbias, q.start, q.start + q.length, axis=3)
      start = col + k.start
      rows = lax.dynamic_update_slice_in_dim(
        rows, _cut(rows, 4, start, k.length) + res[3].astype(rows.dtype), start, axis=4
      )
      dbias = lax.dynamic_update_slice_in_dim(dbias, rows, q.start, axis=3)
    return dq, (dk, dv), dbias

  return bwd


def _replace(tup, i: int, value):
  return tup[:i] + (value,) + tup[i + 1 :]


def _query_results(run: _Run, state, q_back) -> dict:
  """The stage's query-side results (and the backward's ``dbias``) from its accumulators."""
  p = run.p
  cat = lambda xs: _take(jnp.concatenate(xs, axis=3), (3,), (q_back,))
  if run.stage == "fwd":
    out = cat([s[0] for s in state]).astype(p.dtype)
    return {"out": out, "lse": cat([s[1] for s in state])}
  if run.stage == "jvp":
    return {
      "out_dot": cat([s[0] for s in state]).astype(p.dtype),
      "lse_dot": cat([s[1] for s in state]),
    }
  dq, _, dbias = state
  named = {"dq": cat(list(dq)).astype(p.dtype)}
  if dbias is not None:
    named["dbias"] = _take(dbias, (3,), (q_back,)).astype(run.ops["bias"].dtype)
  return named


# ----------------------------------------------------------------------------
# The programs.


def _seq_axes(shards: Shards) -> tuple[tuple[str, ...], tuple[str, ...]]:
  return shards.axes("t"), shards.axes("s")


def _prepare(stage: str, kernel, shards: Shards, operands, params):
  """The ``_Run`` of a device, the call's layout, and the query reindexing to undo."""
  sig = SIGNATURE.stage(stage, params)
  named = sig.unpack(operands)
  ops = {n: named[n] for n in sig.operands}
  p = Problem.of(operands, **params)
  layout = params["sequence_layout"] or SequenceLayout()
  pt = shards.size("t")
  t_len = p.t * pt
  q_back = None
  if pt > 1:
    q_layout = _block_layout(layout, pt, "query")
    q_side = _Side(tuple(q_layout.pieces(d, t_len) for d in range(pt)))
    q_index = lax.axis_index(shards.axes("t"))
  else:
    q_side = _Side((_whole(layout, t_len),))
    q_index = None
    index = _natural_index(layout, t_len)
    if index is not None:
      for name in sig.operands:
        t_dim = _dims_of(sig, name)[0]
        if t_dim is not None:
          ops[name] = _take(ops[name], (t_dim,), (index,))
      q_back = _layout_index(layout, t_len)
  inner = dict(params, sequence_layout=None, sequence_axes=None)
  run = _Run(stage, sig, ops, inner, p, kernel, q_side, q_index)
  return run, layout, q_back


def _finish(run: _Run, shards: Shards, named: dict) -> list:
  """The stage's results, summed over the mesh axes of the reduced factors other than ``t``, ``s``.

  The program completes every result over the sequence itself.
  """
  sig = run.sig
  seq = set(shards.axes("t")) | set(shards.axes("s"))
  out = []
  for i, name in enumerate(sig.results):
    x = named[name]
    axes = tuple(a for a in shards.summed[i] if a not in seq)
    out.append(lax.psum(x, axes) if axes else x)
  return out


def _key_block(run: _Run) -> dict:
  return {n: run.ops[n] for n in _KEY_SIDE if n in run.ops}


def _ring(stage: str, kernel, shards: Shards, *operands, **params) -> list:
  """One device's results of a stage, the key blocks travelling round a ``ppermute`` ring."""
  run, layout, q_back = _prepare(stage, kernel, shards, operands, params)
  t_axes, s_axes = _seq_axes(shards)
  if t_axes != s_axes:  # chosen only where the all-gather was no candidate either
    raise ValueError(
      f"dot_product_attention: the query sequence is sharded over {t_axes} and the key sequence "
      f"over {s_axes}: the ring needs both over the same mesh axes, and gathering K/V would hold "
      f"more than GATHER_LIMIT_BYTES ({GATHER_LIMIT_BYTES}) on a device; shard both sequences "
      "over the same axes"
    )
  n = shards.size("t")
  s_len = run.p.s * n
  k_layout = _block_layout(layout, n, "key/value")
  ring = [(i, (i + 1) % n) for i in range(n)]
  send = lambda x: lax.ppermute(x, s_axes, ring)
  keys = _key_block(run)
  state = _stage_state(run, keys)
  s_blk = run.p.s
  for step in range(n):
    nxt = send(keys) if step < n - 1 else None  # issued before this step's products
    key_side = _Side(tuple(k_layout.pieces((d - step) % n, s_len) for d in range(n)))
    block = lax.rem(run.q_index - step + n, n)
    col = block * s_blk
    state = _visit(run, state, _updater(run, key_side, col), keys, key_side, col)
    if stage == "bwd" and step < n - 1:
      dq, grads, dbias = state
      state = dq, send(grads), dbias
    keys = nxt if nxt is not None else keys
  named = _query_results(run, state, q_back)
  if stage == "bwd":
    dk, dv = send(state[1])  # home: the block each device ends with is its right neighbour's
    named.update(dk=dk.astype(run.p.dtype), dv=dv.astype(run.p.dtype))
  return _finish(run, shards, named)


def _all_gather(stage: str, kernel, shards: Shards, *operands, **params) -> list:
  """One device's results of a stage against the whole key sequence, gathered once."""
  run, layout, q_back = _prepare(stage, kernel, shards, operands, params)
  t_axes, s_axes = _seq_axes(shards)
  ps = shards.size("s")
  s_len = run.p.s * ps
  keys = _key_block(run)
  if ps > 1:
    _block_layout(layout, ps, "key/value")
    keys = {
      n: lax.all_gather(x, s_axes, axis=_dims_of(run.sig, n)[1], tiled=True)
      for n, x in keys.items()
    }
  index = _natural_index(layout, s_len)
  keys = {n: _take(x, (None, _dims_of(run.sig, n)[1]), (None, index)) for n, x in keys.items()}
  for name in ("bias", "mask", "bias_dot"):
    if name in run.ops:
      run.ops[name] = _take(run.ops[name], (4,), (index,))
  key_side = _Side((_whole(layout, s_len),))
  state = _stage_state(run, keys)
  state = _visit(run, state, _updater(run, key_side, 0), keys, key_side, 0)
  named = _query_results(run, state, q_back)
  if stage == "bwd":
    back = _layout_index(layout, s_len)
    for name, grad in zip(("dk", "dv"), state[1]):
      grad = _take(grad, (2,), (back,))
      named[name] = _own_block(grad, t_axes, s_axes, ps).astype(run.p.dtype)
    if "dbias" in named:
      named["dbias"] = _take(named["dbias"], (4,), (back,))
  return _finish(run, shards, named)


def _own_block(grad, t_axes, s_axes, ps: int):
  """A device's block of a whole-sequence key gradient summed over the devices' query blocks.

  Summed over the query axes that do not hold keys; then reduce-scattered
  over the key axes where the query axes hold them all, else summed over the
  shared ones and cut.
  """
  only_t = tuple(a for a in t_axes if a not in s_axes)
  grad = lax.psum(grad, only_t) if only_t else grad
  if ps == 1:
    return grad
  if set(s_axes) <= set(t_axes):
    return lax.psum_scatter(grad, s_axes, scatter_dimension=2, tiled=True)
  shared = tuple(a for a in s_axes if a in t_axes)
  grad = lax.psum(grad, shared) if shared else grad
  size = grad.shape[2] // ps
  return _cut(grad, 2, lax.axis_index(s_axes) * size, size)


# ----------------------------------------------------------------------------
# Costs and the programs of a stage.


def _kv_bytes(avals) -> int:
  k, v = avals[1], avals[2]
  return k.size * np.dtype(k.dtype).itemsize + v.size * np.dtype(v.dtype).itemsize


def _ring_cost(shards: Shards, *avals) -> float:
  """``P - 1`` ``ppermute`` start-ups; each block's transfer hides behind the previous product."""
  t_axes, s_axes = _seq_axes(shards)
  if not t_axes or t_axes != s_axes:
    return math.inf
  return (shards.size("s") - 1) * LATENCY_BYTES


def _gather_cost(shards: Shards, *avals) -> float:
  """One ``all_gather`` start-up and the ``P - 1`` blocks it brings before any product starts.

  Not a candidate (infinite) where the gathered K/V would pass ``GATHER_LIMIT_BYTES``.
  """
  ps = shards.size("s")
  if ps == 1:
    return 0.0
  if ps * _kv_bytes(avals) > GATHER_LIMIT_BYTES:
    return math.inf
  return LATENCY_BYTES + (ps - 1) * _kv_bytes(avals)


def _with_sinks(program, stage: str, kernel, params: dict):
  """``program`` with the sinks applied once around it.

  ``dsinks`` sums a device's query rows: it is summed over the devices
  holding other rows (not over the key-only sequence axes, whose devices
  hold the same rows).
  """

  def run(shards, *operands):
    inner = functools.partial(program, stage, kernel, shards)
    outs = with_sinks(stage, inner)(*operands, **params)
    if stage == "bwd" and params["has_sinks"]:
      t_axes, s_axes = _seq_axes(shards)
      key_only = set(s_axes) - set(t_axes)
      axes = tuple(a for a in shards.summed[-1] if a not in key_only)
      outs[-1] = lax.psum(outs[-1], axes) if axes else outs[-1]
    return outs

  return run


def programs(stage: str, kernel: Callable, params: dict) -> tuple[Program, ...]:
  """The ring and all-gather programs of a call of ``stage`` with ``params``.

  ``kernel(*operands, **params)`` binds the stage's kernel primitive.
  """
  ring = _with_sinks(_ring, stage, kernel, params)
  gather = _with_sinks(_all_gather, stage, kernel, params)
  return (
    Program("ring", ("t", "s"), ring, _ring_cost, shares_axes=True),
    Program("all_gather", ("t", "s"), gather, _gather_cost, shares_axes=True),
  )


def visible_blocks(layout: SequenceLayout, t: int, s: int, left=None, right=None) -> np.ndarray:
  """Per device, how many (query block, key block) pairs of a ring are not hidden (a work count).

  ``t``, ``s``: the global lengths; the window as the kernels take it (causal:
  ``right=0``). A pair counts its query rows times key columns that its
  variant computes: the whole pair unless hidden. Used by the bench and docs
  to show the zigzag and striped layouts evening out causal work.
  """
  n = layout.shards
  q_layout = layout if not layout.natural else SequenceLayout("contiguous", n)
  work = np.zeros(n, np.int64)
  for d in range(n):
    for e in range(n):
      for q in q_layout.pieces(d, t):
        for k in q_layout.pieces(e, s):
          if _variant(left, right, q, k) != HIDDEN:
            work[d] += q.length * k.length
  return work
