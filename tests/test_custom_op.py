"""pallax.custom_op: users' kernels as pallax ops, and examples/swiglu.py end to end.

In this process (no ``TRITON_INTERPRET``) the example's raw Triton kernels are
only lowered for cuda; its numerics here are the XLA program's, against a
float64 reference written below. The raw kernels' numerics run under Triton's
interpreter in ``triton_raw/interpreted_custom_op.py``. A small Pallas
kernel declared here runs interpreted (``pallax.interpret``). Sharding tests
use the 8 fake CPU devices of ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.interpreters import batching
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from pallax.op import Dims
from pallax.triton_raw import compute_capability
from tests.conftest import PLATFORM
from tests.helpers import (
  CALL_TARGET,
  NESTED_IN_AXES,
  as64,
  assert_close,
  check_nested_vmap,
  loop_stack,
  mesh_4x2,
  nested_shape,
  primitive_names,
  rand,
  x64,
)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples import swiglu as example  # noqa: E402
from pallax.verify import sweep  # noqa: E402

DTYPES = (jnp.float32, jnp.bfloat16)
SHAPES = [(13, 40), (2, 5, 24), (7,)]


def swiglu64(x, y):
  """The SwiGLU epilogue in float64, written independently of the example."""
  x, y = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
  return x / (1.0 + jnp.exp(-x)) * y


def _inputs(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  return rand(rng, shape, dtype), rand(rng, shape, dtype), rng


def _count(jaxpr, name: str) -> int:
  return primitive_names(jaxpr).count(name)


# ----------------------------------------------------------------------------
# examples/swiglu.py on its XLA program.


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_example_forward(shape, dtype):
  x, y, _ = _inputs(shape, dtype, 0)
  out = jax.jit(example.swiglu)(x, y)
  assert out.shape == shape and out.dtype == dtype
  with x64():
    assert_close(out, swiglu64(*as64(x, y)), dtype, "forward")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_example_grad_and_jvp(shape, dtype):
  x, y, rng = _inputs(shape, dtype, 1)
  g, tx, ty = (rand(rng, shape, dtype) for _ in range(3))
  _, vjp = jax.vjp(example.swiglu, x, y)
  dx, dy = jax.jit(vjp)(g)
  _, tangent = jax.jit(lambda *a: jax.jvp(example.swiglu, a[:2], a[2:]))(x, y, tx, ty)
  assert dx.dtype == dy.dtype == tangent.dtype == dtype
  with x64():
    _, vjp64 = jax.vjp(swiglu64, *as64(x, y))
    dx64, dy64 = vjp64(*as64(g))
    _, t64 = jax.jvp(swiglu64, tuple(as64(x, y)), tuple(as64(tx, ty)))
    assert_close(dx, dx64, dtype, "dx")
    assert_close(dy, dy64, dtype, "dy")
    assert_close(tangent, t64, dtype, "jvp")


def test_example_ad_primitives():
  """grad: the backward primitive only (the forward's output is unused); jvp: the forward."""
  x, y, _ = _inputs((6, 32), jnp.float32, 2)
  loss = lambda x, y: jnp.sum(example.swiglu(x, y) ** 2)
  grad = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, y)
  assert _count(grad, "swiglu_fwd") == 1 and _count(grad, "swiglu_bwd") == 1
  assert "custom_vjp_call" not in " ".join(primitive_names(grad))
  jvp = jax.make_jaxpr(lambda x, y: jax.jvp(example.swiglu, (x, y), (y, x)))(x, y)
  assert _count(jvp, "swiglu_fwd") == 1 and _count(jvp, "swiglu_bwd") == 0
  # Second order (a Hessian-vector product) differentiates the XLA programs.
  hvp = jax.jvp(jax.grad(loss), (x, y), (y, x))[1]
  with x64():
    hvp64 = jax.jvp(jax.grad(lambda x, y: jnp.sum(swiglu64(x, y) ** 2)), as64(x, y), as64(y, x))[1]
  assert_close(hvp, hvp64, jnp.float32, "hvp")


VMAP_IN_AXES = [(0, 0), (1, None), (None, 0), (2, 1)]


