"""Matmul implementations: the XLA program and the Pallas kernels.

Layout shared by every implementation: ``a`` is ``(*a_dims, M, K)``
(``(*a_dims, K, M)`` with ``transpose_a``), ``b`` is ``(*b_dims, K, N)``
(``(*b_dims, N, K)`` with ``transpose_b``), the optional ``bias`` is
``(*bias_dims, N)`` and the result is ``(*batch, M, N)``. The masks
``a_batch``, ``b_batch`` and ``bias_batch`` (one bool per result batch dim)
say which batch dims each operand has: an operand shared along a batch dim
simply lacks it and is never broadcast in memory. Products accumulate in
float32 (float64 for float64 inputs); the epilogue (bias, activation) runs on
the accumulator and the result is cast to ``out_dtype``. With
``save_preactivation`` the pre-activation ``a @ b + bias`` is a second result:
what the activation's derivative needs under AD.

``contract_batch`` more batch dims, right before the matrix dims of ``a`` and
``b`` (and absent from the result), are contracted with K: the gradient of a
weight shared by a batch sums over the batch in the same GEMM. They need
``transpose_a`` and not ``transpose_b``, which makes them contiguous with K in
both operands.

The kernels fold the trailing batch dims that only ``a`` has (not ``b``, not
``bias``) into M, so that a vmapped ``a`` times a shared weight is one
``[V*M, K] @ [K, N]`` GEMM, and the contracted batch dims into K; the other
batch dims are grid axes. Folding happens per device, after sharding.

* Pallas-Triton: grid ``(*batch, M/bm, N/bn)``, a loop over K in the kernel.
  Blocks are powers of two >= 16 (``tl.dot``'s minimum) and overhang odd dims;
  Pallas-Triton does not mask block edges, so loads and stores along a dim
  that is not a multiple of its block are masked (out-of-range K is loaded as
  zero in both operands).
* Pallas-Mosaic TPU: grid ``(*batch, M/bm, N/bn, K/bk)``, K "arbitrary" with a
  VMEM accumulator. Each block is a whole dim or a multiple of 128 (TPU
  tiling); the K tail of the last step is zeroed in both operands, edge
  blocks of the output are clipped when written back.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallax.executor import KernelSpec, register_kernel
from pallax.executor.config import KernelConfig
from pallax.executor.registry import interpreted, kernel_backend, xla_allowed, xla_on_cpu
from pallax.pallas_utils import in_bounds, load, next_pow2, store, sublanes, triton_compiler_params

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _gelu(z, erf=lax.erf):
  return 0.5 * z * (1.0 + erf(z * _SQRT_HALF))


def _gelu_tanh(z):
  return 0.5 * z * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * (z * z * z))))


# Plain lax/jnp (jax.nn's versions are jitted functions: a `jit` in every jaxpr).
_ACTIVATION_FNS = {
    "relu": lambda z: jnp.where(z > 0, z, 0),
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": lambda z: z * lax.logistic(z),
}


def activate(activation: Optional[str], z: jax.Array) -> jax.Array:
  """The activation (None: identity)."""
  return z if activation is None else _ACTIVATION_FNS[activation](z)


# XLA's float32 erf: x * P(x^2) / Q(x^2) on [-4, 4] (max abs error 4.2e-7).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)


def _erf(x: jax.Array) -> jax.Array:
  """erf from arithmetic only: Pallas-Triton has no lowering for ``lax.erf``."""
  x = jnp.clip(x, -4.0, 4.0)
  x2 = x * x
  p = functools.reduce(lambda acc, c: acc * x2 + c, _ERF_P, jnp.zeros_like(x))
  q = functools.reduce(lambda acc, c: acc * x2 + c, _ERF_Q, jnp.zeros_like(x))
  return x * p / q


def _activate_in_kernel(activation: Optional[str], z: jax.Array) -> jax.Array:
  """``activate`` as the kernels compute it (exact gelu through ``_erf``)."""
  if activation == "gelu":
    return _gelu(z, erf=_erf)
  return activate(activation, z)


@dataclasses.dataclass(frozen=True)
class MatmulConfig(KernelConfig):
  """Tile sizes of the matmul kernel.

  block_m, block_n: the output tile; block_k: the K step. Triton: powers of
    two >= 16. TPU: multiples of 128 (a block at least as large as its dim
    covers the whole dim).
  num_warps, num_stages: Triton launch parameters (ignored on TPU).
  """
  block_m: int
  block_n: int
  block_k: int
  num_warps: int = 4
  num_stages: int = 3
  positive_fields: ClassVar[tuple[str, ...]] = (
      "block_m", "block_n", "block_k", "num_warps", "num_stages")


def acc_dtype(*dtypes) -> jnp.dtype:
  """Accumulation dtype: float32, or float64 when an input is float64."""
  return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


def output_batch(shapes: Sequence[tuple[int, ...]], *, a_batch, b_batch, bias_batch,
                 contract_batch: int = 0, **params) -> tuple[int, ...]:
  """The result's batch shape, from the shapes of ``(a, b[, bias])``.

  Each dim's size comes from an operand that has it; a dim none of the given
  operands has (one only the bias has, when it is not given) has size 1.
  """
  lead = -2 - contract_batch
  sizes = [iter(shapes[0][:lead]), iter(shapes[1][:lead])] + [iter(s[:-1]) for s in shapes[2:]]
  masks = (a_batch, b_batch, bias_batch)[:len(shapes)]
  out = []
  for has in zip(*masks):
    found = [next(it) for it, h in zip(sizes, has) if h]
    out.append(found[0] if found else 1)
  return tuple(out)


def bias_like(bias: jax.Array, bias_batch: Sequence[bool], ndim: int) -> jax.Array:
  """``bias (*bias_dims, N)`` reshaped to broadcast against ``(*batch, M, N)``."""
  sizes = iter(bias.shape[:-1])
  shape = [next(sizes) if has else 1 for has in bias_batch]
  return bias.reshape((1,) * (ndim - 2 - len(shape)) + tuple(shape) + (1, bias.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Problem:
  """The GEMM one call runs, after folding a's trailing batch dims into M."""
  batch: tuple[int, ...]  # the result's batch dims
  fold: int               # how many trailing ones are folded into M
  rows: int               # M of one example (before folding)
  m: int
  n: int
  k: int

  @classmethod
  def of(cls, shapes: Sequence[tuple[int, ...]], *, a_batch, b_batch, bias_batch, contract_batch,
         transpose_a, transpose_b, **params) -> "Problem":
    """The problem of a call with operands of ``shapes`` ``(a, b[, bias])``."""
    batch = output_batch(shapes, a_batch=a_batch, b_batch=b_batch, bias_batch=bias_batch,
                         contract_batch=contract_batch)
    a_shape, b_shape = shapes[:2]
    fold = 0
    if not transpose_a:
      while (fold < len(batch) and a_batch[-1 - fold] and not b_batch[-1 - fold]
             and not bias_batch[-1 - fold]):
        fold += 1
    rows = a_shape[-1] if transpose_a else a_shape[-2]
    contracted = math.prod(a_shape[len(a_shape) - 2 - contract_batch:-2])
    k = contracted * (a_shape[-2] if transpose_a else a_shape[-1])
    n = b_shape[-2] if transpose_b else b_shape[-1]
    return cls(batch, fold, rows, rows * math.prod(batch[len(batch) - fold:]), n, k)

  @property
  def grid_batch(self) -> tuple[int, ...]:
    return self.batch[:len(self.batch) - self.fold]


