"""dot_product_attention: pallax vs jax.nn vs tokamax, time, FLOP/s and peak memory.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_attention.py                     # everything: 20-40 min on 2 CPU cores
  pytest -n 0 bench/test_attention.py -k "not slow"       # without S=16384 (about half the time)
  pytest -n 0 bench/test_attention.py -k "causal-mha-float32-S4096"   # the headline case
  pytest -n 0 bench/test_attention.py -k "S4096 and not bwd"          # forward only
  pytest -n 0 bench/test_attention.py --benchmark-json attention.json # extra_info in the JSON

On a GPU, add ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the peak-memory
subprocess needs device memory the pytest process would otherwise reserve).

Every case runs three implementations side by side, each its own benchmark in
the group named after the case and mode: ``pallax.dot_product_attention``
, ``jax.nn.dot_product_attention`` and
``tokamax.dot_product_attention(..., implementation="xla_chunked")``
(the ``bench`` extra installs tokamax; skipped without it). Layout BTNH for
the query, BSKH for key and value; ``scale`` is the default ``1/sqrt(H)``.

Test ids are ``{mask}-{heads}-{dtype}-S{seq}[-slow]-{mode}-{impl}``, made for
``-k``: ``mask`` is ``causal`` or ``full`` (no mask), ``heads`` ``mha`` (N = K
= 8) or ``gqa`` (N = 8 query heads, K = 2 key/value heads), ``dtype``
``float32`` or ``bfloat16``, ``mode`` ``fwd`` or ``fwd+bwd``, ``impl``
``pallax``, ``jax.nn`` or ``tokamax``. Cases whose calls take tens of seconds
on a CPU (S = 16384) carry ``slow`` in their id and run one or two rounds:
``-k "not slow"`` leaves them out. B = 1 and H = 64 throughout.

Forward+backward goes through ``bench/modes.py``'s ``fwd_bwd``:
``value_and_grad`` of ``sum(out * c)`` for a random cotangent ``c``, gradients
for query, key and value. Before timing, each benchmark checks its first call
against a float64 NumPy reference on the first 128 query rows (the output, or
dL/dquery for forward+backward) and records the error.

``extra_info`` of each benchmark:

- ``flops`` and ``bytes``: ``pallax.roofline.attention_work``, FlashAttention
  papers' convention. Forward: two matmuls (``Q K^T`` and ``P V``) of 2 FLOPs
  per multiply-add over the *unmasked* (query, key) pairs, ``4 * B * N *
  pairs * H``, with ``pairs = T * S`` for full attention and ``T * (T + 1) /
  2`` for causal (about half: masked blocks are not counted as work).
  Forward+backward: 3.5x forward (the backward recomputes ``Q K^T`` and does
  four more matmuls, ``dV``, ``dP``, ``dQ``, ``dK``: seven in all against the
  forward's two). Softmax exponentials are not counted. GQA counts query
  heads (N). Bytes: ``q``, ``k``, ``v`` read and ``o`` written, and the
  backward's reads and gradient writes.
- ``tflop_per_s``, ``gbyte_per_s`` over the median time, and on a device
  ``pallax.roofline`` knows, ``peak_device``, ``fraction_of_peak_flops`` and
  ``fraction_of_peak_bandwidth`` (``bench/throughput.py``).
- ``peak_rss_mib``: absolute peak resident set, in MiB, of a fresh process that
  imports jax and the implementation's library, builds the inputs, compiles
  the call and runs it (twice; once for ``slow`` cases): its lifetime peak,
  as ``ru_maxrss`` would read it at the end, and what the targets below are
  stated in. ``call_peak_rss_mib`` is the
  peak while the calls ran, ``baseline_rss_mib`` the resident set just before
  them, ``call_growth_mib`` the difference (the call's own memory); see
  ``bench/peak_memory.py``. On a GPU/TPU also ``device_peak_mib`` and
  ``device_call_growth_mib``. ``xla_temp_mib``: the temporaries of XLA's buffer
  assignment for the call.
- ``max_rel_err``: max abs error over max abs value against the reference.
- ``pallax_kernels`` (pallax only): ``pallax.explain``'s pick per kernel call,
  e.g. ``dot_product_attention_fwd: xla (heuristic)`` on a CPU.

Targets from the issue (causal MHA float32, B=1, N=8, H=64, on a CPU):
S=4096 forward at most 0.5x jax.nn's time in at most 512 MB peak RSS; S=4096
forward+backward at most jax.nn's time in at most a third of its peak RSS;
S=16384 forward+backward under 2 GiB and faster than tokamax ``xla_chunked``.

Every mode (``test_attention_modes``, what ``python -m pallax.bench --ops
dot_product_attention`` runs and plots): causal MHA at S = 512, 1024, 2048
in float32 and bfloat16, ``fwd``, ``fwd+bwd``, ``jvp`` and ``hvp``
(``bench/modes.py``), pallax against jax.nn, and with ``--peers`` jax.nn's
``implementation="cudnn"`` and tokamax; a peer that raises (cuDNN off NVIDIA
GPUs, tokamax's ``custom_vjp`` under ``jvp``) is reported, not skipped.
These use the ``bench`` fixture (memory from XLA's buffer assignment and
the call's resident-set growth, no fresh process).

Packed documents (issue 14), pallax only: ``test_attention_packed``, ids
``packed-causal-mha-float32-S4096-{docs}-{mode}-pallax`` with ``docs``
``8docs`` (``q_segment_ids = kv_segment_ids = arange(4096) // 512``: 8
documents of 512) or ``1seg`` (all zeros: the same call with one segment),
in one group per mode, so ``-k packed`` runs the four. Segment ids are
arguments of the jitted call (not constants folded at compile time). The
``8docs`` benchmark also times the ``1seg`` call (same rounds) and records
``one_segment_median_s``, ``speedup_vs_one_segment`` (the ``1seg`` median
over the ``8docs`` one) and ``speedup_target`` (3.0, the issue's target on a
CPU) in ``extra_info``; both check 128 query rows across a document
boundary (rows 960-1087) against a float64 reference with the segment mask.

An implementation whose call would not fit in memory is not run (its result
records ``not_run`` with the reason in ``extra_info``): on a
CPU when 1.5x XLA's buffer assignment (XLA:CPU's peak RSS reaches 1.6x its
temporaries) exceeds the available memory, as for jax.nn at S = 16384
(forward+backward needs over 24 GB); on a device when the buffer assignment
exceeds the free device memory.
"""

