"""Peak memory of one jitted call, measured in a fresh Python process.

``measure(builder, *args)`` starts ``python bench/peak_memory.py``, which loads
the file ``builder`` names (``"path/to/file.py:function"``) under a private
module name, calls ``function(*args)`` (``args`` travel as JSON) for a
``(fn, inputs)`` pair, and then:

1. builds the inputs and AOT-compiles ``jax.jit(fn)`` for them;
2. returns freed heap to the OS (``malloc_trim``) and resets the kernel's
   high-water mark of the resident set (``/proc/self/clear_refs``), so the
   compiler's peak does not hide the call's;
3. runs the compiled call ``calls`` times, blocking on the result each time;
4. prints one JSON line, which ``measure`` returns as a dict.

What it reports, in bytes (seconds for ``call_seconds``):

- ``peak_rss``: the process's absolute peak resident set over its whole life
  (imports, inputs, compilation and the calls): the higher of the peak before
  the reset of step 2 and the peak after it, so what ``ru_maxrss`` (or
  ``/usr/bin/time -v``'s "Maximum resident set size") would read at the end of
  the same run without the reset.
- ``call_peak_rss``: the absolute peak resident set while the calls ran.
- ``baseline_rss``: the resident set just before the first call (interpreter,
  jax, the libraries ``builder`` imports, inputs, compiled program).
- ``call_growth``: ``call_peak_rss - baseline_rss``, the memory the call itself
  took on the host.
- ``xla_temp``: the temporary buffers of XLA's buffer assignment
  (``compiled.memory_analysis()``), a static estimate of the same.
- on a GPU or TPU, also ``device_peak`` (``peak_bytes_in_use``, which counts the
  whole process: compile-time autotuning included) and ``device_call_growth``
  (``device_peak`` minus the bytes in use before the first call).
- ``peak_exact``: False where the high-water mark could not be reset (not
  Linux, or ``/proc/self/clear_refs`` not writable): ``call_peak_rss`` is then
  the lifetime peak, an upper bound.

A fresh process is the only way to read a peak that earlier work in the same
process did not set. On a GPU, start pytest with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so the subprocess finds device memory
free (the subprocess itself never preallocates); a TPU cannot be opened by a
second process while pytest holds it, so there ``measure`` raises.
"""

import ctypes
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

_STATUS = "/proc/self/status"


# XLA:CPU's peak RSS over its buffer assignment, measured up to 1.6 (attention).
CPU_MEMORY_FACTOR = 1.5


def does_not_fit(compiled, device):
  """Why the compiled call would not fit in this machine's memory, if it would not.

  On a CPU the need is ``CPU_MEMORY_FACTOR`` times XLA's buffer assignment.
  """
  from pallax.autobatch import free_memory  # here: the parent process need not import jax

  analysis = compiled.memory_analysis()
  available = free_memory([device])
  if analysis is None or available is None:
    return None
  need = (
    analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes
  )
  factor = CPU_MEMORY_FACTOR if device.platform == "cpu" else 1.0
  if factor * need > available:
    return (
      f"needs about {factor * need / 2**30:.1f} GiB ({factor}x XLA's buffer assignment), "
      f"{available / 2**30:.1f} GiB available"
    )
  return None


def record_compiled(info, compiled, fn, inputs, impl):
  """Adds what the compiled call tells about itself to a benchmark's ``extra_info``.

  ``xla_temp_mib``: the temporaries of XLA's buffer assignment; for ``impl ==
  "pallax"``, ``pallax_kernels``: the implementation the executor picked for
  each kernel call (``pallax.explain``).
  """
  if impl == "pallax":
    import pallax

    info["pallax_kernels"] = [
      f"{s.op}: {s.implementation} ({s.source})" for s in pallax.explain(fn, *inputs)
    ]
  analysis = compiled.memory_analysis()
  if analysis is not None:
    info["xla_temp_mib"] = round(analysis.temp_size_in_bytes / 2**20, 1)


def _status_bytes(field):
  """A ``kB`` field of ``/proc/self/status`` in bytes, or None off Linux."""
  try:
    with open(_STATUS) as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None


def _rss_now():
  now = _status_bytes("VmRSS")
  return now if now is not None else _rss_peak()


