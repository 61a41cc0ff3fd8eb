"""A Mixtral-architecture language model on pallax ops, with weights in transformers' layout.

Each decoder layer is ``pallax.rms_norm``, grouped-query causal attention
(``pallax.dot_product_attention``, rotary embeddings in jnp) and a sparse
MoE FFN (``pallax.moe``: top-2 of 8 experts in Mixtral, no token dropped);
the head's loss is ``pallax.linear_cross_entropy``, plus the router's
load-balancing loss built from ``pallax.moe``'s ``RouterStats``. ``loss``
is what ``MixtralForCausalLM(input_ids, labels=..., output_router_logits=True)``
returns, and ``tests/test_mixtral.py`` checks its value and gradients against
transformers' own model.

``params_from_torch`` turns a transformers state dict into the arrays this
module reads: projections transposed to ``[in, out]``, and each layer's
experts kept as transformers stores them (``gate_up_proj`` as one ``[E, D,
2F]`` weight, the layout of ``pallax.moe``'s gated kernel).

Run from the repository root (needs torch and transformers: ``pip install
'pallax[models]'``)::

  python -m examples.mixtral   # a random tiny Mixtral: pallax's loss and transformers'
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallax


class MixtralShape(NamedTuple):
  """The hyperparameters of a Mixtral config that the forward pass reads."""

  heads: int
  kv_heads: int
  head_dim: int
  top_k: int
  rms_norm_eps: float
  rope_theta: float
  router_aux_loss_coef: float

  @classmethod
  def from_config(cls, config: Any) -> MixtralShape:
    """From a ``transformers.MixtralConfig``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    return cls(
      config.num_attention_heads,
      config.num_key_value_heads,
      head_dim,
      config.num_experts_per_tok,
      config.rms_norm_eps,
      rope["rope_theta"],
      config.router_aux_loss_coef,
    )


def params_from_torch(state_dict: dict[str, Any]) -> dict[str, jax.Array]:
  """A transformers ``MixtralForCausalLM`` state dict as float32 arrays in pallax's layout.

  Linear weights (``[out, in]`` in torch) become ``[in, out]``; the experts'
  ``gate_up_proj [E, 2F, D]`` becomes ``[E, D, 2F]`` and ``down_proj [E, D,
  F]`` becomes ``[E, F, D]``. Keys stay transformers' names.
  """
  params = {}
  for name, tensor in state_dict.items():
    value = tensor.detach().float().numpy()
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
      value = value.transpose(0, 2, 1)
    elif value.ndim == 2 and not name.endswith("embed_tokens.weight"):
      value = value.T
    params[name] = jnp.asarray(value)
  return params


def _rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Half-rotation rotary embeddings of ``x [B, T, N, H]`` at ``positions [T]``."""
  h = x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
  angles = positions[:, None].astype(jnp.float32) * inv_freq
  cos, sin = (jnp.concatenate([f(angles)] * 2, -1)[:, None, :] for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(x, 2, axis=-1)
  return x * cos + jnp.concatenate([-x2, x1], -1) * sin


def _attention(p: dict, prefix: str, x: jax.Array, shape: MixtralShape) -> jax.Array:
  b, t, _ = x.shape
  heads = lambda w, n: (x @ p[prefix + w]).reshape(b, t, n, shape.head_dim)
  positions = jnp.arange(t)
  q = _rotary(heads("q_proj.weight", shape.heads), positions, shape.rope_theta)
  k = _rotary(heads("k_proj.weight", shape.kv_heads), positions, shape.rope_theta)
  v = heads("v_proj.weight", shape.kv_heads)
  out = pallax.dot_product_attention(q, k, v, is_causal=True)  # GQA: kv heads as they are
  return out.reshape(b, t, -1) @ p[prefix + "o_proj.weight"]


def _moe(p: dict, prefix: str, x: jax.Array, shape: MixtralShape):
  logits = x @ p[prefix + "gate.weight"]
  return pallax.moe(
    x,
    logits,
    p[prefix + "experts.gate_up_proj"],
    None,
    p[prefix + "experts.down_proj"],
    top_k=shape.top_k,
  )


def hidden_states(
  params: dict[str, jax.Array], tokens: jax.Array, shape: MixtralShape
) -> tuple[jax.Array, list[pallax.RouterStats]]:
  """The final normed hidden states ``[B, T, D]`` and each layer's router statistics."""
  x = params["model.embed_tokens.weight"][tokens]
  stats = []
  layers = sorted({int(k.split(".")[2]) for k in params if k.startswith("model.layers.")})
  norm = lambda a, w: pallax.rms_norm(a, params[w], eps=shape.rms_norm_eps)
  for i in layers:
    pre = f"model.layers.{i}."
    h = norm(x, pre + "input_layernorm.weight")
    x = x + _attention(params, pre + "self_attn.", h, shape)
    h = norm(x, pre + "post_attention_layernorm.weight")
    out, layer_stats = _moe(params, pre + "mlp.", h, shape)
    x, stats = x + out, stats + [layer_stats]
  return norm(x, "model.norm.weight"), stats


def load_balancing_loss(stats: list[pallax.RouterStats], experts: int, tokens: int) -> jax.Array:
  """The Switch / Mixtral auxiliary loss over all layers' tokens, as transformers computes it.

  ``E * sum_e f_e * P_e`` with ``f_e`` the (token, slot) pairs routed to
  expert ``e`` per token and ``P_e`` its mean router probability, both
  over every layer's tokens together.
  """
  rows = len(stats) * tokens
  routed = sum(s.tokens_per_expert for s in stats) / rows
  prob = sum(s.router_prob for s in stats) / len(stats)
  return experts * jnp.sum(routed * prob)


def loss(params: dict[str, jax.Array], tokens: jax.Array, shape: MixtralShape) -> jax.Array:
  """Next-token cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss.

  Args:
    params: ``params_from_torch`` of a ``MixtralForCausalLM``.
    tokens: ``[B, T]`` token ids; position ``t`` predicts token ``t + 1``.
    shape: the model's ``MixtralShape``.

  Returns:
    The scalar loss, float32 (transformers' ``loss`` with ``labels=tokens``
    and ``output_router_logits=True``).
  """
  h, stats = hidden_states(params, tokens, shape)
  lm_head = params["lm_head.weight"]
  cross_entropy = pallax.linear_cross_entropy(h[:, :-1], lm_head, tokens[:, 1:])
  aux = load_balancing_loss(stats, stats[0].router_prob.shape[0], tokens.size)
  return cross_entropy + shape.router_aux_loss_coef * aux


def main() -> None:
  """A random tiny Mixtral in transformers and here: the two losses."""
  import torch
  from transformers import MixtralConfig, MixtralForCausalLM

  torch.manual_seed(0)
  config = MixtralConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.02,
  )
  model = MixtralForCausalLM(config).eval()
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
  ids = torch.as_tensor(tokens)
  want = model(ids, labels=ids, output_router_logits=True).loss.item()
  got = jax.jit(loss, static_argnums=2)(
    params_from_torch(model.state_dict()), jnp.asarray(tokens), MixtralShape.from_config(config)
  )
  print(f"transformers {want:.6f}  pallax {float(got):.6f}")


if __name__ == "__main__":
  main()
