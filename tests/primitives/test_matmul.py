"""matmul: forward, reverse and forward-mode AD against a float64 reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallax
from tests.helpers import (
  FLOAT_DTYPES,
  PATHS,
  as64,
  assert_close,
  lower_text,
  on_path,
  rand,
  to64,
  x64,
)

# (a shape, b shape, bias?, activation): M = 1 and 7, K = 33 (not a multiple of
# any block), N = 200, batched a with a shared b (folded into M), batch dims on
# both, a shared a, broadcast batch dims, vectors.
CASES = [
  ((1, 33), (33, 200), True, "gelu"),
  ((7, 33), (33, 200), True, "relu"),
  ((37, 96), (96, 40), False, None),
  ((2, 5, 33), (33, 200), True, "silu"),
  ((2, 5, 33), (2, 33, 17), True, "gelu_tanh"),
  ((5, 16), (3, 16, 24), False, "gelu"),
  ((33,), (33, 200), True, None),
  ((2, 1, 7, 20), (3, 20, 9), True, "relu"),
  ((7, 33), (33,), False, "silu"),
]
CASE_IDS = [f"{a}@{b}{'+bias' if bias else ''}-{act}" for a, b, bias, act in CASES]
# Fewer cases for the 16-bit dtypes, whose interpreted runs cost the same.
SHORT = [0, 3, 4]
FORWARD = [(c, jnp.float32) for c in range(len(CASES))] + [
  (c, d) for c in SHORT for d in FLOAT_DTYPES[1:]
]
FORWARD_IDS = [f"{CASE_IDS[c]}-{jnp.dtype(d).name}" for c, d in FORWARD]


def _act_ref(activation, z):
  """Activations from their textbook formulas."""
  if activation is None:
    return z
  if activation == "relu":
    return jnp.where(z > 0, z, 0.0)
  if activation == "gelu":
    return 0.5 * z * (1 + jax.scipy.special.erf(z / np.sqrt(2.0)))
  if activation == "gelu_tanh":
    return 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
  return z / (1 + jnp.exp(-z))


def matmul_ref(a, b, bias=None, activation=None):
  """Independent float64 reference (jnp in float64 throughout; call under ``x64()``)."""
  z = jnp.matmul(
    jnp.asarray(a, jnp.float64), jnp.asarray(b, jnp.float64), precision=lax.Precision.HIGHEST
  )
  if bias is not None:
    z = z + jnp.asarray(bias, jnp.float64)
  return _act_ref(activation, z)


def _inputs(case, dtype, seed=0):
  a_shape, b_shape, with_bias, activation = CASES[case]
  rng = np.random.default_rng(seed)
  a = rand(rng, a_shape, dtype)
  b = rand(rng, b_shape, dtype, scale=1 / np.sqrt(b_shape[0 if len(b_shape) == 1 else -2]))
  bias = rand(rng, b_shape[-1:], dtype) if with_bias else None
  return a, b, bias, activation, rng


def _op(activation):
  return lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation=activation)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case, dtype", FORWARD, ids=FORWARD_IDS)
def test_forward(path, case, dtype):
  a, b, bias, activation, _ = _inputs(case, dtype)
  with on_path(path):
    y = jax.jit(_op(activation))(a, b, bias)
  want_shape = jnp.matmul(a, b).shape
  assert y.shape == want_shape and y.dtype == dtype
  with x64():
    want = jax.jit(functools.partial(matmul_ref, activation=activation))(*as64(a, b, bias))
    assert_close(y, want, dtype, "forward")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case, dtype", FORWARD, ids=FORWARD_IDS)
def test_vjp(path, case, dtype):
  a, b, bias, activation, rng = _inputs(case, dtype, seed=1)
  primals = (a, b) if bias is None else (a, b, bias)
  ours = lambda *args: _op(activation)(*args[:2], *args[2:] or [None])
  ct = rand(rng, jax.eval_shape(ours, *primals).shape, dtype)
  with on_path(path):
    grads = jax.jit(_vjp(ours))(primals, ct)
  for g, p in zip(grads, primals):
    assert g.dtype == p.dtype and g.shape == p.shape
  with x64():
    ref = lambda *args: matmul_ref(*args[:2], *args[2:] or [None], activation)
    want = jax.jit(_vjp(ref))(tuple(as64(*primals)), *as64(ct))
    for g, w, name in zip(grads, want, ("da", "db", "dbias")):
      assert_close(g, w, dtype, name)


def _vjp(fn):
  """``(primals, cotangent) -> gradients`` of ``fn``."""
  return lambda primals, ct: jax.vjp(fn, *primals)[1](ct)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
  "case, dtype",
  [(c, d) for c in SHORT for d in FLOAT_DTYPES],
  ids=[f"{CASE_IDS[c]}-{jnp.dtype(d).name}" for c in SHORT for d in FLOAT_DTYPES],
)
def test_jvp(path, case, dtype):
  a, b, bias, activation, rng = _inputs(case, dtype, seed=2)
  primals = (a, b, bias)
  tangents = tuple(rand(rng, x.shape, dtype) for x in primals)
  with on_path(path):
    y, y_dot = jax.jit(lambda p, t: jax.jvp(_op(activation), p, t))(primals, tangents)
  with x64():
    ref = lambda a, b, bias: matmul_ref(a, b, bias, activation)
    y_ref, y_dot_ref = jax.jit(lambda p, t: jax.jvp(ref, p, t))(
      tuple(as64(*primals)), tuple(as64(*tangents))
    )
    assert_close(y, y_ref, dtype, "primal")
    assert_close(y_dot, y_dot_ref, dtype, "tangent")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_jacobians_and_hessian_vector_products(path, activation):
  # A batched a and a shared b: dB contracts the batch dim, and second order
  # differentiates and transposes that product too.
  rng = np.random.default_rng(3)
  a, b, bias, c = rand(rng, (2, 3, 5)), rand(rng, (5, 4)), rand(rng, (4,)), rand(rng, (2, 3, 4))
  v = (rand(rng, (2, 3, 5)), rand(rng, (5, 4)), rand(rng, (4,)))
  op = _op(activation)
  loss = lambda a, b, bias: jnp.sum(jnp.sin(op(a, b, bias)) * c)
  args = (0, 1, 2)
  with on_path(path):
    jf = jax.jit(jax.jacfwd(op, args))(a, b, bias)
    jr = jax.jit(jax.jacrev(op, args))(a, b, bias)
    hvp_fwd = jax.jit(lambda *p: jax.jvp(jax.grad(loss, args), p, v)[1])(a, b, bias)
    hvp_rev = jax.jit(
      jax.grad(lambda *p: sum(jnp.vdot(g, t) for g, t in zip(jax.grad(loss, args)(*p), v)), args)
    )(a, b, bias)
    hess = jax.jit(jax.hessian(loss, 1))(a, b, bias)
  with x64():
    p64, v64, c64 = as64(a, b, bias), as64(*v), to64(c)
    ref = lambda a, b, bias: matmul_ref(a, b, bias, activation)
    ref_loss = lambda a, b, bias: jnp.sum(jnp.sin(ref(a, b, bias)) * c64)
    jac_ref = jax.jacrev(ref, args)(*p64)
    hvp_ref = jax.jvp(jax.grad(ref_loss, args), tuple(p64), tuple(v64))[1]
    for got in (jf, jr):
      for g, r, name in zip(got, jac_ref, ("a", "b", "bias")):
        assert_close(g, r, jnp.float32, f"jacobian wrt {name}")
    for got in (hvp_fwd, hvp_rev):
      for g, r, name in zip(got, hvp_ref, ("a", "b", "bias")):
        assert_close(g, r, jnp.float32, f"hvp wrt {name}")
    assert_close(hess, jax.hessian(ref_loss, 1)(*p64), jnp.float32, "hessian wrt b")


def _eqns(fn, *args):
  return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "matmul"]


def test_grad_is_one_forward_and_two_backward_products():
  """The activation's derivative uses the saved pre-activation: the product is not recomputed."""
  rng = np.random.default_rng(4)
  a, b, bias = rand(rng, (8, 16)), rand(rng, (16, 24)), rand(rng, (24,))
  loss = lambda a, b, bias: jnp.sum(pallax.matmul(a, b, bias=bias, activation="gelu"))
  eqns = _eqns(jax.grad(loss, (0, 1, 2)), a, b, bias)
  assert len(eqns) == 3, eqns
  forward, *backward = eqns
  assert forward.params["save_preactivation"] and forward.params["activation"] == "gelu"
  assert len(forward.invars) == 3  # the bias is fused into the forward kernel
  flags = sorted((e.params["transpose_a"], e.params["transpose_b"]) for e in backward)
  assert flags == [(False, True), (True, False)]  # dA = dC @ B^T, dB = A^T @ dC
  for e in backward:
    assert e.params["activation"] is None and len(e.invars) == 2
  # Without grad nothing is saved.
  (plain,) = _eqns(lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="gelu"), a, b, bias)
  assert not plain.params["save_preactivation"] and len(plain.outvars) == 1


