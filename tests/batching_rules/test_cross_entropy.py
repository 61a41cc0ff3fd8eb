"""vmap of cross_entropy / linear_cross_entropy: the float64 reference per example, one primitive.

Every combination of mapped / unmapped ``x``, ``weight``, labels and bias
(weight only, x only with shared or per-example labels, both, axes other
than 0), nested vmaps, vmap of grad (per-example weight gradients against a
Python loop) and of jvp; a vmapped call is one forward primitive (grad: one
forward and one backward, jvp: one forward and one tangent), never a loop.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  NESTED_IN_AXES,
  assert_close,
  batched,
  check_nested_vmap,
  loop_stack,
  nested_shape,
  on_path,
  primitive_names,
  rand,
  x64,
)
from tests.primitives.cross_entropy_reference import (
  REDUCTIONS,
  labels_for,
  linear_reference,
  reference,
)

TOKENS, D, V = (2, 5), 16, 67  # one example: x (2, 5, 16), weight (16, 67), labels (2, 5)
SIZE = 3
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0)
FWD, JVP, BWD = "cross_entropy_fwd", "cross_entropy_jvp", "cross_entropy_bwd"


def _counts(jaxpr) -> collections.Counter:
  names = primitive_names(jaxpr)
  assert not {"while", "scan"} & set(names), names
  return collections.Counter(n for n in names if "cross_entropy" in n)


def _all_outputs(loss_fn):
  """Every reduction and the lse of one call ``loss_fn(reduction=..., return_lse=...)``."""
  outs = [loss_fn(reduction=r) for r in REDUCTIONS]
  return outs + [loss_fn(reduction="none", return_lse=True)[1]]


def linear(x, w, labels, b):
  return _all_outputs(
    lambda **kw: pallax.linear_cross_entropy(x, w, labels, bias=b, **OPTIONS, **kw)
  )


def linear_one_call(x, w, labels, b):
  """One call (per-token losses and lse): what the primitive counts look at."""
  return pallax.linear_cross_entropy(
    x, w, labels, bias=b, reduction="none", return_lse=True, **OPTIONS
  )


def linear_ref(x, w, labels, b):
  return _all_outputs(lambda **kw: linear_reference(x, w, labels, bias=b, **OPTIONS, **kw))


def logits_fn(z, labels):
  return _all_outputs(lambda **kw: pallax.cross_entropy(z, labels, **OPTIONS, **kw))


def logits_ref(z, labels):
  return _all_outputs(lambda **kw: reference(z, labels, **OPTIONS, **kw))


def _linear_args(rng, in_axes, size=SIZE):
  x_axis, w_axis, l_axis, b_axis = in_axes
  return (
    batched(rng, x_axis, size, TOKENS + (D,)),
    batched(rng, w_axis, size, (D, V), lambda s: rand(rng, s, scale=0.5)),
    batched(rng, l_axis, size, TOKENS, lambda s: labels_for(rng, s, V)),
    batched(rng, b_axis, size, (V,)),
  )


def _to64(args):
  return [a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]


def _check(got, want, what):
  for g, w, name in zip(got, want, REDUCTIONS + ("lse",)):
    assert_close(g, w, jnp.float32, f"{what}: {name}")


# (x, weight, labels, bias) in_axes of linear_cross_entropy.
LINEAR_IN_AXES = [
  (0, None, 0, None),  # a batch of sequences, one LM head
  (0, None, None, None),  # shared labels
  (None, None, 0, None),  # labels only
  (None, 0, None, None),  # weight only
  (None, 0, None, 0),  # weight and bias
  (None, None, None, 0),  # bias only
  (0, 0, 0, 0),  # everything
  (1, 2, 1, None),  # axes other than 0
  (-1, 1, 2, -1),
  (2, -1, None, 0),
]


@pytest.mark.parametrize("in_axes", LINEAR_IN_AXES, ids=str)
def test_linear_vmap_matches_reference(in_axes):
  rng = np.random.default_rng(0)
  args = _linear_args(rng, in_axes)
  got = jax.jit(jax.vmap(linear, in_axes=in_axes))(*args)
  with x64():
    want = loop_stack(linear_ref, _to64(args), in_axes, SIZE)
  _check(got, want, f"in_axes={in_axes}")
  one = jax.make_jaxpr(jax.vmap(linear_one_call, in_axes=in_axes))(*args).jaxpr
  assert _counts(one) == {FWD: 1}


# (logits, labels) in_axes of cross_entropy.
LOGITS_IN_AXES = [(0, 0), (0, None), (None, 0), (1, 1), (-1, 0), (2, -1)]


@pytest.mark.parametrize("in_axes", LOGITS_IN_AXES, ids=str)
def test_logits_vmap_matches_reference(in_axes):
  rng = np.random.default_rng(1)
  z = batched(rng, in_axes[0], SIZE, TOKENS + (V,), lambda s: rand(rng, s, scale=2.0))
  labels = batched(rng, in_axes[1], SIZE, TOKENS, lambda s: labels_for(rng, s, V))
  got = jax.jit(jax.vmap(logits_fn, in_axes=in_axes))(z, labels)
  with x64():
    want = loop_stack(logits_ref, _to64((z, labels)), in_axes, SIZE)
  _check(got, want, f"in_axes={in_axes}")
  one = lambda z, labels: pallax.cross_entropy(z, labels, return_lse=True, **OPTIONS)
  assert _counts(jax.make_jaxpr(jax.vmap(one, in_axes=in_axes))(z, labels).jaxpr) == {FWD: 1}


def test_mean_is_per_example():
  """A "mean" divides by each example's own count of kept tokens (one example all ignored)."""
  rng = np.random.default_rng(2)
  z = rand(rng, (3, 6, V))
  labels = np.array(labels_for(rng, (3, 6), V))
  labels[1] = -100
  labels[2, :4] = -100
  got = jax.jit(jax.vmap(lambda z, labels: pallax.cross_entropy(z, labels)))(z, jnp.asarray(labels))
  with x64():
    want = jnp.stack([reference(z[i].astype(jnp.float64), labels[i]) for i in range(3)])
  assert float(got[1]) == 0.0
  assert_close(got, want, jnp.float32, "per-example mean")


