"""pallax.verify: real compiles for H100, A100, TPU v5e and v6e, and that the check can fail.

The default run compiles every kernel on every target with its heuristic
config at two sizes (``--quick``); the full sweep (``python -m pallax.verify``:
heuristic configs at every size, autotuning candidates at each op's first) is
behind ``-m slow``.
"""

import json
import subprocess
import sys

import pytest

import pallax
from pallax.executor.registry import kernel_spec
from pallax.verify import TARGETS, Case, sweep, verify
from pallax.verify.pool import run_jobs

pytestmark = pytest.mark.lowering

CUDA = [name for name, t in TARGETS.items() if t.platform == "cuda"]
TPU = [name for name, t in TARGETS.items() if t.platform == "tpu"]


def _check(report, status: str):
  assert report.results, "nothing was compiled"
  assert not report.unavailable, report.unavailable
  assert {r["status"] for r in report.results} == {status}, str(report)


@pytest.mark.compilers
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_compiles_on_every_target(target):
  # Every op's sweep but the padded-batch attention case (lengths and segment
  # ids), which adds minutes to the default pytest, the capped causal one
  # (the packed-documents case has its cap and mask) and the biased ones (a
  # minute more; CI's run is near its budget): .ci/run's Mosaic GPU sweep and
  # the full sweep compile them; every attention kernel is here all the same.
  left_out = ("attention_lengths", "attention_capped", "attention_biased", "attention_float32_bias")
  ops = [n for n in sweep.LIBRARY_OPS if n not in left_out]
  report = verify(
    ops, [target], quick=True, heuristic_only=True, workers=1, cache=False, progress=False
  )
  _check(report, "ok")
  assert report.ok and not report.unswept
  assert {r["kernel"] for r in report.results} == set(sweep.library_kernels())
  for kernel in sweep.library_kernels():  # both quick sizes: the first in float32, the second bf16
    calls = [r["call"].split("|")[2] for r in report.results if r["kernel"] == kernel]
    assert any(c.startswith("float32[") for c in calls), calls
    assert any(c.startswith("bfloat16[") for c in calls), calls
  for r in report.results:
    assert r["sources"] == ["heuristic"]
    # The Pallas kernels: XLA's own (fusions, single ops "wrapped_*") left out.
    kernels = [
      k for k in r["kernels"] if "fusion" not in k["name"] and not k["name"].startswith("wrapped_")
    ]
    assert kernels, r
    for k in kernels:
      if TARGETS[target].platform == "cuda":
        assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, r
        assert 0 <= k["smem_bytes"] <= TARGETS[target].shared_memory_limit, r
        assert k["threads"] % 32 == 0, r
      else:
        assert 0 < k["vmem_bytes"] <= TARGETS[target].vmem, r


RAW_OPS = ["rms_norm", "attention", "attention_causal"]


@pytest.mark.compilers
@pytest.mark.slow  # CI runs the same sweep through the command line (.ci/run)
@pytest.mark.parametrize("target", CUDA)
def test_every_raw_triton_config_compiles(target):
  """Every raw Triton config the executor can choose, at both quick sizes: no spills, fits smem."""
  report = verify(
    RAW_OPS,
    [target],
    quick=True,
    exhaustive=True,
    implementations=["triton_raw"],
    workers=1,
    cache=False,
    progress=False,
  )
  _check(report, "ok")
  raw = {k for k in sweep.library_kernels() if "triton_raw" in kernel_spec(k).implementations}
  assert {r["kernel"] for r in report.results} == raw
  for r in report.results:
    assert r["config"]["implementation"] == "triton_raw"
    for k in r["kernels"]:
      assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, r
      assert k["smem_bytes"] <= TARGETS[target].shared_memory_limit, r


MOSAIC_GPU_OPS = [
  "attention",
  "attention_causal",
  "attention_capped",
  "attention_features",
  "attention_lengths",
  "attention_biased",
  "attention_float32_bias",
]