def _problem(avals, params) -> Problem:
  return Problem.of([a.shape for a in avals], **params)


# ----------------------------------------------------------------------------
# Configs: heuristic, autotuning space, legality.

# On-chip memory the tiles may use: Triton's shared memory for the operand
# tiles of all pipeline stages (fits every GPU since V100), and TPU VMEM for
# the double-buffered tiles plus the accumulator (the default scoped VMEM
# limit is 16 MiB on v5e, 32 MiB on v6e).
TRITON_SMEM_BYTES = 96 * 1024
TPU_VMEM_BYTES = 12 * 1024 * 1024
_LANES = 128


def _triton_smem(config: MatmulConfig, itemsize: int) -> int:
  c = config
  return c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * itemsize


def _tpu_vmem(bm: int, bn: int, bk: int, in_itemsize: int, out_itemsize: int,
              outputs: int) -> int:
  return 2 * ((bm * bk + bk * bn) * in_itemsize + outputs * bm * bn * out_itemsize) \
      + 4 * bm * bn


def _clamp_pow2(n: int, lo: int, hi: int) -> int:
  return max(lo, min(hi, next_pow2(n)))


def _triton_heuristic(prob: Problem, itemsize: int) -> MatmulConfig:
  """Output tiles up to 128x128, smaller for small M (or N); 3 stages if they fit."""
  bm = _clamp_pow2(prob.m, 16, 128)
  bn = _clamp_pow2(prob.n, 16, 128)
  bk = _clamp_pow2(prob.k, 16, 64 if itemsize <= 2 else 32)
  config = MatmulConfig(block_m=bm, block_n=bn, block_k=bk,
                        num_warps=8 if bm * bn >= 128 * 128 else 4, num_stages=3)
  while _triton_smem(config, itemsize) > TRITON_SMEM_BYTES and config.num_stages > 1:
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  return config


