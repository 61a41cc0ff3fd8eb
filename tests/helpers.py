"""Shared test helpers: execution paths, random inputs, tolerances, inner pytest runs."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallax
from pallax.executor.executor import device_target
from pallax.executor.implementation import implementation
from tests.conftest import PLATFORM

# Every op is checked on its XLA program and on both interpreted kernels.
PATHS = ("xla", "triton", "mosaic_tpu")

# Max relative error (max|got - want| / max|want|) against float64, per dtype.
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2, "float64": 1e-12}
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _native_kernels() -> tuple[str, ...]:
  """The kernel paths that run compiled under ``PALLAX_TEST_PLATFORM`` (tests/conftest.py).

  Ops run on that device, where the executor picks its compiled kernels: on
  a GPU the Triton ones, and on the devices the Mosaic GPU implementation
  serves (H100, H200) its kernels where they take the call (what
  ``pallax.interpret("mosaic_gpu")`` makes a CPU run interpreted).
  """
  if PLATFORM == "tpu":
    return ("mosaic_tpu",)
  if PLATFORM == "gpu":
    hopper = implementation("pallas_mosaic_gpu").prefers(device_target("cuda"))
    return ("triton", "mosaic_gpu") if hopper else ("triton",)
  return ()


NATIVE_KERNELS = _native_kernels()


def on_path(path: str):
  """Context manager selecting the XLA path or a kernel (interpreted unless native)."""
  if path == "xla" or path in NATIVE_KERNELS:
    return contextlib.nullcontext()
  return pallax.interpret(path)


def rand(rng: np.random.Generator, shape, dtype=jnp.float32, scale=1.0, shift=0.0):
  """Random normal values, rounded to ``dtype`` (never constant)."""
  return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype)


def f64(a) -> np.ndarray:
  return np.asarray(
    jnp.asarray(a, jnp.float32) if jnp.asarray(a).dtype == jnp.bfloat16 else a, np.float64
  )


def to64(a):
  """``f64(a)`` as a jnp array (float64 under ``x64()``); None passes through."""
  return None if a is None else jnp.asarray(f64(a))


def as64(*arrays) -> list:
  """``to64`` of each array."""
  return [to64(a) for a in arrays]


def rel_err(got, want) -> float:
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, (got.shape, want.shape)
  if want.size == 0:
    return 0.0
  assert np.all(np.isfinite(got)), "non-finite values in result"
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(got, want, dtype, what: str = "") -> None:
  err = rel_err(got, want)
  tol = TOL[jnp.dtype(dtype).name]
  assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g} ({jnp.dtype(dtype).name})"


def assert_close_neginf(got, want, *, rtol: float, atol: float) -> None:
  """Equal -inf entries (masked log_softmax), close wherever ``want`` is finite."""
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(
    np.asarray(got)[finite], np.asarray(want)[finite], rtol=rtol, atol=atol
  )


@contextlib.contextmanager
def x64():
  """float64 enabled (for the references) inside the block, computed on the CPU."""
  with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
    yield


def sharding_devices(n: int = 8) -> list:
  """``n`` devices for the sharding tests: the platform's, or the fake host CPUs if it has fewer."""
  devices = jax.devices()
  return devices[:n] if len(devices) >= n else jax.devices("cpu")[:n]


def mesh_4x2(axis_type=jax.sharding.AxisType.Auto) -> jax.sharding.Mesh:
  """A (4, 2) mesh with axes ("a", "b") over ``sharding_devices()``."""
  return jax.make_mesh((4, 2), ("a", "b"), axis_types=(axis_type,) * 2, devices=sharding_devices())


# Lowering for other platforms -------------------------------------------------

# The custom call each platform's Pallas kernels lower to.
CALL_TARGET = {
  "cuda": "__gpu$xla.gpu.triton",
  "rocm": "__gpu$xla.gpu.triton",
  "tpu": "tpu_custom_call",
}


def _abstract_tpu_mesh():
  device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def lower_text(fn, platform: str, *args) -> str:
  """StableHLO text of ``jit(fn)`` lowered for ``platform`` (TPU: an abstract TPU v5e)."""
  lower = lambda: jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
  if platform == "tpu":
    with jax.sharding.use_abstract_mesh(_abstract_tpu_mesh()):
      return lower()
  return lower()


# vmap tests ---------------------------------------------------------------------


def batched(rng: np.random.Generator, axis, size: int, shape, draw=None):
  """``size`` random examples of ``shape`` stacked at ``axis`` (None: one example).

  ``draw(shape)`` makes the values (default: standard normal floats).
  """
  draw = draw or (lambda s: rand(rng, s))
  if axis is None:
    return draw(shape)
  return jnp.moveaxis(draw((size,) + tuple(shape)), 0, axis % (len(shape) + 1))


def example(a, axis, i: int):
  """Example ``i`` of a batch stacked at ``axis`` (None: the shared value)."""
  return a if axis is None else jnp.take(a, i, axis=axis)


def loop_stack(fn, args, in_axes, size: int):
  """``fn`` on each of ``size`` examples of ``args``, outputs stacked (what vmap should give)."""
  outs = [fn(*(example(x, ax, i) for x, ax in zip(args, in_axes))) for i in range(size)]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


