"""The raw Triton implementation in the framework: configs, executor choices, launch, verify's dump.

This process compiles (no ``TRITON_INTERPRET``): the interpreter side is
tested by the ``interpreted_*.py`` suites (``test_interpreted.py``).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from pallax import triton_raw
from pallax.executor import Executor, KernelConfig, KernelSpec, register_kernel
from pallax.executor.executor import candidate_configs, unsupported_reason
from pallax.verify.compile import _raw_kernels
from pallax.verify.targets import TARGETS


@dataclasses.dataclass(frozen=True)
class RawConfig(KernelConfig):
  block: int


def _spec(name: str, implementations: tuple[str, ...]) -> KernelSpec:
  spec = KernelSpec(
    name,
    RawConfig,
    heuristic=lambda avals, target, **p: RawConfig(block=2),
    candidates=lambda avals, target, **p: [RawConfig(block=b) for b in (1, 2)],
    supports=lambda avals, target, config, **p: "block 2 spills" if config.block == 2 else None,
    implementations=implementations,
  )
  register_kernel(spec)
  return spec


WITH_RAW = _spec("raw_fake_op", ("pallas", "triton_raw"))
PALLAS_ONLY = _spec("pallas_fake_op", ("pallas",))
AVALS = [jax.ShapeDtypeStruct((16, 32), jnp.float32)]


def test_config_names_its_implementation():
  config = RawConfig(block=4, implementation="triton_raw")
  assert str(config) == "triton_raw(block=4)"
  assert RawConfig.from_json(config.to_json()) == config
  with pytest.raises(ValueError, match="implementation must be one of"):
    RawConfig(block=4, implementation="cuda")


def test_raw_candidates_join_where_they_can_run():
  on_cuda = candidate_configs(WITH_RAW, AVALS, "cuda", {})
  assert [(c.implementation, c.block) for c in on_cuda] == [
    ("pallas", 1),
    ("pallas", 2),
    ("triton_raw", 1),
    ("triton_raw", 2),
    ("xla", 2),
  ]
  # Not where the op has no raw kernel, nor where kernels run interpreted or on TPU.
  for spec, target in ((PALLAS_ONLY, "cuda"), (WITH_RAW, "cpu"), (WITH_RAW, "tpu")):
    found = {c.implementation for c in candidate_configs(spec, AVALS, target, {})}
    assert "triton_raw" not in found, (spec.op, target)


@pytest.mark.parametrize(
  "spec, target, reason",
  [
    (PALLAS_ONLY, "cuda", "pallas_fake_op has no triton_raw kernel"),
    (WITH_RAW, "tpu", "raw Triton kernels run on cuda and rocm, not tpu"),
    (WITH_RAW, "cpu", "only under Triton's interpreter"),
    (WITH_RAW, "interpret-triton", "only under Triton's interpreter"),
    (WITH_RAW, "cuda", None),
  ],
)
def test_unsupported_reasons(spec, target, reason):
  got = unsupported_reason(spec, AVALS, target, RawConfig(block=1, implementation="triton_raw"), {})
  assert got == reason if reason is None else reason in got
  # The kernel's own reasons still apply to its raw configs.
  bad = RawConfig(block=2, implementation="triton_raw")
  assert unsupported_reason(WITH_RAW, AVALS, "cuda", bad, {}) == "block 2 spills"


def test_pinned_raw_config_that_cannot_run_raises_naming_why():
  ex = Executor(cache_dir=False)
  pinned = RawConfig(block=1, implementation="triton_raw")
  with pytest.raises(ValueError, match="only under Triton's interpreter"):
    ex.select("raw_fake_op", AVALS, "cpu", {}, pinned=pinned)


def test_missing_packages_are_named(monkeypatch):
  real = triton_raw.importlib.util.find_spec
  monkeypatch.setattr(
    triton_raw.importlib.util,
    "find_spec",
    lambda name, *a: None if name == "jax_triton" else real(name, *a),
  )
  reason = triton_raw.unavailable_reason("cuda")
  assert "jax_triton" in reason and "pallax[triton]" in reason


def test_core_package_does_not_import_triton():
  code = (
    "import sys, jax.numpy as jnp, pallax\n"
    "x = jnp.ones((4, 8)); w = jnp.ones(8)\n"
    "pallax.rms_norm(x, w).block_until_ready()\n"
    "pallax.explain(pallax.rms_norm, x, w)\n"
    "sys.exit(int('triton' in sys.modules or 'jax_triton' in sys.modules))\n"
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=False)
  assert done.returncode == 0, done.stderr.decode()[-2000:]


@triton.jit
def _affine(x_ptr, n, y_ptr, scale, BLOCK: tl.constexpr):
  i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
  tl.store(y_ptr + i, (x * scale + 1.0).to(y_ptr.dtype.element_ty), mask=i < n)


def _launch(x, interpret):
  return triton_raw.launch(
    _affine,
    x,
    x.size,
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
    grid=(triton.cdiv(x.size, 128),),
    num_warps=4,
    num_stages=1,
    interpret=interpret,
    scale=2.0,
    BLOCK=128,
  )[0]


def test_interpreting_outside_interpreter_mode_is_refused():
  with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
    jax.jit(lambda x: _launch(x, True))(jnp.ones(10))


@pytest.mark.compilers
@pytest.mark.lowering
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_launch_lowers_for_the_target_and_verify_reads_the_dump(tmp_path, target):
  t = TARGETS[target]
  x = jax.ShapeDtypeStruct((1000,), jnp.bfloat16)
  with triton_raw.dumping_to(str(tmp_path / "jax_triton")):
    with triton_raw.compute_capability(t.compute_capability):
      text = (
        jax.jit(lambda x: _launch(x, False)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
      )
  assert text.count("triton_kernel_call") == 1
  ptx = next(tmp_path.glob("jax_triton/*/*.ptx")).read_text()
  assert f".target {t.arch}" in ptx
  # PTX that CUDA 12's ptxas (XLA's, pip's) assembles: Triton is pointed at it.
  assert float(ptx.split(".version", 1)[1].split()[0]) <= 8.8
  (kernel,) = _raw_kernels(pathlib.Path(tmp_path), t, calls=1)
  assert kernel["name"] == "_affine"
  assert kernel["threads"] == 128 and kernel["spill_bytes"] == 0
  assert 0 < kernel["registers"] <= 255 and kernel["smem_bytes"] == 0


def test_host_tensor_strides_and_contiguity():
  a = np.zeros((3, 5), np.float32)
  t = triton_raw._HostTensor(a)
  assert t.stride() == (5, 1) and t.size() == (3, 5) and t.data_ptr() == a.ctypes.data
  with pytest.raises(ValueError, match="C-contiguous"):
    triton_raw._HostTensor(a.T)
