"""pallax.verify compiles a kernel that configs of one call share once (``kernel_keys``).

The Mosaic GPU attention backward runs a dq and a dk/dv kernel, and its
config space crosses their consumers and steps: configs share kernels. The
sweep compiles each kernel in one config's job and gives the others that
job's kernel records, judged as their own. The keys are checked against the
truth: the kernels' hashes in the lowered programs.
"""

import itertools

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import pallax.verify as verify_module
from pallax import pallas_mosaic_gpu as mgpu
from pallax.executor.registry import kernel_spec
from pallax.verify import TARGETS, Case, sweep
from pallax.verify import compile as verify_compile
from pallax.verify.compile import shared_result

pytestmark = pytest.mark.lowering

H100 = TARGETS["h100"]
DQ, DKDV = "dot_product_attention_dq", "dot_product_attention_dkdv"
# Head dim 128: the dk/dv kernel's steps of 64 queries in one consumer or two,
# of 32 in two, crossed with one or two dq consumers: 6 configs of 3 dq and
# dk/dv kernel pairs; and the dk/dv kernel computing dQ too in one consumer
# or two (``fuse_dq``), the two in 32- or 64-query steps (FlashAttention-3's
# tile): 3 configs of a kernel each.
CASE = Case("attention", "bwd", (2, 1024, 8, 2, 128), "bfloat16")
# 960 queries and keys pad to 1024 for two consumers of 64 (the dq kernel's,
# the dk/dv kernel's) and stay 960 for one: both kernels take both padded
# lengths (``bwd_lengths``), so no configs share them; FlashAttention-3's
# tile masks every step there (``masks_every_step``).
PADDED = Case("attention", "bwd", (2, 960, 8, 2, 128), "bfloat16")
# Lengths and segment ids: the padded queries reach the dk/dv kernel through
# its segment runs too.
FEATURES = Case("attention_lengths", "bwd", (2, 1000, 8, 2, 128), "bfloat16")


def _mosaic_gpu_jobs(case: Case) -> list[sweep.Job]:
  jobs = sweep.jobs_for([case], [H100], implementations=["pallas_mosaic_gpu"])
  return [j for j in jobs if j.kernel == "dot_product_attention_bwd"]


def test_configs_of_one_call_compile_each_kernel_once():
  jobs = _mosaic_gpu_jobs(CASE)
  compiled = {j.id: j for j in jobs if j.kernels_from is None}
  shared = [j for j in jobs if j.kernels_from is not None]
  assert len(jobs) == 9 and len(compiled) == 6 and len(shared) == 3, [j.config for j in jobs]
  padded = _mosaic_gpu_jobs(PADDED)
  assert len(padded) == 9 and sum(j.kernels_from is None for j in padded) == 9
  assert "heuristic" in jobs[0].sources and jobs[0].id in compiled
  # 2 dq and 3 dk/dv kernels: 3 compiles at least, each a pair; 3 fused dk/dv kernels.
  kernels = lambda jobs: {item for j in jobs for item in j.kernel_keys.items()}
  assert len(kernels(jobs)) == 8 and kernels(compiled.values()) == kernels(jobs)
  for job in shared:
    assert set(job.kernels_from) == {DQ, DKDV}
    for name, owner in job.kernels_from.items():
      assert compiled[owner].kernel_keys[name] == job.kernel_keys[name]


def test_the_forward_and_other_kernels_share_nothing():
  case = Case("attention", "fwd", (2, 960, 8, 2, 128), "bfloat16")
  jobs = sweep.jobs_for([case, Case("softmax", "bwd", (1000, 4000), "bfloat16")], [H100])
  assert len(jobs) > 3 and all(not j.kernel_keys and j.kernels_from is None for j in jobs)


def _kernel(name: str, spill_bytes: int = 0, smem_bytes: int = 1000) -> dict:
  return {
    "name": f"{name}_mosaic_gpu_kernel",
    "registers": 168,
    "spill_bytes": spill_bytes,
    "smem_bytes": smem_bytes,
    "threads": 384,
  }


