"""A user's own raw Triton kernel as a pallax op: the SwiGLU epilogue ``x * sigmoid(x) * y``.

Written once, in Triton's own language, it becomes a JAX primitive through
``pallax.custom_op``; what pallax's own ops get, it gets:

* ``jax.vmap`` as one kernel: the vmapped axis is folded into the leading
  dims (the ``...`` of its sharding dims);
* ``jax.grad`` as one forward and one backward kernel, ``jax.jvp`` as the
  forward kernel and an XLA tangent (``pallax.ResidualJVP``; no
  ``custom_vjp``, so ``jacfwd`` and Hessian-vector products work too);
* sharded ``jax.jit``: the rows and columns shard freely, without gathers;
* the executor: the heuristic's config, autotuning over the candidates, the
  XLA reference on the CPU, ``pallax.explain``;
* ``pallax.verify``: every config the executor can choose compiled for H100
  and A100 without the hardware (``register_op`` below)::

    python -m pallax.verify --module examples.swiglu --ops swiglu --quick

Run the demo from the repository root::

    python -m examples.swiglu                     # the XLA program (CPU)
    TRITON_INTERPRET=1 python -m examples.swiglu  # and the raw kernels, interpreted

The Triton kernels need the ``triton`` extra (``pip install 'pallax[triton]'``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

import pallax
import pallax.verify
from pallax.executor.registry import interpreted
from pallax.triton_raw import launch

# ----------------------------------------------------------------------------
# 1. The kernels, in Triton. Each program takes one (BLOCK_ROWS, BLOCK_COLS)
# block of the operands seen as (rows, cols) matrices; the math runs in
# float32; blocks overhanging the matrix are masked.


@triton.jit
def _block(rows, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
  """This program's (BLOCK_ROWS, BLOCK_COLS) block: element offsets and which lie in bounds."""
  r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
  c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
  mask = (r[:, None] < rows) & (c[None, :] < cols)
  return r[:, None].to(tl.int64) * cols + c[None, :], mask