@pytest.mark.parametrize("in_axes", VMAP_IN_AXES, ids=str)
def test_example_vmap_is_one_kernel(in_axes):
  rng = np.random.default_rng(3)
  size, per = 3, (4, 16)
  args = [
    rand(rng, per) if ax is None else jnp.moveaxis(rand(rng, (size, *per)), 0, ax) for ax in in_axes
  ]
  f = jax.vmap(example.swiglu, in_axes=in_axes)
  got = jax.jit(f)(*args)
  want = loop_stack(example.swiglu, args, in_axes, size)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  jaxpr = jax.make_jaxpr(f)(*args)
  assert _count(jaxpr, "swiglu_fwd") == 1
  loss = lambda *a: jnp.sum(f(*a))
  grads = jax.make_jaxpr(jax.grad(loss, (0, 1)))(*args)
  assert _count(grads, "swiglu_bwd") == 1


@pytest.mark.parametrize("outer, inner", NESTED_IN_AXES, ids=str)
def test_example_nested_vmap(outer, inner):
  rng = np.random.default_rng(4)
  args = [rand(rng, nested_shape(outer, inner, i, (5, 8))) for i in range(2)]
  close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  jaxpr = check_nested_vmap(example.swiglu, args, outer, inner, close)
  assert _count(jaxpr, "swiglu_fwd") == 1


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
@pytest.mark.parametrize("spec", [P("a"), P("a", "b"), P(None, None, "a"), P(("a", "b"))], ids=str)
def test_example_sharded_jit_has_no_all_gather(spec, axis_type):
  mesh = mesh_4x2(axis_type)
  x, y, rng = _inputs((8, 4, 200), jnp.float32, 5)
  c = rand(rng, x.shape)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
  xs, ys, cs = put(x), put(y), put(c)
  loss = lambda x, y, c: jnp.sum(example.swiglu(x, y) * c)
  fwd, grad = jax.jit(example.swiglu), jax.jit(jax.grad(loss, (0, 1)))
  out = fwd(xs, ys)
  dx, dy = grad(xs, ys, cs)
  hlo = fwd.lower(xs, ys).compile().as_text() + grad.lower(xs, ys, cs).compile().as_text()
  assert "all-gather" not in hlo
  assert out.sharding.is_equivalent_to(xs.sharding, out.ndim)
  assert dx.sharding.is_equivalent_to(xs.sharding, dx.ndim)
  with x64():
    _, vjp64 = jax.vjp(swiglu64, *as64(x, y))
    dx64, dy64 = vjp64(*as64(c))
    assert_close(out, swiglu64(*as64(x, y)), jnp.float32, "forward")
    assert_close(dx, dx64, jnp.float32, "dx")
    assert_close(dy, dy64, jnp.float32, "dy")


@pytest.mark.compilers
@pytest.mark.lowering
@pytest.mark.parametrize("cc", [90, 80])
def test_example_lowers_for_cuda_as_raw_triton(cc):
  x = jax.ShapeDtypeStruct((3, 40, 96), jnp.bfloat16)
  row = jax.ShapeDtypeStruct((3, 96), jnp.bfloat16)
  loss = lambda x, y: jnp.sum(example.swiglu(x, y).astype(jnp.float32) ** 2)
  # Fresh functions per cc: JAX caches a function's lowering, and the target
  # compute capability is not part of its key.
  cases = {
    "fwd": (lambda x, y: example.swiglu(x, y), (x, x), 1),
    "vmap": (lambda x, y: jax.vmap(example.swiglu, (1, None))(x, y), (x, row), 1),
    "value_and_grad": (lambda x, y: jax.value_and_grad(loss, (0, 1))(x, y), (x, x), 2),
    "vmap_grad": (lambda x, y: jax.vmap(jax.grad(loss, (0, 1)), (1, None))(x, y), (x, row), 2),
  }
  with compute_capability(cc):
    for name, (fn, args, calls) in cases.items():
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert text.count("triton_kernel_call") == calls, name


