"""The one place where pallax reaches into ``jax._src`` or depends on JAX's version.

Each name below has no public JAX API (jax 0.10.2 through 0.11.x). Keep every
private access and every version difference here, so that a JAX upgrade
touches a single file.

What changed from jax 0.10.2 to 0.11 for pallax: every name used here and
every public API pallax calls (``jax.experimental.pallas`` and its ``tpu`` and
``triton`` modules, ``jax.extend.core``, ``jax.interpreters.{ad,batching,
mlir}``, ``custom_partitioning``, ``topologies``) is unchanged. jax 0.11
deprecates the Pallas-Triton backend: lowering a Pallas-Triton kernel for a
GPU emits ``PALLAS_TRITON_DEPRECATION`` (a ``DeprecationWarning``), which
pallax's GPU kernels do until they move to Mosaic GPU. jax 0.11 caches the
programs of the GPU interpreter's threads (``_compile_interpreted_threads_once``).
jax 0.11 needs Python 3.12 or newer.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax._src import dispatch as _dispatch
from jax._src import hardware_utils as _hardware_utils
from jax._src import source_info_util as _source_info_util
from jax._src import stages as _stages
from jax._src.lib import xla_client as _xla_client
from jax._src.lib.mlir import ir

# The start of the warning jax >= 0.11 gives (``DeprecationWarning``,
# deprecation id ``jax-pallas-triton``) each time it lowers a Pallas-Triton
# kernel for a GPU: a ``warnings`` filter's ``message``.
PALLAS_TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"

# Eager evaluation of a primitive: compile it alone and run it (what every
# jax.lax primitive uses as its impl).
apply_primitive = _dispatch.apply_primitive


def require_devices_during_lowering(primitive: Any) -> None:
  """Lets ``custom_partitioning`` run inside ``primitive``'s lowering rule.

  On jax 0.10.2 a ``custom_partitioning`` call inside a primitive's lowering
  fails with "Please file a bug" unless the primitive is in this set (the set
  that ``custom_partitioning_p`` itself is in): lowering then gets the device
  assignment it needs to build the SPMD partitioner callback.
  """
  _dispatch.prim_requires_devices_during_lowering.add(primitive)


def one_source_location():
  """A context in which every traced operation takes the traceback of where it was entered.

  For the per-shard programs traced while XLA partitions a call (or while a
  call inside ``shard_map`` lowers): each of their operations would carry its
  own Python traceback into the HLO's metadata, and XLA:CPU's while-loop
  simplifier, inlining the kernels' loops inside a program's conditionals,
  spent minutes (quadratic in the distinct stack frames) propagating them; a
  ring attention's backward compiled in 1 s with one traceback and did not
  finish in 5 minutes without. ``jax._src.source_info_util.user_context``
  has no public counterpart.
  """
  return _source_info_util.user_context(_xla_client.Traceback.get_traceback())


def enum_flag(name: str, values: Sequence[str], default: str, help: str):
  """A JAX config flag that is part of the jit and trace cache keys.

  Switching it (context manager or ``jax.config.update``) makes already-jitted
  functions re-trace and re-lower instead of reusing a stale executable.
  """
  return _config.enum_state(
    name, list(values), default, help, include_in_jit_key=True, include_in_trace_context=True
  )


def without_vma_checks():
  """Context in which ``shard_map``'s varying-manual-axes checks are off.

  Used only while tracing a kernel inside a primitive's lowering rule: the
  primitive's abstract eval has already fixed how its outputs vary, and
  Pallas' interpreter does not thread that information through the kernel
  body (jax 0.10.2 fails with "requires varying manual axes to match").
  """
  return _config._check_vma(False)


def object_flag(name: str, default, help: str):
  """A JAX config flag holding any hashable object, part of the trace context."""
  return _config.string_or_object_state(
    name, default, help, include_in_jit_key=True, include_in_trace_context=True
  )


def lowering_a_partition(ctx: Any) -> bool:
  """Whether ``ctx`` lowers the per-device body of a ``custom_partitioning`` call.

  jax 0.10.2 lowers that body, inside XLA's SPMD partitioner, as a module
  named ``tmp_xla_computation`` (``jax._src.custom_partitioning``) and drops
  the module's keep-alive objects, among them the host callbacks that
  ``pure_callback`` registers: running one later crashes the process
  (jax-ml/jax#23620).
  """
  name = ctx.module_context.module.operation.attributes["sym_name"]
  return ir.StringAttr(name).value == "tmp_xla_computation"


def quiet_cuda_plugin_without_gpu() -> None:
  """Keeps JAX's CUDA plugin from logging a traceback where no NVIDIA GPU is visible.

  With the plugin installed (pallax's ``verify`` and ``test`` extras), JAX's
  first backend initialisation calls its ``initialize()``; unless
  ``JAX_PLATFORMS`` leaves CUDA out, that checks the CUDA libraries' versions,
  which without a GPU fails ("Unable to load CUDA. Is it installed?") and is
  logged as a "Jax plugin configuration error" with two tracebacks. JAX then
  skips the CUDA backend anyway, by the same test used here
  (``hardware_utils.has_visible_nvidia_gpu``: no ``/dev/nvidia*``), so the
  check can only fail: this skips it (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``, read
  by the plugin), unless the user has set that variable. It takes effect if
  called before JAX initialises its backends (``import pallax`` does), and
  changes nothing on a machine with a visible GPU.
  """
  if "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" in os.environ or _hardware_utils.has_visible_nvidia_gpu():
    return
  os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"


def mosaic_gpu_interpret_params(detect_races: bool = False) -> Any:
  """Parameters that run a Pallas Mosaic GPU kernel in JAX's GPU interpreter on the CPU.

  ``InterpretGPUParams()`` (``jax._src.pallas.mosaic_gpu.interpret.params``,
  no public path in jax 0.10.2) passed as ``interpret=`` to ``plgpu.kernel``
  or ``pallas_call`` simulates the GPU's memories, warpgroups and barriers;
  ``interpret=True`` fails on Mosaic GPU primitives. What it runs:
  docs/mosaic_gpu.md. Imported on use: it loads Pallas' Mosaic GPU modules.
  ``detect_races``: the interpreter checks every SMEM access of one thread
  against the others' since their last synchronisation.
  """
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  _compile_interpreted_threads_once()
  return InterpretGPUParams(detect_races=detect_races)


# Each interpreted thread program's executable, per argument types: jaxpr ->
# {types: [lock, run]}. Weak in the jaxpr, which the kernel's host callback
# holds, and so does jit's trace cache (a static argument) until it evicts it.
_THREAD_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_THREAD_PROGRAMS_LOCK = threading.Lock()


def _eval_thread_program(jaxpr: Any, consts: Any, *args: Any) -> None:
  jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_thread_program(jaxpr: Any, consts: Any, *args: Any) -> None:
  """``thread_map._run_jaxpr``, compiling each thread program once, not once a thread a call."""
  types = tuple(jax.typeof(x) for x in jax.tree.leaves((consts, args)))
  with _THREAD_PROGRAMS_LOCK:
    entry = _THREAD_PROGRAMS.setdefault(jaxpr, {}).setdefault(types, [threading.Lock(), None])
  with entry[0]:  # the warpgroups of one call wait for the first one's compile
    if entry[1] is None:
      traced = jax.jit(_eval_thread_program, static_argnums=0).trace(jaxpr, consts, *args)
      # Called through ``Compiled.call``: ``Compiled.__call__`` sets its
      # dispatcher lazily, which threads calling one executable at once race on
      # (a program with host callbacks has no C++ dispatcher).
      params = traced.lower().compile()._params
      entry[1] = functools.partial(_stages.Compiled.call, params)
  entry[1](consts, *args)


def _compile_interpreted_threads_once() -> None:
  """Makes JAX's interpreters compile each simulated thread's program once.

  The GPU interpreter runs a kernel's warpgroups as host threads
  (``jax._src.pallas.mosaic.interpret.thread_map``). In jax 0.10.2 each
  thread of each call traces, lowers and compiles its program afresh
  (``_run_jaxpr`` jits a closure defined anew, so JAX's caches miss): a
  forward-and-backward attention test compiled 3 distinct programs 20
  times, which took 40 s of compile time (summed over the threads) in a
  23 s test. This replaces ``_run_jaxpr`` (same signature in jax 0.10.2 and
  0.11) with one that keeps each program's executable, shared by the
  threads of a call. jax 0.11 caches them itself (its ``_run`` is a module
  function), but the threads of a first call still compile it side by side.
  Where a JAX version has no ``_run_jaxpr``, this changes nothing.
  """
  from jax._src.pallas.mosaic.interpret import thread_map

  if hasattr(thread_map, "_run_jaxpr"):
    thread_map._run_jaxpr = _run_thread_program


def mosaic_gpu_race_found() -> bool:
  """Whether the kernel JAX's GPU interpreter last ran with ``detect_races`` had a data race.

  The interpreter keeps its race detection's state in a module global
  (``gpu_callbacks.get_races()``, no public path) until the next kernel.
  """
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  return bool(gpu_callbacks.get_races().races_found)


def reset_mosaic_gpu_interpreter() -> None:
  """Resets JAX's GPU interpreter after a kernel raised in it.

  Its global state is left half-initialised, and the next interpreted kernel
  in the process fails in ``_initialize_shared_memory`` unless it is reset
  (``reset_gpu_interpret_mode_state``, no public path in jax 0.10.2).
  """
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
    reset_gpu_interpret_mode_state,
  )

  reset_gpu_interpret_mode_state()