def _tpu_fit(dim: int, target: int) -> int:
  """A TPU block: the whole dim if it is no larger than ``target``, else ``target``."""
  return dim if dim <= target else target


def _tpu_heuristic(prob: Problem, in_itemsize: int, out_itemsize: int,
                   outputs: int) -> MatmulConfig:
  """512-wide tiles (whole dims when smaller), shrunk until they fit VMEM."""
  bm, bn, bk = 512, 512, 512
  while _tpu_vmem(_tpu_fit(prob.m, bm), _tpu_fit(prob.n, bn), _tpu_fit(prob.k, bk),
                  in_itemsize, out_itemsize, outputs) > TPU_VMEM_BYTES:
    if bk > _LANES:
      bk //= 2
    elif bm >= bn and bm > _LANES:
      bm //= 2
    else:
      bn //= 2
  return MatmulConfig(block_m=bm, block_n=bn, block_k=bk)


def _itemsizes(avals, params) -> tuple[int, int]:
  in_size = max(jnp.dtype(a.dtype).itemsize for a in avals[:2])
  return in_size, jnp.dtype(params["out_dtype"]).itemsize


def _pallas_heuristic(avals, backend: str, **params) -> MatmulConfig:
  prob = _problem(avals, params)
  in_size, out_size = _itemsizes(avals, params)
  if backend == "triton":
    return _triton_heuristic(prob, in_size)
  return _tpu_heuristic(prob, in_size, out_size, 1 + params["save_preactivation"])


matmul_heuristic = xla_on_cpu(_pallas_heuristic)


