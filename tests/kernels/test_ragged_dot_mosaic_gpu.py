"""ragged_dot's Mosaic GPU (Hopper) grouped GEMM: interpreted, its refusals, its place in selection.

The kernel runs in JAX's GPU interpreter (docs/mosaic_gpu.md) against
float64 numpy, on group sizes that put several groups (empty ones among
them) in one 64-row tile, groups of one row, held groups of a longer list
(``group_offset``) and rows past every group; dims that are no multiple of
the tiles. Products of 16-bit inputs are exact in float32, so float32
results agree to float32 rounding. Through ``pallax.ragged_dot`` the Mosaic
config is pinned (``Executor.overlay``): the heuristic leaves H100 calls to
the Triton kernel until the kernel is measured on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor import Target
from pallax.executor.executor import candidate_configs
from pallax.executor.registry import kernel_spec
from pallax.kernels import ragged_dot as kernels
from pallax.kernels.ragged_dot import mosaic_gpu
from pallax.kernels.ragged_dot.mosaic_gpu import MosaicGpuRaggedDotConfig
from tests.helpers import assert_close, f64, rand, x64

MOSAIC = mosaic_gpu.IMPLEMENTATION
SMALL = MosaicGpuRaggedDotConfig(tile_m=64, tile_n=64, tile_k=64, stages=2)
H100 = Target("cuda", "h100")


def _reference(lhs, rhs, sizes, offset=0, activation=None, gated=False):
  """float64: each row times its group's matrix (zeros outside the held groups), the epilogue."""
  lhs, rhs = f64(lhs), f64(rhs)
  out = np.zeros((lhs.shape[0], rhs.shape[-1]))
  ends = np.cumsum(sizes)
  for g, (end, size) in enumerate(zip(ends, sizes)):
    start, end = min(end - size, len(lhs)), min(end, len(lhs))
    if offset <= g < offset + rhs.shape[0]:
      out[start:end] = lhs[start:end] @ rhs[g - offset]
  act = {None: lambda z: z, "silu": lambda z: z / (1 + np.exp(-z)), "relu": lambda z: z * (z > 0)}
  if gated:
    a, b = np.split(out, 2, axis=-1)
    return act[activation](a) * b
  return act[activation](out)


