"""paged_attention's config space: heuristics and candidates legal on every target, the rules.

The rules come from ``pallax.verify`` (README): float32 Triton blocks capped
where ptxas spilled, several pages a Mosaic step only on whole sublane tiles,
the page table within SMEM; float64 and oversized calls run the XLA program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor.registry import TARGETS
from tests.helpers import executor_view

heuristic, candidates, supports = executor_view("paged_attention")
Config = pallax.PagedAttentionConfig
PARAMS = dict(scale=0.1, logits_soft_cap=None)


def _avals(b=32, n=32, kv=8, h=128, page_size=16, pps=256, dtype=jnp.bfloat16):
  f = lambda *s: jax.ShapeDtypeStruct(s, dtype)
  i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  return [f(b, kv, n // kv, h), f(kv, b * pps, page_size, h), f(kv, b * pps, page_size, h)] + [
    i(b),
    i(b, pps),
  ]


SHAPES = {
  "decode": dict(),
  "float32": dict(dtype=jnp.float32),
  "small-pages-head-80": dict(b=3, n=12, kv=4, h=80, page_size=8, pps=37),
  "mqa-float16": dict(b=8, n=8, kv=1, h=64, page_size=32, pps=64, dtype=jnp.float16),
  "head-256-float32": dict(b=4, n=16, kv=2, h=256, pps=64, dtype=jnp.float32),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_heuristic_and_candidates_are_legal(target, shape):
  avals = _avals(**SHAPES[shape])
  chosen = heuristic(avals, target, **PARAMS)
  reason = supports(avals, target, chosen, **PARAMS)
  assert (chosen.implementation == "xla") == (target == "cpu")
  if target == "tpu" and avals[0].dtype == jnp.float16:  # the executor runs the XLA program
    assert "float16" in reason
    return
  assert reason is None, (chosen, reason)
  found = candidates(avals, target, **PARAMS)
  assert found and len(set(found)) == len(found)
  for config in found:
    assert supports(avals, target, config, **PARAMS) is None, config


def test_triton_splits_fill_the_gpu():
  config = heuristic(_avals(), "cuda", **PARAMS)
  assert config.num_splits == 2  # 256 (sequence, kv head) programs, 2 splits: 512
  assert heuristic(_avals(b=1, kv=1, n=8), "cuda", **PARAMS).num_splits == 16
  assert heuristic(_avals(pps=1), "cuda", **PARAMS).num_splits == 1  # one block: no split


@pytest.mark.parametrize(
  "shape, block_k, refused",
  [("float32", 64, True), ("float32", 32, False), ("decode", 128, False)],
)
def test_triton_blocks_that_spilled_are_refused(shape, block_k, refused):
  reason = supports(_avals(**SHAPES[shape]), "cuda", Config(block_k=block_k), **PARAMS)
  assert (reason is not None) == refused, reason
  if refused:
    assert "spills" in reason


def test_mosaic_stacks_pages_only_on_whole_sublane_tiles():
  small = _avals(**SHAPES["small-pages-head-80"])  # bfloat16 pages of 8 rows: half a tile
  assert heuristic(small, "tpu", **PARAMS).pages_per_block == 1
  assert "sublanes" in supports(small, "tpu", Config(pages_per_block=2), **PARAMS)
  assert supports(small, "interpret-mosaic_tpu", Config(pages_per_block=2), **PARAMS) is None
  assert heuristic(_avals(), "tpu", **PARAMS).pages_per_block == 16


def test_big_page_tables_and_float64_run_the_xla_program():
  assert "SMEM" in supports(_avals(b=256, pps=512), "tpu", Config(), **PARAMS)
  f64 = _avals(dtype=jnp.float64)
  for target in ("cuda", "tpu"):
    assert "float64" in supports(f64, target, Config(), **PARAMS)


@pytest.mark.parametrize("field", ["block_k", "num_splits", "pages_per_block", "num_warps"])
def test_config_validation_and_json_round_trip(field):
  with pytest.raises(ValueError, match=field):
    Config(**{field: 0})
  config = Config(block_k=32, num_splits=4, pages_per_block=8)
  assert Config.from_json(config.to_json()) == config
