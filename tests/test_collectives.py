"""Per-shard programs with collectives (``pallax.op.collectives``), on a toy attention op.

The toy op is ``softmax(q k^T / sqrt(d)) v`` per batch entry, declared through
``pallax.custom_op`` with a forward, a tangent and a backward stage. Its key
axis ``k`` cannot be split by its kernel (the softmax normalises over it), so
each stage gives two programs for a sharded ``k``: a ring that rotates the
K/V blocks with ``ppermute`` and merges the partial results by log-sum-exp,
and an all-gather of K/V. The tangent and backward stages' programs are JAX's
JVP and VJP of the forward's (``Program.jvp``/``Program.vjp``): the backward
ring carries dK/dV around the inverse ring. The costs model the time a
program waits on the network: a collective's start-up (``LATENCY_BYTES``)
per collective, plus the bytes it moves that compute does not hide (the
ring overlaps each transfer with the previous block's product). So small K/V
blocks are gathered (one start-up) and large ones go round the ring.

Runs on 8 fake CPU devices (tests/conftest.py); everything is compared with
a float64 numpy reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from pallax.op import Dims, Program, Shards, explain_programs
from pallax.op.collectives import choose, recording
from pallax.op.sharding import run_in_shard_map
from tests.helpers import assert_close, mesh_4x2, rand

# What one collective's start-up costs, in bytes of transfer.
LATENCY_BYTES = 1024


def _block(q, k, v):
  """One block's attention output and the log-sum-exp of its scores."""
  s = jnp.einsum("...qd,...kd->...qk", q, k) * q.shape[-1] ** -0.5
  lse = jax.nn.logsumexp(s, axis=-1)
  return jnp.einsum("...qk,...ke->...qe", jnp.exp(s - lse[..., None]), v), lse


def _reference(q, k, v):
  return _block(q, k, v)[0]


def _ring(shards, q, k, v):
  """Each device's queries against every K/V block, the blocks passed round a ``ppermute`` ring."""
  axes, n = shards.axes("k"), shards.size("k")
  ring = [(i, (i + 1) % n) for i in range(n)]
  out, lse = _block(q, k, v)
  for _ in range(n - 1):
    k, v = lax.ppermute((k, v), axes, ring)
    o, s = _block(q, k, v)
    merged = jnp.logaddexp(lse, s)
    out = out * jnp.exp(lse - merged)[..., None] + o * jnp.exp(s - merged)[..., None]
    lse = merged
  return [out]


def _gather(shards, q, k, v):
  """Each device's queries against the whole K/V, gathered from the devices holding its blocks."""
  axes = shards.axes("k")
  k, v = (lax.all_gather(x, axes, axis=x.ndim - 2, tiled=True) for x in (k, v))
  return [_reference(q, k, v)]


def _kv_bytes(k, v) -> int:
  return k.size * k.dtype.itemsize + v.size * v.dtype.itemsize


def _ring_cost(shards, q, k, v, *rest) -> float:
  """n - 1 ``ppermute`` start-ups; each transfer overlaps a block's product."""
  return (shards.size("k") - 1) * LATENCY_BYTES


def _gather_cost(shards, q, k, v, *rest) -> float:
  """One ``all_gather`` start-up, and the n - 1 blocks it brings in before any product starts."""
  return LATENCY_BYTES + (shards.size("k") - 1) * _kv_bytes(k, v)


def _programs(derive=lambda p: p) -> tuple[Program, ...]:
  return (
    derive(Program("ring", ("k",), _ring, _ring_cost, shares_axes=True)),
    derive(Program("all_gather", ("k",), _gather, _gather_cost, shares_axes=True)),
  )


QKV = (("b", "q", "d"), ("b", "k", "d"), ("b", "k", "e"))
OUT = ("b", "q", "e")


def _tangent(q, k, v, dq, dk, dv):
  return jax.jvp(_reference, (q, k, v), (dq, dk, dv))[1]


def _bwd(q, k, v, ct):
  return jax.vjp(_reference, q, k, v)[1](ct)


FWD_DIMS = Dims(QKV, (OUT,), replicated=("d",), programs=_programs())

toy_attention = pallax.custom_op(
  "toy_ring_attention",
  reference=_reference,
  dims=FWD_DIMS,
  jvp=pallax.ResidualJVP(
    tangent=pallax.KernelStage(
      _tangent,
      dims=Dims(QKV * 2, (OUT,), replicated=("d",), programs=_programs(lambda p: p.jvp(3))),
    ),
    bwd=pallax.KernelStage(
      _bwd,
      dims=Dims(QKV + (OUT,), QKV, replicated=("d",), programs=_programs(lambda p: p.vjp(3))),
    ),
  ),
)


