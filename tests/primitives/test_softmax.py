"""softmax / log_softmax forward: float64 reference, jax.nn semantics, bad input.

Every numeric test runs on the XLA path and on both interpreted kernels with
the configs the executor picks (one column block per row at these sizes) and,
on the kernels, with pinned configs whose column blocks split every row
(ragged in rows and columns): the online reduction. AD is in test_softmax_ad.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import FLOAT_DTYPES, PATHS, assert_close, on_path, rand, x64
from tests.primitives.softmax_reference import (
  CONFIGS,
  OPS,
  assert_matches,
  config_id,
  pallax_op,
  random_mask,
  reference,
  reference_op,
)

# Odd shapes: rows not a power of two (96, 200, 1000), row counts not a
# multiple of any block, extra leading dims, a single short row.
SHAPES = [(3, 96), (2, 5, 200), (37, 1000), (1, 7)]
# The multi-block configs only where they split the rows (>= 128 columns).
FORWARD_CASES = [
  (pc, shape) for pc in CONFIGS for shape in SHAPES if pc[1] is None or shape[-1] >= 128
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
  "pc, shape", FORWARD_CASES, ids=[f"{config_id(pc)}-{shape}" for pc, shape in FORWARD_CASES]
)
def test_forward(pc, shape, dtype):
  path, config = pc
  rng = np.random.default_rng(0)
  x, mask = rand(rng, shape, dtype, scale=3.0), random_mask(rng, shape)
  with on_path(path):
    outs = jax.jit(
      lambda x, m: [pallax_op(op, config)(x, where=w) for op in OPS for w in (None, m)]
    )(x, mask)
  with x64():
    wants = [reference(x, where=w, op=op) for op in OPS for w in (None, mask)]
  for got, want, what in zip(
    outs, wants, ["softmax", "softmax where", "log_softmax", "log_softmax where"]
  ):
    assert got.dtype == dtype and got.shape == shape
    assert_matches(got, want, dtype, what)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("axis", [0, (-3, 2), None, ()], ids=str)
def test_axis(path, axis):
  """Any axis or axes, with a mask that broadcasts (some groups fully masked)."""
  rng = np.random.default_rng(4)
  shape = (6, 5, 40)
  x, dy = rand(rng, shape, scale=2.0), rand(rng, shape)
  mask = jnp.asarray(rng.random(shape[-1]) < 0.8)
  with on_path(path):
    outs = jax.jit(
      lambda x, dy: (
        [jax.vjp(lambda x: pallax_op(op)(x, axis, mask), x)[0] for op in OPS]
        + [jax.vjp(lambda x: pallax_op(op)(x, axis, mask), x)[1](dy)[0] for op in OPS]
      )
    )(x, dy)
  with x64():
    x64_, dy64 = x.astype(jnp.float64), dy.astype(jnp.float64)
    wants = [reference(x64_, axis, mask, op=op) for op in OPS] + [
      jax.vjp(lambda x: reference(x, axis, mask, op=op), x64_)[1](dy64)[0] for op in OPS
    ]
  for got, want, what in zip(
    outs, wants, ["softmax", "log_softmax", "dx softmax", "dx log_softmax"]
  ):
    assert_matches(got, want, jnp.float32, f"{what}, axis={axis}")


def _special_rows(rng, cols=300):
  """Rows of 1e4 magnitudes, of -inf entries, only -inf, a +inf, and ordinary rows."""
  x = 3 * rng.standard_normal((9, cols))
  x[0] *= 1e4 / 3
  x[1, ::3] = -np.inf
  x[2] = -np.inf
  x[3, 5] = np.inf
  x[4, :-1] = -np.inf  # one finite entry, in the last column block
  x[5] += 1e4
  mask = rng.random((9, cols)) < 0.7
  mask[6] = False  # fully masked
  mask[7, :] = False
  mask[7, cols - 1] = True  # one kept entry, in the last column block
  return jnp.asarray(x, jnp.float32), jnp.asarray(mask)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("pc", CONFIGS, ids=config_id)
def test_special_values_match_jax_nn(pc, op):
  """Large magnitudes, -inf and +inf entries and fully masked rows, as jax.nn does them.

  Outputs and gradients are NaN exactly where jax.nn's are (rows of only -inf,
  or holding a +inf, at their unmasked entries) and close to them elsewhere;
  fully masked rows are 0 (softmax) or -inf (log_softmax) with zero gradients.
  """
  path, config = pc
  rng = np.random.default_rng(5)
  x, mask = _special_rows(rng)
  c = rand(rng, x.shape)
  ours, theirs = pallax_op(op, config), getattr(jax.nn, op)

  def value_and_grad(f, where):
    finite = lambda x: jnp.where(jnp.isfinite(f(x, where=where)), f(x, where=where), 0)
    return f(x, where=where), jax.grad(lambda x: jnp.sum(finite(x) * c))(x)

  for where in (None, mask):
    with on_path(path):
      got = jax.jit(lambda x: value_and_grad(ours, where))(x)
    want = value_and_grad(theirs, where)
    for g, w, what in zip(got, want, ("output", "gradient")):
      g, w = np.asarray(g), np.asarray(w)
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{what}: NaN entries")
      np.testing.assert_array_equal(np.isinf(g), np.isinf(w), err_msg=f"{what}: inf entries")
      finite = np.isfinite(w)
      np.testing.assert_allclose(
        g[finite], w[finite], rtol=1e-5, atol=1e-5 * np.abs(w[finite]).max(), err_msg=what
      )


@pytest.mark.parametrize("pc", CONFIGS, ids=config_id)
def test_large_magnitudes_against_float64(pc):
  path, config = pc
  rng = np.random.default_rng(6)
  x = rand(rng, (8, 300), scale=1e4)
  dy = rand(rng, x.shape)
  with on_path(path):
    got = jax.jit(
      lambda x: (
        [pallax_op(op, config)(x) for op in OPS]
        + [jax.vjp(pallax_op(op, config), x)[1](dy)[0] for op in OPS]
      )
    )(x)
  with x64():
    x64_, dy64 = x.astype(jnp.float64), dy.astype(jnp.float64)
    want = [reference(x64_, op=op) for op in OPS] + [
      jax.vjp(reference_op(op), x64_)[1](dy64)[0] for op in OPS
    ]
  for g, w, what in zip(got, want, ["softmax", "log_softmax", "dx softmax", "dx log_softmax"]):
    assert_close(g, w, jnp.float32, what)


@pytest.mark.parametrize("path", PATHS)
def test_zero_size(path):
  for shape, axis in (((0, 96), -1), ((4, 0), -1), ((3, 0, 5), 1)):
    x = jnp.zeros(shape, jnp.float32)
    with on_path(path):
      outs = jax.jit(
        lambda x: (
          [f(x, axis) for f in map(pallax_op, OPS)]
          + [jax.grad(lambda x: jnp.sum(f(x, axis)))(x) for f in map(pallax_op, OPS)]
        )
      )(x)
    assert [o.shape for o in outs] == [shape] * 4


def test_eager_matches_jit():
  x = rand(np.random.default_rng(7), (4, 40))
  for op in OPS:
    np.testing.assert_array_equal(getattr(pallax, op)(x), jax.jit(getattr(pallax, op))(x))


def test_float64_xla_path():
  with x64():
    x = rand(np.random.default_rng(8), (5, 33), jnp.float64)
    for op in OPS:
      y = getattr(pallax, op)(x)
      assert y.dtype == jnp.float64
      assert_close(y, reference(x, op=op), jnp.float64, op)
      g = jax.grad(lambda x: jnp.sum(getattr(pallax, op)(x) * x))(x)
      assert_close(
        g, jax.grad(lambda x: jnp.sum(reference(x, op=op) * x))(x), jnp.float64, f"grad {op}"
      )


def test_scalar_with_axis_none():
  for op in OPS:
    y = getattr(pallax, op)(jnp.float32(3.0), axis=None)
    np.testing.assert_array_equal(y, getattr(jax.nn, op)(jnp.float32(3.0), axis=None))


def test_interpret_switch_changes_lowering():
  x = rand(np.random.default_rng(9), (64, 128))
  f = jax.jit(pallax.softmax)
  assert "while" not in f.lower(x).as_text()
  f(x)
  with pallax.interpret("mosaic_tpu"):
    assert "while" in f.lower(x).as_text()


# ----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
  "kwargs, exc, words",
  [
    (dict(x=jnp.ones((4,), jnp.int32)), TypeError, ["x", "int32"]),
    (dict(x=jnp.ones((4,), bool)), TypeError, ["x", "bool"]),
    (dict(x=jnp.float32(1.0)), ValueError, ["axis", "-1", "()"]),
    (dict(axis=2), ValueError, ["axis", "2", "(2, 4)"]),
    (dict(axis=-3), ValueError, ["axis", "-3"]),
    (dict(axis=(0, -2)), ValueError, ["axis", "repeats"]),
    (dict(axis=1.0), TypeError, ["axis", "float"]),
    (dict(axis=True), TypeError, ["axis", "True"]),
    (dict(axis=(0, "1")), TypeError, ["axis"]),
    (dict(where=jnp.ones((2, 4), jnp.int32)), TypeError, ["where", "int32"]),
    (dict(where=jnp.ones((3,), bool)), ValueError, ["where", "(3,)", "(2, 4)"]),
    (dict(where=jnp.ones((2, 2, 4), bool)), ValueError, ["where", "(2, 2, 4)"]),
    (dict(config="fast"), TypeError, ["config", "str"]),
    (dict(config=pallax.NormConfig(block_rows=8)), TypeError, ["config", "NormConfig"]),
  ],
)
def test_bad_input(op, kwargs, exc, words):
  args = dict(x=jnp.ones((2, 4)))
  args.update(kwargs)
  with pytest.raises(exc) as err:
    getattr(pallax, op)(args.pop("x"), **args)
  for word in [op] + words:
    assert word in str(err.value), (word, str(err.value))


def test_bad_input_inside_jit_and_vmap():
  with pytest.raises(ValueError, match="where"):
    jax.jit(lambda x, m: pallax.softmax(x, where=m))(jnp.ones((2, 4)), jnp.ones((3,), bool))
  with pytest.raises(ValueError, match="axis"):
    jax.vmap(lambda x: pallax.log_softmax(x, axis=1))(jnp.ones((2, 4)))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_long_rows_with_default_config(path):
  """Rows longer than the widest default block (8192): the heuristic's online path."""
  rng = np.random.default_rng(10)
  x = rand(rng, (20, 20000), jnp.bfloat16, scale=3.0)
  mask, dy = random_mask(rng, x.shape), rand(rng, x.shape, jnp.bfloat16)
  for op in OPS:
    with on_path(path):
      y, vjp = jax.vjp(lambda x: getattr(pallax, op)(x, where=mask), x)
      (dx,) = vjp(dy)
    with x64():
      y_ref, vjp_ref = jax.vjp(lambda x: reference(x, where=mask, op=op), x.astype(jnp.float64))
      assert_matches(y, y_ref, jnp.bfloat16, op)
      assert_close(dx, vjp_ref(dy.astype(jnp.float64))[0], jnp.bfloat16, f"dx {op}")
