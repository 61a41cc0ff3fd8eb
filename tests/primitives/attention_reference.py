"""Shared by the attention tests: the float64 reference, random inputs, comparisons.

The reference is written from the definition (jax.nn.dot_product_attention's
masks), not from pallax's XLA program: logits ``scale * q.k + bias`` in
float64, the causal, window, length and boolean masks ANDed, a softmax over
the visible keys and the product with ``value``. A query row with no visible
key gives 0 (output and gradients) and ``lse = -inf``; that is where pallax
differs from jax.nn by design.

The extensions of issue 14 are written from their definitions too: the
Gemma 2 soft cap ``c * tanh(l / c)`` on the scaled logits before the bias,
segment ids (query ``t`` sees key ``s`` only within the same segment) ANDed
with the other masks, and per-head sinks: a logit that joins each row's
softmax denominator and attends to nothing, so a row that sees no key gives 0
with ``lse = sink``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import pallax
from tests.helpers import TOL, f64, rand


# Pinned configs with blocks smaller than T and S on the interpreted kernels:
# several query blocks, a loop over key blocks (and block skipping under causal
# and window masks). Mosaic TPU blocks: block_q a multiple of 8, block_k of 128
# (or covering S).
def small_blocks(path: str):
  """The pinned multi-block config of ``path`` (None on the XLA path)."""
  return {
    "xla": None,
    "triton": pallax.AttentionConfig(block_q=16, block_k=16),
    "mosaic_tpu": pallax.AttentionConfig(block_q=8, block_k=128),
  }[path]


def _visible(b, n, t, s, mask, is_causal, q_len, kv_len, window, q_seg=None, kv_seg=None):
  """The (b, n, t, s) bool array of the keys each query sees (jnp: lengths may be traced).

  ``q_seg`` ``(b, t)`` and ``kv_seg`` ``(b, s)``: segment ids (both or neither).
  """
  qi = jnp.arange(t)[:, None]
  ki = jnp.arange(s)[None, :]
  vis = jnp.ones((b, n, t, s), bool)
  if mask is not None:
    vis = vis & jnp.broadcast_to(jnp.asarray(mask), (b, n, t, s))
  if is_causal:
    vis = vis & (ki <= qi)
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    vis = vis & (qi - left <= ki) & (ki <= qi + right)
  if q_len is not None:
    vis = vis & (qi < jnp.asarray(q_len)[:, None, None, None])
  if kv_len is not None:
    vis = vis & (ki < jnp.asarray(kv_len)[:, None, None, None])
  if (q_seg is None) != (kv_seg is None):
    raise ValueError("reference: give both segment ids or neither")
  if q_seg is not None:
    same = jnp.asarray(q_seg)[:, :, None] == jnp.asarray(kv_seg)[:, None, :]  # (b, t, s)
    vis = vis & same[:, None]
  return vis


def _batched_segments(q_seg, kv_seg, unbatched: bool):
  """Segment ids with a batch dim (unbatched calls give ``(T,)`` and ``(S,)``)."""
  if q_seg is None or not unbatched:
    return q_seg, kv_seg
  return jnp.asarray(q_seg)[None], jnp.asarray(kv_seg)[None]


def reference(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  scale=None,
  is_causal=False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  logits_soft_cap=None,
  sinks=None,
  return_residual=False,
):
  """Independent float64 dot-product attention (call under ``tests.helpers.x64()``).

  Args:
    query: ``(B, T, N, H)`` or ``(T, N, H)``.
    key: ``(B, S, K, H)`` or ``(S, K, H)``; query head ``n`` uses key head
      ``n // (N // K)``.
    value: like ``key``, with any head dim ``Hv`` (the output's).
    bias: broadcastable to ``(B, N, T, S)`` (dims missing at the front).
    mask: bool, broadcastable to ``(B, N, T, S)``.
    scale: the logits' scale; ``1 / sqrt(H)`` when None.
    is_causal: query ``t`` sees keys ``s <= t``.
    query_seq_lengths: ``(B,)``; query rows ``t >= q_len[b]`` see nothing.
    key_value_seq_lengths: ``(B,)``; keys ``s >= kv_len[b]`` are never seen.
    local_window_size: ``w`` or ``(left, right)``: query ``t`` sees keys
      ``t - left <= s <= t + right``.
    q_segment_ids: int ``(B, T)`` (``(T,)``); with ``kv_segment_ids`` ``(B, S)``
      (``(S,)``): query ``t`` sees key ``s`` only if their ids are equal.
    kv_segment_ids: see ``q_segment_ids``.
    logits_soft_cap: ``c``: the scaled logits become ``c * tanh(l / c)``
      (before the bias is added).
    sinks: ``(N,)``: per query head, a logit added to every row's softmax
      denominator that attends to nothing (differentiable).
    return_residual: also return the logsumexp of the visible logits (and the
      sink), ``(B, T, N)`` (``-inf`` where no key is visible and there is no
      sink), with no gradient.

  Returns:
    The float64 output shaped like ``query`` (and the residual).
  """
  q, k, v = (jnp.asarray(a).astype(jnp.float64) for a in (query, key, value))
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = jnp.repeat(k, n // kh, axis=2)
  v = jnp.repeat(v, n // kh, axis=2)
  scale = 1.0 / np.sqrt(h) if scale is None else scale
  hi = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if bias is not None:
    logits = logits + jnp.asarray(bias).astype(jnp.float64)
  q_seg, kv_seg = _batched_segments(q_segment_ids, kv_segment_ids, unbatched)
  vis = _visible(
    b,
    n,
    t,
    s,
    mask,
    is_causal,
    query_seq_lengths,
    key_value_seq_lengths,
    local_window_size,
    q_seg,
    kv_seg,
  )
  # Double where: masked logits never reach exp (no inf * 0 in the gradient).
  safe = jnp.where(vis, logits, 0.0)
  m = jnp.max(jnp.where(vis, logits, -jnp.inf), -1, keepdims=True)
  if sinks is not None:
    sink = jnp.asarray(sinks).astype(jnp.float64)[None, :, None, None]  # (1, n, 1, 1)
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(m)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(vis, jnp.exp(safe - m), 0.0)
  total = jnp.sum(e, -1, keepdims=True)
  if sinks is not None:
    total = total + jnp.exp(sink - m)  # the sink's share: in the denominator only
  any_visible = total > 0
  total = jnp.where(any_visible, total, 1.0)
  p = e / total
  out = jnp.einsum("bnts,bsnh->btnh", p, v, precision=hi)
  lse = jnp.where(any_visible, m + jnp.log(total), -jnp.inf)[..., 0]  # (b, n, t)
  lse = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)))
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def visible_rows(query_shape, key_shape, **masks) -> np.ndarray:
  """Bool ``(B, T, N)`` (``(T, N)`` unbatched): query rows that see at least one key.

  ``masks``: the reference's masking keywords (``mask``, ``is_causal``, the
  lengths, ``local_window_size``, the segment ids).
  """
  unbatched = len(query_shape) == 3
  b, t, n = (1,) + tuple(query_shape[:2]) if unbatched else tuple(query_shape[:3])
  s = key_shape[-3]
  q_seg, kv_seg = _batched_segments(
    masks.get("q_segment_ids"), masks.get("kv_segment_ids"), unbatched
  )
  vis = _visible(
    b,
    n,
    t,
    s,
    masks.get("mask"),
    masks.get("is_causal", False),
    masks.get("query_seq_lengths"),
    masks.get("key_value_seq_lengths"),
    masks.get("local_window_size"),
    q_seg,
    kv_seg,
  )
  rows = np.transpose(np.asarray(jnp.any(vis, -1)), (0, 2, 1))
  return rows[0] if unbatched else rows


# ------------------------------------------------------------------------------
# Inputs.


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention call: shapes and the masking features used."""

  b: Optional[int] = 2  # None: unbatched TNH / SKH inputs
  t: int = 40
  s: int = 40
  n: int = 4
  k: int = 4
  h: int = 64
  bias: Optional[tuple[int, ...]] = None  # its shape; fewer than 4 dims broadcast from the front
  mask: Optional[tuple[int, ...]] = None  # likewise; random, keeping about 70%
  is_causal: bool = False
  window: Any = None
  q_len: Optional[tuple[int, ...]] = None
  kv_len: Optional[tuple[int, ...]] = None
  scale: Optional[float] = None
  logit_scale: float = 1.0  # multiplies query: larger logits (online-softmax rescaling)

  def shapes(self):
    lead = () if self.b is None else (self.b,)
    return (lead + (self.t, self.n, self.h), lead + (self.s, self.k, self.h))


