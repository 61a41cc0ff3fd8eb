"""Continuous batching on pallax's serving ops gives each request's tokens as alone.

``examples/serving.py`` serves three requests of a small Llama-architecture
model over a paged KV cache (``ragged_paged_attention``, ``update_kv_cache``,
``apply_rotary``): one joins mid-way, prompts go in chunks of 16 tokens
beside the others' decode steps. Every request's greedy tokens must equal
those of running it alone with ``dot_product_attention`` over its whole
sequence, recomputed each step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples import serving  # noqa: E402


def test_continuous_batching_matches_each_request_alone():
  params = serving.init_params()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, serving.VOCAB, n).tolist() for n in (37, 21, 30)]
  requests = [
    serving.Request(prompts[0], new_tokens=8, arrival=0),
    serving.Request(prompts[1], new_tokens=12, arrival=0),
    serving.Request(prompts[2], new_tokens=6, arrival=3),  # joins mid-way
  ]
  steps = serving.serve(params, requests)
  # A prefill chunk beside another request's decode token, and chunks of 16.
  assert any(16 in q_lens and 1 in q_lens for q_lens in steps), steps
  assert len(steps[3]) == 3 and steps[3][2] == 16, steps  # the late request's first chunk
  for i, request in enumerate(requests):
    alone = serving.generate_alone(params, request.prompt, request.new_tokens)
    assert request.generated == alone, (i, request.generated, alone)
