"""Runs the raw Triton kernels' interpreted suites (``interpreted_*.py``), each in its own process.

Triton chooses at import whether it interprets kernels (``TRITON_INTERPRET=1``)
or compiles them, and a process that did both is left in a bad state; so the
numerics of the raw Triton kernels, run by Triton's interpreter on the CPU,
are tested by an inner pytest per suite file, with the interpreter on and the
outer run's marker expression (``-m``). This process only lowers and
compiles raw kernels (``test_lowering_*``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_pytest

HERE = Path(__file__).resolve().parent
# The built-in raw kernels import jax-triton, which imports only where jaxlib has
# its CUDA plugin (the verify extra's); the custom-op example launches its kernel
# through Triton's interpreter alone.
SUITES = [
  pytest.param(p.name, marks=[] if p.name == "interpreted_custom_op.py" else pytest.mark.compilers)
  for p in sorted(HERE.glob("interpreted_*.py"))
]


@pytest.mark.parametrize("suite", SUITES)
def test_interpreted_suite(suite, request):
  markers = request.config.getoption("markexpr") or "not slow"
  done = run_pytest(
    [str(HERE / suite), "-n", "0", "-m", markers],
    HERE.parents[1],
    TRITON_INTERPRET="1",
    JAX_PLATFORMS="cpu",
  )
  summary = done.stdout[-6000:] + done.stderr[-2000:]
  assert done.returncode == 0, f"{suite} failed under Triton's interpreter:\n{summary}"
  assert " passed" in done.stdout, f"{suite} ran no test:\n{summary}"
