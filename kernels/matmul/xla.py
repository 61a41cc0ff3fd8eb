"""The matmul XLA program: the CPU path and the float64 reference's twin.

One ``dot_general`` in the accumulation dtype (float32, float64 for float64
inputs), then the epilogue (bias, activation) on the accumulator, cast to
``out_dtype``. The kernels run the same ``epilogue``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

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


# The static params of the epilogue; the others describe the product.
EPILOGUE_PARAMS = ("bias_batch", "activation", "save_preactivation")


def split_params(params: dict) -> tuple[dict, dict]:
  """A call's static params (``out_dtype`` aside) as (product params, epilogue params)."""
  epilogue_params = {k: params[k] for k in EPILOGUE_PARAMS}
  return {k: v for k, v in params.items() if k not in EPILOGUE_PARAMS}, epilogue_params


def contract(a, b, *, precision, **params) -> jax.Array:
  """``op(a) @ op(b)`` as one ``dot_general`` in the accumulation dtype, ``(*batch, M, N)``.

  Batch dims both operands have are dot batch dims; a dim only one operand
  has is a free dim of that operand, so nothing is broadcast. A dim neither
  has (only the bias has it) has size 1. ``params``: the batch masks of ``a``
  and ``b``, ``contract_batch`` and the transpose flags.
  """
  a_batch, b_batch, contract_batch = params["a_batch"], params["b_batch"], params["contract_batch"]
  a_axes, b_axes = _batch_axes(a_batch), _batch_axes(b_batch)
  both = [i for i, (x, y) in enumerate(zip(a_axes, b_axes)) if x is not None and y is not None]
  a_contract = [a.ndim - 2 if params["transpose_a"] else a.ndim - 1]
  b_contract = [b.ndim - 1 if params["transpose_b"] else b.ndim - 2]
  for i in range(contract_batch):
    a_contract.append(a.ndim - 2 - contract_batch + i)
    b_contract.append(b.ndim - 2 - contract_batch + i)
  out = lax.dot_general(
    a,
    b,
    ((a_contract, b_contract), ([a_axes[i] for i in both], [b_axes[i] for i in both])),
    precision=precision,
    preferred_element_type=acc_dtype(a.dtype, b.dtype),
  )
  # dot_general's result dims: shared batch, a's free dims, b's free dims.
  labels = (
    both
    + [i for i in range(len(a_batch)) if a_batch[i] and not b_batch[i]]
    + ["m"]
    + [i for i in range(len(a_batch)) if b_batch[i] and not a_batch[i]]
    + ["n"]
  )
  dims = sorted(i for i in labels if i not in ("m", "n"))
  perm = [labels.index(i) for i in dims + ["m", "n"]]
  out = out if perm == sorted(perm) else lax.transpose(out, perm)
  batch = output_batch([a.shape, b.shape], **dict(params, bias_batch=(False,) * len(a_batch)))
  return out.reshape(batch + out.shape[-2:])


def epilogue(acc, *bias, out_dtype, activation_fn=activate, **params) -> list[jax.Array]:
  """Bias and activation on the accumulator: ``[y]`` or ``[y, pre-activation]``.

  ``params``: the call's ``EPILOGUE_PARAMS``.
  """
  z = acc
  if bias:
    z = z + bias_like(bias[0], params["bias_batch"], acc.ndim).astype(acc.dtype)
  outs = [activation_fn(params["activation"], z).astype(out_dtype)]
  if params["save_preactivation"]:
    outs.append(z.astype(out_dtype))
  return outs


def matmul_xla(a, b, *bias, out_dtype, **params):
  """The XLA program of one call: one ``dot_general``, then the epilogue."""
  product, epilogue_params = split_params(params)
  return epilogue(contract(a, b, **product), *bias, out_dtype=out_dtype, **epilogue_params)
