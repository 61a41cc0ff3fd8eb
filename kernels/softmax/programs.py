"""The softmax kernels' row programs: what each kernel computes, block by block.

Every kernel is one two-phase row program (``RowProgram``): a reduction over
the row's column blocks into per-row accumulators, then an elementwise pass
over the same column blocks that writes the output. The forward reduction is
the online softmax (running max ``m`` and running sum ``l`` of
``exp(x - m)``, rescaled when the max grows), so a row never has to fit in one
block. ``triton.py`` and ``mosaic_tpu.py`` run the programs on their backend.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallax.kernels.softmax.config import SoftmaxConfig
from pallax.pallas_utils import RowBlocks, masked


@dataclasses.dataclass(frozen=True)
class RowProgram:
  """A reduction over a row's column blocks, then an elementwise pass.

  name: the kernel's name.
  arity: how many data operands it reads (a ``where=`` mask may follow them);
    the output has the last one's dtype.
  init: initial values of the per-row accumulators (each ``(block_rows, 1)``).
  accumulate: ``(acc, data, keep) -> acc`` folds one column block in; ``keep``
    (None: all) marks the entries that take part: in bounds and not masked.
  emit: ``(acc, data, mask) -> block`` of the output; ``mask`` is the
    ``where=`` block (None without one).
  ``data`` are the data operands' blocks in the stats dtype.
  """

  name: str
  arity: int
  init: tuple[float, ...]
  accumulate: Callable[..., tuple]
  emit: Callable[..., jax.Array]


def _online_step(m, x, keep):
  """One column block of an online softmax over the kept entries of ``x``.

  Returns the new running max, the factor rescaling sums taken against the
  old max, and ``exp(x - max)`` (0 where not kept). Rows whose max is still
  -inf shift by 0 instead (their kept entries are all -inf, so they add
  exp(-inf) = 0), so sums never become NaN from -inf - -inf.
  """
  x = masked(x, keep, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(x, axis=-1, keepdims=True))
  shift = _shift(m_new)
  return m_new, jnp.exp(m - shift), jnp.exp(x - shift)


def _shift(m):
  """What a row's entries are shifted by: its max, or 0 while the max is -inf."""
  return jnp.where(m == -jnp.inf, 0, m)


def _row_sum(x):
  return jnp.sum(x, axis=-1, keepdims=True)


def _online_max_sum(acc, data, keep):
  """Running max ``m`` and sum ``l`` of ``exp(x - m)``, over the kept entries."""
  (m, total), (x,) = acc, data
  m, scale, e = _online_step(m, x, keep)
  return m, total * scale + _row_sum(e)


def _online_softmax_dot(acc, data, keep):
  """``_online_max_sum`` of ``x`` and the running sum of ``exp(x - m) * t``: ``data = (x, t)``."""
  (m, total, dot), (x, t) = acc, data
  m, scale, e = _online_step(m, x, keep)
  return m, total * scale + _row_sum(e), dot * scale + _row_sum(masked(e * t, keep, 0))


def _online_softmax_and_sum(acc, data, keep):
  """``_online_max_sum`` of ``x`` and the sum of ``g`` over the kept entries: ``data = (x, g)``."""
  (m, total, s), (x, g) = acc, data
  m, scale, e = _online_step(m, x, keep)
  return m, total * scale + _row_sum(e), s + _row_sum(masked(g, keep, 0))


def _softmax_emit(acc, data, mask):
  (m, total), (x,) = acc, data
  return masked(jnp.exp(x - m) / total, mask, 0)


def _log_softmax_emit(acc, data, mask):
  (m, total), (x,) = acc, data
  return masked((x - m) - jnp.log(total), mask, -jnp.inf)


def _sum_of(term):
  """An accumulate function: the running row sum of ``term(*data)`` over kept entries."""

  def accumulate(acc, data, keep):
    (s,) = acc
    return (s + _row_sum(masked(term(*data), keep, 0)),)

  return accumulate


def _softmax_bwd_emit(acc, data, mask):
  (s,), (y, v) = acc, data
  return masked(y * (v - s), mask, 0)


def _log_softmax_jvp_emit(acc, data, mask):
  (_, total, dot), (_, t) = acc, data
  return masked(t - dot / total, mask, 0)


def _log_softmax_bwd_emit(acc, data, mask):
  (m, total, s), (x, g) = acc, data
  return masked(g - jnp.exp(x - _shift(m)) * (s / total), mask, 0)


_SOFTMAX_FWD = RowProgram("softmax_fwd", 1, (-math.inf, 0.0), _online_max_sum, _softmax_emit)
_LOG_SOFTMAX_FWD = RowProgram(
  "log_softmax_fwd", 1, (-math.inf, 0.0), _online_max_sum, _log_softmax_emit
)
_SOFTMAX_BWD = RowProgram("softmax_bwd", 2, (0.0,), _sum_of(lambda y, v: y * v), _softmax_bwd_emit)
_LOG_SOFTMAX_JVP = RowProgram(
  "log_softmax_jvp", 2, (-math.inf, 0.0, 0.0), _online_softmax_dot, _log_softmax_jvp_emit
)
_LOG_SOFTMAX_BWD = RowProgram(
  "log_softmax_bwd", 2, (-math.inf, 0.0, 0.0), _online_softmax_and_sum, _log_softmax_bwd_emit
)

PROGRAMS = {
  p.name: p
  for p in (_SOFTMAX_FWD, _LOG_SOFTMAX_FWD, _SOFTMAX_BWD, _LOG_SOFTMAX_JVP, _LOG_SOFTMAX_BWD)
}


def run_rows(
  backend_call: Callable,
  *operands: jax.Array,
  program: RowProgram,
  config: SoftmaxConfig,
  backend: str,
  interpret,
) -> list[jax.Array]:
  """Runs ``program`` over the rows of its operands with a backend's ``pallas_call``.

  ``operands`` are ``program.arity`` data arrays of one shape ``(*lead, cols)``
  and an optional bool mask of that shape. ``backend_call(program, data, mask,
  out_dtype, blocks, config, interpret)`` runs the kernel on the ``(rows,
  cols)`` view.
  """
  data, mask = operands[: program.arity], (operands[program.arity :] or [None])[0]
  shape, out_dtype = data[0].shape, data[-1].dtype
  if math.prod(shape) == 0:
    return [jnp.zeros(shape, out_dtype)]
  rows, cols = math.prod(shape[:-1]), shape[-1]
  blocks = RowBlocks.of(rows, cols, config.block_rows, config.block_cols, backend)
  flat = [a.reshape(rows, cols) for a in data]
  # Bool refs are not portable across Pallas backends: the mask travels as int8.
  mask = None if mask is None else mask.reshape(rows, cols).astype(jnp.int8)
  out = backend_call(program, flat, mask, out_dtype, blocks, config, interpret)
  return [out.reshape(shape)]
