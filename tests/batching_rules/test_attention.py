"""vmap of dot_product_attention: matches a loop over examples and stays one primitive.

The operands are (query, key, value, bias, mask, query_seq_lengths,
key_value_seq_lengths); any of them may be mapped (at axis 0 or 1) or shared,
per-example masks, lengths and biases included, in nested vmaps too. Examples
are batched BTNH calls or unbatched TNH ones (treated as B = 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  NESTED_IN_AXES,
  as64,
  assert_close,
  assert_tree_close,
  attention_primitives,
  batched,
  check_nested_vmap,
  loop_stack,
  nested_shape,
  on_path,
  rand,
  x64,
)
from tests.primitives.attention_reference import reference, small_blocks

# One example's operand shapes: batched (B=2, T=12, S=20, N=4, K=2, H=32) and unbatched.
T, S, N, K, H = 12, 20, 4, 2, 32
EXAMPLES = {
  "batched": (
    (2, T, N, H),
    (2, S, K, H),
    (2, S, K, H),
    (2, N, T, S),
    (2, 1, T, S),
    (2,),
    (2,),
  ),
  "unbatched": ((T, N, H), (S, K, H), (S, K, H), (N, T, S), (T, S), (1,), (1,)),
}
NAMES = ("query", "key", "value", "bias", "mask", "q_len", "kv_len")
FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))


def _draw(rng, name, shape):
  if name == "mask":
    return jnp.asarray(rng.random(shape) < 0.7)
  if name == "q_len":
    return jnp.asarray(rng.integers(1, T + 1, shape), jnp.int32)
  if name == "kv_len":
    return jnp.asarray(rng.integers(0, S + 1, shape), jnp.int32)  # 0: no key at all
  return rand(rng, shape)


def _data(rng, in_axes, size, example="batched"):
  return tuple(
    batched(rng, ax, size, shape, functools.partial(_draw, rng, name))
    for name, ax, shape in zip(NAMES, in_axes, EXAMPLES[example])
  )


def _attention(config=None, return_residual=False, is_causal=True, window=None):
  def f(q, k, v, bias, mask, q_len, kv_len):
    return pallax.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      is_causal=is_causal,
      local_window_size=window,
      return_residual=return_residual,
      config=config,
    )

  return f


# in_axes of (q, k, v, bias, mask, q_len, kv_len).
IN_AXES = [
  (0, 0, 0, 0, 0, 0, 0),
  (0, None, None, None, None, None, None),
  (None, 0, 0, None, None, None, None),
  (None, 0, None, None, None, None, None),
  (None, None, None, 0, None, None, None),
  (None, None, None, None, 0, None, None),
  (None, None, None, None, None, 0, 0),
  (None, None, None, None, None, None, 0),
  (1, None, None, None, 0, None, None),
  (0, 1, 1, 1, None, 0, None),
  (None, None, 1, None, 1, 1, 0),
  (1, 0, None, 0, 1, None, 1),
]


# Every in_axes on batched examples; a few on unbatched (TNH) ones.
LOOP_CASES = [("batched", ax) for ax in IN_AXES] + [
  ("unbatched", IN_AXES[i]) for i in (0, 1, 6, 10)
]


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
  """The loop is pallax too: one vmapped call also against the float64 reference."""
  rng = np.random.default_rng(1)
  in_axes = IN_AXES[-1]
  args = _data(rng, in_axes, 3)
  got = jax.jit(jax.vmap(_attention(window=(3, 2)), in_axes=in_axes))(*args)
  with x64():
    ref = lambda q, k, v, bias, mask, q_len, kv_len: reference(
      q,
      k,
      v,
      bias,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      is_causal=True,
      local_window_size=(3, 2),
    )
    want = jax.vmap(ref, in_axes=in_axes)(*as64(*args[:4]), *args[4:])
    assert_close(got, want, jnp.float32, "vmap")


# Interpreted kernels (the XLA path is above): a few in_axes, blocks split.
PATH_IN_AXES = [IN_AXES[0], IN_AXES[9]]


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("in_axes", PATH_IN_AXES, ids=str)
def test_vmap_on_kernels(path, in_axes):
  rng = np.random.default_rng(2)
  size = 2
  args = _data(rng, in_axes, size)
  f = _attention(small_blocks(path), return_residual=True)
  with on_path(path):
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
    want = loop_stack(jax.jit(f), args, in_axes, size)
  assert_tree_close(got, want)


GRAD_IN_AXES = [IN_AXES[0], IN_AXES[1], IN_AXES[4], IN_AXES[9]]


def _grads(f):
  """Gradients wrt q, k, v and bias of a loss of ``f``'s output."""

  def g(q, k, v, bias, *rest):
    loss = lambda q, k, v, bias: jnp.sum(jnp.sin(f(q, k, v, bias, *rest)))
    return jax.grad(loss, (0, 1, 2, 3))(q, k, v, bias)

  return g


