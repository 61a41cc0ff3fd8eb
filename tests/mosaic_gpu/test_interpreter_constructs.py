"""Which Pallas Mosaic GPU constructs JAX's GPU interpreter runs on a CPU (jax 0.10.2).

One small kernel per construct that the interpreter (``interpret=`` GPU
interpret params, ``pallax._jax_private.mosaic_gpu_interpret_params``) runs,
checked against a float64 numpy reference: TMA pipelines with tiling and
swizzle, ``wgmma`` into a ``run_scoped`` accumulator, explicit barriers, TMA
stores, warp specialisation (the pipeline helper and a hand-written
producer/consumer ring with ping-pong), cluster multicast, and an
online-softmax consumer loop. Where the interpreter cannot run the construct a
Hopper kernel uses (transposed ``wgmma`` operands, ``pl.run_state``
accumulators, ``plgpu.layout_cast``, register ``wgmma`` operands, pipeline
output specs), the kernel here is the variant with the same tile maths that
docs/mosaic_gpu.md names; ``test_kernels_lower_for_cuda`` lowers the real
constructs for a GPU.

bf16 inputs are exact in float32 products, so the matmul kernels (float32
accumulation) agree with float64 to float32 rounding: ``MATMUL_TOL``. The
attention kernel rounds the probabilities to bf16 before ``P @ V`` (as the
Hopper kernel does): ``SOFTMAX_TOL``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallax import _jax_private
from pallax._jax_private import mosaic_gpu_interpret_params

BF16 = jnp.bfloat16
MATMUL_TOL = 1e-5  # max abs error / max abs reference, float32 accumulation of 128-term sums
SOFTMAX_TOL = 1e-2  # max abs error, probabilities rounded to bf16 (8-bit mantissa)


def swizzled(dtype=BF16, swizzle: int = 128):
  """Shared-memory transforms for 128-byte swizzled rows (what TMA and wgmma want)."""
  return (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


def layout(x, interpret, wgmma_layout):
  """``plgpu.layout_cast`` on a GPU; the identity in the interpreter (no CPU rule)."""
  return x if interpret else plgpu.layout_cast(x, wgmma_layout)


def normal(seed: int, shape, dtype=BF16):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def f64(x):
  return np.asarray(x, np.float64)


def relative_error(out, ref) -> float:
  return float(np.max(np.abs(f64(out) - ref)) / np.max(np.abs(ref)))


def pipelined_matmul(
  a, b, interpret=None, *, transpose_a=False, transpose_b=False, tm=64, tn=128, tk=64, stages=3
):
  """``plgpu.emit_pipeline`` of TMA loads (tiling + swizzle), ``wgmma`` into a scoped ACC.

  The output tile leaves by an explicit TMA store: the pipeline's own
  ``out_specs`` issue predicated stores, which the interpreter refuses.
  ``transpose_a`` / ``transpose_b`` keep that operand transposed in GMEM and
  give ``wgmma`` its tile through ``plgpu.transpose_ref`` (lowers for a GPU;
  the interpreter cannot read a transposed operand).
  """
  (m, k), n = a.shape, b.shape[1]

  def operand(shape, index_map, transposed):
    if transposed:
      return plgpu.BlockSpec(
        shape[::-1], lambda s: index_map(s)[::-1], transforms=swizzled(), delay_release=1
      )
    return plgpu.BlockSpec(shape, index_map, transforms=swizzled(), delay_release=1)

  def body(a_gmem, b_gmem, o_gmem, o_smem):
    i, j = lax.axis_index("m"), lax.axis_index("n")

    def tile(acc):
      def step(_, a_smem, b_smem):
        if transpose_a:
          a_smem = plgpu.transpose_ref(a_smem, (1, 0))
        if transpose_b:
          b_smem = plgpu.transpose_ref(b_smem, (1, 0))
        plgpu.wgmma(acc, a_smem, b_smem)
        plgpu.wgmma_wait(1)

      plgpu.emit_pipeline(
        step,
        grid=(k // tk,),
        max_concurrent_steps=stages,
        in_specs=[
          operand((tm, tk), lambda s: (i, s), transpose_a),
          operand((tk, tn), lambda s: (s, j), transpose_b),
        ],
      )(a_gmem, b_gmem)
      plgpu.wgmma_wait(0)
      return acc[...]

    o_smem[...] = pl.run_scoped(tile, plgpu.ACC((tm, tn), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * tm, tm), pl.ds(j * tn, tn)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
    scratch_types=[plgpu.SMEM((tm, tn), jnp.float32)],
    grid=(m // tm, n // tn),
    grid_names=("m", "n"),
    interpret=interpret,
  )(a.T if transpose_a else a, b.T if transpose_b else b)


def multiply_and_store(a_smem, b_smem, o_smem, o_gmem, barriers):
  """Waits for both operands' barriers, ``wgmma`` + ``wgmma_wait``, TMA-stores the product."""
  plgpu.barrier_wait(barriers.at[0])
  plgpu.barrier_wait(barriers.at[1])

  def product(acc):
    plgpu.wgmma(acc, a_smem, b_smem)
    plgpu.wgmma_wait(0)
    return acc[...]

  o_smem[...] = pl.run_scoped(product, plgpu.ACC(o_smem.shape, jnp.float32))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem)
  plgpu.wait_smem_to_gmem(0)


