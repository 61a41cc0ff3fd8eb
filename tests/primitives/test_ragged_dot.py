"""pallax.ragged_dot: the grouped matmul against a float64 per-group reference.

The reference multiplies each group's rows by its matrix in numpy-sized
slices (the group sizes are concrete there), so it shares nothing with the
sorted-tile program under test. Forward, both gradients, jvp, an HVP and
``grad`` of ``grad``; empty groups, single rows, a prime-sized group, one
group holding every row, rows past the groups' end, ``group_offset``;
vmap against a loop for every in_axes combination (one primitive each);
N sharded on 8 devices; clear errors.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import pallax
from pallax import RaggedDotConfig
from tests.helpers import (
  FLOAT_DTYPES,
  assert_close,
  loop_stack,
  mesh_4x2,
  on_path,
  rand,
  sharding_devices,
  to64,
  x64,
)

# (M, K, N, group sizes): empty groups, one row, a prime, all rows in one
# group, and rows past the groups' end (sum < M).
CASES = {
  "mixed": (97, 24, 16, (0, 1, 7, 0, 60, 29)),
  "one-group": (64, 16, 8, (0, 64, 0)),
  "rows-past-end": (80, 8, 12, (5, 0, 31)),
}


def reference(lhs, rhs, sizes, offset: int = 0):
  """Per group, its rows times its matrix; other rows zero (jnp, differentiable)."""
  rows, ends = [], np.cumsum(sizes)
  for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends)):
    start, end = min(start, lhs.shape[0]), min(end, lhs.shape[0])
    block = lhs[start:end]
    if offset <= g < offset + rhs.shape[0]:
      rows.append(block @ rhs[g - offset])
    else:
      rows.append(jnp.zeros((end - start, rhs.shape[2]), block.dtype))
  rest = lhs.shape[0] - min(ends[-1], lhs.shape[0])
  rows.append(jnp.zeros((rest, rhs.shape[2]), lhs.dtype))
  return jnp.concatenate(rows)


def _inputs(name, dtype, seed=0, cases=CASES):
  m, k, n, sizes = cases[name]
  rng = np.random.default_rng(seed)
  return rand(rng, (m, k), dtype), rand(rng, (len(sizes), k, n), dtype), np.asarray(sizes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_forward(name, dtype):
  lhs, rhs, sizes = _inputs(name, dtype)
  out = jax.jit(pallax.ragged_dot)(lhs, rhs, jnp.asarray(sizes))
  assert out.shape == (lhs.shape[0], rhs.shape[2]) and out.dtype == dtype
  with x64():
    want = reference(to64(lhs), to64(rhs), sizes)
  assert_close(out, want, dtype, f"{name} forward")
  past = min(sizes.sum(), lhs.shape[0])
  np.testing.assert_array_equal(np.asarray(out[past:], np.float32), 0.0)


def test_matches_lax_ragged_dot_and_preferred_type():
  lhs, rhs, sizes = _inputs("mixed", jnp.bfloat16)
  got = pallax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
  want = lax.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_group_offset_computes_this_devices_groups_only():
  lhs, rhs, sizes = _inputs("mixed", jnp.float32)
  local = rhs[2:5]  # groups 2, 3, 4 of 6
  out = pallax.ragged_dot(lhs, local, sizes, group_offset=jnp.array([2]))
  with x64():
    want = reference(to64(lhs), to64(local), sizes, offset=2)
  assert_close(out, want, jnp.float32, "group_offset")
  loss = lambda w: jnp.sum(pallax.ragged_dot(lhs, w, sizes, group_offset=jnp.array([2])) ** 2)
  with x64():
    want = jax.grad(lambda w: jnp.sum(reference(to64(lhs), w, sizes, offset=2) ** 2))(to64(local))
  assert_close(jax.grad(loss)(local), want, jnp.float32, "group_offset drhs")


def _loss(fn, sizes, lhs, rhs, cot):
  return jnp.sum(fn(lhs, rhs, sizes).astype(jnp.promote_types(lhs.dtype, jnp.float32)) * cot)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_grads_jvp_and_second_order(dtype):
  lhs, rhs, sizes = _inputs("mixed", dtype, seed=1)
  rng = np.random.default_rng(2)
  cot = rand(rng, (lhs.shape[0], rhs.shape[2]))
  tangents = (rand(rng, lhs.shape, dtype), rand(rng, rhs.shape, dtype))
  ours = functools.partial(_loss, pallax.ragged_dot, jnp.asarray(sizes))
  grads = jax.jit(jax.grad(ours, argnums=(0, 1)))(lhs, rhs, cot)
  f = lambda a, b: pallax.ragged_dot(a, b, jnp.asarray(sizes))
  _, y_dot = jax.jit(lambda a, b, da, db: jax.jvp(f, (a, b), (da, db)))(lhs, rhs, *tangents)
  with x64():
    theirs = functools.partial(_loss, lambda a, b, s: reference(a, b, sizes), sizes)
    args64 = (to64(lhs), to64(rhs), to64(cot))
    want = jax.grad(theirs, argnums=(0, 1))(*args64)
    g = lambda a, b: reference(a, b, sizes)
    _, y_dot_ref = jax.jvp(g, args64[:2], tuple(to64(t) for t in tangents))
  assert_close(grads[0], want[0], dtype, "dlhs")
  assert_close(grads[1], want[1], dtype, "drhs")
  assert_close(y_dot, y_dot_ref, dtype, "jvp")


def test_hvp_and_grad_of_grad_in_float32():
  """Second order: the transposes are grouped products themselves."""
  lhs, rhs, sizes = _inputs("mixed", jnp.float32, seed=3)
  rng = np.random.default_rng(4)
  v = (rand(rng, lhs.shape), rand(rng, rhs.shape))

  def loss(fn, a, b):
    return jnp.sum(jnp.tanh(fn(a, b)))

  ours = functools.partial(loss, lambda a, b: pallax.ragged_dot(a, b, jnp.asarray(sizes)))
  hvp = lambda f, x, t: jax.jvp(jax.grad(f, argnums=(0, 1)), x, t)[1]
  got = jax.jit(functools.partial(hvp, ours))((lhs, rhs), v)
  gg = jax.grad(lambda a: jnp.sum(jax.grad(ours, argnums=1)(a, rhs) ** 2))(lhs)
  with x64():
    theirs = functools.partial(loss, lambda a, b: reference(a, b, sizes))
    want = hvp(theirs, (to64(lhs), to64(rhs)), tuple(to64(t) for t in v))
    gg_want = jax.grad(lambda a: jnp.sum(jax.grad(theirs, argnums=1)(a, to64(rhs)) ** 2))(to64(lhs))
  assert_close(got[0], want[0], jnp.float32, "hvp lhs")
  assert_close(got[1], want[1], jnp.float32, "hvp rhs")
  assert_close(gg, gg_want, jnp.float32, "grad of grad")


def _count(jaxpr, names) -> int:
  """Equations of the named primitives, nested jaxprs included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name in names
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _count(sub, names)
  return n


