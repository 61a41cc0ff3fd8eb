"""The Mosaic GPU attention kernels' config: ``MosaicGpuAttentionConfig``, heuristic, legality.

A config class of its own (``Kernel.spaces``): the executor prefers these
kernels on Hopper (``Implementation.preferred``) for the calls ``supports``
accepts, and runs the Triton kernels for the rest, saying why in ``explain``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp

from pallax import determinism
from pallax import pallas_mosaic_gpu as mgpu
from pallax.executor.config import KernelConfig
from pallax.kernels.attention.common import Call, Problem

IMPLEMENTATION = "pallas_mosaic_gpu"
CONSUMERS = 2  # consumer warpgroups a block of threads; a producer warpgroup besides
# For a kernel of three warpgroups ptxas reports 168 registers a thread (65536
# / 384, the launch's count) and allocates a consumer's code after
# ``setmaxnreg`` up to what it asks (232: the forward's SASS at head dim 128
# uses R179); two warpgroups get 255. At 128 columns the tangent's
# accumulators spill in 232, and the dk/dv kernel's of 64-query steps with
# lengths, segment ids, windows, a bias or a mask (without them they fit, each consumer's
# code a copy of its own, ``Form.warpgroups``; with them they fit 240 where
# every step is masked, ``masks_every_step``): two consumers up to head dim
# 64, one above, unless a config asks (``dkdv_steps``). The dq kernel's:
# ``MosaicGpuAttentionConfig.dq_consumers``.
DQ_ROWS = 64  # queries a consumer of the dq and tangent kernels
# The backward's kernels, as their Pallas calls name them (``kernel_keys``).
DQ_KERNEL = "dot_product_attention_dq"
DKDV_KERNEL = "dot_product_attention_dkdv"


@dataclasses.dataclass(frozen=True)
class MosaicGpuAttentionConfig(KernelConfig):
  """Blocks of the Mosaic GPU attention kernels.

  The forward gives each consumer warpgroup ``block_q`` queries and streams
  ``block_k`` keys a step; the backward's dk/dv kernel gives each ``block_k``
  keys and streams ``block_q`` queries a step, its dq kernel 64 queries and
  ``block_k`` keys a step.

  block_q, block_k: the forward's: 64 (``wgmma``'s rows) and a multiple of
    64: 128 by the heuristic; 64, 192 and 256 are autotuning candidates (192,
    never the heuristic's until timed on a GPU, as FlashAttention-3's
    unmasked forward takes 176 keys a block at head dim 128; above head dim
    64 a causal mask or window takes up to 128). The backward's and the
    tangent's are ``BWD_BLOCKS`` whatever a config says (the dk/dv kernel's
    steps: ``dkdv_rows``; the tangent's where 64 keys overflow SMEM: ``jvp_block_k``).
  num_stages: slots of the producer's SMEM ring (at least 2).
  fuse_dq: the backward's dk/dv kernel computes dQ too (``dS K``: 5 matrix
    products where the dq and dk/dv kernels do 7), each block of threads
    adding its keys' share into a float32 dQ by TMA reduce-adds. Their order
    varies from run to run, so dq is not bitwise reproducible, as in XLA's
    own cuDNN attention: an autotuning candidate (never the heuristic's
    choice), refused where ``XLA_FLAGS`` asks for deterministic ops
    (``pallax.determinism``: the switch that makes XLA's attention
    deterministic). Not with a bias or a mask (the unfused kernels take
    them). Up to head dim 64 with every other feature; at 128 without
    a soft cap, in 2 slots; there with ``dkdv_consumers=2`` two consumer
    warpgroups of 64 keys, sharing dQ's columns (``shares_dq``), in
    32-query steps (``dkdv_rows=32``) or FlashAttention-3's tile
    (``dkdv_rows=64``, the default: ``fused_wide_steps``), every other
    feature too (``_fuse_reason``); lengths, segment ids, windows and, in
    FlashAttention-3's tile, keys short of its blocks of 128 and a causal
    mask with GQA or more queries than keys mask every step
    (``masks_every_step``, ``causal_loops``). The forward and the tangent
    ignore it.
  dq_consumers: consumer warpgroups of the backward's dq kernel, 64 queries
    each: 1 (the heuristic's) or 2, where one consumer's softmax runs beside
    the other's matrix products, up to head dim 128 (an autotuning candidate
    until timed on a GPU; compiled for H100 spill-free at head dim 128: its
    SASS uses up to R183 of the 232 registers its consumers ask unmasked,
    R229 with causal masks, lengths, segment ids, a soft cap and GQA). The
    fused backward runs no dq kernel: it takes 1.
  dkdv_rows: queries a step of the backward's dk/dv kernel: 64, or 32 above
    head dim 64 up to 128, in two consumer warpgroups of 64 keys (an
    autotuning candidate until timed on a GPU). ``fuse_dq`` takes its own
    steps (``FUSED_ROWS``), except in two consumers sharing dQ's columns: 64
    or 32 there (``fused_wide_steps``). The forward and the tangent ignore it.
  dkdv_consumers: consumer warpgroups of 64 keys in the backward's dk/dv
    kernel: None for its steps' own (``dkdv_steps``: two of 32-query steps,
    of 64-query steps two up to head dim 64 and one above), or 2. Two of
    64-query steps above head dim 64 (up to 128: an autotuning candidate
    until timed on a GPU) mask every step with lengths, segment ids,
    windows, a bias or a mask (``masks_every_step``: in loops of their own
    those steps spilled). The forward and the tangent ignore it.
  fwd_overlap: the forward's consumers issue a block's ``S = Q K^T`` beside
    the previous block's ``P V`` and run the block's softmax while ``P V``
    runs (FlashAttention-3's intra-warpgroup overlap, on top of the
    ping-pong between consumers): a block's probabilities, ``block_k / 4``
    registers a thread more, stay live into the next step. Up to head dim 128 and
    ``block_k`` 128 (compiled for H100: 256 keys at head dim 64 spilled 576
    bytes, head dim 256 8); an autotuning candidate in 2 slots until timed
    on a GPU. The backward and the tangent ignore it.
  """

  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  fuse_dq: bool = False
  dq_consumers: int = 1
  dkdv_rows: int = 64
  dkdv_consumers: Optional[int] = None
  fwd_overlap: bool = False
  implementation: str = dataclasses.field(default=IMPLEMENTATION, kw_only=True)


CONFIG_CLS = MosaicGpuAttentionConfig
STAGES = ("fwd", "bwd", "jvp")


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def head(p: Problem) -> int:
  """The head dim the kernels run: both head dims padded to one multiple of 64."""
  return round_up(max(p.head_dim, p.value_dim), 64)


# The largest padded head dim the kernels take. Above 128 the backward and
# the tangent split their results' columns (``out_cols``).
_MAX_HEAD = 256


def has_masks(p: Problem) -> bool:
  """Whether a call's blocks can be partly hidden (causal, windows, lengths, segment ids)."""
  return bounded(p) or p.has_lengths or p.has_segments


