"""Cross-entropy: pallax vs plain JAX vs tokamax, time, FLOP/s and peak memory.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_cross_entropy.py                 # everything: about 40 min on 2 cores
  pytest -n 0 bench/test_cross_entropy.py -k "not slow"   # without V=128256 (about 20 min)
  pytest -n 0 bench/test_cross_entropy.py -k "linear-float32-N8192-D1024-V32768-"  # the headline
  pytest -n 0 bench/test_cross_entropy.py -k "V32768- and fwd+bwd"                 # one mode
  pytest -n 0 bench/test_cross_entropy.py --benchmark-json ce.json   # extra_info in the JSON

On a GPU, add ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the peak-memory
subprocess needs device memory the pytest process would otherwise reserve).

Two families of cases, each implementation its own benchmark in the group
named after the case and mode:

- ``linear``: the language-model head's loss of ``x (N, D)``, ``weight (D,
  V)`` and integer ``labels (N,)``, ``reduction="mean"`` over the N tokens.
  Implementations: ``naive``, the plain JAX formulation (``logits = x @ W`` in
  float32, ``jax.nn.logsumexp`` minus the label's logit by
  ``jnp.take_along_axis``, mean over tokens: it holds the ``[N, V]`` logits);
  ``pallax``, ``pallax.linear_cross_entropy(x, weight, labels)`` (never holds
  them: chunked XLA on a CPU, Pallas kernels on a GPU/TPU); ``tokamax``,
  ``tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction="mean",
  implementation="xla")`` (the ``bench`` extra installs tokamax 0.0.12;
  skipped without it). Inputs: ``x`` standard normal, ``weight`` normal of
  standard deviation ``1/sqrt(D)`` (logits about unit normal), labels
  uniform in ``[0, V)``, all drawn in float32 and cast to the case's dtype.
- ``logits``: the loss of given ``logits (N, V)`` (standard normal):
  ``naive`` (the same logsumexp formulation, in float32) and ``pallax``
  (``pallax.cross_entropy``). tokamax has no such op.

Test ids are ``{family}-{dtype}-N{tokens}[-D{hidden}]-V{vocab}[-slow]-{mode}-{impl}``,
made for ``-k``: ``family`` ``linear`` or ``logits``, ``dtype`` ``float32``
or ``bfloat16``, ``mode`` ``fwd`` or ``fwd+bwd``, ``impl`` ``naive``,
``pallax`` or ``tokamax``. Cases whose calls take tens of seconds on a CPU
(V = 128256, the Llama-3 vocabulary) carry ``slow`` in their id and run one
round: ``-k "not slow"`` leaves them out. ``naive`` runs first in each
group, so ``pallax`` and ``tokamax`` can record their ratios to it.

Forward+backward is the training step's call: ``jax.value_and_grad`` of the
scalar loss with respect to ``x`` and ``weight`` (``logits`` for the logits
family). Before timing, each benchmark checks its first call against a
float64 NumPy reference computed from the same (dtype-rounded) inputs, once
per case: the loss over all N tokens, and for forward+backward also ``dL/dx``
of the first 128 tokens and ``dL/dweight`` of the first 128 vocabulary columns
(``dL/dlogits`` of the first 128 tokens for the logits family).

``extra_info`` of each benchmark:

- ``op`` (``linear_cross_entropy`` or ``cross_entropy``), ``mode``, ``dtype``
  and ``shape`` (``[N, D, V]`` or ``[N, V]``): the fields of ``python -m
  pallax.bench``'s table and plot (``--ops cross_entropy`` runs the logits
  family's cases).
- ``flops`` and ``bytes``: ``pallax.roofline.linear_cross_entropy_work``
  (linear family) or ``cross_entropy_work`` (logits family), from the op's
  definition. Linear: the matmul FLOPs of the plain formulation, 2 per
  multiply-add, forward ``2 * N * D * V`` (``x @ W``), forward+backward 3x
  (``x @ W``, ``dlogits @ W^T`` and ``x^T @ dlogits``); pallax's backward
  kernels recompute the logits (a fourth matmul; on a CPU this scalar loss's
  fused pass does not): that is not counted, so its TFLOP/s compare directly
  with the others' as inverse time. Bytes: ``x`` and ``W`` read (the backward
  reads them again and writes ``dx``, ``dW``); the logits need not leave the
  chip. Logits family: no FLOPs; the logits read, ``N * V * itemsize``
  forward, 3x forward+backward (read again, the gradient written).
- ``tflop_per_s``, ``gbyte_per_s`` over the median, and on a device
  ``pallax.roofline`` knows ``peak_device``, ``fraction_of_peak_flops`` and
  ``fraction_of_peak_bandwidth`` (``bench/throughput.py``).
- ``peak_rss_mib``: absolute peak resident set, in MiB, of a fresh process that
  imports jax, pallax and the implementation's library, builds the inputs,
  compiles the call and runs it (twice; once for ``slow`` cases): its
  lifetime peak, as ``ru_maxrss`` would read it at the end, and what the
  targets below are stated in. ``call_peak_rss_mib`` is the peak while the
  calls ran, ``baseline_rss_mib`` the resident set just before them,
  ``call_growth_mib`` the difference (the call's own memory); see
  ``bench/peak_memory.py``. On a GPU/TPU also ``device_peak_mib`` and
  ``device_call_growth_mib``. ``xla_temp_mib``: the temporaries of XLA's
  buffer assignment for the call.
- ``peak_rss_vs_naive``, ``call_growth_vs_naive``, ``time_vs_naive``
  (``pallax`` and ``tokamax``, when ``naive`` ran earlier in the same
  session): this implementation's ``peak_rss_mib``, ``call_growth_mib`` and
  median time over ``naive``'s.
- ``loss_rel_err``, ``dx_rel_err``, ``dw_rel_err`` (``dlogits_rel_err``) and
  their maximum ``max_rel_err``: max abs error over max abs value against the
  float64 reference.
- ``load_avg``: the machine's 1-minute load average before and after the
  timed rounds (the timings of a shared machine are only comparable at
  similar load).
- ``pallax_kernels`` (pallax only): ``pallax.explain``'s pick per kernel call,
  e.g. ``cross_entropy_fwd: xla (heuristic)`` on a CPU.

Targets from the issue (linear, N = 8192, D = 1024, V = 32768, float32, on a
CPU): pallax forward+backward at most naive's time in at most 40% of its peak
RSS; at V = 128256 naive's memory grows about fourfold and pallax's must not.

An implementation whose call would not fit in memory is not run (its result
records ``not_run`` with the reason in ``extra_info``): on a CPU when 1.5x
XLA's buffer assignment exceeds the available memory (naive forward+backward
at V = 128256 needs about 13 GB), on a device when the buffer assignment
exceeds the free device memory.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import modes
import numpy as np
import peers
import pytest
from peak_memory import does_not_fit, record, record_compiled
from throughput import record_throughput

import pallax
from pallax import roofline

CHECK_ROWS = 128  # tokens (rows of dL/dx) and vocabulary columns (of dL/dweight) checked
REFERENCE_BLOCK = 256  # tokens per block of the float64 reference
# Max relative error against the float64 reference. Accelerators get the bfloat16 bound for every
# dtype: their default float32 matmul precision may be TF32 or one bfloat16 pass.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  tokens: int
  vocab: int
  hidden: int = 1024  # 0: the logits family (cross_entropy on given logits)
  dtype: str = "float32"
  slow: bool = False

  @property
  def linear(self):
    return self.hidden > 0

  @property
  def id(self):
    parts = ["linear" if self.linear else "logits", self.dtype, f"N{self.tokens}"]
    parts += [f"D{self.hidden}"] if self.linear else []
    parts += [f"V{self.vocab}"] + (["slow"] if self.slow else [])
    return "-".join(parts)


CASES = [
  Case(8192, 32768),  # the headline case
  Case(8192, 32768, dtype="bfloat16"),
  Case(8192, 128256, slow=True),  # Llama 3's vocabulary
  Case(4096, 32768, hidden=0),  # cross_entropy on given logits
]
MODES = ["fwd", "fwd+bwd"]
IMPLS = ["naive", "pallax", "tokamax"]  # naive first: the others record their ratios to it


def _rounds(case, mode):
  """(timed rounds, untimed warm-up rounds) after the first, checked call (itself a warm-up)."""
  if case.slow:
    return 1, 0
  if not case.linear:
    return (10 if mode == "fwd" else 5), 1
  return (5 if mode == "fwd" else 3), 0


# ------------------------------------------------------------------------------
# The implementations.


def naive_loss(z, labels):
  """Mean cross-entropy of float32 logits ``z (N, V)``: logsumexp minus the label's logit."""
  lse = jax.nn.logsumexp(z, axis=-1)
  zy = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
  return jnp.mean(lse - zy)


