"""One compile job, run inside a verify worker: compile, then read the compiler's reports.

The kernel call is bound alone with its config pinned and compiled for the
target's compile-only topology. For CUDA the XLA dump holds the PTX of every
kernel and the launch facts (threads, dynamic shared memory); ``ptxas -v``
(XLA's own assembler and flags) gives registers and spill bytes per kernel.
A raw Triton kernel is compiled to PTX by jax-triton while the call is
lowered (for the target's compute capability) and assembled only at launch:
its PTX and shared memory come from jax-triton's dump, and ptxas is run on it
here. For TPU the optimized HLO after code generation holds each Mosaic
kernel's scoped VMEM allocation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import re
import subprocess
import tempfile
import time

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallax import triton_raw
from pallax.executor.registry import kernel_spec
from pallax.verify.sweep import kernel_calls_of
from pallax.verify.targets import TARGETS, Target, ptxas

CALL_TARGET = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
RAW_CALL_TARGET = "triton_kernel_call"
_RAW_DUMP = "jax_triton"  # jax-triton's dump, beside XLA's
_ERROR_CHARS = 600


@functools.cache
def _mesh(name: str) -> Mesh:
  topology = topologies.get_topology_desc(**TARGETS[name].topology_kwargs())
  return Mesh(np.array(topology.devices[:1]), ("x",))


def _arguments(eqn, mesh: Mesh) -> list[jax.ShapeDtypeStruct]:
  sharding = NamedSharding(mesh, PartitionSpec())
  return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding) for v in eqn.invars]


def _first_lines(err: BaseException) -> str:
  text = f"{type(err).__name__}: {err}".strip()
  return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + " ..."


def compile_job(message: dict) -> dict:
  """Compiles one job (``sweep.Job.message()``); returns its result record."""
  target = TARGETS[message["target"]]
  eqn = kernel_calls_of(message["case"])[message["call"]]
  config = kernel_spec(eqn.primitive.name).config_cls.from_dict(message["config"])
  params = {**eqn.params, "config": config}
  fn = lambda *args: eqn.primitive.bind(*args, **params)
  record = {"id": message["id"], "kernels": []}
  raw = config.implementation == triton_raw.IMPLEMENTATION
  start = time.perf_counter()
  with contextlib.ExitStack() as stack:
    dump = stack.enter_context(tempfile.TemporaryDirectory(prefix="pallax-verify-"))
    try:
      if raw:
        stack.enter_context(triton_raw.dumping_to(str(pathlib.Path(dump) / _RAW_DUMP)))
        stack.enter_context(triton_raw.compute_capability(target.compute_capability))
      lowered = jax.jit(fn).trace(*_arguments(eqn, _mesh(target.name))).lower()
      calls = lowered.as_text().count(RAW_CALL_TARGET if raw else CALL_TARGET[target.platform])
      if not calls:
        raise RuntimeError(f"the lowered program has no {config.implementation} kernel call")
      lowered.compile(compiler_options={"xla_dump_to": dump})
      record["compile_s"] = round(time.perf_counter() - start, 3)
      read = _raw_kernels if raw else _gpu_kernels if target.platform == "cuda" else _tpu_kernels
      record["kernels"] = read(pathlib.Path(dump), target, calls)
    except Exception as err:  # noqa: BLE001 -- every compiler error is a result
      record.update(status="failed", error=_first_lines(err))
      record.setdefault("compile_s", round(time.perf_counter() - start, 3))
      return record
  record.update(judge(record["kernels"], target))
  return record


def judge(kernels: list[dict], target: Target) -> dict:
  """``status`` (and ``error``) of a compiled job from its kernels' resources."""
  spilled = [k["name"] for k in kernels if k["spill_bytes"]] if target.platform == "cuda" else []
  if spilled:
    return {"status": "spills", "error": f"register spills in {', '.join(spilled)}"}
  for k in kernels:
    if target.platform == "cuda" and k["smem_bytes"] > target.shared_memory_limit:
      return {
        "status": "failed",
        "error": f"{k['name']} uses {k['smem_bytes']} bytes of shared memory, "
        f"over the {target.shared_memory_limit} of a block on {target.name}",
      }
  return {"status": "ok"}


class ReportMissing(RuntimeError):
  """The compiler's reports lack a kernel the program has: never counted as a pass."""


# -- CUDA: ptxas on the dumped PTX --------------------------------------------------

