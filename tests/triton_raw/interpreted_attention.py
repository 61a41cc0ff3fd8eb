"""The raw Triton attention kernels under Triton's interpreter, against the float64 reference.

Run by ``test_interpreted.py`` in a process with ``TRITON_INTERPRET=1``. A
pinned ``implementation="triton_raw"`` config with 16 x 16 blocks splits T
and S into several blocks, so every program loops over key (query) blocks,
skips those outside the causal, window and length ranges, and runs both the
masked and the unmasked loops. Forward, lse, ``grad`` of q, k, v (and sinks,
applied around the kernels), ``jvp`` (the tangent stage has no raw kernel:
a raw forward with the tangent the executor picks), ``vmap`` (one primitive) and a
``shard_map`` over the 8 fake CPU devices. The interpreter runs numpy per
program: shapes stay tiny, and larger cases are ``slow``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import (
  TOL,
  as64,
  assert_close,
  attention_primitives_of,
  f64,
  loop_stack,
  mesh_4x2,
  rand,
  x64,
)
from tests.primitives.attention_reference import assert_lse_close, reference, visible_rows

# jax-triton imports only where jaxlib has its CUDA plugin (the verify extra's).
pytestmark = pytest.mark.compilers

RAW = pallax.AttentionConfig(block_q=16, block_k=16, implementation="triton_raw")
FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))


@dataclasses.dataclass(frozen=True)
class Case:
  """One call's shapes and features (the raw kernels' own: no bias, mask or segments)."""

  b: int = 1
  t: int = 40
  s: int = 40
  n: int = 2
  k: int = 2
  h: int = 16
  hv: Optional[int] = None  # the value's head dim (None: h)
  is_causal: bool = False
  window: Any = None
  q_len: Optional[tuple[int, ...]] = None
  kv_len: Optional[tuple[int, ...]] = None
  cap: Optional[float] = None
  sinks: bool = False
  logit_scale: float = 1.0


CASES = {
  "causal-T>S": Case(t=40, s=24, is_causal=True),
  "window-gqa-odd": Case(n=4, k=2, t=33, s=40, window=(5, 3)),
  # Rows t >= 28 see no key: zero output and gradients, lse -inf.
  "window-empty-rows-mqa": Case(n=2, k=1, t=48, s=24, window=(4, 30)),
  # The second example has no query, the third no key.
  "lengths-causal": Case(b=3, t=40, s=40, q_len=(33, 0, 40), kv_len=(40, 9, 0), is_causal=True),
  # Head dims padded to powers of two, the value's unlike the query's.
  "padded-heads-80-48": Case(n=2, k=1, h=80, hv=48, t=24, s=40, is_causal=True),
  "soft-cap-large-logits": Case(t=33, s=40, cap=2.0, is_causal=True, logit_scale=8.0),
}


def _inputs(case: Case, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = rand(rng, (case.b, case.t, case.n, case.h), dtype, scale=case.logit_scale)
  k = rand(rng, (case.b, case.s, case.k, case.h), dtype)
  v = rand(rng, (case.b, case.s, case.k, case.hv or case.h), dtype)
  ct = rand(rng, (*q.shape[:-1], v.shape[-1]), dtype)
  sinks = rand(rng, (case.n,), dtype, scale=2.0) if case.sinks else None
  return (q, k, v, sinks), ct


def _kwargs(case: Case) -> dict:
  lengths = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
  return dict(
    is_causal=case.is_causal,
    local_window_size=case.window,
    query_seq_lengths=lengths(case.q_len),
    key_value_seq_lengths=lengths(case.kv_len),
    logits_soft_cap=case.cap,
  )


def _attention(case: Case, config=RAW, **extra):
  """pallax's attention of ``case`` as a function of (q, k, v, sinks)."""
  kw = _kwargs(case)
  return lambda q, k, v, sinks: pallax.dot_product_attention(
    q, k, v, sinks=sinks, config=config, **kw, **extra
  )


def _reference(case: Case, **extra):
  kw = _kwargs(case)
  return lambda q, k, v, sinks: reference(q, k, v, sinks=sinks, **kw, **extra)


def _fwd_lse_grads(fn, args, ct):
  """``(out, lse, grads)``: one call returning the residual, and the vjp of the output."""
  diff = [i for i, a in enumerate(args) if a is not None]

  def f(*d):
    full = list(args)
    for i, x in zip(diff, d):
      full[i] = x
    return fn(*full)

  (out, lse), vjp = jax.vjp(f, *(args[i] for i in diff))
  return out, lse, vjp((ct, jnp.zeros_like(lse)))


