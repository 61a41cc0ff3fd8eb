"""cross_entropy / linear_cross_entropy AD: grad, jvp and Hessian-vector products.

Gradients with respect to the logits, or to ``x``, ``weight`` and ``bias``,
against jax's gradients of the float64 reference, for every option and
reduction (``"none"`` through a random cotangent) and through the returned
lse; tangents in every floating operand at once; forward-over-reverse (and
reverse-over-reverse) Hessian-vector products. On the XLA path and both
interpreted kernels (executor configs and small pinned blocks). Ignored
tokens get zero gradients, an all-ignored "mean" zero gradients (not NaN);
grad is one forward and one backward primitive, jvp one forward and one
tangent primitive, except for a scalar loss of ``linear_cross_entropy``: one
value-and-gradient primitive either way, on a CPU one fused program over
token chunks (checked here over several chunks against float64).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.kernels.cross_entropy import xla as cross_entropy_xla
from tests.helpers import PATHS, assert_close, on_path, primitive_names, rand, to64, x64
from tests.primitives.cross_entropy_reference import (
  IGNORE,
  KERNEL_PATH_CONFIGS,
  OPS,
  OPTIONS,
  assert_loss_close,
  floating,
  inputs,
  labels_for,
  linear_reference,
  pallax_loss,
  pc_config,
  pc_id,
  reference_loss,
)

V = 301
TOKENS = (2, 7)
FWD, JVP, BWD = "cross_entropy_fwd", "cross_entropy_jvp", "cross_entropy_bwd"
LOSS, VALUE_AND_GRAD = "linear_cross_entropy_loss", "linear_cross_entropy_value_and_grad"


def _ignore_index(options: dict):
  return options.get("ignore_index", IGNORE)


def _objective(loss_fn, op, ops, cts, **options):
  """A scalar of the floating operands using every output: mean, sum, none and lse.

  ``cts``: random cotangents of the per-token losses and of the lse.
  """

  def f(floats):
    all_ops = {**ops, **floats}
    mean = loss_fn(op, all_ops, reduction="mean", **options)
    total = loss_fn(op, all_ops, reduction="sum", **options)
    per_token, lse = loss_fn(op, all_ops, reduction="none", return_lse=True, **options)
    return (
      mean
      + 0.5 * total
      + jnp.sum(per_token * cts[0].astype(per_token.dtype))
      + jnp.sum(lse * cts[1].astype(lse.dtype))
    )

  return f


def _pallax_fn(config):
  return lambda op, ops, **kw: pallax_loss(op, ops, config, **kw)


def _cotangents(rng, shape):
  return rand(rng, shape), rand(rng, shape)


def _check_grads(got: dict, want: dict, dtype, what: str) -> None:
  assert set(got) == set(want), (set(got), set(want))
  for name in got:
    assert got[name].dtype == dtype, (what, name, got[name].dtype)
    assert got[name].shape == want[name].shape, (what, name)
    assert_close(got[name], want[name], dtype, f"{what}: d{name}")


def _grads(op, ops, cts, config=None, **options):
  f = _objective(_pallax_fn(config), op, ops, cts, **options)
  return jax.jit(jax.grad(f))(floating(ops))


def _reference_grads(op, ops, cts, **options):
  with x64():
    f = _objective(lambda op, ops, **kw: reference_loss(op, ops, **kw), op, ops, cts, **options)
    return jax.grad(f)({k: to64(a) for k, a in floating(ops).items()})


# ----------------------------------------------------------------------------
# Reverse mode.

AD_OPTIONS = dict(OPTIONS, smoothing_1=dict(label_smoothing=1.0))


@pytest.mark.parametrize("name", list(AD_OPTIONS))
@pytest.mark.parametrize("op", OPS)
def test_grad_xla(op, name):
  options = AD_OPTIONS[name]
  rng = np.random.default_rng(0)
  ops = inputs(op, rng, TOKENS, V, ignore_index=_ignore_index(options))
  cts = _cotangents(rng, TOKENS)
  _check_grads(
    _grads(op, ops, cts, **options), _reference_grads(op, ops, cts, **options), jnp.float32, name
  )


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("ignore_index", [IGNORE, None], ids=str)
def test_grad_linear_combinations(ignore_index, bias):
  options = dict(ignore_index=ignore_index, label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0)
  rng = np.random.default_rng(1)
  op = "linear_cross_entropy"
  ops = inputs(op, rng, (17,), V, d=33, bias=bias, ignore_index=ignore_index)
  cts = _cotangents(rng, (17,))
  _check_grads(
    _grads(op, ops, cts, **options),
    _reference_grads(op, ops, cts, **options),
    jnp.float32,
    f"bias={bias} ignore_index={ignore_index}",
  )


def _kernel_shape(pc):
  path, small = pc
  return ((20,), 160) if path == "mosaic_tpu" and small else ((4, 5), 40)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("pc", KERNEL_PATH_CONFIGS, ids=pc_id)
def test_kernel_grad_and_jvp(pc, op):
  """Every option together on each path: gradients, and the jvp with tangents in every operand."""
  path, _ = pc
  options = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0)
  tokens, d = _kernel_shape(pc)
  rng = np.random.default_rng(2)
  ops = inputs(op, rng, tokens, V, d=d)
  cts = _cotangents(rng, tokens)
  tangents = {k: rand(rng, a.shape) for k, a in floating(ops).items()}
  config = pc_config(pc)
  with on_path(path):
    grads = _grads(op, ops, cts, config, **options)
    jvp = jax.jit(lambda ops, t: _jvp(op, ops, t, config, **options))(ops, tangents)
  _check_grads(grads, _reference_grads(op, ops, cts, **options), jnp.float32, pc_id(pc))
  _check_jvp(jvp, _reference_jvp(op, ops, tangents, **options), jnp.float32, pc_id(pc))


@pytest.mark.parametrize("path", ["xla", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("op", OPS)
def test_grad_bfloat16(op, path):
  """bfloat16 gradients in bfloat16, against float64 gradients of the rounded inputs."""
  options = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0)
  rng = np.random.default_rng(3)
  ops = inputs(op, rng, (24,), V, d=64, dtype=jnp.bfloat16)
  cts = _cotangents(rng, (24,))
  with on_path(path):
    grads = _grads(op, ops, cts, **options)
  _check_grads(grads, _reference_grads(op, ops, cts, **options), jnp.bfloat16, f"{path} bf16")


@pytest.mark.parametrize("op", OPS)
def test_grad_and_jvp_float64(op):
  options = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0)
  rng = np.random.default_rng(4)
  with x64():
    ops = inputs(op, rng, TOKENS, V, dtype=jnp.float64)
    cts = _cotangents(rng, TOKENS)
    tangents = {k: rand(rng, a.shape, jnp.float64) for k, a in floating(ops).items()}
    grads = _grads(op, ops, cts, **options)
    jvp = jax.jit(lambda ops, t: _jvp(op, ops, t, **options))(ops, tangents)
  _check_grads(grads, _reference_grads(op, ops, cts, **options), jnp.float64, "float64")
  _check_jvp(jvp, _reference_jvp(op, ops, tangents, **options), jnp.float64, "float64")


@pytest.mark.parametrize("op", OPS)
def test_ignored_tokens_get_zero_gradients(op):
  rng = np.random.default_rng(5)
  ops = inputs(op, rng, (5, 6), V)
  ignored = np.asarray(ops["labels"]) == IGNORE
  assert ignored.any() and not ignored.all()
  for reduction in ("mean", "sum", "none"):
    f = lambda floats, r=reduction: jnp.sum(
      pallax_loss(op, {**ops, **floats}, reduction=r, label_smoothing=0.2, z_loss=0.1)
    )
    grads = jax.jit(jax.grad(f))(floating(ops))
    first = grads["logits"] if op == "cross_entropy" else grads["x"]
    np.testing.assert_array_equal(np.asarray(first)[ignored], 0.0, err_msg=reduction)
    assert np.abs(np.asarray(first)[~ignored]).max() > 0


@pytest.mark.parametrize("op", OPS)
def test_all_ignored_mean_has_zero_gradients(op):
  rng = np.random.default_rng(6)
  ops = inputs(op, rng, (3, 4), V)
  ops["labels"] = jnp.full((3, 4), IGNORE, jnp.int32)
  for reduction in ("mean", "sum", "none"):
    f = lambda floats, r=reduction: jnp.sum(
      pallax_loss(op, {**ops, **floats}, reduction=r, z_loss=1e-2, label_smoothing=0.1)
    )
    value, grads = jax.jit(jax.value_and_grad(f))(floating(ops))
    assert float(value) == 0.0
    for name, g in grads.items():
      np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=f"{reduction}: d{name}")


@pytest.mark.parametrize("table_layout", ["embedding", "dense"])
@pytest.mark.parametrize("path", PATHS)
def test_transposed_weight_read_in_place(path, table_layout):
  """A weight passed as ``table.T``: values, gradients and tangents through the table.

  ``embedding``: a tied ``(V, D)`` table as ``embedding.T``; ``dense``: a
  ``(D, V)`` kernel as ``kernel.T`` with ``transposed_weight=True``. The
  lowering reads the table in place (flipping the layout flag); the tangent's
  weight tangent is a transpose too.
  """
  rng = np.random.default_rng(7)
  x = rand(rng, (3, 6, 32))
  table = rand(rng, (V, 32) if table_layout == "embedding" else (32, V), scale=0.3)
  dx, dtable = rand(rng, x.shape), rand(rng, table.shape)
  labels = labels_for(rng, (3, 6), V)
  flag = table_layout == "dense"
  f = lambda x, t: pallax.linear_cross_entropy(
    x, t.T, labels, transposed_weight=flag, label_smoothing=0.1
  )
  with on_path(path):
    value, grads = jax.jit(jax.value_and_grad(f, (0, 1)))(x, table)
    _, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, table, dx, dtable)
  with x64():
    weight = (lambda t: t) if flag else (lambda t: t.T)
    ref = lambda x, t: linear_reference(x, weight(t), labels, label_smoothing=0.1)
    args = (to64(x), to64(table))
    value_ref, grads_ref = jax.value_and_grad(ref, (0, 1))(*args)
    _, tangent_ref = jax.jvp(ref, args, (to64(dx), to64(dtable)))
  assert_close(value, value_ref, jnp.float32, "loss")
  assert_close(grads[0], grads_ref[0], jnp.float32, "dx")
  assert_close(grads[1], grads_ref[1], jnp.float32, "dtable")
  assert_close(tangent, tangent_ref, jnp.float32, "tangent")


# ----------------------------------------------------------------------------
# Forward mode.


def _jvp(op, ops, tangents, config=None, **options):
  """Primal and tangent of the mean and of the per-token losses and lse."""

  def f(floats):
    all_ops = {**ops, **floats}
    per_token, lse = pallax_loss(op, all_ops, config, reduction="none", return_lse=True, **options)
    return pallax_loss(op, all_ops, config, **options), per_token, lse

  return jax.jvp(f, (floating(ops),), (tangents,))


def _reference_jvp(op, ops, tangents, **options):
  with x64():

    def f(floats):
      all_ops = {**ops, **floats}
      per_token, lse = reference_loss(op, all_ops, reduction="none", return_lse=True, **options)
      return reference_loss(op, all_ops, **options), per_token, lse

    as64 = lambda d: {k: to64(a) for k, a in d.items()}
    return jax.jvp(f, (as64(floating(ops)),), (as64(tangents),))


def _check_jvp(got, want, dtype, what):
  (primals, tangents), (primals_ref, tangents_ref) = got, want
  for g, w, name in zip(
    primals + tangents,
    primals_ref + tangents_ref,
    ["mean", "none", "lse", "d mean", "d none", "d lse"],
  ):
    assert_loss_close(g, w, dtype, f"{what}: {name}")


@pytest.mark.parametrize("name", ["plain", "smoothing", "z_loss", "cap", "all"])
@pytest.mark.parametrize("op", OPS)
def test_jvp_xla(op, name):
  options = OPTIONS[name]
  rng = np.random.default_rng(8)
  ops = inputs(op, rng, TOKENS, V)
  tangents = {k: rand(rng, a.shape) for k, a in floating(ops).items()}
  got = jax.jit(lambda ops, t: _jvp(op, ops, t, **options))(ops, tangents)
  _check_jvp(got, _reference_jvp(op, ops, tangents, **options), jnp.float32, name)


def test_jvp_of_each_operand_alone():
  """A tangent in only x, only weight or only bias (the others symbolic zeros)."""
  rng = np.random.default_rng(9)
  op = "linear_cross_entropy"
  ops = inputs(op, rng, (11,), V)
  options = dict(label_smoothing=0.1, logit_soft_cap=3.0)
  for name in ("x", "weight", "bias"):
    t = rand(rng, ops[name].shape)

    def f(a, name=name):
      return pallax_loss(op, {**ops, name: a}, reduction="none", **options)

    got = jax.jit(lambda a, t, f=f: jax.jvp(f, (a,), (t,)))(ops[name], t)
    with x64():
      ref = lambda a, name=name: reference_loss(op, {**ops, name: a}, reduction="none", **options)
      want = jax.jvp(ref, (to64(ops[name]),), (to64(t),))
    for g, w, what in zip(got, want, ("primal", "tangent")):
      assert_close(g, w, jnp.float32, f"{what} with a tangent in {name}")


# ----------------------------------------------------------------------------
# Second order.


@pytest.mark.parametrize("op", OPS)
def test_hessian_vector_products(op):
  """``jax.jvp(jax.grad(loss))`` (forward over reverse), and reverse over reverse."""
  options = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0)
  rng = np.random.default_rng(10)
  ops = inputs(op, rng, (9,), 67, d=12)
  vs = {k: rand(rng, a.shape) for k, a in floating(ops).items()}

  def loss(fn):
    return lambda floats: fn(op, {**ops, **floats}, **options)

  ours = loss(lambda op, ops, **kw: pallax_loss(op, ops, **kw))
  fwd_rev = jax.jit(lambda p, v: jax.jvp(jax.grad(ours), (p,), (v,))[1])(floating(ops), vs)
  with x64():
    ref = loss(lambda op, ops, **kw: reference_loss(op, ops, **kw))
    p64, v64 = ({k: to64(a) for k, a in d.items()} for d in (floating(ops), vs))
    want = jax.jvp(jax.grad(ref), (p64,), (v64,))[1]
  for name in want:
    assert_close(fwd_rev[name], want[name], jnp.float32, f"forward-over-reverse hvp d{name}")
  rev_rev = jax.jit(
    jax.grad(lambda p, v: sum(jnp.vdot(g, v[k]) for k, g in jax.grad(ours)(p).items()))
  )(floating(ops), vs)
  for name in want:
    assert_close(rev_rev[name], want[name], jnp.float32, f"reverse-over-reverse hvp d{name}")


@pytest.mark.slow
def test_hessian_of_logits():
  """The full Hessian of a small cross_entropy (jacfwd of grad) against the reference's."""
  rng = np.random.default_rng(11)
  z = rand(rng, (3, 10), scale=2.0)
  labels = jnp.asarray([0, IGNORE, 9], jnp.int32)
  options = dict(label_smoothing=0.2, z_loss=0.1, logit_soft_cap=2.5)
  got = jax.jit(jax.hessian(lambda z: pallax.cross_entropy(z, labels, **options)))(z)
  with x64():
    from tests.primitives.cross_entropy_reference import reference

    want = jax.hessian(lambda z: reference(z, labels, **options))(to64(z))
  assert_close(got, want, jnp.float32, "hessian")


