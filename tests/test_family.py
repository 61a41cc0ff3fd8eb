"""pallax.family: every public op brings its self-check, sweep, bench suite and work model."""

import dataclasses
import inspect

import pytest

import pallax
from pallax import bench, family, roofline, selfcheck
from pallax.family import BenchSuite, OpTools
from pallax.verify import sweep


def _public_ops():
  """The public functions of pallax that are ops: those its primitives modules define."""
  return {
    name
    for name in pallax.__all__
    if inspect.isfunction(obj := getattr(pallax, name))
    and obj.__module__.startswith("pallax.primitives.")
  }


def test_every_public_op_is_registered_once():
  tools = family.registered()
  names = [n for t in tools for n in (t.op, *t.aliases)]
  assert sorted(names) == sorted(_public_ops())
  assert {"paged_attention", "cross_entropy"} <= {t.op for t in tools}


def test_every_tool_has_every_op():
  ops = [t.op for t in family.registered()]
  assert [check.name for check in selfcheck.CHECKS] == ops
  composites = {n: suite for t in family.registered() for n, suite in t.composites.items()}
  assert list(bench.SUITES) == [n for t in family.registered() for n in (t.op, *t.composites)]
  assert composites["moe"].file == "test_moe.py"
  for name, suite in composites.items():
    assert bench.SUITES[name] == (suite.file, suite.keyword)
  swept = [name for t in family.registered() for name in t.sweep]
  assert list(sweep.LIBRARY_OPS) == swept
  for t in family.registered():
    assert bench.SUITES[t.op] == (t.bench.file, t.bench.keyword)
    assert bench.UNITS.get(t.op) == t.bench.unit
    assert all(sweep.OPS[name] is entry for name, entry in t.sweep.items())
    assert getattr(roofline, t.work.__name__) is t.work


def test_families_come_in_alphabetical_order():
  assert [check.name for check in selfcheck.CHECKS] == [
    "dot_product_attention",  # attention
    "cross_entropy",
    "linear_cross_entropy",
    "matmul",
    "rms_norm",  # norm
    "layer_norm",
    "fused_add_rms_norm",
    "paged_attention",
    "ragged_dot",
    "ragged_paged_attention",
    "softmax",
    "log_softmax",
  ]


def test_an_inference_op_has_no_gradient_check():
  inference = ("paged_attention", "ragged_paged_attention")
  for check in selfcheck.CHECKS:
    assert check.differentiable == (check.name not in inference), check.name
  assert all(sweep.OPS[name].stages == ("fwd",) for name in inference)


def test_a_check_named_after_another_op_is_refused():
  check = selfcheck.CHECKS[0]
  suite = BenchSuite("test_x.py", "x")
  with pytest.raises(ValueError, match="check is named"):
    OpTools("other", check, {"other": sweep.OPS["matmul"]}, suite, roofline.matmul_work)
  with pytest.raises(ValueError, match="sweep must name"):
    OpTools(check.name, check, {}, suite, roofline.matmul_work)


@pytest.mark.parametrize(
  "change, message",
  [
    ({"aliases": ("softmax",)}, r"op names registered twice: \['softmax'\]"),
    (
      {"sweep": {"softmax_where": None}},
      r"sweep entry names .*twice: \['softmax_where'\]",
    ),
  ],
)
def test_a_name_registered_twice_is_refused(monkeypatch, change, message):
  tools = family.registered()
  by_op = {t.op: t for t in tools}
  clash = dataclasses.replace(by_op["matmul"], **change)
  found = {"matmul": (clash,), "softmax": (by_op["softmax"], by_op["log_softmax"])}
  family.registered.cache_clear()
  monkeypatch.setattr(family, "_family_tools", lambda package: found.get(package, ()))
  try:
    with pytest.raises(ValueError, match=message):
      family.registered()
  finally:
    monkeypatch.undo()
    family.registered.cache_clear()
  assert family.registered() == tools