_LAUNCH = re.compile(
  r"(\w+) grid: \[[^\]]*\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)"
)
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
_PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _gpu_kernels(dump: pathlib.Path, target: Target, calls: int) -> list[dict]:
  """Every kernel of the compiled program with its launch and ptxas facts."""
  launches = {}
  for path in dump.glob("*thunk_sequence.txt"):
    for name, x, y, z, smem in _LAUNCH.findall(path.read_text()):
      launches[name] = {"threads": int(x) * int(y) * int(z), "smem_bytes": int(smem)}
  kernels = []
  for path in sorted(dump.glob("*.ptx")):
    entries = _ENTRY.findall(path.read_text())
    if entries:
      found = _ptxas_report(path, target.arch)
      if sorted(k["name"] for k in found) != sorted(entries):
        raise ReportMissing(f"ptxas reported {found} for the entries {entries} of {path.name}")
      kernels += found
  for kernel in kernels:
    if kernel["name"] not in launches or kernel["registers"] is None:
      raise ReportMissing(f"no launch or register facts for kernel {kernel['name']}")
    kernel.update(launches[kernel["name"]])
  if len(kernels) < calls:
    raise ReportMissing(f"{len(kernels)} kernels in the dump for {calls} Pallas calls")
  return kernels


_THREADS = re.compile(r"\.reqntid\s+(\d+)")
_RAW_SMEM = re.compile(r"shared_mem_bytes:\s*(\d+)")


def _raw_kernels(dump: pathlib.Path, target: Target, calls: int) -> list[dict]:
  """Every raw Triton kernel jax-triton compiled, with ptxas's facts and its shared memory.

  Shared memory is what Triton allocates (dynamic, from its compile metadata),
  checked against the block's limit by ``judge`` as for Pallas kernels.
  """
  kernels = []
  for path in sorted(dump.glob(f"{_RAW_DUMP}/*/*.ptx")):
    found = _ptxas_report(path, target.arch)
    if len(found) != 1 or found[0]["registers"] is None:
      raise ReportMissing(f"ptxas reported {found} for raw Triton kernel {path.name}")
    threads = _THREADS.search(path.read_text())
    smem = _RAW_SMEM.search(path.with_suffix(".compile_info").read_text())
    if threads is None or smem is None:
      raise ReportMissing(f"no thread count or shared memory for raw Triton kernel {path.name}")
    found[0].update(threads=int(threads.group(1)), smem_bytes=int(smem.group(1)))
    kernels += found
  if len(kernels) < calls:
    raise ReportMissing(f"{len(kernels)} raw Triton kernels dumped for {calls} calls")
  return kernels


def _ptxas_report(path: pathlib.Path, arch: str) -> list[dict]:
  """Registers and spill bytes per entry function (callees' spills included), from ptxas."""
  done = subprocess.run(
    [ptxas(), f"-arch={arch}", "-v", "--warn-on-spills", str(path), "-o", "/dev/null"],
    capture_output=True,
    text=True,
    check=False,
  )
  if done.returncode:
    raise RuntimeError(f"ptxas failed on {path.name}: {done.stderr.strip()[:_ERROR_CHARS]}")
  parts = _PTXAS_FUNCTION.split(done.stderr)
  kernels = []
  for name, block in zip(parts[1::2], parts[2::2]):
    registers = _REGISTERS.search(block)
    kernels.append(
      {
        "name": name,
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": sum(int(a) + int(b) for a, b in _SPILLS.findall(block)),
      }
    )
  return kernels


# -- TPU: scoped VMEM from the compiled HLO ----------------------------------------------

_TPU_CALL = re.compile(r"%([\w.-]+) = .*custom_call_target=\"tpu_custom_call\"(.*)")


def _tpu_kernels(dump: pathlib.Path, target: Target, calls: int) -> list[dict]:
  """Every Mosaic kernel of the compiled program with its scoped VMEM."""
  kernels = []
  for path in dump.glob("*after_codegen.txt"):
    for name, rest in _TPU_CALL.findall(path.read_text()):
      used = re.search(r'"used_scoped_memory_configs":(\[[^\]]*\])', rest)
      if used is None:
        raise ReportMissing(f"no scoped VMEM for Mosaic kernel {name}")
      kernels.append({"name": name, "vmem_bytes": sum(int(c["size"]) for c in json.loads(used[1]))})
  if len(kernels) < calls:
    raise ReportMissing(f"{len(kernels)} Mosaic kernels in the dump for {calls} Pallas calls")
  return kernels