def matmul_candidates(avals: Sequence[Any], target: str, **params) -> list[MatmulConfig]:
  """The autotuning space: tile shapes (and warps, stages on Triton), plus the XLA program."""
  backend = kernel_backend(target)
  base = _pallas_heuristic(avals, backend, **params)
  prob = _problem(avals, params)
  in_size, out_size = _itemsizes(avals, params)
  if interpreted(target):  # interpreted kernels are slow: two tilings
    smaller = dataclasses.replace(base, block_k=max(16 if backend == "triton" else _LANES,
                                                    base.block_k // 2))
    out = list(dict.fromkeys([base, smaller]))
  elif backend == "triton":
    out = [MatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
           for bm in (16, 32, 64, 128) if bm <= max(16, next_pow2(prob.m))
           for bn in (32, 64, 128, 256) if bn <= max(32, next_pow2(prob.n))
           for bk in (32, 64) if bk <= max(32, next_pow2(prob.k))
           for w in (4, 8) if w == 4 or bm * bn >= 64 * 128
           for s in (2, 3, 4)]
    out = [c for c in out if _triton_smem(c, in_size) <= TRITON_SMEM_BYTES]
  else:
    outputs = 1 + params["save_preactivation"]
    out = [MatmulConfig(block_m=bm, block_n=bn, block_k=bk)
           for bm in (128, 256, 512) for bn in (128, 256, 512) for bk in (128, 256, 512)
           if _tpu_vmem(_tpu_fit(prob.m, bm), _tpu_fit(prob.n, bn), _tpu_fit(prob.k, bk),
                        in_size, out_size, outputs) <= TPU_VMEM_BYTES]
  out = [c for c in out if matmul_supports(avals, target, c, **params) is None] or [base]
  if xla_allowed(target):
    out.append(dataclasses.replace(base, implementation="xla"))
  return out


def _mosaic_blocks(prob: Problem, config: MatmulConfig) -> tuple[int, int, int]:
  """TPU block sizes: a block at least as large as its dim is the whole dim."""
  return (min(config.block_m, prob.m), min(config.block_n, prob.n), min(config.block_k, prob.k))


def _mosaic_tiling_error(name: str, block: tuple[int, int], shape: tuple[int, int],
                         dtype) -> Optional[str]:
  rows, cols = block
  sub = sublanes(dtype)
  if (rows % sub and rows != shape[0]) or (cols % _LANES and cols != shape[1]):
    return (f"the {name} block {block} of {shape} must be divisible by ({sub}, {_LANES}) "
            f"or equal the array's dims on TPU")
  return None


def matmul_supports(avals: Sequence[Any], target: str, config: MatmulConfig,
                    **params) -> Optional[str]:
  """Why ``config`` cannot run this call on ``target``, if it cannot."""
  if config.implementation == "xla":
    return None
  a, b = avals[:2]
  if jnp.float64 in (a.dtype, b.dtype, params["out_dtype"]):
    return "float64 has no Pallas matmul kernel"
  backend = kernel_backend(target)
  blocks = (config.block_m, config.block_n, config.block_k)
  if backend == "triton":
    if any(x < 16 or x & (x - 1) for x in blocks):
      return f"blocks {blocks} must be powers of two >= 16 on Triton"
    return None
  precision = params["precision"]
  if precision is not None and (precision[0] != precision[1]
                                or precision[0] not in (lax.Precision.DEFAULT,
                                                        lax.Precision.HIGHEST)):
    return f"precision {precision} has no Mosaic TPU lowering (DEFAULT or HIGHEST only)"
  prob = _problem(avals, params)
  bm, bn, bk = _mosaic_blocks(prob, config)
  ta, tb = params["transpose_a"], params["transpose_b"]
  checks = [
      ("a", (bk, bm) if ta else (bm, bk), (prob.k, prob.m) if ta else (prob.m, prob.k), a.dtype),
      ("b", (bn, bk) if tb else (bk, bn), (prob.n, prob.k) if tb else (prob.k, prob.n), b.dtype),
      ("output", (bm, bn), (prob.m, prob.n), params["out_dtype"]),
  ]
  for name, block, shape, dtype in checks:
    error = _mosaic_tiling_error(name, block, shape, dtype)
    if error:
      return error
  return None


register_kernel(KernelSpec("matmul", MatmulConfig, matmul_heuristic, matmul_candidates,
                           matmul_supports))


# ----------------------------------------------------------------------------
# The XLA program (the CPU path; the reference's twin).


def _batch_axes(mask: Sequence[bool]) -> list[Optional[int]]:
  """For each result batch dim, the operand's axis holding it (None if it lacks it)."""
  axes, next_axis = [], 0
  for has in mask:
    axes.append(next_axis if has else None)
    next_axis += has
  return axes


def contract(a, b, *, a_batch, b_batch, contract_batch, transpose_a, transpose_b,
             precision) -> jax.Array:
  """``op(a) @ op(b)`` as one ``dot_general`` in the accumulation dtype, ``(*batch, M, N)``.

  Batch dims both operands have are dot batch dims; a dim only one operand
  has is a free dim of that operand, so nothing is broadcast. A dim neither
  has (only the bias has it) has size 1.
  """
  a_axes, b_axes = _batch_axes(a_batch), _batch_axes(b_batch)
  both = [i for i, (x, y) in enumerate(zip(a_axes, b_axes)) if x is not None and y is not None]
  a_contract = [a.ndim - 2 if transpose_a else a.ndim - 1]
  b_contract = [b.ndim - 1 if transpose_b else b.ndim - 2]
  for i in range(contract_batch):
    a_contract.append(a.ndim - 2 - contract_batch + i)
    b_contract.append(b.ndim - 2 - contract_batch + i)
  out = lax.dot_general(
      a, b, ((a_contract, b_contract), ([a_axes[i] for i in both], [b_axes[i] for i in both])),
      precision=precision, preferred_element_type=acc_dtype(a.dtype, b.dtype))
  # dot_general's result dims: shared batch, a's free dims, b's free dims.
  labels = (both + [i for i in range(len(a_batch)) if a_batch[i] and not b_batch[i]] + ["m"]
            + [i for i in range(len(a_batch)) if b_batch[i] and not a_batch[i]] + ["n"])
  dims = sorted(i for i in labels if i not in ("m", "n"))
  perm = [labels.index(i) for i in dims + ["m", "n"]]
  out = out if perm == sorted(perm) else lax.transpose(out, perm)
  batch = output_batch([a.shape, b.shape], a_batch=a_batch, b_batch=b_batch,
                       bias_batch=(False,) * len(a_batch), contract_batch=contract_batch)
  return out.reshape(batch + out.shape[-2:])


def epilogue(acc, *bias, bias_batch, activation, out_dtype, save_preactivation,
             activation_fn=activate) -> list[jax.Array]:
  """Bias and activation on the accumulator: ``[y]`` or ``[y, pre-activation]``."""
  z = acc
  if bias:
    z = z + bias_like(bias[0], bias_batch, acc.ndim).astype(acc.dtype)
  outs = [activation_fn(activation, z).astype(out_dtype)]
  if save_preactivation:
    outs.append(z.astype(out_dtype))
  return outs


def matmul_xla(a, b, *bias, a_batch, b_batch, bias_batch, contract_batch, transpose_a,
               transpose_b, activation, out_dtype, precision, save_preactivation):
  """The XLA program of one call: one ``dot_general``, then the epilogue."""
  acc = contract(a, b, a_batch=a_batch, b_batch=b_batch, contract_batch=contract_batch,
                 transpose_a=transpose_a, transpose_b=transpose_b, precision=precision)
  return epilogue(acc, *bias, bias_batch=bias_batch, activation=activation, out_dtype=out_dtype,
                  save_preactivation=save_preactivation)


# ----------------------------------------------------------------------------
# Pallas kernels.


def _spec(mask: Sequence[bool], block: tuple[int, ...], index) -> pl.BlockSpec:
  """A block spec: the operand's batch dims squeezed, ``index(i, j[, k])`` for the rest.

  The grid is ``(*batch, i, j[, k])``; the operand reads the batch dims it has.
  """
  nb = len(mask)

  def index_map(*ids):
    return (*(ids[d] for d in range(nb) if mask[d]), *index(*ids[nb:]))

  return pl.BlockSpec((*(None,) * sum(mask), *block), index_map)


def _block_specs(a_batch, b_batch, bias_batch, blocks: tuple[int, int, int], transpose_a: bool,
                 transpose_b: bool, k_steps: bool) -> tuple[list[pl.BlockSpec], pl.BlockSpec]:
  """Specs of ``a``, ``b``, ``bias`` and the outputs for ``(bm, bn, bk)`` blocks.

  With ``k_steps`` the grid's last axis walks K; otherwise ``bk`` is all of K.
  """
  bm, bn, bk = blocks
  k = (lambda ids: ids[2]) if k_steps else (lambda ids: 0)
  in_specs = [
      _spec(a_batch, (bk, bm) if transpose_a else (bm, bk),
            lambda *ids: (k(ids), ids[0]) if transpose_a else (ids[0], k(ids))),
      _spec(b_batch, (bn, bk) if transpose_b else (bk, bn),
            lambda *ids: (ids[1], k(ids)) if transpose_b else (k(ids), ids[1])),
      _spec(bias_batch, (1, bn), lambda *ids: (0, ids[1])),
  ]
  return in_specs, _spec((True,) * len(a_batch), (bm, bn), lambda *ids: ids[:2])


def _dot(a, b, transpose_a: bool, transpose_b: bool, precision, dtype) -> jax.Array:
  """One tile product ``op(a) @ op(b)``, accumulated in ``dtype``."""
  dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=dtype)


def _tile_mask(rows_ok, cols_ok, shape):
  """The mask of a 2-D tile from its row and column masks (None: all in range)."""
  if rows_ok is None and cols_ok is None:
    return None
  rows = True if rows_ok is None else rows_ok[:, None]
  cols = True if cols_ok is None else cols_ok[None, :]
  return jnp.broadcast_to(rows & cols, shape)


def _triton_kernel(a_ref, b_ref, *refs, prob: Problem, block_k: int, has_bias: bool,
                   transpose_a, transpose_b, activation, precision, save_preactivation):
  bias_ref = refs[0] if has_bias else None
  out_refs = refs[has_bias:]
  bm, bn = out_refs[0].shape
  rank = len(prob.grid_batch) + 2
  row_ok = in_bounds(pl.program_id(rank - 2), bm, prob.m, (bm,), 0)
  col_ok = in_bounds(pl.program_id(rank - 1), bn, prob.n, (bn,), 0)
  compute = jnp.promote_types(a_ref.dtype, b_ref.dtype)

  def load_tile(ref, start, k_ok, other_ok, k_first: bool):
    """A ``block_k``-deep slice of a row/column panel; out-of-range entries load as 0."""
    if k_first:
      view = ref.at[pl.ds(start, block_k), :]
      mask = _tile_mask(k_ok, other_ok, view.shape)
    else:
      view = ref.at[:, pl.ds(start, block_k)]
      mask = _tile_mask(other_ok, k_ok, view.shape)
    return load(view, mask).astype(compute)

  def step(s, acc):
    k_ok = in_bounds(s, block_k, prob.k, (block_k,), 0)
    a = load_tile(a_ref, s * block_k, k_ok, row_ok, k_first=transpose_a)
    b = load_tile(b_ref, s * block_k, k_ok, col_ok, k_first=not transpose_b)
    return acc + _dot(a, b, transpose_a, transpose_b, precision, acc.dtype)

  acc = lax.fori_loop(0, pl.cdiv(prob.k, block_k), step,
                      jnp.zeros((bm, bn), acc_dtype(a_ref.dtype, b_ref.dtype)))
  bias_mask = _tile_mask(None, col_ok, (1, bn))
  bias = [load(bias_ref, bias_mask)] if has_bias else []
  outs = epilogue(acc, *bias, bias_batch=(), activation=activation,
                  out_dtype=out_refs[0].dtype, save_preactivation=save_preactivation,
                  activation_fn=_activate_in_kernel)
  for ref, value in zip(out_refs, outs):
    store(ref, value, _tile_mask(row_ok, col_ok, (bm, bn)))


def _zero_k_tail(x: jax.Array, left, axis: int) -> jax.Array:
  """``x`` with entries at K offsets >= ``left`` (past the end of K) set to zero."""
  return jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, axis) < left, x, 0)