import dataclasses
import math
import os
import statistics
import time
from typing import Optional

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

CHECK_ROWS = 128  # query rows checked against the float64 reference
# Max relative error of the checked rows. Accelerators get the bfloat16 bound for every dtype:
# their default float32 matmul precision may be TF32 or one bfloat16 pass.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  seq: int
  causal: bool = True
  kv_heads: int = 8
  dtype: str = "float32"
  slow: bool = False
  heads: int = 8
  batch: int = 1
  head_dim: int = 64
  soft_cap: Optional[float] = None

  @property
  def id(self):
    parts = [
      "causal" if self.causal else "full",
      "mha" if self.kv_heads == self.heads else "gqa",
      self.dtype,
      f"S{self.seq}",
    ]
    cap = [] if self.soft_cap is None else [f"cap{self.soft_cap:g}"]
    return "-".join(parts + cap + (["slow"] if self.slow else []))


CASES = [
  Case(1024),
  Case(4096),  # the headline case
  Case(4096, causal=False),
  Case(4096, kv_heads=2),
  Case(4096, dtype="bfloat16"),
  Case(16384, slow=True),
]
MODES = ["fwd", "fwd+bwd"]
IMPLS = ["pallax", "jax.nn", "tokamax"]


def attention_work(case, mode, documents=1):
  """``pallax.roofline.attention_work`` of one call (module docstring)."""
  return roofline.attention_work(
    case.batch,
    case.heads,
    case.kv_heads,
    case.seq,
    case.seq,
    case.head_dim,
    case.dtype,
    mode,
    causal=case.causal,
    documents=documents,
  )


def _rounds(case, mode):
  """(timed rounds, untimed warm-up rounds) after the first, checked call."""
  if case.slow:
    return (2 if mode == "fwd" else 1), 0
  if case.seq <= 1024:
    return (10 if mode == "fwd" else 5), 1
  return (5 if mode == "fwd" else 3), 1