def test_a_shared_result_is_judged_from_its_own_kernels():
  # The job compiling the dq kernel spilled in its dk/dv kernel: the dq kernel is fine.
  results = {
    "a": {"status": "spills", "kernels": [_kernel(DKDV, spill_bytes=8), _kernel(DQ)]},
    "b": {"status": "ok", "kernels": [_kernel(DKDV), _kernel(DQ)]},
    "c": {"status": "failed", "error": "ValueError: SMEM", "kernels": []},
    "d": {"status": "ok", "kernels": [_kernel(DKDV, smem_bytes=300_000), _kernel(DQ)]},
  }
  ok = shared_result({DQ: "a", DKDV: "b"}, results, H100)
  assert ok["status"] == "ok" and [k["name"] for k in ok["kernels"]] == [
    f"{DKDV}_mosaic_gpu_kernel",
    f"{DQ}_mosaic_gpu_kernel",
  ]
  assert shared_result({DQ: "b", DKDV: "a"}, results, H100)["status"] == "spills"
  assert shared_result({DQ: "b", DKDV: "d"}, results, H100)["status"] == "failed"  # over SMEM
  # A kernel its job did not compile (it failed), or a name no launch has: none.
  assert shared_result({DQ: "b", DKDV: "c"}, results, H100) is None
  assert shared_result({"dot_product_attention_d": "b"}, results, H100) is None


def test_a_job_whose_kernels_did_not_compile_elsewhere_is_compiled(monkeypatch, tmp_path):
  jobs = _mosaic_gpu_jobs(CASE)
  sent = []

  def run_jobs(messages, workers, timeout_s, on_result=None):
    if messages:
      sent.append([m["id"] for m in messages])
    # The first pass: the dk/dv kernels' jobs fail; the second compiles the others.
    status = "failed" if len(sent) == 1 else "ok"
    kernels = [] if len(sent) == 1 else [_kernel(DKDV), _kernel(DQ)]
    results = [{"id": m["id"], "status": status, "kernels": kernels} for m in messages]
    for result in results:
      on_result(result)
    return results

  monkeypatch.setattr(verify_module, "run_jobs", run_jobs)
  monkeypatch.setenv("PALLAX_CACHE_DIR", str(tmp_path))
  run = lambda: verify_module.verify(
    cases=[CASE], targets=["h100"], implementations=["pallas_mosaic_gpu"], progress=False
  )
  report = run()
  shared = {j.id for j in jobs if j.kernels_from is not None}
  assert len(sent) == 2 and {j.id for j in jobs} - shared <= set(sent[0])  # and the forward's
  assert set(sent[1]) == shared and not shared & set(sent[0])
  bwd = [r for r in report.results if r["kernel"] == "dot_product_attention_bwd"]
  assert len(bwd) == 9 and not any("kernels_from" in r for r in bwd)
  # Both passes' results are in the cache: a rerun compiles nothing.
  rerun = run()
  assert len(sent) == 2 and all(r["cached"] for r in rerun.results)
  assert [r["status"] for r in rerun.results] == [r["status"] for r in report.results]


@pytest.mark.compilers
@pytest.mark.parametrize("case", [CASE, PADDED, FEATURES], ids=["1024", "960", "lengths"])
def test_equal_keys_are_equal_kernels(case):
  """Each kernel's key is equal between two configs exactly where its lowered kernel is."""
  jobs = _mosaic_gpu_jobs(case)
  mesh = verify_compile._mesh("h100")
  sharding = NamedSharding(mesh, PartitionSpec())
  hashes = {}
  for job in jobs:
    eqn = sweep.kernel_calls_of(job.case)[job.call]
    params = {**eqn.params, "config": kernel_spec(eqn.primitive.name).config_from_dict(job.config)}
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding) for v in eqn.invars]
    fn = lambda *a, eqn=eqn, params=params: eqn.primitive.bind(*a, **params)
    with jax.default_device(mesh.devices.flat[0]):  # the kernels' architecture: the H100's
      lowered = jax.jit(fn).trace(*args).lower()
    launches = verify_compile._mosaic_gpu_launches(lowered.compiler_ir("stablehlo"))
    # The fused dk/dv kernel is ``mgpu.SUMS_KERNEL`` (JAX discharges dQ's ref).
    names = {DQ: DQ, DKDV: DKDV, mgpu.SUMS_KERNEL: DKDV}
    hashes[job.id] = {
      names[name]: launch["hash"]
      for launch in launches
      for name in names
      if launch["name"].startswith(f"{name}_")
    }
    assert set(hashes[job.id]) == set(job.kernel_keys), launches
  for a, b in itertools.combinations(jobs, 2):
    for name in set(a.kernel_keys) & set(b.kernel_keys):
      same_key = a.kernel_keys[name] == b.kernel_keys[name]
      assert same_key == (hashes[a.id][name] == hashes[b.id][name]), (name, a.config, b.config)
