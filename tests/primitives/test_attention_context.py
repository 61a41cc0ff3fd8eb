"""Context parallelism: dot_product_attention with a sharded sequence dim.

Runs on 8 fake CPU devices (tests/conftest.py). A query or key sequence
sharded under ``jit`` (or split over ``shard_map`` axes named by
``sequence_axis``) runs the ring or the all-gather program
(``kernels/attention/context.py``); the results, gradients and tangents
must equal the unsharded call, which the other attention tests hold to a
float64 reference (and ``test_unsharded_matches_float64`` here checks again
for the features exercised). Layouts (zigzag, striped) permute the tokens;
masks follow the true positions. The compiled HLO shows which program ran:
``collective-permute`` and no ``all-gather`` for the ring, the K/V gathers
for the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from pallax.kernels.attention import context
from pallax.op import explain_programs
from tests.helpers import (
  as64,
  assert_close,
  deviceless_mesh,
  mesh_4x2,
  rand,
  sharding_devices,
  x64,
)
from tests.primitives.attention_reference import reference

B, N, K, H = 2, 4, 2, 8
LAYOUTS = {
  "contiguous": lambda n: None,
  "zigzag": lambda n: pallax.SequenceLayout("zigzag", n),
  "striped": lambda n: pallax.SequenceLayout("striped", n),
}


def _mesh8():
  return jax.sharding.Mesh(np.array(sharding_devices()), ("sp",), axis_types=(AxisType.Auto,))


@pytest.fixture
def program(request, monkeypatch):
  """Forces the ring or the all-gather program by the cost of a collective's start-up."""
  monkeypatch.setattr(context, "LATENCY_BYTES", 1 if request.param == "ring" else 10**12)
  return request.param


