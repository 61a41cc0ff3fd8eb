"""A Mixtral-architecture model on pallax ops (examples/mixtral.py) against transformers' own.

A tiny ``MixtralForCausalLM`` with random weights (nothing downloaded): its
logits, its loss with ``labels`` and ``output_router_logits=True`` (next-token
cross-entropy plus the router's load-balancing loss) and every parameter's
gradient, against the same model written with ``pallax.rms_norm``,
``pallax.dot_product_attention``, ``pallax.moe`` and
``pallax.linear_cross_entropy``. Both run in float32; the tolerances are
float32 rounding through two layers (the two sum in different orders).

Marker ``models``: needs the ``models`` extra (torch, transformers),
deselected by default and run by CI after installing it.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _import_hub_kernels() -> None:
  """Imports Hugging Face's ``kernels`` (transformers imports it when installed) from site-packages.

  The repository root, on ``sys.path`` for ``tests`` and ``examples``, holds
  pallax's ``kernels/`` sources (installed as ``pallax.kernels``), which would
  shadow it: transformers 5.25's Mixtral failed on ``from kernels import
  CUDAProperties``. Nothing imports pallax's sources as ``kernels``.
  """
  saved = sys.path[:]
  sys.path[:] = [p for p in saved if Path(p or ".").resolve() != ROOT]
  try:
    __import__("kernels")
  except ImportError:  # transformers without hub kernels
    pass
  finally:
    sys.path[:] = saved


_import_hub_kernels()
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples import mixtral  # noqa: E402

pytestmark = pytest.mark.models


def _model(**overrides):
  torch.manual_seed(0)
  config = transformers.MixtralConfig(
    **{
      "vocab_size": 96,
      "hidden_size": 32,
      "intermediate_size": 40,
      "num_hidden_layers": 2,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
      "num_local_experts": 8,
      "num_experts_per_tok": 2,
      "router_aux_loss_coef": 0.05,
      **overrides,
    }
  )
  model = transformers.MixtralForCausalLM(config).eval()
  # transformers initialises with std 0.02: larger weights route less
  # uniformly and give gradients well above float32 rounding.
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim > 1:
        p.mul_(10.0)
  return config, model


@pytest.mark.parametrize("overrides", [{}, {"num_experts_per_tok": 3, "num_key_value_heads": 1}])
def test_loss_and_gradients_match_transformers(overrides):
  config, model = _model(**overrides)
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 11))
  ids = torch.as_tensor(tokens)
  out = model(ids, labels=ids, output_router_logits=True)
  out.loss.backward()
  want_grads = mixtral.params_from_torch({n: p.grad for n, p in model.named_parameters()})

  params = mixtral.params_from_torch(dict(model.named_parameters()))
  shape = mixtral.MixtralShape.from_config(config)
  value, grads = jax.jit(jax.value_and_grad(mixtral.loss), static_argnums=2)(
    params, jnp.asarray(tokens), shape
  )
  np.testing.assert_allclose(float(value), out.loss.item(), rtol=2e-6)
  h, _ = jax.jit(mixtral.hidden_states, static_argnums=2)(params, jnp.asarray(tokens), shape)
  logits = np.asarray(h @ params["lm_head.weight"])
  want_logits = out.logits.detach().numpy()
  np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5 * np.abs(want_logits).max())
  assert set(grads) == set(want_grads)
  for name, want in want_grads.items():
    got, want = np.asarray(grads[name]), np.asarray(want)
    scale = np.abs(want).max()
    assert scale > 0, name
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_router_statistics_give_transformers_aux_loss():
  config, model = _model()
  tokens = np.random.default_rng(2).integers(0, config.vocab_size, (3, 7))
  out = model(torch.as_tensor(tokens), output_router_logits=True)
  params = mixtral.params_from_torch(model.state_dict())
  _, stats = mixtral.hidden_states(
    params, jnp.asarray(tokens), mixtral.MixtralShape.from_config(config)
  )
  got = mixtral.load_balancing_loss(stats, config.num_local_experts, tokens.size)
  np.testing.assert_allclose(float(got), out.aux_loss.item(), rtol=2e-6)
