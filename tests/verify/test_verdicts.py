"""``python -m pallax.verify --write-facts``: verify results merged into shipped verdicts.

Most results here are written by hand in the shape ``verify`` gives them; what
is checked is the merge and that the configs read back from the written files
are left out of the candidates. One real compile checks the whole path.
"""

import functools
import json
import shutil

import jax.numpy as jnp
import pytest

from pallax.executor import facts
from pallax.executor.cache import defaults_dir, read_shipped
from pallax.kernels.matmul import MatmulConfig
from pallax.kernels.matmul import config as matmul_config
from pallax.op import op_params
from pallax.verify import TARGETS, Case, sweep, verify
from pallax.verify.__main__ import main
from pallax.verify.verdicts import write_facts

CASE = Case("matmul", "bwd", (128, 64, 256), "bfloat16")  # a (128, 64), b (64, 256)
SPILLS = MatmulConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)


def _record(eqn, target: str, config: MatmulConfig, status: str, error: str = "") -> dict:
  kernels = [{"name": "matmul_kernel", "registers": 255, "spill_bytes": 24 * (status == "spills")}]
  return {
    "target": target,
    "kernel": eqn.primitive.name,
    "call": sweep.call_key(eqn, TARGETS[target]),
    "config": config.to_dict(),
    "sources": ["candidate"],
    "cases": [CASE.id],
    "status": status,
    "error": error,
    "kernels": kernels,
  }


@pytest.fixture
def shipped(tmp_path, monkeypatch):
  """A copy of the shipped files that ``facts`` reads instead of the package's."""
  shutil.copytree(defaults_dir(), tmp_path, dirs_exist_ok=True)
  facts.verdicts.cache_clear()
  monkeypatch.setattr(facts, "shipped_file", functools.partial(read_shipped, tmp_path))
  yield tmp_path
  facts.verdicts.cache_clear()


def _call(eqn):
  return [v.aval for v in eqn.invars], op_params(eqn.params)


def _facts(eqn) -> dict:
  avals, params = _call(eqn)
  return matmul_config.call_facts(avals, **params)


def test_verdicts_are_added_refuted_and_read_back(shipped):
  calls = sweep.kernel_calls_of(CASE.id)
  forward = calls[0]
  transposed = next(e for e in calls if e.params["transpose_b"] or e.params["transpose_a"])
  avals, params = _call(forward)
  assert SPILLS in matmul_config.candidates(avals, "cuda", **params)
  wide = MatmulConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
  assert matmul_config._spills(wide, "cuda", _facts(transposed))
  results = [
    _record(forward, "a100", SPILLS, "spills"),
    _record(transposed, "a100", wide, "ok"),  # refutes the shipped 128x64x64 verdict
    _record(forward, "a100", SPILLS, "failed", "RuntimeError: LLVM ERROR: out of dims"),
    _record(forward, "h100", SPILLS, "failed", "matmul_kernel uses 240000 bytes of shared memory"),
  ]
  written = write_facts(results, shipped)
  assert (written.added, written.refuted) == (2, 1)
  assert [r["error"] for r in written.unrecorded] == ["RuntimeError: LLVM ERROR: out of dims"]
  a100 = json.loads((shipped / "a100" / "matmul.json").read_text())["rejected"]
  assert {"config": SPILLS.to_dict(), "when": matmul_config.call_facts(avals, **params)} in [
    {k: r[k] for k in ("config", "when")} for r in a100
  ]
  assert not any(r["config"] == {"block_m": 128, "block_n": 64, "block_k": 64} for r in a100)
  assert any("24 bytes spilled at 255 registers" in r["reason"] for r in a100)
  h100 = json.loads((shipped / "h100" / "matmul.json").read_text())["rejected"]
  assert any("shared memory" in r["reason"] for r in h100)

  facts.verdicts.cache_clear()
  assert SPILLS not in matmul_config.candidates(avals, "cuda", **params)
  assert matmul_config._spills(SPILLS, "a100", matmul_config.call_facts(avals, **params))
  transposed_facts = _facts(transposed)
  assert not matmul_config._spills(wide, "a100", transposed_facts)
  assert matmul_config._spills(wide, "h100", transposed_facts)  # not refuted there
  # The verdict holds for the call it was measured at: float32 inputs keep the config.
  f32 = [a.update(dtype=jnp.float32) if a.dtype == jnp.bfloat16 else a for a in avals]
  assert SPILLS in matmul_config.candidates(f32, "cuda", **params)

  again = write_facts(results, shipped)  # idempotent
  assert (again.added, again.refuted) == (0, 0)


