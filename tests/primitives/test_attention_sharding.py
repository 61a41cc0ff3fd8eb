"""dot_product_attention on several devices: sharded jit, shard_map, pmap.

Runs on 8 fake CPU devices (tests/conftest.py). The batch and head dims shard
freely: no all-gather in the compiled HLO of the forward or the gradient, the
output keeps the query's sharding, and the results equal the unsharded call.
A sharded sequence dim (T of the query, S of the key and value) runs the
context-parallel programs: tests/primitives/test_attention_context.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import as64, assert_close, mesh_4x2, on_path, rand, sharding_devices, x64
from tests.primitives.attention_reference import reference, small_blocks

# B=8, T=16, S=24, N=8 query heads, K=4 key/value heads (GQA), H=32.
B, T, S, N, K, H = 8, 16, 24, 8, 4, 32


def _data(seed=0, bias_batch=B):
  rng = np.random.default_rng(seed)
  q, k, v = rand(rng, (B, T, N, H)), rand(rng, (B, S, K, H)), rand(rng, (B, S, K, H))
  bias = rand(rng, (bias_batch, N, T, S))
  mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.8)
  q_len = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32)
  kv_len = jnp.asarray(rng.integers(0, S + 1, B), jnp.int32)
  ct = rand(rng, q.shape)
  return (q, k, v, bias, mask, q_len, kv_len), ct


def _attention(config=None, return_residual=False):
  def f(q, k, v, bias, mask, q_len, kv_len):
    return pallax.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      is_causal=True,
      return_residual=return_residual,
      config=config,
    )

  return f


def _grad(f):
  """Gradients wrt q, k, v, bias of ``sum(f(...) * ct)``."""

  def g(q, k, v, bias, mask, q_len, kv_len, ct):
    loss = lambda q, k, v, bias: jnp.sum(f(q, k, v, bias, mask, q_len, kv_len) * ct)
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias)

  return g


def _reference(args, ct):
  """Float64 output, lse and gradients (call under x64())."""
  q, k, v, bias = as64(*args[:4])

  def ref(q, k, v, bias, **kw):
    return reference(
      q,
      k,
      v,
      bias,
      args[4],
      query_seq_lengths=args[5],
      key_value_seq_lengths=args[6],
      is_causal=True,
      **kw,
    )

  out, lse = ref(q, k, v, bias, return_residual=True)
  loss = lambda *p: jnp.sum(ref(*p) * as64(ct)[0])
  return out, lse, jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias)


# Operand specs (q/k/v, bias, mask, lengths): batch, batch x heads, heads, heads x batch.
SPECS = {
  "batch-heads": (P("a", None, "b"), P("a", "b"), P("a"), P("a")),
  "batch-all-devices": (P(("a", "b")), P(("a", "b")), P(("a", "b")), P(("a", "b"))),
  "heads": (P(None, None, "a"), P(None, "a"), P(), P()),
  "heads-batch": (P("b", None, "a"), P("b", "a"), P("b"), P("b")),
}


def _put(mesh, args, ct, spec_name):
  qkv, bias, mask, lengths = SPECS[spec_name]
  specs = (qkv, qkv, qkv, bias, mask, lengths, lengths)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  return tuple(put(a, s) for a, s in zip(args, specs)), put(ct, qkv)


def _check_sharded(mesh, spec_name, path="xla", seed=0):
  args, ct = _data(seed)
  sargs, sct = _put(mesh, args, ct, spec_name)
  config = small_blocks(path)
  fwd = jax.jit(_attention(config, return_residual=True))
  grad = jax.jit(_grad(_attention(config)))
  with on_path(path):
    fwd, grad = fwd.lower(*sargs).compile(), grad.lower(*sargs, sct).compile()
  hlo = fwd.as_text() + grad.as_text()
  (out, lse), grads = fwd(*sargs), grad(*sargs, sct)
  assert "all-gather" not in hlo, f"{spec_name}: all-gather in the compiled HLO"
  assert out.sharding.is_equivalent_to(sargs[0].sharding, out.ndim), out.sharding
  with x64():
    out_ref, lse_ref, grads_ref = _reference(args, ct)
  assert_close(out, out_ref, jnp.float32, f"{spec_name}: output")
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
  finite = np.isfinite(np.asarray(lse_ref))
  assert_close(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], jnp.float32, "lse")
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dbias")):
    assert_close(g, w, jnp.float32, f"{spec_name}: {name}")


@pytest.mark.parametrize(
  "axis_type, spec_name",
  [(AxisType.Auto, name) for name in SPECS] + [(AxisType.Explicit, "batch-heads")],
  ids=str,
)
def test_sharded_jit_has_no_all_gather(axis_type, spec_name):
  _check_sharded(mesh_4x2(axis_type), spec_name)


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_sharded_jit_on_kernels(path):
  _check_sharded(mesh_4x2(), "batch-heads", path, seed=1)


def test_bias_shared_over_the_sharded_batch():
  """A bias broadcast over the batch: its gradient is summed across batch shards."""
  mesh = mesh_4x2()
  args, ct = _data(2, bias_batch=1)
  q_spec = P("a", None, "b")
  specs = (q_spec, q_spec, q_spec, P(None, "b"), P("a"), P("a"), P("a"))
  sargs = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
  sct = jax.device_put(ct, NamedSharding(mesh, q_spec))
  grad = jax.jit(_grad(_attention())).lower(*sargs, sct).compile()
  assert "all-gather" not in grad.as_text()
  grads = grad(*sargs, sct)
  with x64():
    _, _, grads_ref = _reference(args, ct)
  assert grads[3].shape == (1, N, T, S)
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dbias")):
    assert_close(g, w, jnp.float32, name)


def test_shard_map_forward_and_grad():
  mesh = mesh_4x2()
  args, ct = _data(4)
  qkv, bias, mask, lengths = SPECS["batch-heads"]
  in_specs = (qkv, qkv, qkv, bias, mask, lengths, lengths)
  sharded = jax.shard_map(_attention(), mesh=mesh, in_specs=in_specs, out_specs=qkv)
  got_out = jax.jit(sharded)(*args)
  got_grads = jax.jit(_grad(sharded))(*args, ct)
  with x64():
    out_ref, _, grads_ref = _reference(args, ct)
  assert_close(got_out, out_ref, jnp.float32, "shard_map output")
  for g, w, name in zip(got_grads, grads_ref, ("dq", "dk", "dv", "dbias")):
    assert_close(g, w, jnp.float32, f"shard_map {name}")


def test_pmap():
  args, ct = _data(5)
  devices = sharding_devices()[:4]
  # (4, 2, ...): 4 devices, a batch of 2 on each.
  split = lambda a: a.reshape((4, 2) + a.shape[1:])
  pargs, pct = tuple(split(a) for a in args), split(ct)
  out = jax.pmap(_attention(), devices=devices)(*pargs)
  grads = jax.pmap(_grad(_attention()), devices=devices)(*pargs, pct)
  with x64():
    out_ref, _, grads_ref = _reference(args, ct)
  assert_close(np.asarray(out).reshape(out_ref.shape), out_ref, jnp.float32, "pmap output")
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dbias")):
    assert_close(np.asarray(g).reshape(w.shape), w, jnp.float32, f"pmap {name}")


def test_unsharded_equals_sharded_exactly_shaped():
  """Sharded and unsharded calls agree to float32 rounding."""
  mesh = mesh_4x2()
  args, ct = _data(6)
  sargs, _ = _put(mesh, args, ct, "batch-heads")
  f = jax.jit(_attention())
  np.testing.assert_allclose(f(*sargs), f(*args), rtol=1e-5, atol=1e-6)