def bounded(p: Problem) -> bool:
  """Whether a causal mask or a window bounds the keys each query sees."""
  return p.left is not None or p.right is not None


def windowed(p: Problem) -> bool:
  """Whether a window bounds the keys each query sees (more than a causal mask)."""
  return p.left is not None or bool(p.right)


def feature_reason(p: Problem, stage: str = "fwd") -> Optional[str]:
  """Why the kernels cannot run a call's features, if they cannot (the Triton kernels then do)."""
  if stage not in STAGES:
    return f"the Mosaic GPU attention kernels have no {stage} stage (it runs on Triton)"
  if jnp.dtype(p.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the Mosaic GPU attention kernels take bfloat16 and float16, not {jnp.dtype(p.dtype)}"
  if head(p) > _MAX_HEAD:
    return f"head dims up to {_MAX_HEAD} in the Mosaic GPU {stage} kernels, got {head(p)}"
  if p.t == 0 or p.s == 0:
    return "no queries or no keys"
  return None


class _Smem(NamedTuple):
  """What one kernel keeps in SMEM, in tiles of ``rows x head dim`` and float32 row vectors.

  With segment ids each side has one int32 row vector more (its ids).

  own: the side whose rows each of its consumers owns (``"q"``, ``"k"``,
  ``"dq"`` or ``"jvp"``: 64 queries); the ring streams the other.
  out_tiles: tiles of the results' columns (``out_cols``) besides the own
  tiles (none for the dk/dv kernel's whole results: they go through K's and
  V's). ``shared_tiles``: ring tiles of those columns alone.
  """

  own: str
  own_tiles: int
  ring_tiles: int
  own_stats: int
  ring_stats: int
  out_tiles: int = 0
  shared_tiles: int = 0


_SMEM = {
  "fwd": [_Smem("q", 1, 2, 1, 0)],  # Q (then O), lse; K, V
  # dq kernel: Q, dO, lse, delta, dQ; K, V. dk/dv kernel: K, V (then dK and dV
  # whole, or one tile for their columns, one after the other); Q, dO, lse, delta.
  "bwd": [_Smem("dq", 2, 2, 2, 0, 1), _Smem("k", 2, 2, 0, 2, 1)],
  # The tangent: Q, dQ and the float32 output tile (two 16-bit tiles' worth),
  # lse and the row sums; K, dK, and V and dV in the output's columns.
  "jvp": [_Smem("jvp", 2, 2, 2, 0, 2, 2)],
}


# Above head dim 64 a causal mask or a window takes the forward up to 128
# keys a block, as FlashAttention-3's forward does: compiled for H100 at head
# dim 128, 192-key blocks spilled 8-36 bytes with windows and causal masks
# of fewer queries than keys; unmasked, padded, with lengths or a soft cap
# they fit (the mask's positions vectors, ``Tiles.keep_keys``).
_BOUNDED_BLOCK_K = 128

# With segment ids the forward takes up to 192 keys a block: compiled for
# H100 at head dim 64 (batch 2), 256-key blocks spilled 32-420 bytes with
# lengths or a window (the block's key ids beside the mask's positions).
_SEGMENT_BLOCK_K = 192

# dQ's columns a product (and a TMA reduce-add) of the fused dk/dv kernel
# (``fuse_dq``): dQ^T's 64 rows, ``wgmma``'s M, are K's columns transposed.
FUSED_DQ_COLS = 64
# Queries a step of the fused dk/dv kernel: its S^T, dP^T and dQ^T tiles take
# 16 registers a thread each at 32 (at 64, 32 each spilled 112-248 bytes
# beside dK's and dV's accumulators, compiled for H100). Two consumers sharing
# dQ's columns take ``dkdv_rows`` instead (``fused_wide_steps``).
FUSED_ROWS = 32
# Queries a step of the dk/dv kernel's two consumers above head dim 64
# (``dkdv_rows``): S^T and dP^T take 16 registers a thread each, as in the fused one's.
NARROW_ROWS = 32

# The backward's and the tangent's (block_q, block_k) (but ``jvp_block_k``): each accumulator
# tile is 64 rows of one warpgroup, and wgmma contracts 64 at least with
# 128-byte swizzles (the dk/dv kernel contracts over its query block; its
# 32-query steps, ``dkdv_steps``, swizzle 64 bytes).
BWD_BLOCKS = (64, 64)

# The ring depths autotuning tries. 4 slots are left out: on the H200 (tuning
# run of docs/mosaic_gpu.md) the backward in 4 took 4497 us against 4462 in
# 2, and the forward's fastest ring was 2 slots of 128 keys; each depth is
# another compile of every candidate in pallax.verify and CI.
RING_SLOTS = (2, 3)


def dkdv_steps(p: Problem, config: MosaicGpuAttentionConfig) -> tuple[int, int]:
  """The dk/dv kernel's queries a step and consumer warpgroups (of 64 keys each).

  ``FUSED_ROWS`` with ``fuse_dq`` (``config.dkdv_rows`` where two consumers
  share dQ's columns), else ``config.dkdv_rows``; consumers
  ``config.dkdv_consumers``, by default ``wide_consumers`` and two of
  ``NARROW_ROWS``-query steps. Compiled for H100 at head dim 128 (batch 2),
  two consumers of 32-query steps are spill-free with every mask, lengths,
  segment ids and a soft cap, in 2 slots (S^T and dP^T take 16 registers a
  thread each at 32, 32 at 64). Two of 64-query steps are spill-free
  unmasked, with causal masks and with a soft cap, and with lengths,
  segment ids or windows where every step is masked (``masks_every_step``:
  in the loops of their own, 196 bytes with lengths at 8 query heads on 2,
  268 with segment ids, 20-100 with windows); fused, two spilled 84-328
  bytes with lengths, 104 with a causal mask at 8 query heads on 1, 176
  with a window (``_bwd_reason``, ``_fuse_reason``).
  """
  rows = config.dkdv_rows
  if config.fuse_dq:
    consumers = config.dkdv_consumers or wide_consumers(head(p))
    return (rows if shares_dq(head(p), consumers) else FUSED_ROWS), consumers
  default = CONSUMERS if rows == NARROW_ROWS else wide_consumers(head(p))
  return rows, config.dkdv_consumers or default


def shares_dq(h: int, consumers: int) -> bool:
  """Whether the fused dk/dv kernel's consumers split dQ's columns between them.

  As in FlashAttention-3's backward: two consumers at head dim 128 store
  their dS^T tiles in SMEM, and each computes ``FUSED_DQ_COLS`` of dQ's
  columns over both consumers' keys (128), one float32 tile a step to
  reduce-add, where consumers of their own keys' dQ (every column) add
  twice as many tiles.
  """
  return consumers > 1 and h == consumers * FUSED_DQ_COLS


def fused_wide_steps(p: Problem, config: MosaicGpuAttentionConfig) -> bool:
  """Whether the fused dk/dv kernel runs FlashAttention-3's tile: 64-query steps, operands in SMEM.

  Two consumers sharing dQ's columns (``shares_dq``) with ``dkdv_rows=64``
  store P^T and dS^T to SMEM, and dV's and dK's products read them there,
  as dQ^T's reads dS^T: beside the products in flight a consumer holds
  their accumulators alone, where as those products' register operands
  (the 32-query steps') P^T and dS^T spilled 316-384 bytes in 64-query
  steps, or ptxas serialized the products. Compiled for H100 (head dim
  128, batch 2, 16 on 16, 8 on 2, 8 on 1 and 2 on 2 heads, unmasked, keys
  filling the blocks) spill-free with the consumers at ``WIDE_REGISTERS``
  (at 232, 4 bytes spilled): a step of 64 queries takes 513 instructions
  and 32 ``HGMMA`` (S^T's, dP^T's and dQ^T's 24 of N=64, dV's and dK's 8
  of N=128, the head dim), two 32-query steps 690 and 56 (48 of N=32).
  Masked steps (a causal mask, windows, lengths, segment ids, padded keys)
  run as ``masks_every_step`` says.
  """
  rows, consumers = dkdv_steps(p, config)
  return config.fuse_dq and shares_dq(head(p), consumers) and rows == BWD_BLOCKS[0]


def two_wide_consumers(p: Problem, config: MosaicGpuAttentionConfig) -> bool:
  """Whether the dk/dv kernel runs two consumers above head dim 64, fused or of 64-query steps."""
  rows, consumers = dkdv_steps(p, config)
  return consumers == CONSUMERS and head(p) > 64 and (config.fuse_dq or rows > NARROW_ROWS)


def masks_every_step(p: Problem, config: MosaicGpuAttentionConfig) -> bool:
  """Whether the dk/dv kernel's two consumers above head dim 64 mask every step, in one loop.

  Each step is masked (``tiles.Tiles.keep_queries``) from the positions of
  its queries, a vector the ring brings with the step's lse: computed in
  registers, they are loop invariants ptxas keeps live (16 registers a
  thread at 64 queries). Where the masked and the unmasked steps ran in
  loops of their own, per query head, these spilled, compiled for H100
  (head dim 128, batch 2):

  * FlashAttention-3's tile (``fused_wide_steps``) with a causal mask or
    keys short of its blocks of threads (128): 328-1164 bytes; 124-440
    even without a mask in either loop (ptxas at the loops' edges); one
    loop per query head, every step masked, 28 with GQA; the positions in
    registers, 20-84; dS^T before dV's product (``dv_first``), 28; the mask
    as a float32 or bfloat16 bias tile in SMEM, 180-396. Masking every
    step: spill-free causal at 16 on 16, 8 on 8, 16 on 4, 8 on 2, 32 on 2,
    8 on 1, 32 on 1, 4 on 1 and 2 on 2 heads, at 1024-8192 keys and with
    padded keys (1000-8192), also with fewer keys than queries; windows,
    lengths and segment ids too, since K's and V's ``wgmma`` descriptors are
    computed in the step (``mgpu.Form.opaque_zero``: before, windows spilled
    260-364 bytes that way, lengths 384-476; ``_fuse_reason``). Since then
    (``causal_loops``) a causal mask alone, at one query head a kv head and
    no more queries than keys, runs the split loops spill-free;
  * 32-query steps with lengths (112-148 bytes with GQA) or a window (232
    with GQA; 32 causal at 16 on 16 heads and 2048 keys), where their split
    loops are spill-free with a causal mask alone: masking every step,
    lengths, causal lengths, windows and causal windows are spill-free at
    16 on 16, 8 on 8, 8 on 2, 8 on 1, 32 on 2, 16 on 4 and 2 on 2 heads
    (1000-8192 keys); a right bound alone (context parallelism's pieces:
    -64, -1, 20, 200) at 8 on 2, 8 on 1, 32 on 2, 16 on 4, 4 on 1 and 32 on
    1 heads (1000-4096 keys, 1024 queries on 512) too; segment ids (their
    split loops spilled 8-216 bytes), and lengths with a window, since
    ``opaque_zero`` (before, every step masked, 16-48 bytes with GQA).

  Unfused, two consumers of 64-query steps (``dkdv_consumers=2``) spilled
  196 bytes with lengths (8 on 2 heads), 268 with segment ids and 20-100
  with windows in those loops; every step masked, at
  ``mgpu.WIDE_REGISTERS`` (at 232, lengths 16 and windows 44), lengths,
  segment ids, windows and their mixes with a causal mask, each other and
  a soft cap are spill-free at 16 on 16, 8 on 8, 8 on 2, 8 on 1, 32 on 2,
  16 on 4 and 2 on 2 heads (512-4096 queries and keys, fewer queries than
  keys too). A causal mask alone keeps the loops of their own. A bias or a
  mask (their tile loaded in the step) masks every step too: in loops of
  their own a causal call spilled 296 bytes with a bfloat16 bias and 16
  with a float32 one and a soft cap, and even the loop of unmasked steps
  alone 48 with a bfloat16 bias at 16 on 16 heads; every step masked,
  spill-free at 16 on 16, 8 on 2 and 8 on 1 heads (1000-4096 keys, 512
  queries on 1024), causal or not, a mask alone too.

  Every step masked pays the mask (compares and selects, the positions'
  loads), also where it hides nothing.
  """
  if not config.fuse_dq:  # two consumers of 64-query steps (``_bwd_reason``)
    features = p.has_lengths or p.has_segments or windowed(p) or p.has_bias or p.has_mask
    return two_wide_consumers(p, config) and features
  if not shares_dq(head(p), dkdv_steps(p, config)[1]):
    return False
  if fused_wide_steps(p, config):  # padded keys are masked (``bwd_lengths``' keys)
    masked = has_masks(p) and not causal_loops(p)
    return masked or bwd_lengths(p, config)[1] != p.s
  return p.has_lengths or p.has_segments or windowed(p)


def causal_loops(p: Problem) -> bool:
  """Whether FlashAttention-3's tile runs a causal call's unmasked steps in a loop of their own.

  A causal mask alone (no window, lengths or segment ids), one query head a
  kv head, no more queries than keys. Compiled for H100 (batch 2, head dim
  128), those split loops are spill-free at 16 on 16, 8 on 8, 32 on 32, 4
  on 4, 2 on 2 and 1 on 1 heads (1024-8192 keys, 512 queries on 1024, 1024
  on 768, 4096 on 8192), where with GQA they spilled 820 bytes (8 on 2 and 8
  on 1 heads) and with twice as many queries as keys 24. An unmasked step
  takes 517-526 instructions there, a step masked in every step's loop
  620-629 (SASS, 16 on 16 heads, 4096 keys): a causal call's steps are
  mostly unmasked.
  """
  plain = not (windowed(p) or p.has_lengths or p.has_segments)
  return bounded(p) and plain and p.groups == 1 and p.t <= p.s


def fused_dq_tiles(h: int, consumers: int) -> int:
  """The dQ^T tiles (``FUSED_DQ_COLS`` columns each) a fused dk/dv consumer adds a step."""
  tiles = h // FUSED_DQ_COLS
  return tiles // consumers if shares_dq(h, consumers) else tiles


def bwd_lengths(p: Problem, config: MosaicGpuAttentionConfig) -> tuple[int, int]:
  """The backward's padded query and key lengths, which both its kernels take.

  Queries: a multiple of the dq kernel's blocks and the dk/dv kernel's
  steps; keys: of the dk/dv kernel's blocks of threads.
  """
  (rows, consumers), block_k = dkdv_steps(p, config), BWD_BLOCKS[1]
  tp = round_up(p.t, math.lcm(config.dq_consumers * DQ_ROWS, rows))
  return tp, round_up(p.s, consumers * block_k)


def kernel_keys(
  avals: Sequence[Any], target: str, config: MosaicGpuAttentionConfig, *, stage: str, **params
) -> dict[str, tuple]:
  """What the backward's dq and dk/dv kernels are built from (``ConfigSpace.kernel_keys``).

  ``_space`` crosses the dq kernel's consumers with the dk/dv kernel's steps
  and consumers, so configs share kernels: ``pallax.verify`` compiles each
  once. A kernel's key is the config without the fields only the other
  kernel reads, and the padded lengths, which both take. The forward and
  the tangent run one kernel a config: no keys.
  """
  if stage != "bwd":
    return {}
  p = Problem.of(avals, **params)
  lengths = bwd_lengths(p, config)
  keys = {DKDV_KERNEL: (dataclasses.replace(config, dq_consumers=1), lengths)}
  if not config.fuse_dq:  # the fused dk/dv kernel computes dQ: no dq kernel
    # A dq kernel writing the bias' gradient runs with a ``launch`` sum: its
    # compiled entry is ``SUMS_KERNEL``'s.
    name = mgpu.SUMS_KERNEL if p.differentiates_bias else DQ_KERNEL
    keys[name] = (dataclasses.replace(config, dkdv_rows=64, dkdv_consumers=None), lengths)
  return keys


def out_cols(p: Problem, kernel: str) -> int:
  """Columns of its results a block of threads of ``kernel`` computes.

  ``kernel``: the backward's ``"dq"`` or ``"dkdv"``, or ``"jvp"`` (the
  tangent's). A block of threads that computes a share of the columns
  computes S and dP (the tangent: dS) over the whole head dim for it; the
  shares split over blocks of threads (a grid axis). Compiled for H100 with
  a batch of 2 (pallax.verify): dQ takes 128 columns (256 whole is twice
  the registers), 64 at head dim 192 (shares divide the head dim) and with
  a window at 256 (128 spilled 8-216 bytes); the tangent's output likewise,
  but 128 columns with a window at 256 (spill-free, stop 61); dK
  and dV take their whole head dim up to 128, and 64 columns above it or with
  a soft cap: at head dim 256, 128 columns spilled 108-148 bytes, and whole
  at 128 a soft cap spilled 16-176 bytes, masked or not (the exact tanh's
  registers or not: one from ex2.approx and rsqrt.approx spilled as much).
  """
  h = head(p)
  if kernel == "dkdv" and (h > 128 or p.soft_cap is not None):
    return min(h, 64)
  window = kernel == "dq" and p.left is not None  # its two edges (the tangent's fit)
  if h > 128 and (window or h % 128):  # shares divide h
    return 64
  return min(h, 128)


def logit_bias_dtype(p: Problem) -> Any:
  """The dtype of the bias tiles (``tiles.logit_bias``, its tangent's): the bias', or the call's.

  A 16-bit bias streams as it is (a float32 copy would be written and read
  at twice its bytes, where a bias of every head is the call's largest
  operand) and a float32 one too (rounded to 16 bits a bias of a thousand
  would move the logits by up to 2); either is added in float32, as the
  reference adds it. A mask alone is 0 or -inf, exact in the call's dtype.
  """
  if p.bias_dtype is None:
    return p.dtype
  return p.bias_dtype if jnp.dtype(p.bias_dtype).itemsize == 2 else jnp.float32


def fwd_consumers(p: Problem) -> int:
  """Consumer warpgroups of the forward: two (ping-pong), one in what two spill in.

  Compiled for H100 with a batch of 2 (pallax.verify): above head dim 128
  two consumers' registers (O's 128 of them at 256) spilled
  12-16 bytes with a soft cap and a causal mask or lengths (1-8 query heads
  a kv head), and none with a soft cap and a window's lower bound, where one
  consumer of 255 registers spilled 8 bytes. So one consumer takes a soft cap
  with masks but no lower bound above head dim 128.
  """
  masks = has_masks(p) and p.left is None
  return 1 if head(p) > 128 and p.soft_cap is not None and masks else CONSUMERS


def wide_consumers(h: int) -> int:
  """Consumer warpgroups of the dk/dv (64-query steps) and tangent kernels: two up to 64, else one.

  Above head dim 64 two consumers' accumulators and tiles spill in the 232
  registers each gets with some features (the dk/dv kernel's 196 bytes at
  head dim 128 with lengths; the tangent's 12): ``dkdv_steps`` gives the
  dk/dv kernel two consumers where a config asks.
  """
  return CONSUMERS if h <= 64 else 1


def smem_bytes(
  p: Problem, config: MosaicGpuAttentionConfig, stage: str, jvp_keys: Optional[int] = None
) -> int:
  """SMEM of one block of threads of the stage's largest kernel on a GPU.

  The interpreted form takes more (transposed copies, staged operands): the
  interpreter has no SMEM limit. ``jvp_keys``: the tangent's keys a step
  (default ``jvp_block_k``'s).
  """
  h, item = head(p), jnp.dtype(p.dtype).itemsize
  fused = stage == "bwd" and config.fuse_dq
  rows, dkdv_consumers = dkdv_steps(p, config)
  c = config if stage == "fwd" else dataclasses.replace(config, block_q=rows, block_k=64)
  shapes = {
    "q": (c.block_q, c.block_k),
    "dq": (DQ_ROWS, c.block_k),
    "jvp": (DQ_ROWS, jvp_keys or jvp_block_k(p)),
    "k": (c.block_k, c.block_q),
  }
  h_out = {"q": h, "jvp": out_cols(p, "jvp"), "dq": out_cols(p, "dq"), "k": out_cols(p, "dkdv")}
  consumers = {
    "q": fwd_consumers(p),
    "dq": config.dq_consumers,
    "jvp": wide_consumers(h),
    "k": dkdv_consumers,
  }
  sizes = []
  kernels = [k for k in _SMEM[stage] if not fused or k.own == "k"]  # fused: the dk/dv kernel
  for k in kernels:
    (own, ring), n, cols = shapes[k.own], consumers[k.own], h_out[k.own]
    # dK and dV whole go through K's and V's SMEM; dQ and the tangent have tiles of their own.
    out = k.out_tiles if k.own != "k" or cols < h else 0
    ring_elements = (k.ring_tiles * h + k.shared_tiles * cols) * ring
    elements = n * (k.own_tiles * h + out * cols) * own + c.num_stages * ring_elements
    ringed = int(k.own == "k" and masks_every_step(p, config))  # the steps' query positions
    stats = n * k.own_stats * own + c.num_stages * (k.ring_stats + ringed) * ring
    # Segment ids: two int32 buffers (the own rows', the ring's), each rounded
    # up to whole KiB (``mgpu.SMEM_ALIGN``): compiled for H100, the forward at
    # head dim 256 in 3 slots took 232560 bytes with them, 1904 more than its
    # buffers' elements, and 881 more without them.
    ids = [n * own, c.num_stages * ring] if p.has_segments else []
    stats += sum(round_up(i, mgpu.SMEM_ALIGN // 4) for i in ids)
    # The bias (and mask), and in the tangent the bias' tangent: each slot a
    # tile of the consumers' rows (in the dk/dv kernel its keys').
    bias_tiles = (p.has_bias or p.has_mask) + (stage == "jvp" and p.differentiates_bias)
    bias = bias_tiles * c.num_stages * n * own * ring * jnp.dtype(logit_bias_dtype(p)).itemsize
    if k.own == "dq" and p.differentiates_bias:  # the float32 tile of dS a consumer writes
      bias += n * own * ring * 4
    dq_tiles = 0
    if fused:  # dS^T (two buffers where consumers share it), P^T's, dQ^T's float32 tiles
      ds_buffers = 1 + shares_dq(h, n) + fused_wide_steps(p, config)
      dq_tiles = n * (ds_buffers * own * item + 4 * fused_dq_tiles(h, n) * FUSED_DQ_COLS) * ring
    sizes.append(elements * item + 4 * stats + dq_tiles + bias)
  return max(sizes)


def _stages_reason(p: Problem, stage: str, stages: int) -> Optional[str]:
  """Why a ring of ``stages`` slots cannot serve the stage's kernels, if it cannot."""
  if stages < 2:
    return f"num_stages={stages}: the ring needs at least 2 slots"
  masked = has_masks(p) or p.has_bias or p.has_mask
  if stage == "bwd" and head(p) > 64 and masked and stages > 2:
    # Compiled for H100: 4 slots spill 36 bytes in the causal dk/dv kernel at
    # head dim 128 (with a bias or mask: not compiled, refused alike).
    return (
      f"num_stages={stages}: the backward takes 2 slots with masks, a bias or a mask above"
      " head dim 64"
    )
  if stage != "fwd" and head(p) > 64 and stages & (stages - 1):
    # Compiled for H100: 3 slots spill 112 bytes in the dk/dv kernel at head
    # dim 128, where 2 and 4 do not (a slot index mod 3 takes registers).
    return f"num_stages={stages}: the {stage} kernels take a power of two above head dim 64"
  return None


def _bwd_reason(p: Problem, config: MosaicGpuAttentionConfig) -> Optional[str]:
  """Why the backward's kernels cannot take ``config``'s steps and consumers, if they cannot."""
  n, h, rows, fused = config.dq_consumers, head(p), config.dkdv_rows, config.fuse_dq
  if n not in (1, CONSUMERS):
    return f"dq_consumers={n}: the dq kernel takes 1 or {CONSUMERS} consumer warpgroups"
  if n > 1 and h > 128:
    return f"dq_consumers={n}: more than one dq consumer up to head dim 128"
  if n > 1 and fused:
    return f"dq_consumers={n}: the fused backward (fuse_dq) runs no dq kernel"
  if rows not in (NARROW_ROWS, BWD_BLOCKS[0]):
    return f"dkdv_rows={rows}: the dk/dv kernel streams 64 or {NARROW_ROWS} queries a step"
  kv = config.dkdv_consumers
  if kv not in (None, CONSUMERS):
    return f"dkdv_consumers={kv}: the dk/dv kernel takes None (its steps' own) or {CONSUMERS}"
  if rows == NARROW_ROWS and fused and not shares_dq(h, kv or wide_consumers(h)):
    return (
      f"dkdv_rows={rows}: fuse_dq sets its own steps ({FUSED_ROWS} queries) unless two"
      " consumers share dQ's columns (dkdv_consumers=2 at head dim 128): leave dkdv_rows at 64"
    )
  if rows == NARROW_ROWS and not 64 < h <= 128:
    return f"dkdv_rows={rows}: 32-query steps in two consumers above head dim 64 up to 128"
  if kv == CONSUMERS and h > 128:
    return f"dkdv_consumers={kv}: two dk/dv consumers up to head dim 128"
  return _fuse_reason(p, config) if fused else None


def _fuse_reason(p: Problem, config: MosaicGpuAttentionConfig) -> Optional[str]:
  """Why the dk/dv kernel cannot compute dQ too (``fuse_dq``) on this call, if it cannot.

  Compiled for H100 with a batch of 2: at head dim 64 (two consumers) every
  mask, segment ids and a soft cap, 2-4 slots, spill-free; at head dim 128
  in 2 slots (4 spilled 132 bytes), one consumer (at 255 registers) or two
  sharing dQ's columns (``shares_dq``, at ``mgpu.WIDE_REGISTERS``; 32-query
  steps or FlashAttention-3's tile), every mask, lengths and segment ids,
  GQA and fewer queries than keys too (``masks_every_step`` says which
  calls mask every step). Two consumers spilled with segment ids (16-48
  bytes with GQA), lengths with a window (16-36), a causal mask or window
  with fewer queries than keys (16-364) and, in FlashAttention-3's tile,
  lengths, windows and segment ids (260-484) while their K's and V's
  ``wgmma`` descriptors were held in registers across the loop; computed
  in the step (``mgpu.Form.opaque_zero``), 492 such calls compiled
  spill-free (head layouts 16 on 16, 8 on 2, 8 on 1, 32 on 2, 16 on 4;
  T = S = 1000, 1024 and 4096, 512 on 1024, 1024 on 512; 12 mixes of
  causal masks, windows, lengths and segment ids).
  """
  h = head(p)
  if determinism.required():
    return f"fuse_dq: {determinism.reason()}; the fused dQ's reduce-adds run in no fixed order"
  if p.has_bias or p.has_mask:
    return (
      "fuse_dq: the fused dk/dv kernel streams no bias or mask tile and writes no bias"
      " gradient (the unfused kernels do)"
    )
  if out_cols(p, "dkdv") < h:
    return "fuse_dq: the dk/dv kernel splits dK's and dV's columns here (a share has no whole dQ)"
  if h > 64 and config.num_stages > 2:
    return f"num_stages={config.num_stages}: fuse_dq above head dim 64 takes 2 slots (4 spill)"
  return None


def _config_reason(p: Problem, config: MosaicGpuAttentionConfig, stage: str) -> Optional[str]:
  """Why ``config``'s blocks and ring cannot serve the stage on this call, if they cannot."""
  bk = config.block_k
  if stage == "fwd" and config.block_q != mgpu.WGMMA_ROWS:
    return f"block_q={config.block_q}: the forward takes 64 (a consumer's wgmma rows; 128 spills)"
  if stage == "fwd" and bk % 64:
    return f"block_k={bk} must be a multiple of 64 on Mosaic GPU"
  if stage == "fwd" and bk > _BOUNDED_BLOCK_K and head(p) > 64 and bounded(p):
    return (
      f"block_k={bk}: with a causal mask or window above head dim 64 the forward takes"
      f" up to {_BOUNDED_BLOCK_K} keys a block (spills)"
    )
  if stage == "fwd" and p.has_segments and bk > _SEGMENT_BLOCK_K:
    return (
      f"block_k={bk}: with segment ids the forward takes up to {_SEGMENT_BLOCK_K} keys a block"
      " (spills)"
    )
  if stage == "fwd" and config.fwd_overlap and (head(p) > 128 or bk > 128):
    return (
      f"fwd_overlap: up to head dim 128 and block_k 128, not {head(p)} and {bk}"
      " (a block's S and P beside the output's accumulator spill)"
    )
  reason = _bwd_reason(p, config) if stage == "bwd" else None
  reason = reason or _stages_reason(p, stage, config.num_stages)
  if reason is not None:
    return reason
  smem = smem_bytes(p, config, stage)
  if smem > mgpu.SMEM_BUDGET:
    return f"{config} needs {smem} bytes of SMEM in the {stage} kernels, over {mgpu.SMEM_BUDGET}"
  return None


def _space(p: Problem, stage: str) -> list[MosaicGpuAttentionConfig]:
  """Configs in order of preference: fewer consumers, blocks, fewer slots, within SMEM.

  The forward's blocks: the heuristic's 128 keys, then 64, 192 and 256.

  The backward's consumers: one or two in the dq kernel, and the dk/dv
  kernel's 64-query steps (in two consumers where one is its default), or
  its two consumers of 32; then the dk/dv kernel computing dQ too
  (``fuse_dq``: its consumers, 2 slots), where XLA's flags do not ask for
  deterministic ops (``pallax.determinism``). The forward's: its blocks
  with ``fwd_overlap`` too, in 2 slots.
  """
  blocks = [(64, b) for b in (128, 64, 192, 256)] if stage == "fwd" else [BWD_BLOCKS]
  wide = [None, CONSUMERS] if wide_consumers(head(p)) == 1 else [None]
  # The backward's consumers: the dq kernel's, and the dk/dv kernel's steps and consumers.
  shapes = [(n, 64, kv) for kv in wide for n in (1, CONSUMERS)]
  shapes += [(n, NARROW_ROWS, None) for n in (1, CONSUMERS)]
  configs = [
    MosaicGpuAttentionConfig(bq, bk, st, dq_consumers=n, dkdv_rows=rows, dkdv_consumers=kv)
    for n, rows, kv in (shapes if stage == "bwd" else shapes[:1])
    for bq, bk in blocks
    for st in RING_SLOTS
  ]
  if stage == "fwd":
    two_slots = [c for c in configs if c.num_stages == 2]
    configs += [dataclasses.replace(c, fwd_overlap=True) for c in two_slots]
  if stage == "bwd":
    fused = MosaicGpuAttentionConfig(*BWD_BLOCKS, 2, fuse_dq=True)
    configs += [dataclasses.replace(fused, dkdv_consumers=kv) for kv in wide]
    if CONSUMERS in wide:  # two sharing dQ's columns: 64-query steps or 32
      configs.append(dataclasses.replace(fused, dkdv_rows=NARROW_ROWS, dkdv_consumers=CONSUMERS))
  return [c for c in configs if _config_reason(p, c, stage) is None]


def splits_columns(p: Problem, stage: str = "bwd") -> bool:
  """Whether the stage's blocks of threads split their results' columns (``out_cols``)."""
  kernels = {"bwd": ("dq", "dkdv"), "jvp": ("jvp",)}[stage]
  return min(out_cols(p, k) for k in kernels) < head(p)


def jvp_block_k(p: Problem) -> int:
  """Keys a step of the tangent kernel: 64 where a 2-slot ring of them fits SMEM, else 32.

  At head dim 256 its Q and dQ (64 KiB), its output's float32 share (32
  KiB), and a 2-slot ring of 64 keys' K and dK (128 KiB) and V and dV in 128
  columns (64 KiB) are over a block's SMEM; with 32 keys the ring takes 96
  KiB. A bias or a mask adds its tile of the consumers' rows to each slot,
  and a differentiated bias its tangent's: a float32 bias and its tangent
  take 32 keys (64 needed 257 KiB at head dims 64-192), a 16-bit one 64 up
  to 192 without segment ids (224.5 KiB; with them 32 from head dim 128). Always
  sized for 2 slots: a 3-slot candidate at head dim 64 that 32 keys would
  fit is left out.
  """
  fits = smem_bytes(p, MosaicGpuAttentionConfig(*BWD_BLOCKS), "jvp", BWD_BLOCKS[1])
  return BWD_BLOCKS[1] if fits <= mgpu.SMEM_BUDGET else BWD_BLOCKS[1] // 2


def heuristic(avals: Sequence[Any], target: str, *, stage: str, **params):
  """Forward: 128-key blocks in a 2-slot ring where they are legal, else 64; backward: 64 x 64.

  128-key blocks are legal up to head dim 128 (SMEM: ``_config_reason``).
  None (the Triton kernels by default, these an autotuning candidate) for a
  backward that splits its results' columns (head dim 256, a soft cap above
  64): its blocks of threads compute S and dP once a share (at 256, 15
  products' work against 7) and have not been timed against the Triton
  backward on a GPU; likewise for a tangent that splits them (above head
  dim 128: S and dS once a share, in steps of 32 keys at 256); for a
  forward of one consumer (``fwd_consumers``: no ping-pong); and for a
  call with a bias or mask, every stage (a tile of them streamed each
  step; the backward's written too where the bias is differentiated),
  not timed either.
  """
  p = Problem.of(avals, **params)
  shape = fwd_consumers(p) == 1 if stage == "fwd" else splits_columns(p, stage)
  untimed = shape or p.has_bias or p.has_mask
  if untimed and feature_reason(p, stage) is None:
    return None
  if stage == "fwd":
    configs = [MosaicGpuAttentionConfig(block_k=bk) for bk in (128, 64)]
    return next((c for c in configs if _config_reason(p, c, stage) is None), configs[-1])
  return MosaicGpuAttentionConfig(*BWD_BLOCKS)


def candidates(avals: Sequence[Any], target: str, *, stage: str, **params):
  """The heuristic's config and every config of ``_space`` (consumers, ring shapes) that fits."""
  p = Problem.of(avals, **params)
  base = heuristic(avals, target, stage=stage, **params)
  return list(dict.fromkeys([*([] if base is None else [base]), *_space(p, stage)]))


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuAttentionConfig, *, stage: str, **params
) -> Optional[str]:
  """Why the Mosaic GPU kernels cannot run this call with ``config``, if they cannot."""
  p = Problem.of(avals, **params)
  reason = feature_reason(p, stage)
  return reason if reason is not None else _config_reason(p, config, stage)


def call_of(stage: str, operands, params, interpret) -> tuple[Call, Problem, mgpu.Form]:
  """A stage's call, its facts and the kernel's form; NotImplementedError for a feature it lacks."""
  c = Call.of(stage, operands, params)
  reason = feature_reason(c.p, stage)
  if reason is not None:
    raise NotImplementedError(f"dot_product_attention: {reason}")
  return c, c.p, mgpu.Form.of(interpret)