# name: (M, K, N, group sizes, offset, held groups, dtype, activation, gated, out)
CASES = {
  # Groups of 0, 1, 7, 0, 60, 29, 3 and 4 rows: a tile meets up to five
  # groups; 104 of 130 rows grouped (the rest, and two tiles' worth of
  # padding, zeros); K and N past their tiles.
  "bf16-crowded-tiles": (
    130,
    96,
    80,
    [0, 1, 7, 0, 60, 29, 3, 4],
    0,
    8,
    jnp.bfloat16,
    None,
    0,
    "f32",
  ),
  # A device's experts 2..4 of 6 (expert parallelism): the rows of the
  # others zeros, a tile of no held group stores zeros without a product.
  "f16-held-groups": (200, 64, 64, [10, 20, 30, 40, 5, 3], 2, 3, jnp.float16, None, 0, "in"),
  # The MoE gate and up projections: silu(x @ a) * (x @ b), two accumulators.
  "bf16-gated-silu": (150, 64, 72, [0, 1, 70, 0, 30, 40], 0, 6, jnp.bfloat16, "silu", 1, "f32"),
  "bf16-one-group-relu": (90, 64, 64, [90], 0, 1, jnp.bfloat16, "relu", 0, "in"),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_float64(name):
  m, k, n, sizes, offset, local, dtype, activation, gated, out = CASES[name]
  rng = np.random.default_rng(0)
  lhs = rand(rng, (m, k), dtype)
  rhs = rand(rng, (local, k, n * (1 + gated)), dtype, scale=0.1)
  out_dtype = jnp.float32 if out == "f32" else dtype
  got = mosaic_gpu.gmm(
    lhs,
    rhs,
    jnp.asarray(sizes, jnp.int32),
    jnp.asarray([offset], jnp.int32),
    config=SMALL,
    interpret=True,
    out_dtype=out_dtype,
    activation=activation,
    gated=bool(gated),
  )
  want = _reference(lhs, rhs, sizes, offset, activation, bool(gated))
  assert got.shape == want.shape and got.dtype == out_dtype
  err = float(np.max(np.abs(f64(got) - want)) / np.max(np.abs(want)))
  assert err < (1e-6 if out_dtype == jnp.float32 else 1e-2), (name, err)


def test_tiles_of_no_power_of_two_rows_store_each_row_once():
  """192-row tiles: a group's rows leave SMEM as 128 + 64 + ... rows, never past the tile."""
  rng = np.random.default_rng(5)
  sizes = [150, 0, 100, 91, 3]  # boundaries at rows 150, 250, 341 of 400
  lhs, rhs = rand(rng, (400, 64), jnp.bfloat16), rand(rng, (5, 64, 64), jnp.bfloat16, scale=0.1)
  config = MosaicGpuRaggedDotConfig(tile_m=192, tile_n=64, tile_k=64, stages=2)
  got = mosaic_gpu.gmm(
    lhs,
    rhs,
    jnp.asarray(sizes, jnp.int32),
    jnp.zeros((1,), jnp.int32),
    config=config,
    interpret=True,
    out_dtype=jnp.float32,
  )
  want = _reference(lhs, rhs, sizes)
  assert float(np.max(np.abs(f64(got) - want)) / np.max(np.abs(want))) < 1e-6


def _pinned():
  return pallax.default_executor().overlay({"ragged_dot": SMALL, "ragged_dot_epilogue": SMALL})


def test_grad_and_jvp_run_the_mosaic_kernel():
  """The forward and dlhs (a grouped GEMM against rhs^T) on Mosaic GPU; drhs (tgmm) elsewhere."""
  rng = np.random.default_rng(1)
  sizes = np.asarray([3, 0, 50, 1, 46])
  lhs, rhs = rand(rng, (100, 64), jnp.bfloat16), rand(rng, (5, 64, 72), jnp.bfloat16, scale=0.1)
  cot = rand(rng, (100, 72), jnp.bfloat16)  # bfloat16 cotangents: dlhs is a 16-bit GEMM
  f = lambda a, b: pallax.ragged_dot(a, b, sizes)
  loss = lambda a, b: jnp.sum((f(a, b) * cot).astype(jnp.float32))
  grad = jax.grad(loss, (0, 1))
  with pallax.interpret("mosaic_gpu"), _pinned():
    rows = [(r.op, r.implementation) for r in pallax.explain(grad, lhs, rhs)]
    got = jax.jit(grad)(lhs, rhs)
    tangents = (rand(rng, lhs.shape, jnp.bfloat16), rand(rng, rhs.shape, jnp.bfloat16))
    y, y_dot = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(lhs, rhs, *tangents)
  assert rows.count(("ragged_dot", MOSAIC)) == 2, rows  # forward and dlhs
  assert ("ragged_dot_tgmm", MOSAIC) not in rows, rows
  assert MOSAIC not in kernels.TGMM.impls  # the weight gradient has no Mosaic GPU kernel
  with x64():
    wide = [jnp.asarray(f64(x)) for x in (lhs, rhs, *tangents)]
    ref_f = lambda a, b: jax.lax.ragged_dot(a, b, jnp.asarray(sizes))
    want = jax.grad(lambda a, b: jnp.sum(ref_f(a, b) * f64(cot)), (0, 1))(*wide[:2])
    y_ref, y_dot_ref = jax.jvp(ref_f, wide[:2], wide[2:])
  assert_close(got[0], want[0], jnp.bfloat16, "dlhs")
  assert_close(got[1], want[1], jnp.bfloat16, "drhs")
  assert_close(y, y_ref, jnp.bfloat16, "primal")
  assert_close(y_dot, y_dot_ref, jnp.bfloat16, "tangent")
  # The config pinned by the call: the grouped GEMMs on Mosaic GPU, the weight
  # gradient (no Mosaic kernel) the executor's choice.
  pinned = lambda a, b: jnp.sum(
    (pallax.ragged_dot(a, b, sizes, config=SMALL) * cot).astype(jnp.float32)
  )
  with pallax.interpret("mosaic_gpu"):
    rows = [(r.op, r.implementation) for r in pallax.explain(jax.grad(pinned, (0, 1)), lhs, rhs)]
    again = jax.jit(jax.grad(pinned, (0, 1)))(lhs, rhs)
  assert rows.count(("ragged_dot", MOSAIC)) == 2 and len(rows) == 3, rows
  for g, w in zip(again, got):
    np.testing.assert_array_equal(f64(g), f64(w))


S = jax.ShapeDtypeStruct


def _reason(config=SMALL, dtypes=(jnp.bfloat16, jnp.bfloat16), stage="gmm", **kw):
  params = dict(out_dtype=kw.pop("out_dtype", jnp.bfloat16), precision=None, **kw)
  avals = [S((256, 128), dtypes[0]), S((4, 128, 256), dtypes[1]), S((4,), jnp.int32)]
  return mosaic_gpu.supports(avals, "cuda", config, stage=stage, **params)


def test_supports_refuses_what_the_kernel_cannot_take():
  assert _reason() is None
  assert _reason(MosaicGpuRaggedDotConfig(tile_n=64), gated=True, activation="silu") is None
  assert "16-bit" in _reason(dtypes=(jnp.float32, jnp.float32))
  assert "got bfloat16 and float16" in _reason(dtypes=(jnp.bfloat16, jnp.float16))
  assert "out_dtype must be" in _reason(out_dtype=jnp.float64)
  assert "multiples of 64" in _reason(MosaicGpuRaggedDotConfig(tile_m=96))
  assert "128 registers" in _reason(MosaicGpuRaggedDotConfig(), gated=True)
  assert "GELU" in _reason(MosaicGpuRaggedDotConfig(), activation="gelu")
  gated_gelu = dict(gated=True, activation="gelu")
  assert "GELU" in _reason(MosaicGpuRaggedDotConfig(tile_m=64, tile_n=128), **gated_gelu)
  assert _reason(MosaicGpuRaggedDotConfig(tile_m=64, tile_n=64), **gated_gelu) is None
  assert "at least 2" in _reason(MosaicGpuRaggedDotConfig(stages=1))
  assert "bytes of SMEM" in _reason(MosaicGpuRaggedDotConfig(tile_m=64, tile_n=256, stages=8))


def test_h100_keeps_triton_and_tunes_mosaic_gpu():
  """The heuristic leaves H100 to the Triton kernel; autotuning times Mosaic GPU next to it."""
  lhs, rhs = jnp.zeros((1024, 256), jnp.bfloat16), jnp.zeros((8, 256, 512), jnp.bfloat16)
  sizes = jnp.full((8,), 128, jnp.int32)
  rows = pallax.explain_on(H100, lambda a, b: pallax.ragged_dot(a, b, sizes), lhs, rhs)
  assert [(r.op, r.implementation) for r in rows] == [("ragged_dot", "pallas")]
  params = dict(out_dtype=jnp.bfloat16, precision=None, activation=None, gated=False)
  avals = [S(lhs.shape, lhs.dtype), S(rhs.shape, rhs.dtype), S((8,), jnp.int32), S((1,), jnp.int32)]
  configs = candidate_configs(kernel_spec("ragged_dot"), avals, H100, params)
  mosaic = [c for c in configs if c.implementation == MOSAIC]
  assert {"pallas", "xla"} <= {c.implementation for c in configs} and mosaic
  assert all(isinstance(c, MosaicGpuRaggedDotConfig) for c in mosaic)
  assert MosaicGpuRaggedDotConfig(tile_m=128, tile_n=128, stages=4) in mosaic


@pytest.mark.compilers
def test_every_mosaic_gpu_config_compiles_for_h100():
  """Every Mosaic GPU grouped-GEMM config the executor can choose on an H100: no spills."""
  from pallax.verify import verify
  from pallax.verify.targets import TARGETS

  report = verify(
    ["ragged_dot", "ragged_dot_gated"],
    ["h100"],
    implementations=[MOSAIC],
    quick=True,
    workers=1,
    cache=False,
    progress=False,
  )
  results = [r for r in report.results if r["config"]["implementation"] == MOSAIC]
  assert {r["kernel"] for r in results} == {"ragged_dot", "ragged_dot_epilogue"}, results
  for r in results:
    assert r["status"] == "ok", r
    (k,) = r["kernels"]
    assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, r
    assert 0 < k["smem_bytes"] <= TARGETS["h100"].shared_memory_limit, r
