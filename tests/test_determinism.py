"""pallax.determinism: XLA's flags for deterministic GPU ops, parsed as XLA parses its flags."""

import pytest

from pallax import determinism


@pytest.mark.parametrize(
  "flags, required",
  [
    ("", False),
    ("--xla_gpu_autotune_level=0", False),
    ("--xla_gpu_exclude_nondeterministic_ops=true", True),
    ("--xla_gpu_exclude_nondeterministic_ops", True),
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=false", False),
    # A flag's last setting wins; either flag on is enough.
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=false --xla_gpu_exclude_nondeterministic_ops=TRUE", True),
    ("--xla_gpu_deterministic_ops_extra=true", False),
    ('--xla_gpu_exclude_nondeterministic_ops="true"', True),
    # Parsing stops at the first word that is not a flag.
    ("--xla_gpu_autotune_level=0 stray --xla_gpu_deterministic_ops=true", False),
  ],
)
def test_required_reads_xla_flags_at_each_call(monkeypatch, flags, required):
  monkeypatch.setenv("XLA_FLAGS", flags)
  assert determinism.required() is required


def test_required_without_xla_flags(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert determinism.required() is False
  assert "--xla_gpu_exclude_nondeterministic_ops" in determinism.reason()


def test_required_reads_a_file_of_flags(monkeypatch, tmp_path):
  """XLA_FLAGS that does not start with "-" names a file of flags."""
  path = tmp_path / "flags"
  path.write_text("--xla_gpu_autotune_level=0\n--xla_gpu_deterministic_ops\n")
  monkeypatch.setenv("XLA_FLAGS", str(path))
  assert determinism.required() is True
  monkeypatch.setenv("XLA_FLAGS", str(tmp_path / "missing"))
  assert determinism.required() is False
