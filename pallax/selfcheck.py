"""The self-check behind ``python -m pallax``.

Each op registers a ``SelfCheck``: how to make inputs, its float64 reference
and its plain-JAX formulation. ``run`` reports, per op and dtype, on this
machine: the backend and implementation chosen, the kernel config, the max
relative error against the float64 reference (forward and gradient) and the
time relative to plain JAX; then the same numerics for both interpreted
kernels. It returns False if any error is over its tolerance.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
from typing import Callable, Optional, Sequence, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from pallax.executor.autotune import median_time
from pallax.interpret import BACKENDS, interpret
from pallax.tuning import explain

# Max relative error (max|got - want| / max|want|) against float64.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class SelfCheck:
  """One op's self-check.

  make_args: ``(rng, dtype, small) -> args``; ``small`` for interpret runs.
  op: the pallax function. reference: the same maths in plain jnp; run in
    float64 it is the oracle, in the input dtype it is the timing baseline.
  """
  name: str
  make_args: Callable[[np.random.Generator, jnp.dtype, bool], Sequence[jax.Array]]
  op: Callable
  reference: Callable
  dtypes: tuple = (jnp.float32, jnp.bfloat16)


_CHECKS: list[SelfCheck] = []


def register(check: SelfCheck) -> None:
  _CHECKS.append(check)


def _rel_err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32) if got.dtype == jnp.bfloat16 else got, np.float64)
  want = np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _to64(a):
  return jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32), np.float64))


def _loss(fn, cots):
  """``sum(out * cot)`` over every output leaf: its gradient is the VJP with ``cots``."""
  def loss(*args):
    outs = jax.tree.leaves(fn(*args))
    return sum(jnp.sum(o.astype(cot.dtype) * cot) for o, cot in zip(outs, cots))
  return loss


def _errors(check: SelfCheck, args) -> tuple[float, float]:
  """Forward and gradient (wrt every arg) relative errors vs float64."""
  rng = np.random.default_rng(1)
  outs = jax.tree.leaves(jax.jit(check.op)(*args))
  cots = [jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in outs]
  argnums = tuple(range(len(args)))
  grads = jax.jit(jax.grad(_loss(check.op, cots), argnums))(*args)
  with jax.enable_x64(True):
    args64, cots64 = [_to64(a) for a in args], [_to64(c) for c in cots]
    wants = jax.tree.leaves(check.reference(*args64))
    want_grads = jax.grad(_loss(check.reference, cots64), argnums)(*args64)
    fwd = max(_rel_err(o, w) for o, w in zip(outs, wants))
    grad = max(_rel_err(g, w) for g, w in zip(grads, want_grads))
  return fwd, grad


def _time_ratio(check: SelfCheck, args, pairs: int = 21) -> float:
  """pallax's time over plain JAX's: the median over interleaved pairs of calls.

  Alternating the two cancels the load drift of a shared machine, which
  otherwise swamps differences of a few percent.
  """
  ours, plain = jax.jit(check.op), jax.jit(check.reference)
  for fn in (ours, plain):
    median_time(fn, args, repeats=1)  # compile and warm up
  return statistics.median(median_time(ours, args, warmup=0, repeats=1)
                           / median_time(plain, args, warmup=0, repeats=1)
                           for _ in range(pairs))


def _implementation(check: SelfCheck, args) -> tuple[str, str]:
  """Implementation (with where its config came from) and config of the first kernel."""
  chosen = explain(check.op, *args)[0]
  config = "-" if chosen.implementation == "xla" else str(chosen.config)
  return f"{chosen.implementation} ({chosen.source})", config


def run(out: TextIO = sys.stdout, checks: Optional[Sequence[SelfCheck]] = None) -> bool:
  """Prints the report for ``checks`` (default: every registered op); True when
  every error is within tolerance."""
  ok = True
  device = jax.devices()[0]
  print(f"pallax self-check on {device.platform} ({device.device_kind}), jax {jax.__version__}",
        file=out)
  header = f"{'op':<18} {'dtype':<9} {'implementation':<22} {'fwd err':>9} {'grad err':>9} " \
           f"{'tol':>6} {'time vs jax':>11}  config"
  print(header, file=out)
  print("-" * len(header), file=out)
  rng = np.random.default_rng(0)

  def row(name, dtype, impl, fwd, grad, ratio, config):
    nonlocal ok
    tol = TOLERANCE[jnp.dtype(dtype).name]
    good = fwd < tol and grad < tol
    ok &= good
    print(f"{name:<18} {jnp.dtype(dtype).name:<9} {impl:<22} {fwd:9.2e} {grad:9.2e} {tol:6.0e} "
          f"{ratio:>11}  {config}{'' if good else '   <-- FAIL'}", file=out)

  for check in _CHECKS if checks is None else checks:
    for dtype in check.dtypes:
      args = check.make_args(rng, dtype, False)
      impl, config = _implementation(check, args)
      fwd, grad = _errors(check, args)
      row(check.name, dtype, impl, fwd, grad, f"{_time_ratio(check, args):.2f}x", config)
    for backend in BACKENDS:
      for dtype in check.dtypes:
        args = check.make_args(rng, dtype, True)
        with interpret(backend):
          fwd, grad = _errors(check, args)
          _, config = _implementation(check, args)
        row(check.name, dtype, f"interpret-{backend}", fwd, grad, "n/a", config)
  print("all ops within tolerance" if ok else "SOME OPS ARE WRONG", file=out)
  return ok
