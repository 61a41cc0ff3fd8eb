"""What every cross-entropy implementation shares: the operands' layout and the tile math.

The primitives (``primitives/cross_entropy.py``) never hold the loss itself:
they compute three float32 statistics per token of the logits ``z`` (``x @ w
+ b`` for ``linear_cross_entropy``, the given logits for ``cross_entropy``),
after the optional soft cap ``z' = cap * tanh(z / cap)``:

* ``lse = log(sum_v exp(z'_v))``,
* ``zy = z'_label`` (0 when the label is outside ``[0, V)``),
* ``zsum = sum_v z'_v`` (what label smoothing needs).

Every loss option (ignored tokens, label smoothing, z-loss, reductions) is
plain jnp on these ``(G, N)`` statistics in the public functions, so JAX
differentiates it, and the kernels stay small. With ``p = exp(z' - lse)``
and ``c = dz'/dz`` (``1 - (z'/cap)**2``, or 1 without a cap), the tangent
stage maps a tangent ``dz`` of the logits to the statistics' tangents
``(sum p c dz, c_y dz_y, sum c dz)``, and the backward stage maps their
cotangents ``(a_lse, a_zy, a_sum)`` to the logits' cotangent
``g = c * (p * a_lse + [v == label] * a_zy + a_sum)``, then to ``x``, ``w``
and ``b`` (``g @ w^T``, ``x^T @ g``, ``sum_n g``). Statistics are shared
across vocabulary shards by all-reduces (a max and sums), so a vocab-sharded
weight is never gathered.

Operands of the primitives, by name (``SIGNATURE``; ``G`` groups: 1 unless
vmap folded a mapped weight into it; ``N`` tokens; ``D`` hidden; ``V``
vocabulary):

* ``x (G, N, D)`` with ``linear``; without it ``x`` is the logits ``(G, N, V)``;
* ``w (G, D, V)`` with ``linear`` (``(G, V, D)`` with ``transposed_weight``: a
  tied embedding table read in place);
* ``b (G, V)`` with ``has_bias`` (and ``linear``);
* ``labels (G, N)`` int32.

The primitives keep the caller's token dims (``N`` stands for any number of
them); the implementations see them flattened (``flat_tokens``).

Stages (``pallax.op.signature`` names them: ``x_dot`` is the tangent of ``x``,
``dx`` its gradient, ``dlse`` the cotangent of ``lse``):

* ``fwd (x, [w], [b], labels) -> (lse, zy, zsum)``, each ``(G, N)`` in the
  stats dtype (float32; float64 for float64 inputs);
* ``jvp (x, [w], [b], labels, lse, x_dot, [w_dot], [b_dot]) -> (lse_dot,
  zy_dot, zsum_dot)``, linear in the tangents;
* ``bwd (x, [w], [b], labels, lse, dlse, dzy, dzsum) -> (dx, [dw], [db])`` in
  the inputs' dtypes; ``dw`` in ``w``'s layout, accumulated in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallax.op.signature import Named, Operand, ResidualSignature, Signature
from pallax.pallas_utils import stat_dtype

# The op's operands by name: every stage's operands start with the inputs and
# ``lse`` (``residuals``), all that the tangent and backward stages need of the
# forward; the statistics are all differentiable (the loss reads all three).
SIGNATURE = ResidualSignature(
  inputs=(
    Operand("x", differentiable=True),  # x, or the logits without ``linear``
    Operand("w", when="linear", differentiable=True),
    Operand("b", when="has_bias", differentiable=True),
    Operand("labels"),
  ),
  outputs=(
    Operand("lse", differentiable=True),
    Operand("zy", differentiable=True),
    Operand("zsum", differentiable=True),
  ),
  residuals=("x", "w", "b", "labels", "lse"),
)
# The floating inputs, in order: those with a tangent and a gradient.
_FLOATS = tuple(o.name for o in SIGNATURE.inputs if o.differentiable)
# The backward's per-token operands as ``cotangent`` takes them: ``lse``, then
# the cotangents of the statistics.
BWD_STATS = ("lse", "dlse", "dzy", "dzsum")
# The inputs without token dims (they lead with the groups only), and so their
# tangents and gradients; every other operand and result leads with (G, N).
_WEIGHTS = frozenset({"w", "b"})


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static shape of a call: sizes, dtypes and the features it uses."""

  groups: int
  tokens: int
  hidden: int  # D; 0 without ``linear``
  vocab: int
  dtype: Any  # of x (or the logits)
  w_dtype: Any  # of w (None without ``linear``)
  linear: bool
  has_bias: bool
  transposed_weight: bool
  soft_cap: Optional[float]

  @classmethod
  def of(
    cls,
    avals: Sequence[Any],
    *,
    linear: bool,
    has_bias: bool,
    transposed_weight: bool,
    soft_cap: Optional[float],
    **params,
  ) -> Problem:
    """The shape of a call of any stage, from its operands' avals and its params."""
    named = inputs(avals, dict(linear=linear, has_bias=has_bias))
    first = named.x
    groups, tokens = first.shape[0], math.prod(first.shape[1:-1])
    if linear:
      w = named.w
      vocab = w.shape[1] if transposed_weight else w.shape[2]
      return cls(
        groups,
        tokens,
        first.shape[-1],
        vocab,
        first.dtype,
        w.dtype,
        True,
        has_bias,
        transposed_weight,
        soft_cap,
      )
    return cls(groups, tokens, 0, first.shape[-1], first.dtype, None, False, False, False, soft_cap)

  @property
  def stat_dtype(self):
    return stat_dtype(self.dtype)


