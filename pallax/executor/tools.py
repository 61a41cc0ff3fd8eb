"""The public executor tools: explain, autotune, vmap_with_config, pmap_with_config.

All of them find the kernel calls of a function by tracing it (never by
running it on data), so they see the final shapes each kernel gets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
from jax.extend.core import Jaxpr, JaxprEqn, jaxprs_in_params

from pallax.executor import Executor, Selection, default_executor
from pallax.executor.registry import target_of
from pallax.interpret import interpret_backend
from pallax.op import (
  CompositePrimitive,
  KernelPrimitive,
  kernel_runner,
  op_params,
  select_config,
)


def local_target() -> str:
  """Where ops run in this process: the interpret target, or this machine's platform."""
  device = jax.devices()[0]
  platform = device.platform
  if platform == "gpu":
    platform = "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
  return target_of(platform, interpret_backend())


def kernel_calls(jaxpr: Jaxpr) -> list[JaxprEqn]:
  """Every equation of ``jaxpr`` (nested jaxprs and compositions included) that runs a kernel.

  A composite primitive (``define_composite``) is traced at its operands to
  find the kernel calls it means; on a CPU it may run them as one fused
  program, which the executor allows only where it picks their XLA program.
  """
  calls = []
  for eqn in jaxpr.eqns:
    if isinstance(eqn.primitive, KernelPrimitive) and eqn.primitive.has_kernel:
      calls.append(eqn)
    if isinstance(eqn.primitive, CompositePrimitive):
      reference = functools.partial(eqn.primitive.reference, **eqn.params)
      calls.extend(kernel_calls(jax.make_jaxpr(reference)(*(v.aval for v in eqn.invars)).jaxpr))
    for sub in jaxprs_in_params(eqn.params):
      calls.extend(kernel_calls(sub))
  return calls


def _trace(fn: Callable, args, kwargs) -> list:
  return kernel_calls(jax.make_jaxpr(functools.partial(fn, **kwargs))(*args).jaxpr)


def _select(eqn, target: str, executor: Optional[Executor] = None, **kw) -> Selection:
  """The selection for kernel call ``eqn`` (a traced equation of a pallax primitive)."""
  return select_config(
    eqn.primitive,
    [v.aval for v in eqn.invars],
    target,
    op_params(eqn.params),
    config=eqn.params["config"],
    interpret=eqn.params["interpret"],
    scope=eqn.params["executor"],
    executor=executor,
    **kw,
  )


class Report(list):
  """Rows of selections that print as a table."""

  def __str__(self) -> str:
    lines = [f"{'op':<14} {'impl':<7} {'source':<10} config / key / note"]
    for s in self:
      lines.append(f"{s.op:<14} {s.implementation:<7} {s.source:<10} {s.config}")
      lines.append(f"{'':<34}{s.key} on {s.device_kind!r}")
      if s.note:
        lines.append(f"{'':<34}{s.note}")
    return "\n".join(lines)


def explain(fn: Callable, *args, **kwargs) -> Report:
  """Per kernel call in ``fn(*args, **kwargs)``: key, implementation, config, source.

  Sources: pinned / overlay / memory / disk / default / heuristic / autotune.
  Nothing is tuned or run; with the ``"autotune"`` policy a miss shows the
  heuristic pick with a note. For another device: ``explain_on``.
  """
  return explain_on(local_target(), fn, *args, **kwargs)


def explain_on(target: str, fn: Callable, *args, **kwargs) -> Report:
  """``explain`` for the calls as they would run on ``target``, a device this machine may lack.

  Args:
    target: a platform name (``"cuda"``, ``"tpu"``: no device kind known),
      or a ``pallax.executor.Target`` with its device kind
      (``Target("cuda", "h100")``: the choice on an H100).
    fn: the function whose kernel calls are explained.
    *args: its arguments.
    **kwargs: its keyword arguments.
  """
  return Report(_select(eqn, target, dry_run=True) for eqn in _trace(fn, args, kwargs))


