"""pallax's ops against their plain-JAX formulation, timed in interleaved pairs.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_xla_parity.py
  pytest -n 0 bench/test_xla_parity.py -k "norm and float32"

On a CPU pallax runs its XLA programs, and this suite checks the promise
that they cost at most ``LIMIT`` (1.05x) the time of what a user writes
without pallax: the norms against their jnp formulations, softmax and
log_softmax against ``jax.nn``, matmul against ``jnp.matmul`` plus the
unfused epilogue, at every size and dtype of those ops' benches
(``bench/test_norm.py``, ``test_softmax.py``, ``test_matmul.py``), causal
attention against ``jax.nn.dot_product_attention`` and the linear
cross-entropy against its plain formulation at the sizes of their
every-mode benches (``test_attention_modes``,
``test_linear_cross_entropy_modes``), forward and forward+backward. (The
large attention and cross-entropy cases, seconds a call, record their
ratios in their own benches.)

A few percent cannot be read from two separate timing runs on a shared
machine, so each case times pairs: one call of each side, the order
alternating, and reports the median per-pair ratio with its ~95% interval
(``pallax.selfcheck.measure_ratio``: at least 15 pairs, until the interval
is within ±2% or ``BUDGET_S`` of timed calls). ``extra_info``: ``ratio``
(pallax / plain, the median), ``interval``, ``pairs``, ``fast_ratio`` (the
fastest tenths' ratio), ``reliable`` (False on a machine too loaded to
tell), and ``pallax_kernels``. pytest-benchmark's own statistics time
pallax's call alone. The terminal summary lists every case above ``LIMIT``
and every unreliable one; no case fails on time (benches report, tests
assert).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_attention
import test_cross_entropy
import test_matmul
import test_norm
import test_softmax
from modes import transformed

import pallax
from pallax import selfcheck

LIMIT = 1.05
BUDGET_S = 6.0
MODES = ("fwd", "fwd+bwd")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _norm_case(op, shape, dtype, rng):
  impls = test_norm.OPS[op][1]
  return impls["pallax"], impls["jnp"], test_norm.inputs(op, shape, dtype, rng)


def _softmax_case(op, shape, dtype, rng):
  impls = test_softmax.IMPLS[op]
  return impls["pallax"], impls["jax.nn"], [test_softmax.input_(shape, dtype, rng)]


def _matmul_case(epilogue, shape, dtype, rng):
  del rng
  a, b, bias = test_matmul.inputs(*shape, dtype)
  kwargs = test_matmul.EPILOGUES[epilogue]
  ours, plain = pallax.matmul, test_matmul.IMPLS["jnp"]
  if not kwargs:
    return (lambda a, b: ours(a, b)), (lambda a, b: plain(a, b)), [a, b]
  return (
    (lambda a, b, bias: ours(a, b, bias=bias, **kwargs)),
    (lambda a, b, bias: plain(a, b, bias=bias, **kwargs)),
    [a, b, bias],
  )


def _attention_case(seq, shape, dtype, rng):
  del shape, rng
  case = test_attention.Case(seq, dtype=jnp.dtype(dtype).name)
  _, inputs = test_attention.program(case, "pallax", "fwd")
  ours, plain = (test_attention.attention_fn(impl, True) for impl in ("pallax", "jax.nn"))
  return ours, plain, list(inputs)


def _cross_entropy_case(vocab, shape, dtype, rng):
  del rng
  case = test_cross_entropy.Case(shape[0], vocab, hidden=shape[1], dtype=jnp.dtype(dtype).name)
  x, w, labels = test_cross_entropy.device_inputs(case)
  ours, plain = (test_cross_entropy.loss_fn(case, impl) for impl in ("pallax", "naive"))
  return (lambda x, w: ours(x, w, labels)), (lambda x, w: plain(x, w, labels)), [x, w]


def _id(shape):
  return "x".join(map(str, shape))


CASES = (
  [
    pytest.param(_norm_case, op, shape, dtype, id=f"{op}-{_id(shape)}-{dtype}")
    for op in test_norm.OPS
    for shape in test_norm.SHAPES
    for dtype in DTYPES
  ]
  + [
    pytest.param(_softmax_case, op, shape, dtype, id=f"{op}-{_id(shape)}-{dtype}")
    for op in test_softmax.IMPLS
    for shape in test_softmax.SHAPES
    for dtype in DTYPES
  ]
  + [
    pytest.param(
      _matmul_case, epilogue, shape, "float32", id=f"matmul-{epilogue}-{_id(shape)}-float32"
    )
    for epilogue in test_matmul.EPILOGUES
    for shape in test_matmul.SHAPES
  ]
  + [
    pytest.param(_attention_case, seq, (1, seq, 8, 64), dtype, id=f"attention-S{seq}-{dtype}")
    for seq in test_attention.MODE_SEQS
    for dtype in DTYPES
  ]
  + [
    pytest.param(
      _cross_entropy_case, vocab, (1024, 512, vocab), dtype, id=f"linear_ce-V{vocab}-{dtype}"
    )
    for vocab in test_cross_entropy.MODE_VOCABS
    for dtype in DTYPES
  ]
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make, op, shape, dtype", CASES)
def test_xla_parity(benchmark, request, make, op, shape, dtype, mode):
  rng = np.random.default_rng(0)
  ours, plain, args = make(op, shape, DTYPES[dtype], rng)
  ours, call_args = transformed(ours, args, mode, np.random.default_rng(1))
  plain, _ = transformed(plain, args, mode, np.random.default_rng(1))
  timing = selfcheck.measure_ratio(
    selfcheck.wall_clock_pairs(ours, plain, call_args), budget_s=BUDGET_S
  )
  lo, hi = timing.interval
  info = benchmark.extra_info
  name = {
    _matmul_case: "matmul",
    _attention_case: "dot_product_attention",
    _cross_entropy_case: "linear_cross_entropy",
  }.get(make, op)
  variant = op if make is _matmul_case else None
  info.update(op=name, variant=variant, mode=mode, dtype=dtype)
  info.update(shape=list(shape), limit=LIMIT)
  info.update(
    ratio=round(timing.ratio, 4),
    interval=[round(lo, 4), round(hi, 4)],
    pairs=timing.pairs,
    fast_ratio=round(timing.fast_ratio, 4),
    reliable=timing.reliable,
    pallax_kernels=[f"{s.op}: {s.implementation}" for s in pallax.explain(ours, *call_args)],
  )
  if timing.ratio > LIMIT or not timing.reliable:
    verdict = f"over {LIMIT}x" if timing.reliable else "unreliable"
    request.node.user_properties.append(
      ("summary", f"parity {verdict}: {request.node.name}: {timing.detail()}")
    )
  jitted = jax.jit(ours)
  benchmark.pedantic(lambda: jax.block_until_ready(jitted(*call_args)), rounds=3, warmup_rounds=1)
