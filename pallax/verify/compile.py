"""One compile job, run inside a verify worker: compile, then read the compiler's reports.

The kernel call is bound alone with its config pinned and compiled for the
target's compile-only topology. For CUDA the XLA dump holds the PTX of every
kernel and the launch facts (threads, dynamic shared memory); ``ptxas -v``
(XLA's own assembler and flags) gives registers and spill bytes per kernel.
A raw Triton kernel is compiled to PTX by jax-triton while the call is
lowered (for the target's compute capability) and assembled only at launch:
its PTX and shared memory come from jax-triton's dump, and ptxas is run on it
here. A Pallas Mosaic GPU kernel is compiled (MLIR -> PTX -> ptxas) by the
CUDA plugin inside ``compile()``, which prints ptxas's report to the process's
standard output when asked; its launch facts come from the Mosaic GPU module
the lowered call carries. For TPU the optimized HLO after code generation
holds each Mosaic kernel's scoped VMEM allocation.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Optional

import jax
import numpy as np
from jax.experimental import topologies
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallax import triton_raw
from pallax.executor.registry import kernel_spec
from pallax.verify.sweep import kernel_calls_of
from pallax.verify.targets import TARGETS, Target, ptxas

CALL_TARGET = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
RAW_CALL_TARGET = "triton_kernel_call"
MOSAIC_GPU = "pallas_mosaic_gpu"  # the implementation whose kernels compile in compile()
MOSAIC_GPU_CALL_TARGET = "mosaic_gpu_v2"  # its custom call (``@mosaic_gpu_v2`` in the text)
_RAW_DUMP = "jax_triton"  # jax-triton's dump, beside XLA's
_ERROR_CHARS = 600


@functools.cache
def _mesh(name: str) -> Mesh:
  topology = topologies.get_topology_desc(**TARGETS[name].topology_kwargs())
  return Mesh(np.array(topology.devices[:1]), ("x",))


def _arguments(eqn) -> list[jax.ShapeDtypeStruct]:
  return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]


def _first_lines(err: BaseException) -> str:
  text = f"{type(err).__name__}: {err}".strip()
  return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS] + " ..."


def compile_job(message: dict) -> dict:
  """Compiles one job (``sweep.Job.message()``); returns its result record."""
  target = TARGETS[message["target"]]
  eqn = kernel_calls_of(message["case"])[message["call"]]
  config = kernel_spec(eqn.primitive.name).config_from_dict(message["config"])
  params = {**eqn.params, "config": config}
  fn = lambda *args: eqn.primitive.bind(*args, **params)
  record = {"id": message["id"], "kernels": []}
  start = time.perf_counter()
  try:
    record["kernels"] = compile_kernels(fn, _arguments(eqn), target, config.implementation)
  except Exception as err:  # noqa: BLE001 -- every compiler error is a result
    record.update(status="failed", error=_first_lines(err))
  else:
    record.update(judge(record["kernels"], target))
  record["compile_s"] = round(time.perf_counter() - start, 3)
  return record


def compile_kernels(
  fn: Callable, args: Sequence[jax.ShapeDtypeStruct], target: Target, implementation: str
) -> list[dict]:
  """Compiles ``fn(*args)`` for ``target`` and returns its kernels' resources.

  Args:
    fn: the function to compile; it must call at least one kernel of
      ``implementation``.
    args: the shapes and dtypes of its arguments (placed on one device of the
      target's compile-only topology here).
    target: the hardware to compile for.
    implementation: the kernels' implementation (``"pallas"``,
      ``"triton_raw"``, ``"pallas_mosaic_gpu"``): where their reports are read.

  Returns:
    One record per kernel: ``name`` and, for CUDA, ``registers``,
    ``spill_bytes``, ``smem_bytes`` and ``threads``; for TPU ``vmem_bytes``.
    ``judge`` turns them into a status.

  Raises:
    ReportMissing: the compiler's reports lack a kernel the program has.
  """
  mesh = _mesh(target.name)
  sharding = NamedSharding(mesh, PartitionSpec())
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  if implementation == MOSAIC_GPU:
    # Mosaic GPU takes the kernel's architecture from JAX's default device
    # (sm_90a when that is no GPU): the target's device, for its architecture.
    with jax.default_device(mesh.devices.flat[0]):
      return _mosaic_gpu_kernels(jax.jit(fn).trace(*args).lower(), target)
  raw = implementation == triton_raw.IMPLEMENTATION
  with contextlib.ExitStack() as stack:
    dump = stack.enter_context(tempfile.TemporaryDirectory(prefix="pallax-verify-"))
    if raw:
      stack.enter_context(triton_raw.dumping_to(str(pathlib.Path(dump) / _RAW_DUMP)))
      stack.enter_context(triton_raw.compute_capability(target.compute_capability))
    lowered = jax.jit(fn).trace(*args).lower()
    calls = lowered.as_text().count(RAW_CALL_TARGET if raw else CALL_TARGET[target.platform])
    if not calls:
      raise RuntimeError(f"the lowered program has no {implementation} kernel call")
    lowered.compile(compiler_options={"xla_dump_to": dump})
    read = _raw_kernels if raw else _gpu_kernels if target.platform == "cuda" else _tpu_kernels
    return read(pathlib.Path(dump), target, calls)


def judge(kernels: list[dict], target: Target) -> dict:
  """``status`` (and ``error``) of a compiled job from its kernels' resources."""
  spilled = [k["name"] for k in kernels if k["spill_bytes"]] if target.platform == "cuda" else []
  if spilled:
    return {"status": "spills", "error": f"register spills in {', '.join(spilled)}"}
  serialized = [
    f"{k['name']} ({k['wgmma_serialized']})" for k in kernels if k.get("wgmma_serialized")
  ]
  if serialized:
    return {"status": "failed", "error": f"ptxas serializes the wgmma of {', '.join(serialized)}"}
  for k in kernels:
    if target.platform == "cuda" and k["smem_bytes"] > target.shared_memory_limit:
      return {
        "status": "failed",
        "error": f"{k['name']} uses {k['smem_bytes']} bytes of shared memory, "
        f"over the {target.shared_memory_limit} of a block on {target.name}",
      }
  return {"status": "ok"}


