"""vmap of matmul: matches a loop over examples and stays one primitive."""

from __future__ import annotations

import functools
import re

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
  lower_text,
  nested_shape,
  on_path,
  rand,
)

M, K, N = 3, 20, 6


def _op(a, b, bias):
  return pallax.matmul(a, b, bias=bias, activation="silu")


# (in_axes of a, b, bias), and one example's a and b shapes.
IN_AXES = [
  (0, None, None),
  (None, 0, None),
  (0, 0, None),
  (None, None, 0),
  (0, None, 0),
  (1, None, None),
  (-1, 0, None),
  (None, 2, 0),
  (0, 0, 0),
]
EXAMPLES = {
  "matrices": ((M, K), (K, N)),
  "vector_a": ((K,), (K, N)),
  "batched_a": ((2, M, K), (K, N)),
  "batched_both": ((2, M, K), (2, K, N)),
}


def _data(rng, in_axes, size, example):
  a_shape, b_shape = EXAMPLES[example]
  return (
    batched(rng, in_axes[0], size, a_shape),
    batched(rng, in_axes[1], size, b_shape),
    batched(rng, in_axes[2], size, (N,)),
  )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
@pytest.mark.parametrize("example", ["matrices", "batched_both"])
def test_vmap_matches_loop(path, in_axes, example):
  rng = np.random.default_rng(0)
  size = 4
  args = _data(rng, in_axes, size, example)
  with on_path(path):
    got = jax.jit(jax.vmap(_op, in_axes=in_axes))(*args)
    want = loop_stack(_op, args, in_axes, size)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", IN_AXES[:5] + IN_AXES[-1:], ids=str)
def test_vmap_of_grad_matches_loop(path, in_axes):
  """Per-example gradients: a shared operand's gradient must stay per example."""
  rng = np.random.default_rng(1)
  size = 3
  args = _data(rng, in_axes, size, "batched_a")
  c = rand(rng, (2, M, N))
  g = jax.grad(lambda a, b, bias: jnp.sum(_op(a, b, bias) * c), (0, 1, 2))
  with on_path(path):
    got = jax.jit(jax.vmap(g, in_axes=in_axes))(*args)
    want = loop_stack(g, args, in_axes, size)
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("in_axes", IN_AXES[:5], ids=str)
def test_grad_of_vmap_sums_over_the_batch(in_axes):
  rng = np.random.default_rng(2)
  size = 3
  args = _data(rng, in_axes, size, "matrices")
  loss = lambda *args: jnp.sum(jax.vmap(_op, in_axes=in_axes)(*args) ** 2)
  loop_loss = lambda *args: sum(jnp.sum(y**2) for y in loop_stack(_op, args, in_axes, size))
  got = jax.jit(jax.grad(loss, (0, 1, 2)))(*args)
  want = jax.grad(loop_loss, (0, 1, 2))(*args)
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("in_axes", IN_AXES[:5], ids=str)
def test_vmap_of_jvp_matches_loop(in_axes):
  rng = np.random.default_rng(3)
  size = 3
  args, tangents = _data(rng, in_axes, size, "matrices"), _data(rng, in_axes, size, "matrices")
  f = lambda a, b, bias, ad, bd, biasd: jax.jvp(_op, (a, b, bias), (ad, bd, biasd))[1]
  got = jax.vmap(f, in_axes=in_axes + in_axes)(*args, *tangents)
  want = loop_stack(f, args + tangents, in_axes + in_axes, size)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_nested_vmap(outer, inner):
  rng = np.random.default_rng(4)
  a = rand(rng, nested_shape(outer, inner, 0, (M, K)))
  b = rand(rng, nested_shape(outer, inner, 1, (K, N)))
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  jaxpr = check_nested_vmap(pallax.matmul, (a, b), outer, inner, close)
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names.count("matmul") == 1 and "broadcast_in_dim" not in names, names


@pytest.mark.parametrize("in_axes", IN_AXES, ids=str)
@pytest.mark.parametrize("mode", ["forward", "grad", "jvp"])
def test_vmap_is_one_primitive(in_axes, mode):
  rng = np.random.default_rng(5)
  args = _data(rng, in_axes, 5, "batched_a")
  if mode == "forward":
    f = _op
  elif mode == "grad":
    f = jax.grad(lambda *args: jnp.sum(_op(*args)), (0, 1, 2))
  else:
    f = lambda *args: jax.jvp(_op, args, args)
  jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args).jaxpr
  names = [e.primitive.name for e in jaxpr.eqns]
  assert not {"while", "scan", "pjit", "jit"} & set(names), names
  # grad: the forward kernel, dA and dB; jvp: the forward kernel and two products.
  assert names.count("matmul") == {"forward": 1, "grad": 3, "jvp": 3}[mode], names