def attention_fn(impl, causal):
  """The implementation's function of (query, key, value); imports tokamax lazily."""
  if impl == "pallax":
    return lambda q, k, v: pallax.dot_product_attention(q, k, v, is_causal=causal)
  if impl == "jax.nn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  if impl == "jax.nn-cudnn":  # NVIDIA GPUs only: raises elsewhere
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn"
    )
  if impl == "tokamax":
    tokamax = peers.tokamax()
    return lambda q, k, v: tokamax.dot_product_attention(
      q, k, v, is_causal=causal, implementation="xla_chunked"
    )
  raise ValueError(impl)


def program(case, impl, mode, fwd_bwd=None):
  """``(fn, inputs)`` of one benchmark; ``case`` is a ``Case`` or its fields as a dict.

  Called by the benchmark and, for peak memory, by the subprocess of
  ``bench/peak_memory.py`` (hence a dict, and ``fwd_bwd=None`` meaning
  conftest's maker, loaded from its file).
  """
  case = Case(**case) if isinstance(case, dict) else case
  b, t, n, k, h = case.batch, case.seq, case.heads, case.kv_heads, case.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  dtype = jnp.dtype(case.dtype)
  q, kk, v = (
    jax.random.normal(key, shape, jnp.float32).astype(dtype)
    for key, shape in zip(keys, [(b, t, n, h), (b, t, k, h), (b, t, k, h)])
  )
  fn = attention_fn(impl, case.causal)
  if mode == "fwd":
    return fn, (q, kk, v)
  make = fwd_bwd if fwd_bwd is not None else modes.fwd_bwd
  cotangent = jax.random.normal(keys[3], (b, t, n, h), jnp.float32)
  return make(fn, 3), (q, kk, v, cotangent)


def reference_rows(case, mode, inputs, rows=CHECK_ROWS, bias=None, bias_grad=False):
  """Float64 output (``fwd``) or dL/dquery (``fwd+bwd``) of the first ``rows`` queries.

  ``bias``: added to the logits, ``(B or 1, N, T, S)`` (after the soft cap);
  with ``bias_grad`` (``fwd+bwd``) also its gradient's first ``rows``, summed
  over the batch where the bias broadcasts over it.
  """
  q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in inputs[:3])
  q = q[:, :rows]
  group = case.heads // case.kv_heads  # query head i uses key/value head i // group, as jax.nn
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scale = 1 / math.sqrt(case.head_dim)
  logits = np.einsum("brnh,bsnh->bnrs", q, k, optimize=True) * scale
  slope = 1.0  # d capped logits / d logits
  if case.soft_cap is not None:
    tanh = np.tanh(logits / case.soft_cap)
    logits, slope = case.soft_cap * tanh, 1 - tanh**2
  if bias is not None:
    logits = logits + np.asarray(bias.astype(jnp.float32), np.float64)[:, :, :rows]
  if case.causal:
    visible = np.arange(k.shape[1])[None, :] <= np.arange(q.shape[1])[:, None]
    logits = np.where(visible, logits, -np.inf)
  dout = None if mode == "fwd" else np.asarray(inputs[3], np.float64)[:, :rows]
  if not bias_grad:
    return _softmax_rows(logits, k, v, dout, scale, slope)
  dq, ds = _softmax_rows(logits, k, v, dout, scale, slope, logits_grad=True)
  return dq, ds.sum(0, keepdims=True) if bias.shape[0] == 1 else ds


def _softmax_rows(logits, k, v, dout, scale, slope=1.0, logits_grad=False):
  """The rows' float64 output from masked logits, or with ``dout`` given their dL/dquery.

  ``slope``: the logits' derivative through a soft cap (1 without).
  ``logits_grad``: also the (capped) logits' gradient, a bias' ``(B, N, rows, S)``.
  """
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bnrs,bsnh->brnh", p, v, optimize=True)
  if dout is None:
    return out
  dp = np.einsum("brnh,bsnh->bnrs", dout, v, optimize=True)
  delta = np.einsum("brnh,brnh->bnr", dout, out)
  ds = p * (dp - delta[..., None])
  dq = np.einsum("bnrs,bsnh->brnh", ds * slope, k, optimize=True) * scale
  return (dq, ds) if logits_grad else dq


def _checked_rows(mode, result, rows=CHECK_ROWS):
  if mode == "fwd":
    return result[:, :rows]
  _, (dq, _, _) = result
  return dq[:, :rows]


PARAMS = [
  pytest.param(case, mode, impl, id=f"{case.id}-{mode}-{impl}")
  for case in CASES
  for mode in MODES
  for impl in IMPLS
]


