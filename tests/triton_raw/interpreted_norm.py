"""rms_norm's raw Triton kernels under Triton's interpreter, against a float64 reference.

Run by ``test_interpreted.py`` in a process with ``TRITON_INTERPRET=1``: every
call pins a ``"triton_raw"`` config, so the forward and backward kernels of
``kernels/norm/triton_raw.py`` run on the CPU through Triton's interpreter,
which starts outputs as NaN, so an element a kernel leaves unwritten fails
the comparison. Shapes are tiny (the interpreter is slow) and odd: rows not a
multiple of ``block_rows``, hidden not a power of two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import pallax
from pallax.kernels.norm import NormConfig
from pallax.triton_raw import launch
from tests.helpers import (
  as64,
  assert_close,
  loop_stack,
  primitive_names,
  rand,
  sharding_devices,
  x64,
)

# jax-triton imports only where jaxlib has its CUDA plugin (the verify extra's).
pytestmark = pytest.mark.compilers

DTYPES = (jnp.float32, jnp.bfloat16)
RAW = NormConfig(block_rows=4, num_warps=2, implementation="triton_raw")
# (rows..., hidden): 13 and 10 rows leave the last block of 4 partial; 40 and
# 24 columns pad to 64 and 32.
SHAPES = [(13, 40), (2, 5, 24), (1, 7)]


def rms_norm_ref(x, w, eps=1e-6, offset=0.0):
  """rms_norm in float64 (plain jnp)."""
  x = jnp.asarray(x, jnp.float64)
  y = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * (offset + jnp.asarray(w, jnp.float64))


def raw_rms_norm(x, w, config=RAW, **kwargs):
  return pallax.rms_norm(x, w, config=config, **kwargs)


def _inputs(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  return rand(rng, shape, dtype), rand(rng, shape[-1:], dtype, 0.5, 1.0), rng


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward(shape, dtype):
  x, w, _ = _inputs(shape, dtype, seed=0)
  y = jax.jit(raw_rms_norm)(x, w)
  y_off = jax.jit(lambda x, w: raw_rms_norm(x, w, eps=1e-3, offset=1.0))(x, w)
  y_now = jax.jit(lambda x: raw_rms_norm(x, None))(x)
  assert y.dtype == dtype and y.shape == shape
  with x64():
    x64_, w64 = as64(x, w)
    assert_close(y, rms_norm_ref(x64_, w64), dtype, "weight")
    assert_close(y_off, rms_norm_ref(x64_, w64, 1e-3, 1.0), dtype, "offset=1")
    assert_close(y_now, rms_norm_ref(x64_, None), dtype, "no weight")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grad(shape, dtype):
  x, w, rng = _inputs(shape, dtype, seed=1)
  dy = rand(rng, shape, dtype)
  _, vjp = jax.vjp(lambda x, w: raw_rms_norm(x, w, offset=0.5), x, w)
  dx, dw = jax.jit(vjp)(dy)
  assert dx.dtype == dtype and dw.dtype == dtype
  with x64():
    _, vjp_ref = jax.vjp(lambda x, w: rms_norm_ref(x, w, offset=0.5), *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    assert_close(dx, dx_ref, dtype, "dx")
    assert_close(dw, dw_ref, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jvp(dtype):
  x, w, rng = _inputs((13, 40), dtype, seed=2)
  xd, wd = rand(rng, x.shape, dtype), rand(rng, w.shape, dtype)
  y, yd = jax.jit(lambda *a: jax.jvp(raw_rms_norm, a[:2], a[2:]))(x, w, xd, wd)
  with x64():
    y_ref, yd_ref = jax.jvp(rms_norm_ref, tuple(as64(x, w)), tuple(as64(xd, wd)))
    assert_close(y, y_ref, dtype, "primal")
    assert_close(yd, yd_ref, dtype, "tangent")


def test_weight_dtype_differs_from_x():
  x, _, rng = _inputs((13, 40), jnp.bfloat16, seed=3)
  w, dy = rand(rng, (40,), jnp.float32, 0.5, 1.0), rand(rng, x.shape, jnp.bfloat16)
  y, vjp = jax.vjp(raw_rms_norm, x, w)
  dx, dw = vjp(dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  with x64():
    y_ref, vjp_ref = jax.vjp(rms_norm_ref, *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    assert_close(y, y_ref, jnp.bfloat16, "y")
    assert_close(dx, dx_ref, jnp.bfloat16, "dx")
    assert_close(dw, dw_ref, jnp.bfloat16, "dweight")


@pytest.mark.parametrize("in_axes", [(0, None), (1, 0)], ids=str)
def test_vmap_is_one_kernel(in_axes):
  """vmap (a mapped weight: one weight group per example) matches a loop, one launch a stage."""
  rng = np.random.default_rng(4)
  x = rand(rng, (13, 3, 24) if in_axes[0] == 1 else (3, 13, 24))
  w = rand(rng, (3, 24) if in_axes[1] == 0 else (24,), jnp.float32, 0.5, 1.0)
  size = 3

  def loss(x, w):
    return jnp.sum(jnp.sin(raw_rms_norm(x, w, offset=0.25)))

  fn = lambda x, w: (raw_rms_norm(x, w), jax.grad(loss, (0, 1))(x, w))
  got = jax.jit(jax.vmap(fn, in_axes))(x, w)
  names = lambda f: primitive_names(jax.make_jaxpr(jax.vmap(f, in_axes))(x, w).jaxpr)
  assert [n for n in names(raw_rms_norm) if "norm" in n] == ["rms_norm_fwd"]
  grad_names = names(jax.grad(loss, (0, 1)))
  assert [n for n in grad_names if "norm" in n] == ["rms_norm_fwd", "rms_norm_bwd"]
  assert not {"while", "scan"} & set(grad_names), "vmap looped"
  ref_fn = lambda x, w: (
    rms_norm_ref(x, w),
    jax.grad(lambda x, w: jnp.sum(jnp.sin(rms_norm_ref(x, w, offset=0.25))), (0, 1))(x, w),
  )
  with x64():
    want = loop_stack(ref_fn, as64(x, w), in_axes, size)
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  for g, r, name in zip(got, want, ("y", "dx", "dweight")):
    assert_close(g, r, jnp.float32, name)


def test_sharded_rows():
  """Rows sharded over 8 devices: each runs the raw kernels on its rows; dweight is summed.

  Under ``shard_map``: in a ``jit`` partitioned by XLA, the primitives'
  ``custom_partitioning`` loses the host callbacks the interpreter runs in
  (JAX keeps them alive only for the top-level module: jax-ml/jax#23620).
  """
  mesh = jax.make_mesh((8,), ("d",), (jax.sharding.AxisType.Auto,), devices=sharding_devices())
  x, w, rng = _inputs((16, 40), jnp.float32, seed=5)
  dy = rand(rng, x.shape)

  def fn(x, w, dy):
    y, vjp = jax.vjp(raw_rms_norm, x, w)
    return (y, *vjp(dy))

  rows, whole = PartitionSpec("d"), PartitionSpec()
  sharded = jax.shard_map(
    fn, mesh=mesh, in_specs=(rows, whole, rows), out_specs=(rows, rows, whole)
  )
  put = lambda a: jax.device_put(a, NamedSharding(mesh, rows))
  y, dx, dw = jax.jit(sharded)(put(x), w, put(dy))
  assert y.sharding.spec[0] == "d" and dx.sharding.spec[0] == "d"
  with x64():
    y_ref, vjp_ref = jax.vjp(rms_norm_ref, *as64(x, w))
    for got, want, name in zip((y, dx, dw), (y_ref, *vjp_ref(*as64(dy))), ("y", "dx", "dw")):
      assert_close(got, want, jnp.float32, name)


def test_partitioned_jit_is_refused_not_crashed():
  """A ``jit`` that XLA partitions would drop the interpreter's callbacks: a clear error instead."""
  mesh = jax.make_mesh((8,), ("d",), (jax.sharding.AxisType.Auto,), devices=sharding_devices())
  x, w, _ = _inputs((16, 40), jnp.float32, seed=8)
  x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
  with pytest.raises(Exception, match="jax-ml/jax#23620"):
    jax.jit(raw_rms_norm)(x, w)


def test_backward_programs_loop_over_row_blocks(monkeypatch):
  """Fewer backward programs than row blocks: each sums the weight gradient of several."""
  from pallax.kernels.norm import triton_raw

  monkeypatch.setattr(triton_raw, "MAX_BWD_PROGRAMS", 2)
  jax.clear_caches()
  x, w, rng = _inputs((11, 24), jnp.float32, seed=6)
  dy = rand(rng, x.shape)
  config = NormConfig(block_rows=2, num_warps=1, implementation="triton_raw")
  _, vjp = jax.vjp(lambda x, w: raw_rms_norm(x, w, config), x, w)
  dx, dw = jax.jit(vjp)(dy)
  jax.clear_caches()
  with x64():
    _, vjp_ref = jax.vjp(rms_norm_ref, *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    assert_close(dx, dx_ref, jnp.float32, "dx")
    assert_close(dw, dw_ref, jnp.float32, "dweight")


def test_the_raw_kernels_are_what_runs():
  """The executor picks the pinned raw config, and the CPU program calls the interpreter."""
  x, w, _ = _inputs((13, 40), jnp.float32, seed=7)
  grad = jax.grad(lambda x, w: raw_rms_norm(x, w).sum(), (0, 1))
  report = pallax.explain(grad, x, w)
  assert {s.op: s.config for s in report} == {"rms_norm_fwd": RAW, "rms_norm_bwd": RAW}
  lowered = jax.jit(grad).lower(x, w).as_text()
  assert lowered.count("callback") >= 2, "the raw kernels run as host callbacks"


def test_an_unwritten_block_shows_as_nan():
  """A launch that leaves the last row block out leaves NaN there, which the tests would catch."""
  from pallax.kernels.norm import triton_raw

  x, w, _ = _inputs((13, 40), jnp.float32, seed=8)
  sizes = dict(ROWS=13, HIDDEN=40, BLOCK_ROWS=4, BLOCK_H=64)
  y, rstd = launch(
    triton_raw._fwd_kernel,
    x[None],
    w[None],
    out_shape=[jax.ShapeDtypeStruct((1, 13, 40), x.dtype), jax.ShapeDtypeStruct((1, 13), x.dtype)],
    grid=(1, 3),
    num_warps=2,
    num_stages=1,
    interpret=True,
    EPS=1e-6,
    OFFSET=0.0,
    **sizes,
  )
  assert np.isnan(y[0, 12]).all() and np.isnan(rstd[0, 12])
  with x64():
    assert_close(y[0, :12], rms_norm_ref(*as64(x[:12], w)), jnp.float32, "rows written")


def test_zero_rows():
  x = jnp.zeros((0, 40), jnp.float32)
  w = rand(np.random.default_rng(9), (40,))
  y = jax.jit(raw_rms_norm)(x, w)
  dx, dw = jax.jit(jax.grad(lambda x, w: raw_rms_norm(x, w).sum(), (0, 1)))(x, w)
  assert y.shape == (0, 40) and dx.shape == (0, 40)
  np.testing.assert_array_equal(dw, np.zeros(40, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_larger_shape(dtype):
  """More row blocks and a wider, odd hidden dim, with the heuristic's blocks."""
  x, w, rng = _inputs((130, 1000), dtype, seed=10)
  dy = rand(rng, x.shape, dtype)
  config = NormConfig(block_rows=8, num_warps=8, implementation="triton_raw")
  y, vjp = jax.vjp(lambda x, w: raw_rms_norm(x, w, config, offset=1.0), x, w)
  dx, dw = vjp(dy)
  with x64():
    y_ref, vjp_ref = jax.vjp(lambda x, w: rms_norm_ref(x, w, offset=1.0), *as64(x, w))
    dx_ref, dw_ref = vjp_ref(*as64(dy))
    for got, want, name in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dweight")):
      assert_close(got, want, dtype, name)
