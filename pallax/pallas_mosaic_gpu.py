"""What the Pallas Mosaic GPU (Hopper) kernels share: their two forms, SMEM layouts, launch.

A Mosaic GPU kernel runs compiled on sm_90a (H100, H200) and sm_100a, and
interpreted on the CPU by JAX's GPU interpreter, which runs most of the
constructs but not all (docs/mosaic_gpu.md): transposed ``wgmma`` operands,
register ``wgmma`` operands, ``pl.run_state`` accumulators and
``plgpu.layout_cast`` fail there. So each kernel has two forms with the same
tile maths, chosen by ``Form``: the Hopper form on a GPU, and the interpreted
form, which keeps the same warpgroups, barriers and tiles but takes the
transposed operands from GMEM, stages register operands through SMEM and
accumulates scoped accumulators by value.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallax._jax_private import mosaic_gpu_interpret_params, reset_mosaic_gpu_interpreter

# Shared memory a block may use on sm_90a with opt-in (H100, H200): 227 KiB.
SMEM_LIMIT = 232448
# Rows of one warpgroup's ``wgmma`` (its M): a consumer warpgroup's tile height.
WGMMA_ROWS = 64
# A consumer warpgroup's register budget after the producer gives its own up
# (``setmaxnreg``): 3 warpgroups share the 64K registers of an SM.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40


def swizzle_transforms(dtype, swizzle: int = 128) -> tuple[Any, ...]:
  """SMEM transforms for rows of ``swizzle`` bytes, swizzled: what TMA and ``wgmma`` want."""
  return (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


@dataclasses.dataclass(frozen=True)
class Form:
  """Which form of a kernel runs: the Hopper one (``hopper``) or the interpreted one."""

  hopper: bool

  @classmethod
  def of(cls, interpret: bool) -> Form:
    return cls(hopper=not interpret)

  @property
  def interpret(self) -> Any:
    """The kernel's ``interpret=`` argument: GPU interpret params, or None on a GPU."""
    return None if self.hopper else mosaic_gpu_interpret_params()

  def layout(self, x: jax.Array, layout: Any) -> jax.Array:
    """``plgpu.layout_cast`` on a GPU (a register layout hint); ``x`` interpreted."""
    return plgpu.layout_cast(x, layout) if self.hopper else x

  def iota(self, shape: Sequence[int], dim: int) -> jax.Array:
    """int32 positions along ``dim`` of a ``wgmma`` accumulator's tile."""
    if self.hopper:
      return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
    return lax.broadcasted_iota(jnp.int32, shape, dim)

  def registers(self, count: int, action: str) -> None:
    """Raises (``"increase"``) or gives up (``"decrease"``) a warpgroup's registers on a GPU."""
    if self.hopper:
      plgpu.set_max_registers(count, action=action)

  def barrier(self, values):
    """An optimization barrier on a GPU (it orders the softmax against the ``wgmma``)."""
    return lax.optimization_barrier(values) if self.hopper else values

  def accumulate(self, acc: jax.Array, product: Callable[[Any], None]) -> jax.Array:
    """``acc`` plus the ``wgmma`` products that ``product(acc_ref)`` issues, in float32.

    On a GPU the products accumulate in place (``pl.run_state`` of an
    accumulator initialised from ``acc``); interpreted they go to a fresh
    scoped accumulator that is added to ``acc`` (rounded once more).
    """
    if self.hopper:
      return pl.run_state(product)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
      product(acc_ref)
      plgpu.wgmma_wait(0)
      return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


# The GPU interpreter keeps global state: one interpreted kernel at a time.
_INTERPRETER = threading.Lock()


def on_host(kernel: Callable[..., Any], out_types: Sequence[Any], *operands: jax.Array) -> list:
  """Runs ``kernel``'s interpreted form on ``operands`` in a host callback.

  The GPU interpreter orders its simulation with an ordered IO callback,
  whose token a primitive's lowering has no way to thread through; a jitted
  call of its own, on the host, has. A kernel that raises leaves the
  interpreter's state poisoned: it is reset before the error goes on.
  """
  run = jax.jit(kernel)

  def host(*arrays):
    with _INTERPRETER:
      try:
        return [np.asarray(x) for x in run(*arrays)]
      except Exception:
        reset_mosaic_gpu_interpreter()
        raise

  return list(jax.pure_callback(host, tuple(out_types), *operands))


def smem_bytes(*buffers: tuple[Sequence[int], Any]) -> int:
  """Bytes of SMEM buffers given as ``(shape, dtype)``."""
  total = 0
  for shape, dtype in buffers:
    count = 1
    for n in shape:
      count *= n
    total += count * jnp.dtype(dtype).itemsize
  return total