def autotune(fn: Callable, *args, executor: Optional[Executor] = None, **kwargs) -> Report:
  """Tunes every kernel call of ``fn(*args, **kwargs)`` on this device; returns the table.

  The winners go to the executor's memory and persistent cache, so later
  calls (in this or a fresh process) hit the cache without tuning.
  """
  executor = executor or default_executor()
  target = local_target()
  report, seen = Report(), set()
  for eqn in _trace(fn, args, kwargs):
    avals = [v.aval for v in eqn.invars]
    params = op_params(eqn.params)
    key = (eqn.primitive.name, tuple(avals), tuple(sorted(params.items())))
    if key not in seen:
      seen.add(key)
      report.append(
        executor.tune(
          eqn.primitive.name,
          avals,
          target,
          params,
          kernel_runner(eqn.primitive, params, eqn.params["interpret"]),
        )
      )
  return report


def _in_axes_per_leaf(args: Sequence[Any], in_axes) -> list:
  """``in_axes`` (an int, None, or one entry per positional arg) as a list per arg."""
  if isinstance(in_axes, (int, type(None))):
    return [in_axes] * len(args)
  if len(in_axes) != len(args):
    raise ValueError(f"in_axes has {len(in_axes)} entries for {len(args)} arguments")
  return list(in_axes)


def _select_once(executor: Executor, fn: Callable, structs, kwargs):
  """The config ``executor`` selects for the first kernel call of ``fn`` at ``structs``."""
  with executor:
    calls = _trace(fn, structs, kwargs)
  if not calls:
    raise ValueError(f"{getattr(fn, '__name__', fn)!r} calls no pallax kernel")
  return _select(calls[0], local_target(), executor).config


def _with_config(
  executor: Executor, op: Callable, structs_of: Callable, traced: Callable, mapped: Callable
) -> Callable:
  """``mapped(op)`` with one config per argument shapes, pinned after one selection.

  ``structs_of(args)`` gives the abstract arguments that ``traced`` (a function
  of ``op``) is traced at to find the config: the op is never run on a sample.
  """
  cache: dict = {}

  def wrapped(*args, **kwargs):
    structs = structs_of(args)
    key = (tuple(structs), tuple(sorted(kwargs.items())))
    if key not in cache:
      cache[key] = _select_once(executor, traced(op), structs, kwargs)
    with executor:
      return mapped(functools.partial(op, config=cache[key], **kwargs))(*args)

  return wrapped


def _struct(a, drop_axis: Optional[int] = None) -> jax.ShapeDtypeStruct:
  shape = list(jax.numpy.shape(a))
  if drop_axis is not None:
    del shape[drop_axis]
  return jax.ShapeDtypeStruct(tuple(shape), jax.numpy.result_type(a))


def vmap_with_config(executor: Executor, op: Callable, in_axes=0) -> Callable:
  """``jax.vmap(op, in_axes)`` with one config, selected from the batched shapes.

  The config is chosen once per argument shapes, from the abstract shapes the
  kernel sees after vmap folds the batch axis in (the op is traced, never
  run on a sample), then pinned for the mapped call.
  """
  vmapped = lambda op: lambda *a, **k: jax.vmap(functools.partial(op, **k), in_axes=in_axes)(*a)
  return _with_config(
    executor,
    op,
    lambda args: [_struct(a) for a in args],
    vmapped,
    lambda f: jax.vmap(f, in_axes=in_axes),
  )


def pmap_with_config(
  executor: Executor, op: Callable, in_axes=0, axis_name: str = "devices"
) -> Callable:
  """``jax.pmap(op, in_axes, axis_name)`` with one config, selected from per-device shapes."""
  per_device = lambda args: [
    _struct(a, axis) for a, axis in zip(args, _in_axes_per_leaf(args, in_axes))
  ]
  return _with_config(
    executor,
    op,
    per_device,
    lambda op: op,
    lambda f: jax.pmap(f, in_axes=in_axes, axis_name=axis_name),
  )
