"""pallax.activations: elementwise relative accuracy against float64, tails included.

The references are float64 numpy, computed here from ``math.erfc`` and ``exp``
(not from the module under test). Errors are elementwise and relative,
``|got - want| / |want|``, over a dense grid of z in [-10, 10] plus random
draws, so a tail value computed as ``-0.0`` (the cancelling
``0.5 * z * (1 + erf(z / sqrt(2)))``) fails however small it is.

Tolerances (float32): ``rtol(z) = 1e-6 * (1 + z**2)``, about 8 ulps near 0
growing like the condition number (``z**2`` for exact GELU in the negative
tail: the rounding of ``z * z`` inside ``exp`` alone costs up to
``z**2 * 2**-24``); for exact GELU and its derivative also capped at 1e-5
everywhere. The derivative's error is measured relative to
``|Phi(z)| + |z phi(z)|``, the size of its two terms: the derivative has a
root near z = -0.75, where no float32 evaluation is relatively accurate.
Values whose reference is below float32's smallest normal must be within it
in absolute terms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallax
from pallax import activations
from tests.helpers import CALL_TARGET, lower_text, on_path

TINY = float(np.finfo(np.float32).tiny)
CAP = 1e-5

_erfc = np.vectorize(math.erfc, otypes=[np.float64])


def _points() -> np.ndarray:
  """float32 z: 20001 grid points on [-10, 10], uniform draws, and draws in the negative tail."""
  rng = np.random.default_rng(0)
  grid = np.linspace(-10.0, 10.0, 20001)
  return np.concatenate([grid, rng.uniform(-10, 10, 20000), rng.uniform(-10, -4, 20000)]).astype(
    np.float32
  )


Z = _points()
Z64 = Z.astype(np.float64)


def _phi(z):
  return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _cdf(z):
  return 0.5 * _erfc(-z / math.sqrt(2.0))


def gelu_ref(z):
  return z * _cdf(z)


def gelu_derivative_ref(z):
  """The derivative and the size of its terms (the scale its error is measured against)."""
  return _cdf(z) + z * _phi(z), np.abs(_cdf(z)) + np.abs(z * _phi(z))


def gelu_tanh_ref(z):
  u = math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)
  return 0.5 * z * np.exp(u) / np.cosh(u)  # 1 + tanh(u) = exp(u) / cosh(u), no cancellation


REFS = {
  "relu": lambda z: np.maximum(z, 0.0),
  "gelu": gelu_ref,
  "gelu_tanh": gelu_tanh_ref,
  "silu": lambda z: z / (1.0 + np.exp(-z)),
}


def assert_rel(got, want, z, *, scale=None, cap=None, what=""):
  """Elementwise ``|got - want| <= rtol(z) * scale`` (scale: ``|want|``), see the docstring."""
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  assert np.all(np.isfinite(got)), f"{what}: non-finite values"
  scale = np.abs(want) if scale is None else scale
  rtol = 1e-6 * (1.0 + z * z)
  if cap is not None:
    rtol = np.minimum(rtol, cap)
  err = np.abs(got - want)
  normal = scale >= TINY
  rel = np.where(normal, err / np.where(normal, scale, 1.0), 0.0)
  bad = normal & (rel > rtol) | ~normal & (err > TINY)
  if np.any(bad):
    i = np.flatnonzero(bad)[np.argmax(rel[bad] / rtol[bad])]
    pytest.fail(
      f"{what}: {bad.sum()} of {bad.size} values off; worst at z={z[i]:.6g}: got {got[i]:.8g}, "
      f"want {want[i]:.8g}, relative error {rel[i]:.3g} > {rtol[i]:.3g}"
    )


# The activations on their own ---------------------------------------------------------------


@pytest.mark.parametrize("form", ["xla", "kernel"])
def test_gelu_relative_accuracy(form):
  fn = activations.activate if form == "xla" else activations.activate_in_kernel
  got = jax.jit(lambda z: fn("gelu", z))(jnp.asarray(Z))
  assert got.dtype == jnp.float32
  assert_rel(got, gelu_ref(Z64), Z64, cap=CAP, what=f"gelu ({form})")


def test_gelu_tail_values_from_the_issue():
  z = np.array([-5.71, -5.42, -5.5], np.float32)
  want = gelu_ref(z.astype(np.float64))
  for fn in (activations.activate, activations.activate_in_kernel):
    got = np.asarray(fn("gelu", jnp.asarray(z)), np.float64)
    assert np.all(got < 0), got  # not -0.0
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _erfc_in_kernel(x):
  """erfc over the whole line from the kernels' arithmetic erfc of ``|x|``."""
  ax = lax.abs(x)
  tail = activations.erfc_nonnegative(ax, ax * ax)
  return lax.select(x < 0, 2.0 - tail, tail)


def test_erfc_in_kernel_relative_accuracy():
  # Up to x = 9.1: erfc underflows float32's normal range just beyond.
  draws = np.random.default_rng(1).uniform(0, 9.1, 20000)
  x = np.concatenate([np.linspace(-8.0, 9.1, 20001), draws]).astype(np.float32)
  x64 = x.astype(np.float64)
  got = jax.jit(_erfc_in_kernel)(jnp.asarray(x))
  assert_rel(got, _erfc(x64), np.sqrt(2.0) * x64, cap=CAP, what="erfc_in_kernel")


def test_gelu_derivative_relative_accuracy():
  want, scale = gelu_derivative_ref(Z64)
  got = jax.jit(lambda z: activations.activation_derivative("gelu", z))(jnp.asarray(Z))
  assert got.dtype == jnp.float32
  assert_rel(got, want, Z64, scale=scale, cap=CAP, what="gelu'")


