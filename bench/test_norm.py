"""Norm ops vs their plain-jnp formulations (and tokamax with ``--peers``), in every mode.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_norm.py --benchmark-group-by=param:op,param:shape,param:dtype,param:mode
  pytest -n 0 bench/test_norm.py --peers      # with tokamax.layer_norm (the bench extra)

Each group then holds the timings of one case side by side. ``fused_add_rms_norm``
is compared with plain jnp and with the unfused ``x + r`` followed by
``pallax.rms_norm``. Modes (``bench/modes.py``): ``fwd``, ``fwd+bwd`` (random
cotangents as arguments, so no side can fold the backward away), ``jvp`` and
``hvp``; tokamax's ``custom_vjp`` raises under the last two, which the report
lists. ``extra_info`` (``fwd`` and ``fwd+bwd``): the bytes the op's definition
moves and the achieved GB/s, with the fraction of the device's bandwidth where
``pallax.roofline`` knows it (``bench/throughput.py``).
"""

import jax.numpy as jnp
import numpy as np
import peers
import pytest
from modes import MODES, transformed
from throughput import record_throughput

import pallax
from pallax import roofline
from pallax.primitives.norm import (
  fused_add_rms_norm_reference,
  layer_norm_reference,
  rms_norm_reference,
)

SHAPES = [(1024, 1024), (4096, 1024), (8192, 4096)]


def _tokamax(subtract_mean):
  def norm(x, w, b=None):
    return peers.tokamax().layer_norm(x, w, b, subtract_mean=subtract_mean)

  return norm


OPS = {
  "rms_norm": (
    ("x", "w"),
    {"pallax": pallax.rms_norm, "jnp": rms_norm_reference, "tokamax": _tokamax(False)},
  ),
  "layer_norm": (
    ("x", "w", "b"),
    {"pallax": pallax.layer_norm, "jnp": layer_norm_reference, "tokamax": _tokamax(True)},
  ),
  "fused_add_rms_norm": (
    ("x", "r", "w"),
    {
      "pallax": pallax.fused_add_rms_norm,
      "jnp": fused_add_rms_norm_reference,
      "unfused": lambda x, r, w: (pallax.rms_norm(x + r, w), x + r),
    },
  ),
}
PEERS = {"tokamax"}
CASES = [
  pytest.param(op, impl, id=f"{op}-{impl}", marks=[pytest.mark.peer] if impl in PEERS else [])
  for op, (_, impls) in OPS.items()
  for impl in impls
]


def inputs(op, shape, dtype, rng):
  """The random operands of ``op`` (``OPS``) for ``x`` of ``shape``."""
  make = {
    "x": lambda: rng.standard_normal(shape),
    "r": lambda: rng.standard_normal(shape),
    "w": lambda: 1 + 0.5 * rng.standard_normal(shape[-1]),
    "b": lambda: 0.5 * rng.standard_normal(shape[-1]),
  }
  return [jnp.asarray(make[n](), dtype) for n in OPS[op][0]]


@pytest.mark.parametrize("op, impl", CASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_norm(benchmark, bench, op, impl, mode, dtype, shape):
  rng = np.random.default_rng(0)
  args = inputs(op, shape, dtype, rng)
  benchmark.extra_info.update(
    op=op, impl=impl, mode=mode, dtype=jnp.dtype(dtype).name, shape=list(shape)
  )
  fn, call_args = transformed(OPS[op][1][impl], args, mode, rng)
  if bench(fn, *call_args, peer=impl in PEERS) and mode in roofline.MODES:
    record_throughput(benchmark, roofline.norm_work(op, shape, dtype, mode), dtype)