def shared_result(
  kernels_from: dict[str, str], results: dict[str, dict], target: Target
) -> Optional[dict]:
  """A job's result from the jobs that compile its kernels (``sweep.Job.kernels_from``).

  Each kernel's record is the one its job's compile reported (the launch
  named ``name`` or ``name_...``), and the status is judged from them as a
  compiled job's: a kernel that spills in another config spills here; that
  config's other kernel does not count. None where a job's compile reported
  no such kernel (it failed, crashed or timed out): the job is compiled then.
  """
  kernels = []
  for name, owner in sorted(kernels_from.items()):
    found = [k for k in results[owner].get("kernels", ()) if f"{k['name']}_".startswith(f"{name}_")]
    if not found:
      return None
    kernels += found
  return {"kernels": kernels, **judge(kernels, target)}


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
# ptxas' performance warnings (C7513 and its kin), printed before the function's
# report: its code, why, and the function.
_SERIALIZED = re.compile(
  r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized"
  r" (due to [^\n]*?) in the function '(\w+)'"
)


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
  serialized = _serialized(done.stderr)
  return [_ptxas_facts(name, block, serialized) for name, block in _ptxas_blocks(done.stderr)]


def _ptxas_blocks(text: str) -> list[tuple[str, str]]:
  """Each entry function in ptxas's ``-v`` report with its part of the report."""
  parts = _PTXAS_FUNCTION.split(text)
  return list(zip(parts[1::2], parts[2::2]))


def _serialized(text: str) -> dict[str, str]:
  """Function -> why ptxas serialized its ``wgmma`` (``"C7513: due to ..."``), from its warnings."""
  return {name: f"{code}: {why}" for code, why, name in _SERIALIZED.findall(text)}


def _ptxas_facts(name: str, block: str, serialized: dict[str, str]) -> dict:
  """``name``, ``registers``, ``spill_bytes`` (stores and loads) of one entry function.

  ``wgmma_serialized``: why ptxas serialized its ``wgmma`` (``serialized``,
  from its warnings), or None.
  """
  registers = _REGISTERS.search(block)
  return {
    "name": name,
    "registers": int(registers.group(1)) if registers else None,
    "spill_bytes": sum(int(a) + int(b) for a, b in _SPILLS.findall(block)),
    "wgmma_serialized": serialized.get(name),
  }


