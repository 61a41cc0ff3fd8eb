"""Test set-up: the platform the tests run on, and 8 fake host devices for sharding tests.

``PALLAX_TEST_PLATFORM`` (default ``cpu``) picks where ops run:

* ``cpu``: everything on the CPU; kernels run interpreted (``tests.helpers.on_path``).
* ``gpu`` / ``tpu``: ops run on the device and the kernel path of that device
  (Triton / Mosaic TPU) runs the real, compiled kernel; the other backend's kernel
  stays interpreted, float64 references are computed on the CPU, and the
  lowering and compile tests (marker ``lowering``) are skipped as redundant.
  float32 tolerances assume float32 matmuls, so JAX's default matmul
  precision is set to ``highest`` there (a GPU's default is TF32, a TPU's
  bfloat16 passes): pallax ops with ``precision=None`` and the jax.nn
  calls the tests compare against then both compute in full float32.
  Run it with ``-n 0`` (one process owns the device); with fewer than 8
  devices the sharding tests run on the 8 fake host CPUs
  (``tests.helpers.sharding_devices``).

Tests marked ``compilers`` compile for H100, A100 and TPU without the
hardware; they are skipped, with the reason, where the ``verify`` extra's
compilers are not installed (``missing_compilers``).
"""

import functools
import itertools
import os
import re
import shutil
import tempfile

import pytest

PLATFORM = os.environ.get("PALLAX_TEST_PLATFORM", "cpu").strip().lower()
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}
if PLATFORM not in _JAX_PLATFORMS:
  raise pytest.UsageError(f"PALLAX_TEST_PLATFORM={PLATFORM!r}: use cpu, gpu or tpu")


def _set_xla_flag(name: str, value: str) -> None:
  """Adds ``--name=value`` to ``XLA_FLAGS`` in the environment, unless it sets ``name`` already."""
  flags = os.environ.get("XLA_FLAGS", "")
  if name not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


os.environ.setdefault("JAX_PLATFORMS", _JAX_PLATFORMS[PLATFORM])
if PLATFORM != "cpu":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_set_xla_flag("xla_force_host_platform_device_count", "8")
if PLATFORM == "cpu":
  # Compile-only libtpu (marker ``compilers``) in every xdist worker: without
  # this, the first worker to load libtpu holds its lock file and another's
  # TPU compiles fail ("Internal error when accessing libtpu multi-process lockfile").
  from pallax.verify.targets import TPU_ENV

  for _name, _value in TPU_ENV.items():
    os.environ.setdefault(_name, _value)


def pytest_configure(config):
  from pallax._jax_private import PALLAS_TRITON_DEPRECATION

  if PLATFORM == "cpu":
    if not _selects_compilers_tests(config.getoption("markexpr")) or missing_compilers():
      _compile_without_llvm_optimisation()
      if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _share_compiled_programs(config)

  # jax >= 0.11 warns at every lowering of a Pallas-Triton kernel for a GPU,
  # which the GPU kernels under test are (a known deprecation, not a finding).
  config.addinivalue_line(
    "filterwarnings", f"ignore:{PALLAS_TRITON_DEPRECATION}:DeprecationWarning"
  )
  if PLATFORM != "cpu":
    if getattr(config.option, "numprocesses", None):
      raise pytest.UsageError(
        f"PALLAX_TEST_PLATFORM={PLATFORM}: run with -n 0 (one process owns the device)"
      )
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    platform = jax.devices()[0].platform
    if platform != PLATFORM:
      raise pytest.UsageError(
        f"PALLAX_TEST_PLATFORM={PLATFORM} but JAX's default device is a {platform} device"
      )


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects the ``slow`` marks set here
def pytest_collection_modifyitems(config, items):
  for item in items_beyond_each_value(items):
    item.add_marker(pytest.mark.slow)
  missing = missing_compilers()
  if missing:
    skip = pytest.mark.skip(reason=f"needs the verify compilers: {missing}")
    for item in items:
      if "compilers" in item.keywords:
        item.add_marker(skip)
  if PLATFORM == "cpu":
    return
  skip = pytest.mark.skip(reason=f"lowering/compile check: redundant on a real {PLATFORM}")
  for item in items:
    if "lowering" in item.keywords:
      item.add_marker(skip)


def _selects_compilers_tests(markexpr: str) -> bool:
  """Whether ``-m markexpr`` may select a test marked ``compilers`` (True where unsure).

  Tries every truth value of the expression's other marker names with
  ``compilers`` true: any that selects means such a test may run.
  """
  operators = {"and", "or", "not"}
  names = sorted(set(re.findall(r"[^\s()]+", markexpr)) - operators - {"compilers"})
  if not markexpr or len(names) > 8:
    return True
  # Each name becomes ``v[i]`` (a name may be a Python keyword or start with a digit).
  index = {name: i for i, name in enumerate([*names, "compilers"])}
  code = re.sub(r"[^\s()]+", lambda m: m[0] if m[0] in operators else f"v[{index[m[0]]}]", markexpr)
  for values in itertools.product((False, True), repeat=len(names)):
    try:
      if eval(code, {"__builtins__": {}}, {"v": [*values, True]}):  # v, and, or, not, ()
        return True
    except Exception:  # not an expression pytest takes: pytest reports it
      return True
  return False