# ----------------------------------------------------------------------------
# One kernel each way.


def _counts(jaxpr) -> collections.Counter:
  names = primitive_names(jaxpr)
  assert not {"while", "scan"} & set(names), names
  return collections.Counter(n for n in names if "cross_entropy" in n)


@pytest.mark.parametrize("return_lse", [False, True], ids=["loss", "loss-and-lse"])
@pytest.mark.parametrize("op", OPS)
def test_one_kernel_each_way(op, return_lse):
  rng = np.random.default_rng(12)
  ops = inputs(op, rng, TOKENS, 64, d=16)
  options = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=5.0, return_lse=return_lse)

  def f(floats):
    out = pallax_loss(op, {**ops, **floats}, **options)
    return out[0] + jnp.sum(jnp.sin(out[1])) if return_lse else out

  floats = floating(ops)
  forward = jax.make_jaxpr(f)(floats).jaxpr
  grad = jax.make_jaxpr(jax.grad(f))(floats).jaxpr
  jvp = jax.make_jaxpr(lambda p: jax.jvp(f, (p,), (p,)))(floats).jaxpr
  if op == "linear_cross_entropy" and not return_lse:  # a scalar loss: its gradient in one
    assert _counts(forward) == {LOSS: 1}
    assert _counts(grad) == _counts(jvp) == {VALUE_AND_GRAD: 1}
  else:
    assert _counts(forward) == {FWD: 1}
    assert _counts(grad) == {FWD: 1, BWD: 1}
    assert _counts(jvp) == {FWD: 1, JVP: 1}


