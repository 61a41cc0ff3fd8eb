"""The ragged_dot family's tools: self-check case, verify sweep, bench suite, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.ragged_dot import ragged_dot
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "ragged_dot_work"]


def ragged_dot_work(m: int, k: int, n: int, groups: int, dtype, mode: str) -> Work:
  """``[M, K]`` rows times their groups' ``[K, N]`` of ``[G, K, N]``: ``2MKN`` FLOPs.

  The FLOPs of one dense GEMM of the rows (not G of them); forward+backward
  3x (``dlhs`` and the per-group ``drhs``), reading and writing each operand
  as a matmul's backward does.
  """
  bwd = check_mode(mode)
  elements = m * k + groups * k * n + m * n
  flops = 2 * m * k * n
  if bwd:
    elements += 2 * (m * k + groups * k * n + m * n)
    flops *= 3
  return Work(flops, nbytes(elements, dtype))


def _sizes(m: int, groups: int) -> np.ndarray:
  """Skewed group sizes summing to ``m``: halving, one empty group, the rest in the last."""
  sizes = [m // 2**i for i in range(1, groups)]
  sizes[-1] = 0
  return np.asarray([*sizes, m - sum(sizes)], np.int32)


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  m, k, n, g = (37, 24, 16, 4) if small else (2048, 512, 512, 8)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
  return lhs, rhs, jnp.asarray(_sizes(m, g))


def _reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  return lax.ragged_dot(lhs, rhs, group_sizes)


# Sweep sizes (M, K, N, G), the second with dims no block divides. Group
# sizes are values, not shapes: a compile holds for every split of the rows.
SIZES = ((8192, 1024, 2048, 8), (1000, 512, 300, 5))

# The gated epilogue (the MoE FFN's gate and up projections): halves of N
# columns, multiples of 128 (TPU blocks).
GATED_SIZES = ((8192, 1024, 1024, 8), (1000, 512, 384, 5))


def _gated(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  return ragged_dot(lhs, rhs, group_sizes, activation="silu", gated=True)


TOOLS = (
  OpTools(
    "ragged_dot",
    check=SelfCheck("ragged_dot", _args, ragged_dot, _reference),
    sweep={
      "ragged_dot": SweepOp(
        ragged_dot, lambda m, k, n, g: [(m, k), (g, k, n), (g,)], SIZES, SIZES, ints=1
      ),
      "ragged_dot_gated": SweepOp(
        _gated, lambda m, k, n, g: [(m, k), (g, k, 2 * n), (g,)], GATED_SIZES, GATED_SIZES, ints=1
      ),
    },
    bench=BenchSuite("test_ragged_dot.py", "ragged_dot", "M x K x N"),
    work=ragged_dot_work,
    aliases=("ragged_dot_general",),
    composites={"moe": BenchSuite("test_moe.py", "test_moe", "T x D x F")},
  ),
)
