"""The norm family's tools: self-check cases, verify sweep, bench suites, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``): one ``OpTools`` per op of the family,
``rms_norm``, ``layer_norm`` and ``fused_add_rms_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.norm import (
  fused_add_rms_norm,
  fused_add_rms_norm_reference,
  layer_norm,
  layer_norm_reference,
  rms_norm,
  rms_norm_reference,
)
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "norm_work"]


def norm_work(op: str, shape: Sequence[int], dtype, mode: str) -> Work:
  """rms_norm / layer_norm / fused_add_rms_norm over the last dim of ``x``: bytes only.

  Forward: reads ``x`` (and the residual for ``fused_add_rms_norm``) and the
  ``(D,)`` parameters, writes ``y`` (and the sum). Backward: reads ``x`` (the
  sum), the weight (layer_norm's bias is not needed) and the cotangents,
  writes ``dx`` (and ``dresidual`` for ``fused_add_rms_norm``: the same
  array, counted once) and the parameters' gradients.
  """
  bwd = check_mode(mode)
  params = {"rms_norm": 1, "layer_norm": 2, "fused_add_rms_norm": 1}
  if op not in params:
    raise ValueError(f"op must be one of {tuple(params)}, got {op!r}")
  size, d = math.prod(shape), shape[-1]
  fused = op == "fused_add_rms_norm"
  rows = (2 if fused else 1) * size  # x (and the residual) in; y (and the sum) out
  elements = 2 * rows + params[op] * d
  if bwd:  # x (or the sum), the cotangent(s) and the weight in; dx and dparams out
    elements += (3 if fused else 2) * size + d + size + params[op] * d
  return Work(None, nbytes(elements, dtype))


def _args(*names: str) -> Callable:
  """The self-check's argument maker: ``names`` among x, residual, weight, bias."""

  def make(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array, ...]:
    rows, hidden = (37, 200) if small else (4096, 1024)
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    rest = {
      "x": x,
      "residual": jnp.asarray(rng.standard_normal((rows, hidden)), dtype),
      "weight": jnp.asarray(1.0 + 0.5 * rng.standard_normal(hidden), dtype),
      "bias": jnp.asarray(0.5 * rng.standard_normal(hidden), dtype),
    }
    return tuple(rest[n] for n in names)

  return make


# Sweep sizes: the benches' (bench/), odd ones (rows and widths that no block
# divides), and wide rows (16K hidden).
SIZES = ((1024, 1024), (8192, 4096), (1000, 4000), (64, 16384))
QUICK = ((1024, 1024), (1000, 4000))


def _tools(op: Callable, reference: Callable, names: tuple[str, ...], keyword: str) -> OpTools:
  """The tools of one norm: its arguments ``names`` (x first, then rows, then vectors)."""
  name = op.__name__
  shapes = lambda r, h: [(r, h) if n in ("x", "residual") else (h,) for n in names]
  return OpTools(
    name,
    check=SelfCheck(name, _args(*names), op, reference),
    sweep={name: SweepOp(op, shapes, SIZES, QUICK)},
    bench=BenchSuite("test_norm.py", keyword),
    work=norm_work,
  )


TOOLS = (
  _tools(rms_norm, rms_norm_reference, ("x", "weight"), "rms_norm and not fused_add"),
  _tools(layer_norm, layer_norm_reference, ("x", "weight", "bias"), "layer_norm"),
  _tools(
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    ("x", "residual", "weight"),
    "fused_add_rms_norm",
  ),
)