def loss_fn(case, impl):
  """The implementation's loss of ``(x, weight, labels)`` or ``(logits, labels)``."""
  if not case.linear:
    if impl == "naive":
      return lambda z, labels: naive_loss(z.astype(jnp.float32), labels)
    if impl == "pallax":
      return lambda z, labels: pallax.cross_entropy(z, labels)
    raise ValueError(impl)
  if impl == "naive":
    return lambda x, w, labels: naive_loss(
      jnp.dot(x, w, preferred_element_type=jnp.float32), labels
    )
  if impl == "pallax":
    return lambda x, w, labels: pallax.linear_cross_entropy(x, w, labels)
  if impl == "tokamax":
    tokamax = peers.tokamax()
    return lambda x, w, labels: tokamax.linear_softmax_cross_entropy_loss(
      x, labels, w, reduction="mean", implementation="xla"
    )
  raise ValueError(impl)


def _host_inputs(case):
  """The inputs as NumPy float32 / int32 arrays (before the cast to the case's dtype).

  Drawn directly in float32, so building them never holds a float64 copy (the
  peak-memory subprocess counts the inputs' construction in ``peak_rss``).
  """
  rng = np.random.default_rng(0)
  if not case.linear:
    z = rng.standard_normal((case.tokens, case.vocab), dtype=np.float32)
    return z, rng.integers(0, case.vocab, case.tokens, dtype=np.int32)
  x = rng.standard_normal((case.tokens, case.hidden), dtype=np.float32)
  w = rng.standard_normal((case.hidden, case.vocab), dtype=np.float32)
  w *= np.float32(1 / np.sqrt(case.hidden))
  return x, w, rng.integers(0, case.vocab, case.tokens, dtype=np.int32)