# -- CUDA: Pallas Mosaic GPU, ptxas's report on stdout ------------------------------
#
# The CUDA plugin compiles each ``mosaic_gpu_v2`` call inside ``compile()``
# (MLIR -> PTX -> ptxas, in its FFI instantiate stage). It reads
# MOSAIC_GPU_DUMP_PTXAS at each compile and then prints ptxas's ``-v`` report
# to file descriptor 1 (``Compiling entry function 'body_mosaic_gpu_kernel'
# for 'sm_90a'`` ... ``Used 154 registers, used 2 barriers, 1 bytes smem``),
# not to ``sys.stdout``. MOSAIC_GPU_DUMP_TO would send every dump, ~20 MB of
# MLIR log per kernel, to files instead: it is left unset meanwhile.
#
# ptxas's ``smem`` is static shared memory only (Mosaic GPU's 1-byte base
# symbol); a kernel's shared memory is dynamic, set by its launch. The lowered
# call carries its Mosaic GPU module (MLIR bytecode: ``module`` in the call's
# ``mhlo.backend_config``, beside ``kernel_hash``, the SHA-256 of those bytes)
# after Mosaic GPU's serialization pass, which renames its ops
# (``stable_mosaic_gpu.gpu.launch``); parsed with unregistered ops allowed, its
# one ``gpu.launch`` gives the block size and the dynamic shared memory as
# constant operands, and the module its architecture (``mosaic_gpu.arch_major``
# and ``arch_minor``). The launch is outlined into PTX entry
# ``<enclosing function>_kernel`` (MLIR's GPU kernel outlining), the name
# ptxas reports.

_DUMP_PTXAS, _DUMP_TO = "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO"
_LAUNCH_OPS = ("gpu.launch", "stable_mosaic_gpu.gpu.launch")
_PTXAS_ARCH = re.compile(r" for '(\w+)'")
_STATIC_SMEM = re.compile(r"Used \d+ registers[^\n]*?(\d+) bytes smem")
_SEGMENTS = "operandSegmentSizes"
# gpu.launch's operand segments: dependencies, grid xyz, block xyz, cluster xyz, shared memory.
_BLOCK_SEGMENTS, _SMEM_SEGMENT = (4, 5, 6), 10

# What ptxas reported for each Mosaic GPU kernel compiled in this process, by
# ``kernel_hash``: the plugin compiles a kernel once per process, and a later
# program calling the same kernel reuses it and prints no report.
_MOSAIC_GPU_REPORTS: dict[bytes, dict] = {}


def _mosaic_gpu_kernels(lowered: Any, target: Target) -> list[dict]:
  """Compiles the lowered program; every Mosaic GPU kernel with its launch and ptxas facts."""
  launches = _mosaic_gpu_launches(lowered.compiler_ir("stablehlo"))
  if not launches:
    raise RuntimeError(f"the lowered program has no {MOSAIC_GPU} kernel call")
  for launch in launches:
    if launch["arch"] != target.compute_capability:
      raise RuntimeError(
        f"Mosaic GPU kernel {launch['name']} was lowered for compute capability "
        f"{launch['arch']}, not {target.name}'s {target.compute_capability}"
      )
  with tempfile.TemporaryFile() as sink:
    with _ptxas_report_on_stdout(), _stdout_to(sink):
      lowered.compile()
    sink.seek(0)
    reports = _mosaic_gpu_reports(sink.read().decode(errors="replace"), target)
  return _with_reports(launches, reports)


def _mosaic_gpu_reports(text: str, target: Target) -> list[dict]:
  """Registers, spills and static shared memory of each kernel in ptxas's printed reports."""
  reports, serialized = [], _serialized(text)
  for name, block in _ptxas_blocks(text):
    arch, smem = _PTXAS_ARCH.match(block), _STATIC_SMEM.search(block)
    if arch is None or arch.group(1) != target.arch:
      raise RuntimeError(f"ptxas compiled {name} for {arch and arch.group(1)}, not {target.arch}")
    facts = _ptxas_facts(name, block, serialized)
    reports.append({**facts, "static_smem": int(smem.group(1)) if smem else 0})
  return reports


