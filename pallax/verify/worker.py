"""A verify worker process: compile jobs read from stdin, one JSON result line each.

Run by ``pallax.verify.pool`` as ``python -m pallax.verify.worker`` in
``targets.compile_env()``. Results go to the original stdout; everything the
compilers print goes to stderr, which the pool keeps for crash reports.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
  results = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
  from pallax.verify.compile import compile_job  # after the redirect: imports may print
  from pallax.verify.sweep import MODULES_ENV, import_modules

  import_modules([n for n in os.environ.get(MODULES_ENV, "").split(",") if n])

  results.write(json.dumps({"ready": True}) + "\n")
  for line in sys.stdin:
    results.write(json.dumps(compile_job(json.loads(line))) + "\n")


if __name__ == "__main__":
  main()