def _check(case: Case, dtype, seed: int = 0, config=RAW) -> None:
  args, ct = _inputs(case, dtype, seed)
  got = jax.jit(functools.partial(_fwd_lse_grads, _attention(case, config, return_residual=True)))(
    args, ct
  )
  with x64():
    args64 = tuple(as64(*args))
    want = _fwd_lse_grads(_reference(case, return_residual=True), args64, as64(ct)[0])
  (out, lse, grads), (out_ref, lse_ref, grads_ref) = got, want
  what = f"{case} {jnp.dtype(dtype).name}"
  assert out.dtype == dtype and lse.shape == out.shape[:-1]
  assert_close(out, out_ref, dtype, f"{what}: output")
  assert_lse_close(lse, lse_ref, dtype, f"{what}: lse")
  masks = {k: v for k, v in _kwargs(case).items() if k != "logits_soft_cap"}
  rows = visible_rows(args[0].shape, args[1].shape, **masks)
  if not case.sinks:
    np.testing.assert_array_equal(np.asarray(out, np.float32)[~rows], 0.0, err_msg=what)
  scale = max(float(np.max(np.abs(f64(w)), initial=0.0)) for w in grads_ref)
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dsinks")):
    assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    if np.max(np.abs(f64(w)), initial=0.0) > 1e-10 * scale:
      assert_close(g, w, dtype, f"{what}: {name}")
    else:  # zero in exact arithmetic: compared with the largest gradient
      err = float(np.max(np.abs(f64(g)), initial=0.0)) / scale
      assert err < TOL[jnp.dtype(dtype).name], f"{what}: {name} should be 0, is {err:.3g} rel."


def test_the_raw_kernels_run():
  """The pinned config reaches the raw forward and backward kernels."""
  case = CASES["causal-T>S"]
  args, ct = _inputs(case, jnp.float32)
  fn = lambda *a: _fwd_lse_grads(_attention(case, return_residual=True), a, ct)
  report = pallax.explain(fn, *args)
  assert [(s.op, s.implementation) for s in report] == [(FWD, "triton_raw"), (BWD, "triton_raw")]


