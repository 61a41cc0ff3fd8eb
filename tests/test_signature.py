"""Named operands (pallax.op.signature): each stage's names, and reads by name that can fail."""

import pytest

from pallax.op.signature import Operand, ResidualSignature, Signature

SIG = ResidualSignature(
  inputs=(
    Operand("x", differentiable=True),
    Operand("b", when="has_b", differentiable=True, broadcast=True),
    Operand("labels"),
  ),
  outputs=(Operand("y", differentiable=True), Operand("stat")),
)


@pytest.mark.parametrize("has_b", [False, True])
def test_stage_names_follow_the_declaration(has_b):
  b = ("b",) * has_b
  fwd, jvp, bwd = (SIG.stage(s, {"has_b": has_b}) for s in ("fwd", "jvp", "bwd"))
  assert fwd.operands == ("x", *b, "labels") and fwd.results == ("y", "stat")
  residuals = ("x", *b, "labels", "y", "stat")
  assert jvp.operands == residuals + ("x_dot",) + ("b_dot",) * has_b
  assert jvp.results == ("y_dot",)
  assert bwd.operands == residuals + ("dy",) and bwd.results == ("dx",) + ("db",) * has_b
  assert SIG.linear({"has_b": has_b}) == slice(len(residuals), None)
  assert bwd.operand("db" if has_b else "dx").broadcast == has_b


def test_an_input_with_a_zero_tangent_leaves_the_tangent_and_backward_stages():
  """``tangent_when``: a symbolic-zero tangent drops ``b_dot`` and ``db``, never ``x``'s."""
  sig = ResidualSignature(
    inputs=(
      Operand("x", differentiable=True),
      Operand("b", when="has_b", differentiable=True, tangent_when="b_tangent"),
    ),
    outputs=(Operand("y", differentiable=True),),
  )
  params = {"has_b": True}
  assert sig.zero_tangent_params(["x"], params) == {}  # x declares no such param
  assert sig.zero_tangent_params(["b"], {"has_b": False}) == {}  # absent: nothing to drop
  dropped = {**params, **sig.zero_tangent_params(["x", "b"], params)}
  assert dropped == {"has_b": True, "b_tangent": False}
  assert sig.stage("fwd", dropped).operands == ("x", "b")
  assert sig.stage("jvp", dropped).operands == ("x", "b", "y", "x_dot")
  assert sig.stage("bwd", dropped).results == ("dx",)
  assert sig.linear(dropped) == slice(3, None)
  assert sig.stage("jvp", params).operands == ("x", "b", "y", "x_dot", "b_dot")


def test_reads_by_name():
  bwd = SIG.stage("bwd", {"has_b": False})
  named = bwd.unpack(list(range(len(bwd.operands))))
  assert (named.x, named.dy, named["stat"]) == (0, 4, 3)
  assert named.b is None and named.db is None  # optional and absent: None
  with pytest.raises(AttributeError, match="x_dot"):
    _ = named.x_dot  # required, but another stage's: an error, never a silent None
  with pytest.raises(ValueError, match="expected 5 values"):
    bwd.unpack([0, 1])


def test_declarations_are_checked():
  with pytest.raises(ValueError, match="unique"):
    ResidualSignature(inputs=(Operand("x"),), outputs=(Operand("x"),))
  with pytest.raises(ValueError, match="name no input or output"):
    ResidualSignature(inputs=(Operand("x"),), outputs=(Operand("y"),), residuals=("z",))
  with pytest.raises(ValueError, match="tangent or cotangent"):
    ResidualSignature(inputs=(Operand("x", differentiable=True), Operand("dx")), outputs=())
  for misplaced in (
    {"inputs": (Operand("x", differentiable=True, tangent_when="x_tangent"),), "outputs": ()},
    {"inputs": (Operand("m", when="has_m", tangent_when="m_tangent"),), "outputs": ()},
    {"inputs": (), "outputs": (Operand("y", differentiable=True, tangent_when="y_tangent"),)},
  ):
    with pytest.raises(ValueError, match="optional differentiable inputs"):
      ResidualSignature(**misplaced)
  # An explicit empty residual list is no residuals, not every operand.
  none = ResidualSignature(inputs=(Operand("x", differentiable=True),), outputs=(), residuals=())
  assert none.stage("jvp", {}).operands == ("x_dot",)


def test_declare_one_call():
  sig = Signature.declare(
    (Operand("a"), Operand("bias", when="has_bias")),
    (Operand("out"), Operand("z", when="save")),
    {"has_bias": True, "save": False},
  )
  assert (sig.operands, sig.results) == (("a", "bias"), ("out",))
  refs = sig.unpack_all(["A", "BIAS", "OUT"])
  assert (refs.a, refs.bias, refs.out, refs.z) == ("A", "BIAS", "OUT", None)


def test_nested_recordings_each_keep_their_own_list():
  from pallax.op import collectives

  before = list(collectives._RECORDS)
  with collectives.recording() as outer:
    with collectives.recording() as inner:
      assert collectives._RECORDS[-2:] == [outer, inner]
    assert collectives._RECORDS[-1] is outer  # the inner one left, not an equal outer one
  assert collectives._RECORDS == before


def test_a_fixed_dims_keeps_its_replicated_and_refused_factors_in_derived_stages():
  from pallax.op.dims_rule import DimsRule
  from pallax.op.sharding import Dims

  x, y = Operand("x", differentiable=True), Operand("y", differentiable=True)
  sig = ResidualSignature(inputs=(x,), outputs=(y,))
  dims = Dims(operands=(("r", "c"),), results=(("r",),), replicated=("c",), refused={"r": "no"})
  rule = DimsRule(dims).derived(sig.stage("fwd", {}), sig.stage("bwd", {}))
  assert rule.fixed == Dims(
    operands=(("r", "c"), ("r",), ("r",)),
    results=(("r", "c"),),
    replicated=("c",),
    refused={"r": "no"},
  )
