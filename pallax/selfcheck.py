"""The self-check behind ``python -m pallax``.

``CHECKS`` holds every public op's case (``SelfCheck``): how to make inputs,
its float64 reference and its plain-JAX formulation. Each op family declares
its own in ``kernels/<family>/tools.py`` (``pallax.family``), so every op
pallax registers is checked. ``run`` reports, per op and dtype, on this
machine: the backend and implementation chosen, the kernel config, the max
relative error against the float64 reference (forward, and gradient for ops
with derivatives: ``—`` for an inference op) and the time relative to plain
JAX; then the same numerics for the interpreted kernels (Triton, Mosaic TPU,
and Mosaic GPU where an op has a kernel of it that takes the call). It
returns False if any error is over its tolerance. ``quick=True`` uses the
small sizes everywhere.

The time column is the median over interleaved pairs of calls of pallax's time
over plain JAX's, with a 95% confidence interval; see ``measure_ratio`` for
the rule, and for when it prints ``unreliable`` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Optional, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from pallax import family
from pallax.executor.autotune import median_time
from pallax.executor.implementation import preferred_interpreters
from pallax.executor.tools import explain
from pallax.family import SelfCheck
from pallax.interpret import BACKENDS, interpret

# Backends of the interpret switch that interpret a preferred implementation
# (Mosaic GPU): rows only where an op's call runs on it.
_PREFERRED = preferred_interpreters()

# Max relative error (max|got - want| / max|want|) against float64.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


# Every public op's self-check, in report order: each family's, from its
# ``kernels/<family>/tools.py`` (``pallax.family``).
CHECKS: tuple[SelfCheck, ...] = family.self_checks()


# ---------------------------------------------------------------------------- numerics


def _f64(a) -> np.ndarray:
  """``a`` as a float64 numpy array, converted on the host (no op to compile)."""
  return np.asarray(a).astype(np.float64)


def _rel_err(got, want) -> float:
  got, want = _f64(got), _f64(want)
  if not np.all(np.isfinite(got)):
    return float("inf")
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _as_f64(a) -> jax.Array:
  """A floating argument in float64 (inside ``enable_x64``); integer arguments as they are."""
  return jnp.asarray(_f64(a)) if jnp.issubdtype(a.dtype, jnp.floating) else a


@functools.cache
def _outputs_and_grads(fn: Callable, differentiable: bool = True) -> Callable:
  """Jitted ``(args, cots) -> (output leaves, VJP of cots wrt every arg)``: one compile per shape.

  Without derivatives (``differentiable=False``) the VJP is ``()``. Cached per
  ``fn``, so the rows of one op (and the float64 reference of all its rows)
  share their compilations.
  """

  def outputs_and_grads(args, cots):
    if not differentiable:
      return jax.tree.leaves(fn(*args)), ()
    outs, vjp = jax.vjp(fn, *args)
    leaves, tree = jax.tree.flatten(outs)
    return leaves, vjp(jax.tree.unflatten(tree, [c.astype(o.dtype) for c, o in zip(cots, leaves)]))

  return jax.jit(outputs_and_grads)


def _errors(check: SelfCheck, args, backend: Optional[str] = None) -> tuple[float, Optional[float]]:
  """Forward and gradient (wrt every arg; None without derivatives) relative errors vs float64.

  ``backend``: run the op as that interpreted kernel. The float64 reference runs
  outside the switch (which is part of the jit cache key) so all rows share it.
  """
  rng = np.random.default_rng(1)
  shapes = jax.tree.leaves(jax.eval_shape(check.op, *args))
  cots = [jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in shapes]
  run = _outputs_and_grads(check.op, check.differentiable)
  with interpret(backend) if backend else contextlib.nullcontext():
    outs, grads = run(tuple(args), cots)
  with jax.enable_x64(True):
    args64 = tuple(_as_f64(a) for a in args)
    cots64 = [jnp.asarray(_f64(c)) for c in cots]
    wants, want_grads = _outputs_and_grads(check.reference, check.differentiable)(args64, cots64)
  fwd = max(_rel_err(o, w) for o, w in zip(outs, wants))
  if not check.differentiable:
    return fwd, None
  floating = [(g, w) for g, w in zip(grads, want_grads) if jnp.issubdtype(g.dtype, jnp.inexact)]
  return fwd, max(_rel_err(g, w) for g, w in floating)  # integer args have float0 gradients


# ---------------------------------------------------------------------------- timing

# One interleaved pair of calls: ``time_pair(i) -> (pallax seconds, plain-JAX seconds)``.
PairTimer = Callable[[int], tuple[float, float]]
# Makes the ``PairTimer`` of ``(op, reference, args)``; ``run`` takes a fake one in tests.
PairTimerFactory = Callable[[Callable, Callable, Sequence[jax.Array]], PairTimer]

MIN_PAIRS = 15  # never judge on fewer pairs
MAX_PAIRS = 200  # cap per row
BUDGET_S = 3.0  # cap per row: seconds spent inside the timed calls
TARGET = 0.02  # stop early once the 95% interval of the median is within +-2%
UNRELIABLE = 0.05  # wider than +-5% when stopped: "unreliable"
FAST_AGREE = 0.10  # the fastest-tenth ratio must be within 10% of the median ratio
_Z95 = 1.96


@dataclasses.dataclass(frozen=True)
class Timing:
  """Interleaved pair timings of pallax (``ours``) and plain JAX (``plain``), in seconds."""

  ours: tuple[float, ...]
  plain: tuple[float, ...]

  @property
  def pairs(self) -> int:
    return len(self.ours)

  @property
  def ratios(self) -> np.ndarray:
    """Per-pair ratios ``ours / plain``, sorted."""
    return np.sort(np.asarray(self.ours, np.float64) / np.asarray(self.plain, np.float64))

  @property
  def ratio(self) -> float:
    """The median per-pair ratio: the figure reported."""
    return float(np.median(self.ratios))

  @property
  def interval(self) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median ratio.

    The order statistics of ranks ``n/2 -+ 1.96 sqrt(n)/2`` (the sign test's
    interval), so it holds for the skewed, bimodal ratios of a loaded machine.
    """
    r, n = self.ratios, self.pairs
    half = _Z95 * math.sqrt(n) / 2
    lo = min(max(round(n / 2 - half) - 1, 0), n - 1)
    hi = max(min(round(n / 2 + 1 + half) - 1, n - 1), 0)
    return float(r[lo]), float(r[hi])

  @property
  def half_width(self) -> float:
    """The interval's larger side, relative to the median ratio."""
    lo, hi = self.interval
    return max(hi - self.ratio, self.ratio - lo) / self.ratio

  @property
  def fast_ratio(self) -> float:
    """Pallax's 10th-percentile time over plain JAX's: the ratio of the undisturbed calls."""
    return float(np.percentile(self.ours, 10) / np.percentile(self.plain, 10))

  @property
  def reliable(self) -> bool:
    """Tight interval, and the median and fastest-tenth ratios agree (see ``measure_ratio``)."""
    return (
      self.pairs >= MIN_PAIRS
      and self.half_width <= UNRELIABLE
      and abs(math.log(self.fast_ratio / self.ratio)) <= math.log1p(FAST_AGREE)
    )

  def __str__(self) -> str:
    """``0.98x ±0.02`` (median ratio, interval half-width), or ``unreliable``."""
    if not self.reliable:
      return "unreliable"
    return f"{self.ratio:.2f}x ±{self.half_width * self.ratio:.2f}"

  def detail(self) -> str:
    """Every statistic behind the verdict, for the note of an unreliable row."""
    lo, hi = self.interval
    return (
      f"median {self.ratio:.2f}x [{lo:.2f}, {hi:.2f}] over {self.pairs} pairs, "
      f"fastest-tenth {self.fast_ratio:.2f}x"
    )


