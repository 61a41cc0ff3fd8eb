"""Attention: ``pallax.dot_product_attention``, a drop-in for ``jax.nn``'s.

The public function validates and lays the operands out as the kernels want
them (``kernels/attention/common.py``: query heads grouped by their kv head,
heads before positions), then binds the op declared with
``define_residual_op`` (design.md section 2):

* ``dot_product_attention_fwd (q, k, v, q_len, kv_len, [bias], [mask]) -> (out, lse)``:
  the forward kernel; ``lse`` is its residual.
* ``dot_product_attention_jvp (..., out, lse, dq, dk, dv, [dbias]) -> (dout, dlse)``:
  the tangents of both results, linear in the trailing tangents, one
  blockwise pass that recomputes the probabilities from ``lse`` (never a
  ``[T, S]`` array). ``lse`` has its true tangent, so second-order AD through
  the backward is exact; the public ``lse`` is stop_gradient'ed, as jax.nn's.
* ``dot_product_attention_bwd (..., out, lse, dout, dlse) -> (dq, dk, dv, [dbias])``:
  the tangent's transpose, the backward kernels; ``lse``'s cotangent only
  shifts the row term ``rowsum(dout * out)``.

``grad`` costs one forward and one backward kernel; ``jvp``, ``jacfwd``,
``linearize`` and Hessian-vector products work.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from pallax.batching_rules import attention as attention_batching
from pallax.kernels import attention as kernels
from pallax.kernels.attention import AttentionConfig, context
from pallax.kernels.attention import xla as attention_xla
from pallax.kernels.attention.common import SIGNATURE, inputs, varies_over_heads, with_sinks
from pallax.kernels.attention.context import in_layout
from pallax.kernels.attention.mosaic_gpu import MosaicGpuAttentionConfig
from pallax.op import (
  Dims,
  PrimitiveSpec,
  bind,
  define_residual_op,
  derived_aval,
  full_spec,
  match_manual_axes,
)
from pallax.sequence_layout import SequenceLayout
from pallax.validation import (
  check_concrete_range,
  check_config,
  check_floating_alike,
  check_positive_float,
  check_static_float,
)

__all__ = ["dot_product_attention", "AttentionConfig", "MosaicGpuAttentionConfig"]

_OP = "dot_product_attention"


# ----------------------------------------------------------------------------
# Shapes and shardings.


def _broadcast_names(aval, name: str) -> tuple[str, ...]:
  """Factors of an operand leading with 1 or B: the sinks ``(Bs, K, G)``, a bias-like one.

  The batch where it varies over it; a bias or mask's heads where it varies
  over them. A bias-like operand's query dim is sharded with the queries and
  its key dim (``bs``) is replicated: under a sharded sequence each device
  holds its queries' rows, and the programs slice the key blocks they visit.
  """
  b = "b" if aval.shape[0] > 1 else f"{name}_b"
  if name == "sinks":
    return (b, "k", "g")
  heads = ("k", "g") if varies_over_heads(aval) else (f"{name}_k", f"{name}_g")
  return (b, *heads, "t", "bs")


# Factors of each declared operand (and of its tangent and cotangent); the
# bias, mask and sinks lead with 1 or B and may broadcast over the heads.
_FACTORS = {
  "q": ("b", "k", "g", "t", "h"),
  "k": ("b", "k", "s", "h"),
  "v": ("b", "k", "s", "hv"),
  "q_len": ("b",),
  "kv_len": ("b",),
  "q_seg": ("b", "t"),
  "kv_seg": ("b", "s"),
  "out": ("b", "k", "g", "t", "hv"),
  "lse": ("b", "k", "g", "t"),
}
_STAGE_PRIMITIVE = {"fwd": "fwd", "jvp": "tangent", "bwd": "bwd"}


def _dims(stage: str):
  """A stage's ``Dims``: batch and heads shard freely; a sharded sequence runs a program.

  The ring and all-gather programs (``kernels/attention/context.py``) bind
  the stage's kernel on local blocks; inside ``shard_map`` the call's
  ``sequence_axes`` name the manual axes its sequences are split over.
  """

  def dims(*avals, **params) -> Dims:
    sig = SIGNATURE.stage(stage, params)
    named = inputs(avals, params)

    def factors(name: str) -> tuple[str, ...]:
      base = sig.operand(name).name
      if base in _FACTORS:
        return _FACTORS[base]
      return _broadcast_names(named[base], base)

    kernel = getattr(attention_p, _STAGE_PRIMITIVE[stage]).kernel
    axes = params["sequence_axes"]
    return Dims(
      operands=tuple(map(factors, sig.operands)),
      results=tuple(map(factors, sig.results)),
      replicated=("h", "hv", "bs") if params["has_bias"] or params["has_mask"] else ("h", "hv"),
      programs=context.programs(stage, kernel.bind, params),
      split={} if axes is None else {"t": axes, "s": axes},
    )

  return dims


def _fwd_abstract_eval(*avals, **params):
  named = inputs(avals, params)
  q, v = named.q, named.v
  spec = full_spec(q)
  return [
    derived_aval(q, (*q.shape[:4], v.shape[3]), q.dtype, spec[:4] + (None,)),
    derived_aval(q, q.shape[:4], jnp.promote_types(q.dtype, jnp.float32), spec[:4]),
  ]


def _jvp_abstract_eval(*avals, **params):
  return _fwd_abstract_eval(*avals, **params)


def _bwd_abstract_eval(*avals, **params):
  """One gradient per differentiable input, shaped like it."""
  named, bwd = inputs(avals, params), SIGNATURE.stage("bwd", params)
  return [named[bwd.operand(g).name].update(weak_type=False) for g in bwd.results]


def _stage(stage: str, abstract_eval) -> PrimitiveSpec:
  return PrimitiveSpec(
    abstract_eval=abstract_eval,
    xla=in_layout(stage, with_sinks(stage, getattr(attention_xla, f"attention_{stage}"))),
    kernel=kernels.kernel(stage),
    dims=_dims(stage),
    batching=functools.partial(attention_batching.fold_into_batch, stage),
  )


attention_p = define_residual_op(
  _OP,
  fwd=_stage("fwd", _fwd_abstract_eval),
  tangent=_stage("jvp", _jvp_abstract_eval),
  bwd=_stage("bwd", _bwd_abstract_eval),
  signature=SIGNATURE,
)


# ----------------------------------------------------------------------------
# The public function: validation and layout.


def _array(name: str, x, ndim: tuple[int, ...]) -> jax.Array:
  x = jnp.asarray(x)
  if x.ndim not in ndim:
    raise ValueError(
      f"{_OP}: {name} must have {' or '.join(map(str, ndim))} dims, got shape {x.shape}"
    )
  return x


def _window(local_window_size, is_causal: bool) -> tuple[Optional[int], Optional[int]]:
  """``(left, right)`` of the visible keys around a query; causal is ``right = 0``."""
  if local_window_size is None:
    left = right = None
  else:
    pair = (
      (local_window_size,) * 2
      if isinstance(local_window_size, (numbers.Integral, np.integer))
      else tuple(local_window_size)
    )
    ok = len(pair) == 2 and all(
      isinstance(w, (numbers.Integral, np.integer)) and not isinstance(w, bool) for w in pair
    )
    if not ok:
      raise TypeError(
        f"{_OP}: local_window_size must be an int or a pair of ints, got {local_window_size!r}"
      )
    left, right = (int(w) for w in pair)
    if left < 0 or right < 0:
      raise ValueError(f"{_OP}: local_window_size must be non-negative, got {local_window_size!r}")
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def _lengths(name: str, x, batch: int, full: int) -> jax.Array:
  if x is None:
    return jnp.full((batch,), full, jnp.int32)
  x = jnp.asarray(x)
  if x.dtype != jnp.int32 or x.shape != (batch,):
    raise ValueError(
      f"{_OP}: {name} must be an int32 array of shape ({batch},), got {x.dtype} of shape {x.shape}"
    )
  check_concrete_range(_OP, name, x, 0)
  return jnp.clip(x, 0, full)


def _bias_like(name: str, x, b: int, n: int, t: int, s: int, kv_heads: int) -> jax.Array:
  """``x`` broadcastable to (B, N, T, S) as (Bb, Kb, Gb, T, S): B and N kept 1 if they were."""
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(f"{_OP}: {name} must have at most 4 dims (B, N, T, S), got shape {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  try:
    ok = np.broadcast_shapes(x.shape, (b, n, t, s)) == (b, n, t, s)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(
      f"{_OP}: {name} of shape {x.shape} does not broadcast to (B, N, T, S) = {(b, n, t, s)}"
    )
  x = jnp.broadcast_to(x, x.shape[:2] + (t, s))
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kv_heads, n // kv_heads, t, s)


def _segment_ids(q_segment_ids, kv_segment_ids, b: int, t: int, s: int, unbatched: bool):
  """The segment ids as int32 ``(B, T)``, ``(B, S)``, or None."""
  given = (q_segment_ids is not None, kv_segment_ids is not None)
  if not any(given):
    return None
  if not all(given):
    raise ValueError(f"{_OP}: pass both q_segment_ids and kv_segment_ids, or neither")
  out = []
  for name, x, length in (
    ("q_segment_ids", q_segment_ids, t),
    ("kv_segment_ids", kv_segment_ids, s),
  ):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{_OP}: {name} must have an integer dtype, got {x.dtype}")
    want = (length,) if unbatched else (b, length)
    if x.shape != want:
      raise ValueError(f"{_OP}: {name} must have shape {want}, got {x.shape}")
    out.append(x.astype(jnp.int32).reshape(b, length))
  return out


def _sinks(sinks, n: int, kv_heads: int) -> jax.Array:
  """``sinks (N,)`` laid out as ``(1, K, G)``."""
  sinks = jnp.asarray(sinks)
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"{_OP}: sinks must have a floating dtype, got {sinks.dtype}")
  if sinks.shape != (n,):
    raise ValueError(f"{_OP}: sinks must have shape (N,) = ({n},), got {sinks.shape}")
  return sinks.reshape(1, kv_heads, n // kv_heads)


def _layout(sequence_layout, t: int, s: int) -> Optional[SequenceLayout]:
  """The call's ``SequenceLayout`` (None: natural order), checked against the sequence lengths."""
  if sequence_layout is None or sequence_layout == "contiguous":
    return None
  if not isinstance(sequence_layout, SequenceLayout):
    raise TypeError(
      f"{_OP}: sequence_layout must be None, 'contiguous' or a pallax.SequenceLayout (e.g. "
      f"SequenceLayout('zigzag', shards=8)), got {sequence_layout!r}"
    )
  if sequence_layout.natural:
    return None
  sequence_layout.check(t, f"{_OP}: query of sequence length {t}")
  sequence_layout.check(s, f"{_OP}: key of sequence length {s}")
  return sequence_layout


