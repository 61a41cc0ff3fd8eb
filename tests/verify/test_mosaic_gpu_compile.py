"""pallax.verify on Pallas Mosaic GPU kernels: ptxas's report read from the compile's stdout.

A real kernel (the pipelined ``wgmma`` matmul of tests/mosaic_gpu) is compiled
deviceless for H100 through ``compile_kernels``, the path every verify job
takes; the parser is checked on a captured report with spills, and a kernel
without a report is never a pass.
"""

import os

import jax
import jax.numpy as jnp
import pytest

from pallax.verify import compile as verify_compile
from pallax.verify.compile import MOSAIC_GPU, ReportMissing, compile_kernels, judge
from pallax.verify.targets import TARGETS
from tests.mosaic_gpu.test_interpreter_constructs import pipelined_matmul, tma_store_scale

pytestmark = [pytest.mark.lowering, pytest.mark.compilers]

H100 = TARGETS["h100"]
BF16 = jnp.bfloat16

# What the CUDA plugin printed (fd 1) for a kernel that spills, trimmed.
SPILLING_REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for attention_mosaic_gpu_kernel
    24 bytes stack frame, 20 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 3 barriers, 1 bytes smem
ptxas info    : Compile time = 412.114 ms
"""


def _launch(kernel_hash: bytes, name: str = "attention_mosaic_gpu_kernel") -> dict:
  return {"hash": kernel_hash, "name": name, "arch": 90, "threads": 384, "dynamic_smem": 200000}


def test_real_kernel_compiles_with_its_report(tmp_path, monkeypatch, capfd):
  # 64x128 output tiles, K stepped by 64 through 3 stages of bf16 TMA loads.
  monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))  # must not be used meanwhile
  monkeypatch.delenv("MOSAIC_GPU_DUMP_PTXAS", raising=False)
  args = [jax.ShapeDtypeStruct((128, 256), BF16), jax.ShapeDtypeStruct((256, 128), BF16)]
  (kernel,) = compile_kernels(pipelined_matmul, args, H100, MOSAIC_GPU)
  assert kernel["name"] == "body_mosaic_gpu_kernel"
  assert 0 < kernel["registers"] <= 255
  assert kernel["spill_bytes"] == 0
  assert kernel["threads"] == 128  # one warpgroup
  tiles = 3 * (64 * 64 + 64 * 128) * 2 + 64 * 128 * 4  # A and B stages (bf16), f32 output tile
  assert tiles <= kernel["smem_bytes"] < tiles + 1024  # plus the stages' barriers
  assert judge([kernel], H100) == {"status": "ok"}
  # Environment and stdout as they were, and nothing dumped.
  assert os.environ["MOSAIC_GPU_DUMP_TO"] == str(tmp_path)
  assert "MOSAIC_GPU_DUMP_PTXAS" not in os.environ
  assert not list(tmp_path.iterdir())
  os.write(1, b"stdout is back\n")
  out = capfd.readouterr().out
  assert "stdout is back" in out and "ptxas info" not in out


def test_two_calls_of_one_kernel_share_its_report():
  def twice(x):
    return tma_store_scale(x), tma_store_scale(x) * 2

  kernels = compile_kernels(twice, [jax.ShapeDtypeStruct((64, 64), BF16)], H100, MOSAIC_GPU)
  assert len(kernels) == 2 and kernels[0] == kernels[1]
  assert kernels[0]["registers"] > 0 and kernels[0]["smem_bytes"] >= 64 * 64 * 4


def test_report_with_spills_is_judged_spills():
  reports = verify_compile._mosaic_gpu_reports(SPILLING_REPORT, H100)
  (kernel,) = verify_compile._with_reports([_launch(b"sample with spills")], reports)
  assert kernel == {
    "name": "attention_mosaic_gpu_kernel",
    "registers": 168,
    "spill_bytes": 32,
    "wgmma_serialized": None,
    "smem_bytes": 200001,
    "threads": 384,
  }
  verdict = judge([kernel], H100)
  assert verdict["status"] == "spills"
  assert "attention_mosaic_gpu_kernel" in verdict["error"]


# What it printed for a kernel whose wgmma ptxas serialized (the forward with a
# block's probabilities converted to 16 bits while ``P V`` read the previous
# block's registers), trimmed: the warning comes before the function's report.
SERIALIZED_REPORT = (
  "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are"
  " serialized due to non wgmma instructions defining input registers of a wgmma between"
  " start and end of the pipeline stage in the function 'attention_mosaic_gpu_kernel'\n"
  + SPILLING_REPORT.replace("24 bytes stack frame, 20", "0 bytes stack frame, 0").replace(
    "12 bytes spill loads", "0 bytes spill loads"
  )
)


def test_report_with_serialized_wgmma_is_a_failure():
  reports = verify_compile._mosaic_gpu_reports(SERIALIZED_REPORT, H100)
  (kernel,) = verify_compile._with_reports([_launch(b"sample serialized")], reports)
  assert kernel["wgmma_serialized"].startswith("C7513: due to non wgmma instructions defining")
  assert kernel["spill_bytes"] == 0
  verdict = judge([kernel], H100)
  assert verdict["status"] == "failed"
  assert verdict["error"].startswith("ptxas serializes the wgmma of attention_mosaic_gpu_kernel")
  assert "(C7513: due to non wgmma instructions" in verdict["error"]


def test_report_for_another_architecture_is_refused():
  with pytest.raises(RuntimeError, match="for sm_80, not sm_90a"):
    verify_compile._mosaic_gpu_reports(SPILLING_REPORT.replace("sm_90a", "sm_80"), H100)


def test_missing_report_raises():
  with pytest.raises(ReportMissing, match="attention_mosaic_gpu_kernel"):
    verify_compile._with_reports([_launch(b"sample without report")], [])
  other = verify_compile._mosaic_gpu_reports(SPILLING_REPORT, H100)
  with pytest.raises(ReportMissing, match="flash_mosaic_gpu_kernel"):
    verify_compile._with_reports([_launch(b"another name", "flash_mosaic_gpu_kernel")], other)


def test_kernel_compiled_earlier_without_report_is_not_a_pass():
  # The plugin compiles a kernel once per process: compiled outside verify, it
  # prints nothing when verify compiles it again.
  mesh = verify_compile._mesh(H100.name)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((64, 192), BF16, sharding=sharding)
  jax.jit(tma_store_scale).trace(x).lower().compile()
  with pytest.raises(ReportMissing):
    compile_kernels(tma_store_scale, [jax.ShapeDtypeStruct((64, 192), BF16)], H100, MOSAIC_GPU)