def reference64(q, k, v) -> np.ndarray:
  """softmax(q k^T / sqrt(d)) v in float64 numpy."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("...qk,...ke->...qe", p / p.sum(-1, keepdims=True), v)


def grads64(q, k, v, ct) -> tuple[np.ndarray, ...]:
  """d(sum(attention(q, k, v) * ct)) / d(q, k, v), in float64 numpy."""
  q, k, v, ct = (np.asarray(x, np.float64) for x in (q, k, v, ct))
  scale = 1 / np.sqrt(q.shape[-1])
  s = np.einsum("...qd,...kd->...qk", q, k) * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dv = np.einsum("...qk,...qe->...ke", p, ct)
  dp = np.einsum("...qe,...ke->...qk", ct, v)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
  return np.einsum("...qk,...kd->...qd", ds, k), np.einsum("...qk,...qd->...kd", ds, q), dv


def jvp64(q, k, v, dq, dk, dv) -> np.ndarray:
  """The tangent of attention(q, k, v) along (dq, dk, dv), in float64 numpy."""
  q, k, v, dq, dk, dv = (np.asarray(x, np.float64) for x in (q, k, v, dq, dk, dv))
  scale = 1 / np.sqrt(q.shape[-1])
  s = np.einsum("...qd,...kd->...qk", q, k) * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ds = (np.einsum("...qd,...kd->...qk", dq, k) + np.einsum("...qd,...kd->...qk", q, dk)) * scale
  dp = p * (ds - (p * ds).sum(-1, keepdims=True))
  return np.einsum("...qk,...ke->...qe", dp, v) + np.einsum("...qk,...ke->...qe", p, dv)


def _data(batch=2, queries=16, keys=64, d=8, e=8, seed=0):
  """q, k, v, a cotangent of the output and tangents of q, k, v."""
  rng = np.random.default_rng(seed)
  shapes = [(batch, queries, d), (batch, keys, d), (batch, keys, e), (batch, queries, e)]
  shapes += shapes[:3]
  return [rand(rng, s) for s in shapes]


def _put(mesh, arrays, specs):
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def _compile(fn, *args):
  """``fn`` compiled for ``args``, and the (op, program) of each partitioned call that chose one."""
  with recording() as record:
    compiled = jax.jit(fn).lower(*args).compile()
  return compiled, [(c.op, c.program) for c in record]


def _loss(q, k, v, ct):
  return jnp.sum(toy_attention(q, k, v) * ct)


# name: (q and output spec, k and v spec) on the (4, 2) mesh ("a", "b"). The
# 64 keys are split in blocks of 16 or 8: 2 or 1 KiB of K/V per device, so the
# ring costs less than the gather (LATENCY_BYTES).
RING_SPECS = {
  "queries-and-keys-on-one-axis": (P(None, "a"), P(None, "a")),
  "keys-on-both-axes": (P(), P(None, ("a", "b"))),
  "batch-and-sequence": (P("b", "a"), P("b", "a")),
}


@pytest.mark.parametrize(
  "name, axis_type",
  [(name, AxisType.Auto) for name in RING_SPECS]
  + [("queries-and-keys-on-one-axis", AxisType.Explicit)],
  ids=str,
)
def test_jit_runs_the_ring(name, axis_type):
  mesh = mesh_4x2(axis_type)
  q_spec, kv_spec = RING_SPECS[name]
  q, k, v = _data()[:3]
  args = _put(mesh, (q, k, v), (q_spec, kv_spec, kv_spec))
  f, programs = _compile(toy_attention, *args)
  out, hlo = f(*args), f.as_text()
  assert "collective-permute" in hlo and "all-gather" not in hlo, name
  assert out.sharding.is_equivalent_to(args[0].sharding, out.ndim), out.sharding
  assert_close(out, reference64(q, k, v), jnp.float32, name)
  assert programs == [("toy_ring_attention_fwd", "ring")]


def test_grad_runs_the_ring_backwards():
  mesh = mesh_4x2()
  q, k, v, ct = _data(seed=1)[:4]
  spec = P("b", "a")
  args = _put(mesh, (q, k, v, ct), (spec,) * 4)
  grad, programs = _compile(jax.grad(_loss, (0, 1, 2)), *args)
  grads, hlo = grad(*args), grad.as_text()
  assert "collective-permute" in hlo and "all-gather" not in hlo
  for g, a, want, what in zip(grads, args, grads64(q, k, v, ct), ("dq", "dk", "dv")):
    assert g.sharding.is_equivalent_to(a.sharding, g.ndim), (what, g.sharding)
    assert_close(g, want, jnp.float32, what)
  assert programs == [("toy_ring_attention_bwd", "ring")]


def test_jvp_runs_the_ring():
  mesh = mesh_4x2()
  q, k, v, _, dq, dk, dv = _data(seed=2)
  args = _put(mesh, (q, k, v, dq, dk, dv), (P(None, "a"),) * 6)
  jvp = lambda q, k, v, dq, dk, dv: jax.jvp(toy_attention, (q, k, v), (dq, dk, dv))
  compiled, programs = _compile(jvp, *args)
  out, tangent = compiled(*args)
  assert_close(out, reference64(q, k, v), jnp.float32, "primal")
  assert_close(tangent, jvp64(q, k, v, dq, dk, dv), jnp.float32, "tangent")
  assert programs == [
    ("toy_ring_attention_fwd", "ring"),
    ("toy_ring_attention_jvp", "ring"),
  ]


# name: (in_axes, the operands' specs): the keys (dim 2 of a mapped operand)
# on the ring in each.
VMAP_CASES = {
  "all-mapped": ((0, 0, 0), (P(None, None, "a"),) * 3),
  "queries-mapped": ((0, None, None), (P(None, None, "a"), P(None, "a"), P(None, "a"))),
  "keys-mapped-at-1": ((None, 1, 1), (P(None, "a"), P(None, None, "a"), P(None, None, "a"))),
}


@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_vmap_runs_one_ring(name):
  """vmap folds into the batch factor: one call, its keys still on the ring; vmap of grad too."""
  in_axes, specs = VMAP_CASES[name]
  q, k, v, ct = _data(seed=3)[:4]
  pairs = list(zip((q, k, v), in_axes))
  args = [x if axis is None else jnp.stack([x, 2 * x - 1], axis) for x, axis in pairs]
  placed = _put(mesh_4x2(), args, specs)
  pick = lambda i: [x if axis is None else jnp.take(x, i, axis) for x, axis in zip(args, in_axes)]
  examples = [pick(0), pick(1)]
  cts = jnp.stack([ct, -ct])
  mapped = jax.vmap(toy_attention, in_axes=in_axes)
  mapped_grad = jax.vmap(jax.grad(_loss, (0, 1, 2)), in_axes=(*in_axes, 0))
  (f, programs), (grad, grad_programs) = (
    _compile(mapped, *placed),
    _compile(mapped_grad, *placed, cts),
  )
  got, grads = f(*placed), grad(*placed, cts)
  for i, example in enumerate(examples):
    assert_close(got[i], reference64(*example), jnp.float32, f"{name}: out[{i}]")
    for g, want, what in zip(grads, grads64(*example, cts[i]), ("dq", "dk", "dv")):
      assert_close(g[i], want, jnp.float32, f"{name}: {what}[{i}]")
  assert programs == [("toy_ring_attention_fwd", "ring")]
  assert grad_programs == [("toy_ring_attention_bwd", "ring")]


@pytest.mark.parametrize("keys, program", [(16, "all_gather"), (64, "ring")])
def test_cost_picks_the_program(keys, program, caplog):
  """Blocks of 4 keys (512 bytes of K/V) are gathered; blocks of 16 (2 KiB) go round the ring."""
  mesh = mesh_4x2()
  q, k, v, ct = _data(keys=keys, seed=4)[:4]
  args = _put(mesh, (q, k, v, ct), (P(None, "a"),) * 4)
  block = 2 * keys // 4 * (8 + 8) * 4
  with caplog.at_level("DEBUG", logger="pallax.sharding"):
    (choice,) = explain_programs(toy_attention, *args[:3])
  assert choice.program == program and choice.sharded == {"k": ("a",)}
  assert choice.costs == {"ring": 3 * LATENCY_BYTES, "all_gather": LATENCY_BYTES + 3 * block}
  assert f"program {program} (cost" in choice.reason
  assert str(choice) in caplog.messages
  f, grad = _compile(toy_attention, *args[:3])[0], _compile(jax.grad(_loss, (0, 1, 2)), *args)[0]
  hlo = f.as_text()
  assert ("collective-permute" in hlo) == (program == "ring")
  assert ("all-gather" in hlo) == (program == "all_gather")
  assert_close(f(*args[:3]), reference64(q, k, v), jnp.float32, program)
  for g, want, what in zip(grad(*args), grads64(q, k, v, ct), ("dq", "dk", "dv")):
    assert_close(g, want, jnp.float32, f"{program}: {what}")


def test_shard_map_of_the_op_over_batch():
  """Inside shard_map the op sees its local blocks: a batch split over every device."""
  mesh = mesh_4x2()
  q, k, v, ct = _data(batch=8, seed=5)[:4]
  spec = P(("a", "b"))
  f = jax.shard_map(toy_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  loss = lambda q, k, v: jnp.sum(f(q, k, v) * ct)
  assert_close(jax.jit(f)(q, k, v), reference64(q, k, v), jnp.float32, "shard_map")
  for g, want, what in zip(
    jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v), grads64(q, k, v, ct), ("dq", "dk", "dv")
  ):
    assert_close(g, want, jnp.float32, f"shard_map {what}")


def _ring_in_shard_map(mesh):
  """The op's program run by hand in shard_map: queries and keys split over "a", batch over "b"."""
  spec = P("b", "a")
  body = lambda q, k, v: run_in_shard_map(
    "toy_ring_attention", FWD_DIMS, {"q": "a", "k": "a"}, q, k, v
  )[0]
  return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def test_shard_map_runs_the_program_by_hand():
  """grad, jvp and vmap of the shard_map go through ppermute by JAX's own rules."""
  mesh = mesh_4x2()
  q, k, v, ct, dq, dk, dv = _data(seed=6)
  ring = _ring_in_shard_map(mesh)
  f = _compile(ring, q, k, v)[0]
  hlo = f.as_text()
  assert "collective-permute" in hlo and "all-gather" not in hlo
  assert_close(f(q, k, v), reference64(q, k, v), jnp.float32, "forward")
  loss = lambda q, k, v: jnp.sum(ring(q, k, v) * ct)
  for g, want, what in zip(
    jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v), grads64(q, k, v, ct), ("dq", "dk", "dv")
  ):
    assert_close(g, want, jnp.float32, f"grad {what}")
  _, tangent = jax.jit(lambda *a: jax.jvp(ring, a[:3], a[3:]))(q, k, v, dq, dk, dv)
  assert_close(tangent, jvp64(q, k, v, dq, dk, dv), jnp.float32, "jvp")
  stacked = [jnp.stack([x, 1 - x]) for x in (q, k, v)]
  got = jax.jit(jax.vmap(ring))(*stacked)
  for i in range(2):
    assert_close(got[i], reference64(*(x[i] for x in stacked)), jnp.float32, f"vmap [{i}]")


