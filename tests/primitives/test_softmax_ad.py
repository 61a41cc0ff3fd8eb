"""softmax / log_softmax AD: vjp, jvp, jacfwd, jacrev and Hessian-vector products.

Against the float64 reference, on the XLA path and both interpreted kernels,
with and without ``where=``, with the executor's configs and with multi-block
configs (the online reduction in the forward, tangent and backward kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.kernels.softmax import xla as softmax_xla
from tests.helpers import FLOAT_DTYPES, assert_close, on_path, rand, x64
from tests.primitives.softmax_reference import (
  CONFIGS,
  OPS,
  assert_matches,
  config_id,
  pallax_op,
  random_mask,
  reference,
)

CASES = ["softmax", "softmax where", "log_softmax", "log_softmax where"]


# Every dtype on one shape; float32 also on a batch of short rows.
VJP_CASES = [(dtype, (37, 300)) for dtype in FLOAT_DTYPES] + [(jnp.float32, (2, 5, 200))]


@pytest.mark.parametrize("pc", CONFIGS, ids=config_id)
@pytest.mark.parametrize(
  "dtype, shape", VJP_CASES, ids=[f"{jnp.dtype(d).name}-{s}" for d, s in VJP_CASES]
)
def test_vjp(pc, dtype, shape):
  path, config = pc
  rng = np.random.default_rng(1)
  x, mask, dy = rand(rng, shape, dtype, scale=2.0), random_mask(rng, shape), rand(rng, shape, dtype)
  with on_path(path):
    got = jax.jit(
      lambda x, dy: [
        jax.vjp(lambda x: pallax_op(op, config)(x, where=w), x)[1](dy)[0]
        for op in OPS
        for w in (None, mask)
      ]
    )(x, dy)
  with x64():
    x64_, dy64 = x.astype(jnp.float64), dy.astype(jnp.float64)
    want = [
      jax.vjp(lambda x: reference(x, where=w, op=op), x64_)[1](dy64)[0]
      for op in OPS
      for w in (None, mask)
    ]
  for g, w, what in zip(got, want, CASES):
    assert g.dtype == dtype
    assert_close(g, w, dtype, f"dx of {what}")


@pytest.mark.parametrize("pc", CONFIGS, ids=config_id)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_jvp(pc, dtype):
  path, config = pc
  rng = np.random.default_rng(2)
  shape = (37, 300)
  x, xd, mask = rand(rng, shape, dtype, scale=2.0), rand(rng, shape, dtype), random_mask(rng, shape)
  with on_path(path):
    got = jax.jit(
      lambda x, xd: [
        jax.jvp(lambda x: pallax_op(op, config)(x, where=w), (x,), (xd,))
        for op in OPS
        for w in (None, mask)
      ]
    )(x, xd)
  with x64():
    want = [
      jax.jvp(
        lambda x: reference(x, where=w, op=op), (x.astype(jnp.float64),), (xd.astype(jnp.float64),)
      )
      for op in OPS
      for w in (None, mask)
    ]
  for (y, yd), (y_ref, yd_ref), what in zip(got, want, CASES):
    assert yd.dtype == dtype
    assert_matches(y, y_ref, dtype, f"primal of {what}")
    assert_close(yd, yd_ref, dtype, f"tangent of {what}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("pc", CONFIGS, ids=config_id)
def test_jacobians_and_hessian_vector_products(pc, op):
  path, config = pc
  rng = np.random.default_rng(3)
  shape = (2, 130)  # two column blocks on the multi-block configs
  x, c, v = rand(rng, shape, scale=2.0), rand(rng, shape), rand(rng, shape)
  mask = random_mask(rng, shape)
  ours = lambda x: pallax_op(op, config)(x, where=mask)
  ref = lambda x: reference(x, where=mask, op=op)

  def loss(f, c):  # finite where log_softmax is -inf (masked entries)
    return lambda x: jnp.sum(jnp.where(mask, jnp.sin(jnp.where(mask, f(x), 0)), 0) * c)

  with on_path(path):
    jf = jax.jit(jax.jacfwd(ours))(x)
    jr = jax.jit(jax.jacrev(ours))(x)
    hvp_fwd = jax.jit(lambda x: jax.jvp(jax.grad(loss(ours, c)), (x,), (v,))[1])(x)
    hvp_rev = jax.jit(jax.grad(lambda x: jnp.vdot(jax.grad(loss(ours, c))(x), v)))(x)
  with x64():
    x64_, v64, c64 = (a.astype(jnp.float64) for a in (x, v, c))
    jac_ref = jax.jacrev(ref)(x64_)
    hvp_ref = jax.jvp(jax.grad(loss(ref, c64)), (x64_,), (v64,))[1]
  for got, name in ((jf, "jacfwd"), (jr, "jacrev")):
    assert_close(got, jac_ref, jnp.float32, name)
  for got, name in ((hvp_fwd, "forward-over-reverse hvp"), (hvp_rev, "reverse-over-reverse hvp")):
    assert_close(got, hvp_ref, jnp.float32, name)


@pytest.mark.parametrize("op", OPS)
def test_one_kernel_each_way(op):
  """grad is one forward and one backward kernel; jvp one forward and one tangent kernel."""
  x = rand(np.random.default_rng(4), (8, 128))
  f = lambda x: pallax_op(op)(x)
  grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(x).jaxpr
  jvp = jax.make_jaxpr(lambda x: jax.jvp(f, (x,), (x,)))(x).jaxpr
  tangent = {"softmax": "softmax_bwd", "log_softmax": "log_softmax_jvp"}[op]
  backward = {"softmax": "softmax_bwd", "log_softmax": "log_softmax_bwd"}[op]
  names = lambda jaxpr: sorted(
    e.primitive.name for e in jaxpr.eqns if "softmax" in e.primitive.name
  )
  assert names(grad) == sorted([f"{op}_fwd", backward])
  assert names(jvp) == sorted([f"{op}_fwd", tangent])


@pytest.mark.parametrize("form", ["shared", "recomputed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_both_forms_of_the_log_softmax_derivatives(dtype, form, monkeypatch):
  """log_softmax's XLA tangent and backward share the forward's exp or recompute it by size.

  Both forms (``kernels/softmax/xla.py``'s ``CACHE_SIZED_ELEMENTS``): the
  gradient, the tangent and a forward-over-reverse HVP, masked and not,
  against float64.
  """
  monkeypatch.setattr(softmax_xla, "CACHE_SIZED_ELEMENTS", 1 << 62 if form == "shared" else 0)
  jax.clear_caches()  # programs traced under the other form must not be reused
  rng = np.random.default_rng(7)
  shape = (6, 150)
  x, t, c = rand(rng, shape, dtype, scale=2.0), rand(rng, shape, dtype), rand(rng, shape)
  mask = random_mask(rng, shape)

  def derivatives(f, x, t, c):
    # Linear in the output: no cotangent computed from a rounded 16-bit output.
    loss = lambda x: jnp.sum(jnp.where(mask, f(x), 0).astype(c.dtype) * c)
    return [jax.grad(loss)(x), jax.jvp(f, (x,), (t,))[1], jax.jvp(jax.grad(loss), (x,), (t,))[1]]

  for where in (None, mask):
    ours = lambda x: pallax.log_softmax(x, where=where)
    got = jax.jit(lambda x, t, c: derivatives(ours, x, t, c))(x, t, c)
    with x64():
      ref = lambda x: reference(x, where=where, op="log_softmax")
      want = derivatives(ref, *(a.astype(jnp.float64) for a in (x, t, c)))
    for g, w, name in zip(got, want, ("gradient", "tangent", "hvp")):
      assert_close(g, w, dtype, f"{name} ({form}, where={where is not None})")
  jax.clear_caches()
