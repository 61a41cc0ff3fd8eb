"""rms_norm on several devices: jit with sharded inputs, pmap, shard_map.

Runs on 8 fake CPU devices (tests/conftest.py). The sharding rule must let
batch-like dims shard freely: no all-gather in the compiled HLO of the
forward or the gradient, and the output keeps the input's sharding.
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


def _data(seed=0, shape=(8, 4, 200)):
  rng = np.random.default_rng(seed)
  return rand(rng, shape), rand(rng, shape[-1:], shift=1.0), rand(rng, shape)


def _loss(x, w, c):
  return jnp.sum(pallax.rms_norm(x, w, offset=0.5) * c)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec", [P("a"), P("a", "b"), P(("a", "b")), P(None, "a")], ids=str)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_sharded_jit_has_no_all_gather(path, spec, axis_type):
  mesh = mesh_4x2(axis_type)
  x, w, c = _data()
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  cs = jax.device_put(c, NamedSharding(mesh, spec))
  fwd = jax.jit(pallax.rms_norm)
  grad = jax.jit(jax.grad(_loss, (0, 1)))
  with on_path(path):
    y = fwd(xs, w)
    dx, dw = grad(xs, w, cs)
    fwd_hlo = fwd.lower(xs, w).compile().as_text()
    grad_hlo = grad.lower(xs, w, cs).compile().as_text()
    y_ref = pallax.rms_norm(x, w)
    dx_ref, dw_ref = jax.grad(_loss, (0, 1))(x, w, c)
  assert "all-gather" not in fwd_hlo and "all-gather" not in grad_hlo
  assert y.sharding.is_equivalent_to(xs.sharding, y.ndim)
  assert dx.sharding.is_equivalent_to(xs.sharding, dx.ndim)
  # dweight is summed over the row shards: one all-reduce, not a gather.
  assert "all-reduce" in grad_hlo
  np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-4)


def test_hidden_sharded_input_is_replicated_not_wrong():
  mesh = mesh_4x2()
  x, w, _ = _data(1)
  xs = jax.device_put(x, NamedSharding(mesh, P(None, None, "a")))
  np.testing.assert_allclose(
    jax.jit(pallax.rms_norm)(xs, w), pallax.rms_norm(x, w), rtol=1e-6, atol=1e-6
  )


def test_uneven_shards_fall_back_to_replication():
  mesh = mesh_4x2()
  x, w, c = _data(2, shape=(6, 5, 40))  # 6 rows over 4 devices: uneven

  def loss(x, w, c):
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("a")))
    return _loss(x, w, c)

  got = jax.jit(jax.grad(loss, (0, 1)))(x, w, c)
  want = jax.grad(_loss, (0, 1))(x, w, c)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_pmap(path):
  x, w, c = _data(3, shape=(4, 5, 96))
  with on_path(path):
    y = jax.pmap(pallax.rms_norm, in_axes=(0, None))(x, w)
    g = jax.pmap(jax.grad(_loss, (0, 1)), in_axes=(0, None, 0))(x, w, c)
  np.testing.assert_allclose(y, pallax.rms_norm(x, w), rtol=1e-6, atol=1e-6)
  for i in range(4):
    want = jax.grad(_loss, (0, 1))(x[i], w, c[i])
    np.testing.assert_allclose(g[0][i], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g[1][i], want[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_shard_map_forward_and_grad(path):
  mesh = mesh_4x2()
  x, w, c = _data(4)

  def sharded_loss(x, w, c):
    y = jax.shard_map(
      lambda x, w: pallax.rms_norm(x, w, offset=0.5),
      mesh=mesh,
      in_specs=(P("a", "b"), P()),
      out_specs=P("a", "b"),
    )(x, w)
    return jnp.sum(y * c)

  with on_path(path):
    got = jax.jit(jax.grad(sharded_loss, (0, 1)))(x, w, c)
    want = jax.grad(_loss, (0, 1))(x, w, c)
  # The weight is replicated: its gradient must be summed over the shards.
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["layer_norm", "fused_add_rms_norm"])
def test_family_sharded_jit_has_no_all_gather(op, path):
  mesh = mesh_4x2()
  x, w, c = _data(5)
  fn = {
    "layer_norm": lambda x, w: pallax.layer_norm(x, w, w * 0.5),
    "fused_add_rms_norm": lambda x, w: pallax.fused_add_rms_norm(x, c, w),
  }[op]
  loss = lambda x, w: sum(jnp.sum(o * c) for o in jax.tree.leaves(fn(x, w)))
  xs = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
  with on_path(path):
    grad = jax.jit(jax.grad(loss, (0, 1)))
    hlo = grad.lower(xs, w).compile().as_text()
    got, want = grad(xs, w), jax.grad(loss, (0, 1))(x, w)
    out = jax.jit(fn)(xs, w)
  assert (
    "all-gather" not in hlo and "all-gather" not in jax.jit(fn).lower(xs, w).compile().as_text()
  )
  for o in jax.tree.leaves(out):
    assert o.sharding.is_equivalent_to(xs.sharding, o.ndim)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