def _mosaic_kernel(a_ref, b_ref, *refs, prob: Problem, block_k: int, has_bias: bool,
                   transpose_a, transpose_b, activation, precision, save_preactivation):
  bias_ref = refs[0] if has_bias else None
  out_refs, acc_ref = refs[has_bias:-1], refs[-1]
  k_axis = len(prob.grid_batch) + 2
  s = pl.program_id(k_axis)

  @pl.when(s == 0)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  compute = jnp.promote_types(a_ref.dtype, b_ref.dtype)
  a, b = a_ref[...].astype(compute), b_ref[...].astype(compute)
  if prob.k % block_k:  # the last step's block overhangs K: zero it in both operands
    left = prob.k - s * block_k
    a = _zero_k_tail(a, left, 0 if transpose_a else 1)
    b = _zero_k_tail(b, left, 1 if transpose_b else 0)
  acc_ref[...] += _dot(a, b, transpose_a, transpose_b, precision, acc_ref.dtype)

  @pl.when(s == pl.num_programs(k_axis) - 1)
  def _finish():
    bias = [bias_ref[...]] if has_bias else []
    outs = epilogue(acc_ref[...], *bias, bias_batch=(), activation=activation,
                    out_dtype=out_refs[0].dtype, save_preactivation=save_preactivation,
                    activation_fn=_activate_in_kernel)
    for ref, value in zip(out_refs, outs):
      ref[...] = value