@pytest.mark.parametrize("name", ["relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("form", ["xla", "kernel"])
def test_other_activations(name, form):
  fn = activations.activate if form == "xla" else activations.activate_in_kernel
  got = jax.jit(lambda z: fn(name, z))(jnp.asarray(Z))
  assert_rel(got, REFS[name](Z64), Z64, what=f"{name} ({form})")


def _logistic_derivative_ref(z, v, dv):
  """``d/dz [z * logistic(v(z))]`` and the size of its two terms, in float64."""
  s, one_minus_s = 1.0 / (1.0 + np.exp(-v)), 1.0 / (1.0 + np.exp(v))
  second = z * s * one_minus_s * dv
  return s + second, np.abs(s) + np.abs(second)


def other_derivative_ref(name, z):
  if name == "relu":
    return (z > 0).astype(np.float64), np.ones_like(z)
  if name == "silu":
    return _logistic_derivative_ref(z, z, 1.0)
  c = 2 * math.sqrt(2 / math.pi)  # gelu_tanh = z * logistic(c * (z + 0.044715 z^3))
  return _logistic_derivative_ref(z, c * (z + 0.044715 * z**3), c * (1 + 3 * 0.044715 * z**2))


@pytest.mark.parametrize("name", ["relu", "gelu_tanh", "silu"])
def test_other_derivatives(name):
  want, scale = other_derivative_ref(name, Z64)
  got = jax.jit(lambda z: activations.activation_derivative(name, z))(jnp.asarray(Z))
  assert_rel(got, want, Z64, scale=scale, what=f"{name}'")


def test_identity_and_names():
  z = jnp.linspace(-3.0, 3.0, 7)
  assert activations.activate(None, z) is z
  assert activations.activate_in_kernel(None, z) is z
  np.testing.assert_array_equal(activations.activation_derivative(None, z), jnp.ones_like(z))
  assert activations.ACTIVATIONS == ("relu", "gelu", "gelu_tanh", "silu")


def test_no_jit_in_the_jaxpr():
  """Plain lax/jnp: ``jax.nn``'s jitted functions would put a ``jit`` in every jaxpr."""
  for name in activations.ACTIVATIONS:
    for fn in (activations.activate, activations.activate_in_kernel):
      jaxpr = jax.make_jaxpr(lambda z: fn(name, z))(jnp.ones(3))
      assert all(e.primitive.name not in ("pjit", "jit") for e in jaxpr.eqns), jaxpr
    jaxpr = jax.make_jaxpr(lambda z: activations.activation_derivative(name, z))(jnp.ones(3))
    assert all(e.primitive.name not in ("pjit", "jit") for e in jaxpr.eqns), jaxpr


# End to end through pallax.matmul -------------------------------------------------------------

# a = z as a column and b = ones((1, N)): the pre-activation is z exactly, on every path
# (a K = 1 product, zero-padded K in the kernels).
N = 3
PATHS = ("xla", "triton", "mosaic_tpu")
ZE = Z[::3]  # every third point: the interpreted kernels are slow on a CPU
ZE64 = ZE.astype(np.float64)


def _gelu_matmul(a, b):
  return pallax.matmul(a, b, activation="gelu")


@pytest.mark.parametrize("path", PATHS)
def test_matmul_gelu_forward(path):
  a, b = jnp.asarray(ZE)[:, None], jnp.ones((1, N), jnp.float32)
  with on_path(path):
    y = jax.jit(_gelu_matmul)(a, b)
  assert y.shape == (ZE.size, N) and y.dtype == jnp.float32
  want = gelu_ref(ZE64)
  for j in range(N):
    assert_rel(y[:, j], want, ZE64, cap=CAP, what=f"matmul gelu on {path}, column {j}")


@pytest.mark.parametrize("path", PATHS)
def test_matmul_gelu_grad_and_jvp(path):
  a, b = jnp.asarray(ZE)[:, None], jnp.ones((1, N), jnp.float32)
  # A one-hot cotangent column: d loss / d a_i = gelu'(z_i) * 1, with no rounded sum.
  cot = jnp.zeros((ZE.size, N), jnp.float32).at[:, 1].set(1.0)
  loss = lambda a: jnp.sum(_gelu_matmul(a, b) * cot)
  jvp = lambda a: jax.jvp(lambda a: _gelu_matmul(a, b), (a,), (jnp.ones_like(a),))[1]
  with on_path(path):
    grad = jax.jit(jax.grad(loss))(a)
    y_dot = jax.jit(jvp)(a)
  want, scale = gelu_derivative_ref(ZE64)
  assert_rel(grad[:, 0], want, ZE64, scale=scale, cap=CAP, what=f"grad on {path}")
  for j in range(N):
    assert_rel(y_dot[:, j], want, ZE64, scale=scale, cap=CAP, what=f"jvp on {path}, column {j}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["relu", "gelu_tanh", "silu"])
def test_matmul_other_activations(path, name):
  z = Z[::20]
  a, b = jnp.asarray(z)[:, None], jnp.ones((1, N), jnp.float32)
  with on_path(path):
    y = jax.jit(lambda a, b: pallax.matmul(a, b, activation=name))(a, b)
  z64 = z.astype(np.float64)
  assert_rel(y[:, 0], REFS[name](z64), z64, what=f"matmul {name} on {path}")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", activations.ACTIVATIONS)
def test_kernel_forms_lower(platform, name):
  """``activate_in_kernel`` lowers in the Pallas-Triton and Mosaic TPU matmul epilogues."""
  s = jax.ShapeDtypeStruct
  fn = lambda a, b: pallax.matmul(a, b, activation=name)
  text = lower_text(fn, platform, s((100, 300), jnp.float32), s((300, 200), jnp.float32))
  assert CALL_TARGET[platform] in text
