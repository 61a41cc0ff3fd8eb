"""Activation functions of the fused epilogues, in an XLA form and a kernel-safe form.

Every op with an activation epilogue (matmul today, MoE matmul later) takes its
maths from here: ``activate`` for the XLA programs and references,
``activate_in_kernel`` inside Pallas kernels, and ``activation_derivative`` for
the JVP rules (computed in XLA on the saved pre-activation).

Why this module exists:

* Tail accuracy. The textbook exact GELU ``0.5 * z * (1 + erf(z / sqrt(2)))``
  cancels catastrophically for negative ``z``: ``1 + erf`` loses all its digits
  and float32 returns ``-0.0`` (or noise) below about ``z = -5`` where the true
  value is ``-3e-8``. Here GELU is ``z * Phi(z)`` with the normal CDF
  ``Phi(z) = erfc(-z / sqrt(2)) / 2``, accurate in relative terms in the lower
  tail (as ``jax.nn.gelu`` does). Its derivative ``Phi(z) + z * phi(z)`` is
  written out the same way. ``gelu_tanh`` likewise uses
  ``(1 + tanh(u)) / 2 = logistic(2 u)`` instead of ``1 + tanh(u)``.
* Lowering. Pallas-Triton has no lowering for ``lax.erf`` or ``lax.erfc`` and
  Mosaic TPU none for ``lax.erfc``, so the kernels use an arithmetic erfc
  (Numerical Recipes' erfcc, relative error below 1.2e-7 for ``x >= 0``),
  built from ``exp``, ``mul``, ``add``, ``div``, ``where`` and ``abs`` only.
* No ``jax.nn``: its functions are jitted, which puts a ``jit`` in every jaxpr.

Accuracy in float32 (measured against float64 over ``z`` in [-10, 10], see
``tests/test_activations.py``): GELU and its derivative to a few 1e-6 relative,
both forms. In the negative tail GELU's condition number is about ``z**2``, so
the rounding of ``z * z`` inside ``exp`` alone costs up to ``z**2 * 2**-24``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")

_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_GELU_TANH_CUBIC = 0.044715

# Numerical Recipes' erfcc (Press et al., 2nd ed., section 6.2): for x >= 0,
# erfc(x) = t * exp(-x^2 + P(t)) with t = 1 / (1 + x / 2) and P below (constant
# term first), fractional error < 1.2e-7 for every x >= 0.
_ERFC_P = (
  -1.26551223,
  1.00002368,
  0.37409196,
  0.09678418,
  -0.18628806,
  0.27886807,
  -1.13520398,
  1.48851587,
  -0.82215223,
  0.17087277,
)


# XLA forms -------------------------------------------------------------------


def relu(z: jax.Array) -> jax.Array:
  """``max(z, 0)``."""
  return lax.select(z > 0, z, lax.full_like(z, 0))


def normal_cdf(z: jax.Array) -> jax.Array:
  """The standard normal CDF ``Phi(z)``, relatively accurate in the lower tail."""
  return 0.5 * lax.erfc(-z * _SQRT_HALF)


def normal_pdf(z: jax.Array) -> jax.Array:
  """The standard normal density ``phi(z) = exp(-z**2 / 2) / sqrt(2 pi)``."""
  return _INV_SQRT_2PI * lax.exp(-0.5 * (z * z))


def gelu(z: jax.Array) -> jax.Array:
  """The exact GELU ``z * Phi(z)``, computed through ``erfc`` (no cancellation for z < 0)."""
  return z * normal_cdf(z)


def gelu_derivative(z: jax.Array) -> jax.Array:
  """``gelu'(z) = Phi(z) + z * phi(z)``, relatively accurate in both tails."""
  return normal_cdf(z) + z * normal_pdf(z)


def gelu_tanh(z: jax.Array) -> jax.Array:
  """The tanh approximation of GELU, ``z * (1 + tanh(u)) / 2`` as ``z * logistic(2 u)``.

  ``u = sqrt(2 / pi) * (z + 0.044715 z**3)``. The logistic form keeps the
  negative tail (where ``1 + tanh(u)`` cancels to zero) accurate.
  """
  u = (2 * _SQRT_2_OVER_PI) * (z + _GELU_TANH_CUBIC * (z * z * z))
  return z * lax.logistic(u)


def silu(z: jax.Array) -> jax.Array:
  """``z * logistic(z)`` (also called swish)."""
  return z * lax.logistic(z)


_XLA_FORMS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "relu": relu,
  "gelu": gelu,
  "gelu_tanh": gelu_tanh,
  "silu": silu,
}


def activate(activation: Optional[str], z: jax.Array) -> jax.Array:
  """The activation ``activation`` (one of ``ACTIVATIONS``; None: identity) of ``z``."""
  return z if activation is None else _XLA_FORMS[activation](z)


def activation_derivative(activation: Optional[str], z: jax.Array) -> jax.Array:
  """The activation's derivative at ``z``, elementwise, in ``z``'s dtype (XLA form).

  GELU's is written out (``Phi(z) + z * phi(z)``); the others are the JVP of
  ``activate``, which is accurate for them.
  """
  if activation is None:
    return jnp.ones_like(z)
  if activation == "gelu":
    return gelu_derivative(z)
  return jax.jvp(functools.partial(activate, activation), (z,), (jnp.ones_like(z),))[1]


# Kernel-safe forms -------------------------------------------------------------


def erfc_nonnegative(x: jax.Array, x_squared: jax.Array) -> jax.Array:
  """Numerical Recipes' erfcc for ``x >= 0``, given ``x_squared = x * x``.

  The caller passes ``x * x`` so that it can compute it with the fewest
  roundings: its absolute error is the relative error of the result.
  """
  t = 1.0 / (1.0 + 0.5 * x)
  p = functools.reduce(lambda acc, c: acc * t + c, _ERFC_P[-2::-1], _ERFC_P[-1])
  return t * lax.exp(p - x_squared)


def _normal_cdf_in_kernel(z: jax.Array) -> jax.Array:
  # exp's argument is -z*z/2: one rounding (z * z) instead of three through z / sqrt(2).
  tail = 0.5 * erfc_nonnegative(lax.abs(z) * _SQRT_HALF, 0.5 * (z * z))  # Phi(-|z|)
  return lax.select(z < 0, tail, 1.0 - tail)


def gelu_in_kernel(z: jax.Array) -> jax.Array:
  """The exact GELU ``z * Phi(z)`` through the arithmetic erfc (kernel-safe)."""
  return z * _normal_cdf_in_kernel(z)


def activate_in_kernel(activation: Optional[str], z: jax.Array) -> jax.Array:
  """``activate`` as the Pallas kernels compute it: exact GELU without ``lax.erfc``."""
  if activation == "gelu":
    return gelu_in_kernel(z)
  return activate(activation, z)
