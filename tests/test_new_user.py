"""What a new user meets first: messages on a missing extra, a quiet ``import jax``.

Each check runs in a fresh interpreter (a subprocess), as the user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-c", code],
    env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    capture_output=True,
    text=True,
    check=False,
  )


@pytest.mark.parametrize("family", ["norm", "attention"])
@pytest.mark.parametrize("missing", ["triton", "jax_triton"])
def test_raw_triton_module_without_the_extra_names_it(family, missing):
  # A None entry in sys.modules makes `import <missing>` fail as if it were not installed.
  done = _python(
    f"import sys\nsys.modules[{missing!r}] = None\nimport pallax.kernels.{family}.triton_raw\n"
  )
  assert done.returncode != 0
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("ImportError: "), done.stderr[-2000:]
  assert f"pallax.kernels.{family}.triton_raw needs triton and jax-triton" in last
  assert "pip install 'pallax[triton]'" in last
