"""The attention forward on Pallas Mosaic GPU (Hopper), with FlashAttention-3's structure.

One block of threads per (query head, tile of ``2 * block_q`` queries,
batch), three warpgroups:

* a producer warpgroup gives up most of its registers and issues TMA loads
  of the K and V blocks the tile can see into a ``num_stages``-deep SMEM
  ring, each slot with a "full" barrier per operand and a "consumed" barrier
  that both consumers release;
* two consumer warpgroups, ``block_q`` queries each, issue ``S = Q K^T`` and
  ``O += P V`` on the tensor cores with asynchronous ``wgmma`` and run the
  online softmax (in base 2) in between. A schedule barrier makes them take
  turns (ping-pong): one's softmax overlaps the other's matmuls. Each waits
  for the next block's K while its ``P V`` runs.

Blocks that causality or a window hide entirely are never loaded; those that
are partly hidden, and the block overhanging the keys' end, are masked; the
rest run without a mask. A consumer whose own rows see fewer blocks than the
tile's releases the others without computing, so both take the same turns.
GQA reads the kv head of the query head (never repeated). Sinks are applied
around the kernel (``common.with_sinks``). Head dims are padded to a multiple
of 64 and the query and key lengths to whole tiles, by XLA, when they are not.

Interpreted (the CPU check), the kernel takes K transposed in GMEM and stages
``P`` through SMEM (``pallax.pallas_mosaic_gpu.Form``); the tile maths, the
warpgroups, the ring and the barriers are the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallax import pallas_mosaic_gpu as mgpu
from pallax.executor.config import KernelConfig
from pallax.kernels.attention import common
from pallax.kernels.attention.common import NEG_INF, Call, Problem

IMPLEMENTATION = "pallas_mosaic_gpu"
_CONSUMERS = 2
_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttentionConfig(KernelConfig):
  """Blocks of the Mosaic GPU attention kernel.

  block_q: queries per consumer warpgroup (a multiple of 64, ``wgmma``'s
    rows); a block of threads takes ``2 * block_q``.
  block_k: keys per block of the K/V ring (a multiple of 64).
  num_stages: slots of the K/V ring (at least 2).
  """

  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  implementation: str = dataclasses.field(default=IMPLEMENTATION, kw_only=True)


CONFIG_CLS = MosaicGpuAttentionConfig


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _head(p: Problem) -> int:
  """The head dim the kernel runs: both head dims padded to one multiple of 64."""
  return _round_up(max(p.head_dim, p.value_dim), 64)


def feature_reason(p: Problem) -> Optional[str]:
  """Why the kernel cannot run a call's features, if it cannot (the Triton kernel then does)."""
  features = (
    (p.has_lengths, "lengths"),
    (p.has_bias, "bias"),
    (p.has_mask, "mask"),
    (p.has_segments, "segment ids"),
  )
  for present, name in features:
    if present:
      return f"the Mosaic GPU attention kernel takes no {name} yet"
  if jnp.dtype(p.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the Mosaic GPU attention kernel takes bfloat16 and float16, not {jnp.dtype(p.dtype)}"
  if _head(p) > 256:
    return f"head dims up to 256 on Mosaic GPU, got {max(p.head_dim, p.value_dim)}"
  if p.t == 0 or p.s == 0:
    return "no queries or no keys"
  return None


def smem_bytes(p: Problem, config: MosaicGpuAttentionConfig, hopper: bool = True) -> int:
  """SMEM of one block of threads: Q/O tiles, the K/V ring, lse (and P, interpreted)."""
  h, item = _head(p), p.dtype
  buffers = [
    ((_CONSUMERS, config.block_q, h), item),
    ((2 * config.num_stages, config.block_k, h), item),
    ((_CONSUMERS, config.block_q), jnp.float32),
  ]
  if not hopper:
    buffers.append(((_CONSUMERS, config.block_q, config.block_k), item))
  return mgpu.smem_bytes(*buffers)


def _space(p: Problem) -> list[MosaicGpuAttentionConfig]:
  """Ring shapes in order of preference: long key blocks, then more stages, within SMEM."""
  configs = [
    MosaicGpuAttentionConfig(block_k=bk, num_stages=st) for bk in (128, 64, 256) for st in (2, 3, 4)
  ]
  return [c for c in configs if smem_bytes(p, c) <= mgpu.SMEM_LIMIT]


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params):
  """128-key blocks in a 2-slot ring up to head dim 128, 64-key blocks at 256."""
  p = Problem.of(avals, **params)
  return MosaicGpuAttentionConfig(block_k=128 if _head(p) <= 128 else 64)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params):
  """The heuristic's config and every ring shape that fits SMEM."""
  p = Problem.of(avals, **params)
  return list(dict.fromkeys([heuristic(avals, target, stage=stage, **params), *_space(p)]))


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuAttentionConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the Mosaic GPU kernel cannot run this call with ``config``, if it cannot."""
  if stage != "fwd":
    return f"the Mosaic GPU attention kernels have no {stage} stage yet"
  p = Problem.of(avals, **params)
  reason = feature_reason(p)
  if reason is not None:
    return reason
  if config.block_q % mgpu.WGMMA_ROWS or config.block_k % 64:
    return f"blocks ({config.block_q}, {config.block_k}) must be multiples of 64 on Mosaic GPU"
  if config.num_stages < 2:
    return f"num_stages={config.num_stages}: the K/V ring needs at least 2 slots"
  if smem_bytes(p, config) > mgpu.SMEM_LIMIT:
    return f"{config} needs {smem_bytes(p, config)} bytes of SMEM, over {mgpu.SMEM_LIMIT}"
  return None


@dataclasses.dataclass(frozen=True)
class _Tile:
  """A block of threads' queries and the key blocks they see (traced int32 scalars)."""

  p: Problem
  bq: int
  bk: int

  def key_blocks(self, t0, rows: int):
    """``[lo, hi)``: the key blocks queries ``[t0, t0 + rows)`` can see."""
    return common.key_range(self.p, t0, rows, self.bk)

  def unmasked(self, t0, lo, hi):
    """``[u_lo, u_hi)`` within ``[lo, hi)``: key blocks every query of ``[t0, t0 + bq)`` sees."""
    p, bk, div = self.p, self.bk, lambda a: lax.div(a, jnp.int32(self.bk))
    u_hi = jnp.minimum(hi, p.s // bk)
    if p.right is not None:
      u_hi = jnp.minimum(u_hi, div(t0 + (p.right + 1)))
    u_hi = jnp.maximum(u_hi, lo)
    u_lo = lo
    if p.left is not None:
      u_lo = jnp.maximum(lo, div(jnp.maximum(t0 + (self.bq - 1 - p.left), 0) + (bk - 1)))
    return jnp.minimum(u_lo, u_hi), u_hi

  def keep(self, form: mgpu.Form, t0, j) -> Optional[jax.Array]:
    """Which logits of key block ``j`` the queries from ``t0`` see (None: all)."""
    shape = (self.bq, self.bk)
    t_pos = t0 + form.iota(shape, 0)
    s_pos = j * self.bk + form.iota(shape, 1)
    keep = common.visible(self.p, t_pos, s_pos)
    if self.p.s % self.bk:
      inside = s_pos < self.p.s
      keep = inside if keep is None else keep & inside
    return keep


def _logits2(p: Problem, qk: jax.Array) -> jax.Array:
  """The logits in base 2 (times log2 e), soft-capped."""
  if p.soft_cap is None:
    return qk * (p.scale * _LOG2E)
  return jnp.tanh(qk * (p.scale / p.soft_cap)) * (p.soft_cap * _LOG2E)


def _rows(x: jax.Array, shape) -> jax.Array:
  return lax.broadcast_in_dim(x, shape, [0])


def fwd(*operands, config: MosaicGpuAttentionConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(out, lse)``."""
  c = Call.of("fwd", operands, params)
  p = c.p
  reason = feature_reason(p)
  if reason is not None:
    raise NotImplementedError(f"dot_product_attention: {reason}")
  form = mgpu.Form.of(interpret)
  bq, bk, stages = config.block_q, config.block_k, config.num_stages
  h, rows = _head(p), _CONSUMERS * config.block_q
  tp, sp = _round_up(p.t, rows), _round_up(p.s, bk)

  def pad(x, axis: int, n: int):
    return jnp.pad(x, [(0, n - d if i == axis else 0) for i, d in enumerate(x.shape)])

  q = pad(pad(c.ops.q, 3, tp), 4, h)
  k = pad(pad(c.ops.k, 2, sp), 3, h)
  v = pad(pad(c.ops.v, 2, sp), 3, h)
  if not form.hopper:
    k = jnp.swapaxes(k, 2, 3)  # the interpreter's wgmma takes no transposed operand
  tile = _Tile(p, bq, bk)
  swizzled = mgpu.swizzle_transforms(p.dtype)

  def body(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped):
    (qo_smem, k_smem, v_smem, lse_smem, p_smem), full, consumed, schedule = scoped
    q_full, k_full, v_full = full
    k_consumed, v_consumed = consumed
    n, b, wg = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("wg")
    kh, g = lax.div(n, jnp.int32(p.groups)), lax.rem(n, jnp.int32(p.groups))
    t_tile = lax.axis_index("q") * rows
    lo, hi = tile.key_blocks(t_tile, rows)
    slot = lambda j: lax.rem(j - lo, jnp.int32(stages))

    def take_turn():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    def wait_keys(j):
      @pl.when(j < hi)
      def _():
        plgpu.barrier_wait(k_full.at[slot(j)])

    @pl.when(wg < _CONSUMERS)
    def _consumer():
      form.registers(mgpu.CONSUMER_REGISTERS, "increase")
      t0 = t_tile + wg * bq
      q_smem = qo_smem.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[b, kh, g, pl.ds(t0, bq)], q_smem, q_full.at[wg])
      plgpu.barrier_wait(q_full.at[wg])
      own_lo, own_hi = tile.key_blocks(t0, bq)
      own_lo, own_hi = jnp.maximum(own_lo, lo), jnp.minimum(jnp.maximum(own_hi, own_lo), hi)
      u_lo, u_hi = tile.unmasked(t0, own_lo, own_hi)

      def skip(j, carry):
        plgpu.barrier_wait(v_full.at[slot(j)])
        plgpu.barrier_arrive(k_consumed.at[slot(j)])
        plgpu.barrier_arrive(v_consumed.at[slot(j)])
        take_turn()
        take_turn()
        wait_keys(j + 1)
        return carry

      def step(j, carry, masked: bool):
        acc, m, denom = carry
        s = slot(j)
        keys = plgpu.transpose_ref(k_smem.at[s], (1, 0)) if form.hopper else k_smem.at[s]

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, keys)
          take_turn()
          plgpu.wgmma_wait(0)
          return acc_ref[...]

        qk = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[s])
        z = _logits2(p, qk)
        keep = tile.keep(form, t0, j) if masked else None
        if keep is not None:
          z = jnp.where(keep, z, NEG_INF)
        m_new = jnp.maximum(m, z.max(axis=1))
        m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if keep is not None else m_new
        alpha = jnp.exp2(m - m_use)
        e = jnp.exp2(z - _rows(m_use, z.shape))
        acc = acc * _rows(alpha, acc.shape)
        denom = denom * alpha + e.sum(axis=1)
        e16 = e.astype(p.dtype)
        acc, denom, m_new, e16 = form.barrier((acc, denom, m_new, e16))
        plgpu.barrier_arrive(schedule)  # done with the softmax
        plgpu.barrier_wait(v_full.at[s])
        plgpu.barrier_wait(schedule)  # the tensor cores are ours
        if form.hopper:
          weights = e16
        else:
          weights = p_smem.at[wg]
          weights[...] = e16
          plgpu.commit_smem()

        def values(acc_ref):
          plgpu.wgmma(acc_ref, weights, v_smem.at[s])
          wait_keys(j + 1)

        acc = form.accumulate(acc, values)
        plgpu.barrier_arrive(v_consumed.at[s])
        return acc, m_new, denom

      wgmma = plgpu.Layout.WGMMA
      init = (
        form.layout(jnp.zeros((bq, h), jnp.float32), wgmma),
        form.layout(jnp.full((bq,), NEG_INF, jnp.float32), wgmma.reduce(1)),
        form.layout(jnp.zeros((bq,), jnp.float32), wgmma.reduce(1)),
      )

      @pl.when(lo < hi)
      def _():
        plgpu.barrier_wait(k_full.at[0])

      pl.when(wg == 1)(take_turn)
      masked = lambda j, carry: step(j, carry, True)
      unmasked = lambda j, carry: step(j, carry, False)
      carry = lax.fori_loop(lo, own_lo, skip, init)
      carry = lax.fori_loop(own_lo, u_lo, masked, carry)
      carry = lax.fori_loop(u_lo, u_hi, unmasked, carry)
      carry = lax.fori_loop(u_hi, own_hi, masked, carry)
      acc, m, denom = lax.fori_loop(own_hi, hi, skip, carry)
      pl.when(wg == 0)(take_turn)

      empty = denom == 0.0
      denom = jnp.where(empty, 1.0, denom)
      acc = acc * _rows(1.0 / denom, acc.shape)
      q_smem[...] = acc.astype(p.dtype)
      lse_smem.at[wg][...] = jnp.where(empty, NEG_INF, m * _LN2 + jnp.log(denom))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, kh, g, pl.ds(t0, bq)])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, kh, g, pl.ds(t0, bq)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _CONSUMERS)
    def _producer():
      form.registers(mgpu.PRODUCER_REGISTERS, "decrease")

      def load(j):
        s, keys = slot(j), pl.ds(j * bk, bk)
        k_block = k_ref.at[b, kh, keys] if form.hopper else k_ref.at[b, kh, :, keys]
        plgpu.copy_gmem_to_smem(k_block, k_smem.at[s], k_full.at[s])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kh, keys], v_smem.at[s], v_full.at[s])

      for i in range(stages):
        pl.when(lo + i < hi)(lambda i=i: load(lo + i))

      @pl.loop(lo + stages, hi)
      def _(j):
        plgpu.barrier_wait(k_consumed.at[slot(j)])
        plgpu.barrier_wait(v_consumed.at[slot(j)])
        load(j)

      # Every release observed, the last ``stages`` too (the interpreter wants each phase seen).
      @pl.loop(jnp.maximum(hi - stages, lo), hi)
      def _(j):
        plgpu.barrier_wait(k_consumed.at[slot(j)])
        plgpu.barrier_wait(v_consumed.at[slot(j)])

  k_tile = (bk, h) if form.hopper else (h, bk)
  smem = [
    plgpu.SMEM((_CONSUMERS, bq, h), p.dtype, transforms=swizzled),
    plgpu.SMEM((stages, *k_tile), p.dtype, transforms=swizzled),
    plgpu.SMEM((stages, bk, h), p.dtype, transforms=swizzled),
    plgpu.SMEM((_CONSUMERS, bq), jnp.float32),
    None if form.hopper else plgpu.SMEM((_CONSUMERS, bq, bk), p.dtype, transforms=swizzled),
  ]

  def entry(q_ref, k_ref, v_ref, out_ref, lse_ref):
    pl.run_scoped(
      lambda *scoped: body(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped),
      smem,
      (
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
      ),
      (plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=stages),) * 2,
      plgpu.Barrier(num_arrivals=_CONSUMERS),
      collective_axes="wg",
    )

  lead = (p.batch, p.kv_heads, p.groups, tp)
  out_types = (jax.ShapeDtypeStruct((*lead, h), p.dtype), jax.ShapeDtypeStruct(lead, jnp.float32))
  kernel = plgpu.kernel(
    entry,
    out_type=out_types,
    grid=(p.kv_heads * p.groups, tp // rows, p.batch),
    grid_names=("heads", "q", "batch"),
    num_threads=_CONSUMERS + 1,
    thread_name="wg",
    compiler_params=plgpu.CompilerParams(approx_math=True),
    interpret=form.interpret,
  )
  out, lse = kernel(q, k, v) if form.hopper else mgpu.on_host(kernel, out_types, q, k, v)
  return c.results({"out": out[..., : p.t, : p.value_dim], "lse": lse[..., : p.t]})
