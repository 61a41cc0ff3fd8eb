"""pallax.ragged_dot_general: lax.ragged_dot_general's three modes, against float64.

Forward against ``lax.ragged_dot_general`` in float64 for batch dims, lhs
dims outer and inner to the ragged one, several contracting dims and group
sizes per batch index; gradients against float64 references (lax's for the
ragged non-contracting mode, a masked einsum for the contracting one, whose
lax gradient is unimplemented); clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallax
from tests.helpers import assert_close, rand, to64, x64

D = lax.RaggedDotDimensionNumbers

# name -> (lhs shape, rhs shape, dimension numbers, group sizes)
CASES = {
  "free": ((10, 4), (3, 4, 5), D((((1,), (1,)), ((), ())), [0], [0]), [3, 0, 6]),
  # A batch dim, a free dim inner to the ragged one, two contracting dims, the
  # group dim after the batch dim; sizes per batch index.
  "free-batch-inner": (
    (2, 6, 3, 4, 5),
    (2, 3, 4, 5, 7),
    D((((3, 4), (2, 3)), ((0,), (0,))), [1], [1]),
    [[2, 1, 3], [0, 6, 0]],
  ),
  # A free dim outer to the ragged one: sizes per index of it.
  "free-outer": (
    (2, 6, 4),
    (3, 4, 5),
    D((((2,), (1,)), ((), ())), [1], [0]),
    [[2, 1, 3], [1, 1, 1]],
  ),
  "contracting": ((10, 4), (10, 5), D((((0,), (0,)), ((), ())), [0], []), [3, 0, 6]),
  # A batch dim and a contracting dim outer to the ragged one (summed).
  "contracting-batch-outer": (
    (2, 3, 6, 4),
    (2, 3, 6, 5),
    D((((1, 2), (1, 2)), ((0,), (0,))), [2], []),
    [[[2, 1, 3], [0, 6, 0], [1, 1, 1]], [[6, 0, 0], [2, 2, 2], [3, 3, 0]]],
  ),
  "batch": ((6, 5, 4), (6, 4, 3), D((((2,), (1,)), ((0,), (0,))), [0], []), [2, 1, 1]),
}


def _inputs(name, dtype, seed=0):
  lhs_shape, rhs_shape, dn, sizes = CASES[name]
  rng = np.random.default_rng(seed)
  return rand(rng, lhs_shape, dtype), rand(rng, rhs_shape, dtype), dn, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_lax_in_float64(name):
  lhs, rhs, dn, sizes = _inputs(name, jnp.bfloat16)
  got = jax.jit(lambda a, b: pallax.ragged_dot_general(a, b, sizes, dn))(lhs, rhs)
  with x64():
    want = lax.ragged_dot_general(to64(lhs), to64(rhs), jnp.asarray(sizes), dn)
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert_close(got, want, jnp.bfloat16, name)


def _contracting_reference(lhs, rhs, sizes):
  """``out[g] = lhs[rows of g]^T @ rhs[rows of g]`` by a membership mask (float64)."""
  ends = np.cumsum(sizes)
  rows = np.arange(lhs.shape[0])
  member = (rows[None, :] >= (ends - sizes)[:, None]) & (rows[None, :] < ends[:, None])
  return jnp.einsum("gr,rk,rn->gkn", member.astype(lhs.dtype), lhs, rhs)


@pytest.mark.parametrize("name", ["free", "contracting"])
def test_gradients_and_jvp(name):
  lhs, rhs, dn, sizes = _inputs(name, jnp.float32, seed=1)
  rng = np.random.default_rng(2)
  f = lambda a, b: pallax.ragged_dot_general(a, b, sizes, dn)
  out_shape = jax.eval_shape(f, lhs, rhs).shape
  cot = rand(rng, out_shape)
  tangents = (rand(rng, lhs.shape), rand(rng, rhs.shape))
  grads = jax.grad(lambda a, b: jnp.sum(f(a, b) * cot), (0, 1))(lhs, rhs)
  _, tangent = jax.jvp(f, (lhs, rhs), tangents)
  with x64():
    if name == "free":
      g = lambda a, b: lax.ragged_dot_general(a, b, jnp.asarray(sizes), dn)
    else:
      g = lambda a, b: _contracting_reference(a, b, sizes)
    args = (to64(lhs), to64(rhs))
    want = jax.grad(lambda a, b: jnp.sum(g(a, b) * to64(cot)), (0, 1))(*args)
    _, want_tangent = jax.jvp(g, args, tuple(map(to64, tangents)))
  assert_close(grads[0], want[0], jnp.float32, f"{name} dlhs")
  assert_close(grads[1], want[1], jnp.float32, f"{name} drhs")
  assert_close(tangent, want_tangent, jnp.float32, f"{name} jvp")


def test_bad_input_is_named():
  lhs, rhs, dn, sizes = _inputs("free", jnp.float32)
  with pytest.raises(ValueError, match="ragged_dot_general: a ragged free dim needs an rhs group"):
    pallax.ragged_dot_general(lhs, rhs[0], sizes, D((((1,), (0,)), ((), ())), [0], []))
  with pytest.raises(ValueError, match="group_sizes must have shape"):
    pallax.ragged_dot_general(lhs, rhs, np.ones((2, 3), np.int32), dn)
  with pytest.raises(TypeError, match="group_sizes must be an integer array"):
    pallax.ragged_dot_general(lhs, rhs, sizes.astype(np.float32), dn)
  with pytest.raises(ValueError, match="contracting dims differ"):
    pallax.ragged_dot_general(lhs[:, :3], rhs, sizes, dn)
