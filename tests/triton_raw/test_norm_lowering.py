"""rms_norm's raw Triton kernels lowered for cuda without a GPU, and the calls they refuse.

jax-triton compiles a raw kernel while the program is lowered, for the compute
capability ``pallax.triton_raw.compute_capability`` names (90: H100, 80:
A100), and leaves a ``triton_kernel_call`` custom call per launch. Their
numerics are tested under Triton's interpreter (``interpreted_norm.py``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax import triton_raw
from pallax.kernels.norm import NormConfig
from tests.helpers import CALL_TARGET, executor_view, lower_text

pytestmark = pytest.mark.lowering

RAW = NormConfig(block_rows=4, num_warps=4, implementation="triton_raw")
RAW_CALL = "triton_kernel_call"
DTYPES = (jnp.float32, jnp.bfloat16)


def raw_rms_norm(x, w):
  return pallax.rms_norm(x, w, offset=1.0, config=RAW)


def raw_grad(x, w):
  return jax.grad(lambda x, w: raw_rms_norm(x, w).astype(jnp.float32).sum(), (0, 1))(x, w)


def _calls(fn, cc, *args) -> int:
  """How many raw Triton launches ``fn`` lowers to on cuda at compute capability ``cc``."""
  with triton_raw.compute_capability(cc):
    text = lower_text(fn, "cuda", *args)
  assert CALL_TARGET["cuda"] not in text, "a Pallas kernel where the raw one was pinned"
  return text.count(RAW_CALL)


@pytest.mark.compilers
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("cc", [90, 80])
def test_forward_and_grad_lower_to_raw_launches(cc, dtype):
  x = jax.ShapeDtypeStruct((1000, 200), dtype)
  w = jax.ShapeDtypeStruct((200,), dtype)
  assert _calls(raw_rms_norm, cc, x, w) == 1
  assert _calls(raw_grad, cc, x, w) == 2  # forward and backward


@pytest.mark.compilers
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_vmap_lowers_to_one_launch_per_stage(dtype):
  """A mapped weight (one weight group per example): still one launch per stage."""
  x = jax.ShapeDtypeStruct((3, 100, 200), dtype)
  w = jax.ShapeDtypeStruct((3, 200), dtype)
  assert _calls(jax.vmap(raw_rms_norm), 90, x, w) == 1
  assert _calls(jax.vmap(raw_grad), 90, x, w) == 2


def test_cpu_refuses_raw_kernels_outside_the_interpreter():
  x, w = jnp.ones((13, 40)), jnp.ones((40,))
  with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
    jax.jit(raw_rms_norm)(x, w)


@pytest.mark.parametrize(
  "fn",
  [
    lambda x, w: pallax.layer_norm(x, w, config=RAW),
    lambda x, w: pallax.fused_add_rms_norm(x, x, w, config=RAW)[0],
  ],
  ids=["layer_norm", "fused_add_rms_norm"],
)
def test_other_norms_have_no_raw_kernel(fn):
  x, w = jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32)
  with pytest.raises(ValueError, match="has no triton_raw kernel"):
    _calls(fn, 90, x, w)


def test_refuses_float64_and_rows_that_spill():
  with jax.enable_x64(True):
    x = jax.ShapeDtypeStruct((64, 256), jnp.float64)
    with pytest.raises(ValueError, match="float64 has no raw Triton kernel"):
      _calls(raw_rms_norm, 90, x, jax.ShapeDtypeStruct((256,), jnp.float64))
  x = jax.ShapeDtypeStruct((8, 32768), jnp.bfloat16)
  with pytest.raises(ValueError, match="wider than 16384"):
    _calls(raw_rms_norm, 90, x, jax.ShapeDtypeStruct((32768,), jnp.bfloat16))


@pytest.mark.parametrize("shape", [(1024, 1024), (1000, 4000), (64, 16384)], ids=str)
def test_autotuning_on_cuda_times_a_raw_twin_of_every_pallas_candidate(shape):
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  w = jax.ShapeDtypeStruct(shape[-1:], jnp.bfloat16)
  params = dict(eps=1e-6, offset=0.0)
  _, candidates, supports = executor_view("rms_norm_fwd")
  configs = candidates([x, w], "cuda", **params)
  pallas = [c for c in configs if c.implementation == "pallas"]
  raw = [c for c in configs if c.implementation == "triton_raw"]
  assert pallas and raw == [dataclasses.replace(c, implementation="triton_raw") for c in pallas]
  assert all(supports([x, w], "cuda", c, **params) is None for c in raw)
  _, layer_candidates, _ = executor_view("layer_norm_fwd")
  layer = layer_candidates([x, w, w], "cuda", **params)
  assert not [c for c in layer if c.implementation == "triton_raw"]
