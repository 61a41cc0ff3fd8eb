"""Raw Triton kernels: ``@triton.jit`` functions as an implementation of a pallax kernel.

A family's ``kernels/<family>/triton_raw.py`` writes its kernels in Triton's
own language and starts them with ``launch``. Configs naming
``implementation="triton_raw"`` select them; the executor treats them like
the Pallas kernels (heuristic, candidates, autotuning, ``pallax.verify``).
How a launch runs depends on where the call runs:

* ``cuda`` (and ``rocm``): jax-triton's ``triton_call``, which compiles the
  kernel while the program is lowered and leaves a custom call holding it.
  Lowering for a GPU without one needs its compute capability, which
  ``compute_capability`` sets (``pallax.verify`` and the tests do).
* interpreted targets (``cpu``, the interpret switch): Triton's interpreter
  runs the same function on host copies of the operands, through
  ``jax.pure_callback``. Triton decides at import whether it interprets
  (``TRITON_INTERPRET=1``); a process is either one or the other, so tests
  of the interpreted kernels run in their own process.

Nothing here imports triton or jax-triton until a raw kernel is launched: the
core package does not need them (they come with the ``triton`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallax import _jax_private
from pallax.executor.registry import interpreted, platform_of

IMPLEMENTATION = "triton_raw"
_INSTALL = "pip install 'pallax[triton]'"
# Part of JAX's trace context, so that lowering one function for two compute
# capabilities lowers it twice.
_TARGET_CC = _jax_private.object_flag(
  "pallax_triton_compute_capability",
  None,
  "The CUDA compute capability raw Triton kernels are lowered for (None: the local GPU's).",
)


def interpreter_mode() -> bool:
  """Whether Triton interprets its kernels in this process (``TRITON_INTERPRET`` at import)."""
  return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def unavailable_reason(target: str) -> Optional[str]:
  """Why a raw Triton kernel cannot run a call on ``target``, if it cannot.

  Args:
    target: an executor target (``registry.TARGETS``).
  """
  missing = [m for m in ("triton", "jax_triton") if importlib.util.find_spec(m) is None]
  if missing:
    return f"raw Triton kernels need {' and '.join(missing)} ({_INSTALL})"
  if interpreted(target):
    if not interpreter_mode():
      return (
        "raw Triton kernels run on the CPU only under Triton's interpreter: set "
        "TRITON_INTERPRET=1 before triton is imported"
      )
    return None
  if platform_of(target) not in ("cuda", "rocm"):
    return f"raw Triton kernels run on cuda and rocm, not {target}"
  if interpreter_mode():
    return "Triton was imported in interpreter mode (TRITON_INTERPRET=1): it cannot compile here"
  return None


@contextlib.contextmanager
def compute_capability(cc: int) -> Iterator[None]:
  """Lowers raw Triton kernels for compute capability ``cc`` (90: H100) inside the block.

  Without it jax-triton asks the CUDA driver of the local GPU, which fails on
  a machine without one.
  """
  with _TARGET_CC(cc):
    yield


def import_triton(module: str) -> tuple[Any, Any]:
  """``triton`` and ``triton.language`` for a raw kernel module, or an error naming the extra.

  A family's ``triton_raw.py`` gets them here rather than by ``import
  triton``: without the ``triton`` extra its import fails with an
  ``ImportError`` that says what to install, and triton comes with the
  environment ``_modules`` sets up (whichever way the module is reached).

  Args:
    module: the importing module's name (``__name__``), for the message.

  Raises:
    ImportError: triton or jax-triton is not installed.
  """
  try:
    triton = _modules()[0]
  except ImportError as e:
    first = str(e).splitlines()[0]
    if e.name is None:  # raised by jax-triton itself: jaxlib has no CUDA plugin
      raise ImportError(
        f"{module}: jax-triton imports only where jaxlib has its CUDA plugin: pip install "
        f"'pallax[cuda12]' on an NVIDIA GPU machine, or 'pallax[verify]' (the CUDA plugin "
        f"the compilers use) on another ({first})"
      ) from e
    raise ImportError(
      f"{module} needs triton and jax-triton, which come with the triton extra: {_INSTALL} "
      f"({first})"
    ) from e
  return triton, importlib.import_module("triton.language")


@functools.cache
def _modules() -> tuple[Any, Any]:
  """The triton and jax_triton modules, imported once, with the environment they change put back.

  Importing jax_triton sets ``TRITON_CACHE_DIR=""``; the user's value (or its
  absence) is restored. Triton picks the PTX version from the ptxas it finds,
  and the ptxas it bundles emits PTX newer than CUDA 12's tools and jaxlib's
  CUDA 12 runtime accept: where CUDA 12's ptxas is installed (pip's
  ``nvidia-cuda-nvcc-cu12``, as for XLA), Triton is pointed at it unless the
  user chose one (``TRITON_PTXAS_PATH``; ``TRITON_PTXAS_BLACKWELL_PATH``
  serves sm_90 and newer).
  """
  from pallax.verify.targets import ptxas

  tool = ptxas()
  if tool is not None:
    for name in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
      os.environ.setdefault(name, tool)
  cache = os.environ.get("TRITON_CACHE_DIR")
  # triton first, so that its absence is what a missing triton reports.
  triton = importlib.import_module("triton")
  jax_triton = importlib.import_module("jax_triton")

  if cache is None:
    os.environ.pop("TRITON_CACHE_DIR", None)
  else:
    os.environ["TRITON_CACHE_DIR"] = cache
  return triton, jax_triton


@contextlib.contextmanager
def dumping_to(directory: str) -> Iterator[None]:
  """Has jax-triton write each kernel it compiles inside the block under ``directory``.

  Per kernel, a folder with its PTX (``<name>.ptx``), its shared memory
  (``<name>.compile_info``) and its Triton IRs: what ``pallax.verify`` reads,
  since XLA's compile does not assemble raw Triton kernels (that happens at
  launch). jax-triton reads ``JAX_TRITON_DUMP_DIR`` once, at import, and keeps
  compiled kernels for the process: this sets its module's dump folder and
  empties that cache (both private to jax-triton 0.3.1) so that every kernel
  compiled in the block is written.
  """
  lib = _modules()[1].triton_lib
  saved = lib._JAX_TRITON_DUMP_DIR
  lib._JAX_TRITON_DUMP_DIR = directory
  lib._COMPILED_KERNEL_CACHE.clear()
  try:
    yield
  finally:
    lib._JAX_TRITON_DUMP_DIR = saved
    lib._COMPILED_KERNEL_CACHE.clear()


class LazyKernels:
  """A family's raw Triton module, imported when one of its kernels first runs.

  Stands in for the module in ``Kernel.of_family``'s backends: the module
  imports triton at its top (its kernels are ``@triton.jit`` functions), which
  the core package must not do unless a raw kernel is used.

  Args:
    module: the module's import name.
    names: the kernel functions it defines (the stages it has).
  """

  def __init__(self, module: str, names: Sequence[str]):
    self.module, self.names = module, tuple(names)

  def __getattr__(self, name: str) -> Callable[..., list]:
    if name not in self.names:
      raise AttributeError(f"{self.module} has no raw Triton kernel {name!r}")

    def run(*args, **kwargs):
      _modules()
      return getattr(importlib.import_module(self.module), name)(*args, **kwargs)

    run.__name__ = name
    return run


def launch(
  kernel: Any,
  *args: Any,
  out_shape: Sequence[jax.ShapeDtypeStruct],
  grid: tuple[int, ...],
  num_warps: int,
  num_stages: int,
  interpret: bool,
  zeroed_outputs: Sequence[int] = (),
  **constexprs: Any,
) -> list[jax.Array]:
  """Starts raw Triton kernel ``kernel`` over ``grid`` and returns its outputs.

  The kernel's parameters are ``args`` (arrays: pointers; Python numbers:
  scalars), then one pointer per output, then the ``constexprs`` by name, as
  in ``jax_triton.triton_call``.

  Args:
    kernel: a ``@triton.jit`` function.
    *args: the operands.
    out_shape: the outputs' shapes and dtypes.
    grid: the launch grid, up to three dims.
    num_warps: warps per program (from the kernel's config).
    num_stages: software-pipelining stages of the kernel's loops (likewise).
    interpret: run Triton's interpreter on the host (the executor's
      ``interpreted(target)``), instead of compiling for the GPU.
    zeroed_outputs: outputs zero-filled before the launch (accumulated into
      with atomics); the others start undefined (NaN in the interpreter).
    **constexprs: the kernel's ``tl.constexpr`` parameters.
  """
  if interpret:
    return _interpreted(kernel, args, out_shape, grid, zeroed_outputs, constexprs)
  outs = _modules()[1].triton_call(
    *args,
    kernel=kernel,
    out_shape=list(out_shape),
    grid=tuple(grid),
    num_warps=num_warps,
    num_stages=num_stages,
    compute_capability=_TARGET_CC.value,
    zeroed_outputs=tuple(zeroed_outputs),
    **constexprs,
  )
  return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _interpreted(kernel, args, out_shape, grid, zeroed, constexprs) -> list[jax.Array]:
  """``launch`` under Triton's interpreter, as a host callback."""
  if not interpreter_mode():
    raise NotImplementedError(unavailable_reason("cpu"))
  arrays = [i for i, a in enumerate(args) if isinstance(a, (jax.Array, jax.core.Tracer))]

  def host(*values):
    full = list(args)
    for i, v in zip(arrays, values):
      full[i] = _HostTensor(np.asarray(v))
    outs = [
      np.zeros(s.shape, s.dtype) if i in zeroed else _undefined(s) for i, s in enumerate(out_shape)
    ]
    with _INTERPRETER_LOCK:
      kernel[tuple(grid)](*full, *map(_HostTensor, outs), **constexprs)
    return outs

  shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
  return list(jax.pure_callback(host, shapes, *(args[i] for i in arrays)))