@pytest.mark.parametrize("case, mode, impl", PARAMS)
def test_attention(benchmark, fwd_bwd, case, mode, impl):
  benchmark.group = f"{case.id}-{mode}"
  fn, inputs = program(case, impl, mode, fwd_bwd)
  inputs = jax.block_until_ready(inputs)
  device = jax.devices()[0]
  compiled = jax.jit(fn).lower(*inputs).compile()
  too_big = does_not_fit(compiled, device)
  if too_big:  # reported in the results as not run (jax.nn at S=16384 on a CPU), not timed
    benchmark.extra_info["not_run"] = too_big
    return

  # Peak memory first: a case too big for the machine then fails in the subprocess.
  rounds, warmup = _rounds(case, mode)
  calls = 1 if case.slow else 2
  builder = f"{os.path.abspath(__file__)}:program"
  info = benchmark.extra_info
  record(info, builder, dataclasses.asdict(case), impl, mode, platform=device.platform, calls=calls)
  record_compiled(info, compiled, fn, inputs, impl)

  def call():
    return jax.block_until_ready(compiled(*inputs))

  got = np.asarray(_checked_rows(mode, call()).astype(jnp.float32), np.float64)
  want = reference_rows(case, mode, inputs)
  error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  info["max_rel_err"] = error
  tolerance = TOLERANCE[case.dtype if device.platform == "cpu" else "bfloat16"]
  assert error < tolerance, f"{impl} is wrong: max rel err {error:.2e}"

  benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=warmup)
  info.update(case=case.id, mode=mode, impl=impl, platform=device.platform)
  record_throughput(benchmark, attention_work(case, mode), case.dtype)


# ------------------------------------------------------------------------------
# Every mode at small sizes, peers included: the cases python -m pallax.bench plots.

MODE_SEQS = [512, 1024, 2048]
MODE_PEERS = ("jax.nn-cudnn", "tokamax")
MODE_PARAMS = [
  pytest.param(impl, id=impl, marks=[pytest.mark.peer] if impl in MODE_PEERS else [])
  for impl in ("pallax", "jax.nn", *MODE_PEERS)
]


@pytest.mark.parametrize("impl", MODE_PARAMS)
@pytest.mark.parametrize("mode", modes.MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seq", MODE_SEQS, ids=lambda s: f"S{s}")
def test_attention_modes(benchmark, bench, seq, dtype, mode, impl):
  """Causal MHA (B=1, N=8, H=64) in ``fwd``, ``fwd+bwd``, ``jvp`` and ``hvp`` (``bench/modes.py``).

  With ``--peers``: jax.nn's cuDNN implementation (NVIDIA GPUs; it raises
  elsewhere) and tokamax (its ``custom_vjp`` raises under ``jvp``; its
  ``hvp`` runs), reported, not skipped. pallax's result is checked against
  jax.nn's in the same mode (``max_rel_err_vs_jax_nn``).
  """
  case = Case(seq, dtype=dtype)
  _, inputs = program(case, impl, "fwd")
  shape = [case.batch, case.seq, case.heads, case.head_dim]
  info = benchmark.extra_info
  info.update(op="dot_product_attention", impl=impl, mode=mode, dtype=dtype, shape=shape)
  peer = impl in MODE_PEERS
  call = bench.transformed(attention_fn(impl, True), inputs, mode, np.random.default_rng(0), peer)
  if call is None or not bench(call[0], *call[1], peer=peer):
    return
  fn, args = call
  if impl == "pallax":
    plain, _ = modes.transformed(
      attention_fn("jax.nn", True), inputs, mode, np.random.default_rng(0)
    )
    tolerance = TOLERANCE[dtype if jax.devices()[0].platform == "cpu" else "bfloat16"]
    info["max_rel_err_vs_jax_nn"] = modes.assert_agrees(fn, plain, args, tolerance, "jax.nn")
  if mode in roofline.MODES:
    record_throughput(benchmark, attention_work(case, mode), dtype)


# ------------------------------------------------------------------------------
# Packed documents: block skipping by segment ids (module docstring).

PACKED = Case(4096)  # causal, B=1, N=K=8, H=64, float32
PACKED_DOCS = {"8docs": 8, "1seg": 1}
PACKED_ROWS = slice(960, 1088)  # across the boundary of documents 1 and 2 (at 1024)
SPEEDUP_TARGET = 3.0


def packed_program(docs, mode):
  """``(fn, inputs)``: pallax with ``docs`` equal documents as segment ids (arguments)."""
  b, t, n, h = PACKED.batch, PACKED.seq, PACKED.heads, PACKED.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.float32) for key in keys[:3])
  seg = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // (t // docs), (b, t))

  def fn(q, k, v, seg):
    return pallax.dot_product_attention(
      q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg
    )

  if mode == "fwd":
    return fn, (q, k, v, seg)

  def fwd_bwd(q, k, v, seg, c):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v, seg) * c)
    return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

  return fwd_bwd, (q, k, v, seg, jax.random.normal(keys[3], (b, t, n, h), jnp.float32))


