"""pallax.moe and pallax.route against a per-token float64 reference.

The reference routes each token in numpy (its own softmax/sigmoid, group
limit, bias and top-k) and sums its top-k experts' gated MLPs one token at
a time in jnp (float64, differentiable in the weights and logits for the
fixed choice of experts), sharing nothing with pallax's sort-and-group
program. Every router option, a padding mask, shared experts, precomputed
routing; gradients (reverse and forward mode) and vmap against a loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import assert_close, rand, to64, x64

T, D, F, E, K = 24, 16, 12, 8, 2


def _np_scores(logits: np.ndarray, score: str) -> np.ndarray:
  if score == "sigmoid":
    return 1 / (1 + np.exp(-logits))
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def reference_choice(logits, top_k, opts) -> np.ndarray:
  """Each token's experts, chosen one token at a time in numpy."""
  logits = np.asarray(logits, np.float64)
  chosen = []
  for row in logits:
    probs = _np_scores(row, opts.get("score", "softmax"))
    choice = row.copy() if opts.get("softmax_after_top_k") else probs.copy()
    if "selection_bias" in opts:
      choice += np.asarray(opts["selection_bias"], np.float64)
    if "n_group" in opts:
      groups = choice.reshape(opts["n_group"], -1)
      group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
      best = np.argsort(-group_score, kind="stable")[: opts["topk_group"]]
      allowed = np.zeros(opts["n_group"], bool)
      allowed[best] = True
      choice = np.where(np.repeat(allowed, groups.shape[1]), choice, -np.inf)
    chosen.append(np.argsort(-choice, kind="stable")[:top_k])
  return np.stack(chosen)


def reference_weights(logits, chosen, opts):
  """The chosen experts' weights (jnp: differentiable in ``logits``)."""
  if opts.get("score") == "sigmoid":
    probs = jax.nn.sigmoid(logits)
  else:
    probs = jax.nn.softmax(logits, axis=-1)
  if opts.get("softmax_after_top_k"):
    w = jax.nn.softmax(jnp.take_along_axis(logits, chosen, -1), axis=-1)
  else:
    w = jnp.take_along_axis(probs, chosen, -1)
    if opts.get("norm_topk_prob", True):
      w = w / w.sum(-1, keepdims=True)
  return w * opts.get("routed_scaling_factor", 1.0)


def reference_moe(x, weights, chosen, wg, wu, wd, shared=None, gate=None, mask=None):
  """Per token, its experts' gated MLPs (weights gathered per token), summed with its weights."""
  h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, wg[chosen]))
  h = h * jnp.einsum("td,tkdf->tkf", x, wu[chosen])
  out = jnp.einsum("tk,tkd->td", weights, jnp.einsum("tkf,tkfd->tkd", h, wd[chosen]))
  if shared is not None:
    s = (jax.nn.silu(x @ shared[0]) * (x @ shared[1])) @ shared[2]
    out = out + (s if gate is None else jax.nn.sigmoid(x @ gate)[:, None] * s)
  return out if mask is None else jnp.where(jnp.asarray(mask)[:, None], out, 0)