def test_shared_weight_gradient_is_one_product():
  """dB for a batched a and a shared b contracts over batch and M in one GEMM."""
  rng = np.random.default_rng(5)
  a, b = rand(rng, (3, 4, 16)), rand(rng, (16, 8))
  grad = jax.grad(lambda b: jnp.sum(pallax.matmul(a, b) ** 2))
  (db,) = [e for e in _eqns(grad, b) if e.params["transpose_a"]]
  assert db.params["contract_batch"] == 1
  assert [v.aval.shape for v in db.invars] == [(3, 4, 16), (3, 4, 8)]
  assert db.outvars[0].aval.shape == (16, 8)  # no per-example gradients to sum
  text = lower_text(grad, "cuda", b)
  assert "tensor<12x16xf32>, tensor<12x8xf32>) -> tensor<16x8xf32>" in text


@pytest.mark.parametrize("path", PATHS)
def test_preferred_element_type_and_mixed_dtypes(path):
  rng = np.random.default_rng(6)
  a, b, bias = (
    rand(rng, (7, 33), jnp.bfloat16),
    rand(rng, (33, 20), jnp.bfloat16),
    rand(rng, (20,), jnp.float32),
  )
  with on_path(path):
    # bfloat16 inputs, float32 result: float32 accuracy on the rounded inputs.
    y = pallax.matmul(a, b, bias=bias, activation="silu", preferred_element_type=jnp.float32)
    grads = jax.grad(
      lambda a, b, bias: jnp.sum(
        pallax.matmul(a, b, bias=bias, preferred_element_type=jnp.float32) ** 2
      ),
      (0, 1, 2),
    )(a, b, bias)
    # Mixed inputs promote like jnp.matmul.
    mixed = pallax.matmul(a, b.astype(jnp.float32))
    # A narrower result than the inputs.
    narrow = pallax.matmul(
      a.astype(jnp.float32), b.astype(jnp.float32), preferred_element_type=jnp.bfloat16
    )
  assert y.dtype == jnp.float32 and mixed.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
  with x64():
    a64, b64, bias64 = as64(a, b, bias)
    assert_close(y, matmul_ref(a64, b64, bias64, "silu"), jnp.float32, "preferred float32")
    assert_close(mixed, matmul_ref(a64, b64), jnp.float32, "mixed dtypes")
    assert_close(narrow, matmul_ref(a64, b64), jnp.bfloat16, "bfloat16 result")
    want = jax.grad(lambda a, b, bias: jnp.sum(matmul_ref(a, b, bias) ** 2), (0, 1, 2))(
      a64, b64, bias64
    )
    for g, w, name in zip(grads, want, ("da", "db", "dbias")):
      assert_close(g, w, jnp.bfloat16, name)


