"""The global interpret switch.

``with pallax.interpret():`` (or ``PALLAX_INTERPRET=1`` in the environment)
makes every pallax op lower to its Pallas kernel run with ``interpret=True``,
on any platform, so the GPU/TPU kernel code is exercised on a CPU. The flag is
part of JAX's jit cache key: toggling it re-lowers jitted functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal, Optional

from pallax._jax_private import enum_flag
from pallax.executor.implementation import interpreters

Backend = Literal["triton", "mosaic_tpu", "mosaic_gpu"]
# The Pallas implementations' interpreters, as ``pallax.executor.implementation``
# registers the built-in ones: a built-in backend registered there with an
# interpreter is interpreted under the switch too (the switch's choices are
# fixed when this module is imported, so a user's later registration is not).
BACKENDS: tuple[str, ...] = interpreters()

_ENV_ALIASES = {
  "": "off",
  "0": "off",
  "off": "off",
  "false": "off",
  "1": "triton",
  "true": "triton",
  "gpu": "triton",
  "triton": "triton",
  "tpu": "mosaic_tpu",
  "mosaic_tpu": "mosaic_tpu",
  "hopper": "mosaic_gpu",
  "mosaic_gpu": "mosaic_gpu",
}


def _default_from_env() -> str:
  raw = os.environ.get("PALLAX_INTERPRET", "").strip().lower()
  if raw not in _ENV_ALIASES:
    raise ValueError(
      f"PALLAX_INTERPRET={raw!r} is not understood; use 0, 1, triton, tpu or mosaic_gpu"
    )
  return _ENV_ALIASES[raw]


_MODE = enum_flag(
  "pallax_interpret_mode",
  ("off",) + BACKENDS,
  _default_from_env(),
  help="Run pallax ops as interpreted Pallas kernels (off, triton, mosaic_tpu, mosaic_gpu).",
)


@contextlib.contextmanager
def interpret(backend: Backend = "triton") -> Iterator[None]:
  """Runs every pallax op inside the block as an interpreted Pallas kernel.

  Args:
    backend: which kernel flavour to interpret: ``"triton"`` (the GPU kernel,
      power-of-two blocks with masking), ``"mosaic_tpu"`` (the TPU kernel,
      (8, 128)-aligned blocks) or ``"mosaic_gpu"`` (what an H100 runs: the
      Mosaic GPU kernels where an op has one that takes the call, in JAX's
      GPU interpreter, and the Triton kernels elsewhere).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  with _MODE(backend):
    yield


def interpret_backend() -> Optional[Backend]:
  """The backend being interpreted, or None when the switch is off."""
  mode = _MODE.value
  return None if mode == "off" else mode  # type: ignore[return-value]
