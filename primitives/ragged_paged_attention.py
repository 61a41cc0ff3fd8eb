"""Ragged paged attention: ``pallax.ragged_paged_attention``, prefill and decode in one batch.

The layout of JAX's TPU ``ragged_paged_attention``: the query tokens of every
sequence concatenated along one axis (``cu_q_lens`` their offsets), each
sequence attending causally, bottom-right aligned, to its ``kv_len`` cached
tokens (its new ones included) through its page table, in
``paged_attention``'s pools. One primitive, declared as a user declares an
op (``pallax.custom_op``):

* ``ragged_paged_attention (q, k_pages, v_pages, kv_lens, page_indices,
  cu_q_lens, num_seqs) -> (out, lse)`` with the operands of
  ``kernels/ragged_paged_attention/common.py``; its lowering is the XLA
  program (CPU), the Triton kernel (GPU) or the Mosaic kernel (TPU), as the
  executor's ``RaggedPagedAttentionConfig`` says. Sinks are applied to
  ``out`` from ``lse`` around it.

An inference op: ``grad`` / ``jvp`` raise ``NotImplementedError``. vmap folds
into the tokens and sequences (``batching_rules/ragged_paged_attention.py``);
kv heads (with their query heads) shard, everything else is replicated.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallax import paging, validation
from pallax.batching_rules import ragged_paged_attention as ragged_batching
from pallax.custom_op import custom_op
from pallax.kernels import ragged_paged_attention as kernels
from pallax.kernels.ragged_paged_attention import RaggedPagedAttentionConfig
from pallax.kernels.ragged_paged_attention import xla as ragged_xla
from pallax.kernels.ragged_paged_attention.mosaic_gpu import MosaicGpuRaggedPagedAttentionConfig

__all__ = [
  "ragged_paged_attention",
  "RaggedPagedAttentionConfig",
  "MosaicGpuRaggedPagedAttentionConfig",
]

_OP = "ragged_paged_attention"


def _out_shapes(q, k_pages, v_pages, *_, **params):
  t, kh, g, _ = q.shape
  stat = jnp.promote_types(q.dtype, jnp.float32)
  return (
    jax.ShapeDtypeStruct((t, kh, g, v_pages.shape[3]), q.dtype),
    jax.ShapeDtypeStruct((t, kh, g), stat),
  )


ragged_paged_attention_op = custom_op(
  _OP,
  reference=ragged_xla.ragged_paged_attention,
  abstract_eval=_out_shapes,
  dims="t k g h, k p ps h, k p ps hv, s, s pp, s1, n -> t k g hv, t k g",
  # In order of appearance (Shardy sorts them): only kv and query heads shard.
  replicated=("t", "h", "p", "ps", "hv", "s", "pp", "s1", "n"),
  kernels=kernels.KERNEL.impls,
  config=kernels.KERNEL.space,
  own_configs=kernels.KERNEL.spaces,
  batching=ragged_batching.fold_into_tokens,
  jvp=paging.no_derivatives(_OP),
)
ragged_paged_attention_p = ragged_paged_attention_op.primitive


# ----------------------------------------------------------------------------
# The public function: validation and layout.


def _check_offsets(cu_q_lens, num_seqs, kv_lens, tokens: int) -> None:
  """Static checks of concrete offsets and counts (traced ones are clamped)."""
  cu, num, kv = (validation.concrete(x) for x in (cu_q_lens, num_seqs, kv_lens))
  seqs = kv_lens.shape[0]
  if num is not None and not 0 <= int(num.reshape(-1)[0]) <= seqs:
    raise ValueError(
      f"{_OP}: num_seqs must lie in [0, max_seqs] = [0, {seqs}], got {int(num.reshape(-1)[0])}"
    )
  if cu is None or num is None:
    return
  used = cu[: int(num.reshape(-1)[0]) + 1]
  if used[0] != 0:
    raise ValueError(f"{_OP}: cu_q_lens[0] must be 0, got {used[0]}")
  steps = np.diff(used)
  if (steps < 0).any():
    i = int(np.nonzero(steps < 0)[0][0])
    raise ValueError(
      f"{_OP}: cu_q_lens must not decrease over the num_seqs + 1 offsets in use; "
      f"cu_q_lens[{i}] = {used[i]} > cu_q_lens[{i + 1}] = {used[i + 1]}"
    )
  if used[-1] > tokens:
    raise ValueError(
      f"{_OP}: cu_q_lens[num_seqs] = {used[-1]} is past q's {tokens} tokens (q has shape "
      f"(T, N, H) with T = {tokens})"
    )
  if kv is not None and (steps > kv[: len(steps)]).any():
    i = int(np.nonzero(steps > kv[: len(steps)])[0][0])
    raise ValueError(
      f"{_OP}: sequence {i} has more queries than cached tokens (q_len {steps[i]} > kv_lens[{i}] "
      f"= {kv[i]}): kv_lens counts the new tokens too"
    )


def ragged_paged_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  kv_lens: jax.Array,
  page_indices: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  *,
  scale: Optional[float] = None,
  logits_soft_cap: Optional[float] = None,
  sliding_window: Optional[int] = None,
  sinks: Optional[jax.Array] = None,
  config: Optional[Union[RaggedPagedAttentionConfig, MosaicGpuRaggedPagedAttentionConfig]] = None,
) -> jax.Array:
  """Attention of a batch mixing prefill chunks and decode tokens over a paged KV cache.

  Sequence ``i < num_seqs`` owns query tokens ``cu_q_lens[i] : cu_q_lens[i +
  1]`` of ``q`` (``q_len`` of them) and ``kv_lens[i]`` cached tokens, the new
  ones last: its query ``j`` sits at position ``kv_lens[i] - q_len + j`` and
  attends to the cached tokens at positions up to its own (bottom-right
  causal), the last ``sliding_window`` of them with a window. Token ``s`` of
  sequence ``i`` is row ``s % page_size`` of page ``page_indices[i, s //
  page_size]`` of the pools (``paged_attention``'s layout). Per query head:
  ``softmax(soft_cap(scale * q k^T)) v``, logits and statistics in float32
  (float64 for float64 inputs). Tokens past ``cu_q_lens[num_seqs]`` give 0.

  Values known at trace time are checked (for the ``num_seqs`` sequences in
  use: the other slots may hold anything); traced ones are clamped (lengths
  into the page table, page indices into the pool, offsets into ``[0, T]``
  from 0 and made non-decreasing).

  Args:
    q: ``(T, N, H)``, floating: the batch's query tokens.
    k_pages: ``(K, total_pages, page_size, H)``, q's dtype; ``K`` divides
      ``N`` (query head ``n`` reads kv head ``n // (N // K)``).
    v_pages: ``(K, total_pages, page_size, Hv)``, q's dtype.
    kv_lens: ``(max_seqs,)`` integer: each sequence's cached tokens,
      counting its new ones.
    page_indices: ``(max_seqs, pages_per_sequence)`` integer.
    cu_q_lens: ``(max_seqs + 1,)`` integer: the sequences' query offsets,
      from 0, non-decreasing.
    num_seqs: integer scalar or ``(1,)``: the sequences in use.
    scale: the logits' scale; default ``1 / sqrt(H)``.
    logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)``.
    sliding_window: ``w >= 1``: a query sees the last ``w`` positions up to
      its own; None: all of them.
    sinks: ``(N,)`` floating: a logit per head that joins every softmax's
      denominator and adds no value (attention sinks); None: none.
    config: pin the kernel's ``RaggedPagedAttentionConfig`` (or
      ``RaggedPagedAttentionConfig(implementation="xla")``), or the Hopper
      kernel's ``MosaicGpuRaggedPagedAttentionConfig``.

  Returns:
    ``(T, N, Hv)`` in q's dtype.

  Raises:
    ValueError: concrete offsets, counts, lengths or page indices that break
      the rules above (offsets decreasing, a sequence with more queries than
      cached tokens, lengths past the page table), naming the argument.
    NotImplementedError: under ``grad``, ``jvp`` and the like: an inference op.
  """
  validation.check_config(
    _OP, config, (RaggedPagedAttentionConfig, MosaicGpuRaggedPagedAttentionConfig)
  )
  known = validation.concrete(num_seqs)  # the slots in use, when known: only theirs are checked
  used = int(np.clip(known.reshape(-1)[0], 0, None)) if known is not None and known.size else None
  q, k_pages, v_pages, kv_lens, page_indices, scale, cap = paging.check_call(
    _OP, (q, k_pages, v_pages, kv_lens, page_indices), "kv_lens", scale, logits_soft_cap, None, used
  )
  t, n, h = q.shape
  kv_heads, total_pages, page_size, _ = k_pages.shape
  cu_q_lens = paging.array(_OP, "cu_q_lens", cu_q_lens, 1)
  num_seqs = jnp.asarray(num_seqs)
  paging.check_integer(_OP, "cu_q_lens", cu_q_lens)
  paging.check_integer(_OP, "num_seqs", num_seqs)
  seqs = kv_lens.shape[0]
  if cu_q_lens.shape != (seqs + 1,):
    raise ValueError(
      f"{_OP}: cu_q_lens must have shape (max_seqs + 1,) = ({seqs + 1},), got {cu_q_lens.shape}"
    )
  if num_seqs.size != 1 or num_seqs.ndim > 1:
    raise ValueError(f"{_OP}: num_seqs must be a scalar or have shape (1,), got {num_seqs.shape}")
  if sliding_window is not None:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)):
      raise TypeError(f"{_OP}: sliding_window must be a Python int, got {sliding_window!r}")
    if sliding_window < 1:
      raise ValueError(f"{_OP}: sliding_window must be >= 1, got {sliding_window}")
    sliding_window = int(sliding_window)
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    validation.check_floating(_OP, "sinks", sinks)
    if sinks.shape != (n,):
      raise ValueError(f"{_OP}: sinks must have shape (N,) = ({n},), got {sinks.shape}")
  max_len = page_indices.shape[1] * page_size
  _check_offsets(cu_q_lens, num_seqs, kv_lens, t)
  hv = v_pages.shape[3]
  if 0 in (t, n, seqs, max_len):  # no query, no sequence or no cache: nothing to attend to
    return jnp.zeros((t, n, hv), q.dtype)
  kv_lens, page_indices = paging.clamped(kv_lens, page_indices, page_size, total_pages)
  cu_q_lens = lax.cummax(jnp.clip(cu_q_lens, 0, t).astype(jnp.int32).at[0].set(0))
  num_seqs = jnp.clip(num_seqs.reshape(1), 0, seqs).astype(jnp.int32)
  out, lse = ragged_paged_attention_op(
    q.reshape(t, kv_heads, n // kv_heads, h),
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    config=config,
    scale=scale,
    logits_soft_cap=cap,
    sliding_window=sliding_window,
  )
  out, lse = out.reshape(t, n, hv), lse.reshape(t, n)
  if sinks is not None:  # exp(lse) / (exp(lse) + exp(sink)): the sink's share left out
    share = jax.nn.sigmoid(lse - sinks.astype(lse.dtype))
    share = jnp.where(lse == -jnp.inf, 0.0, share)  # no key seen (a -inf sink too): 0
    out = (out * share[..., None]).astype(q.dtype)
  return out