# (lhs, rhs, group_sizes) in_axes: shared weights, shared sizes, per-example
# everything, a non-leading axis.
IN_AXES = [(0, None, None), (None, 0, None), (0, 0, None), (0, 0, 0), (None, None, 0), (1, 2, None)]


@pytest.mark.parametrize("in_axes", IN_AXES)
def test_vmap_is_one_primitive_and_matches_a_loop(in_axes):
  m, k, n, sizes = CASES["mixed"]
  rng = np.random.default_rng(5)
  size = 3

  def draw(shape, axis):
    x = rand(rng, (size, *shape))
    return x[0] if axis is None else jnp.moveaxis(x, 0, axis)

  lhs, rhs = draw((m, k), in_axes[0]), draw((len(sizes), k, n), in_axes[1])
  per = np.stack([np.random.default_rng(i).permutation(sizes) for i in range(size)])
  group_sizes = jnp.asarray(per if in_axes[2] is not None else sizes, jnp.int32)
  f = pallax.ragged_dot
  got = jax.jit(jax.vmap(f, in_axes=in_axes))(lhs, rhs, group_sizes)
  want = loop_stack(f, (lhs, rhs, group_sizes), in_axes, size)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(lhs, rhs, group_sizes).jaxpr
  assert _count(jaxpr, {"ragged_dot"}) == 1
  # And vmap of grad: per example, both gradients.
  loss = lambda a, b, s: jnp.sum(f(a, b, s) ** 2)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=in_axes))(lhs, rhs, group_sizes)
  want = loop_stack(jax.grad(loss, argnums=(0, 1)), (lhs, rhs, group_sizes), in_axes, size)
  for got_g, want_g in zip(grads, want):
    np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-4, atol=1e-4)