def test_vmapped_vectors_times_shared_weight_are_one_gemm():
  """256 vmapped vectors times a shared (1024, 4096) weight: one [256, 1024] @ [1024, 4096]."""
  vectors = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
  weight = jax.ShapeDtypeStruct((1024, 4096), jnp.float32)
  f = jax.vmap(pallax.matmul, in_axes=(0, None))
  (eqn,) = [
    e for e in jax.make_jaxpr(f)(vectors, weight).jaxpr.eqns if e.primitive.name == "matmul"
  ]
  assert eqn.params["a_batch"] == (True,) and eqn.params["b_batch"] == (False,)
  text = lower_text(f, "cuda", vectors, weight)
  (call,) = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*", text)
  # The kernel sees the folded [256, 1024] matrix and runs a (256/128) x (4096/128) grid.
  assert "tensor<256x1024xf32>, tensor<1024x4096xf32>) -> tensor<256x4096xf32>" in call
  assert "grid_x = 2 : i32, grid_y = 32 : i32, grid_z = 1" in call
  key = pallax.explain(f, vectors, weight)[0].key
  assert "float32[256,1,1024];float32[1024,4096]" in key


def test_vmapped_b_is_a_grid_axis():
  """A vmapped weight with a shared a: one kernel whose grid leads with the batch."""
  a = jax.ShapeDtypeStruct((100, 64), jnp.float32)
  b = jax.ShapeDtypeStruct((5, 64, 300), jnp.float32)
  f = jax.vmap(pallax.matmul, in_axes=(None, 0))
  text = lower_text(f, "cuda", a, b)
  (call,) = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*", text)
  assert "tensor<100x64xf32>, tensor<5x64x300xf32>) -> tensor<5x100x300xf32>" in call
  assert "grid_x = 5 : i32, grid_y = 1 : i32, grid_z = 3" in call  # (batch, M/128, N/128)


def test_vmapped_a_with_batched_shared_b_folds_into_m():
  """a mapped, b shared but batched: the vmapped axis still folds into M."""
  a = jax.ShapeDtypeStruct((64, 2, 1, 32), jnp.float32)  # 64 examples of (2, 1, 32)
  b = jax.ShapeDtypeStruct((2, 32, 128), jnp.float32)
  f = jax.vmap(pallax.matmul, in_axes=(0, None))
  text = lower_text(f, "cuda", a, b)
  (call,) = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\(.*", text)
  assert "tensor<2x64x32xf32>, tensor<2x32x128xf32>) -> tensor<2x64x128xf32>" in call


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("in_axes", [(0, None, None), (None, 0, None), (0, 0, 0)], ids=str)
def test_vmap_axis_size_zero(path, in_axes):
  args = [
    jnp.zeros((0,) * (ax is not None) + shape) for ax, shape in zip(in_axes, ((M, K), (K, N), (N,)))
  ]
  with on_path(path):
    y = jax.jit(jax.vmap(_op, in_axes=in_axes))(*args)
  assert y.shape == (0, M, N)


def test_vmap_with_config_selects_from_the_folded_shapes():
  rng = np.random.default_rng(6)
  vectors, weight = rand(rng, (64, K)), rand(rng, (K, N))
  ex = pallax.Executor(cache_dir=False)
  with pallax.interpret():
    f = pallax.vmap_with_config(ex, pallax.matmul, in_axes=(0, None))
    got = f(vectors, weight)
    (eqn,) = [
      e for e in jax.make_jaxpr(f)(vectors, weight).jaxpr.eqns if e.primitive.name == "matmul"
    ]
    folded = pallax.explain(jax.vmap(pallax.matmul, in_axes=(0, None)), vectors, weight)[0]
  assert eqn.params["config"] == folded.config and folded.config.block_m == 64  # M = 64
  np.testing.assert_allclose(got, vectors @ weight, rtol=1e-5, atol=1e-5)