def test_example_executor():
  x, y, _ = _inputs((6, 32), jnp.float32, 6)
  report = str(pallax.explain(example.swiglu, x, y))
  assert "swiglu_fwd" in report and ("xla" if PLATFORM == "cpu" else "triton_raw") in report
  if PLATFORM == "cpu":
    # Without Triton's interpreter a pinned raw config cannot run on the CPU: it says so.
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
      example.swiglu(x, y, config=example.SwigluConfig())
  with pytest.raises(TypeError, match="SwigluConfig"):
    example.swiglu(x, y, config=pallax.NormConfig(block_rows=4))
  from pallax.executor.registry import kernel_spec

  for name in ("swiglu_fwd", "swiglu_bwd"):
    spec = kernel_spec(name)
    avals = [jax.ShapeDtypeStruct((1000, 3000), jnp.bfloat16)] * 2
    best = spec.heuristic(avals, "cuda", batched=False)
    assert best.implementation == "triton_raw"
    assert spec.supports(avals, "cuda", best, batched=False) is None
    found = spec.candidates(avals, "cuda", batched=False)
    assert len(found) > 3 and all(
      spec.supports(avals, "cuda", c, batched=False) is None for c in found
    )
    # The op has no Pallas kernel: a "pallas" config is refused, with the reason.
    pallas = dataclasses.replace(best, implementation="pallas")
    assert "no triton kernel" in spec.supports(avals, "cuda", pallas, batched=False)
    # A vmapped call that could not be folded has a grid-batch axis, which a
    # raw Triton kernel cannot take: the executor runs the reference, saying why.
    grid = [jax.ShapeDtypeStruct((3, 1000, 3000), jnp.bfloat16)] * 2
    assert "cannot be vmapped" in spec.supports(grid, "cuda", best, batched=True)
    assert spec.supports(grid, "cuda", best, batched=False) is None


def test_example_verify_cases():
  assert "swiglu" not in sweep.LIBRARY_OPS  # verify() sweeps it only when asked
  assert sweep.OPS["swiglu"].fn is example.swiglu
  cases = sweep.cases(["swiglu"], quick=True)
  assert {c.stage for c in cases} == {"fwd", "bwd", "jvp"}
  kernels = {e.primitive.name for c in cases for e in sweep.kernel_calls_of(c.id)}
  assert kernels == {"swiglu_fwd", "swiglu_bwd"}
  assert "swiglu_fwd" not in sweep.library_kernels()
  jobs = sweep.jobs_for(cases, [pallax.verify.TARGETS["h100"]])
  assert jobs and all(j.config["implementation"] == "triton_raw" for j in jobs)


# ----------------------------------------------------------------------------
# A Pallas kernel as a custom op: out = x * w (rows scaled per column).


@dataclasses.dataclass(frozen=True)
class ScaleConfig(pallax.KernelConfig):
  block_rows: int = 8
  num_warps: int = 2


def _scale_heuristic(avals, target, **params):
  return ScaleConfig(block_rows=8)


SCALE_SPACE = pallax.ConfigSpace(ScaleConfig, _scale_heuristic)


