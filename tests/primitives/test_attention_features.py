"""dot_product_attention's extensions (issue 14): segment ids, soft cap, sinks, Hv != H.

Everything is compared with the independent float64 reference of
attention_reference.py (whose new arguments are first checked against other
formulations: a boolean mask, an extra key column, a NumPy soft cap). Each
path (the XLA program and the interpreted Triton and Mosaic TPU kernels, the
kernels with pinned blocks smaller than T and S) runs a few representative
cases that combine the new features with the old ones: packed sorted
documents under a causal mask with boundaries inside blocks, unsorted random
ids, query rows whose segment has no key (with and without sinks), a soft cap
on large logits, sinks with GQA / MQA, a value head dim unlike the query's.
Forward, lse, reverse-mode gradients of query / key / value / bias / sinks
and jvp (tangents in all five). Also: grad stays one forward and one backward
primitive, bad input names its argument, and every feature lowers for CUDA,
ROCm and TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor.tools import kernel_calls
from tests.helpers import (
  CALL_TARGET,
  PATHS,
  TOL,
  assert_close,
  attention_primitives_of,
  f64,
  lower_text,
  on_path,
  rand,
  to64,
  x64,
)
from tests.primitives.attention_reference import (
  assert_lse_close,
  random_mask,
  reference,
  small_blocks,
  visible_rows,
)

KERNEL_PATHS = ("triton", "mosaic_tpu")
# Operands that are floating (made float64 for the reference) and differentiable.
FLOATING = ("query", "key", "value", "bias", "sinks")
FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))


@dataclasses.dataclass(frozen=True)
class Case:
  """One call: shapes, the old masking features and the new ones."""

  b: Optional[int] = 2  # None: unbatched TNH / SKH inputs, (T,) / (S,) segment ids
  t: int = 40
  s: int = 40
  n: int = 4
  k: int = 2
  h: int = 32
  hv: Optional[int] = None  # the value head dim (None: h)
  bias: Optional[tuple[int, ...]] = None  # its shape (broadcast from the front)
  mask: Optional[tuple[int, ...]] = None
  is_causal: bool = False
  window: Any = None
  q_len: Optional[tuple[int, ...]] = None
  kv_len: Optional[tuple[int, ...]] = None
  # "packed": sorted documents of random lengths (boundaries not on block
  # edges), the same for queries and keys when T = S (else the query's over T,
  # the key's over S); "random": unsorted ids
  # drawn from {0, 1, 2}; "missing": random ids, and query ids 3 that no key has.
  segments: Optional[str] = None
  soft_cap: Optional[float] = None
  sinks: bool = False
  logit_scale: float = 1.0  # multiplies query: larger logits


def _packed_ids(rng, length: int, docs: int) -> np.ndarray:
  """Sorted ids ``0..docs-1`` over ``length`` tokens, documents of random lengths >= 1."""
  cuts = np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False))
  assert np.any(cuts % 8), cuts  # a boundary inside the kernels' query and key blocks
  return np.searchsorted(cuts, np.arange(length), side="right")


def _segment_ids(rng, case: Case):
  lead = 1 if case.b is None else case.b
  if case.segments == "packed":  # the same documents for queries and keys when T = S
    q_seg = np.stack([_packed_ids(rng, case.t, 4) for _ in range(lead)])
    kv_seg = (
      q_seg if case.t == case.s else np.stack([_packed_ids(rng, case.s, 4) for _ in range(lead)])
    )
  else:
    q_seg = rng.integers(0, 3, (lead, case.t))
    kv_seg = rng.integers(0, 3, (lead, case.s))
    if case.segments == "missing":
      q_seg[:, 2::5] = 3  # a segment of the queries that no key belongs to
  if case.b is None:
    q_seg, kv_seg = q_seg[0], kv_seg[0]
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def inputs(case: Case, dtype=jnp.float32, seed: int = 0) -> tuple[dict, dict]:
  """``(operands, statics)`` of a pallax / reference call for ``case``."""
  rng = np.random.default_rng(seed)
  lead = () if case.b is None else (case.b,)
  hv = case.hv or case.h
  ops = dict(
    query=rand(rng, lead + (case.t, case.n, case.h), dtype, scale=case.logit_scale),
    key=rand(rng, lead + (case.s, case.k, case.h), dtype),
    value=rand(rng, lead + (case.s, case.k, hv), dtype),
    bias=None if case.bias is None else rand(rng, case.bias, dtype),
    mask=None if case.mask is None else random_mask(rng, case.mask),
    query_seq_lengths=None if case.q_len is None else jnp.asarray(case.q_len, jnp.int32),
    key_value_seq_lengths=None if case.kv_len is None else jnp.asarray(case.kv_len, jnp.int32),
    q_segment_ids=None,
    kv_segment_ids=None,
    sinks=rand(rng, (case.n,), dtype, scale=2.0) if case.sinks else None,
  )
  if case.segments is not None:
    ops["q_segment_ids"], ops["kv_segment_ids"] = _segment_ids(rng, case)
  statics = dict(
    scale=None,
    is_causal=case.is_causal,
    local_window_size=case.window,
    logits_soft_cap=case.soft_cap,
  )
  return ops, statics


def _diff_names(ops: dict) -> tuple[str, ...]:
  return tuple(n for n in FLOATING if ops[n] is not None)


def _call(fn, statics: dict, ops: dict, **extra):
  """``fn(query, key, value, **the other operands, **statics)``; unset ones left out."""
  kw = {n: a for n, a in ops.items() if a is not None and n not in ("query", "key", "value")}
  return fn(ops["query"], ops["key"], ops["value"], **kw, **statics, **extra)


def _pallax(config=None):
  return functools.partial(pallax.dot_product_attention, config=config)


def _fwd_lse_vjp(fn, statics, ops, ct, constant: tuple[str, ...] = ()):
  """``(out, lse, {name: gradient})``: one call returning the residual, and its vjp.

  The gradients along every floating operand but the ``constant`` ones.
  """
  names = [n for n in _diff_names(ops) if n not in constant]
  f = lambda *d: _call(fn, statics, {**ops, **dict(zip(names, d))}, return_residual=True)
  (out, lse), vjp = jax.vjp(f, *(ops[n] for n in names))
  return out, lse, dict(zip(names, vjp((ct, jnp.zeros_like(lse)))))


def _as64(ops: dict) -> dict:
  return {n: (to64(a) if n in FLOATING else a) for n, a in ops.items()}


def _rows(ops, statics) -> np.ndarray:
  """Query rows that see at least one key, ``(B, T, N)`` or ``(T, N)``."""
  return visible_rows(
    ops["query"].shape,
    ops["key"].shape,
    mask=ops["mask"],
    is_causal=statics["is_causal"],
    query_seq_lengths=ops["query_seq_lengths"],
    key_value_seq_lengths=ops["key_value_seq_lengths"],
    local_window_size=statics["local_window_size"],
    q_segment_ids=ops["q_segment_ids"],
    kv_segment_ids=ops["kv_segment_ids"],
  )


def _check_grads(grads: dict, grads_ref: dict, dtype, what: str, dtypes=None) -> None:
  """Each gradient against the reference's, in the operand's dtype, to ``dtype``'s tolerance.

  ``dtypes``: name -> the operand's dtype, where not ``dtype``. A gradient
  that is zero in exact arithmetic is compared relative to the largest
  gradient instead of its own rounding.
  """
  assert set(grads) == set(grads_ref), (set(grads), set(grads_ref))
  scale = max(float(np.max(np.abs(f64(w)), initial=0.0)) for w in grads_ref.values())
  for name, w in grads_ref.items():
    g, want = grads[name], (dtypes or {}).get(name, dtype)
    assert g.shape == w.shape and g.dtype == want, (name, g.shape, g.dtype)
    if np.max(np.abs(f64(w)), initial=0.0) > 1e-10 * scale:
      assert_close(g, w, dtype, f"{what}: d{name}")
    else:
      err = float(np.max(np.abs(f64(g)), initial=0.0)) / scale
      assert err < TOL[jnp.dtype(dtype).name], f"{what}: d{name} should be 0, is {err:.3g} rel."


def _run_case(
  case: Case,
  dtype,
  path: str,
  config=None,
  seed: int = 0,
  edit: Callable[[dict], dict] = lambda ops: ops,
  constant: tuple[str, ...] = (),
):
  """Output, lse and every gradient against the reference; returns both and the rows.

  ``edit`` changes the drawn operands; no gradient is taken along the
  ``constant`` ones.
  """
  ops, statics = inputs(case, dtype, seed)
  ops = edit(ops)
  hv = ops["value"].shape[-1]
  ct = rand(np.random.default_rng(seed + 100), ops["query"].shape[:-1] + (hv,), dtype)
  vjp = lambda fn, ops, ct: _fwd_lse_vjp(fn, statics, ops, ct, constant)
  with on_path(path):
    got = jax.jit(functools.partial(vjp, _pallax(config)))(ops, ct)
  with x64():
    want = jax.jit(functools.partial(vjp, reference))(_as64(ops), to64(ct))
  (out, lse, grads), (out_ref, lse_ref, grads_ref) = got, want
  what = f"{path} {jnp.dtype(dtype).name} {case}"
  assert out.shape == out_ref.shape and out.dtype == dtype, (out.shape, out.dtype)
  assert lse.shape == out_ref.shape[:-1] and lse.dtype == dtype, (lse.shape, lse.dtype)
  assert_close(out, out_ref, dtype, f"{what}: output")
  rows = _rows(ops, statics)
  np.testing.assert_array_equal(
    np.asarray(out, np.float32)[~rows], 0.0, err_msg=f"{what}: rows with no visible key"
  )
  assert_lse_close(lse, lse_ref, dtype, f"{what}: lse")
  if case.sinks:
    assert np.all(np.isfinite(f64(lse))), f"{what}: with sinks every row's lse is finite"
  _check_grads(grads, grads_ref, dtype, what, {n: ops[n].dtype for n in grads})
  return ops, statics, got, want, rows


# ------------------------------------------------------------------------------
# The reference's new arguments against other formulations of the same thing.


def _numpy_attention(q, k, v, cap, sinks, q_seg, kv_seg):
  """Plain NumPy float64 attention, BTNH with K = N, every feature spelled out per row."""
  b, t, n, h = q.shape
  out = np.zeros(q.shape[:-1] + (v.shape[-1],))
  lse = np.zeros((b, t, n))
  for bi in range(b):
    for ni in range(n):
      for ti in range(t):
        keys = [si for si in range(k.shape[1]) if q_seg[bi, ti] == kv_seg[bi, si]]
        logits = np.array([q[bi, ti, ni] @ k[bi, si, ni] / np.sqrt(h) for si in keys])
        logits = cap * np.tanh(logits / cap)
        z = np.sum(np.exp(logits)) + np.exp(sinks[ni])
        out[bi, ti, ni] = sum(np.exp(lg) / z * v[bi, si, ni] for lg, si in zip(logits, keys))
        lse[bi, ti, ni] = np.log(z)
  return out, lse


def test_reference_against_numpy():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((2, 6, 2, 8)) * 4
  k, v = rng.standard_normal((2, 7, 2, 8)), rng.standard_normal((2, 7, 2, 5))
  sinks = rng.standard_normal(2)
  q_seg, kv_seg = rng.integers(0, 3, (2, 6)), rng.integers(0, 3, (2, 7))
  q_seg[0, 1] = 7  # sees no key: output 0, lse = the sink
  want_out, want_lse = _numpy_attention(q, k, v, 1.5, sinks, q_seg, kv_seg)
  with x64():
    out, lse = reference(
      q,
      k,
      v,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      logits_soft_cap=1.5,
      sinks=sinks,
      return_residual=True,
    )
  np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(np.asarray(out)[0, 1], 0.0)
  np.testing.assert_allclose(np.asarray(lse)[0, 1], sinks, rtol=1e-14)


def test_reference_segments_are_a_mask_and_sinks_an_extra_key():
  """Segments: the mask ``q_seg[t] == kv_seg[s]``; a sink: a key of value 0 and logit ``sink``.

  The sink's key is a zero key whose bias column holds the sink, so its
  gradient is that column's gradient summed over batch and queries.
  """
  rng = np.random.default_rng(1)
  b, t, s, n, kh, h = 2, 9, 11, 4, 2, 8
  q, k, v = (rng.standard_normal(sh) for sh in [(b, t, n, h), (b, s, kh, h), (b, s, kh, 6)])
  bias, sinks = rng.standard_normal((b, n, t, s)), rng.standard_normal(n)
  q_seg, kv_seg = rng.integers(0, 3, (b, t)), rng.integers(0, 3, (b, s))
  q_seg[1, 4] = 5
  mask = q_seg[:, None, :, None] == kv_seg[:, None, None, :]
  causal = np.tril(np.ones((t, s), bool))
  # One more key, always visible: key 0, value 0, its bias column the sink.
  mask_ext = np.concatenate([mask & causal, np.ones((b, 1, t, 1), bool)], -1)
  ct = rng.standard_normal((b, t, n, 6))
  with x64():

    def ours(q, k, v, bias, sinks):
      return reference(
        q, k, v, bias, q_segment_ids=q_seg, kv_segment_ids=kv_seg, sinks=sinks, is_causal=True
      )

    def theirs(q, k, v, bias, sinks):
      k = jnp.concatenate([k, jnp.zeros((b, 1, kh, h))], 1)
      v = jnp.concatenate([v, jnp.zeros((b, 1, kh, 6))], 1)
      column = jnp.broadcast_to(sinks[None, :, None, None], (b, n, t, 1))
      return reference(q, k, v, jnp.concatenate([bias, column], -1), jnp.asarray(mask_ext))

    args = tuple(jnp.asarray(a) for a in (q, k, v, bias, sinks))
    fwd_vjp = lambda fn, ct, *a: (fn(*a), jax.vjp(fn, *a)[1](ct))
    out, grads = jax.jit(functools.partial(fwd_vjp, ours))(jnp.asarray(ct), *args)
    want, grads_want = jax.jit(functools.partial(fwd_vjp, theirs))(jnp.asarray(ct), *args)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(grads, grads_want):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    assert np.abs(np.asarray(grads[4])).min() > 1e-6  # dsinks is not trivial
    np.testing.assert_array_equal(np.asarray(out)[1, 4], 0.0)


# ------------------------------------------------------------------------------
# The XLA path.

CASES = {
  # Four sorted documents per example, boundaries at random positions.
  "packed-causal-sinks-cap-gqa": Case(
    n=8, k=2, segments="packed", is_causal=True, sinks=True, soft_cap=20.0
  ),
  "random-ids-bias-mask-cap": Case(
    segments="random", bias=(2, 4, 40, 40), mask=(2, 1, 40, 40), soft_cap=5.0, logit_scale=4.0
  ),
  # Query rows of segment 3 see nothing; lengths and a window add more such rows.
  "missing-segment-sinks-lengths-window": Case(
    segments="missing", sinks=True, q_len=(37, 40), kv_len=(40, 29), window=(6, 3)
  ),
  # Logits up to about +-100 capped at 3: tanh saturates, its derivative vanishes.
  "softcap-large-logits-bias": Case(soft_cap=3.0, logit_scale=20.0, bias=(2, 1, 40, 40)),
  "sinks-mqa-causal-T>S": Case(n=4, k=1, t=48, s=24, is_causal=True, sinks=True),
  "hv-all-features": Case(
    n=4,
    k=2,
    h=32,
    hv=48,
    t=40,
    s=48,
    bias=(2, 4, 40, 48),
    mask=(2, 4, 40, 48),
    is_causal=True,
    window=(20, 0),
    q_len=(40, 33),
    kv_len=(45, 48),
    segments="missing",
    soft_cap=10.0,
    sinks=True,
  ),
  "unbatched-packed-sinks-cap-hv": Case(
    b=None, hv=16, segments="packed", is_causal=True, sinks=True, soft_cap=8.0
  ),
  "packed-T<S-lengths-gqa-bias": Case(
    n=6, k=3, t=24, s=48, segments="packed", kv_len=(48, 30), sinks=True, bias=(2, 6, 24, 48)
  ),
}


@pytest.mark.parametrize("name", CASES)
def test_xla_forward_lse_and_grad(name):
  _run_case(CASES[name], jnp.float32, "xla")


def test_xla_bfloat16():
  _run_case(CASES["hv-all-features"], jnp.bfloat16, "xla", seed=1)


# ------------------------------------------------------------------------------
# The interpreted kernels: pinned blocks smaller than T and S (Triton 16 x 16,
# Mosaic 8 x 128), so document boundaries fall inside blocks and some blocks
# have no segment in common.

KERNEL_CASES = {
  "packed-causal-sinks-cap-gqa": Case(
    n=4, k=2, t=48, s=48, segments="packed", is_causal=True, sinks=True, soft_cap=8.0
  ),
  "all-features-hv": Case(
    n=2,
    k=1,
    h=32,
    hv=64,
    t=33,
    s=40,
    bias=(2, 1, 33, 40),
    mask=(2, 2, 33, 40),
    window=(12, 30),
    q_len=(33, 20),
    kv_len=(40, 31),
    segments="missing",
    sinks=True,
    soft_cap=4.0,
    logit_scale=6.0,
  ),
  # Two key blocks on Mosaic too, the last ragged; sorted ids over T and S.
  "long-S-packed-mqa-unbatched": Case(
    b=None, n=2, k=1, t=40, s=200, segments="packed", sinks=True, logit_scale=4.0
  ),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_forward_lse_and_grad(path, name):
  case = KERNEL_CASES[name]
  config = small_blocks(path)
  ops, statics = inputs(case)
  names = _diff_names(ops)
  grad = lambda *d: jax.grad(
    lambda *d: jnp.sum(_call(_pallax(config), statics, {**ops, **dict(zip(names, d))})),
    tuple(range(len(d))),
  )(*d)
  with on_path(path):
    report = pallax.explain(grad, *(ops[n] for n in names))
  assert {s.implementation for s in report} == {"pallas"}, str(report)
  _run_case(case, jnp.float32, path, config)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_bfloat16(path):
  _run_case(KERNEL_CASES["packed-causal-sinks-cap-gqa"], jnp.bfloat16, path, small_blocks(path), 2)


# ------------------------------------------------------------------------------
# Rows that see no key: a query segment that no key has.


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("path", PATHS)
def test_rows_without_keys(path, sinks):
  """Output 0, lse ``-inf`` (no sinks) or the head's sink; zero dq there; finite dsinks."""
  case = Case(n=2, k=1, t=24, s=40, segments="missing", is_causal=True, sinks=sinks)
  ops, statics, got, _, rows = _run_case(case, jnp.float32, path, small_blocks(path), seed=3)
  out, lse, grads = got
  assert (~rows).sum() >= 8 and rows.sum() > 40
  lse = np.asarray(lse)
  if sinks:
    want = np.broadcast_to(np.asarray(ops["sinks"]), lse.shape)[~rows]
    np.testing.assert_allclose(lse[~rows], want, rtol=1e-6, atol=1e-6)
    dsinks = np.asarray(grads["sinks"])
    assert np.all(np.isfinite(dsinks)) and np.all(dsinks != 0), dsinks
  else:
    assert np.all(np.isneginf(lse[~rows]))
  np.testing.assert_array_equal(np.asarray(grads["query"])[~rows], 0.0)
  for name in ("key", "value"):
    assert np.all(np.isfinite(np.asarray(grads[name]))), name


