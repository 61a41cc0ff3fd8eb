"""dot_product_attention with segment ids, sinks and a soft cap on several devices.

Runs on 8 fake CPU devices (tests/conftest.py). The batch and head dims shard
with the segment ids sharded along the batch and the sinks along the heads:
no all-gather in the compiled HLO of the forward or of the gradient (dsinks
included), the output keeps the query's sharding, and the results equal the
float64 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import assert_close, mesh_4x2, on_path, rand, to64, x64
from tests.primitives.attention_reference import assert_lse_close, reference, small_blocks

# B=8, T=16, S=24, N=8 query heads, K=4 kv heads (GQA), H=32, Hv=16.
B, T, S, N, K, H, HV = 8, 16, 24, 8, 4, 32, 16
STATICS = dict(is_causal=True, logits_soft_cap=5.0)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  q = rand(rng, (B, T, N, H), scale=2.0)
  k, v = rand(rng, (B, S, K, H)), rand(rng, (B, S, K, HV))
  sinks = rand(rng, (N,))
  q_seg = jnp.asarray(rng.integers(0, 3, (B, T)), jnp.int32)
  kv_seg = jnp.asarray(rng.integers(0, 3, (B, S)), jnp.int32)
  ct = rand(rng, (B, T, N, HV))
  return (q, k, v, sinks, q_seg, kv_seg), ct


def _attention(fn, return_residual=False):
  def f(q, k, v, sinks, q_seg, kv_seg):
    return fn(
      q,
      k,
      v,
      sinks=sinks,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      return_residual=return_residual,
      **STATICS,
    )

  return f


def _grad(f):
  """Gradients wrt q, k, v and sinks of ``sum(f(...) * ct)``."""

  def g(q, k, v, sinks, q_seg, kv_seg, ct):
    loss = lambda q, k, v, sinks: jnp.sum(f(q, k, v, sinks, q_seg, kv_seg) * ct)
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)

  return g


# (q/k/v, sinks, segment ids): batch x heads, heads, batch over all devices.
SPECS = {
  "batch-heads": (P("a", None, "b"), P("b"), P("a")),
  "heads": (P(None, None, "a"), P("a"), P()),
  "batch-all-devices": (P(("a", "b")), P(), P(("a", "b"))),
}


def _check_sharded(mesh, spec_name, path="xla", seed=0):
  args, ct = _data(seed)
  qkv, sinks, seg = SPECS[spec_name]
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  sargs = tuple(put(a, s) for a, s in zip(args, (qkv, qkv, qkv, sinks, seg, seg)))
  sct = put(ct, qkv)
  pallax_fn = lambda *a, **kw: pallax.dot_product_attention(*a, **kw, config=small_blocks(path))
  fwd = jax.jit(_attention(pallax_fn, return_residual=True))
  grad = jax.jit(_grad(_attention(pallax_fn)))
  with on_path(path):
    fwd, grad = fwd.lower(*sargs).compile(), grad.lower(*sargs, sct).compile()
  hlo = fwd.as_text() + grad.as_text()
  assert "all-gather" not in hlo, f"{spec_name}: all-gather in the compiled HLO"
  (out, lse), grads = fwd(*sargs), grad(*sargs, sct)
  assert out.sharding.is_equivalent_to(sargs[0].sharding, out.ndim), out.sharding
  with x64():
    args64 = tuple(to64(a) for a in args[:4]) + args[4:]
    out_ref, lse_ref = _attention(reference, return_residual=True)(*args64)
    grads_ref = jax.jit(_grad(_attention(reference)))(*args64, to64(ct))
  assert_close(out, out_ref, jnp.float32, f"{spec_name}: output")
  assert_lse_close(lse, lse_ref, jnp.float32, f"{spec_name}: lse")
  assert grads[3].shape == (N,)
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dsinks")):
    assert_close(g, w, jnp.float32, f"{spec_name}: {name}")


@pytest.mark.parametrize(
  "axis_type, spec_name",
  [(AxisType.Auto, name) for name in SPECS] + [(AxisType.Explicit, "batch-heads")],
  ids=str,
)
def test_sharded_jit_has_no_all_gather(axis_type, spec_name):
  _check_sharded(mesh_4x2(axis_type), spec_name)


def test_sharded_jit_on_triton():
  _check_sharded(mesh_4x2(), "batch-heads", "triton", seed=1)


def test_shard_map_forward_and_grad():
  """Per-shard calls see their slice of the ids and of the sinks; dsinks summed over the batch."""
  mesh = mesh_4x2()
  args, ct = _data(2)
  qkv, sinks, seg = SPECS["batch-heads"]
  in_specs = (qkv, qkv, qkv, sinks, seg, seg)
  f = _attention(pallax.dot_product_attention)
  sharded = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=qkv)
  got_out = jax.jit(sharded)(*args)
  got_grads = jax.jit(_grad(sharded))(*args, ct)
  with x64():
    args64 = tuple(to64(a) for a in args[:4]) + args[4:]
    out_ref = _attention(reference)(*args64)
    grads_ref = jax.jit(_grad(_attention(reference)))(*args64, to64(ct))
  assert_close(got_out, out_ref, jnp.float32, "shard_map output")
  for g, w, name in zip(got_grads, grads_ref, ("dq", "dk", "dv", "dsinks")):
    assert_close(g, w, jnp.float32, f"shard_map {name}")
  np.testing.assert_allclose(got_out, jax.jit(f)(*args), rtol=1e-5, atol=1e-6)