def test_run_in_shard_map_needs_manual_axes():
  mesh = mesh_4x2()
  q, k, v = _data()[:3]
  body = lambda q, k, v: run_in_shard_map("toy", FWD_DIMS, {"k": "b"}, q, k, v)[0]
  spec = P(None, "a")
  f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, axis_names={"a"})
  with pytest.raises(ValueError, match=r"toy: factor k is split over \('b',\), which are not"):
    jax.jit(f)(q, k, v)


def test_factors_no_program_computes_together_raise():
  rows = Program("rows", ("m",), lambda shards, x: [x])
  cols = Program("cols", ("n",), lambda shards, x: [x])
  shards = Shards({"m": ("a",), "n": ("b",)}, [()], {"a": 4, "b": 2})
  x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"my_op: factors .*'m'.*'n'.* no per-shard program"):
    choose("my_op", (rows, cols), shards, [x])
  assert choose("my_op", (rows, cols), Shards({"n": ("b",)}, [()], {"b": 2}), [x]) is cols
  # A program without shares_axes does not compute a factor on another factor's axes.
  shared = Shards({"m": ("a",), "n": ("a",)}, [()], {"a": 4}, frozenset({"m", "n"}))
  with pytest.raises(ValueError, match="no per-shard program"):
    choose("my_op", (Program("rows_and_cols", ("m", "n"), rows.run),), shared, [x])


def test_matmul_and_cross_entropy_are_programs():
  """A sharded K sums partial products; a sharded vocabulary combines per-shard statistics."""
  mesh = mesh_4x2()
  rng = np.random.default_rng(7)
  a, b = rand(rng, (8, 32)), rand(rng, (32, 16))
  a_s, b_s = _put(mesh, (a, b), (P(None, "a"), P("a")))
  matmul = lambda a, b: pallax.matmul(a, b, activation="relu")
  assert _compile(matmul, a_s, b_s)[1] == [("matmul", "psum_partials")]
  x, w = rand(rng, (8, 16)), rand(rng, (16, 64))
  labels = jnp.asarray(rng.integers(0, 64, (8,)), jnp.int32)
  x_s, w_s, labels_s = _put(mesh, (x, w, labels), (P(), P(None, "b"), P()))
  loss = lambda x, w, labels: pallax.linear_cross_entropy(x, w, labels)
  runs = _compile(jax.grad(loss, (0, 1)), x_s, w_s, labels_s)[1]
  stages = {op for op, program in runs if program == "vocab_parallel"}
  assert stages == {"cross_entropy_fwd", "cross_entropy_bwd"}, runs
