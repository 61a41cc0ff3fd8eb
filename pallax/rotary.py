"""Rotary position embeddings: ``pallax.apply_rotary``, one primitive.

Each pair of features ``(a, b)`` of a token's head is rotated by the angle
``position * inv_freq[i]``: ``(a cos - b sin, b cos + a sin)``. Pairs are
``(i, i + d/2)`` in the half-rotation form (Llama, GPT-NeoX) and ``(2i, 2i +
1)`` in the interleaved one (GPT-J), over the first ``rotary_dim`` features
(the rest pass through), with ``inv_freq[i] = theta ** (-2 i / rotary_dim)``
and optional frequency scaling (Llama 3's, or linear position scaling).

* ``apply_rotary (x, positions) -> (y,)``, ``x (L, N, H)`` and ``positions
  (L,)``: one elementwise XLA program on every platform (XLA fuses it into a
  single pass over ``x``; a Pallas kernel would save nothing). The rotation
  is linear in ``x``: its tangent is the same rotation of the tangent (the
  op's default, ``jax.jvp`` of the program), so ``grad`` is the inverse
  rotation (JAX transposes it), and ``jvp``,
  ``vmap`` (folded into ``L``) and sharding (tokens and heads shard) work as
  for any pallax op.

It lives in ``pallax/`` rather than ``primitives/``: an op without kernels
has no kernel family (self-check, verify sweep) to register.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallax import validation
from pallax.custom_op import custom_op

__all__ = ["apply_rotary"]

_OP = "apply_rotary"
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inverse_frequencies(rotary_dim: int, theta: float, scaling) -> jax.Array:
  """``(rotary_dim // 2,)`` float32: each pair's angle a position, scaled."""
  inv = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
  if scaling is None:
    return inv
  kind, values = scaling[0], dict(scaling[1])
  if kind == "linear":
    return inv / values["factor"]
  # Llama 3: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between.
  factor, low, high, original = (values[k] for k in _LLAMA3)
  wavelength = 2 * math.pi / inv
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * inv / factor + smooth * inv
  return jnp.where(
    wavelength > original / low, inv / factor, jnp.where(wavelength < original / high, inv, blended)
  )


def rotary_reference(x, positions, *, theta: float, rotary_dim: int, interleaved: bool, scaling):
  """The XLA program: ``x (L, N, H)`` rotated at ``positions (L,)``, in float32 then x's dtype."""
  angle = positions.astype(jnp.float32)[:, None] * inverse_frequencies(rotary_dim, theta, scaling)
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]  # (L, 1, d/2)
  rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
  if interleaved:
    a, b = rot[..., 0::2], rot[..., 1::2]
    y = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
  else:
    a, b = jnp.split(rot, 2, axis=-1)
    y = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
  return jnp.concatenate([y.astype(x.dtype), rest], axis=-1)


apply_rotary_op = custom_op(
  _OP,
  reference=rotary_reference,
  dims="l n h, l -> l n h",
  replicated=("h",),
)
apply_rotary_p = apply_rotary_op.primitive


def _scaling(scaling: Optional[Mapping[str, Any]]):
  """``scaling`` as a hashable ``(kind, ((name, value), ...))`` param; None passes through."""
  if scaling is None:
    return None
  if not isinstance(scaling, Mapping):
    raise TypeError(f"{_OP}: scaling must be a dict or None, got {type(scaling).__name__}")
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "default":  # transformers' name for no scaling
    return None
  need = {"llama3": _LLAMA3, "linear": ("factor",)}.get(kind)
  if need is None:
    raise ValueError(
      f"{_OP}: scaling's rope_type must be 'llama3', 'linear' or 'default', got {kind!r} "
      f"({dict(scaling)})"
    )
  missing = [k for k in need if k not in scaling]
  if missing:
    raise ValueError(f"{_OP}: {kind} scaling needs {list(need)}; missing {missing}")
  values = tuple(
    (k, validation.check_positive_float(_OP, f"scaling[{k!r}]", scaling[k])) for k in need
  )
  if kind == "llama3" and not dict(values)["high_freq_factor"] > dict(values)["low_freq_factor"]:
    raise ValueError(f"{_OP}: llama3 scaling needs high_freq_factor > low_freq_factor")
  return kind, values


def apply_rotary(
  x: jax.Array,
  positions: jax.Array,
  *,
  theta: float = 10000.0,
  rotary_dim: Optional[int] = None,
  interleaved: bool = False,
  scaling: Optional[Mapping[str, Any]] = None,
) -> jax.Array:
  """Rotary position embeddings of queries or keys at each token's position.

  Args:
    x: ``(..., N, H)``, floating: heads last, any leading dims (batch,
      tokens).
    positions: integer, broadcastable to ``x.shape[:-2]``: each token's
      position (per token: packed sequences and decode offsets work).
    theta: the frequencies' base.
    rotary_dim: the leading features rotated (even, at most ``H``); None:
      all ``H``. The rest pass through (partial rotary, as GPT-NeoX and Phi).
    interleaved: pairs ``(2i, 2i + 1)`` (GPT-J) instead of ``(i, i + d/2)``
      (Llama, GPT-NeoX).
    scaling: None, or as transformers' ``rope_scaling``: ``{"rope_type":
      "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}`` or ``{"rope_type": "linear",
      "factor"}`` (positions divided by ``factor``).

  Returns:
    ``x``'s shape and dtype; the angles and products in float32.
  """
  x = jnp.asarray(x)
  positions = jnp.asarray(positions)
  if x.ndim < 2:
    raise ValueError(f"{_OP}: x must have shape (..., N, H), got {x.shape}")
  validation.check_floating(_OP, "x", x)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise TypeError(f"{_OP}: positions must have an integer dtype, got {positions.dtype}")
  lead, (n, h) = x.shape[:-2], x.shape[-2:]
  try:
    positions = jnp.broadcast_to(positions, lead)
  except ValueError:
    raise ValueError(
      f"{_OP}: positions of shape {positions.shape} must broadcast to x's leading dims {lead} "
      f"(x {x.shape})"
    ) from None
  if rotary_dim is None and h % 2:
    raise ValueError(f"{_OP}: x's head dim H = {h} must be even to rotate it whole (x {x.shape})")
  d = h if rotary_dim is None else rotary_dim
  if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 2 or d % 2 or d > h:
    raise ValueError(f"{_OP}: rotary_dim must be an even int in [2, H] = [2, {h}], got {d!r}")
  d = int(d)
  theta = validation.check_positive_float(_OP, "theta", theta)
  if not isinstance(interleaved, bool):
    raise TypeError(f"{_OP}: interleaved must be a bool, got {type(interleaved).__name__}")
  params = dict(theta=theta, rotary_dim=d, interleaved=interleaved, scaling=_scaling(scaling))
  tokens = math.prod(lead)
  if tokens == 0 or n == 0:
    return x
  y = apply_rotary_op(x.reshape(tokens, n, h), positions.reshape(tokens), **params)
  return y.reshape(x.shape)
