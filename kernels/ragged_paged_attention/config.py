"""The ragged-paged-attention kernels' config: its class, heuristic, space and legality."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from pallax import paging
from pallax import pallas_utils as pu
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.paged_attention.config import (
  MAX_TRITON_HEAD,
  TPU_SMEM_BUDGET,
  PagedKernelConfig,
  paged_reason,
  split_space,
  splits_for,
  tpu_pages,
)
from pallax.kernels.ragged_paged_attention.common import Problem, items_bound


@dataclasses.dataclass(frozen=True)
class RaggedPagedAttentionConfig(PagedKernelConfig):
  """Blocks of the ragged-paged-attention kernels: ``PagedKernelConfig``'s and ``block_q``.

  block_q: query tokens per item of the work list (``common.work_list``): an
    item's ``block_q * G`` rows (its tokens times the kv head's query heads)
    read its sequence's keys once. 1 suits decode, more suits prefill chunks.
    Triton's splits divide an item's keys.
  """

  block_k: int = 32  # 64 spills with float32 operands (``_triton_blocks``)
  block_q: int = 1


CONFIG_CLS = RaggedPagedAttentionConfig

# An item's rows (block_q * G) at most; Triton pads them to a power of two >= 16
# and takes 16 with 4-byte operands or heads above 128, as paged_attention's
# kernel (the verify sweep saw 128, 64 and 32 rows of float32 at head dim 128
# spill on H100). Triton's heuristic aims at 64: measured on an H200
# (bench/hopper_tune.py, bf16, 283 tokens over 16 sequences, G=4), the fastest
# configs had 64 rows, 0.71x the time of a 128-row one.
MAX_ROWS = 128
_TRITON_ROWS = 64


def _wide(p: Problem) -> bool:
  return jnp.dtype(p.dtype).itemsize > 2 or max(p.head_dim, p.value_dim) > 128


def max_rows(p: Problem, target: str) -> int:
  """An item's rows at most on ``target`` (``MAX_ROWS``; 16 for wide Triton blocks)."""
  return 16 if kernel_backend(target) == "triton" and _wide(p) else MAX_ROWS