# ------------------------------------------------------------------------------
# Forward mode: tangents in query, key, value, bias and sinks.

JVP_CASES = [
  ("xla", CASES["hv-all-features"]),
  ("xla", CASES["packed-causal-sinks-cap-gqa"]),
  ("triton", KERNEL_CASES["all-features-hv"]),
  ("mosaic_tpu", KERNEL_CASES["all-features-hv"]),
]


def _jvp(fn, statics, ops, tangents):
  names = _diff_names(ops)
  f = lambda *d: _call(fn, statics, {**ops, **dict(zip(names, d))})
  return jax.jvp(f, tuple(ops[n] for n in names), tuple(tangents[n] for n in names))


@pytest.mark.parametrize("path, case", JVP_CASES, ids=["xla-hv", "xla-packed", "triton", "mosaic"])
def test_jvp(path, case):
  ops, statics = inputs(case, seed=4)
  rng = np.random.default_rng(5)
  tangents = {n: rand(rng, ops[n].shape) for n in _diff_names(ops)}
  assert "sinks" in tangents
  with on_path(path):
    y, y_dot = jax.jit(functools.partial(_jvp, _pallax(small_blocks(path)), statics))(ops, tangents)
  with x64():
    tangents64 = {n: to64(a) for n, a in tangents.items()}
    y_ref, y_dot_ref = jax.jit(functools.partial(_jvp, reference, statics))(_as64(ops), tangents64)
  assert y_dot.dtype == jnp.float32 and y_dot.shape == y_ref.shape
  assert_close(y, y_ref, jnp.float32, "primal")
  assert_close(y_dot, y_dot_ref, jnp.float32, "tangent")
  np.testing.assert_array_equal(np.asarray(y_dot)[~_rows(ops, statics)], 0.0)