def _scale_block(x_ref, w_ref, o_ref):
  o_ref[...] = (x_ref[...].astype(jnp.float32) * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _scale_pallas(x, w, *, config, interpret, broadcast_w: bool):
  """Pallas-Triton: a grid over row blocks; ``w`` (cols,) or (1,) broadcast to the block."""
  rows, cols = x.shape
  br = config.block_rows
  w = jnp.broadcast_to(w, (cols,)) if broadcast_w else w
  return pl.pallas_call(
    _scale_block,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    grid=(pl.cdiv(rows, br),),
    in_specs=[
      pl.BlockSpec((br, cols), lambda i: (i, 0)),
      pl.BlockSpec((1, cols), lambda i: (0, 0)),
    ],
    out_specs=pl.BlockSpec((br, cols), lambda i: (i, 0)),
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
  )(x, w.reshape(1, cols))


def _grid_scale_pallas(x, w, *, config, interpret):
  """The same with a leading batch axis on x (B, R, C) and w (B, C): grid (B, row blocks)."""
  b, rows, cols = x.shape
  br = config.block_rows
  return pl.pallas_call(
    _scale_block,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    grid=(b, pl.cdiv(rows, br)),
    in_specs=[
      pl.BlockSpec((None, br, cols), lambda n, i: (n, i, 0)),
      pl.BlockSpec((None, 1, cols), lambda n, i: (n, 0, 0)),
    ],
    out_specs=pl.BlockSpec((None, br, cols), lambda n, i: (n, i, 0)),
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
  )(x, w.reshape(b, 1, cols))


_scale_ref = lambda x, w: (x.astype(jnp.float32) * w.astype(jnp.float32)).astype(x.dtype)

# Column weights: vmap folds into rows (w unmapped) or columns (w mapped).
scale = pallax.custom_op(
  "test_custom_scale",
  reference=_scale_ref,
  kernels={"triton": lambda x, w, **kw: _scale_pallas(x, w, broadcast_w=False, **kw)},
  config=SCALE_SPACE,
  dims="r c, c -> r c",
)
# One scalar weight of shape (1,): its factor is in no result, so a mapped
# weight cannot be folded: the call gets a grid axis (vmap of pallas_call).
scale1 = pallax.custom_op(
  "test_custom_scale1",
  reference=_scale_ref,
  kernels={"triton": lambda x, w, **kw: _scale_pallas(x, w, broadcast_w=True, **kw)},
  config=SCALE_SPACE,
  dims="r c, o -> r c",
)
# The kernel takes the leading batch axis itself.
grid_scale = pallax.custom_op(
  "test_custom_grid_scale",
  reference=_scale_ref,
  kernels={"triton": _grid_scale_pallas},
  config=SCALE_SPACE,
  dims="r c, c -> r c",
  batching="grid",
)


def _scale64(x, w):
  return jnp.asarray(x, jnp.float64) * jnp.asarray(w, jnp.float64)


@pytest.mark.parametrize("path", ["xla", "triton"])
@pytest.mark.parametrize(
  "op, w_shape, in_axes, batched",
  [
    (scale, (16,), (0, None), False),
    (scale, (16,), (None, 0), False),
    (scale, (16,), (1, 0), False),
    (scale1, (1,), (0, 0), True),
    (scale1, (1,), (None, 0), True),
    (grid_scale, (16,), (0, None), True),
    (grid_scale, (16,), (1, 0), True),
  ],
  ids=lambda v: getattr(v, "name", str(v)),
)
def test_pallas_op_vmap_is_one_kernel(path, op, w_shape, in_axes, batched):
  rng = np.random.default_rng(7)
  size, x_shape = 4, (12, 16)  # columns folded with 4 examples: 64, a power of two
  args = [
    rand(rng, s) if ax is None else jnp.moveaxis(rand(rng, (size, *s)), 0, ax)
    for s, ax in zip((x_shape, w_shape), in_axes)
  ]
  f = jax.vmap(op, in_axes=in_axes)
  ctx = lambda: pallax.interpret("triton") if path == "triton" else contextlib.nullcontext()
  with ctx():
    got = jax.jit(f)(*args)
    want = loop_stack(op, args, in_axes, size)
    plain = jax.jit(op)(*(a if ax is None else jnp.take(a, 0, ax) for a, ax in zip(args, in_axes)))
  with x64():
    ref = loop_stack(_scale64, as64(*args), in_axes, size)
  assert_close(got, ref, jnp.float32, "vmap")
  assert_close(want, ref, jnp.float32, "loop")
  assert_close(plain, ref[0], jnp.float32, "unbatched")
  eqns = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive is op.primitive]
  assert len(eqns) == 1 and eqns[0].params["batched"] is batched
  # Nested: still one kernel.
  nested = jax.vmap(f, in_axes=in_axes)
  stacked = [a if ax is None else jnp.stack([a, 2 * a], ax) for a, ax in zip(args, in_axes)]
  with ctx():
    got2 = jax.jit(nested)(*stacked)
  with x64():
    ref2 = loop_stack(lambda *a: loop_stack(_scale64, a, in_axes, size), as64(*stacked), in_axes, 2)
  assert_close(got2, ref2, jnp.float32, "nested vmap")
  assert _count(jax.make_jaxpr(nested)(*stacked), op.name) == 1


