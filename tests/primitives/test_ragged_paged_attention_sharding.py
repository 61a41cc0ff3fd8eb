"""ragged_paged_attention on several devices: kv heads (with their query heads) shard.

Runs on 8 fake CPU devices (tests/conftest.py). Query heads and the pools'
kv heads shard; tokens, the page table and the offsets are replicated (a
sequence's tokens and pages stay together). No all-gather in the compiled
HLO, the output keeps the query's sharding, and the results equal the
float64 reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import assert_close, mesh_4x2
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
