"""ragged_paged_attention: pallax vs gathering the pages then jax.nn, and vs paged_attention.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_ragged_paged_attention.py
  pytest -n 0 bench/test_ragged_paged_attention.py --benchmark-json ragged.json

One serving step, bfloat16, N = 32 query heads, K = 8 kv heads, H = 128,
pages of 16 tokens in a shuffled pool. Cases:

* ``mixed``: 16 sequences: 12 decoding one token, 3 verifying 5 speculative
  tokens, 1 prefilling a chunk of 256 tokens, caches of 1024 to 2048 tokens;
* ``decode``: 32 sequences decoding one token each against 2048 cached.

Implementations, each its own benchmark in the case's group:
``pallax.ragged_paged_attention``; ``gather+jax.nn``: every sequence's pages
gathered into dense keys and values, its queries padded to the longest, and
``jax.nn.dot_product_attention`` with the bottom-right causal mask, what one
writes without the op; for ``decode``, ``pallax.paged_attention`` (the
decode op it must not be slower than); and on a Hopper GPU ``mosaic_gpu``,
the op with the Mosaic GPU kernel pinned (``MOSAIC_CONFIGS``: until it is
measured, the executor's heuristic runs the Triton kernel there).

``extra_info``: ``flops``, ``bytes`` (``pallax.roofline.ragged_paged_work``:
every query's visible keys; each sequence's cache read once, the floor),
the achieved rates (on a GPU also the device's own time, ``kernel_*``:
``bench/throughput.py``) and,
on a device ``pallax.roofline`` knows, their fractions of its peaks;
``tokens_per_s`` (query tokens a second); ``max_rel_err`` against a float64
NumPy reference on the first sequences.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from throughput import record_kernel_throughput, record_throughput

import pallax
from pallax import roofline

CHECK_SEQUENCES = 4
TOLERANCE = 2e-2  # bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 16
  dtype: str = "bfloat16"

  @property
  def pages_per_sequence(self) -> int:
    return -(-max(self.kv_lens) // self.page_size)


CASES = [
  Case(
    "mixed",
    q_lens=(1,) * 12 + (5,) * 3 + (256,),
    kv_lens=tuple(1024 + 85 * i for i in range(12)) + (1500, 1700, 2000, 2048),
  ),
  Case("decode", q_lens=(1,) * 32, kv_lens=(2048,) * 32),
]
IMPLS = {
  "mixed": ["pallax", "gather+jax.nn", "mosaic_gpu"],
  "decode": ["pallax", "gather+jax.nn", "paged", "mosaic_gpu"],
}
# The Mosaic GPU kernel's pinned configs: 64 rows an item of the mixed batch
# (16 tokens x 4 query heads), one token an item of the decode batch; each
# item's keys in two splits (512 blocks of threads for the decode batch's 256
# items x kv heads on 132 SMs).
MOSAIC_CONFIGS = {
  "mixed": pallax.MosaicGpuRaggedPagedAttentionConfig(block_q=16, num_stages=4, num_splits=2),
  "decode": pallax.MosaicGpuRaggedPagedAttentionConfig(block_q=1, num_stages=4, num_splits=2),
}


def program(case: Case):
  """The step's operands: ``(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)``."""
  rng = np.random.default_rng(0)
  seqs, pps = len(case.q_lens), case.pages_per_sequence
  total = seqs * pps
  dtype = jnp.dtype(case.dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  cu = np.concatenate([[0], np.cumsum(case.q_lens)])
  q = jax.random.normal(keys[0], (int(cu[-1]), case.heads, case.head_dim)).astype(dtype)
  pool = (case.kv_heads, total, case.page_size, case.head_dim)
  k_pages, v_pages = (jax.random.normal(k, pool).astype(dtype) for k in keys[1:])
  table = rng.permutation(total).reshape(seqs, pps)
  ints = (case.kv_lens, table, cu, [seqs])
  return (q, k_pages, v_pages, *(jnp.asarray(x, jnp.int32) for x in ints))


def _gather_then_jax_nn(case: Case):
  """Dense caches, queries padded per sequence, ``jax.nn`` with the bottom-right mask."""
  q_lens, kv_lens = np.asarray(case.q_lens), np.asarray(case.kv_lens)
  cu = np.concatenate([[0], np.cumsum(q_lens)])
  longest = int(q_lens.max())
  rows = np.minimum(cu[:-1, None] + np.arange(longest), cu[-1] - 1)  # (S, longest) tokens
  live = np.arange(longest) < q_lens[:, None]
  positions = kv_lens[:, None] - q_lens[:, None] + np.arange(longest)
  seen = np.arange(case.pages_per_sequence * case.page_size) <= positions[..., None]
  mask = jnp.asarray((seen & live[..., None])[:, None])  # (S, 1, longest, len)

  def fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    def dense(pages):  # (K, P, page_size, H) -> (S, len, K, H)
      x = pages[:, page_indices]
      k, s, n, ps, h = x.shape
      return jnp.transpose(x.reshape(k, s, n * ps, h), (1, 2, 0, 3))

    out = jax.nn.dot_product_attention(q[rows], dense(k_pages), dense(v_pages), mask=mask)
    return jnp.zeros_like(q).at[jnp.where(live, rows, q.shape[0])].set(out, mode="drop")

  return fn


def _paged(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
  return pallax.paged_attention(q, k_pages, v_pages, kv_lens, page_indices)


def reference(case: Case, inputs, sequences=CHECK_SEQUENCES):
  """Float64 outputs of the first ``sequences`` sequences' queries, ``(tokens, N, H)``."""
  q, k_pages, v_pages, kv_lens, table, cu, _ = (np.asarray(x) for x in inputs)
  q, k_pages, v_pages = (x.astype(np.float32).astype(np.float64) for x in (q, k_pages, v_pages))
  kv, _, _, h = k_pages.shape
  out = []
  for i in range(sequences):
    n = int(kv_lens[i])
    k = np.repeat(k_pages[:, table[i]].reshape(kv, -1, h)[:, :n], q.shape[1] // kv, axis=0)
    v = np.repeat(v_pages[:, table[i]].reshape(kv, -1, h)[:, :n], q.shape[1] // kv, axis=0)
    queries = q[cu[i] : cu[i + 1]]
    positions = n - len(queries) + np.arange(len(queries))
    s = np.einsum("tnh,nlh->ntl", queries, k) / np.sqrt(h)
    s = np.where(np.arange(n) <= positions[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out.append(np.einsum("ntl,nlh->tnh", w / w.sum(-1, keepdims=True), v))
  return np.concatenate(out)


PARAMS = [
  pytest.param(
    case,
    impl,
    id=f"{case.name}-{impl}",
    marks=[pytest.mark.hopper_gpu] if impl == "mosaic_gpu" else [],
  )
  for case in CASES
  for impl in IMPLS[case.name]
]


@pytest.mark.parametrize("case, impl", PARAMS)
def test_ragged_paged_attention(benchmark, bench, case, impl):
  benchmark.group = case.name
  inputs = jax.block_until_ready(program(case))
  if impl == "mosaic_gpu":
    fn = functools.partial(pallax.ragged_paged_attention, config=MOSAIC_CONFIGS[case.name])
  else:
    fn = {"pallax": pallax.ragged_paged_attention, "paged": _paged}.get(impl)
  fn = fn or _gather_then_jax_nn(case)
  tokens = int(sum(case.q_lens[:CHECK_SEQUENCES]))
  got = np.asarray(jax.jit(fn)(*inputs)[:tokens].astype(jnp.float32), np.float64)
  want = reference(case, inputs)
  error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
  info = benchmark.extra_info
  info.update(max_rel_err=error, op="ragged_paged_attention", mode="fwd", dtype=case.dtype)
  info.update(variant=case.name, shape=[int(sum(case.q_lens)), case.heads, max(case.kv_lens)])
  assert error < TOLERANCE, f"{impl} is wrong: max rel err {error:.2e}"
  bench(fn, *inputs, rounds=10)
  work = roofline.ragged_paged_work(
    case.q_lens, case.kv_lens, case.heads, case.kv_heads, case.head_dim, case.dtype
  )
  record_throughput(benchmark, work, case.dtype)
  record_kernel_throughput(benchmark, jax.jit(fn), inputs, work, case.dtype)
  if benchmark.stats is not None:
    info["tokens_per_s"] = sum(case.q_lens) / benchmark.stats.stats.median
