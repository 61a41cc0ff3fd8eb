"""The matmul layout every implementation shares: batch masks, result shape, folded GEMM.

``a`` is ``(*a_dims, M, K)`` (``(*a_dims, K, M)`` with ``transpose_a``), ``b``
is ``(*b_dims, K, N)`` (``(*b_dims, N, K)`` with ``transpose_b``), the
optional ``bias`` is ``(*bias_dims, N)`` and the result is ``(*batch, M, N)``.
The masks ``a_batch``, ``b_batch`` and ``bias_batch`` (one bool per result
batch dim) say which batch dims each operand has: an operand shared along a
batch dim simply lacks it and is never broadcast in memory.
``contract_batch`` more batch dims, right before the matrix dims of ``a`` and
``b`` (and absent from the result), are contracted with K.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def acc_dtype(*dtypes) -> jnp.dtype:
  """Accumulation dtype: float32, or float64 when an input is float64."""
  return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


def output_batch(shapes: Sequence[tuple[int, ...]], **params) -> tuple[int, ...]:
  """The result's batch shape, from the shapes of ``(a, b[, bias])`` and the call's params.

  Each dim's size comes from an operand that has it; a dim none of the given
  operands has (one only the bias has, when it is not given) has size 1.
  """
  lead = -2 - params.get("contract_batch", 0)
  sizes = [iter(shapes[0][:lead]), iter(shapes[1][:lead])] + [iter(s[:-1]) for s in shapes[2:]]
  masks = (params["a_batch"], params["b_batch"], params["bias_batch"])[: len(shapes)]
  out = []
  for has in zip(*masks):
    found = [next(it) for it, h in zip(sizes, has) if h]
    out.append(found[0] if found else 1)
  return tuple(out)


def bias_like(bias: jax.Array, bias_batch: Sequence[bool], ndim: int) -> jax.Array:
  """``bias (*bias_dims, N)`` reshaped to broadcast against ``(*batch, M, N)``."""
  sizes = iter(bias.shape[:-1])
  shape = [next(sizes) if has else 1 for has in bias_batch]
  return bias.reshape((1,) * (ndim - 2 - len(shape)) + tuple(shape) + (1, bias.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Problem:
  """The GEMM one call runs, after folding a's trailing batch dims into M."""

  batch: tuple[int, ...]  # the result's batch dims
  fold: int  # how many trailing ones are folded into M
  rows: int  # M of one example (before folding)
  m: int
  n: int
  k: int

  @classmethod
  def of(cls, shapes: Sequence[tuple[int, ...]], **params) -> Problem:
    """The problem of a call with operands of ``shapes`` ``(a, b[, bias])`` and ``params``."""
    batch = output_batch(shapes, **params)
    a_batch, b_batch, bias_batch = params["a_batch"], params["b_batch"], params["bias_batch"]
    transpose_a = params["transpose_a"]
    a_shape, b_shape = shapes[:2]
    fold = 0
    if not transpose_a:
      while (
        fold < len(batch)
        and a_batch[-1 - fold]
        and not b_batch[-1 - fold]
        and not bias_batch[-1 - fold]
      ):
        fold += 1
    rows = a_shape[-1] if transpose_a else a_shape[-2]
    contracted = math.prod(a_shape[len(a_shape) - 2 - params["contract_batch"] : -2])
    k = contracted * (a_shape[-2] if transpose_a else a_shape[-1])
    n = b_shape[-2] if params["transpose_b"] else b_shape[-1]
    return cls(batch, fold, rows, rows * math.prod(batch[len(batch) - fold :]), n, k)

  @property
  def grid_batch(self) -> tuple[int, ...]:
    return self.batch[: len(self.batch) - self.fold]


def problem_of(avals, params) -> Problem:
  """The problem of a call with operands of ``avals`` and static ``params``."""
  return Problem.of([a.shape for a in avals], **params)
