"""``python -m pallax``: reports every op, and fails when one is wrong."""
import io
import os
import subprocess
import sys

import jax.numpy as jnp

import pallax
from pallax.selfcheck import SelfCheck, run

OPS = ["matmul", "rms_norm", "layer_norm", "fused_add_rms_norm", "softmax", "log_softmax"]


def test_python_m_pallax_reports_every_op():
  out = subprocess.run([sys.executable, "-m", "pallax"], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stdout + out.stderr[-2000:]
  rows = [line.split()[0] for line in out.stdout.splitlines()[3:-1]]
  for op in OPS:
    # XLA path and both interpreted kernels, float32 and bfloat16.
    assert rows.count(op) == 6, (op, out.stdout)
  assert out.stdout.strip().endswith("all ops within tolerance")


def test_a_wrong_op_fails_the_report():
  def make_args(rng, dtype, small):
    return (jnp.asarray(rng.standard_normal((8, 128)), dtype),)

  wrong = SelfCheck("wrong_rms_norm", make_args,
                    op=lambda x: pallax.rms_norm(x) * 1.001,  # 1e-3 off: over the f32 tolerance
                    reference=lambda x: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6),
                    dtypes=(jnp.float32,))
  report = io.StringIO()
  assert run(report, checks=[wrong]) is False
  assert "FAIL" in report.getvalue() and "SOME OPS ARE WRONG" in report.getvalue()
