"""matmul on several devices: jit with sharded inputs, pmap, shard_map.

Runs on 8 fake CPU devices (tests/conftest.py). Batch dims and M shard
freely, a sharded N shards the result, a sharded K is contracted per device
and summed across devices: no all-gather in the compiled HLO of the forward or
the gradient, an all-reduce where a contraction is sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import PATHS, mesh_4x2, on_path, rand

M, K, N = 16, 32, 24

# name: (a shape, b shape, a spec, b spec, the result's spec, whether the
# forward sums across devices).
CASES = {
  "m": ((M, K), (K, N), P("a"), P(), P("a", None), False),
  "batch": ((8, M, K), (K, N), P("a", "b"), P(), P("a", "b", None), False),
  "n": ((M, K), (K, N), P(), P(None, "b"), P(None, "b"), False),
  "m_and_n": ((M, K), (K, N), P("a"), P(None, "b"), P("a", "b"), False),
  "k": ((M, K), (K, N), P(None, "a"), P("a"), P(None, None), True),
  "batched_b": ((8, M, K), (8, K, N), P("a"), P("a", None, "b"), P("a", None, "b"), False),
}


def _op(a, b, bias):
  return pallax.matmul(a, b, bias=bias, activation="gelu")


def _loss(a, b, bias, c):
  return jnp.sum(_op(a, b, bias) * c)


def _data(case, seed=0):
  a_shape, b_shape = CASES[case][:2]
  rng = np.random.default_rng(seed)
  a, b = rand(rng, a_shape), rand(rng, b_shape, scale=0.2)
  out_shape = jnp.matmul(a, b).shape
  return a, b, rand(rng, (N,)), rand(rng, out_shape)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_sharded_jit_has_no_all_gather(path, case, axis_type):
  mesh = mesh_4x2(axis_type)
  _, _, a_spec, b_spec, out_spec, summed = CASES[case]
  a, b, bias, c = _data(case)
  a_s = jax.device_put(a, NamedSharding(mesh, a_spec))
  b_s = jax.device_put(b, NamedSharding(mesh, b_spec))
  c_s = jax.device_put(c, NamedSharding(mesh, out_spec))
  fwd = jax.jit(_op)
  grad = jax.jit(jax.grad(_loss, (0, 1, 2)))
  with on_path(path):
    y = fwd(a_s, b_s, bias)
    grads = grad(a_s, b_s, bias, c_s)
    fwd_hlo = fwd.lower(a_s, b_s, bias).compile().as_text()
    grad_hlo = grad.lower(a_s, b_s, bias, c_s).compile().as_text()
    y_ref = _op(a, b, bias)
    grads_ref = jax.grad(_loss, (0, 1, 2))(a, b, bias, c)
  assert "all-gather" not in fwd_hlo and "all-gather" not in grad_hlo
  assert y.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), y.ndim), y.sharding
  for g, x in zip(grads[:2], (a_s, b_s)):
    assert g.sharding.is_equivalent_to(x.sharding, g.ndim), (g.sharding, x.sharding)
  # A sharded K sums the forward's partial products; the gradients always sum
  # some sharded contraction (over M or batch for dB and dbias, N for dA, K...).
  assert ("all-reduce" in fwd_hlo) == summed
  assert "all-reduce" in grad_hlo
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, grads_ref):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-4)


def test_sharded_k_sums_before_the_epilogue():
  """relu(sum of partials + bias), not the sum of per-device relu(partial + bias)."""
  mesh = mesh_4x2()
  a, b, bias, _ = _data("k", seed=1)
  a_s = jax.device_put(a, NamedSharding(mesh, P(None, ("a", "b"))))
  b_s = jax.device_put(b, NamedSharding(mesh, P(("a", "b"))))
  f = jax.jit(lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="relu"))
  hlo = f.lower(a_s, b_s, bias).compile().as_text()
  assert "all-reduce" in hlo and "all-gather" not in hlo
  want = jnp.maximum(jnp.matmul(a, b) + bias, 0)
  np.testing.assert_allclose(f(a_s, b_s, bias), want, rtol=1e-5, atol=1e-5)


def test_uneven_shards_fall_back_to_replication():
  mesh = mesh_4x2()
  rng = np.random.default_rng(2)
  a, b, bias, c = rand(rng, (6, 10)), rand(rng, (10, 5)), rand(rng, (5,)), rand(rng, (6, 5))

  def loss(a, b, bias, c):
    a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("a")))  # 6 rows, 4 devices
    return _loss(a, b, bias, c)

  got = jax.jit(jax.grad(loss, (0, 1, 2)))(a, b, bias, c)
  want = jax.grad(_loss, (0, 1, 2))(a, b, bias, c)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_pmap(path):
  a, b, bias, c = _data("batch", seed=3)
  a, c = a[:4], c[:4]
  with on_path(path):
    y = jax.pmap(_op, in_axes=(0, None, None))(a, b, bias)
    g = jax.pmap(jax.grad(_loss, (0, 1, 2)), in_axes=(0, None, None, 0))(a, b, bias, c)
  np.testing.assert_allclose(y, _op(a, b, bias), rtol=1e-5, atol=1e-5)
  for i in range(4):
    want = jax.grad(_loss, (0, 1, 2))(a[i], b, bias, c[i])
    for got, w in zip(g, want):
      np.testing.assert_allclose(got[i], w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_shard_map_forward_and_grad(path):
  mesh = mesh_4x2()
  a, b, bias, c = _data("batch", seed=4)

  def sharded_loss(a, b, bias, c):
    y = jax.shard_map(_op, mesh=mesh, in_specs=(P("a", "b"), P(), P()), out_specs=P("a", "b"))(
      a, b, bias
    )
    return jnp.sum(y * c)

  with on_path(path):
    got = jax.jit(jax.grad(sharded_loss, (0, 1, 2)))(a, b, bias, c)
    want = jax.grad(_loss, (0, 1, 2))(a, b, bias, c)
  # The weight and bias are replicated: their gradients must be summed over the shards.
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