@pytest.mark.lowering
@pytest.mark.parametrize(
  "op, w_shape, in_axes", [(scale, (16,), (0, 0)), (scale1, (1,), (None, 0))]
)
def test_pallas_op_lowers_for_cuda(op, w_shape, in_axes):
  x = jax.ShapeDtypeStruct((4, 12, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((4, *w_shape), jnp.float32)
  args = (x if in_axes[0] is not None else jax.ShapeDtypeStruct((12, 16), jnp.float32), w)
  text = (
    jax.jit(jax.vmap(op, in_axes=in_axes))
    .trace(*args)
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  assert text.count(CALL_TARGET["cuda"]) == 1


def test_pallas_op_grad_through_reference():
  """No jvp declared: the kernel computes the output, jax.jvp of the reference the tangent."""
  rng = np.random.default_rng(8)
  x, w, c = rand(rng, (12, 16)), rand(rng, (16,)), rand(rng, (12, 16))
  loss = lambda x, w: jnp.sum(scale(x, w) * c)
  with pallax.interpret("triton"):
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    _, t = jax.jvp(scale, (x, w), (c, w))
  with x64():
    x64_, w64, c64 = as64(x, w, c)
    assert_close(dx, c64 * w64, jnp.float32, "dx")
    assert_close(dw, jnp.sum(c64 * x64_, 0), jnp.float32, "dw")
    assert_close(t, c64 * w64 + x64_ * w64, jnp.float32, "jvp")


# ----------------------------------------------------------------------------
# XLA-only ops: AD declarations, outputs, params, batching rules, sharding.


def _cube_jvp(primals, tangents, out, *, alpha):
  (x,), (t,) = primals, tangents
  return 3 * alpha * x * x * t


cube = pallax.custom_op(
  "test_custom_cube",
  reference=lambda x, *, alpha: alpha * x**3,
  dims="... -> ...",
  jvp=_cube_jvp,
)


def test_jvp_rule_linear_in_tangents():
  x = jnp.linspace(-2.0, 2.0, 7)
  assert_close(cube(x, alpha=2.0), 2 * x**3, jnp.float32, "forward")
  g = jax.grad(lambda x: jnp.sum(cube(x, alpha=2.0)))(x)
  assert_close(g, 6 * x**2, jnp.float32, "grad")
  h = jax.jacfwd(jax.grad(lambda x: jnp.sum(cube(x, alpha=2.0))))(x)
  assert_close(h, jnp.diag(12 * x), jnp.float32, "hessian")
  jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(lambda x: cube(x, alpha=2.0))))(x)
  assert _count(jaxpr, "test_custom_cube") == 1


def _softplus_fwd(x):
  """softplus(x) and the residual sigmoid(x)."""
  return jax.nn.softplus(x), jax.nn.sigmoid(x)


softplus = pallax.custom_op(
  "test_custom_softplus",
  reference=_softplus_fwd,
  dims="... c -> ... c, ... c",
  jvp=pallax.ResidualJVP(
    bwd=pallax.KernelStage(lambda x, s, g: g * s),
    residuals=1,
  ),
)


def test_residual_jvp_with_residuals():
  rng = np.random.default_rng(9)
  x, v = rand(rng, (5, 8)), rand(rng, (5, 8))
  assert softplus(x).shape == (5, 8)  # the residual is hidden
  loss = lambda x: jnp.sum(softplus(x) ** 2)
  grad = jax.make_jaxpr(jax.grad(loss))(x)
  names = primitive_names(grad)
  assert "test_custom_softplus_fwd" in names and "test_custom_softplus_bwd" in names
  want_loss = lambda x: jnp.sum(jax.nn.softplus(x) ** 2)
  assert_close(jax.grad(loss)(x), jax.grad(want_loss)(x), jnp.float32, "grad")
  assert_close(jax.jvp(softplus, (x,), (v,))[1], jax.nn.sigmoid(x) * v, jnp.float32, "jvp")
  # Second order: the residual's tangent (d sigmoid) matters in the HVP.
  hvp = jax.jvp(jax.grad(loss), (x,), (v,))[1]
  assert_close(hvp, jax.jvp(jax.grad(want_loss), (x,), (v,))[1], jnp.float32, "hvp")
  batched = jax.vmap(jax.grad(loss))(jnp.stack([x, 2 * x]))
  assert_close(batched[1], jax.grad(want_loss)(2 * x), jnp.float32, "vmap of grad")


linear_scale = pallax.custom_op(
  "test_custom_linear_scale",
  reference=lambda x, *, alpha: alpha * x,
  dims="... -> ...",
  jvp=pallax.ResidualJVP(tangent=pallax.KernelStage(lambda x, t, *, alpha: alpha * t)),
)


def test_residual_jvp_self_transposed_tangent():
  x = jnp.arange(6.0)
  assert_close(
    jax.grad(lambda x: jnp.sum(linear_scale(x, alpha=3.0)))(x), 3 + 0 * x, jnp.float32, ""
  )
  assert_close(jax.jvp(lambda x: linear_scale(x, alpha=3.0), (x,), (x,))[1], 3 * x, jnp.float32, "")


pair = pallax.custom_op(
  "test_custom_pair",
  reference=lambda x, y: (x + y, x * y),
  dims="... c, ... c -> ... c, ... c",
)


def test_multiple_results_and_vmap():
  rng = np.random.default_rng(10)
  x, y = rand(rng, (3, 4, 8)), rand(rng, (4, 8))
  s, p = pair(x[0], y)
  assert_close(s, x[0] + y, jnp.float32, "sum")
  assert_close(p, x[0] * y, jnp.float32, "product")
  s, p = jax.vmap(pair, (0, None))(x, y)
  assert_close(p, x * y, jnp.float32, "vmap")
  assert _count(jax.make_jaxpr(jax.vmap(pair, (0, None)))(x, y), "test_custom_pair") == 1


# The same op declared with a pallax.op.Dims, a dims callable and its own abstract eval.
fixed_scale = pallax.custom_op(
  "test_custom_fixed_scale",
  reference=_scale_ref,
  dims=Dims(operands=(("r", "c"), ("c",)), results=(("r", "c"),)),
)
called_scale = pallax.custom_op(
  "test_custom_called_scale",
  reference=_scale_ref,
  dims=lambda x, w: Dims(operands=(("r", "c"), ("c",)), results=(("r", "c"),)),
  abstract_eval=lambda x, w: jax.ShapeDtypeStruct(x.shape, x.dtype),
)


@pytest.mark.parametrize("op", [fixed_scale, called_scale], ids=lambda op: op.name)
@pytest.mark.parametrize("in_axes", [(0, None), (0, 0), (None, 1)], ids=str)
def test_dims_objects_and_callables(op, in_axes):
  rng = np.random.default_rng(14)
  size, shapes = 3, ((5, 8), (8,))
  args = [
    rand(rng, s) if ax is None else jnp.moveaxis(rand(rng, (size, *s)), 0, ax)
    for s, ax in zip(shapes, in_axes)
  ]
  f = jax.vmap(op, in_axes=in_axes)
  with x64():
    want = loop_stack(_scale64, as64(*args), in_axes, size)
  assert_close(f(*args), want, jnp.float32, "vmap")
  eqns = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive is op.primitive]
  assert len(eqns) == 1 and eqns[0].params["batched"] is False  # folded into r or c
  mesh = mesh_4x2()
  xs = jax.device_put(rand(rng, (8, 8)), NamedSharding(mesh, P("a", "b")))
  w = rand(rng, (8,))
  assert "all-gather" not in jax.jit(op).lower(xs, w).compile().as_text()


