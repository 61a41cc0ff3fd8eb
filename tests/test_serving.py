"""Continuous batching on pallax's serving ops gives each request's tokens and logits as alone.

``examples/serving.py`` serves three requests of a small Llama-architecture
model over a paged KV cache (``ragged_paged_attention``, ``update_kv_cache``,
``apply_rotary``): one joins mid-way, prompts go in chunks of 16 tokens
beside the others' decode steps, the pools start as NaN (a key read that was
never written poisons the logits). Every request's greedy tokens must equal
those of running it alone with ``dot_product_attention`` over its whole
sequence, recomputed each step, and the logits they came from must agree to
float32 rounding. Once with the executor's choice (items of 16 query tokens
on the CPU), once with items of 4 tokens, a chunk spanning four of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import pallax

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples import serving  # noqa: E402

PINNED = pallax.RaggedPagedAttentionConfig(implementation="xla", block_q=4)


@pytest.mark.parametrize("block_q", ["chosen", "4"])
def test_continuous_batching_matches_each_request_alone(block_q):
  params = serving.init_params()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, serving.VOCAB, n).tolist() for n in (37, 21, 30)]
  requests = [
    serving.Request(prompts[0], new_tokens=8, arrival=0),
    serving.Request(prompts[1], new_tokens=12, arrival=0),
    serving.Request(prompts[2], new_tokens=6, arrival=3),  # joins mid-way
  ]
  if block_q == "chosen":
    steps = serving.serve(params, requests)
  else:  # a fresh jit, traced under the pinned config
    with pallax.default_executor().overlay({"ragged_paged_attention": PINNED}):
      step = jax.jit(serving.step_fn, donate_argnums=(1,))
      steps = serving.serve(params, requests, step=step)
  # A prefill chunk beside another request's decode token, and chunks of 16.
  assert any(16 in q_lens and 1 in q_lens for q_lens in steps), steps
  assert len(steps[3]) == 3 and steps[3][2] == 16, steps  # the late request's first chunk
  for i, request in enumerate(requests):
    alone, logits = serving.generate_alone(params, request.prompt, request.new_tokens)
    assert request.generated == alone, (i, request.generated, alone)
    for got, want in zip(request.logits, logits):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