def _rss_peak():
  """The high-water mark of the resident set: resettable ``VmHWM``, else ``ru_maxrss``."""
  peak = _status_bytes("VmHWM")
  if peak is not None:
    return peak
  scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_rss_peak():
  """Resets ``VmHWM`` to the current resident set; False where that is not possible."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    return False
  return True


def _trim_heap():
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass  # not glibc: freed heap stays in the resident set, the baseline is higher


def host_call_growth(call, args):
  """Resident-set growth of one ``call(*args)`` in this process, in bytes, or None.

  The bench fixture's CPU measure for every case (``bench/conftest.py``):
  the freed heap goes back to the OS and the high-water mark is reset to the
  current resident set first, so neither earlier cases nor the compiler can
  set the peak read after the call. None where the mark cannot be reset (not
  Linux). What the call allocates from memory this process already holds
  (e.g. a previous case's output not yet freed) does not show: ``measure``'s
  fresh process is the strict figure.
  """
  _trim_heap()
  if not _reset_rss_peak():
    return None
  baseline = _rss_now()
  out = call(*args)
  growth = _rss_peak() - baseline
  del out
  return growth


def _load(builder):
  path, name = builder.rsplit(":", 1)
  path = os.path.abspath(path)
  sys.path.insert(0, os.path.dirname(path))  # the builder's sibling modules
  spec = importlib.util.spec_from_file_location("_peak_memory_builder", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return getattr(module, name)


def _child(builder, args, calls):
  import jax  # here, not at the top: the parent process need not import jax

  fn, inputs = _load(builder)(*args)
  inputs = jax.block_until_ready(inputs)
  compiled = jax.jit(fn).lower(*inputs).compile()
  analysis = compiled.memory_analysis()
  device = jax.devices()[0]
  _trim_heap()
  setup_peak = _rss_peak()
  exact = _reset_rss_peak()
  baseline = _rss_now()
  device_before = device.memory_stats() if device.platform != "cpu" else None
  seconds = []
  for _ in range(calls):
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*inputs))
    seconds.append(time.perf_counter() - start)
    del out
  call_peak = _rss_peak()
  result = {
    "platform": device.platform,
    "peak_rss": max(setup_peak, call_peak),
    "call_peak_rss": call_peak,
    "baseline_rss": baseline,
    "call_growth": call_peak - baseline,
    "peak_exact": exact,
    "xla_temp": getattr(analysis, "temp_size_in_bytes", None) if analysis else None,
    "calls": calls,
    "call_seconds": seconds,
  }
  if device_before is not None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    result["device_peak"] = peak
    if peak is not None and "bytes_in_use" in device_before:
      result["device_call_growth"] = peak - device_before["bytes_in_use"]
  print(json.dumps(result), flush=True)


def measure(builder, *args, calls=2, timeout=3600):
  """Peak memory of one jitted call in a fresh process (the module docstring says what).

  Args:
    builder: ``"path/to/file.py:function"``; ``function(*args)`` returns
      ``(fn, inputs)`` and must import what ``fn`` needs (the subprocess
      imports nothing else but jax).
    *args: JSON-serialisable arguments for ``function``.
    calls: how many times to run the compiled call.
    timeout: seconds before the subprocess is killed.

  Returns:
    The dict the subprocess printed (bytes; ``call_seconds`` in seconds).

  Raises:
    RuntimeError: the subprocess failed (its stderr's tail is in the message);
      a negative return code -9 usually means the kernel's OOM killer.
  """
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  command = [sys.executable, os.path.abspath(__file__), builder, json.dumps(args), str(calls)]
  done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
  if done.returncode != 0:
    raise RuntimeError(
      f"peak-memory subprocess for {builder}{tuple(args)} exited with {done.returncode}:\n"
      + done.stderr[-3000:]
    )
  return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
  _child(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))


def record(info: dict, builder: str, *args, platform: str, calls: int = 2) -> None:
  """``measure``'s numbers into a benchmark's ``extra_info``, in MiB.

  On a GPU/TPU a second process may find no device memory (a TPU, or a GPU
  this process holds whole): the error is recorded instead; on a CPU it raises.
  """
  try:
    memory = measure(builder, *args, calls=calls)
  except RuntimeError as error:
    if platform == "cpu":
      raise
    info["peak_memory_error"] = str(error)[-500:]
    return
  for name in ("peak_rss", "call_peak_rss", "baseline_rss", "call_growth"):
    info[f"{name}_mib"] = round(memory[name] / 2**20, 1)
  for name in ("device_peak", "device_call_growth"):
    if memory.get(name) is not None:
      info[f"{name}_mib"] = round(memory[name] / 2**20, 1)
  info["peak_exact"] = memory["peak_exact"]
  info["memory_calls"] = memory["calls"]
  info["memory_call_seconds"] = [round(s, 3) for s in memory["call_seconds"]]