@pytest.mark.parametrize("name", CASES)
def test_forward_lse_and_grad(name):
  _check(CASES[name], jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", ["window-gqa-odd", "causal-T>S"])
def test_16_bit_dtypes(name, dtype):
  _check(CASES[name], dtype, seed=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_sinks_around_the_raw_kernels(dtype):
  """Sinks are applied outside the kernels (``with_sinks``): their gradient included.

  The seed is one where ``dsinks``'s sum over rows does not cancel much: in
  bfloat16 its error is the saved output's rounding times that cancellation
  (the README's sinks entry), up to 1.2% for some draws on every path.
  """
  _check(Case(n=2, k=1, t=24, s=33, is_causal=True, kv_len=(30,), sinks=True), dtype, seed=3)


def test_jvp_with_a_raw_forward():
  """A raw forward (overlaid) and the tangent the executor picks (on the CPU: XLA's)."""
  case = Case(n=4, k=2, t=33, s=40, window=(6, 2), kv_len=(31,))
  (q, k, v, _), _ = _inputs(case, jnp.float32, seed=3)
  rng = np.random.default_rng(4)
  tangents = tuple(rand(rng, a.shape) for a in (q, k, v))
  f = lambda q, k, v: _attention(case, config=None)(q, k, v, None)
  jvp = jax.jit(lambda p, t: jax.jvp(f, p, t))
  with pallax.default_executor().overlay({FWD: RAW}):
    report = pallax.explain(jvp, (q, k, v), tangents)
    y, y_dot = jvp((q, k, v), tangents)
  assert {s.op: s.implementation for s in report}[FWD] == "triton_raw", str(report)
  assert {s.op: s.implementation for s in report}[JVP] != "triton_raw", str(report)
  with x64():
    g = lambda q, k, v: _reference(case)(q, k, v, None)
    y_ref, y_dot_ref = jax.jvp(g, tuple(as64(q, k, v)), tuple(as64(*tangents)))
  assert_close(y, y_ref, jnp.float32, "primal")
  assert_close(y_dot, y_dot_ref, jnp.float32, "tangent")


def test_vmap_matches_loop_in_one_primitive():
  case = Case(n=2, k=1, t=24, s=33, is_causal=True)
  rng = np.random.default_rng(5)
  size = 2
  q = rand(rng, (size, 1, case.t, case.n, case.h))
  k, v = (rand(rng, (size, 1, case.s, case.k, case.h)) for _ in range(2))
  kv_len = jnp.asarray([33, 7], jnp.int32)[:, None]

  def f(q, k, v, kv_len):
    return pallax.dot_product_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=kv_len, config=RAW
    )

  grad = lambda q, k, v, kv_len: jax.grad(lambda *a: jnp.sum(f(*a, kv_len) ** 2), (0, 1, 2))(
    q, k, v
  )
  for fn in (f, grad):
    vf = jax.vmap(fn)
    got = jax.jit(vf)(q, k, v, kv_len)
    want = loop_stack(jax.jit(fn), (q, k, v, kv_len), (0, 0, 0, 0), size)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    counts = attention_primitives_of(vf, q, k, v, kv_len)
    assert counts == ({FWD: 1} if fn is f else {FWD: 1, BWD: 1}), counts


def _sharded_inputs(seed: int):
  """Batch 4 over mesh axis "a", the 4 query heads (2 kv heads) over "b" (GQA per shard)."""
  b, t, s, n, kv_heads, h = 4, 24, 24, 4, 2, 16
  rng = np.random.default_rng(seed)
  q = rand(rng, (b, t, n, h))
  k, v = (rand(rng, (b, s, kv_heads, h)) for _ in range(2))
  kv_len = jnp.asarray(rng.integers(1, s + 1, b), jnp.int32)
  return (q, k, v, kv_len), rand(rng, q.shape)


def _raw_causal(q, k, v, kv_len):
  return pallax.dot_product_attention(
    q, k, v, is_causal=True, key_value_seq_lengths=kv_len, config=RAW
  )


def test_shard_map_batch_and_heads():
  """Each of 8 devices runs the raw kernels on its batch and heads; equal to the reference.

  Under ``shard_map``: in a ``jit`` that XLA partitions, the interpreter's host
  callbacks are lost (``test_partitioned_jit_is_refused``).
  """
  (q, k, v, kv_len), ct = _sharded_inputs(6)
  mesh = mesh_4x2()
  qkv, batch = P("a", None, "b"), P("a")

  def fwd_grad(q, k, v, kv_len, ct):
    out, vjp = jax.vjp(lambda q, k, v: _raw_causal(q, k, v, kv_len), q, k, v)
    return (out, *vjp(ct))

  sharded = jax.shard_map(
    fwd_grad, mesh=mesh, in_specs=(qkv, qkv, qkv, batch, qkv), out_specs=(qkv,) * 4
  )
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = [put(a, spec) for a, spec in zip((q, k, v, kv_len, ct), (qkv, qkv, qkv, batch, qkv))]
  got = jax.jit(sharded)(*args)
  assert got[0].sharding.is_equivalent_to(args[0].sharding, 4), got[0].sharding
  with x64():
    ref = lambda q, k, v: reference(q, k, v, is_causal=True, key_value_seq_lengths=kv_len)
    out_ref, vjp_ref = jax.vjp(ref, *as64(q, k, v))
    want = (out_ref, *vjp_ref(as64(ct)[0]))
  for g, w, name in zip(got, want, ("output", "dq", "dk", "dv")):
    assert_close(g, w, jnp.float32, name)


def test_partitioned_jit_is_refused():
  """A ``jit`` that XLA partitions would lose the interpreter's callbacks: an error instead."""
  (q, k, v, kv_len), _ = _sharded_inputs(7)
  mesh = mesh_4x2()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(q, P("a")), put(k, P("a")), put(v, P("a")), put(kv_len, P("a")))
  with pytest.raises(Exception, match="jax-ml/jax#23620"):
    jax.jit(_raw_causal)(*args)


# ------------------------------------------------------------------------------
# Larger: blocks of 32 and 64, several of each loop's kinds of block.

LARGE = {
  "causal-gqa": Case(b=2, t=130, s=130, n=4, k=2, h=64, is_causal=True),
  "window-lengths-cap": Case(
    b=2,
    t=100,
    s=150,
    n=2,
    k=1,
    h=80,
    hv=64,
    window=(40, 10),
    q_len=(100, 61),
    kv_len=(150, 77),
    cap=5.0,
  ),
  "large-logits-window": Case(t=70, s=90, window=(20, 20), logit_scale=8.0, h=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("blocks", [(32, 64), (64, 32)], ids=str)
@pytest.mark.parametrize("name", LARGE)
def test_larger_cases(name, blocks, dtype):
  config = pallax.AttentionConfig(block_q=blocks[0], block_k=blocks[1], implementation="triton_raw")
  _check(LARGE[name], dtype, seed=7, config=config)
