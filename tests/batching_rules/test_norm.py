"""vmap of rms_norm: matches a loop over examples and stays one primitive."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  NESTED_IN_AXES,
  PATHS,
  batched,
  check_nested_vmap,
  loop_stack,
  nested_shape,
  on_path,
  rand,
)

H = 24
X_SHAPE = (3, H)  # one example's x


IN_AXES = [(0, None), (None, 0), (0, 0), (1, None), (-1, 0), (2, 0), (-2, None)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
def test_vmap_matches_loop(path, in_axes):
  rng = np.random.default_rng(0)
  size = 4
  x = batched(rng, in_axes[0], size, X_SHAPE)
  w = batched(rng, in_axes[1], size, (H,))
  f = lambda x, w: pallax.rms_norm(x, w, offset=0.5)
  with on_path(path):
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(x, w)
    want = loop_stack(f, (x, w), in_axes, size)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES[:3], ids=str)
def test_vmap_of_grad_matches_loop(path, in_axes):
  """Per-example gradients: the backward kernel's dweight must be per example."""
  rng = np.random.default_rng(1)
  size = 3
  x = batched(rng, in_axes[0], size, X_SHAPE)
  w = batched(rng, in_axes[1], size, (H,))
  c = rand(rng, X_SHAPE)
  loss = lambda x, w: jnp.sum(pallax.rms_norm(x, w) * c)
  g = jax.grad(loss, (0, 1))
  with on_path(path):
    got = jax.jit(jax.vmap(g, in_axes=in_axes))(x, w)
    want = loop_stack(g, (x, w), in_axes, size)
  for k in range(2):
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("in_axes", IN_AXES[:3], ids=str)
def test_vmap_of_jvp_matches_loop(in_axes):
  rng = np.random.default_rng(2)
  size = 3
  x, xd = (batched(rng, in_axes[0], size, X_SHAPE) for _ in range(2))
  w, wd = (batched(rng, in_axes[1], size, (H,)) for _ in range(2))
  f = lambda x, w, xd, wd: jax.jvp(pallax.rms_norm, (x, w), (xd, wd))[1]
  got = jax.vmap(f, in_axes=in_axes + in_axes)(x, w, xd, wd)
  want = loop_stack(f, (x, w, xd, wd), in_axes + in_axes, size)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_nested_vmap(outer, inner):
  rng = np.random.default_rng(3)
  x = rand(rng, nested_shape(outer, inner, 0, X_SHAPE))
  w = rand(rng, nested_shape(outer, inner, 1, (H,)))
  close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6)
  jaxpr = check_nested_vmap(pallax.rms_norm, (x, w), outer, inner, close)
  assert [e.primitive.name for e in jaxpr.eqns].count("rms_norm_fwd") == 1


@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
@pytest.mark.parametrize("mode", ["forward", "grad", "jvp"])
def test_vmap_is_one_primitive(in_axes, mode):
  rng = np.random.default_rng(4)
  x = batched(rng, in_axes[0], 5, X_SHAPE)
  w = batched(rng, in_axes[1], 5, (H,))
  if mode == "forward":
    f = pallax.rms_norm
  elif mode == "grad":
    f = jax.grad(lambda x, w: pallax.rms_norm(x, w).sum(), (0, 1))
  else:
    f = lambda x, w: jax.jvp(pallax.rms_norm, (x, w), (x, w))
  jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(x, w).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert not {"while", "scan", "pjit", "jit"} & set(names), names
  expected = {
    "forward": {"rms_norm_fwd": 1},
    "grad": {"rms_norm_fwd": 1, "rms_norm_bwd": 1},
    "jvp": {"rms_norm_fwd": 1, "rms_norm_jvp": 1},
  }[mode]
  assert {k: names.count(k) for k in expected} == expected, names


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0)], ids=str)
def test_vmap_axis_size_zero(path, in_axes):
  x = jnp.zeros((0,) * (in_axes[0] is not None) + X_SHAPE)
  w = jnp.zeros((0,) * (in_axes[1] is not None) + (H,))
  with on_path(path):
    y = jax.jit(jax.vmap(pallax.rms_norm, in_axes=in_axes))(x, w)
  assert y.shape == (0,) + X_SHAPE


FAMILY = {
  # op: (function, shapes of one example's operands)
  "layer_norm": (lambda x, w, b: pallax.layer_norm(x, w, b), (X_SHAPE, (H,), (H,))),
  "fused_add_rms_norm": (
    lambda x, r, w: pallax.fused_add_rms_norm(x, r, w),
    (X_SHAPE, X_SHAPE, (H,)),
  ),
}
FAMILY_AXES = [(0, None, None), (None, 0, 0), (0, 0, 0), (1, None, 0), (None, None, 0)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", FAMILY_AXES, ids=str)
@pytest.mark.parametrize("op", list(FAMILY))
def test_family_vmap_of_value_and_grad_matches_loop(op, in_axes, path):
  fn, shapes = FAMILY[op]
  rng = np.random.default_rng(5)
  size = 3
  args = [batched(rng, ax, size, shape) for ax, shape in zip(in_axes, shapes)]
  c = rand(rng, X_SHAPE)

  def value_and_grad(*a):
    loss = lambda *a: sum(jnp.sum(o * c) for o in jax.tree.leaves(fn(*a)))
    return jax.value_and_grad(loss, tuple(range(len(a))))(*a)

  with on_path(path):
    got = jax.jit(jax.vmap(value_and_grad, in_axes=in_axes))(*args)
    want = jax.tree.leaves(loop_stack(value_and_grad, args, in_axes, size))
  for k, leaf in enumerate(jax.tree.leaves(got)):
    np.testing.assert_allclose(leaf, want[k], rtol=2e-5, atol=2e-5)
  jaxpr = jax.make_jaxpr(jax.vmap(value_and_grad, in_axes=in_axes))(*args).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names.count(f"{op}_fwd") == 1 and names.count(f"{op}_bwd") == 1, names
  assert not {"while", "scan"} & set(names)