def barrier_matmul_scratch(m: int, k: int, n: int) -> list:
  """SMEM for an (m, k) x (k, n) bf16 product loaded on two barriers, and its f32 result."""
  return [
    plgpu.SMEM((m, k), BF16, transforms=swizzled()),
    plgpu.SMEM((k, n), BF16, transforms=swizzled()),
    plgpu.SMEM((m, n), jnp.float32),
    plgpu.Barrier(num_barriers=2),
  ]


def barrier_matmul(a, b, interpret=None):
  """``copy_gmem_to_smem`` on explicit barriers, ``barrier_wait``, ``wgmma`` + ``wgmma_wait``."""
  (m, k), n = a.shape, b.shape[1]

  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, barriers):
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, barriers.at[1])
    multiply_and_store(a_smem, b_smem, o_smem, o_gmem, barriers)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
    scratch_types=barrier_matmul_scratch(m, k, n),
    interpret=interpret,
  )(a, b)


def tma_store_scale(x, interpret=None):
  """Registers -> SMEM, ``commit_smem``, ``copy_smem_to_gmem``, ``wait_smem_to_gmem``."""

  def body(x_gmem, o_gmem, x_smem, o_smem, barriers):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])
    o_smem[...] = x_smem[...] * 2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
    scratch_types=[
      plgpu.SMEM(x.shape, x.dtype),
      plgpu.SMEM(x.shape, x.dtype),
      plgpu.Barrier(num_barriers=1),
    ],
    interpret=interpret,
  )(x)


def warp_specialized_pipeline_matmul(a, b, interpret=None):
  """``emit_pipeline_warp_specialized``: a TMA warpgroup feeds 2 consumer warpgroups.

  Each consumer owns 64 rows; the carry is a register accumulator. Each step's
  product comes from a scoped ACC added to the carry (the interpreter has no
  rule for ``pl.run_state``, which would accumulate in place).
  """
  (m, k), n = a.shape, b.shape[1]
  rows = m // 2

  def body(a_gmem, b_gmem, o_gmem, o_smem):
    wg = lax.axis_index("wg")

    def compute_context(pipeline):
      acc = pipeline(layout(jnp.zeros((rows, n), jnp.float32), interpret, plgpu.Layout.WGMMA))
      o_smem.at[wg][...] = acc
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[pl.ds(wg * rows, rows)])
      plgpu.wait_smem_to_gmem(0)

    def step(_, a_smem, b_smem, carry):
      def product(acc):
        plgpu.wgmma(acc, a_smem.at[pl.ds(wg * rows, rows)], b_smem)
        return acc[...]

      return carry + pl.run_scoped(product, plgpu.ACC((rows, n), jnp.float32))

    plgpu.emit_pipeline_warp_specialized(
      step,
      grid=(k // 64,),
      memory_registers=40,
      in_specs=[
        plgpu.BlockSpec((m, 64), lambda s: (0, s), transforms=swizzled()),
        plgpu.BlockSpec((64, n), lambda s: (s, 0), transforms=swizzled()),
      ],
      max_concurrent_steps=2,
      wg_axis="wg",
      num_compute_wgs=2,
      compute_context=compute_context,
    )(a_gmem, b_gmem)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
    scratch_types=[plgpu.SMEM((2, rows, n), jnp.float32)],
    num_threads=3,
    thread_name="wg",
    interpret=interpret,
  )(a, b)