def test_grad_with_respect_to_some_operands_only():
  """grad w.r.t. weight only (x constant) and x only: still one value-and-gradient primitive."""
  rng = np.random.default_rng(13)
  op = "linear_cross_entropy"
  ops = inputs(op, rng, (13,), V)
  for name in ("weight", "x", "bias"):
    f = lambda a, name=name: pallax_loss(op, {**ops, name: a}, label_smoothing=0.1)
    got = jax.jit(jax.grad(f))(ops[name])
    assert _counts(jax.make_jaxpr(jax.grad(f))(ops[name]).jaxpr) == {VALUE_AND_GRAD: 1}
    with x64():
      ref = lambda a, name=name: reference_loss(op, {**ops, name: a}, label_smoothing=0.1)
      want = jax.grad(ref)(to64(ops[name]))
    assert_close(got, want, jnp.float32, f"d{name} alone")


# ----------------------------------------------------------------------------
# The CPU's fused value and gradient of a scalar loss.


def _while_loops(fn, *args) -> int:
  return fn.lower(*args).as_text().count("stablehlo.while")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "table"])
def test_fused_value_and_grad_over_token_chunks(monkeypatch, transposed, reduction):
  """On a CPU, ``value_and_grad`` of a scalar loss is one loop over token chunks.

  Chunks of 8 tokens over 37 (four whole chunks and a remainder of 5), every
  option on, against float64; the same loss with ``return_lse`` (the forward
  and backward stages) is the control, with a loop each.
  """
  monkeypatch.setattr(cross_entropy_xla, "_FUSED_ELEMENTS", 8 * V)
  rng = np.random.default_rng(21)
  op = "linear_cross_entropy"
  ops = inputs(op, rng, (37,), V, d=20)
  x, w, b, labels = ops["x"], ops["weight"], ops["bias"], ops["labels"]
  options = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0, reduction=reduction)
  table = w.T if transposed else w

  def loss(x, table, b, return_lse=False):
    out = pallax.linear_cross_entropy(
      x, table, labels, bias=b, transposed_weight=transposed, return_lse=return_lse, **options
    )
    return out[0] if return_lse else out

  fused = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
  stages = jax.jit(jax.value_and_grad(lambda *a: loss(*a, return_lse=True), (0, 1, 2)))
  assert _while_loops(fused, x, table, b) == 1
  assert _while_loops(stages, x, table, b) == 2
  got, grads = fused(x, table, b)
  with x64():
    ref = lambda x, w, b: reference_loss(op, dict(ops, x=x, weight=w, bias=b), **options)
    want, want_grads = jax.value_and_grad(ref, (0, 1, 2))(to64(x), to64(w), to64(b))
  assert_loss_close(got, want, jnp.float32, reduction)
  want_grads = (want_grads[0], want_grads[1].T if transposed else want_grads[1], want_grads[2])
  for name, g, want_g in zip(("x", "weight", "bias"), grads, want_grads):
    assert_close(g, want_g, jnp.float32, f"{reduction}: d{name}")
