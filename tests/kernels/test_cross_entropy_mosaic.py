"""The Mosaic TPU cross-entropy kernels, called directly: numerics, configs, TPU lowering.

Each stage (``fwd``, ``jvp``, ``bwd``) runs interpreted (compiled on a real
TPU) and is compared with the XLA program of the same stage and with an
independent float64 reference written from the definition: the full logits
``z = x @ w + b``, the soft cap, ``jax.nn.logsumexp``, and ``jax.jvp`` /
``jax.vjp`` of that for the tangent and backward stages. Odd sizes with
pinned small blocks split tokens, vocabulary and hidden dim into several
ragged blocks, whose padding the interpreter fills with NaN: a value that
leaks from it into a sum fails the comparison. Labels include 0, V - 1 and
labels outside ``[0, V)`` (negative and >= V, whose ``zy`` is 0).

Tolerances (max relative error against float64): ``tests.helpers.TOL``,
1e-5 for float32; bfloat16 inputs 1e-2 (the logits are exact float32 sums of
bfloat16 products, but the backward's matmuls take the logits' cotangent
rounded to bfloat16, and ``dx``, ``dw``, ``db`` are bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallax.kernels.cross_entropy import config as ce_config
from pallax.kernels.cross_entropy import mosaic_tpu, xla
from pallax.kernels.cross_entropy.common import Problem
from pallax.kernels.cross_entropy.config import CrossEntropyConfig
from tests.conftest import PLATFORM
from tests.helpers import CALL_TARGET, as64, assert_close, lower_text, rand, x64

INTERPRET = PLATFORM != "tpu"
SMALL = CrossEntropyConfig(block_n=8, block_v=128, block_d=128)
SMALL_BF16 = CrossEntropyConfig(block_n=16, block_v=128, block_d=128)
N, D, V = 21, 200, 301


def _labels(rng, groups: int, tokens: int, vocab: int) -> jax.Array:
  """Random labels in ``[-3, V + 3)`` with 0, V - 1, a negative one and V among them."""
  labels = rng.integers(-3, vocab + 3, (groups, tokens))
  labels[:, :4] = [0, vocab - 1, -1, vocab]
  return jnp.asarray(labels, jnp.int32)


def _reference_stats(soft_cap, linear, transposed_weight, labels, x, w=None, b=None):
  """``(lse, zy, zsum)`` from the full logits (call under ``x64()``)."""
  if linear:
    z = jnp.einsum("gnd,gvd->gnv" if transposed_weight else "gnd,gdv->gnv", x, w)
    if b is not None:
      z = z + b[:, None, :]
  else:
    z = x
  if soft_cap is not None:
    z = soft_cap * jnp.tanh(z / soft_cap)
  vocab = z.shape[-1]
  inside = (labels >= 0) & (labels < vocab)
  zy = jnp.take_along_axis(z, jnp.clip(labels, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(z, axis=-1), jnp.where(inside, zy, 0), jnp.sum(z, axis=-1)


def _case(
  rng,
  dtype,
  *,
  groups=1,
  tokens=N,
  hidden=D,
  vocab=V,
  linear=True,
  has_bias=False,
  transposed_weight=False,
  soft_cap=None,
):
  """Primals, tangents, cotangents and params of one call."""
  params = dict(
    linear=linear, has_bias=has_bias, transposed_weight=transposed_weight, soft_cap=soft_cap
  )
  if linear:
    w_shape = (groups, vocab, hidden) if transposed_weight else (groups, hidden, vocab)
    shapes = [(groups, tokens, hidden), w_shape] + [(groups, vocab)] * has_bias
    scales = [1.0, hidden**-0.5 * 3, 1.0]
  else:
    shapes, scales = [(groups, tokens, vocab)], [3.0]
  floats = [rand(rng, s, dtype, scale=c) for s, c in zip(shapes, scales)]
  tangents = [rand(rng, s, dtype, scale=c) for s, c in zip(shapes, scales)]
  cotangents = [rand(rng, (groups, tokens), jnp.float32) for _ in range(3)]
  return floats, _labels(rng, groups, tokens, vocab), tangents, cotangents, params


def _check_stages(floats, labels, tangents, cotangents, params, config, dtype):
  """Every stage of the kernel against the XLA program and the float64 reference."""
  primals = [*floats, labels]
  kernel = lambda stage: jax.jit(
    lambda *ops: getattr(mosaic_tpu, stage)(*ops, config=config, interpret=INTERPRET, **params)
  )
  program = lambda stage: jax.jit(lambda *ops: getattr(xla, stage)(*ops, **params))

  @jax.jit
  def reference(floats, tangents, cotangents):
    ref = lambda *fs: _reference_stats(
      params["soft_cap"], params["linear"], params["transposed_weight"], labels, *fs
    )
    return ref(*floats), jax.jvp(ref, floats, tangents)[1], jax.vjp(ref, *floats)[1](cotangents)

  with x64():
    wants = reference(as64(*floats), as64(*tangents), tuple(as64(*cotangents)))

  lse = program("fwd")(*primals)[0]
  extra = {"fwd": [], "jvp": [lse, *tangents], "bwd": [lse, *cotangents]}
  for stage, want in zip(("fwd", "jvp", "bwd"), wants):
    got = kernel(stage)(*primals, *extra[stage])
    prog = program(stage)(*primals, *extra[stage])
    assert len(got) == len(prog) == len(want), stage
    for k, (g, p, w) in enumerate(zip(got, prog, want)):
      assert (g.shape, g.dtype) == (p.shape, p.dtype), (stage, k, g.shape, g.dtype, p.dtype)
      assert_close(g, w, dtype, f"{stage}[{k}] vs float64")
      assert_close(g, p, dtype, f"{stage}[{k}] vs the XLA program")


LINEAR_CASES = {
  "bias": dict(has_bias=True),
  "transposed_bias_cap": dict(has_bias=True, transposed_weight=True, soft_cap=3.0),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_multi_block(case):
  """Ragged token, vocabulary and hidden blocks (3 x 3 x 2 of them), float32."""
  rng = np.random.default_rng(len(case))
  _check_stages(*_case(rng, jnp.float32, **LINEAR_CASES[case]), SMALL, jnp.float32)


def test_linear_bfloat16_multi_block():
  """2 x 3 x 2 blocks, a soft cap, no bias."""
  rng = np.random.default_rng(1)
  case = _case(rng, jnp.bfloat16, soft_cap=3.0)
  _check_stages(*case, SMALL_BF16, jnp.bfloat16)


def test_linear_heuristic_blocks():
  """The heuristic's blocks: here one block of all tokens, vocabulary and hidden columns."""
  rng = np.random.default_rng(2)
  floats, labels, tangents, cotangents, params = _case(rng, jnp.float32, has_bias=True)
  avals = [jax.typeof(a) for a in (*floats, labels)]
  config = ce_config.heuristic(avals, "tpu", stage="fwd", **params)
  assert (config.block_n, config.block_v, config.block_d) == (N, V, D)
  _check_stages(floats, labels, tangents, cotangents, params, config, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_logits_only(dtype):
  """The fused softmax cross-entropy: 3 x 3 ragged blocks (2 groups of 2 x 3 in bfloat16).

  float32 with a soft cap, bfloat16 without.
  """
  rng = np.random.default_rng(3)
  f32 = dtype == jnp.float32
  config = SMALL if f32 else SMALL_BF16
  case = _case(rng, dtype, groups=1 if f32 else 2, linear=False, soft_cap=5.0 if f32 else None)
  _check_stages(*case, config, dtype)


def _avals(dtype, tokens, hidden, vocab, linear=True, transposed_weight=False, has_bias=False):
  if not linear:
    return [
      jax.ShapeDtypeStruct((1, tokens, vocab), dtype),
      jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    ]
  w = (1, vocab, hidden) if transposed_weight else (1, hidden, vocab)
  out = [jax.ShapeDtypeStruct((1, tokens, hidden), dtype), jax.ShapeDtypeStruct(w, dtype)]
  out += [jax.ShapeDtypeStruct((1, vocab), dtype)] * has_bias
  return out + [jax.ShapeDtypeStruct((1, tokens), jnp.int32)]


SIZES = [(8192, 1024, 32768), (1000, 4096, 50257), (16, 2048, 32001), (37, 200, 301)]


@pytest.mark.parametrize("stage", ["fwd", "jvp", "bwd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_tpu_configs_are_legal_and_fit(size, dtype, stage):
  """The heuristic is among the candidates, and every candidate is legal and fits the VMEM cap."""
  for linear in (True, False):
    params = dict(linear=linear, has_bias=linear, transposed_weight=False, soft_cap=None)
    avals = _avals(dtype, *size, linear=linear, has_bias=linear)
    base = ce_config.heuristic(avals, "tpu", stage=stage, **params)
    found = ce_config.candidates(avals, "tpu", stage=stage, **params)
    assert found and found[0] == base
    p = Problem.of(avals, **params)
    for c in found:
      assert ce_config.supports(avals, "tpu", c, stage=stage, **params) is None, c
      assert ce_config.tpu_vmem(p, c, stage) <= ce_config._TPU_VMEM_CAP


def test_supports_refuses_vmem_overflow_and_bad_blocks():
  avals = _avals(jnp.float32, 4096, 8192, 32768)
  params = dict(linear=True, has_bias=False, transposed_weight=False, soft_cap=None)
  huge = CrossEntropyConfig(block_n=1024, block_v=2048, block_d=8192)
  assert "VMEM" in ce_config.supports(avals, "tpu", huge, stage="bwd", **params)
  assert ce_config.supports(avals, "interpret-mosaic_tpu", huge, stage="bwd", **params) is None
  odd = CrossEntropyConfig(block_n=12, block_v=128, block_d=128)
  assert "multiple of 8" in ce_config.supports(avals, "tpu", odd, stage="fwd", **params)


LOWERING_CASES = {
  "linear_bias_cap": dict(linear=True, has_bias=True, soft_cap=30.0),
  "linear_transposed": dict(linear=True, transposed_weight=True),
  "logits_cap": dict(linear=False, soft_cap=30.0),
}


@pytest.mark.lowering
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", list(LOWERING_CASES))
@pytest.mark.parametrize("stage", ["fwd", "jvp", "bwd"])
def test_lowers_for_tpu(stage, case, dtype):
  """Each stage lowers to Mosaic (one kernel; two for the linear backward), ragged blocks."""
  params = dict(linear=True, has_bias=False, transposed_weight=False, soft_cap=None)
  params.update(LOWERING_CASES[case])
  prim = _avals(
    dtype, 100, 200, 1000, params["linear"], params["transposed_weight"], params["has_bias"]
  )
  floats = prim[:-1]
  stat = jax.ShapeDtypeStruct((1, 100), jnp.float32)
  extra = {"fwd": [], "jvp": [stat, *floats], "bwd": [stat] * 4}[stage]
  config = SMALL if dtype == jnp.float32 else SMALL_BF16
  fn = lambda *ops: getattr(mosaic_tpu, stage)(*ops, config=config, interpret=False, **params)
  kernels = 2 if stage == "bwd" and params["linear"] else 1
  assert lower_text(fn, "tpu", *prim, *extra).count(CALL_TARGET["tpu"]) == kernels