def test_jvp_of_each_new_operand_alone():
  """The sinks' tangent alone, and the soft cap's derivative through q alone (XLA path)."""
  ops, statics = inputs(CASES["packed-causal-sinks-cap-gqa"], seed=6)
  rng = np.random.default_rng(7)
  for name in ("sinks", "query"):
    tangent = rand(rng, ops[name].shape)
    f = lambda x: _call(_pallax(), statics, {**ops, name: x})
    _, got = jax.jit(lambda x, dx: jax.jvp(f, (x,), (dx,)))(ops[name], tangent)
    with x64():
      ops64 = _as64(ops)
      g = lambda x: _call(reference, statics, {**ops64, name: x})
      _, want = jax.jvp(g, (ops64[name],), (to64(tangent),))
    assert_close(got, want, jnp.float32, f"tangent along {name}")


@pytest.mark.parametrize("path", PATHS)
def test_a_constant_bias_is_not_differentiated(path):
  """A bias without a tangent: its gradient is not computed, nor its tangent read.

  The tangent and backward stages of ``jax.jvp`` and ``jax.grad`` along q, k,
  v and the sinks alone take ``bias_tangent=False``: no ``bias_dot`` operand,
  no ``dbias`` result (no kernel writes the logits' ``(T, S)`` gradient);
  the tangent and the gradients still match float64.
  """
  ops, statics = inputs(KERNEL_CASES["all-features-hv"], seed=21)
  names = [n for n in _diff_names(ops) if n != "bias"]
  f = lambda fn, *d: _call(fn, statics, {**ops, **dict(zip(names, d))})
  rng = np.random.default_rng(22)
  args = [ops[n] for n in names]
  tangents = [rand(rng, a.shape) for a in args]
  ct = rand(rng, ops["query"].shape[:-1] + (ops["value"].shape[-1],))

  def both(fn, args, tangents, ct):
    _, y_dot = jax.jvp(functools.partial(f, fn), args, tangents)
    return y_dot, jax.vjp(functools.partial(f, fn), *args)[1](ct)

  mine = functools.partial(both, _pallax(small_blocks(path)))
  calls = {
    e.primitive.name: e for e in kernel_calls(jax.make_jaxpr(mine)(args, tangents, ct).jaxpr)
  }
  assert calls[JVP].params["bias_tangent"] is False and calls[BWD].params["bias_tangent"] is False
  assert len(calls[JVP].invars) == len(calls[FWD].invars) + 2 + len(names)  # out, lse, tangents
  assert len(calls[BWD].outvars) == len(names)  # dq, dk, dv, dsinks
  with on_path(path):
    y_dot, grads = jax.jit(mine)(args, tangents, ct)
  with x64():
    ops64 = _as64(ops)
    g = lambda *d: _call(reference, statics, {**ops64, **dict(zip(names, d))})
    args64, tangents64 = [ops64[n] for n in names], [to64(t) for t in tangents]
    _, y_dot_ref = jax.jvp(g, args64, tangents64)
    grads_ref = jax.vjp(g, *args64)[1](to64(ct))
  assert_close(y_dot, y_dot_ref, jnp.float32, "tangent")
  _check_grads(dict(zip(names, grads)), dict(zip(names, grads_ref)), jnp.float32, path)


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_the_kernels_write_no_logits_gradient_for_a_constant_bias(platform):
  """The backward's ``(B, K, G, T, S)`` float32 ``dS`` only for a differentiated bias.

  On every platform's lowering (the XLA program's padded buffer on a CPU,
  the Triton and Mosaic TPU kernels' output): no float32 array of the
  logits' shape or larger where ``jax.grad`` runs along q and k alone.
  """
  S = jax.ShapeDtypeStruct
  b, t, s, n, kh, h = 2, 200, 1100, 4, 2, 64
  q, k = S((b, t, n, h), jnp.bfloat16), S((b, s, kh, h), jnp.bfloat16)
  bias = S((b, n, t, s), jnp.bfloat16)
  loss = lambda q, k, bias: jnp.sum(pallax.dot_product_attention(q, k, k, bias).astype(jnp.float32))

  def logits_sized(argnums) -> bool:
    text = lower_text(jax.grad(loss, argnums), platform, q, k, bias)
    shapes = re.findall(rf"tensor<{b}x{kh}x{n // kh}x(\d+)x(\d+)xf32>", text)
    return any(int(rows) >= t and int(cols) >= s for rows, cols in shapes)

  assert logits_sized((0, 1, 2))
  assert not logits_sized((0, 1))


