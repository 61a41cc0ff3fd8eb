"""rms_norm: forward, reverse and forward-mode AD against a float64 reference."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import FLOAT_DTYPES, PATHS, as64, assert_close, on_path, rand, to64, x64

# Odd shapes: hidden not a power of two (96, 200, 1000), rows not a multiple of
# any block, extra leading dims, a single row.
SHAPES = [(3, 96), (2, 5, 200), (37, 1000), (1, 7), (2, 3, 4, 128)]


def rms_norm_ref(x, w, eps=1e-6, offset=0.0):
  """Independent float64 reference (plain jnp, float64 throughout)."""
  x = jnp.asarray(x, jnp.float64)
  y = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * (offset + jnp.asarray(w, jnp.float64))


def _inputs(shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return rand(rng, shape, dtype), rand(rng, shape[-1:], dtype, 0.5, 1.0), rng


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(path, dtype, shape):
  x, w, _ = _inputs(shape, dtype)
  with on_path(path):
    y = jax.jit(pallax.rms_norm)(x, w)
    y_off = jax.jit(lambda x, w: pallax.rms_norm(x, w, eps=1e-3, offset=1.0))(x, w)
    y_now = jax.jit(pallax.rms_norm)(x)
  assert y.dtype == dtype and y.shape == shape
  with x64():
    x64_, w64 = as64(x, w)
    assert_close(y, rms_norm_ref(x64_, w64), dtype, "weight")
    assert_close(y_off, rms_norm_ref(x64_, w64, 1e-3, 1.0), dtype, "offset=1")
    assert_close(y_now, rms_norm_ref(x64_, None), dtype, "no weight")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_vjp(path, dtype, shape):
  x, w, rng = _inputs(shape, dtype, seed=1)
  dy = rand(rng, shape, dtype)
  with on_path(path):
    _, vjp = jax.vjp(lambda x, w: pallax.rms_norm(x, w, offset=0.5), x, w)
    dx, dw = jax.jit(vjp)(dy)
  assert dx.dtype == dtype and dw.dtype == dtype
  with x64():
    _, vjp_ref = jax.vjp(lambda x, w: rms_norm_ref(x, w, offset=0.5), *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dweight")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_jvp(path, dtype, shape):
  x, w, rng = _inputs(shape, dtype, seed=2)
  xd, wd = rand(rng, shape, dtype), rand(rng, shape[-1:], dtype)
  with on_path(path):
    y, yd = jax.jit(lambda *a: jax.jvp(pallax.rms_norm, a[:2], a[2:]))(x, w, xd, wd)
  with x64():
    y_ref, yd_ref = jax.jvp(rms_norm_ref, tuple(as64(x, w)), tuple(as64(xd, wd)))
    assert_close(y, y_ref, dtype, "primal")
    assert_close(yd, yd_ref, dtype, "tangent")


@pytest.mark.parametrize("path", PATHS)
def test_jacobians_and_hessian_vector_products(path):
  x, w, rng = _inputs((3, 6), jnp.float32, seed=3)
  c = rand(rng, (3, 6))
  v = (rand(rng, (3, 6)), rand(rng, (6,)))

  def loss(impl):
    return lambda x, w: jnp.sum(jnp.sin(impl(x, w, offset=0.25)) * c)

  ours, ref = loss(pallax.rms_norm), loss(rms_norm_ref)
  with on_path(path):
    jf = jax.jit(jax.jacfwd(pallax.rms_norm, (0, 1)))(x, w)
    jr = jax.jit(jax.jacrev(pallax.rms_norm, (0, 1)))(x, w)
    hvp_fwd = jax.jit(lambda x, w: jax.jvp(jax.grad(ours, (0, 1)), (x, w), v)[1])(x, w)
    hvp_rev = jax.jit(
      jax.grad(
        lambda x, w: sum(jnp.vdot(g, t) for g, t in zip(jax.grad(ours, (0, 1))(x, w), v)), (0, 1)
      )
    )(x, w)
    hess = jax.jit(jax.hessian(ours, 0))(x, w)
  with x64():
    x64_, w64 = as64(x, w)
    v64, c64 = as64(*v), to64(c)
    ref = lambda x, w: jnp.sum(jnp.sin(rms_norm_ref(x, w, offset=0.25)) * c64)
    jac_ref = jax.jacrev(rms_norm_ref, (0, 1))(x64_, w64)
    hvp_ref = jax.jvp(jax.grad(ref, (0, 1)), (x64_, w64), tuple(v64))[1]
    for got in (jf, jr):
      for g, r, name in zip(got, jac_ref, "xw"):
        assert_close(g, r, jnp.float32, f"jacobian wrt {name}")
    for got in (hvp_fwd, hvp_rev):
      for g, r, name in zip(got, hvp_ref, "xw"):
        assert_close(g, r, jnp.float32, f"hvp wrt {name}")
    assert_close(hess, jax.hessian(ref, 0)(x64_, w64), jnp.float32, "hessian")


@pytest.mark.parametrize("path", PATHS)
def test_zero_rows(path):
  x = jnp.zeros((0, 96), jnp.float32)
  w = rand(np.random.default_rng(4), (96,))
  with on_path(path):
    y = jax.jit(pallax.rms_norm)(x, w)
    dx, dw = jax.jit(jax.grad(lambda x, w: pallax.rms_norm(x, w).sum(), (0, 1)))(x, w)
  assert y.shape == (0, 96) and dx.shape == (0, 96)
  np.testing.assert_array_equal(dw, np.zeros(96, np.float32))


def test_eager_matches_jit():
  x, w, _ = _inputs((4, 40), jnp.float32, seed=5)
  np.testing.assert_array_equal(pallax.rms_norm(x, w), jax.jit(pallax.rms_norm)(x, w))


def test_float64_xla_path():
  with x64():
    x, w, _ = _inputs((5, 33), jnp.float64, seed=6)
    y = pallax.rms_norm(x, w)
    assert y.dtype == jnp.float64
    assert_close(y, rms_norm_ref(x, w), jnp.float64, "float64")
    g = jax.grad(lambda x: pallax.rms_norm(x, w).sum() ** 2)(x)
    assert_close(g, jax.grad(lambda x: rms_norm_ref(x, w).sum() ** 2)(x), jnp.float64, "grad")


def test_weight_dtype_differs_from_x():
  x, _, rng = _inputs((6, 64), jnp.bfloat16, seed=7)
  w = rand(rng, (64,), jnp.float32)
  y = pallax.rms_norm(x, w)
  assert y.dtype == jnp.bfloat16
  dw = jax.grad(lambda w: pallax.rms_norm(x, w).astype(jnp.float32).sum())(w)
  assert dw.dtype == jnp.float32
  with x64():
    assert_close(y, rms_norm_ref(*as64(x, w)), jnp.bfloat16, "mixed dtypes")


def test_pinned_config_gives_same_result():
  x, w, _ = _inputs((37, 200), jnp.float32, seed=8)
  with pallax.interpret():
    default = jax.jit(pallax.rms_norm)(x, w)
    pinned = jax.jit(
      lambda x, w: pallax.rms_norm(x, w, config=pallax.NormConfig(block_rows=4, num_warps=2))
    )(x, w)
  np.testing.assert_allclose(pinned, default, rtol=1e-6, atol=1e-6)


def test_interpret_switch_changes_lowering():
  x, w, _ = _inputs((4096, 128), jnp.float32)  # several row blocks: a grid loop
  f = jax.jit(pallax.rms_norm)
  plain = f.lower(x, w).as_text()
  with pallax.interpret():
    interpreted = f.lower(x, w).as_text()
  assert "while" not in plain and "while" in interpreted
  # The switch is part of the jit key: a function compiled outside the block
  # re-lowers inside it.
  f(x, w)
  with pallax.interpret("mosaic_tpu"):
    assert "while" in f.lower(x, w).as_text()


def test_interpret_environment_variable():
  code = (
    "import jax, jax.numpy as jnp, pallax;"
    "print('while' in jax.jit(pallax.rms_norm).lower(jnp.ones((4096, 16))).as_text())"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    env={**__import__("os").environ, "PALLAX_INTERPRET": "1"},
    check=True,
  )
  assert out.stdout.strip().endswith("True"), out.stderr[-2000:]


# ----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
  "kwargs, exc, words",
  [
    (dict(x=jnp.ones((4,), jnp.int32)), TypeError, ["x", "int32"]),
    (dict(x=jnp.ones((4,), bool)), TypeError, ["x", "bool"]),
    (dict(x=jnp.float32(1.0)), ValueError, ["x", "scalar"]),
    (dict(weight=jnp.ones((5,))), ValueError, ["weight", "(5,)", "(2, 4)"]),
    (dict(weight=jnp.ones((1, 4))), ValueError, ["weight", "(1, 4)"]),
    (dict(weight=jnp.ones((4,), jnp.int32)), TypeError, ["weight", "int32"]),
    (dict(eps=-1e-6), ValueError, ["eps", "-1e-06"]),
    (dict(eps=jnp.float32(1e-6)), TypeError, ["eps"]),
    (dict(weight=None, offset=1.0), ValueError, ["offset", "weight"]),
    (dict(config="fast"), TypeError, ["config", "str"]),
  ],
)
def test_bad_input(kwargs, exc, words):
  args = dict(x=jnp.ones((2, 4)), weight=jnp.ones((4,)))
  args.update(kwargs)
  with pytest.raises(exc) as err:
    pallax.rms_norm(args.pop("x"), args.pop("weight"), **args)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


def test_bad_input_inside_jit_and_vmap():
  with pytest.raises(ValueError, match="weight"):
    jax.jit(pallax.rms_norm)(jnp.ones((2, 4)), jnp.ones((3,)))
  with pytest.raises(ValueError, match="weight"):
    jax.vmap(pallax.rms_norm)(jnp.ones((2, 4)), jnp.ones((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_large_hidden_interpreted(path):
  """A realistic size: many row blocks and a 4096-wide hidden dim."""
  x, w, rng = _inputs((1030, 4096), jnp.bfloat16, seed=9)
  dy = rand(rng, x.shape, jnp.bfloat16)
  with on_path(path):
    y, vjp = jax.vjp(pallax.rms_norm, x, w)
    dx, dw = vjp(dy)
  with x64():
    y_ref, vjp_ref = jax.vjp(rms_norm_ref, *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    for got, want, name in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dweight")):
      assert_close(got, want, jnp.bfloat16, name)