def ping_pong_matmul(a, b, interpret=None, *, stages=2):
  """Hand-written warp specialisation: ``num_threads=3``, ``axis_index("wg")``.

  Warpgroup 2 issues TMA loads into a ``stages``-deep SMEM ring (``full``
  barriers, two copies each); warpgroups 0 and 1 each multiply their 64 rows,
  release the slot (``consumed``, two arrivals), and take turns on the tensor
  core through a schedule barrier (FlashAttention-3's ping-pong). The producer
  waits for the last ``stages`` releases before it exits, which the
  interpreter requires (a hardware kernel may leave them unobserved).
  """
  (m, k), n = a.shape, b.shape[1]
  rows, steps = m // 2, k // 64

  def body(a_gmem, b_gmem, o_gmem, scoped):
    (a_smem, b_smem, o_smem), full, consumed, schedule = scoped
    wg = lax.axis_index("wg")

    def take_turn():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < 2)
    def _consumer():
      pl.when(wg == 1)(take_turn)

      def step(s, acc):
        slot = lax.rem(s, stages)
        plgpu.barrier_wait(full.at[slot])

        def product(acc_ref):
          plgpu.wgmma(acc_ref, a_smem.at[slot, pl.ds(wg * rows, rows)], b_smem.at[slot])
          take_turn()
          plgpu.wgmma_wait(0)
          return acc_ref[...]

        acc = acc + pl.run_scoped(product, plgpu.ACC((rows, n), jnp.float32))
        plgpu.barrier_arrive(consumed.at[slot])
        return acc

      zeros = layout(jnp.zeros((rows, n), jnp.float32), interpret, plgpu.Layout.WGMMA)
      acc = lax.fori_loop(0, steps, step, zeros)
      pl.when(wg == 0)(take_turn)
      o_smem.at[wg][...] = acc
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[pl.ds(wg * rows, rows)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
      @pl.loop(0, steps)
      def _(s):
        slot = lax.rem(s, stages)

        @pl.when(s >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[slot])

        plgpu.copy_gmem_to_smem(a_gmem.at[:, pl.ds(s * 64, 64)], a_smem.at[slot], full.at[slot])
        plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(s * 64, 64)], b_smem.at[slot], full.at[slot])

      # The interpreter wants every phase of a barrier a thread waits on
      # observed by it: wait for the last steps' releases too.
      @pl.loop(max(steps - stages, 0), steps)
      def _(s):
        plgpu.barrier_wait(consumed.at[lax.rem(s, stages)])

  def entry(a_gmem, b_gmem, o_gmem):
    pl.run_scoped(
      lambda *scoped: body(a_gmem, b_gmem, o_gmem, scoped),
      [
        plgpu.SMEM((stages, m, 64), BF16, transforms=swizzled()),
        plgpu.SMEM((stages, 64, n), BF16, transforms=swizzled()),
        plgpu.SMEM((2, rows, n), jnp.float32),
      ],
      plgpu.Barrier(num_barriers=stages, num_arrivals=2),
      plgpu.Barrier(num_barriers=stages, num_arrivals=2),
      plgpu.Barrier(num_arrivals=2),
      collective_axes="wg",
    )

  return plgpu.kernel(
    entry,
    out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
    num_threads=3,
    thread_name="wg",
    interpret=interpret,
  )(a, b)


def multicast_matmul(a, b, interpret=None):
  """A cluster of 2 blocks: each loads its 64 rows of ``a``; ``b`` is multicast to both."""
  (m, k), n = a.shape, b.shape[1]
  rows = m // 2

  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, barriers):
    c = lax.axis_index("c")
    plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(c * rows, rows)], a_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, barriers.at[1], collective_axes="c")
    multiply_and_store(a_smem, b_smem, o_smem, o_gmem.at[pl.ds(c * rows, rows)], barriers)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
    scratch_types=barrier_matmul_scratch(rows, k, n),
    cluster=(2,),
    cluster_names=("c",),
    grid=(2,),
    grid_names=("g",),
    interpret=interpret,
  )(a, b)