def block_q_for(p: Problem, rows: int = MAX_ROWS) -> int:
  """Tokens per item: the mean query length (a power of two), within ``rows`` rows."""
  mean = -(-p.tokens // max(1, p.max_seqs))
  most = max(1, rows // p.groups)
  return max(1, min(pu.next_pow2(mean), 1 << (most.bit_length() - 1)))


def _triton_blocks(p: Problem) -> tuple[int, ...]:
  """Triton's tokens a step for this call: the verify sweep saw larger ones spill.

  float32 at head dim 128 spilled with 64 tokens, at 256 with 32; 16-bit
  operands take up to 64 up to head dim 128.
  """
  if jnp.dtype(p.dtype).itemsize > 2 and max(p.head_dim, p.value_dim) > 128:
    return (16,)
  return (16, 32) if _wide(p) else (16, 32, 64)


def _triton_config(p: Problem, block_q: int, block_k: int, **kw) -> RaggedPagedAttentionConfig:
  """A Triton config: splits filling the GPU (``paged_attention``'s), 8 warps for 128 rows.

  The items are counted as ``T / block_q`` (a decode batch's sequences; a
  mixed batch has a few more), each over up to the whole table.
  """
  warps = 8 if pu.next_pow2(max(16, block_q * p.groups)) >= 128 else 4
  items = -(-p.tokens // block_q)
  splits = splits_for(items * p.kv_heads, p.max_len, block_k)
  return RaggedPagedAttentionConfig(
    block_q=block_q, block_k=block_k, **{"num_warps": warps, "num_splits": splits, **kw}
  )


def heuristic(avals: Sequence[Any], target: str, **params) -> RaggedPagedAttentionConfig:
  p = Problem.of(avals, **params)
  rows = max_rows(p, target)
  if kernel_backend(target) == "triton":
    block_k = min(max(_triton_blocks(p)), max(16, pu.next_pow2(p.max_len)))
    return _triton_config(p, block_q_for(p, min(rows, _TRITON_ROWS)), block_k)
  return RaggedPagedAttentionConfig(block_q=block_q_for(p, rows), pages_per_block=tpu_pages(p))


def candidates(avals: Sequence[Any], target: str, **params) -> list[RaggedPagedAttentionConfig]:
  """The autotuning space: tokens per item and per step (Triton), pages per step (TPU)."""
  p = Problem.of(avals, **params)
  base = heuristic(avals, target, **params)
  if interpreted(target):
    return [base]
  qs = {base.block_q, max(1, base.block_q // 2), 2 * base.block_q}
  if kernel_backend(target) == "triton":
    # Wide blocks (16 rows) take 4 warps (8 spilled at head dim 256 in the
    # verify --exhaustive sweep); 4x the splits: 16-bit operands up to head dim 128.
    warps, more = ((4,), ()) if _wide(p) else ((4, 8), (4,))
    out = []
    for bq, bk, w in itertools.product(sorted(qs), _triton_blocks(p), warps):
      splits = split_space(_triton_config(p, bq, bk).num_splits, (2, *more))
      out += [_triton_config(p, bq, bk, num_warps=w, num_splits=s) for s in splits]
  else:
    out = [
      RaggedPagedAttentionConfig(block_q=bq, pages_per_block=n)
      for bq in sorted(qs)
      for n in (1, 2, 4, 8)
    ]
  legal = [c for c in out if supports(avals, target, c, **params) is None]
  return list(dict.fromkeys([base, *legal]))


def tpu_vmem(p: Problem, config: RaggedPagedAttentionConfig) -> int:
  """Scoped VMEM of the TPU kernel: double-buffered pages, an item's rows, scratch."""
  item = jnp.dtype(p.dtype).itemsize
  rows, pages, page = config.block_q * p.groups, config.pages_per_block, p.page_size
  tokens = pages * pu.tpu_tile((page, 1), item)[0]
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer((pages, page, p.head_dim), item),  # k and v pages
      pu.VmemBuffer((pages, page, p.value_dim), item),
      pu.VmemBuffer((rows, p.head_dim), item),  # the query and output blocks, the lse column
      pu.VmemBuffer((rows, p.value_dim), item),
      pu.VmemBuffer((rows, 1), 4),
      pu.VmemBuffer((rows, p.value_dim), 4, copies=1),  # scratch: accumulator, max and sum
      pu.VmemBuffer((rows, 1), 4, copies=2),
      pu.VmemBuffer((rows, tokens), 4, copies=2),  # logits and probabilities
    ]
  )


def tune_inputs(avals: Sequence[Any], seed: int, **params) -> list[Any]:
  """The operands autotuning times candidates on (``ConfigSpace.inputs``).

  Every slot a sequence with a full cache (``paging.full_cache_inputs``) and
  the tokens shared out evenly among them, each at most its cache.
  """
  tokens, seqs = avals[0].shape[0], avals[3].shape[0]
  q, k, v, kv_lens, table = paging.full_cache_inputs(avals[:5], seed)
  cache = avals[4].shape[1] * avals[1].shape[2]  # pages a sequence x page size
  q_lens = np.minimum(np.diff(np.linspace(0, tokens, seqs + 1).astype(np.int64)), cache)
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)])
  return [
    q,
    k,
    v,
    kv_lens,
    table,
    jnp.asarray(cu_q_lens, avals[5].dtype),
    jnp.full((1,), seqs, avals[6].dtype),
  ]


def supports(
  avals: Sequence[Any], target: str, config: RaggedPagedAttentionConfig, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, **params)
  reason = paged_reason(p, target, config, "ragged-paged-attention")
  if reason is not None:
    return reason
  rows, most = config.block_q * p.groups, max_rows(p, target)
  if rows > most:
    return f"block_q {config.block_q} x {p.groups} query heads a kv head > {most} rows"
  if kernel_backend(target) == "triton":
    return _triton_reason(p, config)
  if interpreted(target):
    return None
  if tpu_vmem(p, config) > pu.TPU_VMEM_BUDGET:
    return f"pages_per_block={config.pages_per_block} needs more than the VMEM budget"
  smem = 4 * items_bound(p, config.block_q) * (3 + p.pages_per_sequence)
  if smem > TPU_SMEM_BUDGET:
    return f"the work list and its page-table rows take {smem} bytes of SMEM > {TPU_SMEM_BUDGET}"
  return None


def _triton_reason(p: Problem, config: RaggedPagedAttentionConfig) -> Optional[str]:
  if max(p.head_dim, p.value_dim) > MAX_TRITON_HEAD:
    return f"head dims up to {MAX_TRITON_HEAD} on Triton, got {max(p.head_dim, p.value_dim)}"
  blocks = _triton_blocks(p)
  if config.block_k not in blocks:
    return (
      f"block_k={config.block_k} on Triton for {jnp.dtype(p.dtype).name} at head dim "
      f"{max(p.head_dim, p.value_dim)}: one of {blocks} (larger spilled)"
    )
  if config.num_splits < 1:
    return f"num_splits={config.num_splits} must be >= 1"
  if pu.next_pow2(max(16, config.block_q * p.groups)) >= 128 and config.num_warps < 8:
    return "128 rows an item need 8 warps on Triton (4 spilled)"
  return pu.triton_warps_reason(config)
