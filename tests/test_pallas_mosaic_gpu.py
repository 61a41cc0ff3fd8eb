"""``pallax.pallas_mosaic_gpu.Form``: ``pipeline``'s products in flight, and ``opaque_zero``.

``Form.pipeline``: products in flight at once, read before the last.

A kernel of one consumer issues products onto two accumulators (the first
starting from a nonzero tile), reads the first while the second's product
may still run, adds another product to the first after the read and returns
work on the read value as a result. Interpreted against float64 (16-bit
products are exact in float32: float32 rounding of the sums), and compiled
for H100 without spills (the Hopper form: one ``pl.run_state``,
``wgmma_accumulator_load(wait_n=1)``). Interpreted, ``read`` waits for every
product (JAX's GPU interpreter runs a ``wgmma`` when it is issued), so a
wrong ``pending`` shows only on a GPU: under ``PALLAX_TEST_PLATFORM=gpu``
on an H100 or H200 the numerics test runs the Hopper form.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallax import pallas_mosaic_gpu as mgpu
from pallax.pallas_mosaic_gpu import plgpu
from tests.helpers import NATIVE_KERNELS, f64

N = 64
START = 2.0  # the first accumulator's start
TOL = 1e-5  # float32 sums of exact products, relative to the largest value


def _pipelined(form: mgpu.Form, a: jax.Array, b: jax.Array) -> list[jax.Array]:
  """``(START + a b + b b, b a, 3 (START + a b))``: the last computed while ``b a`` runs."""
  tile = jax.ShapeDtypeStruct((N, N), jnp.float32)
  swizzled = lambda: plgpu.SMEM((N, N), a.dtype, transforms=mgpu.swizzle_transforms(a.dtype))

  def body(a_ref, b_ref, *refs):
    *out_refs, ((a_smem, b_smem, out_smem), loaded) = refs

    def consumer(_):
      plgpu.copy_gmem_to_smem(a_ref, a_smem, loaded)
      plgpu.copy_gmem_to_smem(b_ref, b_smem, loaded)
      plgpu.barrier_wait(loaded)

      def issue(acc_refs, read):
        plgpu.wgmma(acc_refs[0], a_smem, b_smem)
        plgpu.wgmma(acc_refs[1], b_smem, a_smem)
        tripled = read(0, 1) * 3.0  # the second product may still run
        plgpu.wgmma(acc_refs[0], b_smem, b_smem)  # after the read: not in it
        return (tripled,)

      start = form.layout(jnp.full((N, N), START, jnp.float32), plgpu.Layout.WGMMA)
      zeros = form.zeros((N, N))
      (first, second), (tripled,) = form.pipeline((start, zeros), issue, (zeros,))
      for k, x in enumerate((first, second, tripled)):
        out_smem.at[k][...] = x
      plgpu.commit_smem()
      for k, ref in enumerate(out_refs):
        plgpu.copy_smem_to_gmem(out_smem.at[k], ref)
      plgpu.wait_smem_to_gmem(0)

    form.warpgroups(1, consumer)

  scratch = [
    [swizzled(), swizzled(), plgpu.SMEM((3, N, N), jnp.float32)],
    plgpu.Barrier(num_arrivals=2),
  ]
  return form.launch(
    body,
    [a, b],
    [tile] * 3,
    grid=(1,),
    grid_names=("x",),
    scratch=scratch,
    name="pipeline_test",
    consumers=1,
  )


def _inputs():
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.standard_normal((N, N)), jnp.bfloat16) for _ in range(2)]


def test_a_read_returns_the_start_plus_the_products_issued_before_it():
  a, b = _inputs()
  form = mgpu.Form(hopper="mosaic_gpu" in NATIVE_KERNELS)
  first, second, tripled = _pipelined(form, a, b)
  ab, ba, bb = f64(a) @ f64(b), f64(b) @ f64(a), f64(b) @ f64(b)
  for got, want in ((first, START + ab + bb), (second, ba), (tripled, 3 * (START + ab))):
    assert np.max(np.abs(f64(got) - want)) / np.max(np.abs(want)) < TOL


@pytest.mark.compilers
def test_the_hopper_form_compiles_for_h100_without_spills():
  from pallax.verify.compile import compile_kernels, judge
  from pallax.verify.targets import TARGETS

  h100 = TARGETS["h100"]
  args = [jax.ShapeDtypeStruct((N, N), jnp.bfloat16)] * 2
  fn = lambda a, b: _pipelined(mgpu.Form(hopper=True), a, b)
  kernels = compile_kernels(fn, args, h100, mgpu.IMPLEMENTATION)
  assert [k["name"] for k in kernels] == ["pipeline_test_mosaic_gpu_kernel"]
  assert judge(kernels, h100) == {"status": "ok"}, kernels


@pytest.mark.parametrize("producer", [False, True])
def test_a_register_split_over_the_block_is_refused(producer):
  """Two consumers of 248 and a producer of 32 take 528 of 512 registers a thread (a GPU hangs)."""
  consumer, rest = mgpu.WIDE_REGISTERS
  assert 2 * consumer + rest == 512  # the widest split that fits
  with pytest.raises(ValueError, match=r"registers=\(248, 32\)"):
    mgpu.Form(hopper=False)._registers(2, (248, 32), producer=producer)


def _through_tile(form: mgpu.Form, x: jax.Array, pause: float = 0.0) -> jax.Array:
  """``x`` by TMA into SMEM tile 0 of two and out of tile ``opaque_zero()`` (after ``pause`` s)."""

  def body(x_ref, out_ref, scoped):
    tiles, loaded = scoped

    def consumer(_):
      plgpu.copy_gmem_to_smem(x_ref, tiles.at[0], loaded)
      plgpu.barrier_wait(loaded)
      time.sleep(pause)  # while tracing: another thread's kernel may be traced meanwhile
      plgpu.copy_smem_to_gmem(tiles.at[form.opaque_zero()], out_ref)
      plgpu.wait_smem_to_gmem(0)

    form.warpgroups(1, consumer)

  (out,) = form.launch(
    body,
    [x],
    [jax.ShapeDtypeStruct(x.shape, x.dtype)],
    grid=(1,),
    grid_names=("x",),
    scratch=[plgpu.SMEM((2, *x.shape), x.dtype), plgpu.Barrier(num_arrivals=1)],
    name="opaque_zero_test",
    consumers=1,
  )
  return out


def test_opaque_zero_indexes_as_zero():
  x = jnp.asarray(np.random.default_rng(1).standard_normal((N, N)), jnp.float32)
  got = _through_tile(mgpu.Form(hopper="mosaic_gpu" in NATIVE_KERNELS), x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))


def test_opaque_zero_reads_its_own_threads_kernel():
  """Autotuning traces kernels in a pool of threads: each kernel reads its own zero.

  The first thread's kernel reads its zero while the second's is being
  traced (a zero shared by the threads: a ref of the other kernel's jaxpr).
  """
  x = jax.ShapeDtypeStruct((N, N), jnp.float32)
  trace = lambda pause: jax.make_jaxpr(lambda x: _through_tile(mgpu.Form(True), x, pause))(x)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    jaxprs = list(pool.map(trace, [0.3, 1.0]))
  assert all(j.eqns for j in jaxprs)
  assert not mgpu._STEP_ZERO.refs  # every launch's zero popped


def test_opaque_zero_outside_a_launch_raises():
  with pytest.raises(RuntimeError, match="opaque_zero: only in the body of a kernel"):
    mgpu.Form(hopper=False).opaque_zero()