def device_inputs(case):
  """``_host_inputs`` as jax arrays of the case's dtype, converted one at a time."""
  host = list(_host_inputs(case))
  dtype = jnp.dtype(case.dtype)
  inputs = [jnp.asarray(host.pop(0), dtype) for _ in range(len(host) - 1)]
  return jax.block_until_ready((*inputs, jnp.asarray(host.pop())))


def program(case, impl, mode):
  """``(fn, inputs)`` of one benchmark; ``case`` is a ``Case`` or its fields as a dict.

  Called by the benchmark and, for peak memory, by the subprocess of
  ``bench/peak_memory.py`` (hence a dict).
  """
  case = Case(**case) if isinstance(case, dict) else case
  inputs = device_inputs(case)
  loss = loss_fn(case, impl)
  if mode == "fwd":
    return loss, inputs
  argnums = (0, 1) if case.linear else (0,)
  return jax.value_and_grad(loss, argnums), inputs


# ------------------------------------------------------------------------------
# The float64 reference, once per case.


@functools.cache
def reference(case):
  """Float64 ``{"loss", "dx" | "dlogits", "dw"}`` of the case's (dtype-rounded) inputs.

  The loss is over all tokens; ``dx`` (``dlogits``) covers the first
  ``CHECK_ROWS`` tokens and ``dw`` the first ``CHECK_ROWS`` vocabulary columns.
  Computed by blocks of ``REFERENCE_BLOCK`` tokens.
  """
  dtype = jnp.dtype(case.dtype)
  host = _host_inputs(case)
  *floats, labels = (
    np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64) if a.dtype != np.int32 else a
    for a in host
  )
  del host
  n = case.tokens
  total = 0.0
  out = {}
  if case.linear:
    x, w = floats
    dw = np.zeros((case.hidden, CHECK_ROWS))
  else:
    (z_all,) = floats
  for start in range(0, n, REFERENCE_BLOCK):
    rows = slice(start, min(n, start + REFERENCE_BLOCK))
    z = x[rows] @ w if case.linear else z_all[rows]
    m = z.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(-1))
    y = labels[rows]
    total += float(np.sum(lse - z[np.arange(len(y)), y]))
    p = np.exp(z[:, :CHECK_ROWS] - lse[:, None])  # dL/dz = (softmax - onehot) / N
    hit = y < CHECK_ROWS
    p[np.arange(len(y))[hit], y[hit]] -= 1
    if case.linear:
      dw += x[rows].T @ p / n
    if start == 0:
      g = np.exp(z[:CHECK_ROWS] - lse[:CHECK_ROWS, None])
      g[np.arange(CHECK_ROWS), y[:CHECK_ROWS]] -= 1
      g /= n
      if case.linear:
        out["dx"] = g @ w.T
      else:
        out["dlogits"] = g
  out["loss"] = np.float64(total / n)
  if case.linear:
    out["dw"] = dw
  return out


