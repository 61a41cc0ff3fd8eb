"""Context parallelism: causal attention with the sequence sharded over 8 CPU devices.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_attention_context.py --benchmark-group-by=param:seq,param:mode

B=1, N=8 query heads (K=8), H=64, float32, causal. Impls: ``unsharded``
(one device holds everything: what fits without context parallelism),
``ring`` and ``all_gather`` (the sequence sharded over the 8 devices
``bench/conftest.py`` makes, each program forced by its cost's start-up
term), each in the ``contiguous`` and ``zigzag`` layouts. ``extra_info``
records the per-device memory of the compiled call (XLA's buffer
assignment, ``memory``) and, per layout, the causal work per device
(``visible_blocks``: the key positions each device's queries meet; max/min
is 8 for contiguous and 1 for zigzag). On 8 CPU devices of a 2-core machine
the devices share the cores, so the sharded times measure total work, not
the speed-up of 8 real devices; the memory is per device either way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from modes import MODES

import pallax
from pallax.kernels.attention import context

SEQ_LENS = [16384, 65536]
IMPLS = ("unsharded", "ring", "all_gather")
LAYOUTS = ("contiguous", "zigzag")
DEVICES = 8


# A layout only matters sharded: one device runs the contiguous case alone.
CASES = [(impl, layout) for impl in IMPLS for layout in LAYOUTS]
CASES.remove(("unsharded", "zigzag"))


@pytest.mark.parametrize("impl, layout", CASES, ids="-".join)
@pytest.mark.parametrize("mode", [m for m in MODES if m in ("fwd", "fwd+bwd")])
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_context_parallel(benchmark, bench, monkeypatch, seq, mode, impl, layout):
  assert len(jax.devices()) >= DEVICES, (
    f"{len(jax.devices())} devices: bench/conftest.py makes {DEVICES} CPU devices unless "
    "XLA_FLAGS already sets another count"
  )
  monkeypatch.setattr(context, "LATENCY_BYTES", 1 if impl == "ring" else 10**15)
  order = pallax.SequenceLayout(layout, DEVICES) if layout != "contiguous" else None
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, seq, 8, 64)), jnp.float32) for _ in range(3))
  if impl != "unsharded":
    mesh = jax.make_mesh((DEVICES,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v))
  fn = lambda q, k, v: pallax.dot_product_attention(q, k, v, is_causal=True, sequence_layout=order)
  work = context.visible_blocks(
    order or pallax.SequenceLayout("contiguous", DEVICES), seq, seq, right=0
  )
  benchmark.extra_info.update(
    op="dot_product_attention",
    impl=impl,
    layout=layout,
    mode=mode,
    seq=seq,
    work_max_over_min=float(work.max() / work.min()),
  )
  call, args = bench.transformed(fn, [q, k, v], mode, np.random.default_rng(1))
  bench(call, *args, rounds=3)
