"""Which normalisation: the three norm ops and their operand and result names.

One implementation serves ``rms_norm`` (scale only), ``layer_norm`` (centre,
scale, bias) and ``fused_add_rms_norm`` (add a residual first and return the
sum too), told apart by a static ``NormKind``. Every stage's operands and
results are named, and every name has a category that says how it is laid
out: a full row of ``x`` (``ROW``), a per-row statistic (``STAT``) or a
weight-like vector (``WEIGHT``).
"""

from __future__ import annotations

import dataclasses

ROW, STAT, WEIGHT = "row", "stat", "weight"
CATEGORY = {
  **dict.fromkeys(("x", "residual", "y", "h", "dy", "dh", "dx", "x_dot", "y_dot", "h_dot"), ROW),
  **dict.fromkeys(("mean", "rstd"), STAT),
  **dict.fromkeys(("w", "b", "w_dot", "b_dot", "dw", "db"), WEIGHT),
}


@dataclasses.dataclass(frozen=True)
class NormKind:
  """Which normalisation: centre (subtract the mean), bias, fused residual add.

  With ``residual``, the op normalises ``h = x + r`` and returns ``h`` too;
  the tangent and backward stages then see ``h`` as their ``x``.
  """

  center: bool = False
  bias: bool = False
  residual: bool = False

  def residuals(self) -> tuple[str, ...]:
    """The operands the tangent and backward stages share: ``x``, weight, statistics."""
    return ("x", "w") + ("mean",) * self.center + ("rstd",)

  def names(self, stage: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(operands, results) of ``stage`` in ``fwd``, ``jvp``, ``bwd``.

    The tangent stage is linear in its operands after ``residuals()``; the
    backward stage takes the cotangents of the tangent's results in their
    place and returns one gradient per linear operand.
    """
    center, bias, residual = self.center, self.bias, self.residual
    return {
      "fwd": (
        ("x",) + ("residual",) * residual + ("w",) + ("b",) * bias,
        ("y",) + ("h",) * residual + ("mean",) * center + ("rstd",),
      ),
      "jvp": (
        self.residuals() + ("x_dot", "w_dot") + ("b_dot",) * bias,
        ("y_dot",) + ("h_dot",) * residual,
      ),
      "bwd": (
        self.residuals() + ("dy",) + ("dh",) * residual,
        ("dx", "dw") + ("db",) * bias,
      ),
    }[stage]


RMS = NormKind()
LAYER = NormKind(center=True, bias=True)
ADD_RMS = NormKind(residual=True)