def _compile_without_llvm_optimisation() -> None:
  """Compiles the tests' CPU programs at XLA's backend optimisation level 0.

  The tests' programs are small and run once or twice, so compiling them is
  most of the run's time, and LLVM's optimisation most of that: the default
  run took 16:39 at level 0 against 20:05 (2 cores). The HLO, what pallax
  builds, is the same (XLA's HLO passes do not depend on the level); the
  machine code is less optimised, and LLVM does not contract ``a * b + c``
  into a fused multiply-add, so a result may differ in its last bit from the
  same program at the default level. The tests compare with float64
  references within per-dtype tolerances, which that does not touch; the
  bitwise ones (vmap against a loop, eager against jit) compare two programs
  at level 0, so they check that pallax builds the same arithmetic, not that
  XLA's default code generation contracts both alike. Set through
  ``XLA_FLAGS`` in the environment, which the xdist workers and the
  processes tests start inherit, before any JAX backend starts. Not where a
  test compiles for a GPU or TPU (marker ``compilers``): the level would
  change the compiled kernels those tests check. A level already in
  ``XLA_FLAGS`` is kept.
  """
  _set_xla_flag("xla_backend_optimization_level", "0")


def _share_compiled_programs(config) -> None:
  """Turns on JAX's persistent compilation cache, in a directory of this session's.

  Tests compile many identical XLA programs (each worker its own eager ops,
  the tests' references, each op at the same shapes): shared by every xdist
  worker and the processes tests start, a program compiles once per run. The
  directory is empty at the start of each run (nothing carries over between
  runs). Not used where a test compiles for a GPU or TPU (marker
  ``compilers``): a cached program would not print its compiler's report
  (registers, spills). No size limit: with one, JAX takes a file lock and
  scans the directory at every write, which made the run slower than none.
  Without the lock a worker could read a file another is still writing; JAX
  then warns and compiles the program itself.
  """
  import jax

  # The xdist workers, started later, read these from the environment when
  # they import jax (and then find JAX_COMPILATION_CACHE_DIR set: they skip this).
  path = tempfile.mkdtemp(prefix="pallax-tests-xla-")
  config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
  settings = {
    "compilation_cache_dir": path,
    "persistent_cache_min_compile_time_secs": 0,
  }
  for name, value in settings.items():
    os.environ["JAX_" + name.upper()] = str(value)
    jax.config.update("jax_" + name, value)


@functools.cache  # asked in pytest_configure and again at collection
def missing_compilers() -> str:
  """Why the tests marked ``compilers`` cannot run here ("" when they can).

  They compile for H100 and A100 (the CUDA plugin and ptxas) and TPU v5e and
  v6e (libtpu) without the hardware: the ``verify`` extra, which the ``test``
  extra leaves out (installed, every ``import jax`` logs CUDA driver lines).
  """
  from pallax.verify.targets import TARGETS

  reasons = (target.unavailable_reason() for target in TARGETS.values())
  return "; ".join(dict.fromkeys(r for r in reasons if r))


def items_beyond_each_value(items):
  """The parametrized items the default run leaves to ``-m slow``.

  Per test function with two or more parameters, the default run keeps a
  covering of their values: items picked greedily, in collection order, by
  how many not yet covered (parameter, value) pairs they add, until every
  value of every parameter has run at least once. The rest of the product
  runs under ``-m slow`` (the default run stays within 20 minutes on 2
  cores). A value is known by its first appearance in the group (the same
  object in every item), so every xdist worker keeps the same items.
  """
  groups = {}
  for item in items:
    spec = getattr(item, "callspec", None)
    if spec is not None and len(spec.params) > 1 and "slow" not in item.keywords:
      groups.setdefault((item.path, item.cls, item.originalname), []).append(item)
  beyond = []
  for group in groups.values():
    seen = {}
    values = [
      {(name, _first(seen.setdefault(name, []), v)) for name, v in item.callspec.params.items()}
      for item in group
    ]
    uncovered = set().union(*values)
    kept = set()
    while uncovered:
      best = max(range(len(group)), key=lambda i: len(values[i] & uncovered))
      kept.add(best)
      uncovered -= values[best]
    beyond += [item for i, item in enumerate(group) if i not in kept]
  return beyond


def _first(seen, value):
  """The index of ``value`` (by identity) in ``seen``, appended if new."""
  for index, known in enumerate(seen):
    if known is value:
      return index
  seen.append(value)
  return len(seen) - 1