def _front_rule(prim, args, dims, **params):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
  outs = prim.bind(*args, **params)
  return outs, [0] * len(outs)


front = pallax.custom_op(
  "test_custom_front",
  reference=lambda x, y, *, power: x * y**power,
  dims="... c, ... c -> ... c",
  batching=_front_rule,
)


def test_batching_rule_callable_and_params():
  rng = np.random.default_rng(11)
  x, y = rand(rng, (3, 8)), rand(rng, (8,))
  got = jax.vmap(lambda x: front(x, y, power=2))(x)
  assert_close(got, x * y**2, jnp.float32, "vmap")
  with pytest.raises(TypeError, match="hashable"):
    front(x, x, power=[2])
  with pytest.raises(TypeError, match="static"):
    front(x, x, power=jnp.ones(()))
  with pytest.raises(ValueError, match="reserved"):
    front(x, x, batched=True)


rownorm = pallax.custom_op(
  "test_custom_rownorm",
  reference=lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True),
  dims="r h -> r h",
  replicated=("h",),
)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=str)
def test_replicated_factor_is_gathered_not_split(axis_type):
  mesh = mesh_4x2(axis_type)
  x = rand(np.random.default_rng(12), (8, 16))
  want = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  rows = jax.device_put(x, NamedSharding(mesh, P("a")))
  cols = jax.device_put(x, NamedSharding(mesh, P(None, "a")))
  f = jax.jit(rownorm)
  assert "all-gather" not in f.lower(rows).compile().as_text()
  # vmap folds into the rows, never the replicated h.
  batched = jax.vmap(rownorm, in_axes=1, out_axes=1)
  eqn = next(
    e for e in jax.make_jaxpr(batched)(x[:, None]).jaxpr.eqns if e.primitive.name == rownorm.name
  )
  assert eqn.params["batched"] is False and eqn.invars[0].aval.shape == (8, 16)
  assert_close(batched(x[:, None])[:, 0], want, jnp.float32, "vmap")
  assert_close(f(rows), want, jnp.float32, "rows sharded")
  assert_close(f(cols), want, jnp.float32, "hidden sharded")


