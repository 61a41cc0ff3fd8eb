"""vmap of paged_attention: matches a loop over examples and stays one primitive.

The operands are (q, k_pages, v_pages, lengths, page_indices); any of them
may be mapped (at axis 0 or another) or shared. A vmapped pool is folded
into the page axis with the example's page indices offset, so per-example
caches work too; in nested vmaps as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  NESTED_IN_AXES,
  attention_primitives,
  batched,
  check_nested_vmap,
  loop_stack,
  nested_shape,
  on_path,
)
from tests.primitives.paged_attention_reference import reference

# One example: B=3 sequences, N=4 query heads, K=2 kv heads, H=16, pages of 4
# tokens, 3 pages a sequence, a pool of 10 pages.
B, N, K, H, PS, PPS, P = 3, 4, 2, 16, 4, 3, 10
SHAPES = ((B, N, H), (K, P, PS, H), (K, P, PS, H), (B,), (B, PPS))
NAMES = ("q", "k_pages", "v_pages", "lengths", "page_indices")
SIZE = 3


def _draw(rng, name, shape):
  if name == "lengths":
    return jnp.asarray(rng.integers(0, PS * PPS + 1, shape), jnp.int32)
  if name == "page_indices":
    return jnp.asarray(rng.integers(0, P, shape), jnp.int32)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _data(rng, in_axes, size=SIZE, shapes=SHAPES):
  return tuple(
    batched(rng, ax, size, shape, lambda s, name=name: _draw(rng, name, s))
    for name, ax, shape in zip(NAMES, in_axes, shapes)
  )


def _paged(config=None):
  return lambda *a: pallax.paged_attention(*a, logits_soft_cap=5.0, config=config)


IN_AXES = [
  (0, 0, 0, 0, 0),
  (0, None, None, None, None),
  (None, 0, 0, None, None),
  (None, 0, None, None, None),
  (None, None, 0, None, None),
  (None, None, None, 0, None),
  (None, None, None, None, 0),
  (0, None, None, 0, 0),
  (1, 2, -1, None, 1),
  (None, 1, 0, 0, None),
]


@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
def test_vmap_matches_loop(in_axes):
  rng = np.random.default_rng(abs(hash(in_axes)) % 2**32)
  args = _data(rng, in_axes)
  f = _paged()
  got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
  want = loop_stack(f, args, in_axes, SIZE)
  assert got.shape == (SIZE, B, N, H)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  for i in range(SIZE):  # and the float64 reference, per example
    ex = [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(args, in_axes)]
    np.testing.assert_allclose(got[i], reference(*ex, logits_soft_cap=5.0), rtol=1e-5, atol=1e-5)
  jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args).jaxpr
  assert attention_primitives(jaxpr, loops=False) == {"paged_attention": 1}


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_vmap_on_kernels(path):
  in_axes = (0, 0, 0, None, 0)
  args = _data(np.random.default_rng(1), in_axes)
  f = _paged()
  with on_path(path):
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
  np.testing.assert_allclose(got, loop_stack(f, args, in_axes, SIZE), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_nested_vmap(outer, inner):
  """Two-level vmaps over the queries and the pool (one array as both pools)."""
  rng = np.random.default_rng(2)
  q = _draw(rng, "q", nested_shape(outer, inner, 0, SHAPES[0]))
  pool = _draw(rng, "k", nested_shape(outer, inner, 1, SHAPES[1]))
  lengths, table = _draw(rng, "lengths", SHAPES[3]), _draw(rng, "page_indices", SHAPES[4])
  fn = lambda q, pool: _paged()(q, pool, pool, lengths, table)
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  jaxpr = check_nested_vmap(fn, (q, pool), outer, inner, close)
  names = [e.primitive.name for e in jaxpr.eqns if "attention" in e.primitive.name]
  assert names == ["paged_attention"]


def test_vmap_axis_size_zero():
  args = _data(np.random.default_rng(3), (0, None, None, 0, 0), size=0)
  out = jax.vmap(_paged(), in_axes=(0, None, None, 0, 0))(*args)
  assert out.shape == (0, B, N, H)
