"""Norm ops vs their plain-jnp formulations, forward and forward+backward.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_norm.py --benchmark-group-by=param:op,param:shape,param:dtype,param:mode

Each group then holds the pallax and baseline timings of one case side by
side. ``fused_add_rms_norm`` is compared with plain jnp and with the unfused
``x + r`` followed by ``pallax.rms_norm``. The forward+backward loss takes a
random cotangent per output (arguments, not constants), so neither side can
fold the backward away. ``extra_info``: the bytes the op's definition moves
and the achieved GB/s, with the fraction of the device's bandwidth where
``pallax.roofline`` knows it (``bench/throughput.py``).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from throughput import record_throughput

import pallax
from pallax import roofline
from pallax.primitives.norm import (
  fused_add_rms_norm_reference,
  layer_norm_reference,
  rms_norm_reference,
)

SHAPES = [(1024, 1024), (4096, 1024), (8192, 4096)]
OPS = {
  "rms_norm": (("x", "w"), {"pallax": pallax.rms_norm, "jnp": rms_norm_reference}),
  "layer_norm": (("x", "w", "b"), {"pallax": pallax.layer_norm, "jnp": layer_norm_reference}),
  "fused_add_rms_norm": (
    ("x", "r", "w"),
    {
      "pallax": pallax.fused_add_rms_norm,
      "jnp": fused_add_rms_norm_reference,
      "unfused": lambda x, r, w: (pallax.rms_norm(x + r, w), x + r),
    },
  ),
}
CASES = [(op, impl) for op, (_, impls) in OPS.items() for impl in impls]


@pytest.mark.parametrize("op, impl", CASES, ids=[f"{o}-{i}" for o, i in CASES])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_norm(benchmark, bench, fwd_bwd, op, impl, mode, dtype, shape):
  names, impls = OPS[op]
  rng = np.random.default_rng(0)
  make = {
    "x": lambda: rng.standard_normal(shape),
    "r": lambda: rng.standard_normal(shape),
    "w": lambda: 1 + 0.5 * rng.standard_normal(shape[-1]),
    "b": lambda: 0.5 * rng.standard_normal(shape[-1]),
  }
  args = [jnp.asarray(make[n](), dtype) for n in names]
  if mode == "fwd":
    bench(impls[impl], *args)
  else:
    cotangents = [
      jnp.asarray(rng.standard_normal(shape), jnp.float32)
      for _ in range(2 if op == "fused_add_rms_norm" else 1)
    ]
    bench(fwd_bwd(impls[impl], len(args)), *args, *cotangents)
  record_throughput(benchmark, roofline.norm_work(op, shape, dtype, mode), dtype)