# Triton's interpreter keeps global state per launch, while XLA:CPU runs the
# callbacks of several devices (a sharded call) in parallel threads.
_INTERPRETER_LOCK = threading.Lock()


def _undefined(shape: jax.ShapeDtypeStruct) -> np.ndarray:
  """An output buffer as a kernel finds it: NaN for floats, so unwritten entries show."""
  fill = np.nan if jnp.issubdtype(shape.dtype, jnp.inexact) else 0
  return np.full(shape.shape, fill, shape.dtype)


class _HostStorage:
  """What Triton's interpreter asks of a tensor's storage: the same host buffer."""

  def __init__(self, array: np.ndarray):
    self.array = array

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def cpu(self) -> _HostStorage:
    return self

  def copy_(self, other: _HostStorage) -> None:
    if other.array is not self.array:
      self.array[...] = other.array


class _HostTensor:
  """A numpy array with the few tensor methods Triton's interpreter calls.

  The interpreter copies each tensor argument "to the host" and back through
  its storage; here the array already is on the host, so each step returns
  the same buffer and the kernel reads and writes it in place (torch is not
  needed).
  """

  def __init__(self, array: np.ndarray):
    if not array.flags.c_contiguous:
      raise ValueError("raw Triton kernels take C-contiguous operands")
    self.array = array
    self.dtype = array.dtype

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def untyped_storage(self) -> _HostStorage:
    return _HostStorage(self.array)

  def new_empty(self, *args, **kwargs) -> _HostTensor:
    return self

  def set_(self, storage, offset, size, stride) -> _HostTensor:
    return self

  def storage_offset(self) -> int:
    return 0

  def size(self) -> tuple[int, ...]:
    return self.array.shape

  def stride(self) -> tuple[int, ...]:
    return tuple(s // self.array.itemsize for s in self.array.strides)