@pytest.mark.parametrize(
  "a_shape, b_shape",
  [
    ((3,), (3,)),
    ((3,), (3, 4)),
    ((2, 3), (3,)),
    ((5, 2, 3), (3,)),
    ((3,), (5, 3, 4)),
    ((1, 2, 3), (4, 3, 5)),
    ((4, 1, 2, 3), (5, 3, 6)),
    ((2, 3), (0, 3, 4)),
    ((0, 3), (3, 2)),
  ],
  ids=str,
)
def test_shapes_and_dtypes_follow_jnp_matmul(a_shape, b_shape):
  rng = np.random.default_rng(7)
  for da, db in (
    (jnp.float32, jnp.float32),
    (jnp.bfloat16, jnp.float16),
    (jnp.float16, jnp.float32),
  ):
    a, b = rand(rng, a_shape, da), rand(rng, b_shape, db)
    got, want = pallax.matmul(a, b), jnp.matmul(a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    with x64():
      assert_close(got, matmul_ref(*as64(a, b)), got.dtype, f"{da}@{db}")


@pytest.mark.parametrize(
  "precision", ["highest", lax.Precision.HIGHEST, ("highest", "highest")], ids=str
)
def test_precision_reaches_the_xla_program(precision):
  a, b = jnp.ones((4, 8)), jnp.ones((8, 3))
  # Lowered for the CPU, whose path is the XLA program (a GPU's is the kernel).
  text = lower_text(functools.partial(pallax.matmul, precision=precision), "cpu", a, b)
  assert "HIGHEST, HIGHEST" in text
  with jax.default_matmul_precision("default"):  # the GPU/TPU test runs set "highest"
    assert "DEFAULT, DEFAULT" in lower_text(pallax.matmul, "cpu", a, b)


@pytest.mark.parametrize("path", PATHS)
def test_zero_sizes(path):
  rng = np.random.default_rng(8)
  bias = rand(rng, (5,))
  with on_path(path):
    # K = 0: the product is zero, the epilogue still applies.
    y = pallax.matmul(jnp.zeros((3, 0)), jnp.zeros((0, 5)), bias=bias, activation="relu")
    db = jax.grad(
      lambda bias: jnp.sum(pallax.matmul(jnp.zeros((3, 0)), jnp.zeros((0, 5)), bias=bias))
    )(bias)
    empty_m = pallax.matmul(jnp.zeros((0, 4)), rand(rng, (4, 5)), bias=bias)
    empty_n = jax.grad(lambda a: jnp.sum(pallax.matmul(a, jnp.zeros((4, 0)))))(rand(rng, (3, 4)))
  np.testing.assert_allclose(y, np.broadcast_to(np.maximum(bias, 0), (3, 5)))
  np.testing.assert_allclose(db, np.full(5, 3.0))
  assert empty_m.shape == (0, 5)
  np.testing.assert_array_equal(empty_n, np.zeros((3, 4)))


def test_eager_matches_jit():
  a, b, bias, activation, _ = _inputs(3, jnp.float32, seed=9)
  op = _op(activation)
  np.testing.assert_array_equal(op(a, b, bias), jax.jit(op)(a, b, bias))


def test_float64_xla_path():
  with x64():
    a, b, bias, activation, _ = _inputs(1, jnp.float64, seed=10)
    op = lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="gelu")
    ref = lambda a, b, bias: matmul_ref(a, b, bias, "gelu")
    y = op(a, b, bias)
    assert y.dtype == jnp.float64
    assert_close(y, ref(a, b, bias), jnp.float64, "float64")
    g = jax.grad(lambda *p: jnp.sum(op(*p) ** 2), (0, 1, 2))(a, b, bias)
    g_ref = jax.grad(lambda *p: jnp.sum(ref(*p) ** 2), (0, 1, 2))(a, b, bias)
    for got, want in zip(g, g_ref):
      assert_close(got, want, jnp.float64, "grad")


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_pinned_config_with_tails_in_every_dim(path):
  """Blocks smaller than M and N, K not a multiple of block_k, and K < block_k."""
  rng = np.random.default_rng(11)
  a, b, bias = rand(rng, (37, 300)), rand(rng, (300, 200)), rand(rng, (200,))
  small = (
    pallax.MatmulConfig(block_m=16, block_n=64, block_k=32)
    if path == "triton"
    else pallax.MatmulConfig(block_m=128, block_n=128, block_k=128)
  )
  deep = dataclasses.replace(small, block_k=512)  # one K step, larger than K
  with x64():
    want = matmul_ref(*as64(a, b, bias), "gelu")
  with on_path(path):
    for config in (small, deep):
      y = jax.jit(
        lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="gelu", config=config)
      )(a, b, bias)
      with x64():
        assert_close(y, want, jnp.float32, str(config))