# ----------------------------------------------------------------------------
# Nested vmap.


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_nested_vmap(outer, inner):
  """(x, weight) nested in every mapped / unmapped combination, labels and bias shared."""
  rng = np.random.default_rng(3)
  x = rand(rng, nested_shape(outer, inner, 0, TOKENS + (D,)))
  w = rand(rng, nested_shape(outer, inner, 1, (D, V)), scale=0.5)
  labels, b = labels_for(rng, TOKENS, V), rand(rng, (V,))
  fn = lambda x, w: jnp.stack(linear_one_call(x, w, labels, b))
  close = lambda got, want: assert_close(got, want, jnp.float32, f"{outer} {inner}")
  jaxpr = check_nested_vmap(fn, (x, w), outer, inner, close)
  assert _counts(jaxpr) == {FWD: 1}


def test_nested_vmap_with_labels_against_reference():
  """vmap(vmap) over x and labels (inner) and weight (outer), against the float64 reference."""
  rng = np.random.default_rng(4)
  x = rand(rng, (2, 3) + TOKENS + (D,))
  w = rand(rng, (2, D, V), scale=0.5)
  labels = labels_for(rng, (2, 3) + TOKENS, V)
  f = jax.vmap(
    jax.vmap(lambda x, w, labels: linear(x, w, labels, None), in_axes=(0, None, 0)),
    in_axes=(0, 0, 0),
  )
  got = jax.jit(f)(x, w, labels)
  one = jax.vmap(
    jax.vmap(lambda x, w, labels: linear_one_call(x, w, labels, None), in_axes=(0, None, 0)),
    in_axes=(0, 0, 0),
  )
  assert _counts(jax.make_jaxpr(one)(x, w, labels).jaxpr) == {FWD: 1}
  with x64():
    for i in range(2):
      for j in range(3):
        want = linear_ref(x[i, j].astype(jnp.float64), w[i].astype(jnp.float64), labels[i, j], None)
        _check([g[i, j] for g in got], want, f"example ({i}, {j})")


# ----------------------------------------------------------------------------
# vmap of AD.


def _loss(x, w, labels, b):
  per_token, lse = pallax.linear_cross_entropy(
    x, w, labels, bias=b, reduction="none", return_lse=True, **OPTIONS
  )
  return pallax.linear_cross_entropy(x, w, labels, bias=b, **OPTIONS) + jnp.sum(
    jnp.sin(per_token) + 0.1 * lse
  )


def _loss_ref(x, w, labels, b):
  per_token, lse = linear_reference(
    x, w, labels, bias=b, reduction="none", return_lse=True, **OPTIONS
  )
  return linear_reference(x, w, labels, bias=b, **OPTIONS) + jnp.sum(jnp.sin(per_token) + 0.1 * lse)


def _loss_one_call(x, w, labels, b):
  per_token, lse = linear_one_call(x, w, labels, b)
  return jnp.sum(jnp.sin(per_token) + 0.1 * lse)


GRAD_IN_AXES = [(0, None, 0, None), (None, 0, None, 0), (0, 0, 0, 0), (1, None, 1, None)]


@pytest.mark.parametrize("in_axes", GRAD_IN_AXES, ids=str)
def test_vmap_of_grad(in_axes):
  """Per-example gradients of x, weight and bias against a Python loop and the reference."""
  rng = np.random.default_rng(5)
  args = _linear_args(rng, in_axes)
  g = jax.grad(_loss, (0, 1, 3))
  f = jax.vmap(g, in_axes=in_axes)
  got = jax.jit(f)(*args)
  one = jax.vmap(jax.grad(_loss_one_call, (0, 1, 3)), in_axes=in_axes)
  assert _counts(jax.make_jaxpr(one)(*args).jaxpr) == {FWD: 1, BWD: 1}
  loop = loop_stack(jax.jit(g), args, in_axes, SIZE)
  with x64():
    want = loop_stack(jax.grad(_loss_ref, (0, 1, 3)), _to64(args), in_axes, SIZE)
  for got_, loop_, want_, name in zip(got, loop, want, ("dx", "dweight", "dbias")):
    np.testing.assert_allclose(got_, loop_, rtol=2e-5, atol=2e-6, err_msg=f"{name} vs loop")
    assert_close(got_, want_, jnp.float32, f"{name}, in_axes={in_axes}")