# (outer, inner) in_axes of two-argument vmap(vmap(f, inner), outer) tests,
# and the outer and inner batch sizes.
NESTED_IN_AXES = list(itertools.product([(0, None), (None, 0), (0, 0)], repeat=2))
NESTED_SIZES = (2, 3)


def nested_shape(outer, inner, arg: int, shape) -> tuple[int, ...]:
  """Shape of argument ``arg`` of a nested vmap: its mapped batch dims, then ``shape``."""
  b1, b2 = NESTED_SIZES
  return (b1,) * (outer[arg] is not None) + (b2,) * (inner[arg] is not None) + tuple(shape)


def check_nested_vmap(fn, args, outer, inner, assert_close):
  """Jitted ``vmap(vmap(fn, inner), outer)`` against ``fn`` per (i, j) example.

  ``assert_close(got, want)`` compares one example; returns the nested map's
  jaxpr for the caller's primitive-count check.
  """
  f = jax.vmap(jax.vmap(fn, in_axes=inner), in_axes=outer)
  got = jax.jit(f)(*args)
  b1, b2 = NESTED_SIZES
  for i in range(b1):
    for j in range(b2):
      ij = [example(example(a, o, i), n, j) for a, o, n in zip(args, outer, inner)]
      assert_close(got[i, j], fn(*ij))
  return jax.make_jaxpr(f)(*args).jaxpr


def executor_view(op: str):
  """Kernel ``op``'s heuristic, candidates and support check as the executor applies them.

  The kernel modules describe only their kernels; the executor adds the XLA
  program (by heuristic on cpu, as a candidate where it may run, always
  supported). Returns ``(heuristic, candidates, supports)`` with the kernel
  modules' old signatures.
  """
  from pallax.executor.executor import candidate_configs, heuristic_config, unsupported_reason
  from pallax.executor.registry import kernel_spec

  spec = kernel_spec(op)
  return (
    lambda avals, target, **p: heuristic_config(spec, avals, target, p),
    lambda avals, target, **p: candidate_configs(spec, avals, target, p),
    lambda avals, target, config, **p: unsupported_reason(spec, avals, target, config, p),
  )


# jaxpr inspection -----------------------------------------------------------


def primitive_names(jaxpr) -> list[str]:
  """Names of every equation's primitive, those of nested jaxprs (loops, jit) included."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names += primitive_names(sub)
  return names


def attention_primitives(jaxpr, *, loops: bool = True) -> collections.Counter:
  """How often each attention primitive occurs in ``jaxpr``; ``loops=False`` asserts no loop."""
  names = primitive_names(jaxpr)
  assert loops or not {"while", "scan"} & set(names), names
  return collections.Counter(n for n in names if "attention" in n)


def attention_primitives_of(fn, *args) -> collections.Counter:
  """``attention_primitives`` of ``fn``'s jaxpr at ``args``."""
  return attention_primitives(jax.make_jaxpr(fn)(*args).jaxpr)


def assert_tree_close(got, want, rtol=2e-5, atol=2e-5) -> None:
  """Leaves of equal shape and dtype, the same -inf entries, close elsewhere."""
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
    finite = np.isfinite(np.asarray(w))
    np.testing.assert_allclose(np.asarray(g)[finite], np.asarray(w)[finite], rtol=rtol, atol=atol)


def outside_xdist(**env) -> dict:
  """This process's environment plus ``env``, the outer run's ``PYTEST_XDIST*`` dropped."""
  environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  return {**environ, **env}


def run_pytest(args, cwd, *, timeout=None, **env) -> subprocess.CompletedProcess:
  """pytest ``args`` in a fresh process at ``cwd``, with ``env`` added to the environment.

  Outside any xdist worker of the outer run (its ``PYTEST_XDIST*`` variables
  dropped: pytest-benchmark would not time under one); output captured as text.
  """
  return subprocess.run(
    [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
    cwd=cwd,
    env=outside_xdist(**env),
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def deviceless_mesh(target: str, axis: str) -> jax.sharding.Mesh:
  """A one-axis mesh over a multi-chip topology without the hardware: TPU v5e:2x2 or H100 x8.

  Skips the test where the target's compiler is absent (the verify extra).
  """
  import pytest
  from jax.experimental import topologies

  from pallax.verify.targets import TARGETS

  spec = TARGETS[target]
  if spec.unavailable_reason():
    pytest.skip(spec.unavailable_reason())
  kwargs = spec.topology_kwargs()
  if target == "v5e":
    kwargs["topology_name"] = "v5e:2x2"
  else:
    kwargs["topology"] = "1x1x8"
  devices = topologies.get_topology_desc(**kwargs).devices
  return jax.sharding.Mesh(np.array(devices), (axis,))


def compile_pinned(eqn, config, target: str = "h100") -> list[dict]:
  """``eqn``'s kernel call with ``config`` pinned, compiled for ``target`` without its device.

  Asserts ``pallax.verify``'s judgement (no spills, within the target's
  memory) and returns ``compile_kernels``' records.
  """
  from pallax.verify.compile import _arguments, compile_kernels, judge
  from pallax.verify.targets import TARGETS

  call = lambda *args: eqn.primitive.bind(*args, **{**eqn.params, "config": config})
  compiled = compile_kernels(call, _arguments(eqn), TARGETS[target], config.implementation)
  assert judge(compiled, TARGETS[target]) == {"status": "ok"}, compiled
  return compiled