def matmul_pallas(a, b, *bias, a_batch, b_batch, bias_batch, contract_batch, transpose_a,
                  transpose_b, activation, out_dtype, precision, save_preactivation,
                  config: MatmulConfig, backend: str, interpret):
  """The Pallas kernel of one call on ``backend`` (see the module docstring)."""
  masks = dict(a_batch=a_batch, b_batch=b_batch, bias_batch=bias_batch,
               contract_batch=contract_batch)
  prob = Problem.of([x.shape for x in (a, b, *bias)], transpose_a=transpose_a,
                    transpose_b=transpose_b, **masks)
  out_shape = prob.batch + (prob.rows, prob.n)
  outputs = 1 + save_preactivation
  if math.prod(out_shape) == 0:
    return [jnp.zeros(out_shape, out_dtype)] * outputs
  if prob.k == 0:
    return epilogue(jnp.zeros(out_shape, acc_dtype(a.dtype, b.dtype)), *bias,
                    bias_batch=bias_batch, activation=activation, out_dtype=out_dtype,
                    save_preactivation=save_preactivation)
  nb = len(prob.grid_batch)
  if contract_batch:  # contiguous with K (transpose_a, not transpose_b): fold into K
    a = a.reshape(a.shape[:sum(a_batch)] + (prob.k, prob.m))
    b = b.reshape(b.shape[:sum(b_batch)] + (prob.k, prob.n))
  if prob.fold:
    a = a.reshape(a.shape[:sum(a_batch) - prob.fold] + (prob.m, prob.k))
  a_batch, b_batch, bias_batch = (m[:nb] for m in (a_batch, b_batch, bias_batch))
  bias = [x.reshape(x.shape[:-1] + (1, prob.n)) for x in bias]
  kernel_args = dict(prob=prob, has_bias=bool(bias), transpose_a=transpose_a,
                     transpose_b=transpose_b, activation=activation, precision=precision,
                     save_preactivation=save_preactivation)
  result = jax.ShapeDtypeStruct(prob.grid_batch + (prob.m, prob.n), out_dtype)
  grid = prob.grid_batch
  if backend == "triton":  # whole-K panels; the kernel loops over K
    blocks = (config.block_m, config.block_n, prob.k)
    grid += (pl.cdiv(prob.m, blocks[0]), pl.cdiv(prob.n, blocks[1]))
    kernel = functools.partial(_triton_kernel, block_k=config.block_k, **kernel_args)
    extra = dict(compiler_params=triton_compiler_params(config))
  else:
    blocks = _mosaic_blocks(prob, config)
    grid += tuple(pl.cdiv(d, x) for d, x in zip((prob.m, prob.n, prob.k), blocks))
    kernel = functools.partial(_mosaic_kernel, block_k=blocks[2], **kernel_args)
    extra = dict(scratch_shapes=[pltpu.VMEM(blocks[:2], acc_dtype(a.dtype, b.dtype))],
                 compiler_params=pltpu.CompilerParams(
                     dimension_semantics=("parallel",) * (nb + 2) + ("arbitrary",)))
  in_specs, out_spec = _block_specs(a_batch, b_batch, bias_batch, blocks, transpose_a,
                                    transpose_b, k_steps=backend != "triton")
  outs = pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs[:2 + len(bias)], out_specs=[out_spec] * outputs,
      out_shape=[result] * outputs, interpret=interpret, name="matmul", **extra,
  )(a, b, *bias)
  return [o.reshape(out_shape) for o in outs]