# ------------------------------------------------------------------------------
# Primitives in the jaxpr.


@pytest.mark.parametrize("name", ["hv-all-features", "unbatched-packed-sinks-cap-hv"])
def test_one_primitive_each_way(name):
  """Forward: one fwd; grad of all five operands: one fwd + one bwd; jvp: fwd + jvp."""
  ops, statics = inputs(CASES[name], seed=8)
  names = _diff_names(ops)
  f = lambda *d: _call(_pallax(), statics, {**ops, **dict(zip(names, d))})
  f_res = lambda *d: _call(_pallax(), statics, {**ops, **dict(zip(names, d))}, return_residual=True)
  diff = tuple(ops[n] for n in names)
  assert "sinks" in names
  loss = lambda *d: jnp.sum(jnp.sin(f(*d)))
  assert attention_primitives_of(f, *diff) == {FWD: 1}
  assert attention_primitives_of(f_res, *diff) == {FWD: 1}
  assert attention_primitives_of(jax.grad(loss, tuple(range(len(diff)))), *diff) == {FWD: 1, BWD: 1}
  sinks_only = lambda s: jax.grad(lambda s: loss(*diff[:-1], s))(s)
  assert attention_primitives_of(sinks_only, diff[-1]) == {FWD: 1, BWD: 1}
  jvp = lambda *d: jax.jvp(f, d, d)
  assert attention_primitives_of(jvp, *diff) == {FWD: 1, JVP: 1}
  res_loss = lambda *d: jnp.sum(f_res(*d)[0])
  assert attention_primitives_of(jax.grad(res_loss, tuple(range(len(diff)))), *diff) == {
    FWD: 1,
    BWD: 1,
  }


