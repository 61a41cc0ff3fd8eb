"""Argument checks shared by the public op functions.

Errors name the op, the argument and what was seen, and are raised before
anything is bound, so users never see a deep XLA error instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


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


def check_config(op: str, config, cls: type | tuple[type, ...]) -> None:
  """TypeError unless ``config`` is None or a ``cls`` (the op's KernelConfig classes)."""
  if config is not None and not isinstance(config, cls):
    names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
    raise TypeError(f"{op}: config must be a {names}, got {type(config).__name__}")


def check_precision(op: str, precision):
  """``precision`` as ``lax.dot_general`` takes it: None or a pair of ``lax.Precision``."""
  if precision is None:
    return None
  try:
    if isinstance(precision, (str, lax.Precision)):
      return (lax.Precision(precision),) * 2
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
      return tuple(lax.Precision(p) for p in precision)
  except ValueError:
    pass
  raise ValueError(
    f"{op}: precision must be None, a lax.Precision or its name "
    f"({', '.join(p.name.lower() for p in lax.Precision)}), or a pair of them; "
    f"got {precision!r}"
  )


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


def check_positive_float(op: str, name: str, value) -> float:
  """``value`` as a Python float > 0 (a static number, as ``check_static_float``)."""
  value = check_static_float(op, name, value)
  if not value > 0:
    raise ValueError(f"{op}: {name} must be > 0, got {value}")
  return value


def check_floating_alike(op: str, arrays: Mapping[str, jax.Array]) -> None:
  """TypeError unless every one of ``arrays`` (name -> array) is floating, all of one dtype."""
  for name, x in arrays.items():
    check_floating(op, name, x)
  if len({x.dtype for x in arrays.values()}) > 1:
    *names, last = arrays
    got = ", ".join(str(x.dtype) for x in arrays.values())
    raise TypeError(f"{op}: {', '.join(names)} and {last} must have one dtype, got {got}")


def concrete(x) -> Optional[np.ndarray]:
  """``x``'s values when they are known at trace time (not a tracer), else None."""
  return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_concrete_range(
  op: str, name: str, x, low: int, high: Optional[int] = None, *, high_name: str = ""
) -> None:
  """ValueError when ``x``'s values are known and one lies outside ``[low, high]``.

  Traced values (inside ``jit``, ``vmap``, ...) are not checked: the op
  clamps them.

  Args:
    op: the op's name, for the message.
    name: the argument's name.
    x: the argument, an integer array.
    low: the smallest value allowed.
    high: the largest value allowed (None: no upper bound).
    high_name: how the op's arguments give ``high`` (``"pages_per_sequence *
      page_size"``), for the message.
  """
  values = concrete(x)
  if values is None or not values.size:
    return
  lo, hi = values.min(), values.max()
  if lo >= low and (high is None or hi <= high):
    return
  if high is None:
    allowed = f"be >= {low}"
  else:
    allowed = (
      f"lie in [{low}, {high_name}] = [{low}, {high}]" if high_name else f"lie in [{low}, {high}]"
    )
  raise ValueError(f"{op}: {name} must {allowed}, got values from {lo} to {hi}")
