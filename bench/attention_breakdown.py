"""Where the Hopper attention bench's time goes on a GPU: each implementation's device kernels.

Run on an H100 or H200 (``python bench/attention_breakdown.py``; ``bash
bench/hopper.sh``'s ``attention_breakdown`` step). For the B = 4, S = 4096
cases of ``bench/test_attention_hopper.py`` (bf16, N = 16, H = 128, causal
or not; ``fwd`` and ``fwd+bwd``), a profiler trace of 20 calls gives the
device's time a call in each kernel (``throughput.kernel_times``: without
the host's dispatch) of:

* ``pallax``: the executor's choice (the Mosaic GPU kernels) and the XLA
  programs around them (the backward's ``delta``; the layout transposes the
  primitive's ``(batch, kv heads, group, sequence, head dim)`` operands would
  need are folded away: ``tiles.sequence_first``);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
* ``pallax-k192`` (``fwd``, not causal): the forward pinned to 192-key
  blocks (``bench/test_attention_hopper.py``'s pin);
* ``pallax-fused2`` and ``pallax-fa3``
  (``fwd+bwd``): the backward pinned to the dk/dv kernel computing dQ too
  in two consumers, of 32-query steps and of FlashAttention-3's 64
  (``bench/test_attention_hopper.py``'s pins; left out under
  ``PALLAX_BENCH_FUSED=0``), against cuDNN's one backward kernel;
* ``jax-mgpu`` (``fwd``): JAX's own Mosaic GPU kernel
  (``jax.experimental.pallas.ops.gpu.attention_mgpu``, float16: its scratch
  is float16; 64-query tiles, 128-key blocks, 2 slots), a reference point
  for what Pallas Mosaic GPU reaches with the same structure.

TFLOP/s count the kernels' time alone (causal: the visible half).
"""

import functools
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from test_attention_hopper import CASES, _compiled, _inputs, _work  # noqa: E402
from throughput import kernel_times  # noqa: E402


def _jax_mgpu(case):
  """JAX's Mosaic GPU attention forward, float16 (its kernels' scratch is)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as ref

  config = ref.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=case.causal)
  return functools.partial(ref.attention, config=config)


def _report(name: str, make, args, flops: float) -> None:
  """Prints the kernels of ``make()(*args)``, or why it failed (``make`` compiling too)."""
  try:
    times = kernel_times(make(), args)
  except Exception as e:  # a peer that fails here is reported, the rest still run
    print(f"attention-breakdown {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return
  total = sum(times.values())
  rate = flops / total / 1e12 if total else float("nan")
  print(f"attention-breakdown {name}: {total * 1e6:.1f} us of kernels, {rate:.0f} TFLOP/s")
  for kernel, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:8]:
    print(f"  {seconds * 1e6:9.1f} us  {kernel[:110]}", flush=True)


def main() -> None:
  print("device", jax.devices()[0].device_kind)
  for case in (c for c in CASES if c.batch == 4):
    for mode in ("fwd", "fwd+bwd"):
      inputs = _inputs(case, mode)
      args = inputs[:3] if mode == "fwd" else inputs
      what = f"B{case.batch}-{case.id}-{mode}"
      flops = _work(case, mode).flops
      impls = ["pallax", "cudnn"]
      if mode == "fwd" and not case.causal:
        impls.append("pallax-k192")
      if mode == "fwd+bwd" and os.environ.get("PALLAX_BENCH_FUSED") != "0":
        impls += ["pallax-fused2", "pallax-fa3"]
      for impl in impls:
        make = lambda impl=impl: _compiled(impl, case, mode, inputs)[0]
        _report(f"{what} {impl}", make, args, flops)
      if mode == "fwd":  # its backward needs tuned blocks and takes no causal mask
        half = [x.astype(jnp.float16) for x in args]
        _report(f"{what} jax-mgpu", lambda: jax.jit(_jax_mgpu(case)), half, flops)


if __name__ == "__main__":
  main()
