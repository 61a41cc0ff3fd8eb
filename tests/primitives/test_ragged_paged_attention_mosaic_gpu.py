"""ragged_paged_attention's Mosaic GPU (Hopper) kernel: interpreted, its refusals, its selection.

The kernel runs in JAX's GPU interpreter (its interpreted form:
docs/mosaic_gpu.md) on mixed batches of ragged_paged_attention_reference.py
against the float64 reference at the 16-bit tolerances: pages smaller than a
key block (a TMA copy a page) and larger (a slice of one), key blocks
overhanging a sequence's cache into NaN rows, several items a sequence,
splits of an item's keys (some empty), windows, soft caps, sinks and a value
head dim of its own. Its config is pinned: the heuristic leaves H100 calls to
the Triton kernel until the kernel is measured on a GPU. Under
``PALLAX_TEST_PLATFORM=gpu`` (on a Hopper GPU: ``bench/hopper.sh``) the same
cases run the kernel compiled.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor import Target
from pallax.executor.executor import candidate_configs
from pallax.executor.registry import kernel_spec
from pallax.kernels.ragged_paged_attention import mosaic_gpu
from tests.conftest import PLATFORM
from tests.helpers import assert_close
from tests.primitives.ragged_paged_attention_reference import Batch, inputs, reference

Config = pallax.MosaicGpuRaggedPagedAttentionConfig
MOSAIC = mosaic_gpu.IMPLEMENTATION
H100 = Target("cuda", "h100")

# name -> (batch, dtype, config, statics)
CASES = {
  # MQA (4 query heads a kv head), 16-token pages: 4 TMA copies a 64-key step;
  # sequence 0's 6 queries in two items of 4 tokens, each over 130 keys in
  # two splits: their causal edge inside a block within the cache, the last
  # block overhanging it into NaN rows; sequence 1's 30 keys in one block,
  # its second split empty.
  "mqa-small-pages-splits": (
    Batch(
      q_lens=(6, 1),
      kv_lens=(130, 30),
      n=4,
      k=1,
      h=64,
      page_size=16,
      pages_per_sequence=9,
      pad_tokens=1,
    ),
    jnp.bfloat16,
    Config(block_q=4, block_k=64, num_stages=2, num_splits=2),
    {},
  ),
  # 128-token pages, each 64-key step a slice of one; a soft cap, sinks and
  # value head dim 128 beside 64. Sequence 0's 3 queries (positions 197-199)
  # in one item: its window of 70 starts at key 128 for the first and 130
  # for the last, so the block of keys 128-191 is masked whole inside the cache.
  "large-pages-window-cap-sinks": (
    Batch(
      q_lens=(3, 1),
      kv_lens=(200, 40),
      n=2,
      k=1,
      h=64,
      hv=128,
      page_size=128,
      pages_per_sequence=2,
      pad_tokens=1,
    ),
    jnp.float16,
    Config(block_q=4, block_k=64, num_stages=2, num_splits=1),
    dict(sliding_window=70, logits_soft_cap=5.0, sinks=np.asarray([0.5, -1.0], np.float32)),
  ),
}


def _on_mosaic_gpu():
  """Where the kernel runs: compiled on a GPU, else in JAX's GPU interpreter."""
  return contextlib.nullcontext() if PLATFORM == "gpu" else pallax.interpret("mosaic_gpu")


def _run(batch, dtype, config, seed=0, **statics):
  args = inputs(batch, dtype, seed)
  f = functools.partial(pallax.ragged_paged_attention, config=config, **statics)
  with _on_mosaic_gpu():
    assert [s.implementation for s in pallax.explain(f, *args)] == [MOSAIC]
    got = jax.jit(f)(*args)
  assert got.dtype == dtype
  assert_close(got, reference(*args, **statics), dtype, f"{batch} {config} {statics}")
  end = int(np.asarray(args[5])[int(args[6][0])])
  np.testing.assert_array_equal(np.asarray(got, np.float32)[end:], 0.0)  # no sequence's tokens


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_float64(name):
  batch, dtype, config, statics = CASES[name]
  _run(batch, dtype, config, seed=1, **statics)


@pytest.mark.slow  # 20 s interpreted; head dim 256 compiles in CI's verify
def test_kernel_head_dim_256_prefill_chunk():
  """Head dim 256 (its output leaves SMEM in two parts), 8 query heads a kv head, 16-token pages."""
  batch = Batch(
    q_lens=(9, 1), kv_lens=(200, 77), n=8, k=1, h=256, page_size=16, pages_per_sequence=13
  )
  _run(batch, jnp.bfloat16, Config(block_q=8, block_k=64, num_stages=2, num_splits=2), seed=2)


def _avals(dtype=jnp.bfloat16, h=128, page_size=16, n=32, k=8):
  args = inputs(
    Batch(n=n, k=k, h=h, page_size=page_size, pages_per_sequence=4), dtype, nan_fill=False
  )
  q = jnp.zeros((args[0].shape[0], k, n // k, h), dtype)  # the primitive's grouped layout
  return [q, *args[1:]], dict(scale=0.1)


@pytest.mark.parametrize(
  "change, config, match",
  [
    (dict(dtype=jnp.float32), Config(), "bfloat16 and float16"),
    (dict(h=80), Config(), "64, 128 or 256"),
    (dict(h=192), Config(), "64, 128 or 256"),
    (dict(page_size=4), Config(), "page_size 4"),
    ({}, Config(block_k=96), "block_k=96"),
    (dict(page_size=48), Config(block_k=64), "one must divide the other"),
    ({}, Config(block_q=32), "64 rows"),
    (dict(h=256), Config(block_k=256, num_stages=4), "bytes of SMEM"),
  ],
  ids=["float32", "head-80", "head-192", "page-4", "block-96", "page-48", "rows", "smem"],
)
def test_refusals_name_the_reason(change, config, match):
  avals, params = _avals(**change)
  assert match in mosaic_gpu.supports(avals, "cuda", config, **params)


def test_h100_runs_triton_and_tunes_mosaic():
  """The heuristic leaves an H100 call to Triton; autotuning times the Mosaic configs too."""
  avals, params = _avals()
  f = functools.partial(pallax.ragged_paged_attention, **params)
  args = [avals[0].reshape(avals[0].shape[0], -1, avals[0].shape[-1]), *avals[1:]]
  (step,) = pallax.explain_on(H100, f, *args)
  assert step.implementation == "pallas", str(step)  # the Triton kernel
  spec = kernel_spec("ragged_paged_attention")
  mosaic = [c for c in candidate_configs(spec, avals, H100, params) if c.implementation == MOSAIC]
  assert len(mosaic) >= 8 and all(
    mosaic_gpu.supports(avals, "cuda", c, **params) is None for c in mosaic
  )
