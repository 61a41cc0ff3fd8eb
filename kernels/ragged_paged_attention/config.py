"""The ragged-paged-attention kernels' config: its class, heuristic, space and legality."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import pallas_utils as pu
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.ragged_paged_attention.common import Problem, items_bound


@dataclasses.dataclass(frozen=True)
class RaggedPagedAttentionConfig(KernelConfig):
  """Blocks of the ragged-paged-attention kernels.

  block_q: query tokens per item of the work list (``common.work_list``): an
    item's ``block_q * G`` rows (its tokens times the kv head's query heads)
    read its sequence's keys once. 1 suits decode, more suits prefill chunks.
  block_k: Triton and XLA: tokens per inner step (gathered token by token
    through the page table).
  pages_per_block: TPU: pages fetched per grid step.
  num_warps, num_stages: Triton launch parameters.
  """

  block_q: int = 1
  block_k: int = 64
  pages_per_block: int = 1
  num_warps: int = 4
  num_stages: int = 2


CONFIG_CLS = RaggedPagedAttentionConfig

# An item's rows (block_q * G) at most; Triton pads them to a power of two >= 16
# and takes 16 with 4-byte operands or heads above 128, as paged_attention's
# kernel (the verify sweep saw 128, 64 and 32 rows of float32 at head dim 128
# spill on H100).
MAX_ROWS = 128
MAX_TRITON_HEAD = 256
_TRITON_BLOCKS = (32, 64)
# TPU: tokens a grid step aims for; the pages' operand count cap; the
# scalar-prefetched work list and page-table rows (int32 in SMEM) budget.
_TPU_TOKENS = 256
_TPU_MAX_PAGES_PER_BLOCK = 16
TPU_SMEM_BUDGET = 256 * 2**10


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


def _triton_block_k(p: Problem) -> int:
  return min(32 if _wide(p) else 64, max(16, pu.next_pow2(p.max_len)))


def _tpu_pages(p: Problem) -> int:
  if p.page_size % pu.sublanes(p.dtype):  # pages do not stack on whole sublane tiles
    return 1
  return max(1, min(_TPU_TOKENS // p.page_size, p.pages_per_sequence, _TPU_MAX_PAGES_PER_BLOCK))


def heuristic(avals: Sequence[Any], target: str, **params) -> RaggedPagedAttentionConfig:
  p = Problem.of(avals, **params)
  block_q = block_q_for(p, max_rows(p, target))
  if kernel_backend(target) == "triton":
    return RaggedPagedAttentionConfig(block_q=block_q, block_k=_triton_block_k(p))
  return RaggedPagedAttentionConfig(block_q=block_q, pages_per_block=_tpu_pages(p))


def candidates(avals: Sequence[Any], target: str, **params) -> list[RaggedPagedAttentionConfig]:
  """The autotuning space: tokens per item and per step (Triton), pages per step (TPU)."""
  base = heuristic(avals, target, **params)
  if interpreted(target):
    return [base]
  qs = {base.block_q, max(1, base.block_q // 2), 2 * base.block_q}
  if kernel_backend(target) == "triton":
    out = [
      RaggedPagedAttentionConfig(block_q=bq, block_k=bk, num_warps=w)
      for bq in sorted(qs)
      for bk in _TRITON_BLOCKS
      for w in (4, 8)
    ]
  else:
    out = [
      RaggedPagedAttentionConfig(block_q=bq, pages_per_block=n)
      for bq in sorted(qs)
      for n in (1, 2, 4, 8)
    ]
  legal = [c for c in out if supports(avals, target, c, **params) is None]
  return list(dict.fromkeys([base, *legal]))


def supports(
  avals: Sequence[Any], target: str, config: RaggedPagedAttentionConfig, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, **params)
  rows, most = config.block_q * p.groups, max_rows(p, target)
  if rows > most:
    return f"block_q {config.block_q} x {p.groups} query heads a kv head > {most} rows"
  if kernel_backend(target) == "triton":
    if max(p.head_dim, p.value_dim) > MAX_TRITON_HEAD:
      return f"head dims above {MAX_TRITON_HEAD} (Triton)"
    if config.block_k not in (16, *_TRITON_BLOCKS):
      return f"block_k must be one of {(16, *_TRITON_BLOCKS)} on Triton, got {config.block_k}"
    return None
  if config.pages_per_block > 1 and p.page_size % pu.sublanes(p.dtype):
    return (
      f"page_size {p.page_size} is not a multiple of {pu.sublanes(p.dtype)} rows: one page a step"
    )
  smem = 4 * items_bound(p, config.block_q) * (3 + p.pages_per_sequence)
  if smem > TPU_SMEM_BUDGET:
    return f"the work list and its page-table rows take {smem} bytes of SMEM > {TPU_SMEM_BUDGET}"
  return None
