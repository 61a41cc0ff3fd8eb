"""paged_attention on several devices: sharded jit and shard_map.

Runs on 8 fake CPU devices (tests/conftest.py). The batch (queries, lengths,
page table rows) and the kv heads (queries' heads with the pools' heads)
shard freely: no all-gather in the compiled HLO, the output keeps the
query's sharding, and the results equal the float64 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import assert_close, mesh_4x2, on_path
from tests.primitives.paged_attention_reference import Case, inputs, reference

# B=8 sequences, N=8 query heads, K=4 kv heads, H=32, pages of 4, 6 a sequence.
CASE = Case(n=8, k=4, page_size=4, pages_per_sequence=6, lengths=(0, 1, 3, 4, 5, 24, 17, 9))
STATICS = dict(logits_soft_cap=4.0)

# Specs of (q, pools, lengths and page table).
SPECS = {
  "batch-heads": (P("a", "b"), P("b"), P("a")),
  "batch-all-devices": (P(("a", "b")), P(), P(("a", "b"))),
  "heads": (P(None, "a"), P("a"), P()),
  "query-heads": (P(None, ("a", "b")), P(), P()),
  "heads-batch": (P("b", "a"), P("a"), P("b")),
}


def _put(mesh, args, spec_name):
  q_spec, pool_spec, batch_spec = SPECS[spec_name]
  specs = (q_spec, pool_spec, pool_spec, batch_spec, batch_spec)
  return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))


def _check(mesh, spec_name, path="xla", seed=0):
  args = inputs(CASE, seed=seed)
  sargs = _put(mesh, args, spec_name)
  f = jax.jit(lambda *a: pallax.paged_attention(*a, **STATICS))
  with on_path(path):
    compiled = f.lower(*sargs).compile()
  assert "all-gather" not in compiled.as_text(), f"{spec_name}: all-gather in the compiled HLO"
  out = compiled(*sargs)
  assert out.sharding.is_equivalent_to(sargs[0].sharding, out.ndim), out.sharding
  assert_close(out, reference(*args, **STATICS), jnp.float32, spec_name)


@pytest.mark.parametrize(
  "axis_type, spec_name",
  [(AxisType.Auto, name) for name in SPECS] + [(AxisType.Explicit, "batch-heads")],
  ids=str,
)
def test_sharded_jit_has_no_all_gather(axis_type, spec_name):
  _check(mesh_4x2(axis_type), spec_name)


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_sharded_jit_on_kernels(path):
  _check(mesh_4x2(), "batch-heads", path, seed=1)


def test_shard_map():
  mesh = mesh_4x2()
  args = inputs(CASE, seed=2)
  q_spec, pool_spec, batch_spec = SPECS["batch-heads"]
  in_specs = (q_spec, pool_spec, pool_spec, batch_spec, batch_spec)
  f = jax.shard_map(
    lambda *a: pallax.paged_attention(*a, **STATICS),
    mesh=mesh,
    in_specs=in_specs,
    out_specs=q_spec,
  )
  out = jax.jit(f)(*args)
  assert_close(out, reference(*args, **STATICS), jnp.float32, "shard_map")
  np.testing.assert_array_equal(np.asarray(out)[0], 0.0)  # length 0
