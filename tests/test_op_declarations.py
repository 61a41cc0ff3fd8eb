"""The declaration API of ``pallax.op``: one way to declare an op, a user's or a built-in.

``pallax.custom_op`` builds a ``pallax.op.Declaration`` and hands its
``PrimitiveSpec`` to ``define_primitive``; ``paged_attention`` is declared
through it. These tests check the shared pieces (the dims string, the fold
rule's ``merge_into``, a ``Declaration`` given to ``define_primitive`` by
hand) against independent float64 numpy, and that the built-in op declared
this way is still pallax's own kernel with its own params.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import ad, batching

import pallax
from pallax.executor.registry import kernel_spec
from pallax.op import (
  BATCHED,
  Declaration,
  Dims,
  DimsRule,
  define_primitive,
  merge_into,
)
from pallax.primitives import paged_attention as paged
from pallax.verify import sweep
from tests.helpers import assert_close, rand, x64
from tests.primitives.test_paged_attention import _small

# The sharding dims paged_attention declared by hand before it was a custom op.
PAGED_DIMS = Dims(
  operands=(
    ("b", "k", "g", "h"),
    ("k", "p", "ps", "h"),
    ("k", "p", "ps", "hv"),
    ("b",),
    ("b", "pp"),
  ),
  results=(("b", "k", "g", "hv"),),
  replicated=("h", "p", "ps", "hv", "pp"),
)


def _structs(*shapes):
  return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]


def test_dims_string_gives_the_hand_written_dims():
  rule = DimsRule("b k g h, k p ps h, k p ps hv, b, b pp -> b k g hv", ("h", "p", "ps", "hv", "pp"))
  avals = _structs((3, 2, 2, 8), (2, 5, 4, 8), (2, 5, 4, 6), (3,), (3, 4))
  assert rule(avals, _structs((3, 2, 2, 6)), {}) == PAGED_DIMS
  ellipsis = DimsRule("... c, c -> ... c")
  got = ellipsis(_structs((2, 3, 4), (4,)), _structs((2, 3, 4)), {})
  assert got.operands == (("_e1", "_e0", "c"), ("c",)) and got.results == (("_e1", "_e0", "c"),)
  with pytest.raises(ValueError, match="factor 'c'"):
    ellipsis.check_operands("op", _structs((2, 3, 4), (5,)))


@pytest.mark.parametrize("bdim", [0, 1, 2, None])
@pytest.mark.parametrize("position", [0, 1])
def test_merge_into_matches_numpy(bdim, position):
  rng = np.random.default_rng(0)
  size, example = 3, (4, 5)
  shape = example if bdim is None else example[:bdim] + (size,) + example[bdim:]
  a = rng.standard_normal(shape)
  stacked = np.broadcast_to(a, (size, *example)) if bdim is None else np.moveaxis(a, bdim, 0)
  # Vmapped index major: example v's entries of dim ``position`` come v-th.
  want = np.concatenate([stacked[v] for v in range(size)], axis=position)
  with x64():
    got = merge_into(jnp.asarray(a), bdim, size, position)
  np.testing.assert_array_equal(np.asarray(got), want)


def _scale_rows(x, w, *, power):
  return x * w**power


def test_a_declaration_given_to_define_primitive_by_hand():
  """The lower-level route: the same ``Declaration`` ``custom_op`` builds, vmap folded, AD."""
  declaration = Declaration(
    "test_declared_scale_rows", _scale_rows, {}, None, DimsRule("r c, c -> r c"), "fold"
  )
  prim = define_primitive(declaration.name, declaration.spec())
  ad.primitive_jvps[prim] = declaration.jvp_rule(prim)
  op = lambda x, w: pallax.op.bind(prim, x, w, power=3, **declaration.bind_params())[0]
  rng = np.random.default_rng(1)
  x, w = rand(rng, (4, 6, 5)), rand(rng, (5,))
  f = jax.vmap(op, in_axes=(1, None))
  want = np.moveaxis(np.asarray(x, np.float64), 1, 0) * np.asarray(w, np.float64) ** 3
  assert_close(f(x, w), want, jnp.float32, "vmap")
  eqns = [e for e in jax.make_jaxpr(f)(x, w).jaxpr.eqns if e.primitive is prim]
  assert len(eqns) == 1 and eqns[0].params[BATCHED] is False  # folded into r
  grad = jax.grad(lambda w: jnp.sum(op(x[:, 0], w)))(w)
  want_grad = 3 * np.sum(np.asarray(x[:, 0], np.float64), axis=0) * np.asarray(w, np.float64) ** 2
  assert_close(grad, want_grad, jnp.float32, "grad")


def _front(prim, args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  outs = prim.bind(*(batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)), **params)
  return outs, [0] * len(outs)


own_rule = pallax.custom_op(
  "test_declared_own_rule",
  reference=lambda x, y: x * y,
  dims="... c, ... c -> ... c",
  batching=_front,
)


def test_an_own_batching_rule_binds_the_ops_params_only():
  """Under a rule of its own an op binds no ``batched`` param (the fold rule's), as before."""
  rng = np.random.default_rng(2)
  x, y = rand(rng, (3, 8)), rand(rng, (8,))
  f = jax.vmap(lambda x: own_rule(x, y))
  assert_close(f(x), np.asarray(x, np.float64) * np.asarray(y, np.float64), jnp.float32)
  (eqn,) = [e for e in jax.make_jaxpr(f)(x).jaxpr.eqns if e.primitive is own_rule.primitive]
  assert set(eqn.params) == {"config", "interpret", "executor"}
  with pytest.raises(ValueError, match="reserved"):
    own_rule(x, x, batched=True)


def test_paged_attention_is_declared_through_custom_op():
  op = paged.paged_attention_op
  assert isinstance(op, pallax.CustomOp) and op.primitive is paged.paged_attention_p
  assert op.primitive.name == "paged_attention" and op.config_cls is pallax.PagedAttentionConfig
  spec = kernel_spec("paged_attention")
  assert inspect.unwrap(spec.heuristic).__module__ == "pallax.kernels.paged_attention.config"
  assert spec.implementations == ("pallas",)
  assert "paged_attention" in sweep.library_kernels()  # still one of pallax's own kernels
  eqns = jax.make_jaxpr(pallax.paged_attention)(*_small()).jaxpr.eqns
  (eqn,) = [e for e in eqns if e.primitive is op.primitive]
  assert set(eqn.params) == {"config", "interpret", "executor", "scale", "logits_soft_cap"}


@dataclasses.dataclass(frozen=True)
class _OwnConfig(pallax.KernelConfig):
  tile: int = 64
  implementation: str = dataclasses.field(default="pallas_mosaic_gpu", kw_only=True)


def test_an_own_config_space_may_leave_the_choice_to_the_others():
  """An implementation's own space whose heuristic returns None offers no config, never None."""
  shared = pallax.ConfigSpace(_OwnConfig, heuristic=lambda avals, target, **p: _OwnConfig())
  own = pallax.ConfigSpace(_OwnConfig, heuristic=lambda avals, target, **p: None)
  kernel = lambda x, w, *, config, interpret, power: x
  declaration = Declaration(
    "test_declared_own_space",
    _scale_rows,
    {"pallas_triton": kernel, "pallas_mosaic_gpu": kernel},
    shared,
    DimsRule("r c, c -> r c"),
    "fold",
    own_configs={"pallas_mosaic_gpu": own},
  )
  spec = declaration.kernel()
  avals = _structs((4, 5), (5,))
  space = spec.spaces["pallas_mosaic_gpu"]
  assert space.heuristic(avals, "cuda", power=2) is None
  assert space.configs(avals, "cuda", power=2) == []
  assert spec.space.configs(avals, "cuda", power=2) == [_OwnConfig()]
  # The op's shared space must give a config.
  shared_none = Declaration(
    "test_declared_shared_none",
    _scale_rows,
    {"pallas_triton": kernel},
    own,
    DimsRule("r c, c -> r c"),
    "fold",
  )
  with pytest.raises(TypeError, match="must return a _OwnConfig"):
    shared_none.kernel().space.heuristic(avals, "cuda", power=2)
