"""What a new user meets first: messages on a missing extra or bad lengths, a quiet ``import jax``.

The import checks run in a fresh interpreter (a subprocess), as the user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax


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


# ------------------------------------------------------------------------------
# Sequence lengths: concrete negative values are refused, alike in both attention ops.


def _attention_args(b=2, t=8, s=8, n=2, h=16):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((b, s, n, h)), jnp.float32)
  return q, kv


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_attention_refuses_negative_concrete_lengths(name):
  q, kv = _attention_args()
  lengths = {name: jnp.asarray([-2, 5], jnp.int32)}
  with pytest.raises(
    ValueError, match=rf"^dot_product_attention: {name} must be >= 0, got values from -2 to 5$"
  ):
    pallax.dot_product_attention(q, kv, kv, **lengths)


def test_attention_traced_lengths_are_clamped_as_before():
  """Inside ``jit`` the values are unknown: a negative length hides all, like 0."""
  q, kv = _attention_args()
  run = jax.jit(lambda n: pallax.dot_product_attention(q, kv, kv, key_value_seq_lengths=n))
  got = run(jnp.asarray([-2, 5], jnp.int32))
  want = pallax.dot_product_attention(
    q, kv, kv, key_value_seq_lengths=jnp.asarray([0, 5], jnp.int32)
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.asarray(got[0]).any()


def test_paged_attention_length_message_is_the_shared_one():
  q = jnp.ones((2, 4, 16), jnp.float32)
  pages = jnp.ones((2, 6, 4, 16), jnp.float32)
  table = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
  with pytest.raises(
    ValueError,
    match=r"^paged_attention: lengths must lie in \[0, pages_per_sequence \* page_size\] = "
    r"\[0, 12\], got values from -1 to 3$",
  ):
    pallax.paged_attention(q, pages, pages, jnp.asarray([-1, 3], jnp.int32), table)
