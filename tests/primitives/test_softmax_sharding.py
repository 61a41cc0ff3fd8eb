"""softmax / log_softmax on several devices: sharded jit, pmap, shard_map.

Runs on 8 fake CPU devices (tests/conftest.py). Rows shard freely: no
all-gather in the compiled HLO of the forward or the gradient, and outputs
keep the input's sharding. The softmax axis is replicated: sharding it gathers
it, and the result is still right.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import PATHS, assert_close_neginf, mesh_4x2, on_path, rand

OPS = (pallax.softmax, pallax.log_softmax)


def _data(seed=0, shape=(8, 4, 200)):
  rng = np.random.default_rng(seed)
  return rand(rng, shape, scale=2.0), jnp.asarray(rng.random(shape) < 0.7), rand(rng, shape)


def _loss(op):
  return lambda x, m, c: jnp.sum(jnp.where(m, op(x, where=m), 0) * c)


_close = functools.partial(assert_close_neginf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("spec", [P("a"), P("a", "b"), P(("a", "b")), P(None, "a")], ids=str)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_sharded_jit_has_no_all_gather(path, spec, axis_type):
  mesh = mesh_4x2(axis_type)
  x, m, c = _data()
  xs, ms, cs = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, m, c))
  for op in OPS:
    fwd = jax.jit(lambda x, m: op(x, where=m))
    grad = jax.jit(jax.grad(_loss(op)))
    with on_path(path):
      y, dx = fwd(xs, ms), grad(xs, ms, cs)
      hlo = fwd.lower(xs, ms).compile().as_text() + grad.lower(xs, ms, cs).compile().as_text()
      y_ref, dx_ref = op(x, where=m), jax.grad(_loss(op))(x, m, c)
    assert "all-gather" not in hlo and "all-reduce" not in hlo
    assert y.sharding.is_equivalent_to(xs.sharding, y.ndim)
    assert dx.sharding.is_equivalent_to(xs.sharding, dx.ndim)
    _close(y, y_ref)
    _close(dx, dx_ref)


@pytest.mark.parametrize("axis", [-1, 0], ids=str)
def test_softmax_axis_sharded_is_replicated_not_wrong(axis):
  """Sharding the softmax axis (last, or a moved leading one) gathers it; results match."""
  mesh = mesh_4x2()
  x, m, _ = _data(1)
  spec = P(None, None, "a") if axis == -1 else P("a")
  xs, ms = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, m))
  for op in OPS:
    _close(jax.jit(lambda x, m: op(x, axis, where=m))(xs, ms), op(x, axis, where=m))


def test_uneven_shards_fall_back_to_replication():
  mesh = mesh_4x2()
  x, m, c = _data(2, shape=(6, 5, 40))  # 6 rows over 4 devices: uneven

  for op in OPS:

    def loss(x, m, c):
      x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("a")))
      return _loss(op)(x, m, c)

    _close(jax.jit(jax.grad(loss))(x, m, c), jax.grad(_loss(op))(x, m, c))


@pytest.mark.parametrize("path", PATHS)
def test_pmap(path):
  x, m, c = _data(3, shape=(4, 5, 96))
  for op in OPS:
    with on_path(path):
      y = jax.pmap(lambda x, m: op(x, where=m))(x, m)
      g = jax.pmap(jax.grad(_loss(op)), in_axes=(0, 0, None))(x, m, c[0])
    _close(y, op(x, where=m))
    for i in range(4):
      _close(g[i], jax.grad(_loss(op))(x[i], m[i], c[0]))


@pytest.mark.parametrize("path", PATHS)
def test_shard_map_forward_and_grad(path):
  mesh = mesh_4x2()
  x, m, c = _data(4)
  mask = m[0, 0]  # one (200,) mask, replicated: broadcast over the sharded rows

  for op in OPS:

    def sharded_loss(x, c):
      y = jax.shard_map(
        lambda x, mask: op(x, where=mask),
        mesh=mesh,
        in_specs=(P("a", "b"), P()),
        out_specs=P("a", "b"),
      )(x, mask)
      return jnp.sum(jnp.where(mask, y, 0) * c)

    with on_path(path):
      got = jax.jit(jax.grad(sharded_loss))(x, c)
    want = jax.grad(lambda x, c: jnp.sum(jnp.where(mask, op(x, where=mask), 0) * c))(x, c)
    _close(got, want)