def _with_reports(launches: list[dict], reports: list[dict]) -> list[dict]:
  """Each launch's kernel record, its ptxas report found by entry name.

  Calls of one kernel share its report; distinct kernels with one name are
  refused (ptxas reports them in no known order).
  """
  by_name: dict[str, list[dict]] = {}
  for report in reports:
    by_name.setdefault(report["name"], []).append(report)
  fresh: dict[str, set] = {}
  for launch in launches:
    if launch["hash"] not in _MOSAIC_GPU_REPORTS:
      fresh.setdefault(launch["name"], set()).add(launch["hash"])
  for name, hashes in fresh.items():
    if len(hashes) > 1:  # ptxas's reports do not come in program order
      raise ReportMissing(
        f"{len(hashes)} distinct Mosaic GPU kernels are named {name} in one program: "
        "their reports cannot be told apart (name each kernel)"
      )
  kernels = []
  for launch in launches:
    if launch["hash"] not in _MOSAIC_GPU_REPORTS:
      found = by_name.get(launch["name"])
      if not found or found[0]["registers"] is None:
        raise ReportMissing(f"ptxas reported no registers for Mosaic GPU kernel {launch['name']}")
      _MOSAIC_GPU_REPORTS[launch["hash"]] = found.pop(0)
    report = _MOSAIC_GPU_REPORTS[launch["hash"]]
    kernels.append(
      {
        "name": launch["name"],
        "registers": report["registers"],
        "spill_bytes": report["spill_bytes"],
        "wgmma_serialized": report["wgmma_serialized"],
        "smem_bytes": launch["dynamic_smem"] + report["static_smem"],
        "threads": launch["threads"],
      }
    )
  return kernels


def _mosaic_gpu_launches(module: Any) -> list[dict]:
  """Each Mosaic GPU call of a lowered module (``ir.Module``): its kernel's launch facts."""
  calls = []

  def visit(op):
    target = op.attributes["call_target_name"] if "call_target_name" in op.attributes else None
    if target is not None and mlir.ir.StringAttr(target).value == MOSAIC_GPU_CALL_TARGET:
      calls.append(op)
    return mlir.ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  context = module.context
  allow_unregistered = context.allow_unregistered_dialects
  context.allow_unregistered_dialects = True
  try:
    return [_launch_facts(call, context) for call in calls]
  finally:
    context.allow_unregistered_dialects = allow_unregistered


def _launch_facts(call: Any, context: Any) -> dict:
  """The ``hash``, entry ``name``, ``arch``, ``threads``, ``dynamic_smem`` of a Mosaic GPU call."""
  config = mlir.ir.DictAttr(call.attributes["mhlo.backend_config"])
  kernel = mlir.ir.Module.parse(mlir.ir.StringAttr(config["module"]).value_bytes, context=context)
  launches = []

  def visit(op):
    if op.name in _LAUNCH_OPS:
      launches.append(op)
    return mlir.ir.WalkResult.ADVANCE

  kernel.operation.walk(visit)
  if len(launches) != 1:
    raise ReportMissing(f"a Mosaic GPU module with {len(launches)} kernel launches, not one")
  (launch,) = launches
  function = launch.parent
  while "sym_name" not in function.attributes:
    function = function.parent
  attributes = kernel.operation.attributes
  arch = [mlir.ir.IntegerAttr(attributes[f"mosaic_gpu.arch_{p}"]).value for p in ("major", "minor")]
  segments = list(mlir.ir.DenseI32ArrayAttr(launch.attributes[_SEGMENTS]))
  operand = lambda segment: _constant(launch.operands[sum(segments[:segment])])
  return {
    "hash": mlir.ir.StringAttr(config["kernel_hash"]).value_bytes,
    "name": f"{mlir.ir.StringAttr(function.attributes['sym_name']).value}_kernel",
    "arch": 10 * arch[0] + arch[1],
    "threads": int(np.prod([operand(s) for s in _BLOCK_SEGMENTS])),
    "dynamic_smem": operand(_SMEM_SEGMENT) if segments[_SMEM_SEGMENT] else 0,
  }


def _constant(value: Any) -> int:
  """The integer a launch operand is: the ``value`` of the constant defining it."""
  owner = value.owner
  if "value" not in owner.attributes:
    raise ReportMissing(f"a Mosaic GPU launch operand that is no constant: {owner.name}")
  return mlir.ir.IntegerAttr(owner.attributes["value"]).value


@contextlib.contextmanager
def _ptxas_report_on_stdout() -> Iterator[None]:
  """Has the CUDA plugin print ptxas's report of each Mosaic GPU kernel, no other dump."""
  saved = {name: os.environ.get(name) for name in (_DUMP_PTXAS, _DUMP_TO)}
  os.environ[_DUMP_PTXAS] = "1"
  os.environ.pop(_DUMP_TO, None)
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


@contextlib.contextmanager
def _stdout_to(sink: IO[bytes]) -> Iterator[None]:
  """Points file descriptor 1 at ``sink`` meanwhile, whatever happens, C buffers flushed."""
  sys.stdout.flush()
  saved = os.dup(1)
  try:
    os.dup2(sink.fileno(), 1)
    yield
  finally:
    ctypes.CDLL(None).fflush(None)
    os.dup2(saved, 1)
    os.close(saved)


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
