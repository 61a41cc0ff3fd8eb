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
"""

import os

import pytest

PLATFORM = os.environ.get("PALLAX_TEST_PLATFORM", "cpu").strip().lower()
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}
if PLATFORM not in _JAX_PLATFORMS:
  raise pytest.UsageError(f"PALLAX_TEST_PLATFORM={PLATFORM!r}: use cpu, gpu or tpu")

os.environ.setdefault("JAX_PLATFORMS", _JAX_PLATFORMS[PLATFORM])
if PLATFORM != "cpu":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


def pytest_configure(config):
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


def pytest_collection_modifyitems(config, items):
  if PLATFORM == "cpu":
    return
  skip = pytest.mark.skip(reason=f"lowering/compile check: redundant on a real {PLATFORM}")
  for item in items:
    if "lowering" in item.keywords:
      item.add_marker(skip)
