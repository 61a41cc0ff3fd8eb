"""vmap rule for matmul: every batched call stays one kernel.

The vmapped axis becomes one more result batch dim; the operands that are
mapped have it, the others simply lack it (the primitive's batch masks), so
nothing is broadcast in memory and the call stays one ``matmul_p``.

Where the new dim goes decides what the kernel does with it. The kernel folds
the trailing batch dims that only ``a`` has into M, so when only ``a`` is
mapped the dim is placed last among the batch dims, next to ``a``'s rows: a
vmapped ``a`` times a shared weight is one GEMM with ``V * M`` rows (256
vectors times a shared ``[K, N]`` weight are one ``[256, K] @ [K, N]``). In
every other case it is placed first, a batch axis of the kernel grid.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from pallax.batching_utils import NOT_MAPPED


def matmul_rule(
  prim,
  args,
  bdims,
  *,
  a_batch: Sequence[bool],
  b_batch: Sequence[bool],
  bias_batch: Sequence[bool],
  transpose_a: bool,
  **params,
):
  mapped = [d is not NOT_MAPPED for d in bdims]
  masks = [tuple(a_batch), tuple(b_batch), tuple(bias_batch)]
  nb = len(a_batch)
  # Where neither b nor the bias has batch dims, all of a's fold into M
  # wherever the new one goes: keep it first, where a's mapped axis already
  # is (no copy).
  only_a = (
    mapped[0] and not any(mapped[1:]) and not transpose_a and (any(b_batch) or any(bias_batch))
  )
  pos = nb if only_a else 0
  args = list(args)
  for i, (d, is_mapped) in enumerate(zip(bdims, mapped)):
    if is_mapped:
      args[i] = jnp.moveaxis(args[i], d, sum(masks[i][:pos]))
  new = [m[:pos] + (i < len(args) and mapped[i],) + m[pos:] for i, m in enumerate(masks)]
  outs = prim.bind(
    *args, a_batch=new[0], b_batch=new[1], bias_batch=new[2], transpose_a=transpose_a, **params
  )
  return outs, [pos] * len(outs)