def random_mask(rng: np.random.Generator, shape, keep: float = 0.7) -> jnp.ndarray:
  """A random bool mask keeping about ``keep`` of the entries."""
  return jnp.asarray(rng.random(shape) < keep)


def inputs(case: Case, dtype=jnp.float32, seed: int = 0) -> tuple[tuple, dict]:
  """``(args, kwargs)`` of a pallax / reference call for ``case``, drawn from ``seed``."""
  rng = np.random.default_rng(seed)
  q_shape, kv_shape = case.shapes()
  q = rand(rng, q_shape, dtype, scale=case.logit_scale)
  k, v = rand(rng, kv_shape, dtype), rand(rng, kv_shape, dtype)
  bias = None if case.bias is None else rand(rng, case.bias, dtype)
  mask = None if case.mask is None else random_mask(rng, case.mask)
  kwargs = dict(
    scale=case.scale,
    is_causal=case.is_causal,
    local_window_size=case.window,
    query_seq_lengths=None if case.q_len is None else jnp.asarray(case.q_len, jnp.int32),
    key_value_seq_lengths=None if case.kv_len is None else jnp.asarray(case.kv_len, jnp.int32),
  )
  return (q, k, v, bias, mask), kwargs


# ------------------------------------------------------------------------------
# Comparisons.


def rel_err_finite(got, want) -> float:
  """Max relative error where ``want`` is finite (``got`` must be finite there)."""
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, (got.shape, want.shape)
  finite = np.isfinite(want)
  if not finite.any():
    return 0.0
  g, w = got[finite], want[finite]
  assert np.all(np.isfinite(g)), "non-finite values where the reference is finite"
  return float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30))


def assert_lse_close(got, want, dtype, what: str = "lse") -> None:
  """``-inf`` exactly where ``want`` is, close elsewhere (``TOL`` of ``dtype``)."""
  got, want = f64(got), f64(want)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf rows")
  err = rel_err_finite(got, want)
  tol = TOL[jnp.dtype(dtype).name]
  assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g} ({jnp.dtype(dtype).name})"
