"""layer_norm and fused_add_rms_norm against float64 references (rms_norm: test_norm.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.kernels.norm import xla as norm_xla
from tests.helpers import FLOAT_DTYPES, PATHS, assert_close, on_path, rand, to64, x64

SHAPES = [(3, 96), (2, 5, 200), (37, 1000), (1, 7)]


def layer_norm_ref(x, w=None, b=None, eps=1e-5):
  """Independent float64 reference."""
  mu = jnp.mean(x, axis=-1, keepdims=True)
  y = (x - mu) / jnp.sqrt(jnp.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)
  y = y if w is None else y * w
  return y if b is None else y + b


def add_rms_ref(x, r, w=None, eps=1e-6, offset=0.0):
  h = x + r
  y = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  return (y if w is None else y * (offset + w)), h


@dataclasses.dataclass(frozen=True)
class Case:
  fn: Callable
  ref: Callable
  args: tuple[str, ...]


CASES = {
  "layer_norm": Case(
    lambda x, w, b: pallax.layer_norm(x, w, b, eps=1e-4),
    lambda x, w, b: layer_norm_ref(x, w, b, eps=1e-4),
    ("x", "w", "b"),
  ),
  "fused_add_rms_norm": Case(
    lambda x, r, w: pallax.fused_add_rms_norm(x, r, w, offset=0.5),
    lambda x, r, w: add_rms_ref(x, r, w, offset=0.5),
    ("x", "r", "w"),
  ),
}


def _args(case, shape, dtype, seed):
  rng = np.random.default_rng(seed)
  make = {
    "x": lambda: rand(rng, shape, dtype, shift=0.3),
    "r": lambda: rand(rng, shape, dtype),
    "w": lambda: rand(rng, shape[-1:], dtype, 0.5, 1.0),
    "b": lambda: rand(rng, shape[-1:], dtype, 0.5),
  }
  return tuple(make[n]() for n in case.args), rng


def _close_trees(got, want, dtype, what):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    assert g.shape == w.shape
    assert_close(g, w, dtype, f"{what}[{i}]")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(CASES))
def test_forward_and_vjp(op, path, dtype, shape):
  case = CASES[op]
  args, rng = _args(case, shape, dtype, seed=0)
  with on_path(path):
    out, vjp = jax.vjp(case.fn, *args)
    cts = jax.tree.map(lambda o: rand(rng, o.shape, o.dtype), out)
    grads = jax.jit(vjp)(cts)
  assert all(o.dtype == dtype for o in jax.tree.leaves(out))
  with x64():
    want, vjp_ref = jax.vjp(case.ref, *map(to64, args))
    _close_trees(out, want, dtype, "output")
    _close_trees(grads, vjp_ref(jax.tree.map(to64, cts)), dtype, "gradient")


@pytest.mark.parametrize("form", ["small", "large"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", list(CASES))
def test_both_forms_of_the_xla_programs(op, dtype, form, monkeypatch):
  """The XLA programs pick their forms by size (``CACHE_SIZED_ELEMENTS``); both are right."""
  monkeypatch.setattr(norm_xla, "CACHE_SIZED_ELEMENTS", 1 << 62 if form == "small" else 0)
  jax.clear_caches()  # programs traced under the other form must not be reused
  case = CASES[op]
  args, rng = _args(case, (2, 5, 200), dtype, seed=5)
  out, vjp = jax.vjp(case.fn, *args)
  cts = jax.tree.map(lambda o: rand(rng, o.shape, o.dtype), out)
  grads = jax.jit(vjp)(cts)
  jax.clear_caches()
  with x64():
    want, vjp_ref = jax.vjp(case.ref, *map(to64, args))
    _close_trees(out, want, dtype, "output")
    _close_trees(grads, vjp_ref(jax.tree.map(to64, cts)), dtype, "gradient")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", list(CASES))
def test_jvp(op, path, dtype):
  case = CASES[op]
  args, rng = _args(case, (5, 200), dtype, seed=1)
  tangents = tuple(rand(rng, a.shape, dtype) for a in args)
  with on_path(path):
    out, out_dot = jax.jit(lambda p, t: jax.jvp(case.fn, p, t))(args, tangents)
  with x64():
    want, want_dot = jax.jvp(case.ref, tuple(map(to64, args)), tuple(map(to64, tangents)))
    _close_trees(out, want, dtype, "primal")
    _close_trees(out_dot, want_dot, dtype, "tangent")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", list(CASES))
def test_hessian_vector_products(op, path):
  case = CASES[op]
  args, rng = _args(case, (3, 6), jnp.float32, seed=2)
  cs = jax.tree.map(lambda o: rand(rng, o.shape), case.fn(*args))
  v = tuple(rand(rng, a.shape) for a in args)
  argnums = tuple(range(len(args)))

  def loss(fn, cs):
    return lambda *a: sum(
      jnp.sum(jnp.sin(o) * c) for o, c in zip(jax.tree.leaves(fn(*a)), jax.tree.leaves(cs))
    )

  with on_path(path):
    fwd_over_rev = jax.jit(lambda *a: jax.jvp(jax.grad(loss(case.fn, cs), argnums), a, v)[1])(*args)
    rev_over_rev = jax.jit(
      jax.grad(
        lambda *a: sum(jnp.vdot(g, t) for g, t in zip(jax.grad(loss(case.fn, cs), argnums)(*a), v)),
        argnums,
      )
    )(*args)
    jac = jax.jit(jax.jacfwd(case.fn, argnums))(*args)
  with x64():
    args64, v64, cs64 = map(to64, args), tuple(map(to64, v)), jax.tree.map(to64, cs)
    want = jax.jvp(jax.grad(loss(case.ref, cs64), argnums), tuple(args64), v64)[1]
    _close_trees(fwd_over_rev, want, jnp.float32, "forward-over-reverse")
    _close_trees(rev_over_rev, want, jnp.float32, "reverse-over-reverse")
    _close_trees(jac, jax.jacrev(case.ref, argnums)(*map(to64, args)), jnp.float32, "jacobian")


@pytest.mark.parametrize("path", PATHS)
def test_layer_norm_without_weight_or_bias(path):
  (x, w, b), _ = _args(CASES["layer_norm"], (7, 40), jnp.float32, seed=3)
  with on_path(path):
    got = [pallax.layer_norm(x), pallax.layer_norm(x, w), pallax.layer_norm(x, bias=b)]
    g = jax.grad(lambda x, b: jnp.sum(pallax.layer_norm(x, bias=b) ** 3), (0, 1))(x, b)
  with x64():
    x64_, w64, b64 = map(to64, (x, w, b))
    for out, want in zip(
      got, [layer_norm_ref(x64_), layer_norm_ref(x64_, w64), layer_norm_ref(x64_, None, b64)]
    ):
      assert_close(out, want, jnp.float32, "layer_norm variant")
    want = jax.grad(lambda x, b: jnp.sum(layer_norm_ref(x, None, b) ** 3), (0, 1))(x64_, b64)
    _close_trees(g, want, jnp.float32, "grad")


def test_layer_norm_mixed_weight_and_bias_dtypes():
  (x, w, b), _ = _args(CASES["layer_norm"], (4, 16), jnp.bfloat16, seed=4)
  b32 = b.astype(jnp.float32)
  y = pallax.layer_norm(x, w, b32)
  assert y.dtype == jnp.bfloat16
  dw, db = jax.grad(lambda w, b: pallax.layer_norm(x, w, b).astype(jnp.float32).sum(), (0, 1))(
    w, b32
  )
  assert (dw.dtype, db.dtype) == (jnp.bfloat16, jnp.float32)


def test_fused_add_rms_norm_matches_unfused_and_promotes():
  (x, r, w), _ = _args(CASES["fused_add_rms_norm"], (6, 64), jnp.float32, seed=5)
  y, h = pallax.fused_add_rms_norm(x, r, w)
  np.testing.assert_array_equal(h, x + r)
  np.testing.assert_allclose(y, pallax.rms_norm(x + r, w), rtol=1e-6, atol=1e-6)
  y16, h16 = pallax.fused_add_rms_norm(x.astype(jnp.bfloat16), r)
  assert y16.dtype == h16.dtype == jnp.float32  # promoted like x + residual

  # The gradient through both outputs is one backward kernel.
  def loss(x, r, w):
    y, h = pallax.fused_add_rms_norm(x, r, w)
    return jnp.sum(jnp.sin(y)) + jnp.sum(h**2)

  names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, r, w).eqns]
  assert names.count("fused_add_rms_norm_fwd") == 1 and names.count("fused_add_rms_norm_bwd") == 1
  g = jax.grad(loss, (0, 1, 2))(x, r, w)
  with x64():
    want = jax.grad(
      lambda x, r, w: (
        jnp.sum(jnp.sin(add_rms_ref(x, r, w)[0])) + jnp.sum(add_rms_ref(x, r, w)[1] ** 2)
      ),
      (0, 1, 2),
    )(*map(to64, (x, r, w)))
    _close_trees(g, want, jnp.float32, "grad through both outputs")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", list(CASES))
def test_zero_rows(op, path):
  case = CASES[op]
  args, _ = _args(case, (0, 24), jnp.float32, seed=6)
  with on_path(path):
    out = jax.jit(case.fn)(*args)
    grads = jax.grad(
      lambda *a: sum(jnp.sum(o) for o in jax.tree.leaves(case.fn(*a))), tuple(range(len(args)))
    )(*args)
  assert all(o.shape == (0, 24) for o in jax.tree.leaves(out))
  for a, g in zip(args, grads):
    assert g.shape == a.shape
    if a.ndim == 1:
      np.testing.assert_array_equal(g, np.zeros(a.shape, np.float32))


@pytest.mark.parametrize(
  "call, exc, words",
  [
    (
      lambda: pallax.layer_norm(jnp.ones((2, 4), jnp.int32)),
      TypeError,
      ["layer_norm", "x", "int32"],
    ),
    (lambda: pallax.layer_norm(jnp.ones((2, 4)), jnp.ones(3)), ValueError, ["weight", "(3,)"]),
    (lambda: pallax.layer_norm(jnp.ones((2, 4)), None, jnp.ones((4, 1))), ValueError, ["bias"]),
    (lambda: pallax.layer_norm(jnp.ones((2, 4)), eps=-1.0), ValueError, ["eps"]),
    (lambda: pallax.layer_norm(jnp.float32(1)), ValueError, ["scalar"]),
    (
      lambda: pallax.fused_add_rms_norm(jnp.ones((2, 4)), jnp.ones((2, 5))),
      ValueError,
      ["residual", "(2, 5)", "(2, 4)"],
    ),
    (
      lambda: pallax.fused_add_rms_norm(jnp.ones((2, 4)), jnp.ones((2, 4), bool)),
      TypeError,
      ["residual", "bool"],
    ),
    (
      lambda: pallax.fused_add_rms_norm(jnp.ones((2, 4)), jnp.ones((2, 4)), offset=1.0),
      ValueError,
      ["offset", "weight"],
    ),
  ],
)
def test_bad_input(call, exc, words):
  with pytest.raises(exc) as err:
    call()
  for word in words:
    assert word in str(err.value), (word, str(err.value))