def test_shard_map():
  mesh = mesh_4x2()
  x, y, _ = _inputs((8, 16), jnp.float32, 13)
  f = jax.shard_map(example.swiglu, mesh=mesh, in_specs=(P("a"), P("a")), out_specs=P("a"))
  with x64():
    want = swiglu64(*as64(x, y))
  assert_close(jax.jit(f)(x, y), want, jnp.float32, "shard_map")


# ----------------------------------------------------------------------------
# Declarations and calls that are wrong: clear errors naming the argument.

_ref = lambda x: x


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(name="not a name"), ValueError, "name must be an identifier"),
    (dict(name="swiglu"), ValueError, "already registered"),
    (dict(name="test_custom_cube"), ValueError, "already registered"),
    (dict(reference=None), TypeError, "reference must be callable"),
    (dict(dims="x"), ValueError, "dims: expected 'operands -> results'"),
    (dict(dims="c ... -> c"), ValueError, "'...' may only lead"),
    (dict(dims="c c -> c"), ValueError, "one dim of an array"),
    (dict(dims="_c -> _c"), ValueError, "not starting with '_'"),
    (dict(dims=3), TypeError, "dims must be a string"),
    (dict(replicated=("h",)), ValueError, "replicated: \\['h'\\] name no factor"),
    (dict(kernels={"cuda": _ref}, config=SCALE_SPACE), ValueError, "kernels: unknown backend"),
    (dict(kernels={"triton": 3}, config=SCALE_SPACE), TypeError, "kernels\\['triton'\\]"),
    (dict(kernels=[_ref]), TypeError, "kernels must be a mapping"),
    (dict(kernels={"triton": _ref}), ValueError, "config: an op with kernels"),
    (dict(config=SCALE_SPACE), ValueError, "config: given without kernels"),
    (dict(kernels={"triton": _ref}, config=ScaleConfig), TypeError, "config must be a pallax"),
    (dict(batching="loop"), ValueError, "batching must be"),
    (dict(jvp=3), TypeError, "jvp must be None"),
    (dict(jvp=pallax.ResidualJVP()), ValueError, "needs a bwd stage"),
    (dict(jvp=pallax.ResidualJVP(bwd=_ref)), TypeError, "ResidualJVP.bwd must be"),
    (
      dict(jvp=pallax.ResidualJVP(bwd=pallax.KernelStage(_ref), residuals=1)),
      ValueError,
      "leaves no output",
    ),
    (dict(abstract_eval="f32"), TypeError, "abstract_eval must be callable"),
    (
      dict(kernels={"triton": _ref}, config=SCALE_SPACE, own_configs={"mosaic_tpu": SCALE_SPACE}),
      ValueError,
      "own_configs: 'mosaic_tpu' is not one of the kernels",
    ),
    (
      dict(kernels={"triton": _ref}, config=SCALE_SPACE, own_configs={"triton": ScaleConfig}),
      TypeError,
      "own_configs\\['triton'\\] must be a pallax.ConfigSpace",
    ),
    (
      dict(kernels={"triton": _ref}, config=SCALE_SPACE, own_configs=[SCALE_SPACE]),
      TypeError,
      "own_configs must be a mapping",
    ),
  ],
  ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_declarations(kwargs, error, match):
  declaration = dict(name="test_custom_bad", reference=_ref, dims="... c -> ... c") | kwargs
  name = declaration.pop("name")
  with pytest.raises(error, match=match):
    pallax.custom_op(name, **declaration)


