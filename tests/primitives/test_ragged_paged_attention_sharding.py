"""ragged_paged_attention on several devices: kv heads (with their query heads) shard.

Runs on 8 fake CPU devices (tests/conftest.py). Query heads and the pools'
kv heads shard; tokens, the page table and the offsets are replicated (a
sequence's tokens and pages stay together). No all-gather in the compiled
HLO, the output keeps the query's sharding, and the results equal the
float64 reference. Sequences shard by shard_map: each device its own batch
and share of the pools.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import assert_close, mesh_4x2, sharding_devices
from tests.primitives.ragged_paged_attention_reference import Batch, inputs, reference

BATCH = Batch(n=16, k=8, page_size=4, pages_per_sequence=8, kv_lens=(9, 12, 30, 3, 1))
STATICS = dict(logits_soft_cap=4.0, sliding_window=10)

# Specs of (q, pools): kv heads over one axis or both, query heads within them.
SPECS = {
  "heads": (P(None, "a"), P("a")),
  "heads-all-devices": (P(None, ("a", "b")), P(("a", "b"))),
  "query-heads": (P(None, ("a", "b")), P()),
}


@pytest.mark.parametrize(
  "axis_type, spec_name",
  [(AxisType.Auto, name) for name in SPECS] + [(AxisType.Explicit, "heads")],
  ids=str,
)
def test_sharded_jit_has_no_all_gather(axis_type, spec_name):
  mesh = mesh_4x2(axis_type)
  args = inputs(BATCH, seed=1)
  q_spec, pool_spec = SPECS[spec_name]
  specs = (q_spec, pool_spec, pool_spec, P(), P(), P(), P())
  sargs = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
  f = jax.jit(functools.partial(pallax.ragged_paged_attention, **STATICS))
  compiled = f.lower(*sargs).compile()
  assert "all-gather" not in compiled.as_text(), f"{spec_name}: all-gather in the compiled HLO"
  out = compiled(*sargs)
  assert out.sharding.is_equivalent_to(sargs[0].sharding, out.ndim), out.sharding
  assert_close(out, reference(*args, **STATICS), jnp.float32, spec_name)


# Data-parallel serving: each device its own batch (tokens, offsets, lengths,
# page table) over its own share of the pools' pages. A global array cannot
# say which tokens belong to which device's sequences, so the sequences shard
# by shard_map: the op runs on each device's arrays, its page indices local.
DEVICE_BATCHES = [  # 22 tokens each, padding included
  Batch(q_lens=(1, 5, 12, 0, 1)),
  Batch(q_lens=(3, 1, 1, 2, 7), kv_lens=(20, 1, 40, 2, 9), pad_tokens=8),
  Batch(q_lens=(0, 0, 6, 1, 1), kv_lens=(0, 4, 6, 13, 33), pad_tokens=14),
  Batch(q_lens=(1, 1, 1, 1, 1), kv_lens=(1, 2, 40, 17, 8), pad_tokens=17),
]


def test_shard_map_gives_each_device_its_own_sequences_and_pages():
  mesh = jax.make_mesh((4,), ("data",), devices=sharding_devices(4))
  per_device = [inputs(b, seed=i) for i, b in enumerate(DEVICE_BATCHES)]
  pools = P(None, "data")
  specs = (P("data"), pools, pools, P("data"), P("data"), P("data"), P("data"))
  args = (
    jax.device_put(jnp.concatenate(parts, axis=len(spec) - 1), NamedSharding(mesh, spec))
    for parts, spec in zip(zip(*per_device), specs)  # the pools' pages: axis 1
  )

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=P("data"))
  def serve(*local):
    return pallax.ragged_paged_attention(*local, **STATICS)

  out = jax.jit(serve)(*args)
  want = jnp.concatenate([reference(*args, **STATICS) for args in per_device])
  assert_close(out, want, jnp.float32, "per-device batches")