def measure_ratio(
  time_pair: PairTimer,
  *,
  min_pairs: int = MIN_PAIRS,
  max_pairs: int = MAX_PAIRS,
  budget_s: float = BUDGET_S,
) -> Timing:
  """Times interleaved pairs until the median ratio is tight or a cap is hit.

  The rule. Pair ``i`` times one call of each (the order alternating between
  pairs) and gives the ratio pallax / plain JAX; the two calls of a pair see
  nearly the same machine load, so their ratio cancels the load drift that
  swamps a few percent otherwise. The figure is the median ratio; its ~95%
  interval is distribution-free (``Timing.interval``), as the ratios of a
  loaded machine are skewed and often bimodal (a call preempted or not). After
  ``min_pairs`` pairs it stops as soon as the interval is within ±``TARGET``
  (2%) of the median, else at ``max_pairs`` pairs or once ``budget_s`` seconds
  have been spent in the timed calls. It is then ``unreliable`` if

  * the interval is wider than ±``UNRELIABLE`` (5%) of the median: the column
    is read for differences of a few percent to tens of percent (pallax's XLA
    programs against plain jnp), and a wider interval cannot even tell 1.10x
    from parity; or
  * the fastest-tenth ratio (10th percentile of pallax's times over plain's,
    a robust form of min/min, which hangs on one lucky call) differs from the
    median ratio by more than ``FAST_AGREE`` (10%). On a quiet machine most
    calls run near the fastest, so the two agree; apart, they say that load
    slows one side more than the other (e.g. a program that uses both cores
    losing one), a bias that a tight interval cannot reveal.

  A wrong figure is worse than none: on a busy machine most rows may read
  ``unreliable``; rerun on a quiet one.

  Args:
    time_pair: ``time_pair(i) -> (pallax seconds, plain seconds)`` for pair ``i``.
    min_pairs: pairs always taken.
    max_pairs: pairs at most.
    budget_s: stop once the timed calls have taken this many seconds in all.

  Returns:
    The ``Timing`` of every pair taken; ``str()`` of it is the report's cell.
  """
  ours: list[float] = []
  plain: list[float] = []
  spent = 0.0
  while True:
    a, b = time_pair(len(ours))
    ours.append(a)
    plain.append(b)
    spent += a + b
    if len(ours) < min_pairs:
      continue
    timing = Timing(tuple(ours), tuple(plain))
    if timing.half_width <= TARGET or len(ours) >= max_pairs or spent >= budget_s:
      return timing


