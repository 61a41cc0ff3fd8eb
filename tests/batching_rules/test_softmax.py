"""vmap of softmax / log_softmax: matches a loop over examples and stays one primitive."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  NESTED_IN_AXES,
  PATHS,
  assert_close_neginf,
  batched,
  check_nested_vmap,
  loop_stack,
  nested_shape,
  on_path,
  primitive_names,
  rand,
)

X_SHAPE = (3, 24)  # one example's x (and where=)
OPS = (pallax.softmax, pallax.log_softmax)


def _batched(rng, axis, size, shape, mask=False):
  """A batch of random examples (or of ``where=`` masks, keeping 70%)."""
  draw = (
    (lambda s: jnp.asarray(rng.random(s) < 0.7)) if mask else (lambda s: rand(rng, s, scale=2.0))
  )
  return batched(rng, axis, size, shape, draw)


# (x, where) in_axes; the softmax axis of each example is its last.
IN_AXES = [(0, None), (None, 0), (0, 0), (1, None), (-1, 0), (2, 0), (-2, None), (2, -1)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
def test_vmap_matches_loop(path, in_axes):
  rng = np.random.default_rng(0)
  size = 4
  x = _batched(rng, in_axes[0], size, X_SHAPE)
  w = _batched(rng, in_axes[1], size, X_SHAPE, mask=True)
  for op in OPS:
    with on_path(path):
      got = jax.jit(jax.vmap(lambda x, w: op(x, where=w), in_axes=in_axes))(x, w)
      want = loop_stack(lambda x, w: op(x, where=w), (x, w), in_axes, size)
    assert_close_neginf(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes, axis", [(0, -1), (1, 0), (-1, 0), (2, (0, 1))], ids=str)
def test_vmap_over_any_axis_without_mask(path, in_axes, axis):
  """The vmapped axis and the softmax axes in any position; no mask operand."""
  rng = np.random.default_rng(1)
  x = _batched(rng, in_axes, 5, X_SHAPE)
  for op in OPS:
    f = lambda x: op(x, axis=axis)
    with on_path(path):
      got = jax.jit(jax.vmap(f, in_axes=in_axes))(x)
      want = loop_stack(f, (x,), (in_axes,), 5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES[:3], ids=str)
def test_vmap_of_grad_matches_loop(path, in_axes):
  rng = np.random.default_rng(2)
  size = 3
  x = _batched(rng, in_axes[0], size, X_SHAPE)
  w = _batched(rng, in_axes[1], size, X_SHAPE, mask=True)
  c = rand(rng, X_SHAPE)
  for op in OPS:
    g = jax.grad(lambda x, w: jnp.sum(jnp.where(w, op(x, where=w), 0) * c))
    with on_path(path):
      got = jax.jit(jax.vmap(g, in_axes=in_axes))(x, w)
      want = loop_stack(g, (x, w), in_axes, size)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
  "in_axes", [(0, 0, None), (None, None, 0), (0, None, 0), (None, 0, 0)], ids=str
)
def test_vmap_of_jvp_matches_loop(in_axes):
  """(x, x_dot, where): an unmapped primal with mapped tangents is what jacfwd does."""
  rng = np.random.default_rng(3)
  size = 3
  x, xd = (_batched(rng, ax, size, X_SHAPE) for ax in in_axes[:2])
  w = _batched(rng, in_axes[2], size, X_SHAPE, mask=True)
  for op in OPS:
    f = lambda x, xd, w: jax.jvp(lambda x: op(x, where=w), (x,), (xd,))[1]
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(x, xd, w)
    want = loop_stack(f, (x, xd, w), in_axes, size)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_nested_vmap(outer, inner):
  rng = np.random.default_rng(4)
  x = rand(rng, nested_shape(outer, inner, 0, X_SHAPE))
  w = jnp.asarray(rng.random(nested_shape(outer, inner, 1, X_SHAPE)) < 0.7)
  close = functools.partial(assert_close_neginf, rtol=2e-5, atol=2e-5)
  for op in OPS:
    jaxpr = check_nested_vmap(lambda x, w: op(x, where=w), (x, w), outer, inner, close)
    names = primitive_names(jaxpr)
    assert names.count(f"{op.__name__}_fwd") == 1, names


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.__name__)
@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
@pytest.mark.parametrize("mode", ["forward", "grad", "jvp", "hessian"])
def test_vmap_is_one_primitive(op, in_axes, mode):
  rng = np.random.default_rng(5)
  x = _batched(rng, in_axes[0], 5, X_SHAPE)
  w = _batched(rng, in_axes[1], 5, X_SHAPE, mask=True)
  loss = lambda x, w: jnp.sum(jnp.sin(jnp.where(w, op(x, where=w), 0)))
  f = {
    "forward": lambda x, w: op(x, where=w),
    "grad": jax.grad(loss),
    "jvp": lambda x, w: jax.jvp(lambda x: op(x, where=w), (x,), (x,)),
    # jacfwd of grad: the forward's tangent kernel vmapped over the basis.
    "hessian": jax.hessian(loss),
  }[mode]
  names = primitive_names(jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(x, w).jaxpr)
  assert not {"while", "scan"} & set(names), names
  name = op.__name__
  fwd, tangent = f"{name}_fwd", "softmax_bwd" if name == "softmax" else "log_softmax_jvp"
  expected = {
    "forward": {fwd: 1},
    "grad": {fwd: 1, f"{name}_bwd": 1},
    "jvp": {fwd: 1, tangent: 1},
    # Second order differentiates the backward's XLA program.
    "hessian": {fwd: 1, tangent: 1},
  }[mode]
  assert collections.Counter(n for n in names if "softmax" in n) == expected, names


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0), (0, 0)], ids=str)
def test_vmap_axis_size_zero(path, in_axes):
  x = jnp.zeros((0,) * (in_axes[0] is not None) + X_SHAPE)
  w = jnp.zeros((0,) * (in_axes[1] is not None) + X_SHAPE, bool)
  for op in OPS:
    with on_path(path):
      y = jax.jit(jax.vmap(lambda x, w: op(x, where=w), in_axes=in_axes))(x, w)
      g = jax.jit(
        jax.vmap(jax.grad(lambda x, w: jnp.sum(jnp.where(w, op(x, where=w), 0))), in_axes=in_axes)
      )(x, w)
    assert y.shape == (0,) + X_SHAPE and g.shape == (0,) + X_SHAPE
