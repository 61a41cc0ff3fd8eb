"""A dropless mixture-of-experts FFN: ``pallax.moe`` and its router, ``pallax.route``.

Every token goes to its ``top_k`` experts, none is dropped: the (token,
slot) pairs are sorted by expert, each expert's rows pass its gated MLP as
two grouped matmuls (``pallax.ragged_dot``: one GEMM's work for all
experts, not one per expert; the gate and up projections in one gated
kernel), and the results are un-permuted and combined with the routing
weights. Built from JAX ops and pallax primitives, so ``grad``,
``jvp``, ``vmap`` and their compositions all work; the integer routing
(top-k, sort) has no derivative, the weights do.

The routers of current models are options of ``route``: softmax or sigmoid
scores, renormalised top-k or not, a routed scaling factor, group-limited
top-k and a selection-only per-expert bias (DeepSeek-V3), softmax after the
top-k (Mixtral's formulation); or pass a ``Routing`` of your own.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallax.primitives.ragged_dot import ragged_dot
from pallax.validation import check_floating, check_static_float

__all__ = ["moe", "route", "Routing", "RouterStats", "SCORES"]

_OP = "moe"
SCORES = ("softmax", "sigmoid")


class Routing(NamedTuple):
  """Each token's experts and their weights.

  Attributes:
    experts: ``[..., top_k]`` integers, the chosen experts.
    weights: ``[..., top_k]`` floating, each expert's weight in the token's
      output.
  """

  experts: jax.Array
  weights: jax.Array


class RouterStats(NamedTuple):
  """What load-balancing losses are built from, over the tokens the mask keeps.

  With ``f = tokens_per_expert / sum(tokens_per_expert)`` and ``P =
  router_prob``, the Switch / Mixtral auxiliary loss is ``E * sum(f * P)``.

  Attributes:
    tokens_per_expert: ``[E]`` float32, the (token, slot) pairs routed to
      each expert.
    router_prob: ``[E]`` float32, each expert's mean router score (softmax
      or sigmoid, before any selection bias); None for a given ``Routing``.
    z_loss: the router z-loss, the mean of ``logsumexp(logits) ** 2``; None
      for a given ``Routing``.
  """

  tokens_per_expert: jax.Array
  router_prob: Optional[jax.Array]
  z_loss: Optional[jax.Array]


def _token_mask(mask, shape, what: str) -> jax.Array:
  """``mask`` (default all True) as a flat boolean vector over the tokens of ``shape``."""
  if mask is None:
    return jnp.ones((math.prod(shape),), bool)
  mask = jnp.asarray(mask)
  if mask.shape != tuple(shape):
    raise ValueError(
      f"{_OP}: mask must have the tokens' shape {tuple(shape)} ({what}), got {mask.shape}"
    )
  return mask.reshape(-1).astype(bool)


def _masked_mean(values: jax.Array, keep: jax.Array) -> jax.Array:
  """The mean over the kept rows of ``values`` (``[T, ...]``); 0 when none is kept."""
  total = jnp.sum(jnp.where(keep.reshape(-1, *[1] * (values.ndim - 1)), values, 0), axis=0)
  return total / jnp.maximum(jnp.sum(keep), 1)


def _check_groups(experts: int, top_k: int, n_group, topk_group) -> None:
  if (n_group is None) != (topk_group is None):
    raise ValueError(f"{_OP}: n_group and topk_group go together, got {n_group} and {topk_group}")
  if n_group is None:
    return
  if n_group <= 0 or experts % n_group:
    raise ValueError(f"{_OP}: n_group={n_group} must divide the {experts} experts")
  if not 0 < topk_group <= n_group or top_k > topk_group * (experts // n_group):
    raise ValueError(
      f"{_OP}: topk_group={topk_group} groups of {experts // n_group} experts must hold "
      f"top_k={top_k} experts (and at most n_group={n_group} groups)"
    )


def _group_limited(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
  """``choice`` with the experts outside each token's ``topk_group`` best groups at -inf.

  A group's score is the sum of its two best experts' (DeepSeek-V3; its best
  one's for groups of one expert).
  """
  t, e = choice.shape
  grouped = choice.reshape(t, n_group, e // n_group)
  best = lax.top_k(grouped, min(2, e // n_group))[0]
  _, groups = lax.top_k(jnp.sum(best, axis=-1), topk_group)
  kept = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], groups].set(True)
  return jnp.where(jnp.repeat(kept, e // n_group, axis=1), choice, -jnp.inf)


def route(
  router_logits: jax.Array,
  top_k: int,
  *,
  score: str = "softmax",
  softmax_after_top_k: bool = False,
  norm_topk_prob: bool = True,
  routed_scaling_factor: float = 1.0,
  n_group: Optional[int] = None,
  topk_group: Optional[int] = None,
  selection_bias: Optional[jax.Array] = None,
  mask: Optional[jax.Array] = None,
) -> tuple[Routing, RouterStats]:
  """Top-k routing of tokens to experts, and the router's statistics.

  Args:
    router_logits: ``[..., E]`` floating, one logit per expert.
    top_k: experts a token.
    score: ``"softmax"`` (Mixtral, Qwen-MoE) or ``"sigmoid"`` (DeepSeek-V3)
      scores of the logits.
    softmax_after_top_k: softmax scores only: pick the top-k logits, then
      take the softmax over them (the weights sum to 1).
    norm_topk_prob: renormalise the chosen scores to sum to 1 (False: Qwen's
      ``norm_topk_prob=False``, the raw scores).
    routed_scaling_factor: multiplies the weights (DeepSeek-V3).
    n_group: group-limited top-k: the experts in ``n_group`` equal groups
      (with ``topk_group``).
    topk_group: a token's experts come from its ``topk_group`` best groups.
    selection_bias: ``[E]``, added to the scores to choose the experts but
      not to their weights (DeepSeek-V3's balancing without an auxiliary
      loss); no gradient flows through it.
    mask: ``[...]`` booleans, False for padding: it counts in no statistic.

  Returns:
    The ``Routing`` (experts ``[..., top_k]`` int32, weights ``[..., top_k]``
    float32) and the ``RouterStats``.
  """
  logits = jnp.asarray(router_logits)
  check_floating(_OP, "router_logits", logits)
  lead, experts = logits.shape[:-1], logits.shape[-1]
  if not 0 < top_k <= experts:
    raise ValueError(f"{_OP}: top_k must be in [1, {experts}] (the experts), got {top_k}")
  if score not in SCORES:
    raise ValueError(f"{_OP}: score must be one of {SCORES}, got {score!r}")
  if softmax_after_top_k and score != "softmax":
    raise ValueError(f"{_OP}: softmax_after_top_k takes softmax scores, got score={score!r}")
  _check_groups(experts, top_k, n_group, topk_group)
  scale = check_static_float(_OP, "routed_scaling_factor", routed_scaling_factor)
  keep = _token_mask(mask, lead, "router_logits' leading dims")
  flat = logits.reshape(-1, experts).astype(jnp.float32)
  probs = jax.nn.softmax(flat, axis=-1) if score == "softmax" else jax.nn.sigmoid(flat)
  choice = flat if softmax_after_top_k else probs
  if selection_bias is not None:
    bias = jnp.asarray(selection_bias, jnp.float32)
    if bias.shape != (experts,):
      raise ValueError(f"{_OP}: selection_bias must have shape ({experts},), got {bias.shape}")
    choice = choice + lax.stop_gradient(bias)
  if n_group is not None:
    choice = _group_limited(choice, n_group, topk_group)
  _, chosen = lax.top_k(lax.stop_gradient(choice), top_k)
  picked = jnp.take_along_axis(flat if softmax_after_top_k else probs, chosen, axis=-1)
  if softmax_after_top_k:
    weights = jax.nn.softmax(picked, axis=-1)
  elif norm_topk_prob:
    weights = picked / (jnp.sum(picked, axis=-1, keepdims=True) + 1e-20)
  else:
    weights = picked
  stats = RouterStats(
    tokens_per_expert=_pairs_per_expert(
      chosen, jnp.broadcast_to(keep[:, None], chosen.shape), experts
    ).astype(jnp.float32),
    router_prob=_masked_mean(probs, keep),
    z_loss=_masked_mean(jax.nn.logsumexp(flat, axis=-1) ** 2, keep),
  )
  shape = (*lead, top_k)
  return Routing(chosen.reshape(shape).astype(jnp.int32), (weights * scale).reshape(shape)), stats


def _pairs_per_expert(chosen: jax.Array, routed: jax.Array, experts: int) -> jax.Array:
  """``[E]`` int32: the routed (token, slot) pairs per expert (``chosen``, ``routed [T, k]``)."""
  pairs = jnp.where(routed, chosen, experts).reshape(-1)
  return jnp.zeros((experts + 1,), jnp.int32).at[pairs].add(1)[:experts]


def _expert_mlps(rows, sizes, w_gate_up, w_down) -> jax.Array:
  """Each expert's gated MLP of its (sorted) rows, in their dtype: two grouped GEMMs.

  The gate and up projections run as one gated ``ragged_dot`` (the rows read
  once, ``[rows, 2F]`` never written), its float32 epilogue rounded to the
  rows' dtype once for the down projection, whose float32 accumulator is
  rounded to it too (so the backward's grouped GEMMs take cotangents of the
  rows' dtype); the routing weights combine the experts in float32.
  """
  hidden = ragged_dot(
    rows, w_gate_up, sizes, preferred_element_type=rows.dtype, activation="silu", gated=True
  )
  return ragged_dot(hidden, w_down, sizes)


def _fused_experts(x, w_gate, w_up, w_down) -> jax.Array:
  """The experts' ``[E, D, 2F]`` gate-and-up weight, checked against ``x`` and ``w_down``."""
  d = x.shape[-1]
  if w_up is None:
    fused = w_gate.ndim == 3 and w_gate.shape[1] == d and w_gate.shape[2] % 2 == 0
    e, f = (w_gate.shape[0], w_gate.shape[2] // 2) if fused else (None, None)
    if not fused or w_down.shape != (e, f, d):
      raise ValueError(
        f"{_OP}: without w_up, w_gate must be [E, D, 2F] (gate and up side by side) and w_down "
        f"[E, F, D] with D = {d} (x's last dim); got {w_gate.shape} and {w_down.shape}"
      )
    return w_gate
  e, _, f = w_gate.shape if w_gate.ndim == 3 else (None, None, None)
  ok = w_gate.ndim == 3 and w_gate.shape == w_up.shape and w_gate.shape[1] == d
  if not ok or w_down.shape != (e, f, d):
    raise ValueError(
      f"{_OP}: w_gate and w_up must be [E, D, F] and w_down [E, F, D] with D = {d} (x's "
      f"last dim); got {w_gate.shape}, {w_up.shape} and {w_down.shape}"
    )
  return jnp.concatenate([w_gate, w_up], axis=-1)


def _dense(a, w, dtype) -> jax.Array:
  return jnp.matmul(a, w, preferred_element_type=dtype)


def _shared_output(x, shared_experts, shared_expert_gate) -> jax.Array:
  """The shared experts' gated MLP of every token, times its sigmoid gate if given."""
  w_gate, w_up, w_down = (jnp.asarray(w) for w in shared_experts)
  d = x.shape[-1]
  if (
    w_gate.ndim != 2
    or w_gate.shape != w_up.shape
    or w_down.shape != w_gate.shape[::-1]
    or w_gate.shape[0] != d
  ):
    raise ValueError(
      f"{_OP}: shared_experts must be ([D, F], [D, F], [F, D]) with D = {d}; got "
      f"{w_gate.shape}, {w_up.shape} and {w_down.shape}"
    )
  f32 = jnp.float32
  hidden = jax.nn.silu(_dense(x, w_gate, f32)) * _dense(x, w_up, f32)
  out = _dense(hidden.astype(x.dtype), w_down, f32)
  if shared_expert_gate is None:
    return out
  gate = jnp.asarray(shared_expert_gate)
  if gate.shape not in ((d,), (d, 1)):
    raise ValueError(
      f"{_OP}: shared_expert_gate must have shape ({d},) or ({d}, 1), got {gate.shape}"
    )
  return jax.nn.sigmoid(_dense(x, gate.reshape(d, 1), jnp.float32)) * out


def moe(
  x: jax.Array,
  router_logits: Optional[jax.Array],
  w_gate: jax.Array,
  w_up: Optional[jax.Array],
  w_down: jax.Array,
  *,
  top_k: Optional[int] = None,
  routing: Optional[Routing] = None,
  mask: Optional[jax.Array] = None,
  shared_experts: Optional[tuple[jax.Array, jax.Array, jax.Array]] = None,
  shared_expert_gate: Optional[jax.Array] = None,
  **router_options,
) -> tuple[jax.Array, RouterStats]:
  """A dropless mixture-of-experts gated MLP: each token through its top-k experts.

  ``out[t] = sum_j weight[t, j] * expert_{e[t, j]}(x[t])`` with ``expert_e(x)
  = (silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]``, plus the shared
  experts' gated MLP of every token. No capacity, no dropped token.

  Args:
    x: ``[..., D]`` floating, the tokens.
    router_logits: ``[..., E]``, the router's logits (``route`` turns them
      into a ``Routing``); None when ``routing`` is given.
    w_gate: ``[E, D, F]``, the experts' gate projections.
    w_up: ``[E, D, F]``, their up projections; None: ``w_gate`` is ``[E,
      D, 2F]``, the gate and up projections side by side (the layout the
      gated kernel reads, which saves concatenating them on every call).
    w_down: ``[E, F, D]``, their down projections.
    top_k: experts a token (with ``router_logits``).
    routing: a precomputed ``Routing`` (experts and weights ``[..., k]``)
      instead of ``router_logits``; an expert id outside ``[0, E)`` marks a
      dropped slot (it contributes nothing).
    mask: ``[...]`` booleans, False for padding tokens: they are routed
      nowhere, count in no statistic and get a zero output.
    shared_experts: ``(w_gate [D, Fs], w_up [D, Fs], w_down [Fs, D])``, a
      dense gated MLP added to every token's output (Qwen-MoE, DeepSeek).
    shared_expert_gate: ``[D]``: the shared output is scaled by
      ``sigmoid(x @ shared_expert_gate)`` (Qwen-MoE).
    **router_options: ``route``'s keyword options (``score``,
      ``norm_topk_prob``, ``routed_scaling_factor``, ``n_group``,
      ``topk_group``, ``selection_bias``, ``softmax_after_top_k``).

  Returns:
    ``(out [..., D] in x's dtype, RouterStats)``; for a given ``routing``
    the stats hold ``tokens_per_expert`` only.
  """
  x, w_gate, w_down = (jnp.asarray(a) for a in (x, w_gate, w_down))
  w_up = None if w_up is None else jnp.asarray(w_up)
  for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
    if a is not None:
      check_floating(_OP, name, a)
  w_gate_up = _fused_experts(x, w_gate, w_up, w_down)
  experts, lead = w_gate.shape[0], x.shape[:-1]
  keep = _token_mask(mask, lead, "x's leading dims")
  if (router_logits is None) == (routing is None):
    raise ValueError(f"{_OP}: pass router_logits (with top_k) or a routing, exactly one")
  if routing is None:
    if top_k is None:
      raise ValueError(f"{_OP}: router_logits need top_k")
    router_logits = jnp.asarray(router_logits)
    if router_logits.shape != (*lead, experts):
      raise ValueError(
        f"{_OP}: router_logits must have shape {(*lead, experts)} (x's leading dims, E), got "
        f"{router_logits.shape}"
      )
    routing, stats = route(router_logits, top_k, mask=mask, **router_options)
  elif router_options or top_k is not None:
    given = sorted(router_options) + ["top_k"] * (top_k is not None)
    raise ValueError(f"{_OP}: a given routing takes no top_k or router options, got {given}")
  chosen, weights = jnp.asarray(routing.experts), jnp.asarray(routing.weights)
  if chosen.shape != weights.shape or chosen.shape[:-1] != lead:
    raise ValueError(
      f"{_OP}: routing's experts and weights must both have shape {(*lead, 'k')} (x's leading "
      f"dims, k); got {chosen.shape} and {weights.shape}"
    )
  k = chosen.shape[-1]
  chosen, weights = chosen.reshape(-1, k), weights.reshape(-1, k)
  # Pairs of padding tokens, and expert ids outside [0, E) (a dropped slot),
  # go past every expert's rows: they compute nothing and count nowhere.
  routed = keep[:, None] & (chosen >= 0) & (chosen < experts)
  order = jnp.argsort(jnp.where(routed, chosen, experts).reshape(-1), stable=True)
  sizes = _pairs_per_expert(chosen, routed, experts)
  if router_logits is None:
    stats = RouterStats(sizes.astype(jnp.float32), None, None)
  tokens = x.reshape(-1, x.shape[-1])
  rows = _expert_mlps(tokens[order // k], sizes, w_gate_up, w_down)
  per_slot = jnp.zeros_like(rows).at[order].set(rows).reshape(-1, k, rows.shape[-1])
  out = jnp.einsum("tkd,tk->td", per_slot, weights, preferred_element_type=jnp.float32)
  if shared_experts is not None:
    out = out + _shared_output(tokens, shared_experts, shared_expert_gate)
  elif shared_expert_gate is not None:
    raise ValueError(f"{_OP}: shared_expert_gate needs shared_experts")
  out = jnp.where(keep[:, None], out, 0).astype(x.dtype)
  return out.reshape(x.shape), stats