def inputs(operands: Sequence[Any], params) -> Named:
  """The op's inputs by name, from the operands (or avals) of any of its stages, which they lead."""
  fwd = SIGNATURE.stage("fwd", params)
  return fwd.unpack(operands[: len(fwd.operands)])


def operands(stage: str, ops: Sequence[Any], params) -> Named:
  """The operands ``ops`` of ``stage`` for a call with ``params``, by name."""
  return SIGNATURE.stage(stage, params).unpack(ops)


def float_names(named: Named) -> list[str]:
  """The names of the floating inputs ``named`` has, in order: ``x``, then ``w`` and ``b``."""
  return [n for n in _FLOATS if n in named]


def returning(sig: Signature, *results: str) -> Signature:
  """``sig`` for a kernel that returns only those of ``results`` the call has."""
  return dataclasses.replace(sig, results=tuple(r for r in sig.results if r in results))


def kernel_refs(sig: Signature, refs: Sequence[Any]) -> tuple[Named, list]:
  """A kernel's refs by name (its operands, then its results), and its scratch refs after them."""
  count = len(sig.operands) + len(sig.results)
  return sig.unpack_all(refs[:count]), list(refs[count:])


def has_tokens(sig: Signature, name: str) -> bool:
  """Whether operand or result ``name`` leads with ``(G, N)`` (else with ``G``: a weight)."""
  return sig.operand(name).name not in _WEIGHTS


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A call cut into blocks of ``bn`` tokens, ``bv`` vocabulary and ``bd`` hidden columns.

  The base of the Pallas kernels' layouts; each backend picks the sizes.
  """

  p: Problem
  bn: int
  bv: int
  bd: int

  @property
  def nn(self) -> int:
    return pl.cdiv(self.p.tokens, self.bn)

  @property
  def nv(self) -> int:
    return pl.cdiv(self.p.vocab, self.bv)

  @property
  def nd(self) -> int:
    """Hidden blocks (1 without ``linear``)."""
    return pl.cdiv(self.p.hidden, self.bd) if self.p.linear else 1


def flat_tokens(stage: str, fn):
  """``fn`` (an implementation of ``stage`` on ``(G, N, ...)`` operands) for any token dims.

  The primitives keep the caller's token dims, ``(G, *T, ...)``, so that
  sharded token dims never meet a reshape outside a shard (merging two
  sharded dims would gather them); inside the lowering, arrays are local and
  the reshape to one token dim is free.
  """

  @functools.wraps(fn)
  def run(*ops, **params):
    p = Problem.of([jax.typeof(o) for o in ops], **params)
    sig = SIGNATURE.stage(stage, params)
    tokens = inputs(ops, params).labels.shape[1:]
    flat = [
      o.reshape(p.groups, p.tokens, *o.shape[1 + len(tokens) :]) if has_tokens(sig, n) else o
      for n, o in zip(sig.operands, ops)
    ]
    outs = fn(*flat, **params)
    return [
      o.reshape(p.groups, *tokens, *o.shape[2:]) if has_tokens(sig, n) else o
      for n, o in zip(sig.results, outs)
    ]

  return run


def capped(z: jax.Array, soft_cap: Optional[float]) -> tuple[jax.Array, Optional[jax.Array]]:
  """``(z', c)``: the soft-capped logits and ``dz'/dz`` (None without a cap)."""
  if soft_cap is None:
    return z, None
  zc = soft_cap * jnp.tanh(z / soft_cap)
  return zc, 1 - jnp.square(zc / soft_cap)


def stats_init(rows: int, dtype) -> tuple[jax.Array, ...]:
  """Initial running statistics ``(m, s, zy, zsum)``, each ``(rows, 1)``."""
  zeros = jnp.zeros((rows, 1), dtype)
  return jnp.full((rows, 1), -jnp.inf, dtype), zeros, zeros, zeros


def stats_update(acc, zc: jax.Array, hit: Optional[jax.Array], valid: Optional[jax.Array]):
  """Folds a ``(rows, cols)`` tile of capped logits into ``(m, s, zy, zsum)``.

  ``m`` and ``s`` are the running max and sum of ``exp(z' - m)`` (online
  logsumexp); ``hit`` marks each row's label column (None: ``zy`` is left
  to the caller, as the XLA programs gather it); ``valid`` (None: all) the
  columns inside the vocabulary.
  """
  m, s, zy, zsum = acc
  if valid is not None:
    zc_sum = jnp.where(valid, zc, 0)
    zc = jnp.where(valid, zc, -jnp.inf)
  else:
    zc_sum = zc
  m_new = jnp.maximum(m, jnp.max(zc, axis=1, keepdims=True))
  s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(zc - m_new), axis=1, keepdims=True)
  if hit is not None:
    zy = zy + jnp.sum(jnp.where(hit, zc_sum, 0), axis=1, keepdims=True)
  return m_new, s, zy, zsum + jnp.sum(zc_sum, axis=1, keepdims=True)


def stats_finish(acc) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(lse, zy, zsum)`` from the running statistics."""
  m, s, zy, zsum = acc
  return m + jnp.log(s), zy, zsum