def _sequence_axes(sequence_axis) -> Optional[tuple[str, ...]]:
  """The manual mesh axes the sequences are split over inside ``shard_map`` (None: not split)."""
  if sequence_axis is None:
    return None
  axes = (sequence_axis,) if isinstance(sequence_axis, str) else tuple(sequence_axis)
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  named = all(isinstance(a, str) for a in axes) and len(set(axes)) == len(axes)
  if not axes or not named or not set(axes) <= manual:
    raise ValueError(
      f"{_OP}: sequence_axis must name distinct manual axes of the enclosing shard_map (manual: "
      f"{tuple(sorted(manual))}), got {sequence_axis!r}"
    )
  return axes


_IMPLEMENTATIONS = (None, "xla", "pallas")


def dot_product_attention(
  query: jax.Array,
  key: jax.Array,
  value: jax.Array,
  bias: Optional[jax.Array] = None,
  mask: Optional[jax.Array] = None,
  *,
  scale: Optional[float] = None,
  is_causal: bool = False,
  query_seq_lengths: Optional[jax.Array] = None,
  key_value_seq_lengths: Optional[jax.Array] = None,
  local_window_size: Union[int, tuple[int, int], None] = None,
  q_segment_ids: Optional[jax.Array] = None,
  kv_segment_ids: Optional[jax.Array] = None,
  logits_soft_cap: Optional[float] = None,
  sinks: Optional[jax.Array] = None,
  implementation: Optional[str] = None,
  return_residual: Union[bool, str] = False,
  config: Optional[Union[AttentionConfig, MosaicGpuAttentionConfig]] = None,
  sequence_layout: Union[None, str, SequenceLayout] = None,
  sequence_axis: Union[None, str, tuple[str, ...]] = None,
) -> Union[jax.Array, tuple[jax.Array, jax.Array]]:
  """Scaled dot-product attention, with ``jax.nn.dot_product_attention``'s semantics.

  ``softmax(scale * q k^T + bias, masked) v`` per query head, computed
  blockwise (flash attention): memory grows with ``T x block``, not ``T x S``,
  and blocks that causal, window, length or segment masks hide entirely are
  skipped.
  Logits and softmax are float32; the probabilities are cast to the value's
  dtype for the product with it, as in jax.nn.

  One difference from jax.nn, by design: a query row that sees no key at all
  (every key masked) gives output 0 and zero gradients, where jax.nn's finite
  large negative gives the mean of ``value``. Rows padded by
  ``query_seq_lengths`` are 0 in both.

  Beyond jax.nn: packed sequences (segment ids), Gemma 2's logit soft cap,
  attention sinks (gpt-oss), a value head dim unlike the query's, and
  context parallelism: a query or key sequence dim sharded under ``jit``
  (or split over ``shard_map`` axes named by ``sequence_axis``) runs a ring
  of the key blocks or an all-gather of them, whichever moves fewer
  unhidden bytes (``pallax.op.explain_programs`` says which), with every
  feature, ``grad``, ``jvp`` and ``vmap``; ``sequence_layout`` evens out the
  causal work across devices.

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``, floating.
    key: ``(B, S, K, H)`` or ``(S, K, H)``, the query's dtype; ``K`` divides
      ``N`` (grouped-query attention: query head ``n`` reads kv head
      ``n // (N // K)``).
    value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``, the query's dtype.
    bias: optional, broadcastable to ``(B, N, T, S)`` (fewer dims are
      expanded at the front), added to the scaled logits; differentiable.
    mask: optional bool, broadcastable to ``(B, N, T, S)``: True where a query
      may see a key.
    scale: the logits' scale; default ``1 / sqrt(H)``.
    is_causal: query ``t`` sees keys ``s <= t`` (top-left aligned, also when
      ``T != S``).
    query_seq_lengths: optional int32 ``(B,)``: queries ``t >= len`` are
      padding (output 0).
    key_value_seq_lengths: optional int32 ``(B,)``: keys ``s >= len`` are hidden.
    local_window_size: ``(left, right)`` or an int for both: query ``t`` sees
      keys ``t - left <= s <= t + right``.
    q_segment_ids: optional integer ``(B, T)`` (``(T,)`` unbatched), with
      ``kv_segment_ids`` ``(B, S)``: query ``t`` sees key ``s`` only where
      their ids are equal (packed sequences; with ``is_causal``, document
      masking). Blocks whose id ranges cannot meet are skipped.
    kv_segment_ids: see ``q_segment_ids``; both or neither.
    logits_soft_cap: optional ``cap > 0``: the scaled logits become
      ``cap * tanh(logits / cap)`` before the bias and masks (Gemma 2).
    sinks: optional floating ``(N,)``, differentiable: a logit per query head
      that joins each row's softmax denominator and attends to nothing
      (gpt-oss). A row that sees no key then has ``lse = sink``.
    implementation: None lets the executor choose; ``"xla"`` runs the XLA
      program, ``"pallas"`` the kernel (Triton on GPU, Mosaic on TPU).
    return_residual: also return the forward's ``lse``, without gradient as
      jax.nn's; ``"differentiable"``: with its true gradient, for composing
      attention by hand (merging partial results by log-sum-exp: a ring of
      your own, a cascade, speculative branches).
    config: pin the kernels' ``AttentionConfig`` (the forward's, tangent's
      and backward's blocks), or a ``MosaicGpuAttentionConfig`` (the Hopper
      kernels: their forward, tangent and backward, for the calls they take).
    sequence_layout: how the query and key sequences' tokens are laid out
      over the devices that shard them: None or ``"contiguous"`` (natural
      order), or a ``pallax.SequenceLayout("zigzag" | "striped", shards=P)``
      for arrays permuted by ``pallax.context_parallel``; masks, windows and
      lengths follow the tokens' true positions, and the output comes back in
      the same layout. On one device, or sharded over ``P`` devices, it means
      the same.
    sequence_axis: inside ``shard_map``, the manual mesh axis (or axes) over
      which the query and key/value sequences are split; the local blocks are
      then one device's share of a longer sequence (ring or all-gather).
      Lengths count the whole sequence, and a bias or mask holds the
      device's query rows and every key: ``(B, N, T_local, S)``.

  Returns:
    The output, shaped like ``query`` with the value's head dim; with
    ``return_residual``, ``(output, lse)`` where ``lse (B, T, N)`` (``(T, N)``)
    is the natural-log sum of the exponentiated visible logits (and sink),
    in the key's dtype, ``-inf`` on rows that see nothing, without gradient
    (as jax.nn) unless ``return_residual="differentiable"``.
  """
  q = _array("query", query, (3, 4))
  k = _array("key", key, (q.ndim,))
  v = _array("value", value, (q.ndim,))
  check_floating_alike(_OP, {"query": q, "key": k, "value": v})
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  b, t, n, h = q.shape
  if k.shape[0] != b or k.shape[3] != h:
    raise ValueError(
      f"{_OP}: key of shape {k.shape} does not match query {q.shape}: (B, S, K, H) with "
      f"query's B and H"
    )
  s, kv_heads = k.shape[1], k.shape[2]
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{_OP}: value of shape {v.shape} must match key {k.shape} in (B, S, K)")
  if n % kv_heads:
    raise ValueError(
      f"{_OP}: the key's {kv_heads} heads must divide the query's {n} heads (query {q.shape}, "
      f"key {k.shape})"
    )
  if implementation == "cudnn":
    raise ValueError(
      f"{_OP}: implementation='cudnn' is jax.nn's; pallax runs its own kernels: use "
      "implementation='pallas' (Triton on GPU, Mosaic on TPU), 'xla', or None to let it choose"
    )
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(
      f"{_OP}: implementation must be one of {_IMPLEMENTATIONS}, got {implementation!r}"
    )
  check_config(_OP, config, (AttentionConfig, MosaicGpuAttentionConfig))
  if isinstance(config, MosaicGpuAttentionConfig) and implementation is not None:
    raise TypeError(
      f"{_OP}: a MosaicGpuAttentionConfig names its implementation; "
      f"drop implementation={implementation!r}"
    )
  if config is not None and implementation is not None:
    config = AttentionConfig(**{**config.to_dict(), "implementation": implementation})
  pinned = implementation if config is None else config
  scale = 1 / np.sqrt(h) if scale is None else check_static_float(_OP, "scale", scale)
  left, right = _window(local_window_size, bool(is_causal))
  has_lengths = query_seq_lengths is not None or key_value_seq_lengths is not None
  sequence_axes = _sequence_axes(sequence_axis)
  shards = 1 if sequence_axes is None else jax.lax.axis_size(sequence_axes)
  # Inside shard_map the lengths count the whole sequence's tokens.
  q_len = _lengths("query_seq_lengths", query_seq_lengths, b, t * shards)
  kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, b, s * shards)
  extra = []
  if bias is not None:
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"{_OP}: bias must have a floating dtype, got {bias.dtype}")
    extra.append(_bias_like("bias", bias, b, n, t, s * shards, kv_heads))
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"{_OP}: mask must be a boolean array, got {mask.dtype}")
    extra.append(_bias_like("mask", mask, b, n, t, s * shards, kv_heads))
  segments = _segment_ids(q_segment_ids, kv_segment_ids, b, t, s, unbatched)
  if segments is not None:
    extra += segments
  cap = None
  if logits_soft_cap is not None:
    cap = check_positive_float(_OP, "logits_soft_cap", logits_soft_cap)
  if sinks is not None:
    extra.append(_sinks(sinks, n, kv_heads))
  if return_residual not in (False, True, "differentiable"):
    raise ValueError(
      f"{_OP}: return_residual must be False, True or 'differentiable', got {return_residual!r}"
    )
  layout = _layout(sequence_layout, t * shards, s * shards)
  if 0 in (b, t, n, s):  # nothing to attend to, or nobody asking: no kernel to run
    empty = -jnp.inf if sinks is None else jnp.asarray(sinks)  # a row's lse: its sink
    out, lse = jnp.zeros((b, t, n, v.shape[3]), q.dtype), jnp.full((b, t, n), empty, k.dtype)
    out, lse = (x[0] for x in (out, lse)) if unbatched else (out, lse)
    return (out, lse) if return_residual else out
  g = n // kv_heads
  q5 = jnp.transpose(q.reshape(b, t, kv_heads, g, h), (0, 2, 3, 1, 4))
  operands = [q5, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), q_len, kv_len, *extra]
  out, lse = bind(
    attention_p.fwd,
    *match_manual_axes(*operands),
    config=pinned,
    scale=float(scale),
    window_left=left,
    window_right=right,
    has_lengths=has_lengths,
    has_bias=bias is not None,
    has_mask=mask is not None,
    has_segments=segments is not None,
    has_sinks=sinks is not None,
    logits_soft_cap=cap,
    sequence_layout=layout,
    sequence_axes=sequence_axes,
  )
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, v.shape[3])
  if unbatched:
    out = out[0]
  if not return_residual:
    return out
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, n).astype(k.dtype)
  if return_residual != "differentiable":
    lse = jax.lax.stop_gradient(lse)
  return out, lse[0] if unbatched else lse