@pytest.mark.parametrize("in_axes", GRAD_IN_AXES, ids=str)
def test_vmap_of_grad_matches_loop(in_axes):
  """Per-example gradients: a shared operand's gradient stays per example."""
  rng = np.random.default_rng(3)
  size = 3
  args = _data(rng, in_axes, size)
  g = _grads(_attention())
  vg = jax.vmap(g, in_axes=in_axes)
  assert_tree_close(jax.jit(vg)(*args), loop_stack(jax.jit(g), args, in_axes, size))
  assert attention_primitives(jax.make_jaxpr(vg)(*args).jaxpr, loops=False) == {FWD: 1, BWD: 1}


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_vmap_of_grad_on_kernels(path):
  rng = np.random.default_rng(4)
  in_axes = IN_AXES[9]
  args = _data(rng, in_axes, 2)
  g = _grads(_attention(small_blocks(path)))
  with on_path(path):
    got = jax.jit(jax.vmap(g, in_axes=in_axes))(*args)
    want = loop_stack(jax.jit(g), args, in_axes, 2)
  assert_tree_close(got, want)


# (q, k, v, bias, mask, q_len, kv_len, q_dot, k_dot, v_dot, bias_dot): jacfwd
# maps the tangents over shared primals.
JVP_IN_AXES = [
  (None,) * 7 + (0, 0, 0, 0),
  (None,) * 7 + (0, None, None, None),
  (0,) * 7 + (0, 0, 0, 0),
  (None, 0, 0, None, 0, None, 0) + (None, 0, None, 1),
]


@pytest.mark.parametrize("in_axes", JVP_IN_AXES, ids=str)
def test_vmap_of_jvp_matches_loop(in_axes):
  rng = np.random.default_rng(5)
  size = 3
  args = _data(rng, in_axes[:7], size)
  shapes = EXAMPLES["batched"][:4]
  tangents = tuple(batched(rng, ax, size, s) for ax, s in zip(in_axes[7:], shapes))
  f = _attention()

  def jvp(q, k, v, bias, mask, q_len, kv_len, *tangents):
    fn = lambda q, k, v, bias: f(q, k, v, bias, mask, q_len, kv_len)
    return jax.jvp(fn, (q, k, v, bias), tangents)

  vj = jax.vmap(jvp, in_axes=in_axes)
  all_args = args + tangents
  assert_tree_close(jax.jit(vj)(*all_args), loop_stack(jax.jit(jvp), all_args, in_axes, size))
  assert attention_primitives(jax.make_jaxpr(vj)(*all_args).jaxpr, loops=False) == {FWD: 1, JVP: 1}


def test_jacfwd_under_vmap_is_one_kernel_each_way():
  """Per-example jacfwd (along 3 directions of q and bias): one forward, one tangent kernel."""
  rng = np.random.default_rng(6)
  args = _data(rng, IN_AXES[0], 2)
  dq, dbias = rand(rng, (3,) + EXAMPLES["batched"][0]), rand(rng, (3,) + EXAMPLES["batched"][3])
  f = _attention()

  def per_example(q, k, v, bias, mask, q_len, kv_len):
    along = lambda a: f(
      q + jnp.tensordot(a, dq, 1), k, v, bias + jnp.tensordot(a, dbias, 1), mask, q_len, kv_len
    )
    return jax.jacfwd(along)(jnp.zeros(3))

  vf = jax.vmap(per_example)
  assert_tree_close(jax.jit(vf)(*args), loop_stack(jax.jit(per_example), args, (0,) * 7, 2))
  assert attention_primitives(jax.make_jaxpr(vf)(*args).jaxpr, loops=False) == {FWD: 1, JVP: 1}


# Nested vmaps over two operands; the others are shared.
def _nested_fn(which: str):
  rng = np.random.default_rng(7)
  shared = _data(rng, (None,) * 7, 1)
  f = _attention()
  if which == "q-mask":
    return lambda q, mask: f(q, *shared[1:4], mask, *shared[5:]), (0, 4)
  if which == "kv-bias":
    return lambda kv, bias: f(shared[0], kv, kv, bias, *shared[4:]), (1, 3)
  return lambda q, kv_len: f(q, *shared[1:6], kv_len), (0, 6)


# Every (outer, inner) pair for (q, mask); three for the other operand pairs.
NESTED_CASES = [("q-mask", o, i) for o, i in NESTED_IN_AXES] + [
  (which, *NESTED_IN_AXES[j]) for which in ("kv-bias", "q-kv_len") for j in (1, 5, 8)
]


@pytest.mark.parametrize("which, outer, inner", NESTED_CASES, ids=str)
def test_nested_vmap(outer, inner, which):
  rng = np.random.default_rng(8)
  fn, operands = _nested_fn(which)
  args = tuple(
    _draw(rng, NAMES[i], nested_shape(outer, inner, j, EXAMPLES["batched"][i]))
    for j, i in enumerate(operands)
  )
  close = lambda got, want: assert_tree_close(got, want)
  jaxpr = check_nested_vmap(fn, args, outer, inner, close)
  assert attention_primitives(jaxpr, loops=False) == {FWD: 1}
