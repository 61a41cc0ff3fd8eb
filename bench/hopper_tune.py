"""Autotunes the device benches' kernel calls on this GPU, printing every candidate's time.

Run on the device (``bench/hopper.sh`` does, before the benches)::

  python bench/hopper_tune.py OUT_DIR [CASE ...]    # cases: paged ragged attention

Each case's function is tuned with ``pallax.tune.tune`` (the paged kernels on full
caches: their config modules' ``tune_inputs``). Per kernel call it prints
the candidates fastest first, with the heuristic's config marked, and the
heuristic's time over the best (what tuning would gain), so that the
heuristics can learn from one run. After each case this device's tuned
configs are exported to ``OUT_DIR/tuned.json`` (``python -m pallax.tune
--import`` merges them into a cache or the shipped defaults).
"""

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import pallax
from pallax.executor import default_executor
from pallax.tune import export_configs, tune

BF16 = jnp.bfloat16


def _s(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _i32(*shape):
  return _s(shape, jnp.int32)


def _paged_decode():
  """``bench/test_paged_attention.py``'s full case: B=32, N=32, K=8, H=128, 4096 tokens."""
  b, pps = 32, 256
  pool = _s((8, b * pps, 16, 128))
  args = (_s((b, 32, 128)), pool, pool, _i32(b), _i32(b, pps))
  return pallax.paged_attention, args, {}


def _ragged(tokens, seqs, pps):
  """``bench/test_ragged_paged_attention.py``'s shapes: N=32, K=8, H=128, pages of 16."""
  pool = _s((8, seqs * pps, 16, 128))
  args = (_s((tokens, 32, 128)), pool, pool, _i32(seqs), _i32(seqs, pps), _i32(seqs + 1), _i32(1))
  return pallax.ragged_paged_attention, args, {}


def _attention(batch, seq, causal):
  """``bench/test_attention_hopper.py``'s shapes: N=16, H=128, forward and backward."""
  qkv = _s((batch, seq, 16, 128))

  def f(q, k, v):
    return pallax.dot_product_attention(q, k, v, is_causal=causal)

  return f, (qkv, qkv, qkv), {"grad": True}


CASES = {
  "paged": [("paged decode B32 ctx4096", _paged_decode)],
  "ragged": [
    ("ragged mixed T283 S16", lambda: _ragged(283, 16, 128)),
    ("ragged decode T32 S32", lambda: _ragged(32, 32, 128)),
  ],
  "attention": [
    ("attention B4 S4096", lambda: _attention(4, 4096, False)),
    ("attention B4 S4096 causal", lambda: _attention(4, 4096, True)),
  ],
}


def _print_log(entries, heuristics) -> None:
  """Each tuned call's candidates, fastest first; ``heuristics``: key -> the heuristic's config."""
  for selection, result in entries:
    timings = sorted(result.timings, key=lambda ct: ct[1])
    best = timings[0][1]
    print(f"hopper-tune {selection.op}: {len(timings)} timed, {len(result.failures)} skipped")
    heuristic = None
    for config, seconds in timings:
      mark = ""
      if config == heuristics.get(selection.key):
        heuristic, mark = seconds, "  <- heuristic"
      print(f"  {seconds * 1e6:9.1f} us  {config}{mark}")
    if heuristic is not None:
      print(f"  heuristic / best: {heuristic / best:.2f}")
    for config, reason in result.failures[:8]:
      print(f"  skipped {config}: {reason[:160]}")


def _with_backward(fn):
  """``fn`` and its gradient in one function (what ``pallax.tune(grad=True)`` tunes)."""

  def both(*args):
    total = lambda *a: fn(*a).astype(jnp.float32).sum()
    return fn(*args), jax.grad(total, argnums=tuple(range(len(args))))(*args)

  return both


def main(out: Path, names) -> None:
  out.mkdir(parents=True, exist_ok=True)
  executor = default_executor()
  print("jax", jax.__version__, jax.devices()[0].device_kind)
  for name in names:
    for title, make in CASES[name]:
      fn, args, kw = make()
      traced = _with_backward(fn) if kw.get("grad") else fn
      heuristics = {s.key: s.config for s in pallax.explain(traced, *args)}  # before tuning
      start, seen = time.perf_counter(), len(executor.tune_log)
      try:
        tune(fn, *args, **kw)
      except Exception as err:  # noqa: BLE001 - report and go on to the next case
        print(f"hopper-tune {title}: FAILED {type(err).__name__}: {str(err)[:400]}")
      print(f"hopper-tune {title}: tuned in {time.perf_counter() - start:.0f} s")
      _print_log(executor.tune_log[seen:], heuristics)
      export_configs(out / "tuned.json")
      sys.stdout.flush()


if __name__ == "__main__":
  main(Path(sys.argv[1]), sys.argv[2:] or list(CASES))
