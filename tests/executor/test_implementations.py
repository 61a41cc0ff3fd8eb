"""The implementation registry: built-ins listed, device-aware targets, one added from outside."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import pallax.executor as executor
from pallax.executor.implementation import (
  Implementation,
  Target,
  implementation,
  kernel_backend,
  pallas_implementation,
  short_device_kind,
)


def test_builtins_are_listed_with_their_platforms():
  listed = executor.implementations()
  assert listed["xla"] == ("cpu", "cuda", "rocm", "tpu")
  assert listed["pallas_triton"] == ("cuda", "rocm")
  assert listed["pallas_mosaic_tpu"] == ("tpu",)
  assert listed["pallas_mosaic_gpu"] == ("cuda",)
  assert listed["triton_raw"] == ("cuda", "rocm")


@pytest.mark.parametrize(
  "kind, short",
  [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA H200", "h200"),
    ("TPU v5 lite", "v5e"),
    ("TPU v6 lite", "v6e"),
    ("TPU v4", "v4"),
    ("cpu", "cpu"),
    ("Some New Chip 9", "some-new-chip-9"),
  ],
)
def test_device_kinds_get_short_names(kind, short):
  assert short_device_kind(kind) == short


def test_targets_carry_the_device_kind_and_compare_as_their_name():
  target = Target("cuda", "h100")
  assert target == "cuda" and f"{target}" == "cuda" and target.device_kind == "h100"
  assert target.platform == "cuda" and Target("interpret-triton").platform == "cpu"
  assert Target("interpret-mosaic_tpu").interpreter == "mosaic_tpu"


def test_availability_depends_on_the_device_kind():
  mosaic_gpu = implementation("pallas_mosaic_gpu")
  assert mosaic_gpu.unavailable_reason(Target("cuda", "h100")) is None
  assert "not a100" in mosaic_gpu.unavailable_reason(Target("cuda", "a100"))
  assert "not tpu" in mosaic_gpu.unavailable_reason(Target("tpu", "v5e"))
  # "pallas" stands for the first Pallas implementation an op has that can run there.
  assert pallas_implementation(Target("cuda", "h100")) == "pallas_triton"
  # Mosaic GPU kernels have config classes of their own: "pallas" never stands
  # for them; the executor prefers them where they run (their device kinds,
  # their interpret switch) and "pallas" is the Triton kernel they fall back to.
  assert pallas_implementation(Target("cuda", "h100"), ("pallas_mosaic_gpu",)) is None
  assert mosaic_gpu.prefers(Target("cuda", "h100")) and mosaic_gpu.prefers("interpret-mosaic_gpu")
  assert not mosaic_gpu.prefers(Target("cuda", "a100")) and not mosaic_gpu.prefers("cuda")
  # sm_100a has no wgmma: a B200 keeps the Triton kernels.
  assert "not b200" in mosaic_gpu.unavailable_reason(Target("cuda", "b200"))
  assert not mosaic_gpu.prefers(Target("cuda", "b200"))
  assert not mosaic_gpu.prefers("interpret-triton")
  assert pallas_implementation("interpret-mosaic_gpu") == "pallas_triton"
  assert kernel_backend("interpret-mosaic_gpu") == "triton"
  assert pallas_implementation("tpu") == "pallas_mosaic_tpu"
  assert pallas_implementation("cpu") == "pallas_triton"  # interpreted
  assert pallas_implementation("interpret-mosaic_tpu") == "pallas_mosaic_tpu"
  assert kernel_backend("tpu") == "mosaic_tpu" and kernel_backend("rocm") == "triton"


def test_reserved_and_conflicting_names_are_refused():
  with pytest.raises(ValueError, match="names the target's Pallas"):
    executor.register_implementation(Implementation("pallas", ("cpu",), "x"))
  with pytest.raises(ValueError, match="already registered"):
    executor.register_implementation(Implementation("pallas_triton", ("cpu",), "x"))


# Runs in its own process: the registration changes what rms_norm runs on the CPU.
_OUTSIDE = """
import dataclasses
import jax, jax.numpy as jnp, numpy as np
import pallax
from pallax.executor import (ConfigSpace, Implementation, KernelConfig, register_implementation,
                             register_kernel_implementation)
from pallax.executor.registry import kernel_spec
from pallax.primitives import norm

