"""The matmul XLA program: the CPU path and the float64 reference's twin.

One ``dot_general`` in the accumulation dtype (float32, float64 for float64
inputs), then the epilogue (bias, activation) on the accumulator, cast to
``out_dtype``. The kernels run the same ``epilogue``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
from jax import lax

from pallax.activations import activate
from pallax.kernels.matmul.layout import acc_dtype, bias_like, output_batch


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