def test_sharded_n_needs_no_gather_and_sharded_k_is_summed():
  lhs, rhs, sizes = _inputs("mixed", jnp.float32)
  mesh = mesh_4x2()
  spec = jax.sharding.PartitionSpec(None, None, ("a", "b"))
  rhs_s = jax.device_put(rhs, jax.sharding.NamedSharding(mesh, spec))
  f = jax.jit(lambda a, b: pallax.ragged_dot(a, b, jnp.asarray(sizes)))
  out = f(lhs, rhs_s)
  np.testing.assert_allclose(np.asarray(out), np.asarray(f(lhs, rhs)), rtol=1e-6, atol=1e-6)
  assert out.sharding.spec[1] == ("a", "b")
  assert "all-gather" not in f.lower(lhs, rhs_s).compile().as_text()
  # A sharded K: per-device partial products, summed across devices.
  lhs_k = jax.device_put(
    lhs, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "b"))
  )
  rhs_k = jax.device_put(
    rhs, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "b"))
  )
  np.testing.assert_allclose(
    np.asarray(f(lhs_k, rhs_k)), np.asarray(f(lhs, rhs)), rtol=1e-5, atol=1e-5
  )
  assert "all-reduce" in f.lower(lhs_k, rhs_k).compile().as_text()


# (mesh, lhs spec, rhs spec): the experts (G) over 8 devices, the tokens (M)
# over 8, the tokens over one axis and the experts over the other, the
# experts over both axes of a 4x2 mesh, tokens and experts over the same 8.
EXPERT_SHARDINGS = {
  "experts-8": ("8", P(), P("e")),
  "tokens-8": ("8", P("e"), P()),
  "tokens-a-experts-b": ("4x2", P("a"), P("b")),
  "experts-ab": ("4x2", P(), P(("a", "b"))),
  "tokens-and-experts-8": ("8", P("e"), P("e")),
  "tokens-and-experts-ab": ("4x2", P(("a", "b")), P(("a", "b"))),
}


