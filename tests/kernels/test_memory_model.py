"""One on-chip memory model (``pallax.pallas_utils``) for every family's configs.

Each family describes its blocks and the model adds them up; the numbers are
those of the per-family formulas they replaced (copied here as they were),
except paged attention's 16-bit query rows, now padded to their 16-row tile.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest

import pallax
from pallax import pallas_utils as pu
from pallax.executor.tools import kernel_calls
from pallax.kernels.attention import config as attention_config
from pallax.kernels.attention.common import Problem as AttentionProblem
from pallax.kernels.cross_entropy import config as ce_config
from pallax.kernels.cross_entropy.common import Problem as CeProblem
from pallax.kernels.matmul import MatmulConfig
from pallax.kernels.matmul import config as matmul_config
from pallax.kernels.norm import config as norm_config
from pallax.kernels.paged_attention import PagedAttentionConfig
from pallax.kernels.paged_attention import config as paged_config
from pallax.kernels.paged_attention.common import Problem as PagedProblem
from pallax.kernels.softmax import config as softmax_config
from pallax.op import op_params

S = jax.ShapeDtypeStruct


def test_tiles_pad_to_sublanes_and_lanes():
  assert pu.tpu_tile((5, 100), 4) == (8, 128)
  assert pu.tpu_tile((5, 100), 2) == (16, 128)
  assert pu.tpu_tile((5, 100), 1) == (32, 128)
  assert pu.tpu_tile((3, 17, 129), 4) == (3, 24, 256)
  assert pu.tpu_tile((300,), 4) == (384,)
  assert pu.VmemBuffer((5, 100), 2).nbytes == 2 * 16 * 128 * 2  # double-buffered
  assert pu.VmemBuffer((5, 100), 2, copies=1, padded=False).nbytes == 5 * 100 * 2
  assert pu.tpu_vmem_bytes([pu.VmemBuffer((8, 128), 4), pu.VmemBuffer((1, 1), 4, 3)]) == (
    2 * 8 * 128 * 4 + 3 * 8 * 128 * 4
  )
  assert pu.triton_smem_bytes([(128, 64), (64, 128)], 2, 3) == 3 * 2 * 128 * 64 * 2


def test_vmem_constants():
  mib = 2**20
  assert (pu.TPU_VMEM["v5e"].default_limit, pu.TPU_VMEM["v6e"].default_limit) == (
    16 * mib,
    32 * mib,
  )
  assert pu.TPU_VMEM_BUDGET == 12 * mib
  assert (pu.TPU_VMEM_RAISED_LIMIT, pu.TPU_VMEM_RAISED_BUDGET) == (64 * mib, 48 * mib)
  assert (pu.TPU_VMEM_RAISED_TARGET, pu.TPU_VMEM_CEILING) == (24 * mib, 100 * mib)
  assert ce_config.TPU_VMEM_LIMIT == 64 * mib


def test_row_families_as_their_formulas():
  for rows, hidden, itemsize in itertools.product((1, 8, 37, 1024), (100, 4000, 65536), (2, 4)):
    want = rows * hidden * (2 * 4 * itemsize + 3 * 4)
    assert norm_config.tpu_vmem(rows, hidden, itemsize) == want
    for masked in (False, True):
      want = rows * hidden * (4 * itemsize + 16 + 2 * masked)
      assert softmax_config.tpu_vmem(rows, hidden, itemsize, masked) == want


def test_matmul_as_its_formulas():
  for bm, bn, bk, ii, oi, outputs in itertools.product(
    (7, 128, 512), (3, 256), (128, 512), (2, 4), (2, 4), (1, 2)
  ):
    want = 2 * ((bm * bk + bk * bn) * ii + outputs * bm * bn * oi) + 4 * bm * bn
    assert matmul_config._tpu_vmem(bm, bn, bk, ii, oi, outputs) == want
  config = MatmulConfig(block_m=128, block_n=64, block_k=32, num_stages=3)
  assert matmul_config._triton_smem(config, 2) == 3 * (128 * 32 + 32 * 64) * 2


def _ce_formula(p, config, stage) -> int:
  """``kernels/cross_entropy/config.py``'s ``tpu_vmem`` before issue 27."""
  up = lambda n, m: -(-n // m) * m
  bn, bv = up(min(config.block_n, p.tokens), 16), up(min(config.block_v, p.vocab), 128)
  ix = jnp.dtype(p.dtype).itemsize
  col, tile = bn * 128 * 4, bn * bv * 4
  temps = 6 * tile
  if not p.linear:
    block = bn * bv * ix
    blocks = {"fwd": 2 * block + 12 * col, "jvp": 4 * block + 13 * col, "bwd": 4 * block + 10 * col}
    return blocks[stage] + temps
  iw = jnp.dtype(p.w_dtype).itemsize
  d = up(p.hidden, 128)
  bias = 16 * bv * 4 if p.has_bias else 0
  if stage == "bwd":
    xb, wb = bn * d * ix, d * bv * iw
    dx = 4 * xb + wb * 3 + 2 * bn * d * 4
    dw = 4 * wb + xb * 4 + 2 * d * bv * 4
    return max(dx, dw) + 2 * bias + 10 * col + temps
  bd = min(config.block_d, p.hidden)
  split = bd < p.hidden
  xb, wb = bn * up(bd, 128) * ix, up(bd, 128) * bv * iw
  copies = (xb + wb) if split else 0
  if stage == "fwd":
    return 2 * (xb + wb) + 2 * bias + copies + 12 * col + split * tile + temps
  parts = 4 * (xb + wb) if not split and max(ix, iw) == 4 else 0
  return 4 * (xb + wb) + 4 * bias + 2 * copies + parts + 13 * col + 2 * split * tile + temps


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_cross_entropy_as_its_formula(dtype):
  for (n, d, v), linear, stage in itertools.product(
    ((37, 200, 301), (1000, 4096, 50257)), (True, False), ("fwd", "jvp", "bwd")
  ):
    for has_bias in (True, False) if linear else (False,):
      if linear:
        avals = [S((1, n, d), dtype), S((1, d, v), dtype)] + [S((1, v), dtype)] * has_bias
      else:
        avals = [S((1, n, v), dtype)]
      avals.append(S((1, n), jnp.int32))
      params = dict(linear=linear, has_bias=has_bias, transposed_weight=False, soft_cap=None)
      p = CeProblem.of(avals, **params)
      for bn, bv, bd in itertools.product((8, 16, 256), (128, 512), (128, 2048, 8192)):
        config = ce_config.CrossEntropyConfig(block_n=bn, block_v=bv, block_d=bd)
        assert ce_config.tpu_vmem(p, config, stage) == _ce_formula(p, config, stage), config


def _attention_problem(dtype, h, has_bias, has_mask) -> AttentionProblem:
  """The Problem of the forward kernel call of a (1, 256, 4, 2, h) attention, by tracing it."""
  q, kv = S((1, 256, 4, h), dtype), S((1, 256, 2, h), dtype)
  extra = {}
  if has_bias:
    extra["bias"] = S((1, 4, 256, 256), dtype)
  if has_mask:
    extra["mask"] = S((1, 4, 256, 256), jnp.bool_)
  names = list(extra)
  fn = lambda q, k, v, *e: pallax.dot_product_attention(q, k, v, **dict(zip(names, e)))
  jaxpr = jax.make_jaxpr(fn)(q, kv, kv, *extra.values()).jaxpr
  (eqn,) = [e for e in kernel_calls(jaxpr) if e.primitive.name == "dot_product_attention_fwd"]
  return AttentionProblem.of([v.aval for v in eqn.invars], **op_params(eqn.params))


def test_attention_as_its_formula():
  for dtype, h, has_bias, has_mask in itertools.product(
    (jnp.float32, jnp.bfloat16), (64, 80, 256), (False, True), (False, True)
  ):
    p = _attention_problem(dtype, h, has_bias, has_mask)
    item = jnp.dtype(dtype).itemsize
    for bq, bk in ((128, 128), (256, 512), (512, 512)):
      config = attention_config.AttentionConfig(block_q=bq, block_k=bk)
      rows = 2 * item * (3 * bq * h + 4 * bk * h)
      tile = bq * bk * (4 * 4 + 2 * (item + 1) * (has_bias + has_mask))
      want = rows + tile + 4 * (3 * bq * h + 2 * bk * h)
      assert attention_config.tpu_vmem(p, config) == want


def test_paged_attention_pads_pages_and_rows_to_their_tiles():
  dtypes = (jnp.float32, jnp.bfloat16)
  for dtype, page, groups in itertools.product(dtypes, (8, 16, 32), (1, 4, 12)):
    b, kv, h, pages = 2, 2, 80, 8  # the kernel's layout: q (B, K, G, H)
    avals = [S((b, kv, groups, h), dtype), S((kv, b * pages, page, h), dtype)]
    avals += [S((kv, b * pages, page, h), dtype), S((b,), jnp.int32), S((b, pages), jnp.int32)]
    p = PagedProblem.of(avals, scale=1.0)
    item, sub = jnp.dtype(dtype).itemsize, pu.sublanes(dtype)
    up = lambda n, m: -(-n // m) * m
    for ppb in (1, 4):
      config = PagedAttentionConfig(pages_per_block=ppb)
      page_rows, group_rows = up(page, sub), up(groups, sub)
      want = 2 * ppb * page_rows * 2 * 128 * item  # k and v pages, head dim 80 in 128 lanes
      want += 2 * group_rows * 2 * 128 * item  # query and output
      want += 4 * up(groups, 8) * (128 + 2 * 128 + 2 * up(ppb * page_rows, 128))  # float32
      assert paged_config.tpu_vmem(p, config) == want
