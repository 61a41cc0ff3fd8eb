"""Argument checks shared by the public op functions.

Errors name the op, the argument and what was seen, and are raised before
anything is bound, so users never see a deep XLA error instead.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp


def check_floating(op: str, name: str, a: jax.Array) -> None:
  """TypeError unless ``a`` has a floating dtype."""
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{op}: {name} must have a floating dtype, got {a.dtype} (shape {a.shape})")


def check_array(op: str, name: str, x) -> jax.Array:
  """``x`` as an array; ValueError for a scalar, TypeError unless floating."""
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError(f"{op}: {name} must have at least 1 dimension, got a scalar (shape ())")
  check_floating(op, name, x)
  return x


def check_config(op: str, config, cls: type) -> None:
  """TypeError unless ``config`` is None or a ``cls`` (the op's KernelConfig)."""
  if config is not None and not isinstance(config, cls):
    raise TypeError(f"{op}: config must be a {cls.__name__}, got {type(config).__name__}")


def check_static_float(op: str, name: str, value, *, minimum: float | None = None) -> float:
  """``value`` as a Python float; it must be a concrete number, not a traced array."""
  if (
    isinstance(value, jax.core.Tracer)
    or not isinstance(value, numbers.Real)
    or isinstance(value, bool)
  ):
    raise TypeError(f"{op}: {name} must be a static Python number, got {type(value).__name__}")
  value = float(value)
  if minimum is not None and not value >= minimum:
    raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
  return value