@pytest.mark.parametrize("name", EXPERT_SHARDINGS)
def test_expert_and_token_sharding_match_unsharded(name):
  """Expert parallelism: each device its experts' rows, no all-gather of the weights."""
  mesh_name, lhs_spec, rhs_spec = EXPERT_SHARDINGS[name]
  if mesh_name == "8":
    mesh = jax.make_mesh(
      (8,), ("e",), axis_types=(jax.sharding.AxisType.Auto,), devices=sharding_devices()
    )
  else:
    mesh = mesh_4x2()
  rng = np.random.default_rng(10)
  sizes = np.asarray([0, 1, 7, 0, 60, 29, 3, 4])  # 104 rows, 8 groups
  lhs, rhs = rand(rng, (112, 24)), rand(rng, (8, 24, 16))
  f = jax.jit(lambda a, b: pallax.ragged_dot(a, b, jnp.asarray(sizes)))
  grad = jax.jit(
    jax.grad(lambda a, b: jnp.sum(jnp.tanh(pallax.ragged_dot(a, b, jnp.asarray(sizes)))), (0, 1))
  )
  a = jax.device_put(lhs, jax.sharding.NamedSharding(mesh, lhs_spec))
  b = jax.device_put(rhs, jax.sharding.NamedSharding(mesh, rhs_spec))
  np.testing.assert_allclose(np.asarray(f(a, b)), np.asarray(f(lhs, rhs)), rtol=1e-6, atol=1e-6)
  for got, want in zip(grad(a, b), grad(lhs, rhs)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for fn in (f, grad):  # nothing gathered: tokens and experts alike travel by all-to-all
    hlo = fn.lower(a, b).compile().as_text()
    assert " all-gather(" not in hlo, name
    assert (" all-to-all(" in hlo) == (lhs_spec == rhs_spec), name
  if lhs_spec != rhs_spec:
    return
  # Tokens and experts on the same axes: the gated epilogue exchanges rows
  # too, and under vmap (a grid-batch axis) the rows are gathered instead.
  gated = jax.jit(lambda a, b: pallax.ragged_dot(a, b, sizes, activation="silu", gated=True))
  np.testing.assert_allclose(
    np.asarray(gated(a, b)), np.asarray(gated(lhs, rhs)), rtol=1e-6, atol=1e-6
  )
  stacked = jnp.stack([lhs, -lhs])
  batched = jax.device_put(stacked, jax.sharding.NamedSharding(mesh, P(None, *lhs_spec)))
  fv = jax.jit(jax.vmap(lambda a, b: pallax.ragged_dot(a, b, sizes), in_axes=(0, None)))
  np.testing.assert_allclose(
    np.asarray(fv(batched, b)), np.asarray(fv(stacked, rhs)), rtol=1e-6, atol=1e-6
  )


def test_tokens_and_experts_on_one_axis_with_a_group_offset():
  """Held groups 1..8 of 10, over the devices that also hold the tokens: the exchange's offsets."""
  mesh = jax.make_mesh(
    (8,), ("e",), axis_types=(jax.sharding.AxisType.Auto,), devices=sharding_devices()
  )
  rng = np.random.default_rng(14)
  sizes = jnp.asarray([9, 0, 1, 7, 0, 40, 29, 3, 4, 11])  # 104 of 112 rows
  offset = jnp.asarray([1])
  lhs, rhs = rand(rng, (112, 24)), rand(rng, (8, 24, 16))
  f = jax.jit(lambda a, b: pallax.ragged_dot(a, b, sizes, group_offset=offset))
  loss = lambda a, b: jnp.sum(jnp.tanh(f(a, b)))
  grad = jax.jit(jax.grad(loss, (0, 1)))
  a = jax.device_put(lhs, jax.sharding.NamedSharding(mesh, P("e")))
  b = jax.device_put(rhs, jax.sharding.NamedSharding(mesh, P("e")))
  with x64():
    want = np.asarray(jax.lax.ragged_dot(to64(lhs[9:102]), to64(rhs), jnp.asarray(sizes[1:9])))
  got = np.asarray(f(a, b))
  np.testing.assert_allclose(got[9:102], want, rtol=1e-5, atol=1e-5)
  assert not got[:9].any() and not got[102:].any()  # rows of groups 0 and 9, and past them
  for g, w in zip(grad(a, b), grad(lhs, rhs)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  ta, tb = rand(rng, lhs.shape), rand(rng, rhs.shape)
  jvp = jax.jit(lambda *x: jax.jvp(f, x[:2], x[2:])[1])
  np.testing.assert_allclose(
    np.asarray(jvp(a, b, ta, tb)), np.asarray(jvp(lhs, rhs, ta, tb)), rtol=1e-5, atol=1e-5
  )
  assert " all-to-all(" in f.lower(a, b).compile().as_text()


def test_bad_input_is_named():
  lhs, rhs, sizes = _inputs("mixed", jnp.float32)
  with pytest.raises(ValueError, match="lhs must be \\[M, K\\]"):
    pallax.ragged_dot(lhs[0], rhs, sizes)
  with pytest.raises(ValueError, match="one entry per group"):
    pallax.ragged_dot(lhs, rhs, sizes[:-1])
  with pytest.raises(TypeError, match="group_sizes must be an integer array"):
    pallax.ragged_dot(lhs, rhs, sizes.astype(np.float32))
  with pytest.raises(TypeError, match="lhs must have a floating dtype"):
    pallax.ragged_dot(lhs.astype(jnp.int32), rhs, sizes)
  with pytest.raises(ValueError, match="precision"):
    pallax.ragged_dot(lhs, rhs, sizes, precision="bogus")


# ------------------------------------------------------------------------------
# The kernels, interpreted: forward, both gradients (gmm and tgmm) and jvp.

KERNEL_PATHS = ("triton", "mosaic_tpu")
# The cases above, and one wide enough for K and N blocks of 128 (TPU) to
# overhang: K = 160 in a 128-deep step and a 32-deep tail, N = 136.
KERNEL_CASES = {**CASES, "wide": (50, 160, 136, (20, 0, 25))}
PINNED = {
  # Tiles of 32 rows over groups of 0, 1, 7, 0, 60 and 29 rows: tiles meeting
  # up to four groups (empty ones among them); K = 24 in two 16-deep steps,
  # the second half past K; N = 16 in one block, 12 in a block overhanging it.
  "triton": RaggedDotConfig(block_m=32, block_n=16, block_k=16),
  # 32-row tiles as above; blocks of 128 (whole K and N in the small cases).
  "mosaic_tpu": RaggedDotConfig(block_m=32, block_n=128, block_k=128),
}


def _kernel_report(path, config, *args):
  with on_path(path):
    report = pallax.explain(
      lambda a, b: jax.grad(
        lambda a, b: jnp.sum(pallax.ragged_dot(a, b, *args[2:], config=config)), argnums=(0, 1)
      )(a, b),
      *args[:2],
    )
  return [(s.op, s.implementation) for s in report]


# Each kernel on every case, each dtype at least once (a chosen covering: the
# wide case's tails on both kernels).
KERNEL_RUNS = [
  ("triton", "mixed", jnp.float32),
  ("triton", "rows-past-end", jnp.float16),
  ("triton", "wide", jnp.bfloat16),
  ("mosaic_tpu", "mixed", jnp.bfloat16),
  ("mosaic_tpu", "one-group", jnp.float32),
  ("mosaic_tpu", "wide", jnp.float32),
]


@pytest.mark.parametrize("run", KERNEL_RUNS, ids=lambda r: f"{r[0]}-{r[1]}-{jnp.dtype(r[2]).name}")
def test_kernel(run):
  path, name, dtype = run
  lhs, rhs, sizes = _inputs(name, dtype, seed=6, cases=KERNEL_CASES)
  config = PINNED[path] if name != "one-group" else None  # and the executor's own
  calls = _kernel_report(path, config, lhs, rhs, jnp.asarray(sizes))
  assert set(calls) == {("ragged_dot", "pallas"), ("ragged_dot_tgmm", "pallas")}, calls
  rng = np.random.default_rng(7)
  cot = rand(rng, (lhs.shape[0], rhs.shape[2]))
  tangents = (rand(rng, lhs.shape, dtype), rand(rng, rhs.shape, dtype))
  f = lambda a, b: pallax.ragged_dot(a, b, jnp.asarray(sizes), config=config)
  with on_path(path):
    out, y_dot = jax.jit(lambda a, b, da, db: jax.jvp(f, (a, b), (da, db)))(lhs, rhs, *tangents)
    grads = jax.jit(jax.grad(functools.partial(_loss, lambda a, b, s: f(a, b), None), (0, 1)))(
      lhs, rhs, cot
    )
  with x64():
    g = lambda a, b: reference(a, b, sizes)
    args64 = (to64(lhs), to64(rhs))
    want, y_dot_ref = jax.jvp(g, args64, tuple(to64(t) for t in tangents))
    want_grads = jax.grad(lambda a, b: jnp.sum(g(a, b) * to64(cot)), (0, 1))(*args64)
  assert_close(out, want, dtype, f"{name} {path} forward")
  assert_close(y_dot, y_dot_ref, dtype, f"{name} {path} jvp")
  assert_close(grads[0], want_grads[0], dtype, f"{name} {path} dlhs")
  assert_close(grads[1], want_grads[1], dtype, f"{name} {path} drhs")
  past = min(sizes.sum(), lhs.shape[0])
  np.testing.assert_array_equal(np.asarray(out[past:], np.float32), 0.0)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_group_offset_and_vmap(path):
  """A device's groups only (expert parallelism), and vmap: the grid grows, one kernel."""
  lhs, rhs, sizes = _inputs("mixed", jnp.float32, seed=8)
  local, offset = rhs[2:5], jnp.array([2])
  f = lambda a, b, s: pallax.ragged_dot(a, b, s, group_offset=offset, config=PINNED[path])
  loss = lambda a, b, s: jnp.sum(f(a, b, s) ** 2)
  rng = np.random.default_rng(9)
  lhs3, local3 = rand(rng, (3, *lhs.shape)), rand(rng, (3, *local.shape))
  per = jnp.asarray(np.stack([np.random.default_rng(i).permutation(sizes) for i in range(3)]))
  with on_path(path):
    out, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(lhs, local, jnp.asarray(sizes))
    vmapped = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(lhs3, local3, per)
  with x64():
    ref = lambda a, b, s: jnp.sum(reference(a, b, s, offset=2) ** 2)
    want, want_grads = jax.value_and_grad(ref, (0, 1))(to64(lhs), to64(local), sizes)
    want_v = [
      jax.grad(ref, (0, 1))(to64(lhs3[i]), to64(local3[i]), np.asarray(per[i])) for i in range(3)
    ]
  assert_close(out, want, jnp.float32, "group_offset loss")
  assert_close(grads[0], want_grads[0], jnp.float32, "group_offset dlhs")
  assert_close(grads[1], want_grads[1], jnp.float32, "group_offset drhs")
  for i in range(2):
    assert_close(vmapped[i], jnp.stack([w[i] for w in want_v]), jnp.float32, f"vmap grad {i}")


@pytest.mark.parametrize("path", ("xla",) + KERNEL_PATHS)
def test_held_groups_past_the_sizes_and_negative_sizes(path):
  """Offset 4 of 6 sizes holds groups 4, 5 and a 6th that does not exist (zeros, no
  out-of-bounds read); a negative size counts as 0; the sizes sum past M."""
  rng = np.random.default_rng(11)
  sizes = np.asarray([3, 10, -2, 12, 5, 15])  # 43 rows (the -2 an empty group) of 40
  lhs, local = rand(rng, (40, 24)), rand(rng, (3, 24, 16))
  config = None if path == "xla" else PINNED[path]
  f = lambda a, b: pallax.ragged_dot(a, b, sizes, group_offset=jnp.array([4]), config=config)
  cot = rand(rng, (40, 16))
  with on_path(path):
    out = jax.jit(f)(lhs, local)
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * cot), (0, 1)))(lhs, local)
  clipped = np.maximum(sizes, 0)
  with x64():
    g = lambda a, b: reference(a, b, clipped, offset=4)
    want = g(to64(lhs), to64(local))
    want_grads = jax.grad(lambda a, b: jnp.sum(g(a, b) * to64(cot)), (0, 1))(to64(lhs), to64(local))
  assert_close(out, want, jnp.float32, f"{path} forward")
  assert_close(grads[0], want_grads[0], jnp.float32, f"{path} dlhs")
  assert_close(grads[1], want_grads[1], jnp.float32, f"{path} drhs")
  np.testing.assert_array_equal(np.asarray(grads[1][2]), 0.0)  # the group that does not exist


