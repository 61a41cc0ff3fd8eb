"""``python -m pallax [--quick]``: the self-check report; exits 1 if any op is wrong.

Per public op (every op an op family registers, ``pallax.family``) and dtype
(float32, bfloat16): the implementation chosen on this machine and its
config, the forward and gradient relative errors against float64 (``—`` for
the gradient of an inference op, paged_attention) and pallax's time relative
to plain JAX (the median over interleaved pairs of calls, ± its 95% interval,
or ``unreliable`` on a machine too busy to tell; see
``pallax.selfcheck.measure_ratio``); then the same errors for the interpreted
Triton and Mosaic TPU kernels at small sizes, and Mosaic GPU's where an op
has one that takes the call. ``--quick`` uses the small sizes everywhere,
with times that are mostly dispatch overhead: on 2 CPU cores about a minute
and a half instead of three and a half (most of it compiling each op's, its
gradient's and the interpreted kernels' programs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

from pallax.selfcheck import run

_DESCRIPTION = (
  "pallax self-check: per public op, its implementation, errors against float64 "
  "and time relative to plain JAX. Exits 1 if any op is over its tolerance."
)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Parses ``argv``, prints the report and returns the exit status (0: every op right)."""
  parser = argparse.ArgumentParser(prog="python -m pallax", description=_DESCRIPTION)
  parser.add_argument(
    "--quick",
    action="store_true",
    help="small sizes everywhere (on 2 CPU cores about 1.5 minutes, not 3.5); times are then "
    "mostly dispatch overhead",
  )
  args = parser.parse_args(argv)
  return 0 if run(quick=args.quick) else 1


if __name__ == "__main__":
  sys.exit(main())
