"""What the matmul kernels of both backends share: block specs, tile maths, the call.

The kernels fold the trailing batch dims that only ``a`` has (not ``b``, not
``bias``) into M, so that a vmapped ``a`` times a shared weight is one
``[V*M, K] @ [K, N]`` GEMM, and the contracted batch dims into K; the other
batch dims are grid axes. Folding happens per device, after sharding. Each
backend (``triton.py``, ``mosaic_tpu.py``) plans its blocks, grid and kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax.activations import activate_in_kernel
from pallax.kernels.matmul.config import MatmulConfig
from pallax.kernels.matmul.layout import Problem, acc_dtype
from pallax.kernels.matmul.xla import epilogue, split_params
from pallax.op.signature import Named, Operand, Signature


@dataclasses.dataclass(frozen=True)
class Plan:
  """A backend's kernel for one problem.

  blocks: ``(bm, bn, bk)`` of the operands' block specs.
  grid: the grid axes after the batch axes.
  kernel: the kernel function.
  call_args: more ``pallas_call`` arguments (compiler params, scratch).
  k_steps: whether the grid's last axis walks K (else a block holds all of K).
  """

  blocks: tuple[int, int, int]
  grid: tuple[int, ...]
  kernel: Callable
  call_args: dict[str, Any]
  k_steps: bool


def _spec(mask: Sequence[bool], block: tuple[int, ...], index) -> pl.BlockSpec:
  """A block spec: the operand's batch dims squeezed, ``index(i, j[, k])`` for the rest.

  The grid is ``(*batch, i, j[, k])``; the operand reads the batch dims it has.
  """
  nb = len(mask)

  def index_map(*ids):
    return (*(ids[d] for d in range(nb) if mask[d]), *index(*ids[nb:]))

  return pl.BlockSpec((*(None,) * sum(mask), *block), index_map)


def _block_specs(
  a_batch,
  b_batch,
  bias_batch,
  blocks: tuple[int, int, int],
  transpose_a: bool,
  transpose_b: bool,
  k_steps: bool,
) -> tuple[list[pl.BlockSpec], pl.BlockSpec]:
  """Specs of ``a``, ``b``, ``bias`` and the outputs for ``(bm, bn, bk)`` blocks.

  With ``k_steps`` the grid's last axis walks K; otherwise ``bk`` is all of K.
  """
  bm, bn, bk = blocks
  k = (lambda ids: ids[2]) if k_steps else (lambda ids: 0)
  in_specs = [
    _spec(
      a_batch,
      (bk, bm) if transpose_a else (bm, bk),
      lambda *ids: (k(ids), ids[0]) if transpose_a else (ids[0], k(ids)),
    ),
    _spec(
      b_batch,
      (bn, bk) if transpose_b else (bk, bn),
      lambda *ids: (ids[1], k(ids)) if transpose_b else (k(ids), ids[1]),
    ),
    _spec(bias_batch, (1, bn), lambda *ids: (0, ids[1])),
  ]
  return in_specs, _spec((True,) * len(a_batch), (bm, bn), lambda *ids: ids[:2])


def _dot(a, b, transpose_a: bool, transpose_b: bool, precision, dtype) -> jax.Array:
  """One tile product ``op(a) @ op(b)``, accumulated in ``dtype``."""
  dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=dtype)


def tile_mask(rows_ok, cols_ok, shape):
  """The mask of a 2-D tile from its row and column masks (None: all in range)."""
  if rows_ok is None and cols_ok is None:
    return None
  rows = True if rows_ok is None else rows_ok[:, None]
  cols = True if cols_ok is None else cols_ok[None, :]
  return jnp.broadcast_to(rows & cols, shape)


# The kernel's operands and results by name (``pallax.op.signature``).
_OPERANDS = (Operand("a"), Operand("b"), Operand("bias", when="has_bias"))
_RESULTS = (Operand("out"), Operand("z", when="save_preactivation"))


@dataclasses.dataclass(frozen=True)
class KernelArgs:
  """What a kernel body knows of its call besides its refs."""

  prob: Problem
  has_bias: bool
  transpose_a: bool
  transpose_b: bool
  precision: Any
  activation: Any
  save_preactivation: bool

  @property
  def signature(self) -> Signature:
    """The kernel's operand and result names for this call."""
    params = dict(has_bias=self.has_bias, save_preactivation=self.save_preactivation)
    return Signature.declare(_OPERANDS, _RESULTS, params)

  def refs(self, refs: Sequence[Any]) -> Named:
    """A kernel's refs by name: ``a``, ``b``, ``bias`` (None without), ``out``, ``z``.

    ``z`` is the pre-activation, a result where the call saves it.
    """
    return self.signature.unpack_all(refs)

  def store(self, refs: Named, outs: Sequence[jax.Array], put: Callable[[Any, jax.Array], None]):
    """``put(ref, value)`` for each result of ``finish`` into the ref of its name."""
    for name, value in zip(self.signature.results, outs):
      put(refs[name], value)

  def product(self, a, b, dtype) -> jax.Array:
    """One tile product ``op(a) @ op(b)``, accumulated in ``dtype``."""
    return _dot(a, b, self.transpose_a, self.transpose_b, self.precision, dtype)

  def finish(self, acc, bias, out_dtype) -> list[jax.Array]:
    """The epilogue of a finished accumulator tile (bias: a list of 0 or 1 tile)."""
    return epilogue(
      acc,
      *bias,
      out_dtype=out_dtype,
      activation_fn=activate_in_kernel,
      bias_batch=(),
      activation=self.activation,
      save_preactivation=self.save_preactivation,
    )


