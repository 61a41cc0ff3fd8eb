"""What a new user meets first: messages on a missing extra or bad lengths, a quiet ``import jax``.

The import checks run in a fresh interpreter (a subprocess), as the user's would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tomllib
from packaging.requirements import Requirement

import pallax


def _python(code: str, *, unset: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
  environ = {
    k: v for k, v in {**os.environ, "JAX_PLATFORMS": "cpu", **env}.items() if k not in unset
  }
  return subprocess.run(
    [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=False
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


# ------------------------------------------------------------------------------
# A quiet import: the verify extra's CUDA plugin and libtpu on a machine without either device.

_FIRST_OP = (
  "import jax, jax.numpy as jnp, pallax\n"
  "pallax.rms_norm(jnp.ones((4, 8)), jnp.ones(8)).block_until_ready()\n"
)


@pytest.mark.compilers  # the CUDA plugin's traceback: only where the plugin is installed
def test_first_op_logs_no_cuda_plugin_error():
  """JAX_PLATFORMS unset, as a new user runs: JAX initialises every installed plugin."""
  # Without the variable pallax sets (this process inherited it from its own import of pallax).
  done = _python(_FIRST_OP, unset=("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"))
  assert done.returncode == 0, done.stderr[-3000:]
  for noise in ("Jax plugin configuration error", "Unable to load CUDA", "Traceback"):
    assert noise not in done.stderr, done.stderr[-3000:]


def test_on_the_cpu_platform_only_the_cuda_kernels_import_lines_remain():
  """With JAX_PLATFORMS=cpu, the rest is what ``import jax`` itself prints.

  jaxlib imports the CUDA plugin's kernel modules when jax is imported
  (before pallax is), and each logs that it found no CUDA driver; no
  environment variable turns that off. Nothing else may print: no libtpu
  lines, no traceback, nothing from pallax.
  """
  done = _python(_FIRST_OP, unset=("JAX_SKIP_CUDA_CONSTRAINTS_CHECK",))
  assert done.returncode == 0, done.stderr[-3000:]
  cuda_stub = ("cudart_stub.cc", "All log messages before absl::InitializeLog()")
  others = [line for line in done.stderr.splitlines() if not any(s in line for s in cuda_stub)]
  assert others == [], done.stderr[-3000:]


# ------------------------------------------------------------------------------
# The JAX versions pallax installs next to.


def _requirements(extra: str = "") -> dict:
  project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
  lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
  return {r.name: r for r in map(Requirement, lines)}


def _installed_by(extra: str) -> set[str]:
  """The distributions ``pip install 'pallax[extra]'`` asks for, following ``pallax[...]`` in it."""
  names, extras, seen = set(), [extra], set()
  while extras:
    current = extras.pop()
    seen.add(current)
    for name, requirement in _requirements(current).items():
      if name == "pallax":
        extras += [e for e in requirement.extras if e not in seen]
      else:
        names.add(name)
  return names


def test_the_test_extra_leaves_the_compilers_out():
  """A development install imports quietly: installed, the CUDA plugin's kernel modules
  log at every ``import jax`` that there is no CUDA driver (docs/verify.md)."""
  compilers = set(_requirements("verify")) - {"jaxlib"}
  assert compilers == {"jax-cuda12-plugin", "nvidia-cuda-nvcc-cu12", "libtpu"}
  assert _installed_by("test") & compilers == set()
  assert "triton" in _installed_by("test")


def test_jax_pin_admits_0_10_2_through_0_11():
  for name, requirement in _requirements().items():
    if name in ("jax", "jaxlib"):
      for version in ("0.10.2", "0.11.0", "0.11.2"):
        assert requirement.specifier.contains(version), (name, version)
      for version in ("0.10.1", "0.12.0"):
        assert not requirement.specifier.contains(version), (name, version)
  assert _requirements("cuda12")["jax"].specifier == _requirements()["jax"].specifier


def test_verify_compilers_match_the_jaxlib_they_pin():
  verify = _requirements("verify")
  (jaxlib,) = verify["jaxlib"].specifier
  (plugin,) = verify["jax-cuda12-plugin"].specifier
  assert jaxlib.operator == plugin.operator == "==" and jaxlib.version == plugin.version
  assert _requirements()["jaxlib"].specifier.contains(jaxlib.version)


@pytest.mark.parametrize("transposed", [False, True])
def test_linear_cross_entropy_names_the_flag_that_reads_the_other_layout(transposed):
  x, labels = jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)
  weight = jnp.ones((8, 16)) if transposed else jnp.ones((16, 8))  # the other layout
  flag = f"transposed_weight={not transposed}"
  with pytest.raises(ValueError, match=flag) as err:
    pallax.linear_cross_entropy(x, weight, labels, transposed_weight=transposed)
  assert ("(V, D)" if transposed else "(D, V)") in str(err.value)
  # A weight that fits neither layout gets no such hint.
  with pytest.raises(ValueError) as err:
    pallax.linear_cross_entropy(x, jnp.ones((5, 3)), labels, transposed_weight=transposed)
  assert "transposed_weight=" not in str(err.value)
