"""pallax.moe vs the same dropless MoE on ``lax.ragged_dot`` and tokamax's, and a dense MLP.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_moe.py --benchmark-group-by=param:shape,param:mode

Shapes are ``(T, D, F, E, k)``: T tokens of width D, each through its top-k
of E experts, gated MLPs of width F. Impls: ``pallax`` (``pallax.moe``:
the gate and up projections one gated ``ragged_dot`` kernel, their weights
passed side by side, ``[E, D, 2F]``), ``lax`` and
``tokamax`` (the same routing, sort and combine written in JAX, each expert
product one ``lax.ragged_dot`` or ``tokamax.ragged_dot``: what a JAX user
writes today; ``lax`` on CPU and GPU is a masked dense product over every
expert, E times the FLOPs, and tokamax's ``custom_vjp`` raises under
``jvp``), and ``dense`` (the T*k rows through one dense gated MLP: the same
FLOPs with no routing, the bound). Modes as in ``bench/modes.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from modes import MODES
from peers import tokamax
from throughput import record_throughput

import pallax
from pallax import roofline
from pallax.kernels.ragged_dot.tools import ragged_dot_work

SHAPES = [(2048, 512, 1024, 8, 2)]
IMPLS = ("pallax", "lax", "tokamax", "dense")


def dropless(ragged_dot, top_k: int):
  """A dropless MoE FFN written in JAX around the grouped product ``ragged_dot(a, w, sizes)``."""

  def moe(x, logits, w_gate, w_up, w_down):
    t, e = logits.shape
    routing, _ = pallax.route(logits, top_k)
    chosen = routing.experts.reshape(-1)
    order = jnp.argsort(chosen, stable=True)
    sizes = jnp.zeros((e,), jnp.int32).at[chosen].add(1)
    rows = x[order // top_k]
    hidden = jax.nn.silu(ragged_dot(rows, w_gate, sizes)) * ragged_dot(rows, w_up, sizes)
    out = ragged_dot(hidden, w_down, sizes)
    per_slot = jnp.zeros_like(out).at[order].set(out).reshape(t, top_k, -1)
    return jnp.einsum("tkd,tk->td", per_slot, routing.weights.astype(out.dtype))

  return moe


def dense(top_k: int):
  """Every token's k copies through one dense gated MLP (expert 0's weights): equal FLOPs."""

  def mlp(x, logits, w_gate, w_up, w_down):
    rows = jnp.repeat(x, top_k, axis=0)
    out = (jax.nn.silu(rows @ w_gate[0]) * (rows @ w_up[0])) @ w_down[0]
    return out.reshape(x.shape[0], top_k, -1).sum(1)

  return mlp


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_moe(benchmark, bench, impl, mode, dtype, shape):
  t, d, f, e, k = shape
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((t, d)), dtype)
  logits = jnp.asarray(rng.standard_normal((t, e)), dtype)
  weights = [
    jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), dtype)
    for s in ((e, d, f), (e, d, f), (e, f, d))
  ]
  args = [x, logits, *weights]
  if impl == "pallax":  # the gate and up weights side by side, as its gated kernel reads them
    fn = lambda x, logits, w, w_down: pallax.moe(x, logits, w, None, w_down, top_k=k)[0]
    args = [x, logits, jnp.concatenate(weights[:2], -1), weights[2]]
  elif impl == "dense":
    fn = dense(k)
  else:
    fn = dropless(lax.ragged_dot if impl == "lax" else tokamax().ragged_dot, k)
  info = dict(op="moe", impl=impl, mode=mode, dtype=jnp.dtype(dtype).name, shape=list(shape))
  benchmark.extra_info.update(info)
  peer = impl != "pallax"
  call = bench.transformed(fn, args, mode, np.random.default_rng(1), peer)
  if call is None or not bench(call[0], *call[1], rounds=5, peer=peer):
    return
  if mode in roofline.MODES:
    up = ragged_dot_work(t * k, d, 2 * f, e, dtype, mode)
    down = ragged_dot_work(t * k, f, d, e, dtype, mode)
    record_throughput(benchmark, roofline.Work(up.flops + down.flops, up.bytes + down.bytes), dtype)
