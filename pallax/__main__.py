"""``python -m pallax``: the self-check report; exits 1 if any op is wrong."""
import sys

import pallax  # noqa: F401  (registers every op's self-check)
from pallax.selfcheck import run

if __name__ == "__main__":
  sys.exit(0 if run() else 1)