def test_per_example_weight_gradients():
  """The usual per-example gradient: vmap(grad wrt weight) over (x, labels), weight shared."""
  rng = np.random.default_rng(6)
  x, labels = rand(rng, (4, 9, D)), labels_for(rng, (4, 9), V)
  w = rand(rng, (D, V), scale=0.5)
  g = jax.grad(lambda w, x, labels: pallax.linear_cross_entropy(x, w, labels, label_smoothing=0.1))
  got = jax.jit(jax.vmap(g, in_axes=(None, 0, 0)))(w, x, labels)
  assert got.shape == (4, D, V)
  for i in range(4):
    np.testing.assert_allclose(got[i], jax.jit(g)(w, x[i], labels[i]), rtol=2e-5, atol=2e-6)
    with x64():
      want = jax.grad(
        lambda w: linear_reference(x[i].astype(jnp.float64), w, labels[i], label_smoothing=0.1)
      )(w.astype(jnp.float64))
    assert_close(got[i], want, jnp.float32, f"example {i}")


@pytest.mark.parametrize("in_axes", [(0, 0), (None, 0), (0, None)], ids=str)
def test_vmap_of_jvp(in_axes):
  """(weight, its tangent): an unmapped primal with mapped tangents is what jacfwd does."""
  rng = np.random.default_rng(7)
  x, labels, b = rand(rng, TOKENS + (D,)), labels_for(rng, TOKENS, V), rand(rng, (V,))
  w, wd = (batched(rng, ax, SIZE, (D, V), lambda s: rand(rng, s, scale=0.5)) for ax in in_axes)
  f = lambda w, wd: jax.jvp(lambda w: _loss(x, w, labels, b), (w,), (wd,))
  got = jax.jit(jax.vmap(f, in_axes=in_axes))(w, wd)
  one = lambda w, wd: jax.jvp(lambda w: _loss_one_call(x, w, labels, b), (w,), (wd,))
  assert _counts(jax.make_jaxpr(jax.vmap(one, in_axes=in_axes))(w, wd).jaxpr) == {FWD: 1, JVP: 1}
  with x64():
    x64_, b64 = x.astype(jnp.float64), b.astype(jnp.float64)
    ref = lambda w, wd: jax.jvp(lambda w: _loss_ref(x64_, w, labels, b64), (w,), (wd,))
    want = loop_stack(ref, _to64((w, wd)), in_axes, SIZE)
  for g, w_, name in zip(got, want, ("primal", "tangent")):
    assert_close(g, w_, jnp.float32, name)


@pytest.mark.parametrize("mode", ["forward", "grad", "jvp"])
@pytest.mark.parametrize("in_axes", LINEAR_IN_AXES, ids=str)
def test_vmap_is_one_primitive(in_axes, mode):
  rng = np.random.default_rng(8)
  args = _linear_args(rng, in_axes, size=5)
  f = {
    "forward": linear_one_call,
    "grad": jax.grad(_loss_one_call, (0, 1, 3)),
    "jvp": lambda x, w, labels, b: jax.jvp(
      lambda x, w, b: _loss_one_call(x, w, labels, b), (x, w, b), (x, w, b)
    ),
  }[mode]
  expected = {"forward": {FWD: 1}, "grad": {FWD: 1, BWD: 1}, "jvp": {FWD: 1, JVP: 1}}[mode]
  assert _counts(jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args).jaxpr) == expected


# ----------------------------------------------------------------------------
# The interpreted kernels under vmap.


@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_kernels_under_vmap(path):
  """A mapped weight (folded into groups) and mapped logits, forward and grad, on a kernel."""
  rng = np.random.default_rng(9)
  in_axes = (0, 0, 0, 0)
  args = _linear_args(rng, in_axes, size=2)
  z = rand(rng, (2,) + TOKENS + (V,), scale=2.0)
  labels = labels_for(rng, (2,) + TOKENS, V)
  grad = jax.grad(_loss, (0, 1, 3))
  with on_path(path):
    got = jax.jit(jax.vmap(linear, in_axes=in_axes))(*args)
    got_grad = jax.jit(jax.vmap(grad, in_axes=in_axes))(*args)
    got_logits = jax.jit(jax.vmap(logits_fn))(z, labels)
  with x64():
    want = loop_stack(linear_ref, _to64(args), in_axes, 2)
    want_grad = loop_stack(jax.grad(_loss_ref, (0, 1, 3)), _to64(args), in_axes, 2)
    want_logits = loop_stack(logits_ref, _to64((z, labels)), (0, 0), 2)
  _check(got, want, f"{path} linear")
  _check(got_logits, want_logits, f"{path} logits")
  for g, w, name in zip(got_grad, want_grad, ("dx", "dweight", "dbias")):
    assert_close(g, w, jnp.float32, f"{path} {name}")