def wall_clock_pairs(op: Callable, reference: Callable, args: Sequence[jax.Array]) -> PairTimer:
  """The real ``PairTimer``: jits and warms up both, then times one call of each per pair."""
  ours, plain = jax.jit(op), jax.jit(reference)
  for fn in (ours, plain):
    median_time(fn, args, warmup=2, repeats=1)  # compile and warm up
  once = functools.partial(median_time, args=args, warmup=0, repeats=1)

  def time_pair(i: int) -> tuple[float, float]:
    if i % 2:
      plain_s = once(plain)
      return once(ours), plain_s
    ours_s = once(ours)
    return ours_s, once(plain)

  return time_pair


# ---------------------------------------------------------------------------- the report


def _grad_cell(grad: Optional[float]) -> str:
  """The gradient error as the report prints it: ``—`` for an op without derivatives."""
  return "—" if grad is None else f"{grad:9.2e}"


def _implementation(check: SelfCheck, args) -> tuple[str, str]:
  """Implementation (with where its config came from) and config of the first kernel."""
  chosen = explain(check.op, *args)[0]
  config = "-" if chosen.implementation == "xla" else str(chosen.config)
  return f"{chosen.implementation} ({chosen.source})", config


def run(
  out: TextIO = sys.stdout,
  checks: Optional[Sequence[SelfCheck]] = None,
  *,
  quick: bool = False,
  pair_timer: PairTimerFactory = wall_clock_pairs,
) -> bool:
  """Prints the self-check report.

  Args:
    out: where to print.
    checks: the ops to check; default ``CHECKS``, every registered op.
    quick: the small sizes everywhere (the interpret sizes), not only for the
      interpreted kernels: on 2 CPU cores about a minute and a half instead
      of three and a half (mostly compiles); the times are then mostly
      dispatch overhead.
    pair_timer: makes the pair timer of ``(op, reference, args)``; see
      ``measure_ratio`` for how the time column is computed from it.

  Returns:
    True when every error is within tolerance (the times do not count; an
    inference op has no gradient error).
  """
  ok = True
  device = jax.devices()[0]
  sizes = "small sizes (--quick)" if quick else "full sizes"
  print(
    f"pallax self-check on {device.platform} ({device.device_kind}), jax {jax.__version__}, "
    f"{sizes}",
    file=out,
  )
  header = (
    f"{'op':<21} {'dtype':<9} {'implementation':<22} {'fwd err':>9} {'grad err':>9} "
    f"{'tol':>6} {'time vs jax':>12}  config"
  )
  print(header, file=out)
  print("-" * len(header), file=out)
  rng = np.random.default_rng(0)
  unreliable = no_grad = False

  def row(name, dtype, impl, fwd, grad, timing, config):
    nonlocal ok, unreliable, no_grad
    no_grad |= grad is None
    tol = TOLERANCE[jnp.dtype(dtype).name]
    good = fwd < tol and (grad is None or grad < tol)
    ok &= good
    notes = "" if good else "   <-- FAIL"
    if timing is not None and not timing.reliable:
      unreliable = True
      notes += f"   (time: {timing.detail()})"
    print(
      f"{name:<21} {jnp.dtype(dtype).name:<9} {impl:<22} {fwd:9.2e} {_grad_cell(grad):>9} "
      f"{tol:6.0e} {'n/a' if timing is None else str(timing):>12}  {config}{notes}",
      file=out,
    )

  for check in CHECKS if checks is None else checks:
    for dtype in check.dtypes:
      args = check.make_args(rng, dtype, quick)
      impl, config = _implementation(check, args)
      fwd, grad = _errors(check, args)
      timing = measure_ratio(pair_timer(check.op, check.reference, args))
      row(check.name, dtype, impl, fwd, grad, timing, config)
    for backend in BACKENDS:
      for dtype in check.dtypes:
        args = check.make_args(rng, dtype, True)
        with interpret(backend):
          impl, config = _implementation(check, args)
        own = _PREFERRED.get(backend)
        if own is not None and not impl.startswith(own):
          continue  # its fallback's kernel (Triton's), which has a row of its own
        fwd, grad = _errors(check, args, backend)
        row(check.name, dtype, f"interpret-{backend}", fwd, grad, None, config)
  print("-" * len(header), file=out)
  print(
    "time vs jax: pallax's time over plain JAX's, the median over interleaved pairs of calls "
    "± its 95% interval",
    file=out,
  )
  if no_grad:
    print("grad err —: an inference op, without derivatives", file=out)
  if unreliable:
    print(
      f"unreliable: that interval is wider than ±{UNRELIABLE:.0%}, or the fastest tenth of the "
      f"calls gives a ratio over {FAST_AGREE:.0%} off: a busy machine?",
      file=out,
    )
  print("all ops within tolerance" if ok else "SOME OPS ARE WRONG", file=out)
  return ok