# ----------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
  "kwargs, exc, words",
  [
    (dict(a=jnp.ones((2, 4), jnp.int32)), TypeError, ["a", "int32"]),
    (dict(b=jnp.ones((4, 3), bool)), TypeError, ["b", "bool"]),
    (dict(a=jnp.float32(1.0)), ValueError, ["a", "scalar"]),
    (dict(b=jnp.ones((5, 3))), ValueError, ["a", "b", "(2, 4)", "(5, 3)"]),
    (dict(b=jnp.ones((5,))), ValueError, ["length", "(5,)"]),
    (dict(a=jnp.ones((2, 2, 4)), b=jnp.ones((3, 4, 3))), ValueError, ["batch", "(2,)", "(3,)"]),
    (dict(bias=jnp.ones((4,))), ValueError, ["bias", "(3,)", "(4,)"]),
    (dict(bias=jnp.ones((1, 3))), ValueError, ["bias", "(1, 3)"]),
    (dict(bias=jnp.ones((3,), jnp.int32)), TypeError, ["bias", "int32"]),
    (dict(b=jnp.ones((4,)), bias=jnp.ones((1,))), ValueError, ["bias", "(4,)"]),
    (dict(activation="tanh"), ValueError, ["activation", "'tanh'", "gelu_tanh"]),
    (dict(preferred_element_type=jnp.int32), TypeError, ["preferred_element_type", "int32"]),
    (dict(precision="bogus"), ValueError, ["precision", "'bogus'"]),
    (dict(config="fast"), TypeError, ["config", "str"]),
    (dict(config=pallax.NormConfig(block_rows=8)), TypeError, ["MatmulConfig"]),
  ],
)
def test_bad_input(kwargs, exc, words):
  args = dict(a=jnp.ones((2, 4)), b=jnp.ones((4, 3)))
  args.update(kwargs)
  with pytest.raises(exc) as err:
    pallax.matmul(args.pop("a"), args.pop("b"), **args)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


def test_bad_input_inside_jit_and_vmap():
  with pytest.raises(ValueError, match="b of shape"):
    jax.jit(pallax.matmul)(jnp.ones((2, 4)), jnp.ones((3, 5)))
  with pytest.raises(ValueError, match="bias"):
    jax.vmap(lambda a, bias: pallax.matmul(a, jnp.ones((4, 3)), bias=bias))(
      jnp.ones((2, 4)), jnp.ones((2, 5))
    )


def test_transpose_of_epilogue_is_refused():
  b, bias = jnp.ones((4, 3)), jnp.ones((3,))
  with pytest.raises(NotImplementedError, match="not linear"):
    jax.linear_transpose(lambda a: pallax.matmul(a, b, bias=bias), jnp.ones((2, 4)))(
      jnp.ones((2, 3))
    )
