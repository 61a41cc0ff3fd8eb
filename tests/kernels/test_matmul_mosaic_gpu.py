"""matmul's Mosaic GPU (Hopper) kernel, interpreted, its refusals and its place in selection.

The kernel runs in JAX's GPU interpreter (its interpreted form:
docs/mosaic_gpu.md) on shapes that are not multiples of its 64x64x64 tiles,
against float64 numpy. Products of 16-bit inputs are exact in float32, so
float32 results agree to float32 rounding. Through ``pallax.matmul`` the
Mosaic config is pinned (``Executor.overlay``): on an H100 or H200 the
heuristic gives plain 16-bit products to XLA's GEMM and fused ones to the
Triton kernel, as measured (kernels/matmul/config.py), so grads and jvps run
the Mosaic GPU kernel only when pinned or chosen by autotuning.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor import Target
from pallax.executor.executor import candidate_configs
from pallax.executor.registry import kernel_spec
from pallax.executor.tools import kernel_calls
from pallax.kernels.matmul import mosaic_gpu
from pallax.kernels.matmul.mosaic_gpu import MosaicGpuMatmulConfig
from tests.helpers import assert_close, compile_pinned, f64, rand, x64
from tests.primitives.test_matmul import matmul_ref

MOSAIC = mosaic_gpu.IMPLEMENTATION
SMALL = MosaicGpuMatmulConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)
M, N, K = 100, 72, 130  # 2 x 2 tiles, 3 K steps, each dim padded
H100, A100 = Target("cuda", "h100"), Target("cuda", "a100")


def _params(batch: int = 0, **kw) -> dict:
  params = dict(
    a_batch=(True,) * batch,
    b_batch=(True,) * batch,
    bias_batch=(False,) * batch,
    contract_batch=0,
    transpose_a=False,
    transpose_b=False,
    activation=None,
    precision=None,
    save_preactivation=False,
  )
  return params | kw


def _act64(activation, z: np.ndarray) -> np.ndarray:
  with x64():
    return np.asarray(matmul_ref(z, np.eye(z.shape[-1]), activation=activation))


# name: (dtype, a's shape, b's shape, params, bias, out_dtype)
CASES = {
  "bf16-bias-relu-saved": (jnp.bfloat16, (M, K), (K, N), _params(activation="relu"), True, "f32"),
  "f16-both-transposed-gelu_tanh-saved": (
    jnp.float16,
    (K, M),
    (N, K),
    _params(transpose_a=True, transpose_b=True, activation="gelu_tanh"),
    True,
    "f32",
  ),
  # a's batch dim folded into M, b shared; a bf16 result.
  "bf16-folded-batch-gelu": (
    jnp.bfloat16,
    (2, M, K),
    (K, N),
    _params(1, b_batch=(False,), activation="gelu"),
    True,
    "in",
  ),
  # A grid batch axis: a shared, b batched and transposed.
  "f16-grid-batch-silu": (
    jnp.float16,
    (M, K),
    (3, N, K),
    _params(1, a_batch=(False,), transpose_b=True, activation="silu"),
    False,
    "f32",
  ),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_float64(name):
  dtype, a_shape, b_shape, params, with_bias, out = CASES[name]
  rng = np.random.default_rng(0)
  a, b = rand(rng, a_shape, dtype), rand(rng, b_shape, dtype, scale=0.1)
  bias = [rand(rng, (N,), jnp.float32)] if with_bias else []
  out_dtype = jnp.float32 if out == "f32" else dtype
  save = params["activation"] is not None
  params = dict(params, save_preactivation=save)
  outs = mosaic_gpu.matmul(a, b, *bias, out_dtype=out_dtype, config=SMALL, interpret=True, **params)
  a64, b64 = f64(a), f64(b)
  a64 = np.swapaxes(a64, -1, -2) if params["transpose_a"] else a64
  b64 = np.swapaxes(b64, -1, -2) if params["transpose_b"] else b64
  z = np.matmul(a64, b64) + (f64(bias[0]) if bias else 0.0)
  want = [_act64(params["activation"], z), z][: len(outs)]
  for got, ref in zip(outs, want):
    assert got.shape == ref.shape and got.dtype == out_dtype
    err = float(np.max(np.abs(f64(got) - ref)) / np.max(np.abs(ref)))
    assert err < (1e-6 if out_dtype == jnp.float32 else 1e-2), (name, err)


def _pinned():
  return pallax.default_executor().overlay({"matmul": SMALL})


def _mosaic_rows(fn, *args) -> list[str]:
  with pallax.interpret("mosaic_gpu"), _pinned():
    return [r.implementation for r in pallax.explain(fn, *args) if r.op == "matmul"]


def _operands(dtype, seed: int):
  rng = np.random.default_rng(seed)
  return (
    rand(rng, (2, M, K), dtype),
    rand(rng, (K, N), dtype, scale=0.1),
    rand(rng, (N,), dtype),
  )


def _ref(a, b, *, bias, activation):
  return matmul_ref(a, b, bias, activation)


def _loss(matmul, a, b, bias):
  return jnp.sum(matmul(a, b, bias=bias, activation="gelu_tanh").astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_grad_runs_the_mosaic_kernel(dtype):
  """The forward and both products of the backward (dB contracts the batch) on Mosaic GPU."""
  a, b, bias = _operands(dtype, seed=1)
  grad = jax.grad(functools.partial(_loss, pallax.matmul), (0, 1, 2))
  assert _mosaic_rows(grad, a, b, bias) == [MOSAIC] * 3
  with pallax.interpret("mosaic_gpu"), _pinned():
    got = jax.jit(grad)(a, b, bias)
  with x64():
    want = jax.grad(functools.partial(_loss, _ref), (0, 1, 2))(
      *(jnp.asarray(f64(x)) for x in (a, b, bias))
    )
  for g, w, name in zip(got, want, ("da", "db", "dbias")):
    assert g.dtype == dtype
    assert_close(g, w, dtype, name)


def test_jvp_runs_the_mosaic_kernel():
  a, b, bias = _operands(jnp.bfloat16, seed=2)
  rng = np.random.default_rng(3)
  tangents = tuple(rand(rng, x.shape, jnp.bfloat16) for x in (a, b, bias))
  f = lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="relu")
  jvp = lambda *args: jax.jvp(f, args[:3], args[3:])
  assert _mosaic_rows(jvp, a, b, bias, *tangents) == [MOSAIC] * 3
  with pallax.interpret("mosaic_gpu"), _pinned():
    y, y_dot = jax.jit(jvp)(a, b, bias, *tangents)
  with x64():
    wide = [jnp.asarray(f64(x)) for x in (a, b, bias, *tangents)]
    ref = lambda a, b, bias: matmul_ref(a, b, bias, "relu")
    y_ref, y_dot_ref = jax.jvp(ref, wide[:3], wide[3:])
  assert_close(y, y_ref, jnp.bfloat16, "primal")
  assert_close(y_dot, y_dot_ref, jnp.bfloat16, "tangent")


def test_vmap_matches_a_loop():
  rng = np.random.default_rng(4)
  a = rand(rng, (3, M, K), jnp.bfloat16)
  b = rand(rng, (3, K, N), jnp.bfloat16, scale=0.1)
  f = lambda a, b: pallax.matmul(a, b, activation="silu")
  assert _mosaic_rows(jax.vmap(f), a, b) == [MOSAIC]
  with pallax.interpret("mosaic_gpu"), _pinned():
    batched = jax.jit(jax.vmap(f))(a, b)
    looped = [jax.jit(f)(x, y) for x, y in zip(a, b)]
  np.testing.assert_array_equal(f64(batched), f64(jnp.stack(looped)))


S = jax.ShapeDtypeStruct


# The largest buffers a choosable config takes: 128x128 tiles in 3 slots, a
# float32 result and its pre-activation, a bias.
WIDEST = MosaicGpuMatmulConfig(tile_m=128, tile_n=128, stages=3)
WIDEST_PARAMS = dict(out_dtype=jnp.float32, activation="relu", save_preactivation=True)


def _avals(dtype=jnp.bfloat16, b_dtype=None, bias=None):
  out = [S((M, K), dtype), S((K, N), b_dtype or dtype)]
  return out + ([S((N,), bias)] if bias else [])


def _reason(config=SMALL, avals=None, **kw):
  params = _params(out_dtype=kw.pop("out_dtype", jnp.bfloat16), **kw)
  return mosaic_gpu.supports(avals or _avals(), "cuda", config, **params)


def test_supports_refuses_what_the_kernel_cannot_take():
  assert _reason() is None
  assert _reason(MosaicGpuMatmulConfig(), activation="relu", save_preactivation=True) is None
  assert "16-bit" in _reason(avals=_avals(jnp.float32))
  assert "got bfloat16 and float16" in _reason(avals=_avals(jnp.bfloat16, jnp.float16))
  assert "bias must be" in _reason(avals=_avals(bias=jnp.float64))
  assert "out_dtype must be" in _reason(out_dtype=jnp.float64)
  assert "multiples of 64" in _reason(MosaicGpuMatmulConfig(tile_m=96))
  assert "multiples of 64" in _reason(MosaicGpuMatmulConfig(tile_n=512, tile_m=64))
  assert "128 registers" in _reason(MosaicGpuMatmulConfig(tile_m=128, tile_n=256))
  assert "GELU" in _reason(MosaicGpuMatmulConfig(), activation="gelu")
  assert _reason(MosaicGpuMatmulConfig(tile_m=64), activation="gelu") is None
  assert "at least 2" in _reason(MosaicGpuMatmulConfig(stages=1))
  assert "bytes of SMEM" in _reason(MosaicGpuMatmulConfig(tile_m=64, tile_n=256, stages=8))
  # 229632 bytes of buffers fit (``SMEM_BUDGET``: compiled, below).
  assert _reason(WIDEST, avals=_avals(bias=jnp.bfloat16), **WIDEST_PARAMS) is None


def test_hopper_prefers_cublas_for_plain_products_and_tunes_mosaic_gpu():
  """Plain 16-bit products on H100/H200 run XLA's GEMM (measured faster); the rest Triton.

  Autotuning times Mosaic GPU, Triton and XLA alike.
  """
  a, b = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.bfloat16)
  bias = jnp.zeros((384,), jnp.bfloat16)
  plain = lambda a, b: pallax.matmul(a, b)
  fused = lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="gelu")
  grad = jax.grad(lambda a, b: jnp.sum(pallax.matmul(a, b).astype(jnp.float32)), (0, 1))
  for target in (H100, Target("cuda", "h200")):
    assert [r.implementation for r in pallax.explain_on(target, plain, a, b)] == ["xla"]
    assert [r.implementation for r in pallax.explain_on(target, grad, a, b)] == ["xla"] * 3
    (row,) = pallax.explain_on(target, fused, a, b, bias)
    assert row.implementation == "pallas" and not isinstance(row.config, MosaicGpuMatmulConfig)
    f32 = [jnp.zeros(x.shape, jnp.float32) for x in (a, b)]
    assert [r.implementation for r in pallax.explain_on(target, plain, *f32)] == ["pallas"]
  assert [r.implementation for r in pallax.explain_on(A100, plain, a, b)] == ["pallas"]
  params = _params(out_dtype=jnp.bfloat16)
  avals = [S(a.shape, a.dtype), S(b.shape, b.dtype)]
  configs = candidate_configs(kernel_spec("matmul"), avals, H100, params)
  names = {c.implementation for c in configs}
  assert {MOSAIC, "pallas", "xla"} <= names
  mosaic = [c for c in configs if c.implementation == MOSAIC]
  assert MosaicGpuMatmulConfig(tile_m=128, tile_n=128, stages=4) in mosaic
  for c in mosaic:
    assert mosaic_gpu.supports(avals, "cuda", c, **params) is None


@pytest.mark.compilers
def test_every_mosaic_gpu_config_compiles_for_h100():
  """Every Mosaic GPU matmul config the executor can choose on an H100: no spills, fits SMEM."""
  from pallax.verify import verify
  from pallax.verify.targets import TARGETS

  report = verify(
    ["matmul"],
    ["h100"],
    implementations=[MOSAIC],
    workers=1,
    cache=False,
    progress=False,
  )
  results = [r for r in report.results if r["config"]["implementation"] == MOSAIC]
  assert results, report.results
  for r in results:
    assert r["status"] == "ok", r
    (k,) = r["kernels"]
    assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, r
    assert 0 < k["smem_bytes"] <= TARGETS["h100"].shared_memory_limit, r
    assert k["threads"] == 128, r


@pytest.mark.compilers
def test_the_widest_buffers_compile_for_h100():
  """``WIDEST`` (229632 bytes of buffers) compiles for H100 within its SMEM, without spills."""
  a, b = jnp.zeros((1024, 512), jnp.bfloat16), jnp.zeros((512, 1024), jnp.bfloat16)
  bias = jnp.zeros((1024,), jnp.bfloat16)
  fwd = lambda a, b, bias: pallax.matmul(
    a, b, bias=bias, activation="relu", preferred_element_type=jnp.float32
  )
  loss = lambda *args: jnp.sum(fwd(*args))
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(a, b, bias).jaxpr
  (eqn,) = [e for e in kernel_calls(jaxpr) if e.params["save_preactivation"]]
  assert all(eqn.params[k] == v for k, v in WIDEST_PARAMS.items())
  compile_pinned(eqn, WIDEST)
