"""paged_attention: pallax vs gathering the pages then jax.nn, time, bandwidth and peak memory.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_paged_attention.py
  pytest -n 0 bench/test_paged_attention.py -k "full and pallax"
  pytest -n 0 bench/test_paged_attention.py --benchmark-json paged.json   # extra_info in the JSON

On a GPU, add ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the peak-memory
subprocess needs device memory the pytest process would otherwise reserve).

One decode step of the issue's shape: B = 32 sequences, N = 32 query heads,
K = 8 kv heads, H = 128, a context of 4096 tokens in pages of 16 (256 pages
a sequence, a pool of B * 256 pages in a random order), bfloat16. Cases:
``full`` (every sequence 4096 tokens) and ``ragged`` (lengths drawn
uniformly from 1..4096: pallax reads only the pages below each length).

Two implementations side by side, each its own benchmark in the case's group:
``pallax.paged_attention``, and ``gather+jax.nn``: gather every sequence's
pages into dense ``(B, S, K, H)`` keys and values (``k_pages[:, table]``)
and call ``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``,
what one writes without a paged kernel.

``extra_info`` of each benchmark:

- ``op``, ``mode`` (``fwd``: an inference op), ``dtype``, ``shape`` ``[B, N,
  context, H]`` and ``variant`` (``full`` or ``ragged``): the fields of
  ``python -m pallax.bench --ops paged_attention``'s table and plot.
- ``flops`` and ``bytes``: ``pallax.roofline.paged_decode_work``: the keys
  and values each sequence needs under its length (``sum(lengths) * K * 2H *
  itemsize``), plus ``q`` read and ``o`` written: the traffic floor of a
  decode step, which is bandwidth-bound. ``gbyte_per_s`` and ``tflop_per_s``
  over the median time, and on a device ``pallax.roofline`` knows
  ``fraction_of_peak_bandwidth`` (``bench/throughput.py``). On a GPU also
  ``kernel_us`` and ``kernel_gbyte_per_s``, ``kernel_fraction_of_peak_bandwidth``:
  the device's own time a call from a profiler trace, without the host's
  dispatch that the wall-clock median includes (``record_kernel_throughput``).
- ``peak_rss_mib``, ``call_peak_rss_mib``, ``baseline_rss_mib``,
  ``call_growth_mib`` (and ``device_*`` on a GPU): ``bench/peak_memory.py``
  in a fresh process; ``xla_temp_mib``: XLA's temporaries for the call.
- ``max_rel_err``: against a float64 NumPy reference on the first sequences.
- ``pallax_kernels`` (pallax only): ``pallax.explain``'s pick.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peak_memory import record, record_compiled
from throughput import record_kernel_throughput, record_throughput

import pallax
from pallax import roofline

CHECK_SEQUENCES = 2
TOLERANCE = 2e-2  # bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
  ragged: bool = False
  batch: int = 32
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  context: int = 4096
  page_size: int = 16
  dtype: str = "bfloat16"

  @property
  def id(self):
    return f"{'ragged' if self.ragged else 'full'}-B{self.batch}-ctx{self.context}-{self.dtype}"

  @property
  def pages_per_sequence(self):
    return -(-self.context // self.page_size)


CASES = [Case(), Case(ragged=True)]
IMPLS = ["pallax", "gather+jax.nn"]


def _gather_then_jax_nn(q, k_pages, v_pages, lengths, page_indices):
  """Dense keys and values from every sequence's pages, then ``jax.nn``."""

  def dense(pages):  # (K, P, page_size, H) -> (B, S, K, H)
    x = pages[:, page_indices]  # (K, B, pages_per_sequence, page_size, H)
    k, b, n, ps, h = x.shape
    return jnp.transpose(x.reshape(k, b, n * ps, h), (1, 2, 0, 3))

  out = jax.nn.dot_product_attention(
    q[:, None], dense(k_pages), dense(v_pages), key_value_seq_lengths=lengths
  )
  return out[:, 0]


def program(case, impl):
  """``(fn, inputs)`` of one benchmark; ``case`` is a ``Case`` or its fields as a dict."""
  case = Case(**case) if isinstance(case, dict) else case
  rng = np.random.default_rng(0)
  b, pps = case.batch, case.pages_per_sequence
  total = b * pps
  dtype = jnp.dtype(case.dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, case.heads, case.head_dim), jnp.float32).astype(dtype)
  pool = (case.kv_heads, total, case.page_size, case.head_dim)
  k_pages = jax.random.normal(keys[1], pool, jnp.float32).astype(dtype)
  v_pages = jax.random.normal(keys[2], pool, jnp.float32).astype(dtype)
  if case.ragged:
    lengths = rng.integers(1, case.context + 1, b)
  else:
    lengths = np.full(b, case.context)
  table = rng.permutation(total).reshape(b, pps)
  inputs = (q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), jnp.asarray(table, jnp.int32))
  fn = pallax.paged_attention if impl == "pallax" else _gather_then_jax_nn
  return fn, inputs


def reference(inputs, sequences=CHECK_SEQUENCES):
  """Float64 outputs of the first ``sequences`` sequences, ``(sequences, N, H)``."""
  q, k_pages, v_pages, lengths, table = (np.asarray(x) for x in inputs)
  q, k_pages, v_pages = (x.astype(np.float32).astype(np.float64) for x in (q, k_pages, v_pages))
  kv, _, ps, h = k_pages.shape
  group = q.shape[1] // kv
  out = []
  for b in range(sequences):
    n = int(lengths[b])
    k = k_pages[:, table[b]].reshape(kv, -1, h)[:, :n]
    v = v_pages[:, table[b]].reshape(kv, -1, h)[:, :n]
    s = np.einsum("kgh,klh->kgl", q[b].reshape(kv, group, h), k) / np.sqrt(h)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out.append(np.einsum("kgl,klh->kgh", w, v).reshape(-1, h))
  return np.stack(out)


PARAMS = [pytest.param(case, impl, id=f"{case.id}-{impl}") for case in CASES for impl in IMPLS]


@pytest.mark.parametrize("case, impl", PARAMS)
def test_paged_attention(benchmark, case, impl):
  benchmark.group = case.id
  fn, inputs = program(case, impl)
  inputs = jax.block_until_ready(inputs)
  device = jax.devices()[0]
  compiled = jax.jit(fn).lower(*inputs).compile()
  info = benchmark.extra_info
  builder = f"{os.path.abspath(__file__)}:program"
  record(info, builder, dataclasses.asdict(case), impl, platform=device.platform)
  record_compiled(info, compiled, fn, inputs, impl)

  def call():
    return jax.block_until_ready(compiled(*inputs))

  got = np.asarray(call()[:CHECK_SEQUENCES].astype(jnp.float32), np.float64)
  want = reference(inputs)
  error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  info["max_rel_err"] = error
  assert error < TOLERANCE, f"{impl} is wrong: max rel err {error:.2e}"

  benchmark.pedantic(call, rounds=5, iterations=1, warmup_rounds=1)
  info.update(case=case.id, impl=impl, platform=device.platform)
  shape = [case.batch, case.heads, case.context, case.head_dim]
  variant = "ragged" if case.ragged else "full"
  info.update(op="paged_attention", mode="fwd", dtype=case.dtype, shape=shape, variant=variant)
  work = roofline.paged_decode_work(inputs[3], case.heads, case.kv_heads, case.head_dim, case.dtype)
  record_throughput(benchmark, work, case.dtype)
  record_kernel_throughput(benchmark, compiled, inputs, work, case.dtype)
