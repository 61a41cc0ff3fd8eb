"""apply_rotary against a float64 NumPy reference: both forms, partial dims, scaling, AD, vmap.

The reference rotates each feature pair with NumPy in float64, its Llama 3
frequencies written from the published recipe (transformers'
``_compute_llama3_parameters``): no code shared with pallax.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import FLOAT_DTYPES, assert_close, f64, mesh_4x2, primitive_names, rand, x64

LLAMA3 = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 64,
}


def _inv_freq(d, theta, scaling):
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  if scaling is None:
    return inv
  if scaling["rope_type"] == "linear":
    return inv / scaling["factor"]
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  out = []
  for f in inv:
    wavelen = 2 * math.pi / f
    if wavelen < old / high:
      out.append(f)
    elif wavelen > old / low:
      out.append(f / factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append((1 - smooth) * f / factor + smooth * f)
  return np.asarray(out)


def reference(x, positions, theta=10000.0, rotary_dim=None, interleaved=False, scaling=None):
  x = f64(x)
  d = rotary_dim or x.shape[-1]
  pos = np.broadcast_to(np.asarray(positions), x.shape[:-2]).astype(np.float64)
  angle = pos[..., None, None] * _inv_freq(d, theta, scaling)  # (..., 1, d/2)
  cos, sin = np.cos(angle), np.sin(angle)
  out = x.copy()
  if interleaved:
    a, b = x[..., 0:d:2], x[..., 1:d:2]
    out[..., 0:d:2], out[..., 1:d:2] = a * cos - b * sin, b * cos + a * sin
  else:
    a, b = x[..., : d // 2], x[..., d // 2 : d]
    out[..., : d // 2], out[..., d // 2 : d] = a * cos - b * sin, b * cos + a * sin
  return out


CASES = {
  "half": dict(),
  "interleaved": dict(interleaved=True),
  "partial": dict(rotary_dim=8),
  "partial-interleaved-theta": dict(rotary_dim=12, interleaved=True, theta=500000.0),
  "llama3": dict(scaling=LLAMA3, theta=500000.0),
  "linear": dict(scaling={"rope_type": "linear", "factor": 4.0}),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_forward(name, dtype):
  rng = np.random.default_rng(0)
  x = rand(rng, (2, 9, 3, 16), dtype)
  positions = jnp.asarray(rng.integers(0, 300, (2, 9)), jnp.int32)  # packed and offset
  got = jax.jit(lambda x, p: pallax.apply_rotary(x, p, **CASES[name]))(x, positions)
  assert got.shape == x.shape and got.dtype == dtype
  assert_close(got, reference(x, positions, **CASES[name]), dtype, name)


def test_positions_broadcast_and_features_past_rotary_dim_pass_through():
  rng = np.random.default_rng(1)
  x = rand(rng, (3, 7, 2, 10))
  got = pallax.apply_rotary(x, jnp.arange(7), rotary_dim=np.int64(6))
  assert_close(got, reference(x, np.arange(7), rotary_dim=6), jnp.float32)
  np.testing.assert_array_equal(got[..., 6:], x[..., 6:])


@pytest.mark.parametrize("name", ["half", "interleaved", "llama3"])
def test_grad_is_the_inverse_rotation_and_jvp_the_rotation(name):
  rng = np.random.default_rng(2)
  x, ct, t = (rand(rng, (4, 2, 16)) for _ in range(3))
  positions = jnp.asarray([0, 5, 17, 300], jnp.int32)
  f = lambda x: pallax.apply_rotary(x, positions, **CASES[name])
  grad = jax.grad(lambda x: jnp.sum(f(x) * ct))(x)
  _, tangent = jax.jvp(f, (x,), (t,))
  with x64():
    ref = lambda x: jnp.asarray(reference(x, positions, **CASES[name]))
    want_grad = reference(ct, -np.asarray(positions), **CASES[name])  # rotating back
    want_tangent = ref(t)
  assert_close(grad, want_grad, jnp.float32, "grad")
  assert_close(tangent, want_tangent, jnp.float32, "tangent")
  hvp = jax.jvp(jax.grad(lambda x: jnp.sum(f(x) ** 2)), (x,), (t,))[1]
  assert_close(hvp, 2 * t, jnp.float32, "hvp")  # a rotation preserves the norm


def test_vmap_matches_a_loop_and_is_one_primitive():
  rng = np.random.default_rng(3)
  x = rand(rng, (3, 5, 2, 8))
  positions = jnp.asarray(rng.integers(0, 50, (3, 5)), jnp.int32)
  f = lambda x, p: pallax.apply_rotary(x, p, interleaved=True)
  got = jax.jit(jax.vmap(f))(x, positions)
  for i in range(3):
    np.testing.assert_array_equal(got[i], f(x[i], positions[i]))
  names = primitive_names(jax.make_jaxpr(jax.vmap(f))(x, positions).jaxpr)
  assert collections.Counter(n for n in names if "rotary" in n) == {"apply_rotary": 1}


def test_tokens_and_heads_shard_without_gathers():
  mesh = mesh_4x2()
  rng = np.random.default_rng(4)
  x, positions = rand(rng, (8, 6, 4, 16)), jnp.asarray(rng.integers(0, 99, (8, 6)), jnp.int32)
  xs = jax.device_put(x, NamedSharding(mesh, P("a", None, "b")))
  ps = jax.device_put(positions, NamedSharding(mesh, P("a")))
  compiled = jax.jit(pallax.apply_rotary).lower(xs, ps).compile()
  assert "all-gather" not in compiled.as_text()
  out = compiled(xs, ps)
  assert out.sharding.is_equivalent_to(xs.sharding, out.ndim)
  assert_close(out, reference(x, positions), jnp.float32)


BAD = {
  "x rank 1": (dict(x=jnp.ones((8,))), "x"),
  "integer x": (dict(x=jnp.ones((2, 2, 8), jnp.int32)), "x"),
  "float positions": (dict(positions=jnp.ones((2,))), "positions"),
  "positions shape": (dict(positions=jnp.ones((3,), jnp.int32)), "positions"),
  "odd rotary_dim": (dict(rotary_dim=3), "rotary_dim"),
  "rotary_dim past H": (dict(rotary_dim=10), "rotary_dim"),
  "theta zero": (dict(theta=0.0), "theta"),
  "scaling kind": (dict(scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type"),
  "scaling missing": (dict(scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
  "scaling order": (dict(scaling={**LLAMA3, "high_freq_factor": 0.5}), "high_freq_factor"),
  "interleaved string": (dict(interleaved="yes"), "interleaved"),
  "odd head dim": (dict(x=jnp.ones((2, 2, 7))), "must be even"),
}


def test_transformers_default_rope_type_is_no_scaling():
  x = rand(np.random.default_rng(5), (4, 2, 8))
  plain = pallax.apply_rotary(x, jnp.arange(4))
  np.testing.assert_array_equal(
    pallax.apply_rotary(x, jnp.arange(4), scaling={"rope_type": "default"}), plain
  )


@pytest.mark.parametrize("name", BAD)
def test_bad_input(name):
  overrides, word = BAD[name]
  call = dict(x=jnp.ones((2, 2, 8)), positions=jnp.arange(2))
  call.update(overrides)
  with pytest.raises((ValueError, TypeError)) as err:
    pallax.apply_rotary(call.pop("x"), call.pop("positions"), **call)
  assert word in str(err.value), str(err.value)