def _rel_err(got, want):
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _errors(case, mode, result):
  """Relative errors of one call's results against ``reference``."""
  want = reference(case)
  if mode == "fwd":
    return {"loss_rel_err": _rel_err(result, want["loss"])}
  loss, grads = result
  errors = {"loss_rel_err": _rel_err(loss, want["loss"])}
  if case.linear:
    dx, dw = grads
    errors["dx_rel_err"] = _rel_err(dx[:CHECK_ROWS], want["dx"])
    errors["dw_rel_err"] = _rel_err(dw[:, :CHECK_ROWS], want["dw"])
  else:
    errors["dlogits_rel_err"] = _rel_err(grads[0][:CHECK_ROWS], want["dlogits"])
  return errors


# ------------------------------------------------------------------------------
# The benchmarks.

_SEEN = {}  # (case id, mode) -> impl -> {"peak_rss_mib", "call_growth_mib", "median"}


def _work(case, mode):
  """The FLOPs and bytes of one call (module docstring)."""
  if case.linear:
    return roofline.linear_cross_entropy_work(
      case.tokens, case.hidden, case.vocab, case.dtype, mode
    )
  return roofline.cross_entropy_work(case.tokens, case.vocab, case.dtype, mode)


def _load_avg():
  try:
    return round(os.getloadavg()[0], 2)
  except OSError:
    return None


PARAMS = [
  pytest.param(case, mode, impl, id=f"{case.id}-{mode}-{impl}")
  for case in CASES
  for mode in MODES
  for impl in IMPLS
  if case.linear or impl != "tokamax"
]


