"""Where a ragged-paged-attention decode step's time goes on a GPU, next to paged_attention's.

Run on the device (``python bench/ragged_breakdown.py``; ``SMALL=1`` on a
CPU, interpreted, checks the script only). It times, median of 50 calls
each, for ``bench/test_ragged_paged_attention.py``'s decode case: the
public ops; the Triton kernels' implementations at the heuristic's configs
(what the op's primitive runs); and the pieces of the ragged one around its
kernel (the work list, the items' queries and page-table rows, each token's
result gathered from its item); then, from a profiler trace, the device's kernels of
each public op (``throughput.kernel_times``: without the host's dispatch).
"""

import dataclasses
import functools
import os
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from test_ragged_paged_attention import CASES, Case, program  # noqa: E402
from throughput import kernel_times  # noqa: E402

import pallax  # noqa: E402
from pallax.executor.autotune import median_time  # noqa: E402
from pallax.kernels.paged_attention import config as paged_config  # noqa: E402
from pallax.kernels.paged_attention import triton as paged_triton  # noqa: E402
from pallax.kernels.ragged_paged_attention import common  # noqa: E402
from pallax.kernels.ragged_paged_attention import config as ragged_config  # noqa: E402
from pallax.kernels.ragged_paged_attention import triton as ragged_triton  # noqa: E402

SMALL = bool(os.environ.get("SMALL"))


def main() -> None:
  case = CASES[1]
  if SMALL:
    case = Case("decode", q_lens=(1,) * 4, kv_lens=(40,) * 4, heads=8, kv_heads=2, head_dim=32)
  inputs = program(case)
  q, k_pages, v_pages, kv_lens, table, cu, num_seqs = inputs
  t, n, h = q.shape
  kv = k_pages.shape[0]
  ops = (q.reshape(t, kv, n // kv, h), k_pages, v_pages, kv_lens, table, cu, num_seqs)
  params = {"scale": float(h) ** -0.5, "logits_soft_cap": None, "sliding_window": None}
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in ops]
  target, interpret = ("interpret-triton", True) if SMALL else ("cuda", False)
  rcfg = ragged_config.heuristic(avals, target, **params)
  pcfg = paged_config.heuristic(avals[:5], target, **params)
  p = common.Problem.of(avals, **params)
  bq = rcfg.block_q
  items = common.work_list(p, bq, kv_lens, cu, num_seqs)
  item_out = jax.numpy.zeros((len(items.seq), kv, bq * (n // kv), h), q.dtype)
  rows = {
    "op ragged_paged_attention": (jax.jit(pallax.ragged_paged_attention), inputs),
    "op paged_attention": (jax.jit(pallax.paged_attention), inputs[:5]),
    f"impl ragged {rcfg}": (
      jax.jit(
        functools.partial(
          ragged_triton.ragged_paged_attention, config=rcfg, interpret=interpret, **params
        )
      ),
      ops,
    ),
    f"impl paged {pcfg}": (
      jax.jit(
        functools.partial(paged_triton.paged_attention, config=pcfg, interpret=interpret, **params)
      ),
      ops[:5],
    ),
    "work_list": (
      jax.jit(lambda *a: dataclasses.astuple(common.work_list(p, bq, *a))),
      (kv_lens, cu, num_seqs),
    ),
    # The Triton kernel reads items of up to 16 rows from q's tokens: no gather then.
    "item_queries + table rows": (
      jax.jit(lambda q, table: (common.item_queries(q, items, bq), table[items.seq])),
      (ops[0], table),
    ),
    "token_results out + lse": (
      jax.jit(
        lambda x, cu, num: (
          common.token_results(x, bq, t, cu, num, 0),
          common.token_results(x[..., 0], bq, t, cu, num, -np.inf),
        )
      ),
      (item_out, cu, num_seqs),
    ),
  }
  print("device", jax.devices()[0].device_kind, "items", len(items.seq))
  for name, (fn, args) in rows.items():
    seconds = median_time(fn, args, warmup=1, repeats=50)
    print(f"ragged-breakdown {seconds * 1e6:9.1f} us  {name}", flush=True)
  for name in ("op ragged_paged_attention", "op paged_attention"):
    times = kernel_times(*rows[name])
    print(f"ragged-breakdown kernels of {name}: {sum(times.values()) * 1e6:.1f} us in all")
    for kernel, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
      print(f"  {seconds * 1e6:9.1f} us  {kernel}")


if __name__ == "__main__":
  main()
