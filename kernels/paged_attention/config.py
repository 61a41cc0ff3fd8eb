"""The paged-attention kernels' config: ``PagedAttentionConfig``, heuristic, space, legality."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax.numpy as jnp

from pallax import paging
from pallax import pallas_utils as pu
from pallax.executor import facts
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend
from pallax.kernels.paged_attention.common import PagedFacts, Problem


@dataclasses.dataclass(frozen=True)
class PagedKernelConfig(KernelConfig):
  """Blocks of every kernel over a paged cache (paged and ragged paged attention).

  block_k: Triton: tokens per inner step (a power of two >= 16; pages are
    gathered token by token, so it need not be a multiple of the page size).
  num_splits: Triton: programs per query block and kv head, each walking its
    share of the keys (flash-decoding); their partial softmaxes are combined
    afterwards.
  pages_per_block: TPU: pages fetched per grid step (each its own pipelined
    block).
  num_warps, num_stages: Triton launch parameters.
  """

  block_k: int = 64
  num_splits: int = 1
  pages_per_block: int = 1
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig(PagedKernelConfig):
  """Blocks of the paged-attention kernels (``PagedKernelConfig``'s; a query block: a sequence)."""


CONFIG_CLS = PagedAttentionConfig

# Triton: a kv head's query heads are one block of rows, padded to a power of
# two >= 16 (Triton's dots need 16 rows); more than this runs the XLA program.
MAX_TRITON_GROUPS = 128
MAX_TRITON_HEAD = 256
# Programs to aim for on a GPU (about two waves of an H100's 132 SMs).
_TARGET_PROGRAMS = 264
_MAX_SPLITS = 16
# TPU: tokens per grid step to aim for, and the pages' operand count cap.
_TPU_TOKENS = 256
_TPU_MAX_PAGES_PER_BLOCK = 16
# Scalar-prefetched page table (int32 in SMEM): the budget it may take.
TPU_SMEM_BUDGET = 256 * 2**10


def rows(p: Problem) -> int:
  """Query rows of a Triton program: the kv head's query heads, padded."""
  return pu.next_pow2(max(p.groups, 16))


# Triton: the tokens a step the space tries (``candidates``; the heuristic
# takes 64, or 32 where 64 is rejected). A call takes those ``pallax.verify``
# did not see spill or overflow shared memory on its devices (``facts``:
# ``defaults/<device>/paged_attention.json``, per operand width and padded
# head dim): float32 dots at precision HIGHEST hold their operands in
# registers. Blocks beyond the space were never verified.
_TRITON_BLOCKS = (32, 64, 128)


def call_facts(avals: Sequence[Any], **params) -> dict[str, Any]:
  """What the compiler verdicts on a call's configs depend on (``pallax.executor.facts``).

  width: the operands' bytes an element (2 or 4); head: the padded head dim
  (64, 128 or 256; smaller heads count as 64).
  """
  return _facts(Problem.of(avals, **params))


def _facts(p: Problem) -> dict[str, Any]:
  return {
    "width": 4 if jnp.dtype(p.dtype).itemsize == 4 else 2,
    "head": max(64, pu.next_pow2(max(p.head_dim, p.value_dim, 16))),
  }


def _triton_block_reason(p: Problem, target: str, config: PagedAttentionConfig) -> Optional[str]:
  """Why a Triton config's ``block_k`` cannot compile cleanly for this call, if so."""
  if config.block_k > max(_TRITON_BLOCKS):
    return f"at most {max(_TRITON_BLOCKS)} tokens a step on Triton (the verified blocks)"
  return facts.rejection(target, "paged_attention", config, _facts(p))


def _triton_block_k(p: Problem, target: str) -> int:
  """64 tokens a step, or 32 where 64 is rejected; no more than the longest sequence."""
  bk = next(
    (
      bk
      for bk in (64, 32)
      if _triton_block_reason(p, target, PagedAttentionConfig(block_k=bk)) is None
    ),
    16,
  )
  return min(bk, max(16, pu.next_pow2(p.max_len)))


def splits_for(programs: int, keys: int, block_k: int) -> int:
  """Splits of ``programs`` over ``keys`` that fill the GPU, each with two blocks of keys."""
  want = -(-_TARGET_PROGRAMS // max(1, programs))
  most = max(1, -(-keys // (2 * block_k)))
  return max(1, min(want, most, _MAX_SPLITS))


def split_space(splits: int, more: tuple[int, ...] = (2,)) -> tuple[int, ...]:
  """The autotuning space around ``splits``: half, it, and ``more`` times it (within the cap).

  More splits than fill the GPU once keep more loads in flight a multiprocessor.
  """
  larger = (min(_MAX_SPLITS, f * splits) for f in more)
  return tuple(dict.fromkeys((splits, max(1, splits // 2), *larger)))


def tpu_pages(p: Problem) -> int:
  """TPU pages a step: ``_TPU_TOKENS`` tokens' worth, one where pages do not stack on sublanes."""
  if p.page_size % pu.sublanes(p.dtype):  # pages do not stack on whole sublane tiles
    return 1
  return max(1, min(_TPU_TOKENS // p.page_size, p.pages_per_sequence, _TPU_MAX_PAGES_PER_BLOCK))


def tpu_vmem(p: Problem, config: PagedAttentionConfig) -> int:
  """Scoped VMEM of the TPU kernel: double-buffered pages, query, output and scratch."""
  item = jnp.dtype(p.dtype).itemsize
  pages, page = config.pages_per_block, p.page_size
  tokens = pages * pu.tpu_tile((page, 1), item)[0]
  return pu.tpu_vmem_bytes(
    [
      pu.VmemBuffer((pages, page, p.head_dim), item),  # k and v pages
      pu.VmemBuffer((pages, page, p.value_dim), item),
      pu.VmemBuffer((p.groups, p.head_dim), item),  # the query and output blocks
      pu.VmemBuffer((p.groups, p.value_dim), item),
      pu.VmemBuffer((p.groups, p.value_dim), 4, copies=1),  # scratch: accumulator, max and sum
      pu.VmemBuffer((p.groups, 1), 4, copies=2),
      pu.VmemBuffer((p.groups, tokens), 4, copies=2),  # logits and probabilities
    ]
  )


def heuristic(avals: Sequence[Any], target: str, **params) -> PagedAttentionConfig:
  p = Problem.of(avals, **params)
  if kernel_backend(target) == "triton":
    bk = _triton_block_k(p, target)
    return PagedAttentionConfig(
      block_k=bk, num_splits=splits_for(p.batch * p.kv_heads, p.max_len, bk)
    )
  return PagedAttentionConfig(pages_per_block=tpu_pages(p))


def candidates(avals: Sequence[Any], target: str, **params) -> list[PagedAttentionConfig]:
  """The autotuning space: blocks, splits, warps and stages (Triton), pages per step (TPU)."""
  p = Problem.of(avals, **params)
  base = heuristic(avals, target, **params)
  if interpreted(target):
    return [base]
  if kernel_backend(target) == "triton":
    # 16-bit operands also try 4x the splits and 3 stages: the verify sweep
    # saw float32 spill with 8 splits at head dim 128 (and never compiled
    # float32 with 3 stages).
    narrow = jnp.dtype(p.dtype).itemsize == 2
    out = []
    for bk in _TRITON_BLOCKS:
      bk = min(bk, max(16, pu.next_pow2(p.max_len)))
      splits = splits_for(p.batch * p.kv_heads, p.max_len, bk)
      for s in split_space(splits, (2, 4) if narrow else (2,)):
        out += [
          PagedAttentionConfig(block_k=bk, num_splits=s, num_warps=w, num_stages=st)
          for w in (4, 8)
          for st in ((2, 3) if narrow else (2,))
        ]
  else:
    out = [PagedAttentionConfig(pages_per_block=n) for n in (1, 2, 4, 8, 16)]
  legal = [c for c in out if supports(avals, target, c, **params) is None]
  return list(dict.fromkeys([base, *legal]))


# The operands autotuning times candidates on (``ConfigSpace.inputs``): full caches.
tune_inputs = paging.full_cache_inputs


def paged_reason(
  p: PagedFacts, target: str, config: PagedKernelConfig, kernel: str
) -> Optional[str]:
  """What every kernel over a paged cache refuses, if anything.

  float64; on TPU a dtype Mosaic lacks, and several pages a step that do
  not stack on whole sublane tiles. ``kernel``: its name in the reasons.
  """
  if p.dtype == jnp.float64:
    return f"float64 has no {kernel} kernel"
  if kernel_backend(target) != "mosaic_tpu":
    return None
  reason = pu.mosaic_dtype_reason([p.dtype], target)
  if reason:
    return reason
  stacks = config.pages_per_block > 1 and p.page_size % pu.sublanes(p.dtype)
  if stacks and not interpreted(target):  # Mosaic's layouts; the interpreter stacks any
    return (
      f"page_size={p.page_size} is not a multiple of {pu.sublanes(p.dtype)} sublanes: "
      "one page per step on TPU"
    )
  return None


def supports(
  avals: Sequence[Any], target: str, config: PagedAttentionConfig, **params
) -> Optional[str]:
  """Why the kernel cannot run this call on ``target`` with ``config``, if it cannot."""
  p = Problem.of(avals, **params)
  reason = paged_reason(p, target, config, "paged-attention")
  if reason is not None:
    return reason
  if kernel_backend(target) == "mosaic_tpu":
    if config.pages_per_block > p.pages_per_sequence:
      return f"pages_per_block={config.pages_per_block} > {p.pages_per_sequence} pages a sequence"
    if not interpreted(target):
      if tpu_vmem(p, config) > pu.TPU_VMEM_BUDGET:
        return f"pages_per_block={config.pages_per_block} needs more than the VMEM budget"
      if 4 * p.batch * (p.pages_per_sequence + 1) > TPU_SMEM_BUDGET:
        return f"a {p.batch}x{p.pages_per_sequence} page table is too large for TPU SMEM"
    return None
  value = config.block_k
  if value & (value - 1) or value < 16:
    return f"block_k={value} must be a power of two >= 16 on Triton"
  reason = None if interpreted(target) else _triton_block_reason(p, target, config)
  if reason is not None:
    return (
      f"block_k={value} spills for {jnp.dtype(p.dtype).name} at head dim "
      f"{max(p.head_dim, p.value_dim)}: {reason}"
    )
  if p.groups > MAX_TRITON_GROUPS:
    return f"{p.groups} query heads a kv head: at most {MAX_TRITON_GROUPS} on Triton"
  if max(p.head_dim, p.value_dim) > MAX_TRITON_HEAD:
    return f"head dims up to {MAX_TRITON_HEAD} on Triton, got {max(p.head_dim, p.value_dim)}"
  return pu.triton_warps_reason(config)