def online_softmax_attention(q, k, v, interpret=None, *, block_kv=64):
  """One consumer warpgroup's FlashAttention forward loop: ``softmax(q k^T) v``.

  On a GPU (``interpret`` None) the Hopper form: ``S = Q K^T`` with K's tile
  transposed in SMEM (``plgpu.transpose_ref``), P kept in registers as the
  ``wgmma`` left operand, ``P @ V`` accumulated in place into the rescaled
  output (``pl.run_state`` of ``plgpu.ACC.init``), and ``plgpu.layout_cast``
  layouts. The interpreter runs none of those four, so interpreted the same
  tile maths takes K transposed in GMEM (a plain (head_dim, block_kv) tile),
  stores P to SMEM as bf16, and adds a scoped ACC's ``P @ V`` to the rescaled
  output. The running max, the rescale and the row sums are computed on the
  accumulator's value either way.
  """
  block_q, head_dim = q.shape
  kv_len = v.shape[0]
  hopper = interpret is None
  k_tile = (block_kv, head_dim) if hopper else (head_dim, block_kv)

  def body(q_gmem, k_gmem, v_gmem, o_gmem, q_smem, k_smem, v_smem, p_smem, o_smem, barriers):
    plgpu.copy_gmem_to_smem(q_gmem, q_smem, barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])

    def step(s, carry):
      acc, m_i, l_i = carry
      kv = pl.ds(s * block_kv, block_kv)
      plgpu.copy_gmem_to_smem(k_gmem.at[kv] if hopper else k_gmem.at[:, kv], k_smem, barriers.at[1])
      plgpu.copy_gmem_to_smem(v_gmem.at[kv], v_smem, barriers.at[2])
      plgpu.barrier_wait(barriers.at[1])

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem, (1, 0)) if hopper else k_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      qk = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
      m_new = jnp.maximum(m_i, qk.max(axis=1))
      alpha = jnp.exp(m_i - m_new)
      p = jnp.exp(qk - lax.broadcast_in_dim(m_new, qk.shape, [0])).astype(BF16)
      l_i = l_i * alpha + p.astype(jnp.float32).sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      plgpu.barrier_wait(barriers.at[2])
      if hopper:
        return (
          pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p, v_smem))(plgpu.ACC.init(acc)),
          m_new,
          l_i,
        )
      p_smem[...] = p
      plgpu.commit_smem()

      def weighted_values(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

      acc = acc + pl.run_scoped(weighted_values, plgpu.ACC((block_q, head_dim), jnp.float32))
      return acc, m_new, l_i

    init = (
      layout(jnp.zeros((block_q, head_dim), jnp.float32), interpret, plgpu.Layout.WGMMA),
      layout(jnp.full((block_q,), -jnp.inf, jnp.float32), interpret, plgpu.Layout.WGMMA.reduce(1)),
      layout(jnp.zeros((block_q,), jnp.float32), interpret, plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, _, l_i = lax.fori_loop(0, kv_len // block_kv, step, init)
    o_smem[...] = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((block_q, head_dim), jnp.float32),
    scratch_types=[
      plgpu.SMEM((block_q, head_dim), BF16, transforms=swizzled()),
      plgpu.SMEM(k_tile, BF16, transforms=swizzled()),
      plgpu.SMEM((block_kv, head_dim), BF16, transforms=swizzled()),
      plgpu.SMEM((block_q, block_kv), BF16, transforms=swizzled()),
      plgpu.SMEM((block_q, head_dim), jnp.float32),
      plgpu.Barrier(num_barriers=3),
    ],
    interpret=interpret,
  )(q, k if hopper else k.T, v)


def softmax_attention_reference(q, k, v):
  scores = f64(q) @ f64(k).T
  p = np.exp(scores - scores.max(axis=1, keepdims=True))
  return (p / p.sum(axis=1, keepdims=True)) @ f64(v)


def interpreted(kernel, *args):
  return jax.jit(functools.partial(kernel, interpret=mosaic_gpu_interpret_params()))(*args)


@pytest.fixture(scope="module")
def operands():
  return normal(0, (128, 192)), normal(1, (192, 128))


def test_pipeline_of_tma_loads_into_wgmma(operands):
  a, b = operands
  out = interpreted(pipelined_matmul, a, b)  # 3 K steps, 3 stages, 2x1 grid
  assert relative_error(out, f64(a) @ f64(b)) < MATMUL_TOL


def test_explicit_barriers_and_wgmma_wait():
  a, b = normal(2, (64, 64)), normal(3, (64, 128))
  assert relative_error(interpreted(barrier_matmul, a, b), f64(a) @ f64(b)) < MATMUL_TOL


def test_tma_store_from_registers():
  x = normal(4, (64, 128), jnp.float32)
  np.testing.assert_array_equal(f64(interpreted(tma_store_scale, x)), f64(x) * 2)  # exact


def test_warp_specialized_pipeline(operands):
  a, b = operands
  out = interpreted(warp_specialized_pipeline_matmul, a, b)
  assert relative_error(out, f64(a) @ f64(b)) < MATMUL_TOL


def test_producer_and_ping_pong_consumers(operands):
  a, b = operands
  out = interpreted(ping_pong_matmul, a, b)  # 3 K steps through a 2-slot ring
  assert relative_error(out, f64(a) @ f64(b)) < MATMUL_TOL


def test_each_thread_program_compiles_once(operands, monkeypatch):
  """The 3 warpgroups of a call, and the next call, run one compiled program."""
  traced = []

  def evaluate(jaxpr, consts, *args):
    traced.append(jaxpr)
    jax.core.eval_jaxpr(jaxpr, consts, *args)

  monkeypatch.setattr(_jax_private, "_eval_thread_program", evaluate)
  a, b = operands
  kernel = jax.jit(functools.partial(ping_pong_matmul, interpret=mosaic_gpu_interpret_params()))
  for _ in range(2):
    assert relative_error(kernel(a, b), f64(a) @ f64(b)) < MATMUL_TOL
  assert len(traced) == 1, f"pallax's cache compiled the warpgroups' program {len(traced)} times"


def test_cluster_multicast(operands):
  a, b = operands
  out = interpreted(multicast_matmul, a, b)
  assert relative_error(out, f64(a) @ f64(b)) < MATMUL_TOL


def test_online_softmax_on_the_accumulator():
  q, k, v = normal(5, (64, 64)), normal(6, (192, 64)), normal(7, (192, 64))
  out = interpreted(online_softmax_attention, q, k, v)  # 3 KV blocks
  ref = softmax_attention_reference(q, k, v)
  assert np.max(np.abs(f64(out) - ref)) < SOFTMAX_TOL


MATMUL_ARGS = ((128, 192), (192, 128))


@pytest.mark.compilers
@pytest.mark.parametrize(
  "kernel, shapes",
  [
    (pipelined_matmul, MATMUL_ARGS),
    (functools.partial(pipelined_matmul, transpose_a=True), MATMUL_ARGS),
    (functools.partial(pipelined_matmul, transpose_b=True), MATMUL_ARGS),
    (barrier_matmul, ((64, 64), (64, 128))),
    (tma_store_scale, ((64, 128),)),
    (warp_specialized_pipeline_matmul, MATMUL_ARGS),
    (ping_pong_matmul, MATMUL_ARGS),
    (multicast_matmul, MATMUL_ARGS),
    (online_softmax_attention, ((64, 64), (192, 64), (192, 64))),
  ],
  ids=[
    "pipeline",
    "transposed_a",
    "transposed_b",
    "barriers",
    "tma_store",
    "ws_pipeline",
    "ping_pong",
    "multicast",
    "online_softmax",
  ],
)
def test_kernels_lower_for_cuda(kernel, shapes):
  """Each kernel, in its GPU form (``interpret`` None), lowers to one Mosaic GPU call.

  That form includes what the interpreter cannot run: transposed ``wgmma``
  operands, ``plgpu.layout_cast``, and the attention loop's register P
  operand and in-place ``pl.run_state`` accumulation.
  """
  args = [jax.ShapeDtypeStruct(shape, BF16) for shape in shapes]
  lowered = jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("mosaic_gpu_v2") == 1