def _inputs(seed: int, t: int, s: int, features: tuple[str, ...]):
  """q, k, v and the keyword arguments of ``features``, drawn at random."""
  rng = np.random.default_rng(seed)
  q, k, v = rand(rng, (B, t, N, H)), rand(rng, (B, s, K, H)), rand(rng, (B, s, K, H))
  kw = {}
  if "causal" in features:
    kw["is_causal"] = True
  if "window" in features:
    kw["local_window_size"] = (9, 4)
  if "lengths" in features:
    kw["query_seq_lengths"] = jnp.array([t, t // 2 + 3], jnp.int32)
    kw["key_value_seq_lengths"] = jnp.array([s - 5, s // 3], jnp.int32)
  if "segments" in features:
    kw["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (B, t)), axis=1), jnp.int32)
    kw["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (B, s)), axis=1), jnp.int32)
  if "soft_cap" in features:
    kw["logits_soft_cap"] = 2.0
  if "sinks" in features:
    kw["sinks"] = rand(rng, (N,))
  if "bias" in features:
    kw["bias"] = rand(rng, (B, N, t, s))
  return (q, k, v), kw


def _everything(layout, kw):
  """``(q, k, v, bias, sinks) -> (out, lse, grads, jvp)`` of one attention call.

  ``grads``: along every floating operand, then (with a bias) along q, k, v alone.
  """
  differentiable = [name for name in ("bias", "sinks") if name in kw]
  fixed = {n: x for n, x in kw.items() if n not in differentiable}

  def f(q, k, v, *extra):
    return pallax.dot_product_attention(
      q,
      k,
      v,
      **fixed,
      **dict(zip(differentiable, extra)),
      sequence_layout=layout,
      return_residual=True,
    )

  def run(q, k, v, *extra):
    out, lse = f(q, k, v, *extra)
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)[0]))
    grads = jax.grad(loss, tuple(range(3 + len(extra))))(q, k, v, *extra)
    if "bias" in kw:  # along q, k, v alone too: a constant bias, no gradient of it computed
      grads += jax.grad(lambda q, k, v: loss(q, k, v, *extra), (0, 1, 2))(q, k, v)
    tangent = jax.jvp(lambda q, k, v: f(q, k, v, *extra)[0], (q, k, v), (0.3 * q, -k, v))[1]
    return out, lse, grads, tangent

  return run, [kw[n] for n in differentiable]


def _compare(got, want, what: str):
  out, lse, grads, tangent = got
  w_out, w_lse, w_grads, w_tangent = want
  assert_close(out, w_out, jnp.float32, f"{what}: out")
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(w_lse), f"{what}: empty rows")
  finite = np.isfinite(np.asarray(w_lse))
  assert_close(np.asarray(lse)[finite], np.asarray(w_lse)[finite], jnp.float32, f"{what}: lse")
  for i, (g, w) in enumerate(zip(grads, w_grads)):
    assert_close(g, w, jnp.float32, f"{what}: grad {i}")
  assert_close(tangent, w_tangent, jnp.float32, f"{what}: jvp")


def _check(mesh, q_spec, kv_spec, layout_name, features, *, t=64, s=64, seed=0, extra_spec=None):
  """The sharded call (compiled once) equals the unsharded one; returns the compiled HLO."""
  (q, k, v), kw = _inputs(seed, t, s, features)
  seq_axes = q_spec[1] if len(q_spec) > 1 else None
  axes = (seq_axes,) if isinstance(seq_axes, str) else seq_axes or ()
  layout = LAYOUTS[layout_name](int(np.prod([mesh.shape[a] for a in axes])))
  run, extra = _everything(layout, kw)
  want = jax.jit(run)(q, k, v, *extra)
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  bias_spec = extra_spec or P(None, None, seq_axes)
  specs = [bias_spec if x.ndim == 4 else P() for x in extra]
  args = [put(q, q_spec), put(k, kv_spec), put(v, kv_spec)]
  args += [put(x, sp) for x, sp in zip(extra, specs)]
  compiled = jax.jit(run).lower(*args).compile()
  _compare(compiled(*args), want, f"{layout_name} {features}")
  return compiled.as_text()


SEQ = P(None, "sp")
# The all-gather's variant of the larger cases runs under -m slow (CI budget);
# the default suite runs it on the causal layouts, T != S and one-sided shardings.
GATHER_SLOW = pytest.param("all_gather", marks=pytest.mark.slow)
FEATURES = {
  "causal": ("causal",),
  "everything": ("causal", "window", "lengths", "segments", "soft_cap", "sinks", "bias"),
}


@pytest.mark.parametrize("program", ["ring", "all_gather"], indirect=True)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_causal_equals_unsharded(program, layout_name):
  hlo = _check(_mesh8(), SEQ, SEQ, layout_name, FEATURES["causal"])
  if program == "ring":
    assert "collective-permute" in hlo and "all-gather" not in hlo
  else:
    assert "all-gather" in hlo


@pytest.mark.parametrize("program", ["ring", GATHER_SLOW], indirect=True)
def test_every_feature_equals_unsharded(program):
  _check(_mesh8(), SEQ, SEQ, "zigzag", FEATURES["everything"], seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("program", ["ring", "all_gather"], indirect=True)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize(
  "features",
  [
    (),
    ("window",),
    ("causal", "window"),
    ("causal", "lengths"),
    ("causal", "segments"),
    ("soft_cap", "sinks"),
    ("causal", "bias"),
  ],
  ids=lambda f: "-".join(f) or "plain",
)
def test_feature_sweep(program, layout_name, features):
  _check(_mesh8(), SEQ, SEQ, layout_name, features, seed=2)


@pytest.mark.parametrize("program", ["ring", GATHER_SLOW], indirect=True)
def test_data_and_sequence_mesh(program):
  """Batch on one axis, the sequence on the other (4x2 and 2x4 meshes: rings of 4)."""
  mesh = mesh_4x2()
  _check(mesh, P("b", "a"), P("b", "a"), "zigzag", ("causal", "lengths"), seed=3)
  mesh24 = jax.sharding.Mesh(
    np.array(sharding_devices()).reshape(2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2
  )
  _check(mesh24, P("a", "b"), P("a", "b"), "striped", ("causal", "window"), seed=4)


def test_sequence_and_heads_on_two_axes():
  mesh = mesh_4x2()
  qkv = P(None, "a", "b")
  _check(mesh, qkv, qkv, "contiguous", ("causal", "sinks"), seed=5)


@pytest.mark.parametrize(
  "program", [pytest.param("ring", marks=pytest.mark.slow), "all_gather"], indirect=True
)
def test_queries_and_keys_of_other_lengths(program):
  """T != S: cross attention, and top-left causal with more keys than queries."""
  _check(_mesh8(), SEQ, SEQ, "contiguous", (), t=32, s=64, seed=6)
  _check(_mesh8(), SEQ, SEQ, "contiguous", ("causal", "lengths"), t=32, s=64, seed=7)


def test_only_queries_or_only_keys_sharded():
  _check(_mesh8(), SEQ, P(), "contiguous", ("causal", "window"), seed=8)
  _check(_mesh8(), P(), SEQ, "contiguous", ("causal", "sinks"), seed=9)


def test_sequences_on_overlapping_axes():
  """Queries over ("a", "b") and keys over "a" (and the reverse): the all-gather's reductions."""
  mesh = mesh_4x2()
  _check(mesh, P(None, ("a", "b")), P(None, "a"), "contiguous", ("causal", "sinks"), seed=15)
  _check(mesh, P(None, "a"), P(None, ("a", "b")), "contiguous", ("causal",), seed=16)


def test_vmap_of_the_sharded_call_and_of_its_grad():
  mesh = _mesh8()
  rng = np.random.default_rng(10)
  q, k, v = rand(rng, (3, B, 64, N, H)), rand(rng, (3, B, 64, K, H)), rand(rng, (3, B, 64, K, H))
  layout = pallax.SequenceLayout("zigzag", 8)
  f = lambda q, k, v: pallax.dot_product_attention(q, k, v, is_causal=True, sequence_layout=layout)
  g = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, None, "sp")))
  for fn in (f, g):
    got = jax.jit(jax.vmap(fn))(*map(put, (q, k, v)))
    want = [fn(q[i], k[i], v[i]) for i in range(3)]
    want = jax.tree.map(lambda *xs: jnp.stack(xs), *want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_close(a, b, jnp.float32, "vmap")


def test_shard_map_with_sequence_axis():
  """Local blocks of a striped sequence; the bias holds the device's query rows and every key."""
  mesh = _mesh8()
  (q, k, v), kw = _inputs(11, 64, 64, ("causal", "lengths", "sinks", "bias"))
  layout = pallax.SequenceLayout("striped", 8)
  lengths = {n: kw[n] for n in ("query_seq_lengths", "key_value_seq_lengths")}

  def attention(q, k, v, sinks, bias, **extra):
    return pallax.dot_product_attention(
      q, k, v, bias, is_causal=True, sinks=sinks, sequence_layout=layout, **lengths, **extra
    )

  local = functools.partial(attention, sequence_axis="sp")
  in_specs = (SEQ, SEQ, SEQ, P(), P(None, None, "sp"))
  sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=SEQ)
  grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2, 3, 4))
  args = (q, k, v, kw["sinks"], kw["bias"])
  for fn in (lambda f: f, grad):
    got = jax.jit(fn(sharded))(*args)
    want = fn(attention)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert_close(a, b, jnp.float32, "shard_map")


