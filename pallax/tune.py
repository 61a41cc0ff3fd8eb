"""Tune a model's kernels for this device, and move tuned configs between machines.

``pallax.tune(fn, *example_args)`` autotunes every kernel call of ``fn`` (and
with ``grad=True`` of its backward) for the device this process runs on, and
writes the winners to the persistent cache (``$PALLAX_CACHE_DIR``, else
``~/.cache/pallax``), where every later process finds them. The example
arguments may be arrays or ``jax.ShapeDtypeStruct``s: the calls are found by
tracing, and each candidate is timed on random inputs of the kernel's shapes.

``export_configs`` writes this device kind's tuned configs to one JSON file;
``import_configs`` merges such a file into a cache directory on a machine of
the same device kind, or into a shipped-defaults directory
(``pallax/executor/defaults``: configs that ship with the package).

From the command line (``MODULE:FUNCTION`` names your own function; the
repository's example model, from a source checkout)::

  python -m pallax.tune examples.train_step:loss --grad --args SHAPES...  # docs/tuning.md
  python -m pallax.tune --export tuned.json
  python -m pallax.tune --import tuned.json [--into pallax/executor/defaults]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp

from pallax.executor import Executor, default_executor
from pallax.executor.cache import FORMAT, DiskCache, default_cache_dir, slug
from pallax.executor.registry import kernel_spec, registered_ops
from pallax.executor.tools import Report, autotune, local_target

__all__ = ["export_configs", "import_configs", "parse_shape", "this_device_kind", "tune"]

BUNDLE = "pallax-tuned-configs"
_DTYPES = {
  "f16": "float16",
  "bf16": "bfloat16",
  "f32": "float32",
  "f64": "float64",
  "i8": "int8",
  "i32": "int32",
  "i64": "int64",
  "u8": "uint8",
}


def tune(
  fn: Callable,
  *args,
  grad: bool = False,
  allow_interpreted: bool = False,
  executor: Optional[Executor] = None,
  **kwargs,
) -> Report:
  """Autotunes every kernel call of ``fn(*args, **kwargs)`` on this device.

  The winners go to ``executor``'s (default: the default executor's) memory
  and persistent cache; each kernel call (a cache key) is tuned once, the
  forward's calls that the backward makes again included. Whether kernels
  run interpreted is the interpret switch's business (``pallax.interpret``,
  ``PALLAX_INTERPRET``); interpreted timings say nothing about a GPU or TPU,
  so under the switch this raises unless ``allow_interpreted`` (outside it,
  the executor never times an interpreted kernel).

  Args:
    fn: the function whose kernel calls to tune.
    *args: example arguments, arrays or ``jax.ShapeDtypeStruct``s.
    grad: also tune the backward's kernels: those of ``jax.grad`` of the sum
      of ``fn``'s floating outputs with respect to its floating arguments.
    allow_interpreted: tune even when the interpret switch is on.
    executor: the executor to tune with.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    The report of every tuned call (``print`` it for a table).
  """
  target = local_target()
  if target.startswith("interpret-") and not allow_interpreted:
    raise ValueError(
      f"pallax.tune: the interpret switch is on ({target}): interpreted kernels' timings "
      "say nothing about the hardware; turn the switch off, or allow_interpreted=True"
    )
  if not grad:
    return autotune(fn, *args, executor=executor, **kwargs)
  # One trace of the forward and the backward, so that a kernel call both
  # make (the forward's, which the backward recomputes) is tuned once.
  backward = _backward(fn, args, kwargs)
  return autotune(lambda *a: (fn(*a, **kwargs), backward(*a)), *args, executor=executor)


def _floating(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _backward(fn: Callable, args: Sequence[Any], kwargs: dict) -> Callable:
  """``jax.grad`` of the sum of ``fn``'s floating outputs w.r.t. its floating arguments."""
  wrt = tuple(i for i, a in enumerate(args) if _floating(a))
  if not wrt:
    raise ValueError("pallax.tune: grad=True needs a floating argument to differentiate")

  def total(*a):
    leaves = [o for o in jax.tree.leaves(fn(*a, **kwargs)) if _floating(o)]
    return sum(jnp.sum(o.astype(jnp.float32)) for o in leaves)

  return jax.grad(total, wrt)


def _cache(cache_dir) -> DiskCache:
  if cache_dir is not None:
    return DiskCache(cache_dir)
  disk = default_executor().disk
  return disk if disk is not None else DiskCache(default_cache_dir())


def this_device_kind() -> str:
  """The device kind configs are tuned for in this process (its first device's)."""
  return jax.devices()[0].device_kind


