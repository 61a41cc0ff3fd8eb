"""vmap of dot_product_attention with segment ids and sinks: matches a loop, one primitive.

The operands (query, key, value, q_segment_ids, kv_segment_ids, sinks) may
each be mapped (at axis 0 or 1) or shared: per-example segment ids and
per-example sinks included. Calls are causal with a soft cap, GQA, and a
value head dim unlike the query's. Examples are batched BTNH calls (ids
``(B, T)``) or unbatched TNH ones (ids ``(T,)``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  assert_close,
  assert_tree_close,
  attention_primitives,
  batched,
  loop_stack,
  on_path,
  rand,
  to64,
  x64,
)
from tests.primitives.attention_reference import reference, small_blocks

# One example: B=2, T=12, S=20, N=4 query heads, K=2 kv heads, H=32, Hv=16.
T, S, N, K, H, HV = 12, 20, 4, 2, 32, 16
EXAMPLES = {
  "batched": ((2, T, N, H), (2, S, K, H), (2, S, K, HV), (2, T), (2, S), (N,)),
  "unbatched": ((T, N, H), (S, K, H), (S, K, HV), (T,), (S,), (N,)),
}
NAMES = ("query", "key", "value", "q_seg", "kv_seg", "sinks")
FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))
STATICS = dict(is_causal=True, logits_soft_cap=6.0)


def _draw(rng, name, shape):
  if name.endswith("seg"):  # unsorted ids; some query rows see no key
    return jnp.asarray(rng.integers(0, 3, shape), jnp.int32)
  return rand(rng, shape, scale=2.0 if name in ("query", "sinks") else 1.0)


def _data(rng, in_axes, size, example="batched"):
  return tuple(
    batched(rng, ax, size, shape, functools.partial(_draw, rng, name))
    for name, ax, shape in zip(NAMES, in_axes, EXAMPLES[example])
  )


def _attention(config=None, return_residual=False, fn=None):
  fn = fn or functools.partial(pallax.dot_product_attention, config=config)

  def f(q, k, v, q_seg, kv_seg, sinks):
    return fn(
      q,
      k,
      v,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      sinks=sinks,
      return_residual=return_residual,
      **STATICS,
    )

  return f


# in_axes of (q, k, v, q_seg, kv_seg, sinks).
IN_AXES = [
  (0, 0, 0, 0, 0, 0),
  (None, None, None, None, None, 0),  # per-example sinks only
  (None, None, None, 0, 0, None),  # per-example segment ids only
  (None, None, None, None, 0, None),
  (0, None, None, None, None, None),  # ids and sinks shared
  (1, 0, 0, 1, None, 0),
  (None, 1, 1, None, 1, None),
]

LOOP_CASES = [("batched", ax) for ax in IN_AXES] + [("unbatched", IN_AXES[i]) for i in (0, 1, 5)]


@pytest.mark.parametrize("example, in_axes", LOOP_CASES, ids=str)
def test_vmap_matches_loop(example, in_axes):
  rng = np.random.default_rng(0)
  size = 3
  args = _data(rng, in_axes, size, example)
  f = _attention(return_residual=True)
  vf = jax.vmap(f, in_axes=in_axes)
  got = jax.jit(vf)(*args)
  want = loop_stack(jax.jit(f), args, in_axes, size)
  assert_tree_close(got, want)
  assert attention_primitives(jax.make_jaxpr(vf)(*args).jaxpr, loops=False) == {FWD: 1}


def test_vmap_matches_float64_reference():
  """The loop is pallax too: one vmapped call against the float64 reference."""
  rng = np.random.default_rng(1)
  in_axes = IN_AXES[5]
  args = _data(rng, in_axes, 3)
  got = jax.jit(jax.vmap(_attention(), in_axes=in_axes))(*args)
  with x64():
    f64_args = tuple(
      to64(a) if n in ("query", "key", "value", "sinks") else a for n, a in zip(NAMES, args)
    )
    want = jax.vmap(_attention(fn=reference), in_axes=in_axes)(*f64_args)
  assert_close(got, want, jnp.float32, "vmap")


def _grads(f):
  """Gradients wrt q, k, v and sinks of a loss of ``f``'s output."""

  def g(q, k, v, q_seg, kv_seg, sinks):
    loss = lambda q, k, v, sinks: jnp.sum(jnp.sin(f(q, k, v, q_seg, kv_seg, sinks)))
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)

  return g


GRAD_IN_AXES = [IN_AXES[0], IN_AXES[1], IN_AXES[2], IN_AXES[5]]


@pytest.mark.parametrize("in_axes", GRAD_IN_AXES, ids=str)
def test_vmap_of_grad_matches_loop(in_axes):
  """Per-example gradients: shared sinks get a per-example dsinks."""
  rng = np.random.default_rng(2)
  size = 3
  args = _data(rng, in_axes, size)
  g = _grads(_attention())
  vg = jax.vmap(g, in_axes=in_axes)
  got = jax.jit(vg)(*args)
  assert got[3].shape == (size, N)
  assert_tree_close(got, loop_stack(jax.jit(g), args, in_axes, size))
  assert attention_primitives(jax.make_jaxpr(vg)(*args).jaxpr, loops=False) == {FWD: 1, BWD: 1}


def test_vmap_of_jvp_matches_loop():
  """Tangents of the query and the sinks mapped over shared primals, and mapped primals."""
  rng = np.random.default_rng(3)
  size = 3
  f = _attention()

  def jvp(q, k, v, q_seg, kv_seg, sinks, q_dot, sinks_dot):
    fn = lambda q, sinks: f(q, k, v, q_seg, kv_seg, sinks)
    return jax.jvp(fn, (q, sinks), (q_dot, sinks_dot))

  for in_axes in [(None,) * 6 + (0, 0), (0, None, None, 0, 0, 0, None, 0)]:
    args = _data(rng, in_axes[:6], size)
    shapes = (EXAMPLES["batched"][0], EXAMPLES["batched"][5])
    tangents = tuple(batched(rng, ax, size, s) for ax, s in zip(in_axes[6:], shapes))
    vj = jax.vmap(jvp, in_axes=in_axes)
    all_args = args + tangents
    assert_tree_close(jax.jit(vj)(*all_args), loop_stack(jax.jit(jvp), all_args, in_axes, size))
    assert attention_primitives(jax.make_jaxpr(vj)(*all_args).jaxpr, loops=False) == {
      FWD: 1,
      JVP: 1,
    }


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_vmap_on_kernels(path):
  """Mapped ids and sinks on the interpreted kernels, blocks split."""
  rng = np.random.default_rng(4)
  in_axes, size = IN_AXES[5], 2
  args = _data(rng, in_axes, size)
  f = _attention(small_blocks(path), return_residual=True)
  with on_path(path):
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
    want = loop_stack(jax.jit(f), args, in_axes, size)
  assert_tree_close(got, want)
