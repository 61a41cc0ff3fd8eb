"""The matmul family's tools: self-check case, verify sweep, bench suite, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.matmul import matmul, matmul_reference
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "matmul_work"]


def matmul_work(m: int, k: int, n: int, dtype, mode: str, *, bias: bool = False) -> Work:
  """``[M, K] @ [K, N]`` (plus a ``(N,)`` bias): ``2MKN`` FLOPs; backward ``dA`` and ``dB``.

  Forward+backward: 3x the FLOPs (``dC B^T`` and ``A^T dC``); the backward
  reads ``A``, ``B``, ``dC`` (once per product: twice) and writes ``dA``,
  ``dB`` (and ``dbias``). An epilogue's activation is elementwise: not counted.
  """
  bwd = check_mode(mode)
  elements = m * k + k * n + m * n + (n if bias else 0)
  flops = 2 * m * k * n
  if bwd:
    elements += 2 * (m * k + k * n + m * n) + (n if bias else 0)
    flops *= 3
  return Work(flops, nbytes(elements, dtype))


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
  m, k, n = (37, 200, 96) if small else (512, 1024, 1024)
  a = jnp.asarray(rng.standard_normal((m, k)), dtype)
  b = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  bias = jnp.asarray(rng.standard_normal(n), dtype)
  return a, b, bias


def _matmul_gelu(a: jax.Array, b: jax.Array, bias: jax.Array) -> jax.Array:
  return matmul(a, b, bias=bias, activation="gelu")


def _matmul_gelu_reference(a: jax.Array, b: jax.Array, bias: jax.Array) -> jax.Array:
  return matmul_reference(a, b, bias=bias, activation="gelu")


# Sweep sizes (M, K, N): the benches' (bench/), odd ones and a few rows.
SIZES = ((1024, 1024, 1024), (4096, 4096, 4096), (1000, 4000, 300), (8, 1000, 1000))

SWEEP = SweepOp(_matmul_gelu, lambda m, k, n: [(m, k), (k, n), (n,)], SIZES, (SIZES[0], SIZES[2]))
# The suite's every case, vmapped too.
BENCH = BenchSuite("test_matmul.py", "matmul", "M x K x N")
CHECK = SelfCheck("matmul", _args, _matmul_gelu, _matmul_gelu_reference)

TOOLS = (OpTools("matmul", CHECK, {"matmul": SWEEP}, BENCH, matmul_work),)