@pytest.mark.compilers
@pytest.mark.slow  # CI runs the same sweep through the command line (.ci/run)
def test_every_mosaic_gpu_config_compiles_for_h100():
  """The Mosaic GPU configs the executor can choose on an H100: no spills, fits SMEM.

  The heuristic's at every size and 16-bit dtype (head dims 64, 80, 128,
  256), every candidate at every case. The forward: three warpgroups a block
  (two with a soft cap and a causal mask or lengths above head dim 128); the
  tangent's and the backward's dk/dv kernels three up to head dim 64 and two
  above; the backward's dq kernel two.
  """
  report = verify(
    MOSAIC_GPU_OPS,
    ["h100"],
    implementations=["pallas_mosaic_gpu"],
    workers=1,
    cache=False,
    progress=False,
  )
  _check(report, "ok")
  kernels = {r["kernel"] for r in report.results}
  assert kernels == {f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp")}
  assert {"heuristic", "candidate"} <= set().union(*(r["sources"] for r in report.results))
  fwd = [r for r in report.results if r["kernel"] == "dot_product_attention_fwd"]
  assert len({(r["config"]["block_k"], r["config"]["num_stages"]) for r in fwd}) >= 6
  for r in report.results:
    assert r["config"]["implementation"] == "pallas_mosaic_gpu"
    assert len(r["kernels"]) == (2 if r["kernel"].endswith("bwd") else 1), r
    for k in r["kernels"]:
      assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 255, r
      assert 0 < k["smem_bytes"] <= TARGETS["h100"].shared_memory_limit, r
      assert k["threads"] in (2 * 128, 3 * 128), r


def test_every_registered_kernel_is_in_the_sweep():
  assert len(sweep.library_kernels()) == 23
  assert sweep.unswept_kernels(sweep.cases()) == []
  assert sweep.unswept_kernels(sweep.cases(quick=True)) == []


def test_candidates_are_swept_and_deduplicated():
  case = Case("softmax", "bwd", (1000, 4000), "bfloat16")
  jobs = sweep.jobs_for([case], [TARGETS["h100"]])
  assert len({job.id for job in jobs}) == len(jobs)
  fwd = [j for j in jobs if j.kernel == "softmax_fwd"]
  assert {"heuristic", "candidate"} <= set().union(*(j.sources for j in fwd))
  assert len(fwd) > 1
  # The forward kernel of the jvp case is the bwd case's: compiled once.
  both = sweep.jobs_for([case, Case("softmax", "jvp", (1000, 4000), "bfloat16")], [TARGETS["h100"]])
  assert len([j for j in both if j.kernel == "softmax_fwd"]) == len(fwd)
  # Outside the candidate cases only the heuristic's configs are compiled.
  only = sweep.jobs_for([case], [TARGETS["h100"]], candidates_at=set())
  assert {frozenset(j.sources) for j in only} == {frozenset({"heuristic"})}
  assert len(only) == len({j.kernel for j in jobs}) < len(jobs)


def test_candidate_cases_are_the_first_size_in_float32():
  chosen = sweep.candidate_cases(sweep.cases(["softmax", "matmul"]))
  assert chosen == {
    f"{op}:{stage}:{size}:float32"
    for op, size in (("softmax", "1024x1024"), ("matmul", "1024x1024x1024"))
    for stage in sweep.STAGES
  }


# The check can fail --------------------------------------------------------------------


def _pinned(targets, case: Case, kernel: str, config):
  """The report of ``case``'s ``kernel`` compiled with ``config`` for ``targets``."""
  return verify(
    targets=targets, cases=[case], pinned={kernel: config}, workers=1, cache=False, progress=False
  )


@pytest.mark.compilers
def test_spilling_config_is_reported():
  # 32 rows of 1024 float32 on 4 warps: 256 elements per thread in the backward kernel.
  config = pallax.NormConfig(block_rows=32, num_warps=4)
  report = _pinned(CUDA, Case("rms_norm", "bwd", (1024, 1024), "float32"), "rms_norm_bwd", config)
  _check(report, "spills")
  assert not report.ok
  for r in report.results:
    spilled = [k for k in r["kernels"] if k["spill_bytes"]]
    assert [k["name"] for k in spilled] == ["norm_bwd"], r
  assert "SPILLS rms_norm_bwd on h100" in str(report)


@pytest.mark.compilers
def test_spilling_raw_triton_config_is_reported():
  # The raw backward kernel with the same 256 elements per thread spills too.
  config = pallax.NormConfig(block_rows=32, num_warps=4, implementation="triton_raw")
  report = _pinned(CUDA, Case("rms_norm", "bwd", (1024, 1024), "float32"), "rms_norm_bwd", config)
  _check(report, "spills")
  assert "SPILLS rms_norm_bwd on h100" in str(report)
  assert "| rms_norm_bwd (triton_raw) | h100 | 0/1 | 1 |" in report.table()


@pytest.mark.compilers
def test_oversized_shared_memory_is_reported():
  # 4 stages of (128x128 + 128x256) bfloat16 tiles: 384 KiB, over H100's 227 KiB.
  config = pallax.MatmulConfig(block_m=128, block_n=256, block_k=128, num_warps=8, num_stages=4)
  report = _pinned(CUDA, Case("matmul", "fwd", (1024, 1024, 1024), "bfloat16"), "matmul", config)
  _check(report, "failed")
  for r in report.results:
    assert "shared memory" in r["error"].lower(), r["error"]


@pytest.mark.compilers
def test_oversized_vmem_is_reported():
  # 4096 rows of 4096 float32: 64 MiB a buffer, double-buffered in and out.
  config = pallax.NormConfig(block_rows=4096)
  report = _pinned(TPU, Case("rms_norm", "fwd", (8192, 4096), "float32"), "rms_norm_fwd", config)
  _check(report, "failed")
  for r in report.results:
    assert "vmem" in r["error"].lower(), r["error"]


@pytest.mark.compilers
def test_crash_and_timeout_are_results_and_the_pool_recovers():
  case = Case("softmax", "fwd", (1024, 1024), "float32")
  (job,) = sweep.jobs_for([case], [TARGETS["v5e"]], heuristic_only=True)
  crash = dict(job.message(), id="crash", call=99)  # no such kernel call: the worker dies
  results = {r["id"]: r for r in run_jobs([crash, job.message()], workers=1, timeout_s=120)}
  assert results["crash"]["status"] == "crashed"
  assert "IndexError" in results["crash"]["error"]
  assert results[job.id]["status"] == "ok"  # a fresh worker took the next job
  (late,) = run_jobs([job.message()], workers=1, timeout_s=1e-3)
  assert late["status"] == "timeout"


@pytest.mark.compilers
def test_command_line_json(tmp_path):
  out = tmp_path / "verify.json"
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "pallax.verify",
      "--ops",
      "log_softmax",
      "--targets",
      "v6e,a100",
      "--quick",
      "--heuristic-only",
      "--no-cache",
      "--json",
      str(out),
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "| log_softmax_bwd | v6e |" in done.stdout
  data = json.loads(out.read_text())
  assert data["ok"] and {r["target"] for r in data["results"]} == {"v6e", "a100"}
  bad = subprocess.run(
    [sys.executable, "-m", "pallax.verify", "--targets", "h200"],
    capture_output=True,
    text=True,
    check=False,
  )
  assert bad.returncode != 0 and "unknown target 'h200'" in bad.stderr


@pytest.mark.compilers
@pytest.mark.slow
def test_full_sweep():
  report = verify(progress=False)
  assert report.ok, str(report)


def test_the_result_cache_covers_every_source_of_a_kernel(monkeypatch):
  """A cached verify result is keyed by the kernel family's files, its subpackages included."""
  from pallax.verify import cache

  hashed = []
  monkeypatch.setattr(cache, "_hash_files", lambda paths: hashed.extend(paths) or "h")
  cache._family_hash.cache_clear()
  try:
    cache._family_hash("dot_product_attention_fwd")
  finally:
    cache._family_hash.cache_clear()
  names = {(p.parent.name, p.name) for p in hashed}
  assert {("attention", "triton.py"), ("mosaic_gpu", "fwd.py"), ("mosaic_gpu", "bwd.py")} <= names