@dataclasses.dataclass(frozen=True)
class Folded:
  """A call's operands as the kernels take them: batch dims folded into M and K.

  a, b: the operands, a's trailing batch dims that only it has folded into M
    and the contracted batch dims into K.
  bias: 0 or 1 bias, ``(*bias_dims, 1, N)``.
  masks: the batch masks of ``a``, ``b`` and ``bias`` over ``prob.grid_batch``.
  args: what the kernel body knows of the call.
  """

  prob: Problem
  a: jax.Array
  b: jax.Array
  bias: list[jax.Array]
  masks: tuple[tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]]
  args: KernelArgs

  def unfold(self, outs: Sequence[jax.Array]) -> list[jax.Array]:
    """The kernel's ``(*grid_batch, M, N)`` results in the call's ``(*batch, rows, N)``."""
    prob = self.prob
    return [o.reshape(prob.batch + (prob.rows, prob.n)) for o in outs]


def trivial(a, b, *bias, out_dtype, **params) -> Optional[list[jax.Array]]:
  """The results of a call with nothing to multiply (an empty result or K = 0), else None."""
  prob = Problem.of([x.shape for x in (a, b, *bias)], **params)
  out_shape = prob.batch + (prob.rows, prob.n)
  if math.prod(out_shape) == 0:
    return [jnp.zeros(out_shape, out_dtype)] * (1 + params["save_preactivation"])
  if prob.k == 0:
    acc = acc_dtype(a.dtype, b.dtype)
    epilogue_params = split_params(params)[1]
    return epilogue(jnp.zeros(out_shape, acc), *bias, out_dtype=out_dtype, **epilogue_params)
  return None


def fold(a, b, *bias, **params) -> Folded:
  """The operands of a call reshaped so that folded batch dims join M (contracted ones K)."""
  prob = Problem.of([x.shape for x in (a, b, *bias)], **params)
  nb = len(prob.grid_batch)
  a_batch, b_batch, bias_batch = params["a_batch"], params["b_batch"], params["bias_batch"]
  if params["contract_batch"]:  # contiguous with K (transpose_a, not transpose_b): fold into K
    a = a.reshape(a.shape[: sum(a_batch)] + (prob.k, prob.m))
    b = b.reshape(b.shape[: sum(b_batch)] + (prob.k, prob.n))
  if prob.fold:
    a = a.reshape(a.shape[: sum(a_batch) - prob.fold] + (prob.m, prob.k))
  masks = tuple(tuple(m[:nb]) for m in (a_batch, b_batch, bias_batch))
  args = KernelArgs(
    prob,
    bool(bias),
    params["transpose_a"],
    params["transpose_b"],
    params["precision"],
    params["activation"],
    params["save_preactivation"],
  )
  return Folded(prob, a, b, [x.reshape(x.shape[:-1] + (1, prob.n)) for x in bias], masks, args)


def matmul(
  a, b, *bias, out_dtype, config: MatmulConfig, interpret, plan: Callable[..., Plan], **params
):
  """The Pallas kernel of one call, on the backend whose ``plan`` is given.

  The operands are reshaped so that folded batch dims join M (and contracted
  ones K); ``plan(prob, config, kernel_args, acc_dtype)`` gives the backend's
  blocks, grid, kernel and ``pallas_call`` arguments.
  """
  done = trivial(a, b, *bias, out_dtype=out_dtype, **params)
  if done is not None:
    return done
  f = fold(a, b, *bias, **params)
  prob, args = f.prob, f.args
  outputs = 1 + args.save_preactivation
  result = jax.ShapeDtypeStruct(prob.grid_batch + (prob.m, prob.n), out_dtype)
  p = plan(prob, config, args, acc_dtype(a.dtype, b.dtype))
  in_specs, out_spec = _block_specs(
    *f.masks, p.blocks, args.transpose_a, args.transpose_b, k_steps=p.k_steps
  )
  outs = pl.pallas_call(
    p.kernel,
    grid=prob.grid_batch + p.grid,
    in_specs=in_specs[: 2 + len(f.bias)],
    out_specs=[out_spec] * outputs,
    out_shape=[result] * outputs,
    interpret=interpret,
    name="matmul",
    **p.call_args,
  )(f.a, f.b, *f.bias)
  return f.unfold(outs)