def tangent_update(acc, zc, c, lse, dz, hit, valid):
  """Adds a tile's terms to ``(dlse, dzy, dzsum)``: ``(sum p c dz, c_y dz_y, sum c dz)``.

  ``dz`` is the logits' tangent tile; columns outside ``valid`` count nothing.
  """
  cdz = dz if c is None else c * dz
  if valid is not None:
    cdz = jnp.where(valid, cdz, 0)
  p = jnp.exp(zc - lse)
  dlse, dzy, dzsum = acc
  return (
    dlse + jnp.sum(p * cdz, axis=1, keepdims=True),
    dzy + jnp.sum(jnp.where(hit, cdz, 0), axis=1, keepdims=True),
    dzsum + jnp.sum(cdz, axis=1, keepdims=True),
  )


def cotangent(zc, c, lse, hit, valid, a_lse, a_zy, a_sum) -> jax.Array:
  """The logits' cotangent tile ``c * (p a_lse + [v == label] a_zy + a_sum)`` (0 outside ``valid``).

  ``lse`` and the ``a_*`` are ``(rows, 1)`` columns.
  """
  g = jnp.exp(zc - lse) * a_lse + jnp.where(hit, a_zy, 0) + a_sum
  if c is not None:
    g = c * g
  return g if valid is None else jnp.where(valid, g, 0)


def combine_stats(lse, zy, zsum, *, pmax, psum):
  """Statistics of the whole vocabulary from per-part ones (vocab shards or splits).

  ``pmax`` and ``psum`` reduce across the parts; ``zy`` and ``zsum`` are plain
  sums (a label lies in one part; the others contribute 0).
  """
  m = jax.lax.stop_gradient(pmax(lse))
  return m + jnp.log(psum(jnp.exp(lse - m))), psum(zy), psum(zsum)


def kept_tokens(labels: jax.Array, ignore_index: Optional[int]) -> jax.Array:
  """The tokens that count: those whose label is not ``ignore_index``."""
  if ignore_index is None:
    return jnp.ones(labels.shape, bool)
  return labels != ignore_index


def token_loss(
  lse: jax.Array,
  zy: jax.Array,
  zsum: jax.Array,
  labels: jax.Array,
  *,
  vocab: int,
  ignore_index: Optional[int],
  label_smoothing: float,
  z_loss: float,
) -> jax.Array:
  """Each token's loss from its statistics: 0 where ignored, NaN where the label is out of range.

  ``lse - (1 - eps) zy - eps / V zsum + z_loss lse**2``: the one formula of
  the loss options, which the public functions and the fused CPU program
  (``xla.value_and_grad``) both differentiate with JAX.
  """
  loss = lse - (1 - label_smoothing) * zy
  if label_smoothing:
    loss = loss - (label_smoothing / vocab) * zsum
  if z_loss:
    loss = loss + z_loss * jnp.square(lse)
  loss = jnp.where((labels >= 0) & (labels < vocab), loss, jnp.nan)
  return jnp.where(kept_tokens(labels, ignore_index), loss, 0)


def mean_scale(labels: jax.Array, ignore_index: Optional[int], reduction: str, dtype) -> jax.Array:
  """The factor of the summed token losses: 1 (``"sum"``), or 1 / kept tokens (``"mean"``).

  ``labels`` is ``(G, *T)``: one scale per group, ``(G,)``. Summed without a
  reshape, which would gather token dims sharded over two mesh axes.
  """
  if reduction == "sum":
    return jnp.ones(labels.shape[:1], dtype)
  kept = jnp.sum(kept_tokens(labels, ignore_index), axis=tuple(range(1, labels.ndim)))
  return 1 / jnp.maximum(kept, 1).astype(dtype)