def test_no_rows_or_no_groups():
  lhs, rhs = jnp.zeros((0, 8)), jnp.ones((3, 8, 5))
  out = pallax.ragged_dot(lhs, rhs, jnp.zeros(3, jnp.int32))
  assert out.shape == (0, 5)
  dlhs, drhs = jax.grad(
    lambda a, b: jnp.sum(pallax.ragged_dot(a, b, jnp.zeros(3, jnp.int32))), (0, 1)
  )(lhs, rhs)
  assert dlhs.shape == (0, 8) and not np.asarray(drhs).any()
  out = pallax.ragged_dot(jnp.ones((4, 8)), rhs[:0], jnp.zeros(0, jnp.int32))
  np.testing.assert_array_equal(np.asarray(out), 0.0)


# ------------------------------------------------------------------------------
# The fused epilogue: an activation, or gated (``act(x @ w_a) * (x @ w_b)``).


def _epilogue_reference(lhs, rhs, sizes, activation, gated):
  act = {None: lambda z: z, "relu": jax.nn.relu, "silu": jax.nn.silu, "gelu": jax.nn.gelu}
  act["gelu"] = lambda z: jax.nn.gelu(z, approximate=False)
  act["gelu_tanh"] = lambda z: jax.nn.gelu(z, approximate=True)
  h = reference(lhs, rhs, sizes)
  if not gated:
    return act[activation](h)
  n = h.shape[-1] // 2
  return act[activation](h[:, :n]) * h[:, n:]