@pytest.mark.parametrize(
  "bad, error, match",
  [
    (dict(config_cls=dict), TypeError, "subclass of pallax.KernelConfig"),
    (dict(heuristic=None), TypeError, "heuristic must be callable"),
    (dict(supports=3), TypeError, "supports must be callable"),
    (dict(version=0), ValueError, "version must be a positive int"),
  ],
  ids=str,
)
def test_bad_config_space(bad, error, match):
  with pytest.raises(error, match=match):
    pallax.ConfigSpace(**(dict(config_cls=ScaleConfig, heuristic=_scale_heuristic) | bad))


def test_bad_calls():
  x = jnp.ones((4, 16))
  with pytest.raises(TypeError, match="takes 2 array operand"):
    scale(x)
  with pytest.raises(ValueError, match="operand 1 must have rank 1"):
    scale(x, x)
  with pytest.raises(ValueError, match="factor 'c' .* size 16 in operand 0 .* but 8 in operand 1"):
    scale(x, jnp.ones(8))
  with pytest.raises(TypeError, match="config must be a ScaleConfig"):
    scale(x, jnp.ones(16), config=example.SwigluConfig())
  with pytest.raises(TypeError, match="has no kernels"):
    cube(x, alpha=1.0, config=ScaleConfig())
  with pytest.raises(ValueError, match="factor '...'"):
    example.swiglu_op(jnp.ones((2, 4, 8)), jnp.ones((3, 4, 8)))
  wrong = pallax.custom_op("test_custom_wrong_dims", reference=lambda x: (x, x), dims="c -> c")
  with pytest.raises(ValueError, match="names 1 results; the op returns 2"):
    wrong(jnp.ones(3))


@pytest.mark.compilers
@pytest.mark.lowering
def test_verify_command_line_compiles_the_example(tmp_path):
  """``python -m pallax.verify --module examples.swiglu``: the workers import it too."""
  out = tmp_path / "verify.json"
  args = ["--module", "examples.swiglu", "--ops", "swiglu", "--targets", "h100,a100"]
  args += ["--heuristic-only"]  # the candidates: the README's full run of the example
  done = subprocess.run(
    [sys.executable, "-m", "pallax.verify", *args, "--quick", "--no-cache", "--json", str(out)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "| swiglu_bwd (triton_raw) | a100 |" in done.stdout
  data = json.loads(out.read_text())
  assert data["ok"] and {r["kernel"] for r in data["results"]} == {"swiglu_fwd", "swiglu_bwd"}
  for r in data["results"]:
    assert all(k["spill_bytes"] == 0 for k in r["kernels"]), r
  bad = subprocess.run(
    [sys.executable, "-m", "pallax.verify", "--module", "examples.nope", "--quick"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=False,
  )
  assert bad.returncode == 2 and "--module: No module named 'examples.nope'" in bad.stderr
