"""examples/swiglu.py's raw Triton kernels under Triton's interpreter, against float64.

Run by ``test_interpreted.py`` in a process with ``TRITON_INTERPRET=1``: every
call pins a ``"triton_raw"`` ``SwigluConfig``, so the forward and backward
kernels of the example (a user's ``pallax.custom_op``) run on the CPU through
Triton's interpreter, which starts outputs as NaN: an element a kernel leaves
unwritten fails the comparison. Shapes are tiny and odd: rows and columns
that the blocks (4 x 16) do not divide.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.helpers import (
  as64,
  assert_close,
  check_nested_vmap,
  loop_stack,
  mesh_4x2,
  primitive_names,
  rand,
  x64,
)

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples.swiglu import SwigluConfig, swiglu  # noqa: E402

DTYPES = (jnp.float32, jnp.bfloat16)
RAW = SwigluConfig(block_rows=4, block_cols=16, num_warps=2)
SHAPES = [(13, 40), (2, 5, 24), (1, 7)]


def swiglu64(x, y):
  """The SwiGLU epilogue in float64 (plain jnp)."""
  x, y = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
  return x / (1.0 + jnp.exp(-x)) * y


def raw(x, y):
  return swiglu(x, y, config=RAW)


def _inputs(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  return rand(rng, shape, dtype), rand(rng, shape, dtype), rng


def test_the_raw_kernels_run():
  x, y, _ = _inputs((5, 8), jnp.float32, 0)
  text = jax.jit(raw).lower(x, y).as_text()
  assert "callback" in text  # Triton's interpreter, called back from XLA
  grad = jax.jit(jax.grad(lambda x, y: jnp.sum(raw(x, y) ** 2), (0, 1))).lower(x, y).as_text()
  assert grad.count("callback") == 2  # the forward and the backward kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(shape, dtype):
  x, y, _ = _inputs(shape, dtype, 1)
  out = jax.jit(raw)(x, y)
  assert out.shape == shape and out.dtype == dtype
  with x64():
    assert_close(out, swiglu64(*as64(x, y)), dtype, "forward")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grad_and_jvp(shape, dtype):
  x, y, rng = _inputs(shape, dtype, 2)
  g, tx, ty = (rand(rng, shape, dtype) for _ in range(3))
  _, vjp = jax.vjp(raw, x, y)
  dx, dy = jax.jit(vjp)(g)
  _, tangent = jax.jit(lambda *a: jax.jvp(raw, a[:2], a[2:]))(x, y, tx, ty)
  assert dx.dtype == dy.dtype == tangent.dtype == dtype
  with x64():
    _, vjp64 = jax.vjp(swiglu64, *as64(x, y))
    dx64, dy64 = vjp64(*as64(g))
    _, t64 = jax.jvp(swiglu64, tuple(as64(x, y)), tuple(as64(tx, ty)))
    assert_close(dx, dx64, dtype, "dx")
    assert_close(dy, dy64, dtype, "dy")
    assert_close(tangent, t64, dtype, "jvp")


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, 0)], ids=str)
def test_vmap_is_one_kernel(in_axes):
  rng = np.random.default_rng(3)
  size, per = 3, (5, 24)
  args = [
    rand(rng, per) if ax is None else jnp.moveaxis(rand(rng, (size, *per)), 0, ax) for ax in in_axes
  ]
  f = jax.vmap(raw, in_axes=in_axes)
  got = jax.jit(f)(*args)
  with x64():
    want = loop_stack(swiglu64, as64(*args), in_axes, size)
  assert_close(got, want, jnp.float32, "vmap")
  assert primitive_names(jax.make_jaxpr(f)(*args)).count("swiglu_fwd") == 1
  g = rand(rng, got.shape)
  _, vjp = jax.vjp(f, *args)
  grads = jax.jit(vjp)(g)
  with x64():
    _, vjp64 = jax.vjp(lambda *a: loop_stack(swiglu64, a, in_axes, size), *as64(*args))
    for got_g, want_g in zip(grads, vjp64(*as64(g))):
      assert_close(got_g, want_g, jnp.float32, "vmap of grad")


def test_nested_vmap():
  rng = np.random.default_rng(4)
  outer, inner = (0, None), (None, 0)
  args = [rand(rng, (2, 5, 8)), rand(rng, (3, 5, 8))]

  def close(got, want):
    with x64():
      assert_close(got, want, jnp.float32, "nested vmap")

  jaxpr = check_nested_vmap(raw, args, outer, inner, close)
  assert primitive_names(jaxpr).count("swiglu_fwd") == 1


@pytest.mark.parametrize("spec", [P("a"), P(None, None, "b")], ids=str)
def test_sharded(spec):
  """Sharded over the 4 x 2 mesh, each device runs the kernels on its shard.

  Under ``shard_map`` in a ``jit``: in a ``jit`` partitioned by XLA, JAX
  drops the host callbacks the interpreter runs in (jax-ml/jax#23620), and
  pallax raises (``test_partitioned_jit_raises``). The main process checks
  the partitioned ``jit`` of the same op on its XLA program
  (``tests/test_custom_op.py``).
  """
  mesh = mesh_4x2()
  x, y, rng = _inputs((8, 3, 24), jnp.float32, 5)
  c = rand(rng, x.shape)

  def fn(x, y, c):
    out, vjp = jax.vjp(raw, x, y)
    return (out, *vjp(c))

  sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  out, dx, dy = sharded(put(x), put(y), put(c))
  assert out.sharding.is_equivalent_to(put(x).sharding, out.ndim)
  with x64():
    _, vjp64 = jax.vjp(swiglu64, *as64(x, y))
    dx64, dy64 = vjp64(*as64(c))
    assert_close(out, swiglu64(*as64(x, y)), jnp.float32, "forward")
    assert_close(dx, dx64, jnp.float32, "dx")
    assert_close(dy, dy64, jnp.float32, "dy")


def test_partitioned_jit_raises():
  """A ``jit`` that XLA partitions would drop the interpreter's callbacks: a clear error instead."""
  mesh = mesh_4x2()
  x, y, _ = _inputs((8, 24), jnp.float32, 6)
  xs = jax.device_put(x, NamedSharding(mesh, P("a")))
  with pytest.raises(Exception, match="jax-ml/jax#23620"):
    jax.jit(raw)(xs, xs)