@triton.jit
def _swiglu_fwd_kernel(
  x_ptr, y_ptr, rows, cols, out_ptr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr
):
  offsets, mask = _block(rows, cols, BLOCK_ROWS, BLOCK_COLS)
  x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
  y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
  out = x * tl.sigmoid(x) * y
  tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
  x_ptr,
  y_ptr,
  g_ptr,
  rows,
  cols,
  dx_ptr,
  dy_ptr,
  BLOCK_ROWS: tl.constexpr,
  BLOCK_COLS: tl.constexpr,
):
  offsets, mask = _block(rows, cols, BLOCK_ROWS, BLOCK_COLS)
  x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
  y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
  g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
  s = tl.sigmoid(x)
  dx = g * y * s * (1.0 + x * (1.0 - s))  # d/dx x*sigmoid(x) = s * (1 + x * (1 - s))
  dy = g * x * s
  tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
  tl.store(dy_ptr + offsets, dy.to(dy_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------
# 2. The config: what the executor chooses per call (block sizes, warps), a
# heuristic, the autotuning candidates, and which configs can run a call.


@dataclasses.dataclass(frozen=True)
class SwigluConfig(pallax.KernelConfig):
  """Blocks of the SwiGLU kernels (forward and backward).

  block_rows, block_cols: the (rows, cols) block a program computes (powers
    of two).
  num_warps, num_stages: Triton launch parameters.
  implementation: ``"triton_raw"``, the kernels below; ``"xla"``, the
    reference.
  """

  block_rows: int = 4
  block_cols: int = 512
  num_warps: int = 4
  num_stages: int = 1
  implementation: str = dataclasses.field(default="triton_raw", kw_only=True)


_DTYPES = ("float32", "bfloat16", "float16")
# Elements of a block per thread: at 64 the backward kernel, which holds three
# float32 operands, spills registers on H100 and A100 (found by
# ``python -m pallax.verify --module examples.swiglu``); at 32 neither spills.
_PER_THREAD = 32
_MAX_BLOCK = 8192


def _next_pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _rows_cols(avals: Sequence[Any]) -> tuple[int, int]:
  shape = avals[0].shape
  return math.prod(shape[:-1]), shape[-1]


def heuristic(avals: Sequence[Any], target: str, **params: Any) -> SwigluConfig:
  """2K elements a program, as wide as the rows allow (up to 1024 columns), 4 warps."""
  rows, cols = _rows_cols(avals)
  block_cols = min(_next_pow2(cols), 1024)
  block_rows = max(1, min(_next_pow2(rows), 2048 // block_cols))
  return SwigluConfig(block_rows=block_rows, block_cols=block_cols, num_warps=4)


def candidates(avals: Sequence[Any], target: str, **params: Any) -> list[SwigluConfig]:
  """The autotuning space: blocks of 512 to 8K elements, 2 to 8 warps, 4 to 32 elements a thread."""
  if interpreted(target):  # the interpreter is slow: the heuristic's blocks only
    return [heuristic(avals, target)]
  rows, cols = _rows_cols(avals)
  out = []
  for block_cols in (64, 128, 256, 512, 1024):
    if block_cols > max(64, _next_pow2(cols)):
      continue
    for block_rows in (1, 2, 4, 8, 16, 32, 64):
      size = block_rows * block_cols
      if block_rows > _next_pow2(rows) or not 512 <= size <= _MAX_BLOCK:
        continue
      out += [
        SwigluConfig(block_rows=block_rows, block_cols=block_cols, num_warps=w)
        for w in (2, 4, 8)
        if 4 <= size // (32 * w) <= _PER_THREAD
      ]
  return out or [heuristic(avals, target)]


def supports(
  avals: Sequence[Any], target: str, config: SwigluConfig, **params: Any
) -> Optional[str]:
  """Why ``config`` cannot run this call, if it cannot."""
  dtype = jnp.dtype(avals[0].dtype).name
  if dtype not in _DTYPES:
    return f"the kernels compute in float32 and take {', '.join(_DTYPES)}, not {dtype}"
  for name in ("block_rows", "block_cols", "num_warps"):
    value = getattr(config, name)
    if value & (value - 1):
      return f"{name}={value} must be a power of two"
  per_thread = config.block_rows * config.block_cols // (32 * config.num_warps)
  if not interpreted(target) and per_thread > _PER_THREAD:
    return f"{per_thread} elements a thread spill registers (at most {_PER_THREAD})"
  return None


CONFIG = pallax.ConfigSpace(SwigluConfig, heuristic, candidates, supports)

# ----------------------------------------------------------------------------
# 3. The kernel functions pallax calls: (*arrays, config, interpret) -> arrays.
# Operands of any rank are (rows, cols) matrices to the kernels.


def _launch(kernel, arrays, outs, config: SwigluConfig, interpret: bool) -> list[jax.Array]:
  shape = arrays[0].shape
  rows, cols = math.prod(shape[:-1]), shape[-1]
  if rows * cols == 0:
    return [jnp.zeros(shape, dtype) for dtype in outs]
  grid = (triton.cdiv(rows, config.block_rows), triton.cdiv(cols, config.block_cols))
  results = launch(
    kernel,
    *(a.reshape(rows, cols) for a in arrays),
    rows,
    cols,
    out_shape=[jax.ShapeDtypeStruct((rows, cols), dtype) for dtype in outs],
    grid=grid,
    num_warps=config.num_warps,
    num_stages=config.num_stages,
    interpret=interpret,
    BLOCK_ROWS=config.block_rows,
    BLOCK_COLS=config.block_cols,
  )
  return [r.reshape(shape) for r in results]


def swiglu_fwd_kernel(x, y, *, config: SwigluConfig, interpret: bool) -> list[jax.Array]:
  """``x * sigmoid(x) * y`` by the forward kernel."""
  return _launch(_swiglu_fwd_kernel, (x, y), [x.dtype], config, interpret)


def swiglu_bwd_kernel(x, y, g, *, config: SwigluConfig, interpret: bool) -> list[jax.Array]:
  """The cotangents of ``x`` and ``y`` for the output cotangent ``g``, by the backward kernel."""
  return _launch(_swiglu_bwd_kernel, (x, y, g), [x.dtype, y.dtype], config, interpret)


# ----------------------------------------------------------------------------
# 4. The XLA programs: what the op means, and what runs on the CPU.


def _compute_dtype(dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, jnp.float32)  # float32, float64 for float64


def swiglu_reference(x: jax.Array, y: jax.Array) -> jax.Array:
  """``x * sigmoid(x) * y`` in float32 (float64 for float64), in ``x``'s dtype."""
  f = _compute_dtype(x.dtype)
  xf = x.astype(f)
  return (xf * jax.nn.sigmoid(xf) * y.astype(f)).astype(x.dtype)


def swiglu_bwd_reference(x: jax.Array, y: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The backward kernel's XLA twin: the cotangents of ``x`` and ``y``."""
  f = _compute_dtype(x.dtype)
  xf, yf, gf = x.astype(f), y.astype(f), g.astype(f)
  s = jax.nn.sigmoid(xf)
  return (gf * yf * s * (1 + xf * (1 - s))).astype(x.dtype), (gf * xf * s).astype(y.dtype)


# ----------------------------------------------------------------------------
# 5. The op: reference, kernels, config space, sharding dims and AD, declared once.

swiglu_op = pallax.custom_op(
  "swiglu",
  reference=swiglu_reference,
  kernels={"triton_raw": swiglu_fwd_kernel},
  config=CONFIG,
  # Any leading dims (rows) and the columns: all batch-like, so they shard
  # freely, and vmap folds its axis into the leading dims.
  dims="... c, ... c -> ... c",
  # grad: the forward kernel, then the backward kernel (the transpose of the
  # tangent, which is jax.jvp of the reference: jvp costs no kernel more).
  jvp=pallax.ResidualJVP(
    bwd=pallax.KernelStage(swiglu_bwd_reference, kernels={"triton_raw": swiglu_bwd_kernel}),
  ),
)


def swiglu(x: jax.Array, y: jax.Array, *, config: Optional[SwigluConfig] = None) -> jax.Array:
  """The SwiGLU epilogue ``x * sigmoid(x) * y`` (``silu(x) * y``), elementwise.

  Args:
    x: the gate, a floating array of any shape (at least 1-D).
    y: the value, an array of ``x``'s shape; the dtypes are promoted.
    config: pin the kernels' ``SwigluConfig`` instead of the executor's choice.

  Returns:
    An array of ``x``'s shape and the promoted dtype.
  """
  x, y = jnp.asarray(x), jnp.asarray(y)
  if x.shape != y.shape or x.ndim == 0:
    raise ValueError(f"swiglu: x and y must have one shape, at least 1-D; got {x.shape}, {y.shape}")
  dtype = jnp.result_type(x, y)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"swiglu: x and y must be floating, got {x.dtype} and {y.dtype}")
  return swiglu_op(x.astype(dtype), y.astype(dtype), config=config)


# ----------------------------------------------------------------------------
# 6. pallax.verify's cases: (rows, cols) sizes, both operands of that shape.

pallax.verify.register_op(
  "swiglu",
  pallax.verify.Op(
    swiglu,
    shapes=lambda rows, cols: [(rows, cols), (rows, cols)],
    # The first size is where the autotuning candidates are compiled too.
    sizes=((4096, 4096), (1000, 3000), (8, 14336)),
    quick=((4096, 4096), (1000, 3000)),
  ),
)


def _demo() -> None:
  """Every transformation on the CPU: the XLA program, and the raw kernels when interpreted."""
  from pallax.triton_raw import interpreter_mode

  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (4, 6, 96), jnp.float32)
  y = jax.random.normal(ky, (4, 6, 96), jnp.float32)
  err = lambda a, b: f"{float(jnp.max(jnp.abs(a - b))):.1e}"
  ref_loss = lambda x, y: jnp.sum(swiglu_reference(x, y) ** 2)
  ref_vmap = jax.vmap(swiglu_reference, in_axes=(1, None))(x, y[:, 0])

  paths = {"XLA program": None}
  if interpreter_mode():  # Triton interprets: pinned raw configs run on the CPU
    paths["raw Triton, interpreted"] = SwigluConfig(block_rows=4, block_cols=32)
  for path, config in paths.items():
    op = lambda x, y: swiglu(x, y, config=config)
    out = jax.jit(op)(x, y)
    grads = jax.jit(jax.grad(lambda x, y: jnp.sum(op(x, y) ** 2), (0, 1)))(x, y)
    _, tangent = jax.jit(lambda x, y: jax.jvp(op, (x, y), (y, x)))(x, y)
    _, ref_tangent = jax.jvp(swiglu_reference, (x, y), (y, x))
    batched = jax.vmap(op, in_axes=(1, None))
    calls = str(jax.make_jaxpr(batched)(x, y[:, 0])).count("swiglu_fwd[")
    print(f"{path}: max |error| against the reference")
    print(f"  forward {err(out, swiglu_reference(x, y))}")
    print(f"  grad    {', '.join(map(err, grads, jax.grad(ref_loss, (0, 1))(x, y)))}")
    print(f"  jvp     {err(tangent, ref_tangent)}")
    print(f"  vmap    {err(jax.jit(batched)(x, y[:, 0]), ref_vmap)} ({calls} kernel call)")
  print(pallax.explain(swiglu, x, y))


if __name__ == "__main__":
  _demo()
