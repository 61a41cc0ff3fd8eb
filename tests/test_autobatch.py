"""Tests of ``pallax.autobatch``: chunked results equal the unbatched function.

Property tests draw axis lengths (0, 1, primes, large composites), budgets,
pytrees with unbatched leaves and non-zero in/out axes, and every supported
reduction ufunc; they check the result against the unbatched function (exactly,
or to float rounding for float sums and products), the chunk count against
the formula ``ceil(n / ceil(n / ceil(n * e / B)))`` and the scan in the jaxpr.
The rest covers jit, vmap, grad, jvp, shard_map, nesting, the default budget,
``count_intermediates`` and the errors for bad arguments.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallax.autobatch import autobatch, free_memory
from tests.helpers import sharding_devices

PROPERTY = settings(
  max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# 0, 1, small and large primes, large composites, anything up to 300.
LENGTHS = st.one_of(
  st.sampled_from([0, 1, 2, 3, 7, 13, 97, 101, 211, 1009, 360, 720, 1024, 2520, 5040]),
  st.integers(0, 300),
)

# (ufunc, output dtype, exact): every reduction the driver supports.
REDUCTIONS = [
  (jnp.add, np.float32, False),
  (jnp.add, np.int32, True),
  (jnp.add, np.uint8, True),
  (jnp.multiply, np.float32, False),
  (jnp.multiply, np.int32, True),
  (jnp.maximum, np.float32, True),
  (jnp.maximum, np.int8, True),
  (jnp.minimum, np.float32, True),
  (jnp.minimum, np.int32, True),
  (jnp.logical_and, np.bool_, True),
  (jnp.logical_or, np.bool_, True),
  (jnp.logical_xor, np.bool_, True),
  (jnp.bitwise_and, np.int32, True),
  (jnp.bitwise_or, np.uint8, True),
  (jnp.bitwise_xor, np.int32, True),
]


def expected_chunking(n, elem_nbytes, budget):
  """(number of chunks, chunk length) by the documented formula."""
  if n == 0:
    return 1, 0
  target = max(1, -(-n * elem_nbytes // budget))
  length = -(-n // target)
  return -(-n // length), length


def scans(fn, *args):
  """(nesting depth, length) of every scan in the jaxpr of ``fn(*args)``."""
  found = []

  def walk(jaxpr, depth):
    for eqn in jaxpr.eqns:
      is_scan = eqn.primitive.name == "scan"
      if is_scan:
        found.append((depth, eqn.params["length"]))
      for sub in jaxprs_in_params(eqn.params):
        walk(sub, depth + is_scan)

  walk(jax.make_jaxpr(fn)(*args).jaxpr, 0)
  return found


def check_scan(fn, args, n, nbatches, length):
  """One scan of the full chunks when there is more than one chunk, else none."""
  expected = [] if nbatches == 1 else [(0, n // length)]
  assert scans(fn, *args) == expected


def random_array(rng, shape, dtype):
  """Random values of ``dtype``: never all zeros or all ones."""
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    low, high = max(info.min, -50), min(info.max, 50)
    return rng.integers(low, high, shape, dtype=dtype, endpoint=True)
  return rng.uniform(0.5, 1.5, shape).astype(dtype)


def budget_for(data, total_nbytes, elem_nbytes):
  """A budget from a few bytes under one element up to above the total."""
  return data.draw(st.integers(max(1, elem_nbytes - 3), max(elem_nbytes, total_nbytes + 7)))


# -- mapping: pytrees, unbatched leaves, non-zero axes ------------------------


def tree_func(x_axis, out_axis):
  """f(x, d) with x batched at ``x_axis``, d = {'i': batched at 1, 'w': unbatched}."""

  def f(x, d):
    rows = jnp.moveaxis(x, x_axis, 0)  # (n, 3)
    # no a * b + c or division by a constant: XLA:CPU contracts the first to
    # an FMA and may turn the second into a multiplication in some loop
    # shapes only, which would make bitwise equality depend on the chunking
    mixed = jnp.maximum(jnp.sin(rows) * d["w"], d["i"][0][:, None] * 0.03125)
    return {"a": jnp.moveaxis(mixed, 0, out_axis), "b": d["i"].sum(0) * 3}

  return f


@PROPERTY
@given(
  n=LENGTHS,
  x_axis=st.sampled_from([0, 1, -1]),
  out_axis=st.sampled_from([0, 1, -1]),
  seed=st.integers(0, 2**31),
  data=st.data(),
)
def test_map_matches_unbatched(n, x_axis, out_axis, seed, data):
  rng = np.random.default_rng(seed)
  x_shape = (n, 3) if x_axis == 0 else (3, n)
  x = random_array(rng, x_shape, np.float32)
  d = {"i": random_array(rng, (2, n), np.int32), "w": random_array(rng, (3,), np.float32)}
  f = tree_func(x_axis, out_axis)
  # per element: x 3 f32, i 2 i32, a 3 f32, b 1 i32
  elem = (3 + 2 + 3 + 1) * 4
  budget = budget_for(data, n * elem, elem)
  g = autobatch(
    f,
    budget,
    in_axes=(x_axis, {"i": 1, "w": None}),
    out_axes={"a": out_axis, "b": 0},
    return_nbatches=True,
    warn_on_overflow=False,
  )

  out, nbatches = g(x, d)
  expected = f(x, d)
  np.testing.assert_array_equal(out["a"], expected["a"])
  np.testing.assert_array_equal(out["b"], expected["b"])
  nb, length = expected_chunking(n, elem, budget)
  assert int(nbatches) == nb
  check_scan(g, (x, d), n, nb, length)


def test_prime_length_quarter_budget_runs_four_chunks():
  n = 10007
  x = random_array(np.random.default_rng(0), (n, 5), np.float32)
  f = lambda x: jnp.cos(x) * 2  # noqa: E731
  g = autobatch(f, n * 10 * 4 // 4, return_nbatches=True)
  out, nbatches = g(x)
  np.testing.assert_array_equal(out, f(x))
  assert int(nbatches) == 4
  assert scans(g, x) == [(0, 3)]  # 3 full chunks of 2502 + a remainder of 2501


# -- reductions ---------------------------------------------------------------


@pytest.mark.parametrize("ufunc, dtype, exact", REDUCTIONS)
@settings(PROPERTY, max_examples=6)
@given(n=LENGTHS, out_axis=st.sampled_from([0, 1, -1]), seed=st.integers(0, 2**31), data=st.data())
def test_reduce_matches_unbatched(ufunc, dtype, exact, n, out_axis, seed, data):
  rng = np.random.default_rng(seed)
  x = random_array(rng, (2, n), dtype)  # batched along axis 1
  c = random_array(rng, (2,), dtype)  # unbatched
  if ufunc is jnp.multiply and dtype == np.float32:
    x, c = 0.9 + x / 5, 0.9 + c / 5  # products of thousands of factors stay normal

  def f(x, c):
    y = jnp.stack([x[0], x[1], ufunc(x[0], c[1])], axis=-1)  # (n, 3)
    return {"y": jnp.moveaxis(y, 0, out_axis), "c": x[0]}

  elem = 6 * np.dtype(dtype).itemsize
  budget = budget_for(data, n * elem, elem)
  g = autobatch(
    f,
    budget,
    in_axes=(1, None),
    out_axes={"y": out_axis, "c": 0},
    reduce_ufunc=ufunc,
    return_nbatches=True,
    warn_on_overflow=False,
  )

  full = f(x, c)
  if n == 0 and ufunc.identity is None:
    # like the unbatched reduction: maximum/minimum of nothing is an error
    with pytest.raises(ValueError, match="zero-size"):
      ufunc.reduce(full["y"], axis=out_axis)
    with pytest.raises(ValueError, match="zero-size"):
      g(x, c)
    return
  out, nbatches = g(x, c)
  for key, axis in (("y", out_axis), ("c", 0)):
    expected = ufunc.reduce(full[key], axis=axis)
    assert out[key].dtype == expected.dtype
    if exact:
      np.testing.assert_array_equal(out[key], expected)
    else:
      np.testing.assert_allclose(out[key], expected, rtol=1e-4)
  nb, length = expected_chunking(n, elem, budget)
  assert int(nbatches) == nb
  check_scan(g, (x, c), n, nb, length)


@pytest.mark.parametrize("ufunc, dtype, exact", REDUCTIONS)
def test_reduce_over_an_empty_axis_is_the_unbatched_result(ufunc, dtype, exact):
  x = np.zeros((0, 3), dtype)
  g = autobatch(lambda x: x, 64, reduce_ufunc=ufunc, return_nbatches=True)
  if ufunc.identity is None:
    with pytest.raises(ValueError, match="zero-size"):
      g(x)
    return
  out, nbatches = g(x)
  np.testing.assert_array_equal(out, ufunc.reduce(x, axis=0))
  assert out.dtype == ufunc.reduce(x, axis=0).dtype
  assert int(nbatches) == 1


def test_reduce_accumulates_in_the_reduction_dtype():
  x = jnp.asarray(np.random.default_rng(8).integers(90, 127, 300), jnp.int8)
  g = autobatch(lambda x: x, 30, reduce_ufunc=jnp.add, return_nbatches=True)
  total, nbatches = g(x)
  assert total.dtype == jnp.int32  # int8 sums accumulate in int32, no wrap-around
  assert int(total) == int(np.asarray(x, np.int64).sum())
  assert int(nbatches) == 20


# -- nesting ------------------------------------------------------------------


def nested(budget, inner_axis):
  """Outer autobatch over rows; inside, an autobatch over ``inner_axis`` of the chunk."""
  inner = autobatch(lambda y: jnp.exp(y) - y, budget, in_axes=inner_axis, out_axes=inner_axis)
  return autobatch(inner, budget, return_nbatches=True)


@pytest.mark.parametrize("inner_axis", [0, 1])
def test_nested_inner_does_not_loop_when_outer_chunk_fits(inner_axis):
  n, m = 96, 5
  x = random_array(np.random.default_rng(1), (n, m), np.float32)
  budget = n * m * 8 // 4  # 4 chunks of 24 rows, each exactly at the budget
  g = nested(budget, inner_axis)
  out, nbatches = g(x)
  np.testing.assert_allclose(out, jnp.exp(x) - x, rtol=1e-6)
  assert int(nbatches) == 4
  assert scans(g, x) == [(0, 4)]  # the inner autobatch adds no scan


@PROPERTY
@given(n=st.integers(1, 400), seed=st.integers(0, 2**31), data=st.data())
def test_nested_inner_loops_only_when_outer_chunk_overshoots(n, seed, data):
  m = 3
  x = random_array(np.random.default_rng(seed), (n, m), np.float32)
  elem = m * 8
  budget = budget_for(data, n * elem, elem)
  g = nested(budget, 1)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # one row may exceed tiny budgets
    out, nbatches = g(x)
    found = scans(g, x)
  np.testing.assert_allclose(out, jnp.exp(x) - x, rtol=1e-6)
  nb, length = expected_chunking(n, elem, budget)
  assert int(nbatches) == nb
  # the inner autobatch loops (over columns) only when its chunk of rows
  # exceeds the budget: by less than a row, or because one row does
  expected_depths = [0] if nb > 1 else []
  if length * elem > budget:
    expected_depths.append(int(nb > 1))
  assert [depth for depth, _ in found] == expected_depths


# -- transformations ----------------------------------------------------------


def mlp(x, w):
  return jnp.tanh(x @ w["a"]) @ w["b"]


def assert_float32_mlp(out, x, w, rows_summed=False):
  """``out`` is ``mlp(x, w)`` (its sum over rows if ``rows_summed``) to float32 rounding.

  Chunking changes the row count of each matmul, and XLA's CPU dot may then
  sum in another order, so results agree with the unchunked call only to
  rounding. The reference is float64; the bound is 16 float32 ulps of the
  absolute terms (two dots of 4 and 6 terms and a tanh need at most 12), plus
  one ulp per summed row.
  """
  x, a, b = (np.asarray(v, np.float64) for v in (x, w["a"], w["b"]))
  want = np.tanh(x @ a) @ b
  terms = (np.abs(x) @ np.abs(a) + np.abs(np.tanh(x @ a))) @ np.abs(b)
  bound = 16 * np.finfo(np.float32).eps * terms
  if rows_summed:
    want, bound = want.sum(-2), (bound + x.shape[-2] * np.finfo(np.float32).eps * terms).sum(-2)
  error = np.abs(np.asarray(out, np.float64) - want)
  assert np.all(error <= bound), f"largest error over the bound: {np.max(error / bound):.3g}x"


@pytest.fixture
def mlp_args():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(103, 4)), jnp.float32)
  w = {
    "a": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(6, 2)), jnp.float32),
  }
  return x, w


BUDGET = 103 * 6 * 4 // 5  # 6 chunks: a remainder of 13 rows, then 5 of 18 in the scan


def test_jit_of_autobatch(mlp_args):
  x, w = mlp_args
  g = autobatch(mlp, BUDGET, in_axes=(0, None))
  out = jax.jit(lambda x, w: g(x, w) * 2)(x, w)
  assert_float32_mlp(out / 2, x, w)


def test_keyword_arguments(mlp_args):
  x, w = mlp_args
  g = autobatch(mlp, BUDGET, in_axes=(0, None))
  assert_float32_mlp(g(x=x, w=w), x, w)


def test_vmap_of_autobatch(mlp_args):
  x, w = mlp_args
  xs = jnp.stack([x, -x, 2 * x])
  g = autobatch(mlp, BUDGET, in_axes=(0, None))
  assert_float32_mlp(jax.vmap(g, (0, None))(xs, w), xs, w)
  total = autobatch(mlp, BUDGET, in_axes=(0, None), reduce_ufunc=jnp.add)
  assert_float32_mlp(jax.vmap(total, (0, None))(xs, w), xs, w, rows_summed=True)


@pytest.mark.parametrize("reduce_ufunc", [None, jnp.add])
def test_grad_through_autobatch(mlp_args, reduce_ufunc):
  x, w = mlp_args
  g = autobatch(mlp, BUDGET, in_axes=(0, None), reduce_ufunc=reduce_ufunc)

  cotangent = np.random.default_rng(7).normal(size=(103, 2) if reduce_ufunc is None else (2,))

  def loss(fn, x, w):
    return jnp.vdot(fn(x, w), cotangent)

  ref = lambda x, w: mlp(x, w) if reduce_ufunc is None else mlp(x, w).sum(0)  # noqa: E731
  got = jax.grad(lambda x, w: loss(g, x, w), argnums=(0, 1))(x, w)
  want = jax.grad(lambda x, w: loss(ref, x, w), argnums=(0, 1))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduce_ufunc", [None, jnp.add, jnp.maximum])
def test_jvp_through_autobatch(mlp_args, reduce_ufunc):
  x, w = mlp_args
  rng = np.random.default_rng(3)
  tx = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  tw = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), w)
  g = autobatch(mlp, BUDGET, in_axes=(0, None), reduce_ufunc=reduce_ufunc)
  ref = mlp if reduce_ufunc is None else lambda x, w: reduce_ufunc.reduce(mlp(x, w), axis=0)
  out, tangent = jax.jvp(g, (x, w), (tx, tw))
  want_out, want_tangent = jax.jvp(ref, (x, w), (tx, tw))
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(tangent, want_tangent, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduce_ufunc", [None, jnp.add])
def test_inside_shard_map(mlp_args, reduce_ufunc):
  _, w = mlp_args
  mesh = jax.make_mesh((8,), ("x",), devices=sharding_devices())
  x = random_array(np.random.default_rng(4), (8 * 37, 4), np.float32)
  x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x")))
  g = autobatch(
    mlp,
    37 * 6 * 4 // 3,
    in_axes=(0, None),
    reduce_ufunc=reduce_ufunc,
    reduce_vary_axes=("x",),
    return_nbatches=True,
  )

  def shard(x, w):
    out, _ = g(x, w)
    return out if reduce_ufunc is None else jax.lax.psum(out, "x")

  sharded = jax.jit(
    jax.shard_map(
      shard, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x") if reduce_ufunc is None else P()
    )
  )
  want = mlp(x, w) if reduce_ufunc is None else mlp(x, w).sum(0)
  np.testing.assert_allclose(sharded(x, w), want, rtol=1e-5, atol=1e-5)
  assert scans(sharded, x, w) == [(0, 2)]  # per shard: a remainder of 11 rows, then 2 chunks of 13


# -- budget, warnings, intermediates ------------------------------------------


def test_one_chunk_has_no_scan(mlp_args):
  x, w = mlp_args
  g = autobatch(mlp, 10**9, in_axes=(0, None), return_nbatches=True)
  out, nbatches = g(x, w)
  np.testing.assert_array_equal(out, mlp(x, w))
  assert int(nbatches) == 1
  assert scans(g, x, w) == []


def test_default_budget_is_derived_from_the_host(mlp_args):
  x, w = mlp_args
  g = autobatch(mlp, in_axes=(0, None), return_nbatches=True)
  out, nbatches = g(x, w)
  np.testing.assert_array_equal(out, mlp(x, w))
  assert int(nbatches) == 1  # 3 KiB of io is far under 1/8 of the free RAM


def test_unknown_free_memory_asks_for_a_budget(mlp_args, monkeypatch):
  class NoStats:  # an accelerator that reports no memory statistics
    platform = "gpu"

    def memory_stats(self):
      return None

  assert free_memory(jax.local_devices()) > 0  # the host's RAM
  monkeypatch.setattr(jax, "local_devices", lambda: [NoStats()])
  g = autobatch(mlp, in_axes=(0, None))
  with pytest.raises(ValueError, match="max_io_nbytes=None: the free memory of the gpu"):
    g(*mlp_args)


def test_overflow_warns_and_runs_chunks_of_one():
  x = random_array(np.random.default_rng(5), (7, 16), np.float32)
  g = autobatch(jnp.sin, 100, return_nbatches=True)  # one row is 128 bytes
  with pytest.warns(UserWarning, match="128 bytes > max_io_nbytes=100"):
    out, nbatches = g(x)
  np.testing.assert_array_equal(out, jnp.sin(x))
  assert int(nbatches) == 7
  quiet = autobatch(jnp.sin, 100, warn_on_overflow=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    np.testing.assert_array_equal(quiet(x), jnp.sin(x))


@pytest.mark.parametrize("reduce_ufunc", [None, jnp.add])
def test_remainder_chunk_and_scan_do_not_overlap_in_memory(reduce_ufunc):
  S = jax.ShapeDtypeStruct
  w = {"a": S((8, 2048), jnp.float32), "b": S((2048, 2), jnp.float32)}
  # 4 chunks: 248 rows before the scan, then 3 of 251 rows in it
  g = autobatch(mlp, 1001 * 10 * 4 // 4, in_axes=(0, None), reduce_ufunc=reduce_ufunc)
  temp = g.lower(S((1001, 8), jnp.float32), w).compile().memory_analysis().temp_size_in_bytes
  chunk = jax.jit(mlp).lower(S((251, 8), jnp.float32), w).compile().memory_analysis()
  assert temp < 1.5 * chunk.temp_size_in_bytes  # one chunk's temporaries, not two


def test_count_intermediates_shrinks_chunks_to_fit():
  hidden = 256
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(500, 4)), jnp.float32)
  w = {
    "a": jnp.asarray(rng.normal(size=(4, hidden)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(hidden, 2)), jnp.float32),
  }
  budget = 500 * 6 * 4 // 2
  io_only = autobatch(mlp, budget, in_axes=(0, None), return_nbatches=True)
  counted = autobatch(
    mlp, budget, in_axes=(0, None), return_nbatches=True, count_intermediates=True
  )
  out, nbatches = counted(x, w)
  np.testing.assert_allclose(out, mlp(x, w), rtol=1e-5, atol=1e-5)
  assert int(io_only(x, w)[1]) == 2
  assert int(nbatches) > 2
  length = math.ceil(500 / int(nbatches))
  chunk = jax.jit(mlp).lower(x[:length], w).compile().memory_analysis()
  assert length * 6 * 4 + chunk.temp_size_in_bytes <= budget + 6 * 4 + hidden * 4


def test_count_intermediates_warns_once_without_temporaries():
  g = autobatch(lambda x: x * 3, 64, count_intermediates=True)
  with pytest.warns(UserWarning, match="reports no temporaries") as record:
    g(jnp.arange(40.0))
    g(jnp.arange(50.0))  # traced again, not warned again
  assert len([r for r in record if "count_intermediates" in str(r.message)]) == 1


def test_count_intermediates_falls_back_under_collectives():
  mesh = jax.make_mesh((8,), ("x",), devices=sharding_devices())
  x = jax.device_put(jnp.arange(8 * 12.0), NamedSharding(mesh, P("x")))
  g = autobatch(lambda y: y - jax.lax.pmean(y, "x"), 16, count_intermediates=True)
  with pytest.warns(UserWarning, match="could not compile func on its own"):
    out = jax.jit(jax.shard_map(g, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x)
  rows = np.asarray(x).reshape(8, 12)
  np.testing.assert_allclose(out, (rows - rows.mean(0)).reshape(-1), rtol=1e-6)


def test_result_shape_dtype_skips_the_shape_trace(mlp_args):
  x, w = mlp_args
  traces = []

  def f(x, w):
    traces.append(x.shape)
    return mlp(x, w)

  shape = jax.ShapeDtypeStruct((103, 2), jnp.float32)
  out = autobatch(f, 10**9, in_axes=(0, None), result_shape_dtype=shape)(x, w)
  np.testing.assert_array_equal(out, mlp(x, w))
  assert traces == [(103, 4)]
  wrong = jax.ShapeDtypeStruct((103, 3), jnp.float32)
  with pytest.raises(ValueError, match="result_shape_dtype"):
    autobatch(f, 10**9, in_axes=(0, None), result_shape_dtype=wrong)(x, w)


# -- bad arguments ------------------------------------------------------------


@pytest.mark.parametrize(
  "budget, error, match",
  [
    (0, ValueError, "max_io_nbytes must be positive"),
    (-5, ValueError, "max_io_nbytes must be positive"),
    (2.5, TypeError, "max_io_nbytes must be a positive int"),
    (True, TypeError, "max_io_nbytes must be a positive int"),
  ],
)
def test_bad_budget(budget, error, match):
  with pytest.raises(error, match=match):
    autobatch(jnp.sin, budget)


@pytest.mark.parametrize(
  "ufunc, error, match",
  [
    (jnp.subtract, TypeError, "has no identity"),
    (jnp.sum, TypeError, "binary ufunc"),
  ],
)
def test_bad_reduce_ufunc(ufunc, error, match):
  with pytest.raises(error, match=match):
    autobatch(jnp.sin, 100, reduce_ufunc=ufunc)


def test_bad_reduce_vary_axes():
  with pytest.raises(TypeError, match="reduce_vary_axes"):
    autobatch(jnp.sin, 100, reduce_ufunc=jnp.add, reduce_vary_axes=3)


@pytest.mark.parametrize(
  "call, error, match",
  [
    (
      lambda: autobatch(lambda a, b: a + b, 100)(jnp.ones(4), jnp.ones(5)),
      ValueError,
      r"in_axes: the batched axes have different lengths "
      r"\(args\[0\]: 4, args\[1\]: 5\)",
    ),
    (
      lambda: autobatch(jnp.sin, 100, in_axes=2)(jnp.ones((3, 4))),
      ValueError,
      r"in_axes: axis 2 is out of range for argument\[0\] of shape \(3, 4\)",
    ),
    (
      lambda: autobatch(jnp.sin, 100, in_axes=(None,))(jnp.ones(3)),
      ValueError,
      "in_axes: no argument is batched",
    ),
    (
      lambda: autobatch(jnp.sin, 100, in_axes=(0, 0))(jnp.ones(3)),
      ValueError,
      "in_axes=.* is not a pytree prefix of the arguments",
    ),
    (
      lambda: autobatch(jnp.sin, 100, in_axes=0.5)(jnp.ones(3)),
      TypeError,
      "in_axes: the axis for argument.* must be an int or None",
    ),
    (
      lambda: autobatch(jnp.sin, 100, out_axes=None)(jnp.ones(3)),
      ValueError,
      "out_axes: None for output",
    ),
    (
      lambda: autobatch(jnp.sin, 100, out_axes=-3)(jnp.ones((3, 2))),
      ValueError,
      r"out_axes: axis -3 is out of range for output of shape \(3, 2\)",
    ),
    (
      lambda: autobatch(lambda x: x.T, 100)(jnp.ones((3, 2))),
      ValueError,
      "out_axes: output has length 2 along axis 0, but the batched arguments have length 3",
    ),
    (
      lambda: autobatch(lambda x, *, k: x * k, 100)(jnp.ones(3), k=2.0),
      TypeError,
      "keyword-only arguments",
    ),
  ],
)
def test_bad_call_arguments(call, error, match):
  with pytest.raises(error, match=match):
    call()