def test_lse_has_no_gradient():
  ops, statics = inputs(CASES["packed-causal-sinks-cap-gqa"], seed=9)
  f = lambda q, s: jnp.sum(
    _call(_pallax(), statics, {**ops, "query": q, "sinks": s}, return_residual=True)[1]
  )
  dq, ds = jax.grad(f, (0, 1))(ops["query"], ops["sinks"])
  np.testing.assert_array_equal(dq, 0.0)
  np.testing.assert_array_equal(ds, 0.0)


# ------------------------------------------------------------------------------
# Bad input.

_Q, _KV = (2, 8, 4, 32), (2, 8, 2, 32)


def _ones(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


_SEG_Q, _SEG_KV = _ones((2, 8), jnp.int32), _ones((2, 8), jnp.int32)
_SEGS = dict(q_segment_ids=_SEG_Q, kv_segment_ids=_SEG_KV)

# (overrides of the valid call, the words of which the message holds one each).
BAD_INPUTS = {
  "q segment ids length": ({**_SEGS, "q_segment_ids": _ones((2, 7), jnp.int32)}, ["q_segment_ids"]),
  "kv segment ids length": (
    {**_SEGS, "kv_segment_ids": _ones((2, 9), jnp.int32)},
    ["kv_segment_ids"],
  ),
  "q segment ids batch": ({**_SEGS, "q_segment_ids": _ones((3, 8), jnp.int32)}, ["q_segment_ids"]),
  "kv segment ids rank": (
    {**_SEGS, "kv_segment_ids": _ones((2, 8, 1), jnp.int32)},
    ["kv_segment_ids"],
  ),
  "q segment ids rank 1 on batched": (
    {**_SEGS, "q_segment_ids": _ones((8,), jnp.int32)},
    ["q_segment_ids"],
  ),
  "float q segment ids": ({**_SEGS, "q_segment_ids": _ones((2, 8))}, ["q_segment_ids"]),
  "float kv segment ids": ({**_SEGS, "kv_segment_ids": _ones((2, 8))}, ["kv_segment_ids"]),
  "only q segment ids": (dict(q_segment_ids=_SEG_Q), [("q_segment_ids", "kv_segment_ids")]),
  "only kv segment ids": (dict(kv_segment_ids=_SEG_KV), [("q_segment_ids", "kv_segment_ids")]),
  "soft cap 0": (dict(logits_soft_cap=0.0), ["logits_soft_cap"]),
  "soft cap negative": (dict(logits_soft_cap=-30.0), ["logits_soft_cap"]),
  "soft cap string": (dict(logits_soft_cap="big"), ["logits_soft_cap"]),
  "sinks per kv head": (dict(sinks=_ones((2,))), ["sinks"]),
  "sinks too many": (dict(sinks=_ones((5,))), ["sinks"]),
  "sinks rank 2": (dict(sinks=_ones((1, 4))), ["sinks"]),
  "sinks scalar": (dict(sinks=_ones(())), ["sinks"]),
  "integer sinks": (dict(sinks=_ones((4,), jnp.int32)), ["sinks"]),
  "bool sinks": (dict(sinks=_ones((4,), bool)), ["sinks"]),
}


def _bad_call(overrides, query_shape=_Q, kv_shape=_KV):
  call = dict(query=_ones(query_shape), key=_ones(kv_shape), value=_ones(kv_shape))
  call.update(overrides)
  return pallax.dot_product_attention(call.pop("query"), call.pop("key"), call.pop("value"), **call)


def _assert_names(err, words) -> None:
  message = str(err.value)
  for word in words:
    alternatives = (word,) if isinstance(word, str) else word
    assert any(w in message for w in alternatives), (word, message)


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input(name):
  overrides, words = BAD_INPUTS[name]
  with pytest.raises((ValueError, TypeError)) as err:
    _bad_call(overrides)
  _assert_names(err, words)


def test_bad_unbatched_segment_ids():
  """Unbatched calls take ``(T,)`` / ``(S,)`` ids: batched ones are refused."""
  with pytest.raises((ValueError, TypeError)) as err:
    _bad_call(_SEGS, _Q[1:], _KV[1:])
  _assert_names(err, [("q_segment_ids", "kv_segment_ids")])
  _bad_call(dict(q_segment_ids=_SEG_Q[0], kv_segment_ids=_SEG_KV[0]), _Q[1:], _KV[1:])


def test_valid_new_arguments_are_accepted():
  """The valid call of the bad-input table, with every new argument set: no error."""
  out = _bad_call(dict(**_SEGS, logits_soft_cap=30.0, sinks=_ones((4,))))
  assert out.shape == _Q


def test_bad_input_inside_jit():
  q, kv = _ones(_Q), _ones(_KV)
  with pytest.raises((ValueError, TypeError), match="sinks"):
    jax.jit(lambda s: pallax.dot_product_attention(q, kv, kv, sinks=s))(_ones((3,)))
  with pytest.raises((ValueError, TypeError), match="segment_ids"):
    jax.jit(
      lambda a, b: pallax.dot_product_attention(q, kv, kv, q_segment_ids=a, kv_segment_ids=b)
    )(_SEG_Q, _ones((2, 5), jnp.int32))


# ------------------------------------------------------------------------------
# Lowering for other platforms: every feature on, the same kernels as without.


def _lowering_fns(new_features: bool):
  """grad of q, k, v, bias (and sinks) and a jvp, of a call with every feature."""
  extra = dict(logits_soft_cap=30.0) if new_features else {}

  def f(q, k, v, bias, sinks, mask, q_len, kv_len, q_seg, kv_seg):
    new = dict(sinks=sinks, q_segment_ids=q_seg, kv_segment_ids=kv_seg) if new_features else {}
    return pallax.dot_product_attention(
      q,
      k,
      v,
      bias,
      mask,
      is_causal=True,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      local_window_size=(64, 0),
      **extra,
      **new,
    )

  def grad(*a):
    loss = lambda *d: jnp.sum(f(*d, *a[5:]).astype(jnp.float32))
    return jax.grad(loss, (0, 1, 2, 3, 4) if new_features else (0, 1, 2, 3))(*a[:5])

  def jvp(*a):
    return jax.jvp(lambda *d: f(*d, *a[5:]), a[:5], a[:5])

  return grad, jvp


@pytest.mark.lowering
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
def test_lowers_with_every_feature(platform, dtype):
  S = jax.ShapeDtypeStruct
  b, t, s, n, kh, h, hv = 2, 200, 300, 4, 2, 64, 32
  args = (
    S((b, t, n, h), dtype),
    S((b, s, kh, h), dtype),
    S((b, s, kh, hv), dtype),
    S((b, n, t, s), dtype),
    S((n,), dtype),
    S((b, 1, t, s), jnp.bool_),
    S((b,), jnp.int32),
    S((b,), jnp.int32),
    S((b, t), jnp.int32),
    S((b, s), jnp.int32),
  )
  target = CALL_TARGET[platform]
  for with_new, without_new in zip(_lowering_fns(True), _lowering_fns(False)):
    want = lower_text(without_new, platform, *args).count(target)
    assert want >= 2, want  # the baseline runs kernels: a forward and a backward or tangent
    got = lower_text(with_new, platform, *args).count(target)
    assert got == want, f"{platform}: {got} kernel calls with the new features, {want} without"


# ------------------------------------------------------------------------------
# Larger sizes.


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_xla_long_packed_sequences(dtype):
  case = Case(
    b=2,
    t=1000,
    s=1000,
    n=4,
    k=2,
    h=64,
    segments="packed",
    is_causal=True,
    sinks=True,
    soft_cap=30.0,
  )
  _run_case(case, dtype, "xla", seed=10)


@pytest.mark.slow
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(
  "case",
  [
    Case(n=4, k=2, h=64, t=300, s=300, segments="packed", is_causal=True, sinks=True),
    Case(n=4, k=1, h=32, hv=64, t=130, s=270, segments="random", soft_cap=5.0, logit_scale=8.0),
  ],
  ids=["packed-causal-sinks", "random-ids-cap-hv"],
)
def test_kernel_longer_sequences(path, case):
  _run_case(case, jnp.float32, path, small_blocks(path), seed=11)
  _run_case(case, jnp.bfloat16, path, None, seed=12)