def packed_reference_rows(mode, inputs, rows=PACKED_ROWS):
  """Float64 output (``fwd``) or dL/dquery (``fwd+bwd``) of query ``rows``, segments masked."""
  q, k, v = (np.asarray(x, np.float64) for x in inputs[:3])
  seg = np.asarray(inputs[3])
  qi = np.arange(q.shape[1])[rows]
  scale = 1 / math.sqrt(q.shape[-1])
  logits = np.einsum("brnh,bsnh->bnrs", q[:, rows], k) * scale
  visible = (np.arange(k.shape[1])[None, :] <= qi[:, None])[None] & (
    seg[:, rows, None] == seg[:, None, :]
  )
  logits = np.where(visible[:, None], logits, -np.inf)
  dout = None if mode == "fwd" else np.asarray(inputs[4], np.float64)[:, rows]
  return _softmax_rows(logits, k, v, dout, scale)


def _packed_call(docs, mode):
  """``(fn, call, inputs, error)``: the compiled, blocking call, checked once."""
  fn, inputs = packed_program(docs, mode)
  inputs = jax.block_until_ready(inputs)
  compiled = jax.jit(fn).lower(*inputs).compile()
  call = lambda: jax.block_until_ready(compiled(*inputs))
  result = call()
  got = result[:, PACKED_ROWS] if mode == "fwd" else result[1][0][:, PACKED_ROWS]
  want = packed_reference_rows(mode, inputs)
  error = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
  return fn, call, inputs, error


@pytest.mark.parametrize(
  "docs, mode",
  [(d, m) for m in MODES for d in PACKED_DOCS],
  ids=[f"packed-causal-mha-float32-S4096-{d}-{m}-pallax" for m in MODES for d in PACKED_DOCS],
)
def test_attention_packed(benchmark, docs, mode):
  benchmark.group = f"packed-causal-mha-float32-S4096-{mode}"
  info = benchmark.extra_info
  fn, call, inputs, error = _packed_call(PACKED_DOCS[docs], mode)
  info["max_rel_err"] = error
  assert error < TOLERANCE["float32"], f"pallax ({docs}) is wrong: max rel err {error:.2e}"
  info["pallax_kernels"] = [
    f"{s.op}: {s.implementation} ({s.source})" for s in pallax.explain(fn, *inputs)
  ]
  rounds, warmup = _rounds(PACKED, mode)
  one_segment = None
  if docs == "8docs":  # the same call with one segment, timed here too for the ratio
    _, one_call, _, one_error = _packed_call(1, mode)
    assert one_error < TOLERANCE["float32"], f"pallax (1seg) is wrong: {one_error:.2e}"
    for _ in range(warmup):
      one_call()
    times = []
    for _ in range(rounds):
      start = time.perf_counter()
      one_call()
      times.append(time.perf_counter() - start)
    one_segment = statistics.median(times)
  benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=warmup)
  # Unmasked pairs: per document of length L, L (L + 1) / 2 under the causal mask.
  work = attention_work(PACKED, mode, documents=PACKED_DOCS[docs])
  info.update(case=f"packed-{docs}", mode=mode, impl="pallax")
  info["platform"] = jax.devices()[0].platform
  record_throughput(benchmark, work, PACKED.dtype)
  if one_segment is not None:
    info["one_segment_median_s"] = round(one_segment, 4)
    info["speedup_target"] = SPEEDUP_TARGET
    if benchmark.stats is not None:  # None under --benchmark-disable
      info["speedup_vs_one_segment"] = round(one_segment / benchmark.stats.stats.median, 2)
