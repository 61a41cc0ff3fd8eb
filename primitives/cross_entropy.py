"""Cross-entropy losses: ``pallax.cross_entropy`` and ``pallax.linear_cross_entropy``.

``linear_cross_entropy(x, weight, labels)`` is the language-model head's loss,
``cross_entropy(x @ weight + bias, labels)``, without ever holding the
``[tokens, vocab]`` logits: the kernels compute them tile by tile. Both ops
share three primitives (``kernels/cross_entropy/common.py`` has their contract),
declared with ``define_residual_op`` (design.md section 2):

* ``cross_entropy_fwd (x, [w], [b], labels) -> (lse, zy, zsum)``: per-token
  statistics of the (soft-capped) logits: log-sum-exp, the label's logit,
  their sum;
* ``cross_entropy_jvp``: their tangents, linear in the tangents of ``x``,
  ``w``, ``b`` (or the logits);
* ``cross_entropy_bwd``: its transpose, the gradients, recomputing the logits
  block by block from the saved ``lse``.

Their operands are named once, in ``common.SIGNATURE``; every rule here reads
them by name.

The loss itself (ignored tokens, label smoothing, z-loss, the reduction) is
jnp on the statistics, so JAX differentiates it: ``grad`` costs one forward
and one backward primitive, ``jvp`` one forward and one tangent primitive.
Primitive operands lead with a group dim ``G`` (1 unless vmap folds a mapped
weight into it), then the caller's token dims; vmap of activations adds one.
Sharding: tokens shard freely; a vocabulary-sharded weight (a tensor-parallel
LM head) combines the statistics across shards with all-reduces of ``(N,)``
vectors, and its gradient stays sharded: the weight and the logits are never
gathered.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Mapping
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from pallax.batching_rules import cross_entropy as cross_entropy_batching
from pallax.kernels import cross_entropy as kernels
from pallax.kernels.cross_entropy import CrossEntropyConfig, common
from pallax.kernels.cross_entropy import xla as cross_entropy_xla
from pallax.kernels.cross_entropy.common import (
  SIGNATURE,
  Problem,
  combine_stats,
  flat_tokens,
  float_names,
  inputs,
)
from pallax.op import (
  Dims,
  PrimitiveSpec,
  Program,
  Rewrite,
  Shards,
  bind,
  define_composite,
  define_residual_op,
  derived_aval,
  full_spec,
  match_manual_axes,
  op_params,
  produced_by,
)
from pallax.pallas_utils import stat_dtype
from pallax.validation import check_config, check_floating, check_positive_float, check_static_float

__all__ = [
  "cross_entropy",
  "linear_cross_entropy",
  "linear_softmax_cross_entropy_loss",
  "CrossEntropyConfig",
]

Config = Optional[CrossEntropyConfig]
REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------
# Shapes and shardings.


def _factors(token, linear: bool, transposed_weight: bool, **params) -> dict:
  """Factor names of each declared operand: groups and tokens (``token``), hidden, vocabulary."""
  return dict(
    x=token + (("d",) if linear else ("v",)),
    w=("g", "v", "d") if transposed_weight else ("g", "d", "v"),
    b=("g", "v"),
    labels=token,
    lse=token,
    zy=token,
    zsum=token,
  )


def _dims(stage: str):
  def dims(*avals, **params) -> Dims:
    token = ("g",) + tuple(f"n{i}" for i in range(inputs(avals, params).x.ndim - 2))
    factors = _factors(token, **params)
    sig = SIGNATURE.stage(stage, params)
    of = lambda name: factors[sig.operand(name).name]
    return Dims(
      tuple(map(of, sig.operands)),
      tuple(map(of, sig.results)),
      replicated=("d",) if params["linear"] else (),
      programs=(Program("vocab_parallel", ("v",), functools.partial(_per_shard, stage, params)),),
    )

  return dims


def _per_shard(stage: str, params: dict, shards: Shards, *args):
  """One device's share of a call whose vocabulary or tokens are sharded.

  Labels are global vocabulary indices: each shard compares them with its own
  columns. The forward's statistics combine across vocabulary shards; the
  tangent's are plain sums, and so are the gradients (``dx`` over vocabulary
  shards, ``dw`` and ``db`` over token shards).
  """
  vocab = shards.axes("v")
  if vocab:
    local = Problem.of([jax.typeof(a) for a in args], **params)
    sig = SIGNATURE.stage(stage, params)
    named = dict(sig.unpack(args))
    named["labels"] = named["labels"] - lax.axis_index(vocab) * local.vocab
    args = sig.pack(named)
  outs = _STAGES[stage].kernel.bind(*args, **params)
  if stage == "fwd":
    return combine_stats(
      *outs, pmax=lambda x: lax.pmax(x, vocab) if vocab else x, psum=lambda x: shards.psum(x, 0)
    )
  return [shards.psum(out, i) for i, out in enumerate(outs)]


def _stats_abstract_eval(*avals, **params):
  token = inputs(avals, params).x
  dtype = stat_dtype(token.dtype)
  spec = full_spec(token)[:-1]
  return [derived_aval(token, token.shape[:-1], dtype, spec) for _ in range(3)]


def _bwd_abstract_eval(*avals, **params):
  """The gradients: like the inputs they are of."""
  sig = SIGNATURE.stage("bwd", params)
  named = sig.unpack(avals)
  return [named[sig.operand(g).name].update(weak_type=False) for g in sig.results]


def _transposed_table(value, aval):
  """The ``(V, D)`` table of a ``(1, D, V)`` weight lowered as ``table.T[None]``, or None."""
  if any(full_spec(aval)) or getattr(aval, "vma", None):
    return None  # sharding in types: keep the caller's layout
  expanded = produced_by(value, "stablehlo.broadcast_in_dim", broadcast_dimensions=(1, 2))
  if expanded is None:
    return None
  return produced_by(expanded, "stablehlo.transpose", permutation=(1, 0))


def _read_table_in_place(stage: str, values, avals, params) -> Optional[Rewrite]:
  """Reads a weight passed as ``table.T`` from the table itself, with the layout flag flipped.

  A kernel takes its operands as laid out in memory, so ``linear_cross_entropy(x,
  embedding.T, labels)`` would copy the table on GPU and TPU. When the weight
  (and in the tangent stage its tangent) was lowered in the same program as a
  2-D transpose, the call reads the transpose's operand instead and flips
  ``transposed_weight``; XLA then drops the unused transpose. The backward's
  weight gradient comes out in the table's layout and is transposed back,
  which XLA folds into the caller's transpose of the cotangent.
  """
  sig = SIGNATURE.stage(stage, params)
  if not params["linear"] or sig.unpack(avals).w.shape[0] != 1:
    return None
  # The weight, and in the tangent stage its tangent.
  at = tuple(i for i, n in enumerate(sig.operands) if sig.operand(n).name == "w")
  tables = [_transposed_table(values[i], avals[i]) for i in at]
  if any(t is None for t in tables):
    return None
  new_values, new_avals = list(values), list(avals)
  for i, table in zip(at, tables):
    new_values[i] = table
    new_avals[i] = jax.core.ShapedArray(avals[i].shape[:0:-1], avals[i].dtype)

  def prepare(*ops):
    return [o[None] if i in at else o for i, o in enumerate(ops)]

  def finish(outs):
    if stage == "bwd":
      dw = sig.index("dw", results=True)
      outs[dw] = jnp.swapaxes(outs[dw], 1, 2)
    return outs

  flipped = dict(params, transposed_weight=not params["transposed_weight"])
  return Rewrite(new_values, new_avals, flipped, prepare, finish)


def _stage(stage: str, abstract_eval) -> PrimitiveSpec:
  return PrimitiveSpec(
    abstract_eval=abstract_eval,
    xla=flat_tokens(stage, getattr(cross_entropy_xla, stage)),
    kernel=kernels.kernel(stage),
    dims=_dims(stage),
    batching=functools.partial(cross_entropy_batching.fold, stage),
    rewrite=functools.partial(_read_table_in_place, stage),
  )


cross_entropy_p = define_residual_op(
  "cross_entropy",
  fwd=_stage("fwd", _stats_abstract_eval),
  tangent=_stage("jvp", _stats_abstract_eval),
  bwd=_stage("bwd", _bwd_abstract_eval),
  signature=SIGNATURE,
)
_STAGES = {"fwd": cross_entropy_p.fwd, "jvp": cross_entropy_p.tangent, "bwd": cross_entropy_p.bwd}


# ----------------------------------------------------------------------------
# A scalar loss of linear_cross_entropy: its derivative in one pass on a CPU.

_LOSS_PARAMS = ("ignore_index", "label_smoothing", "z_loss", "reduction")


def _loss_params(options: tuple) -> dict:
  ignore_index, smoothing, z_loss, _, reduction = options
  return dict(
    ignore_index=ignore_index, label_smoothing=smoothing, z_loss=z_loss, reduction=reduction
  )


def _token_options(options: tuple, vocab: int) -> dict:
  ignore_index, smoothing, z_loss, _, _ = options
  return dict(vocab=vocab, ignore_index=ignore_index, label_smoothing=smoothing, z_loss=z_loss)


def _group_losses(*ops, ignore_index, label_smoothing, z_loss, reduction, **params):
  """Each group's scalar loss, ``(G,)``, from the forward primitive's statistics."""
  labels = inputs(ops, params).labels
  lse, zy, zsum = cross_entropy_p.fwd.bind(*ops, **params)
  vocab = Problem.of([jax.typeof(o) for o in ops], **op_params(params)).vocab
  loss = common.token_loss(
    lse,
    zy,
    zsum,
    labels,
    vocab=vocab,
    ignore_index=ignore_index,
    label_smoothing=label_smoothing,
    z_loss=z_loss,
  )
  scale = common.mean_scale(labels, ignore_index, reduction, lse.dtype)
  return jnp.sum(loss, axis=tuple(range(1, loss.ndim))) * scale


def _value_and_grad_reference(*ops, **params):
  """``(loss (G,), dx, dw[, db])`` from the forward and backward primitives (``jax.vjp``)."""
  fwd = SIGNATURE.stage("fwd", params)
  named = fwd.unpack(ops)
  floats = float_names(named)
  group_losses = lambda *f: _group_losses(*fwd.pack({**named, **dict(zip(floats, f))}), **params)
  loss, pull = jax.vjp(group_losses, *(named[n] for n in floats))
  return [loss, *pull(jnp.ones_like(loss))]


def _value_and_grad_abstract_eval(*avals, **params):
  named = inputs(avals, params)
  token = named.x
  loss = derived_aval(token, token.shape[:1], stat_dtype(token.dtype), full_spec(token)[:1])
  return [loss, *(named[n].update(weak_type=False) for n in float_names(named))]


linear_cross_entropy_value_and_grad_p = define_composite(
  "linear_cross_entropy_value_and_grad",
  abstract_eval=_value_and_grad_abstract_eval,
  reference=_value_and_grad_reference,
  fused=cross_entropy_xla.value_and_grad,
  decided_by=cross_entropy_p.fwd,
  own_params=_LOSS_PARAMS,
)


def _scalar_loss_jvp(primals, tangents, **params):
  """``<gradient, tangents>``, the gradient from ``linear_cross_entropy_value_and_grad_p``.

  Linear in the tangents, so JAX transposes it for ``grad``: on a CPU one fused
  pass of three matmuls, elsewhere the forward and backward kernels.
  Forward-mode ``jvp`` costs the same: the gradient and a dot with the tangents.
  """
  loss, *grads = linear_cross_entropy_value_and_grad_p.bind(*primals, **params)
  tangent_of = inputs(tangents, params)
  dloss = jnp.zeros_like(loss)
  for g, n in zip(grads, float_names(tangent_of)):
    t = tangent_of[n]
    if type(t) is not ad.Zero:
      dloss = dloss + jnp.sum(g.astype(loss.dtype) * t.astype(loss.dtype), axis=range(1, g.ndim))
  return [loss], [dloss]


linear_cross_entropy_loss_p = define_composite(
  "linear_cross_entropy_loss",
  abstract_eval=lambda *avals, **params: _value_and_grad_abstract_eval(*avals, **params)[:1],
  reference=lambda *ops, **params: [_group_losses(*ops, **params)],
  jvp=_scalar_loss_jvp,
)


# ----------------------------------------------------------------------------
# The public functions: validation, layout and the loss from the statistics.


def _options(op: str, ignore_index, label_smoothing, z_loss, logit_soft_cap, reduction) -> tuple:
  """The loss options, checked: ``(ignore_index, smoothing, z_loss, soft_cap, reduction)``."""
  if ignore_index is not None and (
    isinstance(ignore_index, bool) or not isinstance(ignore_index, (numbers.Integral, np.integer))
  ):
    raise TypeError(f"{op}: ignore_index must be an int or None, got {ignore_index!r}")
  smoothing = check_static_float(op, "label_smoothing", label_smoothing, minimum=0.0)
  if smoothing > 1:
    raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {smoothing}")
  z_loss = check_static_float(op, "z_loss", z_loss, minimum=0.0)
  cap = None
  if logit_soft_cap is not None:
    cap = check_positive_float(op, "logit_soft_cap", logit_soft_cap)
  if reduction not in REDUCTIONS:
    raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
  return (None if ignore_index is None else int(ignore_index)), smoothing, z_loss, cap, reduction


def _labels(op: str, labels, shape: tuple[int, ...], vocab: int, ignore_index) -> jax.Array:
  """``labels`` as int32 of ``shape``; concrete labels outside the vocabulary raise."""
  labels_in = labels
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"{op}: labels must have an integer dtype, got {labels.dtype}")
  if labels.shape != shape:
    raise ValueError(
      f"{op}: labels must have shape {shape} (the logits' leading dims), got {labels.shape}"
    )
  if not isinstance(labels_in, jax.core.Tracer) and labels.size:
    values = np.asarray(labels_in)
    bad = (values < 0) | (values >= vocab)
    if ignore_index is not None:
      bad &= values != ignore_index
    if bad.any():
      raise ValueError(
        f"{op}: labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; "
        f"got {values[bad].flat[0]}"
      )
  return labels.astype(jnp.int32)


def _loss(op: str, floats: dict, labels, params, vocab, options: Mapping[str, Any]):
  """The loss from the forward primitive's statistics, or ``linear_cross_entropy_loss_p``.

  ``floats``: the floating operands by name (``x``, ``w``, ``b``), checked,
  taken in their common dtype; ``labels`` of ``x``'s token dims; ``options``
  ``cross_entropy``'s keyword arguments by name, checked here.

  A scalar loss of ``linear_cross_entropy`` (without ``return_lse``) is
  ``linear_cross_entropy_loss_p``, whose derivative is the value-and-gradient
  primitive; the rest differentiates the statistics.
  """
  options = dict(options)
  config, return_lse = options.pop("config"), options.pop("return_lse")
  options = _options(op, **options)
  check_config(op, config, CrossEntropyConfig)
  ignore_index, smoothing, z_loss, cap, reduction = options
  labels = _labels(op, labels, floats["x"].shape[:-1], vocab, ignore_index)
  shape = labels.shape
  tokens = labels.size
  dtype = jnp.result_type(*floats.values())
  floats = {name: a.astype(dtype) for name, a in floats.items()}
  st = stat_dtype(dtype)
  named = {name: a[None] for name, a in floats.items()}
  operands = SIGNATURE.stage("fwd", params).pack(dict(named, labels=labels[None]))
  operands = match_manual_axes(*operands)
  if tokens and params["linear"] and reduction != "none" and not return_lse:
    loss_params = dict(params, soft_cap=cap, **_loss_params(options))
    (loss,) = bind(linear_cross_entropy_loss_p, *operands, config=config, **loss_params)
    return loss[0]
  if tokens:
    stats = bind(_STAGES["fwd"], *operands, config=config, **params, soft_cap=cap)
    lse, zy, zsum = (s[0] for s in stats)
  else:
    lse = zy = zsum = jnp.zeros(shape, st)
  loss = common.token_loss(lse, zy, zsum, labels, **_token_options(options, vocab))
  if reduction != "none":
    loss = jnp.sum(loss) * common.mean_scale(labels[None], ignore_index, reduction, st)[0]
  return (loss, lse) if return_lse else loss


def _floating(op: str, name: str, a) -> jax.Array:
  a = jnp.asarray(a)
  check_floating(op, name, a)
  return a


def cross_entropy(
  logits: jax.Array,
  labels: jax.Array,
  *,
  ignore_index: Optional[int] = -100,
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  logit_soft_cap: Optional[float] = None,
  reduction: str = "mean",
  return_lse: bool = False,
  config: Config = None,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
  """Softmax cross-entropy of integer labels, fused forward and backward.

  Per token, with ``z`` the logits (after ``cap * tanh(z / cap)`` with a
  soft cap), ``lse = logsumexp(z)`` and ``eps = label_smoothing``::

    loss = lse - (1 - eps) * z[label] - eps / V * sum(z) + z_loss * lse**2

  Statistics are float32 (float64 for float64 logits) for any input dtype.

  Args:
    logits: floating array ``(..., V)``.
    labels: integer array of the logits' leading shape.
    ignore_index: tokens with this label have loss 0 and are left out of the
      mean; None ignores none. Any other label outside ``[0, V)`` raises a
      ValueError when ``labels`` is concrete and gives a NaN loss when traced.
    label_smoothing: in ``[0, 1]``: the target puts ``1 - eps`` on the label
      and ``eps / V`` on every class (as PyTorch and Optax).
    z_loss: coefficient of PaLM's ``lse**2`` term.
    logit_soft_cap: Gemma 2's cap on the logits, a positive number or None.
    reduction: ``"mean"`` over the kept tokens (0 when none is kept),
      ``"sum"`` or ``"none"`` (per-token losses, 0 where ignored).
    return_lse: also return every token's ``lse`` (for z-loss logging).
    config: pin the kernels' ``CrossEntropyConfig``.

  Returns:
    The loss (a scalar, or of ``labels``' shape for ``"none"``), and with
    ``return_lse`` the pair ``(loss, lse)``.
  """
  given = locals()  # the keyword arguments, taken by name below (``_OPTIONS``)
  op = "cross_entropy"
  logits = _floating(op, "logits", logits)
  if logits.ndim < 1 or logits.shape[-1] == 0:
    raise ValueError(f"{op}: logits must have a non-empty last (class) axis, got {logits.shape}")
  params = dict(linear=False, has_bias=False, transposed_weight=False)
  options = {name: given[name] for name in _OPTIONS}
  return _loss(op, dict(x=logits), labels, params, logits.shape[-1], options)


# ``cross_entropy``'s keyword arguments and their defaults: the loss options
# ``linear_cross_entropy`` takes too.
_OPTIONS = {
  p.name: p.default
  for p in inspect.signature(cross_entropy).parameters.values()
  if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _loss_options(op: str, options: Mapping[str, Any]) -> dict[str, Any]:
  """``options`` with ``cross_entropy``'s defaults; an unknown name raises as Python does."""
  unknown = sorted(set(options) - set(_OPTIONS))
  if unknown:
    raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r}")
  return {**_OPTIONS, **options}


