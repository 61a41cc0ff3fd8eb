"""The hardware targets ``pallax.verify`` compiles for, without the hardware.

TPU: libtpu compiles for the TPU generations it knows from a compile-only
topology (``jax.experimental.topologies``). CUDA: the CUDA PJRT plugin does a
deviceless compile from a ``GpuTargetConfigProto`` (the device facts, kept in
``gpu_targets/``), running Triton and ``ptxas`` for the target's architecture.
Both work under ``JAX_PLATFORMS=cpu`` in one process; ``compile_env`` is the
environment a verify worker runs in.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import shutil
from typing import Optional

from pallax.pallas_utils import TPU_VMEM

_GPU_TARGETS = pathlib.Path(__file__).parent / "gpu_targets"

# libtpu looks for a TPU's metadata server and worker list unless told it is a
# single local worker; these silence that (no TPU is used). It also takes a
# lock file that lets one process at a time load it, which compile-only
# workers (verify's, and the test processes compiling for TPU) need not respect.
TPU_ENV = {
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
  "TPU_SKIP_MDS_QUERY": "1",
  "TPU_ACCELERATOR_TYPE": "v5litepod-4",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "TPU_WORKER_ID": "0",
}


@dataclasses.dataclass(frozen=True)
class Target:
  """One compile target.

  name: short name (``h100``).
  platform: ``"cuda"`` or ``"tpu"``: the platform pallax lowers for.
  description: what it stands for, for reports.
  topology: keyword arguments of ``topologies.get_topology_desc`` (the GPU
    target config text is read from ``gpu_config`` when needed).
  gpu_config: file name in ``gpu_targets/`` (CUDA only).
  arch: the ``ptxas -arch`` of the target (CUDA only).
  scoped_vmem: the default scoped VMEM limit a Mosaic kernel gets (TPU only;
    a kernel may raise it with ``vmem_limit_bytes``).
  vmem: the physical VMEM per core (TPU only).
  """

  name: str
  platform: str
  description: str
  topology: tuple[tuple[str, str], ...]
  gpu_config: Optional[str] = None
  arch: Optional[str] = None
  scoped_vmem: int = 0
  vmem: int = 0

  @functools.cached_property
  def target_config(self) -> str:
    return (_GPU_TARGETS / self.gpu_config).read_text()

  @property
  def compute_capability(self) -> int:
    """The CUDA compute capability of ``arch`` (``sm_90a`` -> 90), for raw Triton kernels."""
    return int(re.search(r"sm_(\d+)", self.arch).group(1))

  @property
  def shared_memory_limit(self) -> int:
    """Shared memory per block with opt-in (CUDA): the most a kernel may use."""
    return int(re.search(r"shared_memory_per_block_optin:\s*(\d+)", self.target_config).group(1))

  @property
  def device_kind(self) -> str:
    """The device kind the executor keys cached configs by on this target."""
    if self.platform == "cuda":
      return re.search(r'device_description_str:\s*"([^"]*)"', self.target_config).group(1)
    return {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}[self.name]

  def topology_kwargs(self) -> dict:
    kwargs = dict(self.topology, platform=self.platform)
    if self.gpu_config:
      kwargs["target_config"] = self.target_config
    return kwargs

  def unavailable_reason(self) -> Optional[str]:
    """Why this machine cannot compile for the target, if it cannot: a missing package."""
    if self.platform == "tpu":
      if not _installed("libtpu"):
        return "libtpu is not installed (pip install 'pallax[verify]')"
      return None
    if not _installed("jax_plugins.xla_cuda12"):
      return "the CUDA plugin is not installed (pip install 'pallax[verify]')"
    if ptxas() is None:
      return "no ptxas (pip install 'pallax[verify]')"
    return None


def _installed(module: str) -> bool:
  """Whether ``module`` can be imported (its parent package missing: it cannot)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # ``jax_plugins`` exists only where some JAX plugin is installed
    return False


def _gpu(name: str, description: str, arch: str) -> Target:
  """A CUDA target: its device facts in ``gpu_targets/<name>_sxm.txtpb``."""
  return Target(name, "cuda", description, (("topology", "1x1x1"),), f"{name}_sxm.txtpb", arch)


def _tpu(name: str, description: str) -> Target:
  """A TPU target: one chip of a compile-only ``<name>:2x2`` topology, its VMEM as ``TPU_VMEM``."""
  topology = (("topology_name", f"{name}:2x2"),)
  vmem = TPU_VMEM[name]
  return Target(
    name, "tpu", description, topology, scoped_vmem=vmem.default_limit, vmem=vmem.physical
  )


TARGETS = {
  t.name: t
  for t in (
    _gpu("h100", "NVIDIA H100 SXM, sm_90a", "sm_90a"),
    _gpu("a100", "NVIDIA A100 SXM, sm_80", "sm_80"),
    _tpu("v5e", "TPU v5e (v5 lite)"),
    _tpu("v6e", "TPU v6e (v6 lite)"),
  )
}


@functools.cache
def ptxas() -> Optional[str]:
  """The ``ptxas`` XLA uses here: pip's ``nvidia-cuda-nvcc-cu12`` first, then ``PATH``."""
  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  for root in spec.submodule_search_locations if spec else ():
    candidate = pathlib.Path(root) / "bin" / "ptxas"
    if candidate.is_file():
      return str(candidate)
  return shutil.which("ptxas")


def compile_env(base: Optional[dict] = None) -> dict:
  """The environment of a verify worker: CPU as JAX's platform, quiet libtpu."""
  env = dict(os.environ if base is None else base)
  env.update(TPU_ENV)
  env["JAX_PLATFORMS"] = "cpu"
  # Every job must compile: a persistent compilation cache hit dumps nothing to inspect.
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  return env