def export_configs(path: str | Path, *, device_kind: Optional[str] = None, cache_dir=None) -> int:
  """Writes a device kind's tuned configs (every op) to ``path``; returns how many.

  Args:
    path: the JSON file to write.
    device_kind: whose configs (default: this process's device's).
    cache_dir: the persistent cache to read (default: the default executor's).
  """
  kind = device_kind or this_device_kind()
  cache = _cache(cache_dir)
  ops = {}
  for op in registered_ops():
    version = kernel_spec(op).version
    entries = cache.load(kind, op, version)
    if entries:
      ops[op] = {"op_version": version, "entries": entries}
  bundle = {"format": FORMAT, "kind": BUNDLE, "device_kind": slug(kind), "ops": ops}
  Path(path).write_text(json.dumps(bundle, indent=1, sort_keys=True))
  return sum(len(o["entries"]) for o in ops.values())


def import_configs(
  path: str | Path, *, into=None, device_kind: Optional[str] = None, log=print
) -> int:
  """Merges a file written by ``export_configs`` into a cache directory; returns how many.

  Args:
    path: the exported JSON file.
    into: the directory to merge into: a persistent cache (default: the
      default executor's), or a shipped-defaults directory such as
      ``pallax/executor/defaults``, which has the same layout.
    device_kind: the device kind this machine must be (default: its
      device's); a file exported on another kind raises ``ValueError``.
    log: where to report ops skipped for a version this pallax does not have.
  """
  try:
    bundle = json.loads(Path(path).read_text())
  except json.JSONDecodeError as err:
    raise ValueError(f"pallax.tune: {path} is not JSON: {err}") from None
  if not isinstance(bundle, dict) or bundle.get("kind") != BUNDLE:
    raise ValueError(f"pallax.tune: {path} is not a file written by --export")
  if bundle.get("format") != FORMAT:
    raise ValueError(f"pallax.tune: {path} has format {bundle.get('format')}, not {FORMAT}")
  kind = slug(device_kind or this_device_kind())
  if bundle["device_kind"] != kind:
    raise ValueError(
      f"pallax.tune: {path} holds configs tuned on {bundle['device_kind']!r}, "
      f"this machine is {kind!r}"
    )
  cache = _cache(into)
  count = 0
  for op, data in sorted(bundle["ops"].items()):
    ours = kernel_spec(op).version if op in registered_ops() else None
    if ours != data["op_version"]:
      log(f"pallax.tune: skipping {op}: tuned for version {data['op_version']}, this is {ours}")
      continue
    if not cache.store(kind, op, ours, data["entries"]):
      raise OSError(f"pallax.tune: cannot write {cache.path(kind, op)}")
    cache.path(kind, op).with_suffix(".json.lock").unlink(missing_ok=True)
    count += len(data["entries"])
  return count


def parse_shape(text: str) -> jax.ShapeDtypeStruct:
  """``"f32[8,1024]"`` (or ``bfloat16[8]``, ``i32[]``) as a ``jax.ShapeDtypeStruct``."""
  match = re.fullmatch(r"\s*([a-z0-9_]+)\[([0-9,\s]*)\]\s*", text)
  if match is None:
    raise ValueError(f"pallax.tune: cannot read {text!r}; write dtype[dims], e.g. f32[8,1024]")
  name, dims = match.groups()
  try:
    dtype = jnp.dtype(_DTYPES.get(name, name))
  except TypeError:
    raise ValueError(f"pallax.tune: unknown dtype {name!r} in {text!r}") from None
  shape = tuple(int(d) for d in dims.split(",") if d.strip())
  return jax.ShapeDtypeStruct(shape, dtype)


def _function(spec: str) -> Callable:
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"pallax.tune: name the function as MODULE:FUNCTION, got {spec!r}")
  fn = importlib.import_module(module)
  for part in name.split("."):
    fn = getattr(fn, part)
  return fn


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m pallax.tune",
    description="Autotune a function's pallax kernels for this device, "
    "or export/import tuned configs.",
  )
  parser.add_argument("function", nargs="?", help="MODULE:FUNCTION to tune")
  parser.add_argument("--args", nargs="+", default=[], metavar="SHAPE", help="e.g. f32[8,1024]")
  parser.add_argument("--grad", action="store_true", help="also tune the backward's kernels")
  parser.add_argument(
    "--allow-interpreted", action="store_true", help="tune even under the interpret switch"
  )
  parser.add_argument("--export", metavar="FILE", help="write this device's tuned configs")
  parser.add_argument("--import", dest="import_", metavar="FILE", help="merge exported configs")
  parser.add_argument("--into", metavar="DIR", help="with --import: cache or defaults directory")
  ns = parser.parse_args(argv)
  if not (ns.function or ns.export or ns.import_):
    parser.error("give a FUNCTION to tune, --export or --import")
  if ns.into and not ns.import_:
    parser.error("--into goes with --import")
  if ns.import_:
    count = import_configs(ns.import_, into=ns.into, log=lambda m: print(m, file=sys.stderr))
    print(f"imported {count} tuned configs into {_cache(ns.into).directory}")
  if ns.function:
    args = [parse_shape(a) for a in ns.args]
    print(tune(_function(ns.function), *args, grad=ns.grad, allow_interpreted=ns.allow_interpreted))
  if ns.export:
    count = export_configs(ns.export)
    print(f"exported {count} tuned configs for {this_device_kind()!r} to {ns.export}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
