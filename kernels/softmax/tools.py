"""The softmax family's tools: self-check cases, verify sweep, bench suites, work model.

Read by ``pallax.family`` (the self-check, ``pallax.verify``, ``python -m
pallax.bench`` and ``pallax.roofline``): one ``OpTools`` per op of the family,
``softmax`` and ``log_softmax``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallax.family import BenchSuite, OpTools, SelfCheck, SweepOp
from pallax.primitives.softmax import log_softmax, softmax
from pallax.roofline import Work, check_mode, nbytes

__all__ = ["TOOLS", "softmax_work"]


def softmax_work(shape: Sequence[int], dtype, mode: str) -> Work:
  """Softmax or log-softmax of ``x``: bytes only.

  Reads ``x`` and writes ``y``; the backward reads ``y`` and ``dy``, writes ``dx``.
  """
  bwd = check_mode(mode)
  size = math.prod(shape)
  return Work(None, nbytes((5 if bwd else 2) * size, dtype))


def _args(rng: np.random.Generator, dtype, small: bool) -> tuple[jax.Array]:
  rows, cols = (37, 300) if small else (4096, 1024)
  return (jnp.asarray(3 * rng.standard_normal((rows, cols)), dtype),)


# Sweep sizes: the benches' (bench/), odd ones (rows and widths that no block
# divides), and a vocabulary-sized row.
SIZES = ((1024, 1024), (8192, 4096), (1000, 4000), (16, 50257))
QUICK = ((1024, 1024), (1000, 4000))
_rows = lambda r, h: [(r, h)]

TOOLS = (
  OpTools(
    "softmax",
    check=SelfCheck("softmax", _args, softmax, jax.nn.softmax),
    sweep={
      "softmax": SweepOp(softmax, _rows, SIZES, QUICK),
      "softmax_where": SweepOp(
        lambda x, where: softmax(x, where=where),
        lambda r, h: [(r, h), (r, h)],
        QUICK,
        QUICK,
        masks=1,
      ),
    },
    bench=BenchSuite("test_softmax.py", "softmax and not log_softmax"),
    work=softmax_work,
  ),
  OpTools(
    "log_softmax",
    check=SelfCheck("log_softmax", _args, log_softmax, jax.nn.log_softmax),
    sweep={"log_softmax": SweepOp(log_softmax, _rows, SIZES, QUICK)},
    bench=BenchSuite("test_softmax.py", "log_softmax"),
    work=softmax_work,
  ),
)
