"""The attention tangent (``jvp``) on Pallas Mosaic GPU (Hopper): one pass from the saved ``lse``.

A query-side kernel (``query_side.QueryKernel``), head dims up to 128: each of
its consumers (two up to head dim 64, one above: ``config.wide_consumers``)
keeps its 64 queries' Q, their tangent dQ and lse, and the producer streams
K, V and their tangents dK, dV. Per key block:
``P = exp2(S - lse)``, the logits' tangent ``dS = scale (dQ K^T + Q dK^T)``
(two ``wgmma`` into one accumulator, times the soft cap's slope), and
``A += (P dS) V + P dV``, ``r += rowsum(P dS)``. Then ``out_dot = A - r out``
(by XLA, from the forward's ``out``) and ``lse_dot = r``: the tangent the
Triton kernel computes (``common.tangent_block``), linear in (dq, dk, dv).
Sinks are applied around it (``common.with_sinks``). ``P dV`` is issued
before the wait for the tangent logits and ``(P dS) V`` computed beside it
(``Form.pipeline``); where a step has no mask, S runs with the tangent logits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.config import (
  BWD_BLOCKS,
  DQ_ROWS,
  MosaicGpuAttentionConfig,
  call_of,
  head,
  round_up,
  wide_consumers,
)
from pallax.kernels.attention.mosaic_gpu.query_side import QueryKernel
from pallax.kernels.attention.mosaic_gpu.tiles import broadcast
from pallax.pallas_mosaic_gpu import plgpu


def jvp(*operands, config: MosaicGpuAttentionConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(out_dot, lse_dot)``."""
  c, p, form = call_of("jvp", operands, params, interpret)
  ops = c.ops
  h, bk = head(p), BWD_BLOCKS[1]
  consumers = wide_consumers(h)
  tp, sp = round_up(p.t, consumers * DQ_ROWS), round_up(p.s, bk)
  rows = lambda x: tiles.pad(x, {3: tp, 4: h})
  keys = lambda x: tiles.pad(x, {2: sp, 3: h})
  lse = tiles.pad(tiles.lse2(ops.lse.astype(jnp.float32)), {3: tp}, jnp.inf)
  kernel = QueryKernel(
    p,
    ops,
    form,
    config.num_stages,
    bk,
    consumers,
    own_tiles={"q": rows(ops.q), "dq": rows(ops.q_dot.astype(p.dtype))},
    own_stats={"lse": lse},
    ring={
      "k": keys(ops.k),
      "v": keys(ops.v),
      "dk": keys(ops.k_dot.astype(p.dtype)),
      "dv": keys(ops.v_dot.astype(p.dtype)),
    },
    transposed=("k", "dk"),
    outs={"a": (jnp.float32, True), "r": (jnp.float32, False)},
    name="dot_product_attention_jvp",
    # One loop with one consumer even without masks (unlike the dk/dv
    # kernel's rule): a ragged last key block is masked, and the two loops
    # spilled 4 bytes at head dim 128 for that alone.
    one_loop=consumers == 1,
    staged=2,
  )
  shape = (DQ_ROWS, bk)

  def step(ctx, j, carry, hide):
    a, r = carry
    s = lambda acc_ref: plgpu.wgmma(acc_ref, ctx.own["q"], ctx.tile_t("k"))

    def softmax(x):  # P and the cap's slope
      z, slope = tiles.logits2(p, x, cap_grad=True)
      return jnp.exp2(hide(z) - broadcast(ctx.stats["lse"], shape, 0)), slope

    # S and the tangent logits run at once in steps without a mask; masked,
    # S's softmax comes before them (registers).
    together = ctx.masked is False
    probs = None if together else softmax(mgpu.fresh_product(shape, s))
    ctx.ring.wait(2, j)
    zeros = form.layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

    def products(refs, read):
      """The tangent logits dS, then A += P dV beside them and A += (P dS) V beside that."""
      a_ref, ds_ref, *s_ref = refs
      if s_ref:
        s(s_ref[0])
      plgpu.wgmma(ds_ref, ctx.own["dq"], ctx.tile_t("k"))
      plgpu.wgmma(ds_ref, ctx.own["q"], ctx.tile_t("dk"))
      weights, slope = softmax(read(2, 2)) if s_ref else probs
      ctx.ring.wait(3, j)
      plgpu.wgmma(a_ref, ctx.operand(weights.astype(p.dtype)), ctx.tile("dv"))
      ds = read(1, 1) * p.scale
      ctx.ring.release(0, j)
      ctx.ring.release(2, j)
      pds = weights * (ds if slope is None else ds * slope)
      ctx.ring.wait(1, j)
      plgpu.wgmma(a_ref, ctx.operand(pds.astype(p.dtype), 1), ctx.tile("v"))
      return (r + pds.sum(axis=1),)

    accs = (a, zeros) + ((zeros,) if together else ())
    (a, *_), (r,) = form.pipeline(accs, products, (r,))
    ctx.ring.release(1, j)
    ctx.ring.release(3, j)
    return a, r

  def init(ctx):
    wgmma = plgpu.Layout.WGMMA
    return (
      form.layout(jnp.zeros((DQ_ROWS, h), jnp.float32), wgmma),
      form.layout(jnp.zeros((DQ_ROWS,), jnp.float32), wgmma.reduce(1)),
    )

  a, r = kernel(init, step, lambda ctx, carry: dict(zip("ar", carry)), tp, h)
  a, r = a[..., : p.t, : p.value_dim], r[..., : p.t]
  out_dot = a - r[..., None] * ops.out.astype(jnp.float32)
  return c.results({"out_dot": out_dot.astype(ops.out.dtype), "lse_dot": r})
