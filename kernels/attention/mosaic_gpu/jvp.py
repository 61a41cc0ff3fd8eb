"""The attention tangent (``jvp``) on Pallas Mosaic GPU (Hopper): one pass from the saved ``lse``.

A query-side kernel (``query_side.QueryKernel``): each of its consumers (two
up to head dim 64, one above: ``config.wide_consumers``) keeps its 64
queries' Q, their tangent dQ and lse, and the producer streams K, V and
their tangents dK, dV. Above head dim 128 blocks of threads split the
output's columns (``config.out_cols``): each computes S and dS whole and
streams V and dV in its columns alone (32 keys a step where a 2-slot ring
of 64 overflows SMEM: at head dim 256, and with some biases:
``config.jvp_block_k``). Per key block:
``P = exp2(S - lse)``, the logits' tangent ``dS = scale (dQ K^T + Q dK^T)``
(two ``wgmma`` into one accumulator, times the soft cap's slope), and
``A += (P dS) V + P dV``, ``r += rowsum(P dS)``. Then ``out_dot = A - r out``
(by XLA, from the forward's ``out``) and ``lse_dot = r``: the tangent the
Triton kernel computes (``common.tangent_block``), linear in (dq, dk, dv).
With a bias (or a mask: ``tiles.logit_bias``) the producer streams its
tile of the block of threads' rows with the keys, and the bias' tangent's
beside it: added to the logits and to ``dS`` (after the cap's slope).
Sinks are applied around it (``common.with_sinks``). ``P dV`` is issued
before the wait for the tangent logits and ``(P dS) V`` computed beside it
(``Form.pipeline``); in a loop of unmasked steps (``tiles.over_steps``; not
above head dim 64, one loop) S runs with the tangent logits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallax.kernels.attention.mosaic_gpu import tiles
from pallax.kernels.attention.mosaic_gpu.config import (
  DQ_ROWS,
  MosaicGpuAttentionConfig,
  call_of,
  head,
  jvp_block_k,
  logit_bias_dtype,
  out_cols,
  round_up,
  wide_consumers,
)
from pallax.kernels.attention.mosaic_gpu.query_side import QueryKernel
from pallax.pallas_mosaic_gpu import plgpu


def jvp(*operands, config: MosaicGpuAttentionConfig, interpret: Any, **params) -> list[jax.Array]:
  """``(out_dot, lse_dot)``."""
  c, p, form = call_of("jvp", operands, params, interpret)
  ops = c.ops
  h, bk, cols = head(p), jvp_block_k(p), out_cols(p, "jvp")
  consumers = wide_consumers(h)
  tp, sp = round_up(p.t, consumers * DQ_ROWS), round_up(p.s, bk)
  rows = lambda x: tiles.pad(x, {3: tp, 4: h})
  keys = lambda x: tiles.pad(x, {2: sp, 3: h})
  lse = tiles.pad(tiles.lse2(ops.lse.astype(jnp.float32)), {3: tp}, jnp.inf)
  bias_dtype = logit_bias_dtype(p)
  bias = tiles.logit_bias(ops, bias_dtype, tp, sp)
  row_tiles = {} if bias is None else {"bias": bias}
  if ops.bias_dot is not None:  # a constant bias has none (``Problem.differentiates_bias``)
    row_tiles["bias_dot"] = tiles.pad(ops.bias_dot.astype(bias_dtype), {3: tp, 4: sp})
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
    cols=cols,
    staged=2,
    shared=("v", "dv"),
    row_tiles=row_tiles,
  )
  shape = (DQ_ROWS, bk)

  def step(ctx, j, carry, hide):
    a, r = carry

    def products(refs, read, ready):
      """The tangent logits dS (S's softmax beside them), P dV beside P dS, then (P dS) V."""
      a_ref, ds_ref = refs
      plgpu.wgmma(ds_ref, ctx.own["dq"], ctx.tile_t("k"))
      plgpu.wgmma(ds_ref, ctx.own["q"], ctx.tile_t("dk"))
      probs, slope = ready(2)
      ctx.ring.wait(3, j)
      plgpu.wgmma(a_ref, ctx.operand(probs.astype(p.dtype)), ctx.tile("dv"))
      ds = read(1, 1) * p.scale
      ds = ds if slope is None else ds * slope
      if "bias_dot" in ctx.row_refs:  # read before its slot (the keys' group) is released
        ds = ds + ctx.row_tile("bias_dot").astype(jnp.float32)
      ctx.ring.release(0, j)
      ctx.ring.release(2, j)
      pds = probs * ds
      ctx.ring.wait(1, j)
      plgpu.wgmma(a_ref, ctx.operand(pds.astype(p.dtype), 1), ctx.tile("v"))
      return (r + pds.sum(axis=1),)

    def starts():  # dK's wait: before an unmasked step's S, after a masked step's softmax
      ctx.ring.wait(2, j)
      return a, form.zeros(shape)

    (a, _), (r,) = ctx.pipeline(starts, products, hide, (r,))
    ctx.ring.release(1, j)
    ctx.ring.release(3, j)
    return a, r

  def init(ctx):
    rows = plgpu.Layout.WGMMA.reduce(1)
    return form.zeros((DQ_ROWS, cols)), form.layout(jnp.zeros((DQ_ROWS,), jnp.float32), rows)

  a, r = kernel(init, step, lambda ctx, carry: dict(zip("ar", carry)), tp, h)
  a, r = a[..., : p.t, : p.value_dim], r[..., : p.t]
  out_dot = a - r[..., None] * ops.out.astype(jnp.float32)
  return c.results({"out_dot": out_dot.astype(ops.out.dtype), "lse_dot": r})
