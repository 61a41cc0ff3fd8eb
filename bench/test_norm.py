"""rms_norm vs its plain-jnp formulation, forward and forward+backward.

Run: ``pytest bench/test_norm.py --benchmark-group-by=param:shape,param:dtype,param:mode``.
Each group then holds the pallax and plain-jnp timings of one case side by side.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.primitives.norm import rms_norm_reference

SHAPES = [(1024, 1024), (4096, 1024), (8192, 4096)]
IMPLS = {"pallax": pallax.rms_norm, "jnp": rms_norm_reference}


def _fwd_bwd(fn):
  return jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32)), (0, 1))


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(bench, impl, mode, dtype, shape):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape), dtype)
  w = jnp.asarray(1 + 0.5 * rng.standard_normal(shape[-1]), dtype)
  fn = IMPLS[impl] if mode == "fwd" else _fwd_bwd(IMPLS[impl])
  bench(fn, x, w)