def linear_cross_entropy(
  x: jax.Array,
  weight: jax.Array,
  labels: jax.Array,
  *,
  bias: Optional[jax.Array] = None,
  transposed_weight: bool = False,
  **options: Any,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
  """``cross_entropy(x @ weight + bias, labels)`` without materialising the logits.

  The language-model head's loss: the kernels compute the logits block by
  block (an online log-sum-exp over vocabulary blocks), and the backward
  recomputes them from the saved ``lse`` to form ``dx``, ``dweight`` (summed
  in float32) and ``dbias``. Memory stays ``O(tokens + weight)`` whatever the
  vocabulary size.

  Args:
    x: floating array ``(..., D)``: the final hidden states.
    weight: ``(D, V)``, a Flax ``Dense`` kernel; with ``transposed_weight``,
      ``(V, D)``: a tied embedding table, read in place.
    labels: integer array of ``x``'s leading shape.
    bias: optional ``(V,)``.
    transposed_weight: ``weight`` is ``(V, D)``: a tied embedding table.
      ``embedding.T`` (without the flag) is read in place too: the lowering
      reads a weight made by a transpose in the same program from the
      transpose's operand (``_read_table_in_place``). One made inside a
      nested ``jit`` is a copy on GPU and TPU, where kernels read their
      operands as laid out in memory; the flag never is.
    **options: ``cross_entropy``'s keyword arguments, with its defaults:
      ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap``,
      ``reduction``, ``return_lse`` and ``config`` (the signature lists them).

  Returns:
    As ``cross_entropy``.
  """
  op = "linear_cross_entropy"
  x = _floating(op, "x", x)
  weight = _floating(op, "weight", weight)
  if x.ndim < 1:
    raise ValueError(f"{op}: x must have at least 1 dimension (..., D), got a scalar")
  if not isinstance(transposed_weight, (bool, np.bool_)):
    raise TypeError(f"{op}: transposed_weight must be a bool, got {transposed_weight!r}")
  layout = "(V, D)" if transposed_weight else "(D, V)"
  shape = weight.shape[::-1] if transposed_weight else weight.shape
  if weight.ndim != 2 or shape[0] != x.shape[-1] or shape[1] == 0:
    hint = ""
    other_shape = weight.shape if transposed_weight else weight.shape[::-1]
    if weight.ndim == 2 and other_shape[0] == x.shape[-1] and other_shape[1]:
      other = "(D, V)" if transposed_weight else "(V, D)"
      hint = (
        f"; a {other} weight is read as is with transposed_weight={not transposed_weight} "
        "(no transpose is materialised)"
      )
    raise ValueError(
      f"{op}: weight must have shape {layout} with D = x.shape[-1] = {x.shape[-1]} and V > 0, "
      f"got {weight.shape}{hint}"
    )
  _, vocab = shape
  floats = dict(x=x, w=weight)
  if bias is not None:
    bias = _floating(op, "bias", bias)
    if bias.shape != (vocab,):
      raise ValueError(f"{op}: bias must have shape ({vocab},), got {bias.shape}")
    floats["b"] = bias
  params = dict(linear=True, has_bias=bias is not None, transposed_weight=bool(transposed_weight))
  return _loss(op, floats, labels, params, vocab, _loss_options(op, options))


# ``help`` and ``inspect`` show every keyword argument, as cross_entropy's do.
_own = list(inspect.signature(linear_cross_entropy).parameters.values())[:-1]
linear_cross_entropy.__signature__ = inspect.signature(linear_cross_entropy).replace(
  parameters=_own
  + [p for p in inspect.signature(cross_entropy).parameters.values() if p.name in _OPTIONS]
)


def linear_softmax_cross_entropy_loss(
  x: jax.Array,
  labels: jax.Array,
  weights: jax.Array,
  *,
  reduction: str = "sum",
  precision=None,
) -> jax.Array:
  """The ``linear_softmax_cross_entropy_loss`` of tokamax, on pallax's kernels.

  ``x (B, H)``, ``labels (B,)``, ``weights (H, V)``; ``reduction`` is
  ``"sum"`` or ``"mean"`` (over all ``B`` tokens). ``precision`` is accepted
  for compatibility: the logits are always accumulated in float32 (float64
  for float64 inputs). Unlike tokamax's, it supports ``jax.jvp`` and ``vmap``.
  """
  op = "linear_softmax_cross_entropy_loss"
  if reduction not in ("sum", "mean"):
    raise ValueError(f"{op}: reduction must be 'sum' or 'mean', got {reduction!r}")
  del precision
  return linear_cross_entropy(x, weights, labels, ignore_index=None, reduction=reduction)