def test_write_facts_needs_a_family_with_call_facts(shipped):
  """Families that describe no call facts get no verdicts: their failures stay failures."""
  eqn = sweep.kernel_calls_of(Case("softmax", "fwd", (64, 256), "float32").id)[0]
  record = {
    "target": "a100",
    "kernel": eqn.primitive.name,
    "call": sweep.call_key(eqn, TARGETS["a100"]),
    "config": {"block_rows": 8, "block_cols": 256},
    "cases": [Case("softmax", "fwd", (64, 256), "float32").id],
    "status": "spills",
    "kernels": [{"name": "k", "registers": 255, "spill_bytes": 8}],
  }
  written = write_facts([record], shipped)
  assert written.unrecorded == [record] and not written.paths


def test_the_command_line_takes_write_facts(monkeypatch, tmp_path, capsys):
  """``--write-facts DIR`` runs verify with the verdicts ignored, then merges its results."""
  seen = {}

  def fake_verify(*args, **kwargs):
    wide = {"block_m": 128, "block_n": 64, "block_k": 64}
    seen["ignored"] = facts.rejection("cuda", "matmul", wide, {})
    from pallax.verify.report import VerifyReport

    return VerifyReport([], {}, [], 0.0)

  monkeypatch.setattr("pallax.verify.__main__.verify", fake_verify)
  assert main(["--ops", "matmul", "--targets", "a100", "--write-facts", str(tmp_path)]) == 1
  assert seen["ignored"] is None
  assert "facts: 0 verdicts added" in capsys.readouterr().out


@pytest.mark.compilers
@pytest.mark.lowering
def test_a_compiled_shared_memory_overflow_becomes_a_verdict(tmp_path):
  # 4 stages of (128x128 + 128x256) bfloat16 tiles: 384 KiB, over H100's 227 KiB.
  config = MatmulConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=4)
  gpus = [name for name, t in TARGETS.items() if t.platform == "cuda"]
  report = verify(
    cases=[Case("matmul", "fwd", (1024, 1024, 1024), "bfloat16")],
    targets=gpus,
    pinned={"matmul": config},
    workers=1,
    cache=False,
    progress=False,
  )
  written = write_facts(report.results, tmp_path)
  assert (written.added, written.unrecorded) == (len(gpus), [])
  for device in gpus:
    (verdict,) = read_shipped(tmp_path, device, "matmul", 1)["rejected"]
    assert verdict["config"] == config.to_dict()
    assert verdict["when"] == {"itemsize": 2, "transpose_a": False, "transpose_b": False}
    assert "shared memory" in verdict["reason"].lower()


def test_a_norm_verdict_moves_the_heuristic_and_leaves_the_candidates(shipped):
  """The norm family reads the verdicts too (before issue 27 it had a spill rule in code)."""
  from pallax.executor import Target
  from pallax.kernels.norm import NormConfig
  from tests.helpers import executor_view

  case = Case("rms_norm", "bwd", (64, 1024), "bfloat16")
  (eqn,) = [e for e in sweep.kernel_calls_of(case.id) if e.primitive.name == "rms_norm_bwd"]
  avals, params = _call(eqn)
  heuristic, candidates, supports = executor_view("rms_norm_bwd")
  chosen = heuristic(avals, "cuda", **params)
  assert chosen == NormConfig(block_rows=8, num_warps=8)
  record = {**_record(eqn, "h100", chosen, "spills"), "cases": [case.id]}
  record["kernels"] = [{"name": "norm_bwd_kernel", "registers": 255, "spill_bytes": 40}]
  written = write_facts([record], shipped)
  assert written.added == 1
  facts.verdicts.cache_clear()
  assert heuristic(avals, "cuda", **params) != chosen
  assert chosen not in candidates(avals, "cuda", **params)
  assert "h100: ptxas: 40 bytes spilled" in supports(avals, "cuda", chosen, **params)
  assert heuristic(avals, Target("cuda", "a100"), **params) == chosen  # the verdict is H100's
  assert heuristic(avals, Target("cuda", "h100"), **params) != chosen
  assert supports(avals, "interpret-triton", chosen, **params) is None
