"""dot_product_attention: forward, lse, AD, execution paths, primitives and bad input.

Everything is compared with the independent float64 reference of
attention_reference.py. The XLA path gets the broad coverage: every masking
feature and pairs of them, GQA / MQA, T != S both ways, head dims, dtypes,
fully masked rows. The interpreted Triton and Mosaic TPU kernels run a
representative subset at small sizes with pinned configs whose blocks split T
and S (several query blocks, a loop over key blocks, blocks skipped under the
causal and window masks), and once with the executor's choice.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  FLOAT_DTYPES,
  NATIVE_KERNELS,
  PATHS,
  TOL,
  as64,
  assert_close,
  attention_primitives_of,
  f64,
  on_path,
  rand,
  to64,
  x64,
)
from tests.primitives.attention_reference import (
  Case,
  assert_lse_close,
  inputs,
  reference,
  small_blocks,
  visible_rows,
)

KERNEL_PATHS = ("triton", "mosaic_tpu")
STATICS = ("scale", "is_causal", "local_window_size")


def _statics(kwargs: dict) -> dict:
  return {k: kwargs[k] for k in STATICS}


def _arrays(args, kwargs) -> tuple:
  """``(q, k, v, bias, mask, q_len, kv_len)``: the array operands of a call."""
  return tuple(args) + (kwargs["query_seq_lengths"], kwargs["key_value_seq_lengths"])


def _op(fn, statics: dict, **extra):
  """``fn`` (pallax's or the reference) as a function of the seven array operands."""

  def call(q, k, v, bias, mask, q_len, kv_len):
    return fn(
      q,
      k,
      v,
      bias,
      mask,
      query_seq_lengths=q_len,
      key_value_seq_lengths=kv_len,
      **statics,
      **extra,
    )

  return call


def _pallax(config=None, **extra):
  return functools.partial(pallax.dot_product_attention, config=config, **extra)


def _diff_args(arrays) -> tuple:
  """The differentiable operands: q, k, v and the bias when there is one."""
  return arrays[:3] if arrays[3] is None else arrays[:4]


def _with_diff(arrays, diff) -> tuple:
  """``arrays`` with its differentiable operands replaced by ``diff``."""
  return tuple(diff[:3]) + ((diff[3] if len(diff) == 4 else None),) + tuple(arrays[4:])


def _fwd_lse_vjp(fn, statics, arrays, ct):
  """``(out, lse, grads)`` of ``fn``: one call returning the residual, and its vjp."""
  f = lambda *diff: _op(fn, statics, return_residual=True)(*_with_diff(arrays, diff))
  (out, lse), vjp = jax.vjp(f, *_diff_args(arrays))
  return out, lse, vjp((ct, jnp.zeros_like(lse)))


def _reference_fwd_lse_vjp(statics, arrays, ct):
  """``_fwd_lse_vjp`` of the float64 reference on float64 copies (call under x64())."""
  arrays64 = tuple(as64(*arrays[:4])) + tuple(arrays[4:])
  return jax.jit(functools.partial(_fwd_lse_vjp, reference, statics))(arrays64, to64(ct))


def _rows(args, kwargs) -> np.ndarray:
  """Query rows that see a key, ``(B, T, N)`` or ``(T, N)``."""
  return visible_rows(args[0].shape, args[1].shape, mask=args[4], **kwargs)


def _check(got, want, rows, dtype, what: str) -> None:
  """Output, lse and gradients against the reference; masked rows exactly 0 / -inf."""
  (out, lse, grads), (out_ref, lse_ref, grads_ref) = got, want
  q_shape = want[0].shape
  assert out.shape == q_shape and out.dtype == dtype, (out.shape, out.dtype)
  assert lse.shape == q_shape[:-1] and lse.dtype == dtype, (lse.shape, lse.dtype)
  assert_close(out, out_ref, dtype, f"{what}: output")
  np.testing.assert_array_equal(
    np.asarray(out, np.float32)[~rows], 0.0, err_msg=f"{what}: rows with no visible key"
  )
  assert_lse_close(lse, lse_ref, dtype, f"{what}: lse")
  # A gradient that is zero in exact arithmetic (dq and dbias with one visible key
  # per row) is compared relative to the largest gradient instead of its rounding.
  scale = max(float(np.max(np.abs(f64(w)), initial=0.0)) for w in grads_ref)
  for g, w, name in zip(grads, grads_ref, ("dq", "dk", "dv", "dbias")):
    assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
    if np.max(np.abs(f64(w)), initial=0.0) > 1e-10 * scale:
      assert_close(g, w, dtype, f"{what}: {name}")
    else:
      err = float(np.max(np.abs(f64(g)), initial=0.0)) / scale
      assert err < TOL[jnp.dtype(dtype).name], f"{what}: {name} should be 0, is {err:.3g} rel."


def _run_case(case: Case, dtype, path: str, config=None, seed: int = 0) -> None:
  args, kwargs = inputs(case, dtype, seed)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  ct = rand(np.random.default_rng(seed + 100), args[0].shape, dtype)
  with on_path(path):
    got = jax.jit(functools.partial(_fwd_lse_vjp, _pallax(config), statics))(arrays, ct)
  with x64():
    want = _reference_fwd_lse_vjp(statics, arrays, ct)
  _check(got, want, _rows(args, kwargs), dtype, f"{path} {case}")


# ------------------------------------------------------------------------------
# The XLA path: every feature and pairs of them.

B, N, T, S = 2, 4, 40, 40
CASES = {
  "mha": Case(),
  "causal-T>S": Case(t=48, s=24, is_causal=True),
  "causal-T<S-bias": Case(t=24, s=48, is_causal=True, bias=(B, N, 24, 48)),
  "T<S-mask": Case(t=17, s=40, mask=(B, N, 17, 40)),
  "T>S-lengths": Case(t=40, s=9, q_len=(33, 5), kv_len=(9, 4)),
  "window-int-causal": Case(window=5, is_causal=True),
  # Query rows t >= 28 see no key: fully masked rows from the window alone.
  "window-T>S": Case(t=48, s=24, window=(4, 30)),
  "window-T<S-gqa": Case(n=6, k=3, t=24, s=48, window=(2, 9)),
  "lengths": Case(t=48, s=48, q_len=(1, 37), kv_len=(37, 1)),
  "lengths-causal-T>S": Case(t=40, s=17, q_len=(33, 5), kv_len=(17, 9), is_causal=True),
  "lengths-window-mask": Case(mask=(1, N, T, S), window=(10, 2), q_len=(30, 40), kv_len=(40, 25)),
  "bias-broadcast-N-lengths": Case(bias=(B, 1, T, S), q_len=(20, 37), kv_len=(40, 11)),
  "bias-2d-mask-2d": Case(bias=(T, S), mask=(T, S)),
  "bias-row-mqa": Case(n=4, k=1, bias=(1, 1, 1, S)),
  "bias-broadcast-B-mask-window": Case(bias=(1, N, T, S), mask=(B, 1, T, S), window=(0, 6)),
  "mask-bias-causal": Case(mask=(B, N, T, S), bias=(B, N, T, S), is_causal=True),
  "gqa-causal-bias": Case(n=8, k=2, is_causal=True, bias=(B, 8, T, S)),
  "mqa-mask-lengths-large-logits": Case(
    n=4, k=1, mask=(B, 4, T, S), kv_len=(13, 40), logit_scale=8.0
  ),
  "unbatched-gqa-causal-bias": Case(b=None, n=4, k=2, is_causal=True, bias=(4, T, S)),
  "unbatched-mask-lengths-scale": Case(b=None, mask=(T, S), q_len=(29,), kv_len=(31,), scale=0.3),
  "one-query": Case(b=1, t=1, s=40),
  "one-key-causal": Case(t=40, s=1, is_causal=True),
}


@pytest.mark.parametrize("name", CASES)
def test_xla_forward_lse_and_grad(name):
  _run_case(CASES[name], jnp.float32, "xla")


# bfloat16 and float16: outputs, lse and gradients in the input dtype.
DTYPE_CASES = ["lengths", "mask-bias-causal", "window-T>S"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", DTYPE_CASES)
def test_xla_16_bit_dtypes(name, dtype):
  _run_case(CASES[name], dtype, "xla", seed=1)


@pytest.mark.parametrize("h", [32, 64, 80, 96, 128, 256])
def test_xla_head_dims(h):
  _run_case(Case(n=4, k=2, t=24, s=32, h=h, is_causal=True, kv_len=(32, 19)), jnp.float32, "xla")


# ------------------------------------------------------------------------------
# The interpreted kernels: small T and S, pinned blocks smaller than T and S.

KERNEL_CASES = {
  "causal-T>S": Case(n=2, k=2, h=32, t=48, s=24, is_causal=True),
  "window-T>S-mqa": Case(n=2, k=1, h=32, t=48, s=24, window=(4, 30)),
  "lengths": Case(n=2, k=2, h=32, t=48, s=48, q_len=(1, 37), kv_len=(37, 1)),
  "mask-bias-causal": Case(
    n=2, k=2, h=32, t=33, s=40, mask=(2, 2, 33, 40), bias=(2, 1, 33, 40), is_causal=True
  ),
  "gqa-bias-lengths": Case(n=4, k=2, h=64, t=40, s=40, bias=(1, 4, 40, 40), kv_len=(40, 23)),
  "causal-T<S-mqa-bias": Case(n=4, k=1, h=32, t=17, s=40, is_causal=True, bias=(2, 4, 17, 40)),
  # Two key blocks on Mosaic too (block_k = 128), the last one ragged.
  "long-S-window-unbatched": Case(
    b=None, n=2, k=2, h=32, t=40, s=200, window=(30, 140), kv_len=(171,), logit_scale=8.0
  ),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_forward_lse_and_grad(path, name):
  case = KERNEL_CASES[name]
  config = small_blocks(path)
  args, kwargs = inputs(case)
  with on_path(path):
    report = pallax.explain(
      lambda *a: jax.grad(lambda q: jnp.sum(_op(_pallax(config), _statics(kwargs))(q, *a[1:])))(
        a[0]
      ),
      *_arrays(args, kwargs),
    )
  assert {s.implementation for s in report} == {"pallas"}, str(report)
  _run_case(case, jnp.float32, path, config)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_default_config(path):
  """The executor's own configs on the kernels."""
  _run_case(KERNEL_CASES["mask-bias-causal"], jnp.float32, path, seed=2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_16_bit_dtypes(path, dtype):
  case = Case(n=4, k=2, h=64, t=40, s=40, is_causal=True, bias=(2, 4, 40, 40), kv_len=(40, 27))
  _run_case(case, dtype, path, small_blocks(path), seed=3)


HEAD_DIMS = [("triton", 80), ("triton", 256), ("mosaic_tpu", 128), ("mosaic_tpu", 256)]


@pytest.mark.parametrize("path, h", HEAD_DIMS)
def test_kernel_head_dims(path, h):
  case = Case(n=2, k=1, h=h, t=24, s=40, is_causal=True, q_len=(24, 17))
  if path == "triton" and path in NATIVE_KERNELS and h == 256:
    # Compiled, float32 at H=256 has no spill-free Triton config (config.py):
    # a pinned config is refused by name; unpinned calls run the XLA program.
    with pytest.raises(ValueError, match="no fwd Triton config compiles spill-free"):
      _run_case(case, jnp.float32, path, small_blocks(path), seed=4)
    _run_case(case, jnp.bfloat16, path, small_blocks(path), seed=4)
    return
  _run_case(case, jnp.float32, path, small_blocks(path), seed=4)


# ------------------------------------------------------------------------------
# Fully masked rows: output exactly 0, lse -inf, finite (zero) gradients.


def _fully_masked_inputs(rng):
  """Rows masked by an all-False mask row, by kv_len = 0 and by padded queries."""
  b, t, s, n = 3, 24, 40, 2
  q, k, v = rand(rng, (b, t, n, 32)), rand(rng, (b, s, n, 32)), rand(rng, (b, s, n, 32))
  mask = np.asarray(rng.random((b, n, t, s)) < 0.7)
  mask[0, 0, 3] = False  # one head's row
  mask[0, :, 7] = False  # every head's row
  mask[1, 1, 5:9] = False
  mask[2, :, :, :] = True
  mask[0, 1, 11, :-1] = False  # one visible key: the last, in the last key block
  mask[0, 1, 11, -1] = True
  bias = rand(rng, (b, n, t, s))
  q_len = jnp.asarray([24, 20, 13], jnp.int32)
  kv_len = jnp.asarray([40, 0, 40], jnp.int32)  # batch 1: no key at all
  return (q, k, v, bias, jnp.asarray(mask), q_len, kv_len)


@pytest.mark.parametrize("path", PATHS)
def test_fully_masked_rows(path):
  rng = np.random.default_rng(5)
  arrays = _fully_masked_inputs(rng)
  statics = dict(scale=None, is_causal=False, local_window_size=None)
  ct = rand(rng, arrays[0].shape)
  with on_path(path):
    got = jax.jit(functools.partial(_fwd_lse_vjp, _pallax(small_blocks(path)), statics))(arrays, ct)
  with x64():
    want = _reference_fwd_lse_vjp(statics, arrays, ct)
  rows = visible_rows(
    arrays[0].shape,
    arrays[1].shape,
    mask=arrays[4],
    query_seq_lengths=arrays[5],
    key_value_seq_lengths=arrays[6],
  )
  assert (~rows).sum() > 50 and rows.sum() > 50
  _check(got, want, rows, jnp.float32, f"{path} fully masked rows")
  out, lse, (dq, dk, dv, dbias) = got
  assert np.all(np.isneginf(np.asarray(lse)[~rows]))
  np.testing.assert_array_equal(np.asarray(dq)[~rows], 0.0)
  np.testing.assert_array_equal(np.asarray(dk)[1], 0.0)  # kv_len = 0: nothing attends
  np.testing.assert_array_equal(np.asarray(dv)[1], 0.0)
  np.testing.assert_array_equal(np.asarray(dbias)[~np.asarray(arrays[4])], 0.0)


def test_jax_nn_differs_only_on_fully_masked_rows():
  """Where jax.nn averages ``value`` over a row with no visible key, pallax gives 0."""
  rng = np.random.default_rng(6)
  q, k, v, bias, mask, _, kv_len = _fully_masked_inputs(rng)
  ours = pallax.dot_product_attention(q, k, v, bias, mask, key_value_seq_lengths=kv_len)
  theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, key_value_seq_lengths=kv_len)
  rows = visible_rows(q.shape, k.shape, mask=mask, key_value_seq_lengths=kv_len)
  np.testing.assert_allclose(np.asarray(ours)[rows], np.asarray(theirs)[rows], atol=2e-5)
  np.testing.assert_array_equal(np.asarray(ours)[~rows], 0.0)


# ------------------------------------------------------------------------------
# Drop-in for jax.nn.dot_product_attention, and the reference against it.

JAX_NN_CASES = [
  "causal-T>S",
  "causal-T<S-bias",
  "window-T<S-gqa",
  "lengths-causal-T>S",
  "bias-2d-mask-2d",
  "unbatched-gqa-causal-bias",
]


@pytest.mark.parametrize("name", JAX_NN_CASES)
def test_matches_jax_nn(name):
  """No fully masked rows (or only padded query rows, which jax.nn zeroes too)."""
  args, kwargs = inputs(CASES[name], seed=7)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  assert np.all(_rows(args, kwargs) | _padded_query_rows(args, kwargs))
  call = lambda fn: jax.jit(_op(fn, statics, return_residual=True))(*arrays)
  (got, got_lse), (want, want_lse) = (
    call(pallax.dot_product_attention),
    call(jax.nn.dot_product_attention),
  )
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  rows = _rows(args, kwargs)
  np.testing.assert_allclose(np.asarray(got_lse)[rows], np.asarray(want_lse)[rows], rtol=2e-5)
  with x64():  # the oracle itself: jax.nn runs its softmax in float32
    ref = jax.jit(_op(reference, statics))(*as64(*arrays[:4]), *arrays[4:])
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)


def _padded_query_rows(args, kwargs) -> np.ndarray:
  q_len = kwargs["query_seq_lengths"]
  q = args[0]
  t = q.shape[-3]
  if q_len is None:
    return np.zeros(q.shape[:-1], bool)
  padded = np.arange(t)[None, :, None] >= np.asarray(q_len)[:, None, None]
  padded = np.broadcast_to(padded, (len(q_len),) + q.shape[-3:-1])
  return padded[0] if q.ndim == 3 else padded


# ------------------------------------------------------------------------------
# Forward-mode AD, Jacobians, linearize, Hessian-vector products.

JVP_CASES = [
  ("xla", "gqa-causal-bias"),
  ("xla", "mqa-mask-lengths-large-logits"),
  ("xla", "window-T>S"),
  ("triton", "gqa-bias-lengths"),
  ("mosaic_tpu", "gqa-bias-lengths"),
]


def _jvp(fn, statics, arrays, tangents):
  f = lambda *diff: _op(fn, statics)(*_with_diff(arrays, diff))
  return jax.jvp(f, _diff_args(arrays), tangents)


@pytest.mark.parametrize("path, name", JVP_CASES)
def test_jvp(path, name):
  case = (KERNEL_CASES if path != "xla" else CASES)[name]
  args, kwargs = inputs(case, seed=8)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  rng = np.random.default_rng(9)
  tangents = tuple(rand(rng, a.shape) for a in _diff_args(arrays))
  with on_path(path):
    y, y_dot = jax.jit(functools.partial(_jvp, _pallax(small_blocks(path)), statics))(
      arrays, tangents
    )
  with x64():
    arrays64 = tuple(as64(*arrays[:4])) + arrays[4:]
    y_ref, y_dot_ref = jax.jit(functools.partial(_jvp, reference, statics))(
      arrays64, tuple(as64(*tangents))
    )
  assert y_dot.dtype == jnp.float32 and y_dot.shape == y_ref.shape
  assert_close(y, y_ref, jnp.float32, "primal")
  assert_close(y_dot, y_dot_ref, jnp.float32, "tangent")
  rows = _rows(args, kwargs)
  np.testing.assert_array_equal(np.asarray(y_dot)[~rows], 0.0)


def test_jvp_is_the_same_on_every_run_of_one_executable():
  """A compiled GQA jvp, run again and again (XLA:CPU once gave uninitialised values).

  jax 0.10.2's algebraic simplifier rewrote constant (zero) tangents and the
  sum of the two logits-tangent products so that the second and later runs of
  one executable read memory nobody wrote; the XLA program now hides its
  tangents behind a barrier and takes one product over a concatenation.
  """
  case = Case(n=8, k=2, t=40, s=40)
  args, kwargs = inputs(case, seed=10)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  rng = np.random.default_rng(11)
  diff = _diff_args(arrays)
  tangents = (jnp.zeros_like(diff[0]), *(rand(rng, a.shape) for a in diff[1:]))
  with x64():
    arrays64 = tuple(as64(*arrays[:4])) + arrays[4:]
    _, want = jax.jit(functools.partial(_jvp, reference, statics))(arrays64, tuple(as64(*tangents)))
  run = jax.jit(functools.partial(_jvp, _pallax(None), statics))
  for attempt in range(4):
    assert_close(run(arrays, tangents)[1], want, jnp.float32, f"run {attempt}")


# A tiny case for the Jacobians and HVPs: GQA, causal, a broadcast bias and a
# kv length, blocks split on the kernels.
TINY = Case(b=2, t=20, s=24, n=2, k=1, h=32, is_causal=True, bias=(2, 1, 20, 24), kv_len=(24, 13))


def _derivatives(fn, statics, arrays, vecs, dirs, proj, c, *, full: bool):
  """jacfwd along a few directions, an HVP and (``full``) jacrev and linearize.

  The Jacobians are of maps with a 3-dim input (``alpha`` moves q, k, v and
  bias along ``dirs``) or a 3-dim output (``proj`` projects the output), so
  that the interpreted kernels see batches of 3 tangents or cotangents.
  """
  f = lambda q, k, v, bias: _op(fn, statics)(q, k, v, bias, *arrays[4:])
  loss = lambda *p: jnp.sum(jnp.sin(f(*p)) * c)
  p = arrays[:4]
  along = lambda alpha: f(*(x + jnp.tensordot(alpha, d, 1) for x, d in zip(p, dirs)))
  out = {
    "jacfwd": jax.jacfwd(along)(jnp.zeros(3, p[0].dtype)),
    "hvp": jax.jvp(jax.grad(loss, (0, 1, 2, 3)), p, vecs)[1],
  }
  if full:
    projected = lambda *p: jnp.tensordot(proj, f(*p), f(*p).ndim)
    out["jacrev"] = jax.jacrev(projected, (0, 1, 2, 3))(*p)
    out["linearize"] = jax.linearize(f, *p)[1](*vecs)
  return out


@pytest.mark.parametrize("path", PATHS)
def test_jacobians_linearize_and_hessian_vector_products(path):
  """All of them on the XLA path; jacfwd (tangent kernel) and the HVP on the kernels."""
  args, kwargs = inputs(TINY, seed=10)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  rng = np.random.default_rng(11)
  c = rand(rng, arrays[0].shape)
  vecs = tuple(rand(rng, a.shape) for a in arrays[:4])
  dirs = tuple(rand(rng, (3,) + a.shape) for a in arrays[:4])
  proj = rand(rng, (3,) + arrays[0].shape)
  full = path == "xla"
  derivatives = functools.partial(_derivatives, statics=statics, full=full)
  with on_path(path):
    got = jax.jit(functools.partial(derivatives, _pallax(small_blocks(path))))(
      arrays=arrays, vecs=vecs, dirs=dirs, proj=proj, c=c
    )
  with x64():
    want = jax.jit(functools.partial(derivatives, reference))(
      arrays=tuple(as64(*arrays[:4])) + arrays[4:],
      vecs=tuple(as64(*vecs)),
      dirs=tuple(as64(*dirs)),
      proj=to64(proj),
      c=to64(c),
    )
  assert_close(got["jacfwd"], want["jacfwd"], jnp.float32, "jacfwd")
  for name, each in (("hvp", True), ("jacrev", True), ("linearize", False)):
    if name not in got:
      continue
    pairs = zip(got[name], want[name], "qkvb") if each else [(got[name], want[name], "")]
    for g, w, arg in pairs:
      assert g.shape == w.shape, (name, arg, g.shape, w.shape)
      assert_close(g, w, jnp.float32, f"{name} {arg}")


# ------------------------------------------------------------------------------
# Primitives in the jaxpr.


FWD, BWD, JVP = (f"dot_product_attention_{s}" for s in ("fwd", "bwd", "jvp"))


@pytest.mark.parametrize(
  "name",
  ["mha", "mask-bias-causal", "mqa-mask-lengths-large-logits", "unbatched-mask-lengths-scale"],
)
def test_one_primitive_each_way(name):
  """Forward: one fwd; grad: one fwd + one bwd (no recomputed forward); jvp: fwd + jvp."""
  args, kwargs = inputs(CASES[name], seed=12)
  arrays, statics = _arrays(args, kwargs), _statics(kwargs)
  f = _op(_pallax(), statics)
  f_res = _op(_pallax(), statics, return_residual=True)
  diff = _diff_args(arrays)
  loss = lambda *d: jnp.sum(jnp.sin(f(*_with_diff(arrays, d))))
  assert attention_primitives_of(f, *arrays) == {FWD: 1}
  assert attention_primitives_of(f_res, *arrays) == {FWD: 1}
  grad_all = jax.grad(loss, tuple(range(len(diff))))
  assert attention_primitives_of(grad_all, *diff) == {FWD: 1, BWD: 1}
  assert attention_primitives_of(jax.grad(loss), *diff) == {FWD: 1, BWD: 1}
  assert attention_primitives_of(jax.value_and_grad(loss), *diff) == {FWD: 1, BWD: 1}
  jvp = lambda *d: jax.jvp(lambda *d: f(*_with_diff(arrays, d)), d, d)
  assert attention_primitives_of(jvp, *diff) == {FWD: 1, JVP: 1}
  # With the residual returned too, grad still runs one forward.
  res_loss = lambda q: jnp.sum(f_res(q, *arrays[1:])[0])
  assert attention_primitives_of(jax.grad(res_loss), arrays[0]) == {FWD: 1, BWD: 1}


def test_lse_has_no_gradient():
  args, kwargs = inputs(CASES["causal-T>S"], seed=13)
  f = lambda q, k: jnp.sum(
    pallax.dot_product_attention(q, k, *args[2:], **kwargs, return_residual=True)[1]
  )
  dq, dk = jax.grad(f, (0, 1))(*args[:2])
  np.testing.assert_array_equal(dq, 0.0)
  np.testing.assert_array_equal(dk, 0.0)
  _, lse_dot = jax.jvp(
    lambda q: pallax.dot_product_attention(q, *args[1:], **kwargs, return_residual=True)[1],
    (args[0],),
    (args[0],),
  )
  np.testing.assert_array_equal(lse_dot, 0.0)


# ------------------------------------------------------------------------------
# implementation= and config=.


def _implementations(fn, *args) -> set[str]:
  return {s.implementation for s in pallax.explain(fn, *args)}


def test_implementation_pins():
  args, kwargs = inputs(CASES["gqa-causal-bias"], seed=14)
  with x64():
    want = reference(*as64(*args[:4]), args[4], **kwargs)
  for path, impl, expected in [
    ("xla", "xla", "xla"),
    ("triton", "xla", "xla"),
    ("triton", "pallas", "pallas"),
    ("mosaic_tpu", "pallas", "pallas"),
  ]:
    f = lambda q, k, v, bias: pallax.dot_product_attention(
      q, k, v, bias, args[4], **kwargs, implementation=impl
    )
    grad = jax.grad(lambda *p: jnp.sum(f(*p)), (0, 1, 2, 3))
    with on_path(path):
      assert _implementations(grad, *args[:4]) == {expected}, (path, impl)
      got = jax.jit(f)(*args[:4])
    assert_close(got, want, jnp.float32, f"{path} implementation={impl}")


@pytest.mark.parametrize(
  "impl, words", [("cudnn", ["pallas", "xla"]), ("triton", ["implementation"])]
)
def test_bad_implementation(impl, words):
  q = jnp.ones((1, 8, 2, 32))
  with pytest.raises(ValueError) as err:
    pallax.dot_product_attention(q, q, q, implementation=impl)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


def test_pinned_config_reaches_every_kernel():
  args, kwargs = inputs(KERNEL_CASES["gqa-bias-lengths"], seed=15)
  config = pallax.AttentionConfig(block_q=16, block_k=32, num_warps=4, num_stages=2)
  f = lambda *a: jnp.sum(_op(_pallax(config), _statics(kwargs))(*a))
  grad = jax.grad(f, (0, 1, 2))
  jvp = lambda q: jax.jvp(lambda q: f(q, *_arrays(args, kwargs)[1:]), (q,), (q,))
  with on_path("triton"):
    report = list(pallax.explain(grad, *_arrays(args, kwargs))) + list(pallax.explain(jvp, args[0]))
  assert sorted(s.op for s in report) == sorted([FWD, BWD, FWD, JVP]), str(report)
  for s in report:
    assert s.implementation == "pallas" and s.source == "pinned", str(report)
    assert (s.config.block_q, s.config.block_k) == (16, 32), str(report)


def test_eager_matches_jit():
  """Eager and jitted calls agree to float32 rounding.

  Not bitwise: eagerly, the layout changes around the primitive run as separate
  programs, and XLA may then order the products' sums differently.
  """
  args, kwargs = inputs(CASES["mask-bias-causal"], seed=16)
  f = lambda *a: pallax.dot_product_attention(*a, **kwargs)
  assert_close(f(*args), jax.jit(f)(*args), jnp.float32, "eager against jit")


def test_config_is_one_dataclass():
  config = pallax.AttentionConfig(block_q=32, block_k=64, num_warps=4, num_stages=2)
  assert isinstance(config, pallax.KernelConfig)
  assert dataclasses.replace(config, block_q=16).block_q == 16


# ------------------------------------------------------------------------------
# Bad input.

_Q, _KV = (2, 8, 4, 32), (2, 8, 2, 32)


def _ones(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


# (overrides of the valid call, the words of which the message holds one each).
BAD_INPUTS = {
  "query rank 2": (dict(query=_ones((8, 32))), ["query"]),
  "query rank 5": (dict(query=_ones((1,) + _Q)), ["query"]),
  "key rank 2": (dict(key=_ones((8, 32))), ["key"]),
  "value rank": (dict(value=_ones(_KV[1:])), ["value"]),
  "key head dim": (dict(key=_ones((2, 8, 2, 16))), [("key", "query")]),
  "kv heads not dividing": (
    dict(key=_ones((2, 8, 3, 32)), value=_ones((2, 8, 3, 32))),
    [("key", "heads")],
  ),
  "more kv heads than query heads": (
    dict(key=_ones((2, 8, 8, 32)), value=_ones((2, 8, 8, 32))),
    [("key", "heads")],
  ),
  "k/v length mismatch": (dict(value=_ones((2, 9, 2, 32))), ["value"]),
  "k/v batch mismatch": (dict(value=_ones((3, 8, 2, 32))), ["value"]),
  "q/k batch mismatch": (
    dict(key=_ones((3, 8, 2, 32)), value=_ones((3, 8, 2, 32))),
    [("key", "query")],
  ),
  "integer query": (dict(query=_ones(_Q, jnp.int32)), ["query"]),
  "integer key": (dict(key=_ones(_KV, jnp.int32)), ["key"]),
  "bool value": (dict(value=_ones(_KV, bool)), ["value"]),
  "float mask": (dict(mask=_ones((2, 4, 8, 8))), ["mask"]),
  "int mask": (dict(mask=_ones((8, 8), jnp.int32)), ["mask"]),
  "mask shape": (dict(mask=_ones((2, 4, 8, 7), bool)), ["mask"]),
  "mask heads": (dict(mask=_ones((2, 3, 8, 8), bool)), ["mask"]),
  "mask rank 5": (dict(mask=_ones((1, 2, 4, 8, 8), bool)), ["mask"]),
  "bias shape": (dict(bias=_ones((2, 4, 7, 8))), ["bias"]),
  "bias batch": (dict(bias=_ones((3, 1, 8, 8))), ["bias"]),
  "bias rank 5": (dict(bias=_ones((1, 2, 4, 8, 8))), ["bias"]),
  "q lengths shape": (dict(query_seq_lengths=_ones((3,), jnp.int32)), ["query_seq_lengths"]),
  "q lengths rank": (dict(query_seq_lengths=_ones((2, 1), jnp.int32)), ["query_seq_lengths"]),
  "q lengths dtype": (dict(query_seq_lengths=_ones((2,))), ["query_seq_lengths"]),
  "kv lengths shape": (
    dict(key_value_seq_lengths=_ones((1,), jnp.int32)),
    ["key_value_seq_lengths"],
  ),
  "kv lengths dtype": (dict(key_value_seq_lengths=_ones((2,), bool)), ["key_value_seq_lengths"]),
  "negative window": (dict(local_window_size=-1), ["local_window_size"]),
  "negative right window": (dict(local_window_size=(3, -2)), ["local_window_size"]),
  "window of three": (dict(local_window_size=(1, 2, 3)), ["local_window_size"]),
  "scale string": (dict(scale="big"), ["scale"]),
  "implementation": (dict(implementation="fast"), ["implementation"]),
  "config string": (dict(config="fast"), ["config"]),
  "config class": (dict(config=pallax.NormConfig(block_rows=8)), ["AttentionConfig"]),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input(name):
  overrides, words = BAD_INPUTS[name]
  call = dict(query=_ones(_Q), key=_ones(_KV), value=_ones(_KV))
  call.update(overrides)
  with pytest.raises((ValueError, TypeError)) as err:
    pallax.dot_product_attention(call.pop("query"), call.pop("key"), call.pop("value"), **call)
  message = str(err.value)
  for word in words:
    alternatives = (word,) if isinstance(word, str) else word
    assert any(w in message for w in alternatives), (word, message)


def test_bad_input_inside_jit_and_vmap():
  q, kv = _ones(_Q), _ones(_KV)
  with pytest.raises((ValueError, TypeError), match="mask"):
    jax.jit(lambda m: pallax.dot_product_attention(q, kv, kv, mask=m))(_ones((2, 4, 8, 7), bool))
  with pytest.raises((ValueError, TypeError), match="key_value_seq_lengths"):
    jax.vmap(lambda n: pallax.dot_product_attention(q, kv, kv, key_value_seq_lengths=n))(
      _ones((5, 3), jnp.int32)
    )


# ------------------------------------------------------------------------------
# Larger sizes.


@pytest.mark.slow
@pytest.mark.parametrize(
  "case",
  [
    Case(b=2, t=1000, s=1000, n=4, k=2, h=64, is_causal=True, q_len=(1000, 37), kv_len=(1, 1000)),
    Case(b=1, t=1000, s=777, n=2, k=1, h=128, window=(100, 20), bias=(1, 2, 1000, 777)),
  ],
  ids=["causal-lengths", "window-bias"],
)
def test_xla_long_sequences(case):
  _run_case(case, jnp.float32, "xla", seed=17)
  _run_case(case, jnp.bfloat16, "xla", seed=18)


@pytest.mark.slow
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(
  "name", ["causal-T<S-bias", "gqa-causal-bias", "mqa-mask-lengths-large-logits", "lengths"]
)
def test_kernel_more_cases(path, name):
  _run_case(CASES[name], jnp.float32, path, small_blocks(path), seed=19)


@pytest.mark.slow
@pytest.mark.parametrize("pinned", [False, True], ids=["default-config", "small-blocks"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_longer_sequences(path, pinned):
  """Hundreds of queries and keys: many key blocks, ragged in T and S, on both kernels."""
  case = Case(
    n=4, k=2, h=64, t=300, s=257, is_causal=True, bias=(2, 1, 300, 257), kv_len=(257, 100)
  )
  _run_case(case, jnp.float32, path, small_blocks(path) if pinned else None, seed=20)
  _run_case(case, jnp.bfloat16, path, small_blocks(path) if pinned else None, seed=21)


@pytest.mark.parametrize("path", PATHS)
def test_value_head_dim_may_differ(path):
  """An extension of jax.nn (which requires equal head dims): the output takes the value's."""
  rng = np.random.default_rng(23)
  q, k = rand(rng, (2, 24, 4, 32)), rand(rng, (2, 40, 2, 32))
  v, bias = rand(rng, (2, 40, 2, 16)), rand(rng, (1, 4, 24, 40))
  ct = rand(rng, (2, 24, 4, 16))
  f = lambda q, k, v, bias: pallax.dot_product_attention(
    q, k, v, bias, is_causal=True, config=small_blocks(path)
  )
  with on_path(path):
    out, vjp = jax.vjp(f, q, k, v, bias)
    grads = vjp(ct)
  assert out.shape == (2, 24, 4, 16)
  with x64():
    ref = lambda q, k, v, bias: reference(q, k, v, bias, is_causal=True)
    want, ref_vjp = jax.vjp(ref, *as64(q, k, v, bias))
    want_grads = ref_vjp(to64(ct))
  assert_close(out, want, jnp.float32, "output")
  for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv", "dbias")):
    assert_close(g, w, jnp.float32, name)