CALLS = []

@dataclasses.dataclass(frozen=True)
class HostConfig(KernelConfig):
  chunk: int = 8

register_implementation(Implementation("host_jnp", ("cpu",), backend="jnp"))
prim = norm.rms_norm_p.fwd
op = prim.name

def kernel(*arrays, config, interpret, **params):
  CALLS.append((config, interpret))
  return prim.xla_impl(*arrays, **params)

space = ConfigSpace(
  HostConfig,
  heuristic=lambda avals, target, **p: HostConfig(chunk=16, implementation="host_jnp"),
  candidates=lambda avals, target, **p: [
    HostConfig(chunk=c, implementation="host_jnp") for c in (8, 16)
  ],
  supports=lambda avals, target, config, **p: None,
)
register_kernel_implementation(op, "host_jnp", kernel, space)
assert "host_jnp" in kernel_spec(op).implementations

rng = np.random.default_rng(0)
x = rng.standard_normal((6, 64)).astype(np.float32)
w = rng.standard_normal(64).astype(np.float32)
(row,) = [r for r in pallax.explain(pallax.rms_norm, x, w) if r.op == op]
assert (row.implementation, row.source, row.config.chunk) == ("host_jnp", "heuristic", 16), row
y = jax.jit(pallax.rms_norm)(x, w)
x64, w64 = x.astype(np.float64), w.astype(np.float64)
want = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-6) * w64
assert np.max(np.abs(np.asarray(y, np.float64) - want)) < 1e-5 * np.max(np.abs(want))
assert CALLS and CALLS[0] == (HostConfig(chunk=16, implementation="host_jnp"), False), CALLS
print("selected", op, row.implementation)
"""


def test_an_implementation_added_from_outside_is_selected_on_its_platform():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PALLAX_INTERPRET="0")
  done = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(_OUTSIDE)],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "selected" in done.stdout and "host_jnp" in done.stdout


def test_the_interpret_switch_and_targets_follow_the_registered_interpreters():
  from pallax.executor.implementation import interpreters
  from pallax.executor.registry import TARGETS
  from pallax.interpret import BACKENDS

  assert BACKENDS == interpreters() == ("triton", "mosaic_tpu", "mosaic_gpu")
  assert [t for t in TARGETS if t.startswith("interpret-")] == [f"interpret-{b}" for b in BACKENDS]


def test_a_config_may_name_the_pallas_implementation_it_means():
  from pallax.executor.executor import unsupported_reason
  from pallax.executor.registry import kernel_spec
  from pallax.kernels.softmax import SoftmaxConfig

  spec = kernel_spec("softmax_fwd")
  avals = [jax.ShapeDtypeStruct((8, 128), jnp.float32)]
  named = SoftmaxConfig(block_rows=8, block_cols=128, implementation="pallas_triton")
  assert unsupported_reason(spec, avals, Target("cuda", "h100"), named, {}) is None
  mosaic = dataclasses.replace(named, implementation="pallas_mosaic_gpu")
  assert "no pallas_mosaic_gpu kernel" in unsupported_reason(spec, avals, "cuda", mosaic, {})


def test_cached_configs_of_an_added_implementation_come_back_in_its_class(tmp_path):
  from pallax.executor import Executor, KernelConfig, KernelSpec, register_kernel
  from pallax.executor.registry import ConfigSpace

  @dataclasses.dataclass(frozen=True)
  class Native(KernelConfig):
    block: int = 1

  @dataclasses.dataclass(frozen=True)
  class Own(KernelConfig):
    chunk: int = 1

  spec = KernelSpec(
    "cache_class_op",
    Native,
    heuristic=lambda avals, target, **p: Native(),
    candidates=lambda avals, target, **p: [Native()],
    supports=lambda avals, target, config, **p: None,
    implementations=("pallas", "triton_raw"),
    spaces={"triton_raw": ConfigSpace(Own, heuristic=lambda a, t, **p: Own())},
  )
  register_kernel(spec)
  entry = {"config": Own(chunk=4, implementation="triton_raw").to_dict()}
  assert Executor._from_entry(spec, entry) == Own(chunk=4, implementation="triton_raw")
  assert Executor._from_entry(spec, {"config": Native(block=2).to_dict()}) == Native(block=2)