@pytest.mark.parametrize("case, mode, impl", PARAMS)
def test_cross_entropy(benchmark, case, mode, impl):
  benchmark.group = f"{case.id}-{mode}"
  info = benchmark.extra_info
  info.update(case=case.id, mode=mode, impl=impl)
  op = "linear_cross_entropy" if case.linear else "cross_entropy"
  shape = [case.tokens, case.hidden, case.vocab] if case.linear else [case.tokens, case.vocab]
  info.update(op=op, dtype=case.dtype, shape=shape)
  fn, inputs = program(case, impl, mode)
  device = jax.devices()[0]
  info["platform"] = device.platform
  compiled = jax.jit(fn).lower(*inputs).compile()
  too_big = does_not_fit(compiled, device)
  if too_big:  # reported in the results as not run, not timed
    info["not_run"] = too_big
    return

  # Peak memory first: a case too big for the machine then fails in the subprocess.
  rounds, warmup = _rounds(case, mode)
  builder = f"{os.path.abspath(__file__)}:program"
  calls = 1 if case.slow else 2
  record(info, builder, dataclasses.asdict(case), impl, mode, platform=device.platform, calls=calls)
  record_compiled(info, compiled, fn, inputs, impl)

  def call():
    return jax.block_until_ready(compiled(*inputs))

  errors = _errors(case, mode, call())
  error = max(errors.values())
  info.update(errors, max_rel_err=error)
  tolerance = TOLERANCE[case.dtype if device.platform == "cpu" else "bfloat16"]
  assert error < tolerance, f"{impl} is wrong: {errors}"

  load_before = _load_avg()
  benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=warmup)
  info["load_avg"] = [load_before, _load_avg()]
  record_throughput(benchmark, _work(case, mode), case.dtype)
  if benchmark.stats is None:  # None under --benchmark-disable
    return
  median = benchmark.stats.stats.median
  seen = _SEEN.setdefault((case.id, mode), {})
  mine = {k: info.get(k) for k in ("peak_rss_mib", "call_growth_mib")}
  seen[impl] = dict(mine, median=median)
  naive = seen.get("naive")
  if impl != "naive" and naive is not None:
    for name, value in [*mine.items(), ("median", median)]:
      if value is not None and naive.get(name):
        key = "time_vs_naive" if name == "median" else name.removesuffix("_mib") + "_vs_naive"
        info[key] = round(value / naive[name], 3)
  info["median_s"] = round(median, 4)


# ------------------------------------------------------------------------------
# Every mode at small sizes, tokamax included: the cases python -m pallax.bench plots.

MODE_VOCABS = [4096, 16384, 32768]
MODE_PARAMS = [
  pytest.param(impl, id=impl, marks=[pytest.mark.peer] if impl == "tokamax" else [])
  for impl in ("pallax", "naive", "tokamax")
]


@pytest.mark.parametrize("impl", MODE_PARAMS)
@pytest.mark.parametrize("mode", modes.MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", MODE_VOCABS, ids=lambda v: f"V{v}")
def test_linear_cross_entropy_modes(benchmark, bench, vocab, dtype, mode, impl):
  """The mean loss of ``x (1024, 512) @ weight (512, V)`` in every mode (``bench/modes.py``).

  Differentiated in ``x`` and ``weight`` (labels fixed). With ``--peers``
  tokamax's ``linear_softmax_cross_entropy_loss`` (``custom_vjp``: it raises
  under ``jvp`` and ``hvp``, reported, not skipped). pallax's result is
  checked against the plain-JAX formulation's in the same mode
  (``max_rel_err_vs_naive``).
  """
  case = Case(1024, vocab, hidden=512, dtype=dtype)
  x, w, labels = device_inputs(case)
  info = benchmark.extra_info
  info.update(
    op="linear_cross_entropy", impl=impl, mode=mode, dtype=dtype, shape=[1024, 512, vocab]
  )

  def transformed(impl):
    loss = loss_fn(case, impl)
    fn = lambda x, w: loss(x, w, labels)
    return bench.transformed(fn, [x, w], mode, np.random.default_rng(0), impl == "tokamax")

  call = transformed(impl)
  if call is None or not bench(call[0], *call[1], peer=impl == "tokamax"):
    return
  fn, args = call
  if impl == "pallax":
    tolerance = TOLERANCE[dtype if jax.devices()[0].platform == "cpu" else "bfloat16"]
    naive = transformed("naive")[0]
    info["max_rel_err_vs_naive"] = modes.assert_agrees(fn, naive, args, tolerance, "plain JAX")
  if mode in roofline.MODES:
    record_throughput(benchmark, _work(case, mode), dtype)