def _params(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  x = rand(rng, (T, D), dtype)
  logits = rand(rng, (T, E))
  experts = [rand(rng, s, dtype) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
  return x, logits, experts


# The routers of current models.
ROUTERS = {
  "mixtral": {},
  "mixtral-softmax-after-top-k": {"softmax_after_top_k": True},
  "qwen-no-renorm": {"norm_topk_prob": False},
  "deepseek-v3": {
    "score": "sigmoid",
    "n_group": 4,
    "topk_group": 2,
    "selection_bias": np.linspace(-0.3, 0.3, E),
    "routed_scaling_factor": 2.5,
  },
  "sigmoid-raw": {"score": "sigmoid", "norm_topk_prob": False},
}


@pytest.mark.parametrize("router", ROUTERS)
def test_moe_matches_per_token_reference(router):
  opts = ROUTERS[router]
  x, logits, (wg, wu, wd) = _params(seed=1)
  mask = np.ones(T, bool)
  mask[[3, 17]] = False  # padding
  f = jax.jit(lambda *a: pallax.moe(*a, top_k=K, mask=mask, **opts))
  out, stats = f(x, logits, wg, wu, wd)
  chosen = reference_choice(logits, K, opts)
  routing, _ = pallax.route(logits, K, **opts)
  np.testing.assert_array_equal(np.asarray(routing.experts), chosen)
  with x64():
    w = reference_weights(to64(logits), chosen, opts)
    want = reference_moe(to64(x), w, chosen, *map(to64, (wg, wu, wd)), mask=mask)
  assert_close(out, want, jnp.float32, f"{router} forward")
  # Gradients with respect to the tokens, the logits and every weight.
  rng = np.random.default_rng(2)
  cot = rand(rng, (T, D))

  def ours(x, logits, wg, wu, wd):
    return jnp.sum(pallax.moe(x, logits, wg, wu, wd, top_k=K, mask=mask, **opts)[0] * cot)

  def theirs(x, logits, wg, wu, wd):
    w = reference_weights(logits, chosen, opts)
    return jnp.sum(reference_moe(x, w, chosen, wg, wu, wd, mask=mask) * to64(cot))

  args = (x, logits, wg, wu, wd)
  grads = jax.jit(jax.grad(ours, argnums=range(5)))(*args)
  with x64():
    want_grads = jax.grad(theirs, argnums=range(5))(*map(to64, args))
  for name, g, wg_ in zip(("x", "logits", "w_gate", "w_up", "w_down"), grads, want_grads):
    assert_close(g, wg_, jnp.float32, f"{router} d{name}")
  # The statistics, over the kept tokens.
  kept = chosen[mask]
  np.testing.assert_array_equal(
    np.asarray(stats.tokens_per_expert), np.bincount(kept.ravel(), minlength=E)
  )
  probs = _np_scores(np.asarray(logits, np.float64), opts.get("score", "softmax"))
  np.testing.assert_allclose(np.asarray(stats.router_prob), probs[mask].mean(0), rtol=1e-5)
  lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(float(stats.z_loss), (lse[mask] ** 2).mean(), rtol=1e-5)


def test_jvp_shared_experts_and_bfloat16():
  x, logits, (wg, wu, wd) = _params(jnp.bfloat16, seed=3)
  rng = np.random.default_rng(4)
  shared = [rand(rng, s, jnp.bfloat16) * 0.3 for s in ((D, 20), (D, 20), (20, D))]
  gate = rand(rng, (D,), jnp.bfloat16)
  tangents = (rand(rng, (T, D), jnp.bfloat16), rand(rng, (T, E)))

  def f(x, logits):
    return pallax.moe(
      x, logits, wg, wu, wd, top_k=K, shared_experts=shared, shared_expert_gate=gate
    )[0]

  out, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, logits, *tangents)
  chosen = reference_choice(logits, K, {})
  with x64():

    def g(x, logits):
      w = reference_weights(logits, chosen, {})
      experts = [to64(a) for a in (wg, wu, wd)]
      return reference_moe(x, w, chosen, *experts, [to64(s) for s in shared], to64(gate))

    want, want_tangent = jax.jvp(g, (to64(x), to64(logits)), tuple(map(to64, tangents)))
  assert out.dtype == jnp.bfloat16
  assert_close(out, want, jnp.bfloat16, "shared experts forward")
  assert_close(tangent, want_tangent, jnp.bfloat16, "jvp")


def test_precomputed_routing_and_vmap_against_a_loop():
  x, logits, (wg, wu, wd) = _params(seed=5)
  routing, _ = pallax.route(logits, 3)
  out, stats = pallax.moe(x, None, wg, wu, wd, routing=routing)
  chosen = np.asarray(routing.experts)
  with x64():
    want = reference_moe(to64(x), to64(routing.weights), chosen, *map(to64, (wg, wu, wd)))
  assert_close(out, want, jnp.float32, "precomputed routing")
  assert stats.router_prob is None and stats.z_loss is None
  np.testing.assert_array_equal(
    np.asarray(stats.tokens_per_expert), np.bincount(chosen.ravel(), minlength=E)
  )
  # An expert id outside [0, E) is a dropped slot: it adds nothing, shifts nothing.
  dropped = jnp.asarray(chosen).at[5, 1].set(-1).at[9, 0].set(E)
  out, stats = pallax.moe(x, None, wg, wu, wd, routing=pallax.Routing(dropped, routing.weights))
  weights = np.asarray(routing.weights).copy()
  weights[5, 1] = weights[9, 0] = 0.0
  with x64():
    want = reference_moe(to64(x), to64(weights), chosen, *map(to64, (wg, wu, wd)))
  assert_close(out, want, jnp.float32, "dropped slots")
  assert float(stats.tokens_per_expert.sum()) == chosen.size - 2
  # vmap over a batch of token sets with shared experts' weights, and of grad.
  rng = np.random.default_rng(6)
  xs, ls = rand(rng, (3, T, D)), rand(rng, (3, T, E))
  f = lambda x, lg: pallax.moe(x, lg, wg, wu, wd, top_k=K)[0]
  got = jax.jit(jax.vmap(f))(xs, ls)
  want = jnp.stack([f(xs[i], ls[i]) for i in range(3)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  loss = lambda x, lg: jnp.sum(f(x, lg) ** 2)
  got = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(xs, ls)
  one = jax.jit(jax.grad(loss, (0, 1)))
  for i in range(3):
    want = one(xs[i], ls[i])
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-4, atol=1e-5)
  # Leading dims: [2, 12, D] tokens route as the [24, D] they flatten to.
  out3, _ = pallax.moe(x.reshape(2, 12, D), logits.reshape(2, 12, E), wg, wu, wd, top_k=K)
  out2, _ = pallax.moe(x, logits, wg, wu, wd, top_k=K)
  np.testing.assert_allclose(np.asarray(out3).reshape(T, D), np.asarray(out2), rtol=1e-6)


def test_the_experts_run_as_grouped_matmuls():
  x, logits, (wg, wu, wd) = _params()
  jaxpr = jax.make_jaxpr(lambda *a: pallax.moe(*a, top_k=K))(x, logits, wg, wu, wd)
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names.count("ragged_dot_epilogue") == 1  # gate and up, one gated kernel
  assert names.count("ragged_dot") == 1  # down


def test_fused_gate_and_up_weight_is_the_pair():
  x, logits, (wg, wu, wd) = _params(seed=4)
  fused = jnp.concatenate([wg, wu], axis=-1)
  want, _ = pallax.moe(x, logits, wg, wu, wd, top_k=K)
  got, _ = pallax.moe(x, logits, fused, None, wd, top_k=K)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  grads = jax.grad(lambda w: jnp.sum(pallax.moe(x, logits, w, None, wd, top_k=K)[0] ** 2))(fused)
  pair = jax.grad(lambda a, b: jnp.sum(pallax.moe(x, logits, a, b, wd, top_k=K)[0] ** 2), (0, 1))
  np.testing.assert_allclose(
    np.asarray(grads), np.asarray(jnp.concatenate(pair(wg, wu), -1)), rtol=1e-6, atol=1e-7
  )


def test_bad_input_is_named():
  x, logits, (wg, wu, wd) = _params()
  with pytest.raises(ValueError, match="top_k must be in"):
    pallax.moe(x, logits, wg, wu, wd, top_k=E + 1)
  with pytest.raises(ValueError, match="w_down"):
    pallax.moe(x, logits, wg, wu, wd[:, :, :-1], top_k=K)
  with pytest.raises(ValueError, match="without w_up, w_gate must be"):
    pallax.moe(x, logits, wg, None, wd, top_k=K)
  with pytest.raises(ValueError, match="router_logits must have shape"):
    pallax.moe(x, logits[:, :-1], wg, wu, wd, top_k=K)
  with pytest.raises(ValueError, match="exactly one"):
    pallax.moe(x, None, wg, wu, wd, top_k=K)
  with pytest.raises(ValueError, match="n_group=3 must divide"):
    pallax.moe(x, logits, wg, wu, wd, top_k=K, n_group=3, topk_group=1)
  with pytest.raises(ValueError, match="score must be one of"):
    pallax.moe(x, logits, wg, wu, wd, top_k=K, score="relu")
  with pytest.raises(ValueError, match="mask must have"):
    pallax.moe(x, logits, wg, wu, wd, top_k=K, mask=np.ones(T + 1, bool))
  with pytest.raises(TypeError, match="x must have a floating dtype"):
    pallax.moe(x.astype(jnp.int32), logits, wg, wu, wd, top_k=K)
