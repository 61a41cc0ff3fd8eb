"""The cross-entropy op's named operands: every stage's names, in binding order.

The kernels, the XLA programs, the batching, sharding and AD rules all read
the primitives' operands by these names (``common.SIGNATURE``); the order is
the contract the Pallas kernels were written against, so it is spelled out
here for each kind of call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallax.kernels.cross_entropy.common import SIGNATURE, Problem, has_tokens, inputs

_LOGITS = dict(linear=False, has_bias=False)
_LINEAR = dict(linear=True, has_bias=False)
_BIAS = dict(linear=True, has_bias=True)

STAGES = [
  (_LOGITS, "fwd", ("x", "labels"), ("lse", "zy", "zsum")),
  (_LOGITS, "jvp", ("x", "labels", "lse", "x_dot"), ("lse_dot", "zy_dot", "zsum_dot")),
  (_LOGITS, "bwd", ("x", "labels", "lse", "dlse", "dzy", "dzsum"), ("dx",)),
  (_LINEAR, "fwd", ("x", "w", "labels"), ("lse", "zy", "zsum")),
  (
    _LINEAR,
    "jvp",
    ("x", "w", "labels", "lse", "x_dot", "w_dot"),
    ("lse_dot", "zy_dot", "zsum_dot"),
  ),
  (_LINEAR, "bwd", ("x", "w", "labels", "lse", "dlse", "dzy", "dzsum"), ("dx", "dw")),
  (_BIAS, "fwd", ("x", "w", "b", "labels"), ("lse", "zy", "zsum")),
  (
    _BIAS,
    "jvp",
    ("x", "w", "b", "labels", "lse", "x_dot", "w_dot", "b_dot"),
    ("lse_dot", "zy_dot", "zsum_dot"),
  ),
  (_BIAS, "bwd", ("x", "w", "b", "labels", "lse", "dlse", "dzy", "dzsum"), ("dx", "dw", "db")),
]


@pytest.mark.parametrize("params,stage,operands,results", STAGES)
def test_stage_names(params, stage, operands, results):
  sig = SIGNATURE.stage(stage, params)
  assert (sig.operands, sig.results) == (operands, results)


@pytest.mark.parametrize("params", [_LOGITS, _LINEAR, _BIAS])
def test_tangent_is_linear_in_the_tangents_only(params):
  """The tangent stage is linear in the block after the residuals: the inputs' tangents."""
  operands = SIGNATURE.stage("jvp", params).operands
  block = operands[SIGNATURE.linear(params)]
  assert block == tuple(n for n in operands if n.endswith("_dot"))


def test_weights_lead_with_groups_only():
  """``w``, ``b``, their tangents and gradients have no token dims; everything else has."""
  for stage in ("fwd", "jvp", "bwd"):
    sig = SIGNATURE.stage(stage, _BIAS)
    without = [n for n in sig.operands + sig.results if not has_tokens(sig, n)]
    weights = {"w", "b", "w_dot", "b_dot", "dw", "db"}
    assert without == [n for n in sig.operands + sig.results if n in weights]


def test_problem_reads_inputs_of_any_stage():
  """``Problem.of`` finds x and w by name whatever stage's operands it is given."""
  x = jax.ShapeDtypeStruct((2, 5, 7, 16), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((2, 40, 16), jnp.float32)
  b = jax.ShapeDtypeStruct((2, 40), jnp.float32)
  tok = jax.ShapeDtypeStruct((2, 5, 7), jnp.int32)
  stat = jax.ShapeDtypeStruct((2, 5, 7), jnp.float32)
  params = dict(_BIAS, transposed_weight=True, soft_cap=None)
  for ops in (
    [x, w, b, tok],
    [x, w, b, tok, stat, x, w, b],
    [x, w, b, tok, stat, stat, stat, stat],
  ):
    p = Problem.of(ops, **params)
    assert (p.groups, p.tokens, p.hidden, p.vocab) == (2, 35, 16, 40)
    assert (p.dtype, p.w_dtype) == (jnp.bfloat16, jnp.float32)
    assert inputs(ops, params).labels is tok