def test_unsharded_layout_matches_float64():
  """A zigzag-ordered sequence on one device: masks follow the true positions."""
  (q, k, v), kw = _inputs(12, 32, 32, ("causal", "window", "segments"))
  layout = pallax.SequenceLayout("zigzag", 4)
  lay = functools.partial(pallax.context_parallel, layout)
  segs = lay(kw["q_segment_ids"], kw["kv_segment_ids"])
  got = pallax.dot_product_attention(
    *lay(q, k, v),
    is_causal=True,
    local_window_size=(9, 4),
    q_segment_ids=segs[0],
    kv_segment_ids=segs[1],
    sequence_layout=layout,
  )
  (got,) = lay(got, inverse=True)
  with x64():
    want = reference(
      *as64(q, k, v),
      is_causal=True,
      local_window_size=(9, 4),
      q_segment_ids=kw["q_segment_ids"],
      kv_segment_ids=kw["kv_segment_ids"],
    )
  assert_close(got, want, jnp.float32, "zigzag on one device")


def test_explain_picks_by_bytes(monkeypatch):
  """Small K/V blocks are gathered (one start-up); large ones go round the ring.

  And where the gathered K/V would pass the memory limit, the ring runs.
  """
  mesh = _mesh8()
  f = lambda q, k, v: pallax.dot_product_attention(q, k, v, is_causal=True)
  sh = NamedSharding(mesh, SEQ)
  cases = [
    (64, "all_gather", context.GATHER_LIMIT_BYTES),
    (8192, "ring", context.GATHER_LIMIT_BYTES),
  ]
  cases.append((64, "ring", 4096))
  for s, want, limit in cases:
    monkeypatch.setattr(context, "GATHER_LIMIT_BYTES", limit)
    structs = [
      jax.ShapeDtypeStruct((1, s, heads, 64), jnp.bfloat16, sharding=sh) for heads in (N, K, K)
    ]
    choices = explain_programs(f, *structs)
    assert [c.program for c in choices] == [want], choices
    assert "t over ('sp',)" in str(choices[0])