# (activation, gated): each activation plain, silu gated (the MoE FFN), and
# gated without an activation (a bilinear GLU).
EPILOGUES = [("relu", False), ("gelu", False), ("gelu_tanh", False), ("silu", True), (None, True)]


@pytest.mark.parametrize(
  "epilogue", EPILOGUES, ids=lambda e: f"{e[0]}-{'gated' if e[1] else 'plain'}"
)
def test_epilogue_forward_grads_and_jvp(epilogue):
  activation, gated = epilogue
  m, k, n, sizes = CASES["mixed"]
  rng = np.random.default_rng(12)
  lhs, rhs = rand(rng, (m, k)), rand(rng, (len(sizes), k, 2 * n if gated else n)) * 0.3
  f = lambda a, b: pallax.ragged_dot(a, b, sizes, activation=activation, gated=gated)
  cot = rand(rng, (m, n))
  tangents = (rand(rng, lhs.shape), rand(rng, rhs.shape))
  out, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(lhs, rhs, *tangents)
  grads = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * cot), (0, 1)))(lhs, rhs)
  with x64():
    g = lambda a, b: _epilogue_reference(a, b, sizes, activation, gated)
    args = (to64(lhs), to64(rhs))
    want, want_tangent = jax.jvp(g, args, tuple(map(to64, tangents)))
    want_grads = jax.grad(lambda a, b: jnp.sum(g(a, b) * to64(cot)), (0, 1))(*args)
  assert_close(out, want, jnp.float32, "forward")
  assert_close(tangent, want_tangent, jnp.float32, "jvp")
  assert_close(grads[0], want_grads[0], jnp.float32, "dlhs")
  assert_close(grads[1], want_grads[1], jnp.float32, "drhs")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_gated_kernel_and_expert_sharding(path):
  """The gated epilogue in the kernels (halves of 128 columns: whole TPU blocks), and sharded."""
  rng = np.random.default_rng(13)
  sizes = np.asarray([0, 1, 7, 0, 60, 29, 3, 4])
  lhs, rhs = rand(rng, (112, 24)), rand(rng, (8, 24, 256)) * 0.3
  f = lambda a, b: pallax.ragged_dot(
    a, b, sizes, activation="silu", gated=True, config=PINNED[path]
  )
  cot = rand(rng, (112, 128))
  loss = lambda a, b: jnp.sum(f(a, b) * cot)
  with on_path(path):
    calls = {(s.op, s.implementation) for s in pallax.explain(f, lhs, rhs)}
    out, grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(lhs, rhs)
    mesh = jax.make_mesh(
      (8,), ("e",), axis_types=(jax.sharding.AxisType.Auto,), devices=sharding_devices()
    )
    sharded = jax.device_put(rhs, jax.sharding.NamedSharding(mesh, P("e")))
    out_sharded = jax.jit(f)(lhs, sharded)
  assert calls == {("ragged_dot_epilogue", "pallas")}, calls
  with x64():
    g = lambda a, b: _epilogue_reference(a, b, sizes, "silu", True)
    want, want_grads = jax.value_and_grad(lambda a, b: jnp.sum(g(a, b) * to64(cot)), (0, 1))(
      to64(lhs), to64(rhs)
    )
  assert_close(out, want, jnp.float32, f"{path} loss")
  assert_close(grads[0], want_grads[0], jnp.float32, f"{path} dlhs")
  assert_close(grads[1], want_grads[1], jnp.float32, f"{path} drhs")
  with x64():
    want_out = g(to64(lhs), to64(rhs))
  assert_close(out_sharded, want_out, jnp.float32, f"{path} experts sharded")
