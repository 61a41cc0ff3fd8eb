"""The order of the GPU attention kernels' query tiles: under a causal mask, last to first.

``Problem.last_query_tile_first`` (``kernels/attention/common.py``): a GPU
starts blocks of threads in the grid's order, and under a causal mask a
later query tile sees more keys, so the longest tiles go first. The kernels'
numerics under that order are the attention tests'; these check the rule.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax.executor.tools import kernel_calls
from pallax.kernels.attention.common import Blocks, Problem
from pallax.op import op_params

T = 256


def _problem(**kwargs) -> Problem:
  """The Problem of the forward kernel call of a (1, T, 2, 64) attention with ``kwargs``."""
  q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.bfloat16)
  fn = lambda q, k, v: pallax.dot_product_attention(q, k, v, **kwargs)
  jaxpr = jax.make_jaxpr(fn)(q, q, q).jaxpr
  (eqn,) = [e for e in kernel_calls(jaxpr) if e.primitive.name == "dot_product_attention_fwd"]
  return Problem.of([v.aval for v in eqn.invars], **op_params(eqn.params))


@pytest.mark.parametrize(
  ("kwargs", "last_first"),
  [
    ({"is_causal": True}, True),
    ({"is_causal": True, "local_window_size": (40, 0)}, False),  # a causal window: flat
    ({"local_window_size": (40, 10)}, False),
    ({}, False),
  ],
  ids=["causal", "causal-window", "window", "none"],
)
def test_causal_query_tiles_run_last_to_first(kwargs, last_first):
  p = _problem(**kwargs)
  assert p.last_query_tile_first == last_first
  blocks = Blocks(p, bq=64, bk=64)
  order = [int(blocks.query_block(jnp.int32(i))) for i in range(blocks.nq)]
  assert order == ([3, 2, 1, 0] if last_first else [0, 1, 2, 3])
  starts = [int(blocks.query_start(jnp.int32(i))) for i in range(blocks.nq)]
  assert starts == [64 * i for i in order]


def test_a_left_bound_alone_keeps_the_order():
  """A later query tile sees fewer keys there (not reachable from ``dot_product_attention``)."""
  p = dataclasses.replace(_problem(), left=40, right=None)
  assert not p.last_query_tile_first
  assert [p.query_tile(i, 4) for i in range(4)] == [0, 1, 2, 3]