def test_differentiable_lse_composes_a_ring_by_hand():
  """Merging two halves by their lse gives attention's gradient only with the true lse gradient."""
  rng = np.random.default_rng(13)
  q, k, v = rand(rng, (B, 16, N, H)), rand(rng, (B, 32, K, H)), rand(rng, (B, 32, K, H))

  def merged(q, k, v, mode):
    parts = [
      pallax.dot_product_attention(q, k[:, i : i + 16], v[:, i : i + 16], return_residual=mode)
      for i in (0, 16)
    ]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    return sum(o * jnp.exp(part_lse - lse)[..., None] for o, part_lse in parts)

  loss = lambda mode: lambda *a: jnp.sum(jnp.sin(merged(*a, mode)))
  whole = jax.grad(lambda *a: jnp.sum(jnp.sin(pallax.dot_product_attention(*a))), (0, 1, 2))
  want = whole(q, k, v)
  got = jax.grad(loss("differentiable"), (0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    assert_close(a, b, jnp.float32, "differentiable lse")
  stopped = jax.grad(loss(True), (0, 1, 2))(q, k, v)
  assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(stopped, want)) > 1e-2


def test_sequence_layout_permutations():
  layout = pallax.SequenceLayout("zigzag", 2)
  np.testing.assert_array_equal(layout.order(8), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(pallax.SequenceLayout("striped", 2).order(6), [0, 2, 4, 1, 3, 5])
  x = jnp.arange(24).reshape(2, 12)
  for kind in ("contiguous", "zigzag", "striped"):
    lay = pallax.SequenceLayout(kind, 3)
    (y,) = pallax.context_parallel(lay, x)
    np.testing.assert_array_equal(y[0], lay.order(12))
    np.testing.assert_array_equal(pallax.context_parallel(lay, y, inverse=True)[0], x)


def test_visible_blocks_even_out_causal_work():
  work = {
    kind: context.visible_blocks(pallax.SequenceLayout(kind, 8), 1024, 1024, right=0)
    for kind in ("contiguous", "zigzag", "striped")
  }
  assert work["contiguous"].max() / work["contiguous"].min() == 8
  assert work["zigzag"].max() == work["zigzag"].min()
  assert work["striped"].max() == work["striped"].min()


def test_bad_input():
  q = jnp.zeros((B, 12, N, H))
  with pytest.raises(TypeError, match="sequence_layout must be"):
    pallax.dot_product_attention(q, q, q, sequence_layout="zigzag")
  with pytest.raises(ValueError, match="divisible by 16"):
    pallax.dot_product_attention(q, q, q, sequence_layout=pallax.SequenceLayout("zigzag", 8))
  with pytest.raises(ValueError, match="return_residual must be"):
    pallax.dot_product_attention(q, q, q, return_residual="yes")
  with pytest.raises(ValueError, match="sequence_axis must name distinct manual axes"):
    pallax.dot_product_attention(q, q, q, sequence_axis="sp")
  with pytest.raises(ValueError, match="kind must be one of"):
    pallax.SequenceLayout("ring", 2)
  mesh = _mesh8()
  x = jax.device_put(jnp.zeros((B, 64, N, H)), NamedSharding(mesh, SEQ))
  layout = pallax.SequenceLayout("zigzag", 4)
  with pytest.raises(Exception, match="is for 4 shards but the query sequence is sharded over 8"):
    jax.jit(lambda x: pallax.dot_product_attention(x, x, x, sequence_layout=layout))(x)


def test_unsharded_matches_float64():
  """The reference these tests compare with, held to float64 for their features."""
  (q, k, v), kw = _inputs(14, 64, 64, FEATURES["everything"])
  got = pallax.dot_product_attention(q, k, v, **kw)
  with x64():
    kw64 = {n: as64(x)[0] if n in ("bias", "sinks") else x for n, x in kw.items()}
    want = reference(*as64(q, k, v), **kw64)
  assert_close(got, want, jnp.float32, "unsharded")


@pytest.mark.compilers
@pytest.mark.parametrize("target", ["v5e", "h100"])
def test_ring_compiles_for_tpu_and_h100_without_the_hardware(target, monkeypatch):
  """The ring's forward and backward in ``shard_map``, compiled for TPU v5e:2x2 and H100 x8.

  (Deviceless compiles take ``shard_map``: XLA has no emitter for a
  ``custom_partitioning`` call without devices.) The kernels are the
  target's (Mosaic TPU, Pallas-Triton); the K/V blocks travel by
  ``collective-permute`` and nothing is gathered.
  """
  monkeypatch.setattr(context, "LATENCY_BYTES", 1)
  mesh = deviceless_mesh(target, "sp")
  n = mesh.size
  layout = pallax.SequenceLayout("zigzag", n)

  def local(q, k, v):
    return pallax.dot_product_attention(
      q, k, v, is_causal=True, sequence_layout=layout, sequence_axis="sp"
    )

  ring = jax.shard_map(local, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
  loss = lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32))
  sharding = NamedSharding(mesh, SEQ)
  shapes = [(1, 256 * n, 8, 128), (1, 256 * n, 2, 128), (1, 256 * n, 2, 128)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
  hlo = jax.jit(jax.grad(loss, (0, 1, 2))).trace(*args).lower().compile().as_text()
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo
