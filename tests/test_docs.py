"""Every code block of README.md and docs/*.md runs, as a reader would run it.

A fenced block's language says what it is:

* ``python``: a program. The blocks of a file run one after another in a
  fresh process (``JAX_PLATFORMS=cpu``; one process a core, each taking
  whole files), each block in a namespace of its own, so every block must be
  self-contained: its imports, its inputs. A block that raises fails the
  test, which names the file and line of every block that raised. Blocks
  check their own results where they compute something (``assert`` against
  ``jax.nn`` or plain ``jnp``), so a wrong answer fails too.
* ``bash`` / ``sh`` / ``console``: commands, one a line (a line ending in
  ``\\`` continues on the next; in ``console`` blocks only lines starting
  with ``$`` are commands, the rest is their output). The commands of one
  block run in order (the blocks side by side, one a core), each under
  ``bash`` with ``JAX_PLATFORMS=cpu`` and the block's own fresh
  ``PALLAX_CACHE_DIR``, in a scratch directory of the block's that links the
  repository's top-level entries except the package sources (so relative
  paths such as ``examples.train_step`` or ``tests/verify`` resolve, and
  the files a command writes land in the scratch directory). A command
  must exit 0 within ``COMMAND_TIMEOUT`` seconds. Exceptions:

  - ``pip install ...`` lines are not run (the test extra is installed).
    A block that installs the ``verify`` extra needs its compilers: it runs
    in ``test_shell_blocks_with_the_compilers`` (marker ``compilers``).
  - The README's test command is what CI runs: the test asserts that
    ``.ci/run`` runs it verbatim, and does not start the suite from inside it.
  - A command too long for a test carries a trailing ``# slow: <why>``
    comment, which a reader sees as its cost. It is not run; its program
    (``pytest``, ``python -m pallax.verify``: the words before the first
    option, without environment assignments) is run with ``--help``, once
    per program, which must exit 0 and list every ``--option`` the command
    passes itself (not those after a ``--`` separator, which go on to
    pytest), so a renamed or removed flag still fails.

* ``text`` / ``output``: what a command prints, a layout, a formula: not
  code, not run.

Any other language, or none, fails the test: a new block says what it is.
Relative links between the files, and their ``#anchors``, must resolve.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "console"}
NOT_CODE = {"text", "output"}
COMMAND_TIMEOUT = 120
# The package sources: a command must import pallax as installed, not from a link.
NOT_LINKED = {"pallax", "kernels", "primitives", "batching_rules", ".git", "pallax.egg-info"}


@dataclasses.dataclass(frozen=True)
class Block:
  path: Path
  line: int  # of the opening fence, 1-based
  language: str
  source: str

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
  """The fenced code blocks of a Markdown file."""
  found, fence, start, language, body = [], None, 0, "", []
  for number, line in enumerate(path.read_text().splitlines(), 1):
    stripped = line.strip()
    if fence is None:
      match = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
      if match:
        fence, start, language, body = match.group(1), number, match.group(2).lower(), []
    elif stripped.startswith(fence) and not stripped[len(fence) :].strip():
      found.append(Block(path, start, language, textwrap.dedent("\n".join(body)) + "\n"))
      fence = None
    else:
      body.append(line)
  assert fence is None, f"{path.name}: the block opened at line {start} is never closed"
  return found


ALL_BLOCKS = [b for path in DOCS for b in blocks(path)]
README_TEST_COMMAND = "pip install -e '.[test]' && pytest"


def split_comment(line: str) -> tuple[str, str]:
  """``command # comment`` split at the first ``#`` outside quotes that starts a word."""
  quote = None
  for i, char in enumerate(line):
    if quote:
      quote = None if char == quote else quote
    elif char in "'\"":
      quote = char
    elif char == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip(), line[i + 1 :].strip()
  return line.rstrip(), ""


def commands(block: Block) -> list[tuple[str, str]]:
  """``(command, comment)`` per command of a shell block."""
  lines, out, pending = block.source.splitlines(), [], ""
  for line in lines:
    if block.language == "console":
      if not (pending or line.startswith("$ ")):
        continue  # output
      line = line[2:] if not pending else line
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    command, comment = split_comment(pending + line)
    pending = ""
    if command.strip():
      out.append((command.strip(), comment))
  return out


def option_flags(command: str) -> list[str]:
  """The ``--options`` a command passes itself (not those after a ``--`` separator)."""
  own = command.split(" -- ")[0]
  return sorted({m.group(1) for m in re.finditer(r"(?<!\S)(--[\w-]+)", own)})


def scratch_dir(base: Path) -> Path:
  """A directory in ``base`` linking the top-level entries of the repository but its sources."""
  work = base / "work"
  work.mkdir()
  for entry in ROOT.iterdir():
    if entry.name not in NOT_LINKED:
      (work / entry.name).symlink_to(entry)
  return work


def environment(base: Path) -> dict[str, str]:
  """The environment a reader's shell would have, on the CPU, with a cache in ``base``."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env.update(JAX_PLATFORMS="cpu", PALLAX_CACHE_DIR=str(base / "cache"))
  env.pop("PALLAX_INTERPRET", None)
  env.pop("PALLAX_POLICY", None)
  return env


def run(command: str, cwd: Path, env: dict, where: str) -> str:
  result = subprocess.run(
    ["bash", "-c", command],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=COMMAND_TIMEOUT,
  )
  output = result.stdout + result.stderr
  assert result.returncode == 0, (
    f"{where}: `{command}` exited {result.returncode}:\n{output[-4000:]}"
  )
  return output


# ----------------------------------------------------------------------------
# The blocks' languages, links and the README's test command.


def test_every_block_says_what_it_is():
  assert ALL_BLOCKS, "no code blocks found"
  unknown = [
    f"{b.where} ({b.language or 'no language'})"
    for b in ALL_BLOCKS
    if b.language not in {"python", *SHELL, *NOT_CODE}
  ]
  assert not unknown, f"blocks of unknown language: {unknown}"


def test_readme_test_command_is_what_ci_runs():
  readme = [c for b in ALL_BLOCKS if b.path.name == "README.md" for c, _ in commands(b)]
  assert README_TEST_COMMAND in readme, "the README lost its test command"
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert any(line.strip().startswith(README_TEST_COMMAND) for line in ci), (
    f".ci/run does not run the README's test command `{README_TEST_COMMAND}`"
  )


def _anchor(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(path):
  text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):
      continue  # https:, mailto:
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.exists():
      broken.append(target)
    elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
      broken.append(target)
  assert not broken, f"{path.name}: links that do not resolve: {broken}"


# ----------------------------------------------------------------------------
# Python blocks: one process a core, each running whole files.

_RUNNER = """
import json, sys, traceback
failed = []
for where, source in json.load(sys.stdin):
  try:
    exec(compile(source, where, "exec"), {"__name__": "__main__"})
  except BaseException:
    failed.append(where)
    print(f"=== the python block at {where} raised:", file=sys.stderr)
    traceback.print_exc()
  else:
    print(f"=== ran {where}", flush=True)
sys.exit(f"python blocks that raised: {failed}" if failed else 0)
"""

PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.language == "python"]


def _run_python_blocks(todo: list[tuple[str, str]], cwd: Path, env: dict) -> str:
  """Runs blocks in one fresh process; what went wrong, or "" if every block ran."""
  result = subprocess.run(
    [sys.executable, "-c", _RUNNER],
    input=json.dumps(todo),
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=COMMAND_TIMEOUT,
  )
  lines = result.stdout.splitlines()
  ran = [line.removeprefix("=== ran ") for line in lines if line.startswith("=== ran ")]
  if result.returncode or ran != [where for where, _ in todo]:
    return result.stderr[-6000:] or result.stdout[-2000:]
  return ""


def test_python_blocks(tmp_path):
  cwd, env = scratch_dir(tmp_path), environment(tmp_path)
  files = {}
  for b in PYTHON_BLOCKS:
    files.setdefault(b.path, []).append((b.where, b.source))
  # One process a core, each running whole files (the most blocks to the least loaded).
  processes = [[] for _ in range(min(os.cpu_count() or 1, len(files)))]
  for todo in sorted(files.values(), key=len, reverse=True):
    min(processes, key=len).extend(todo)
  with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
    errors = list(pool.map(lambda todo: _run_python_blocks(todo, cwd, env), processes))
  assert not any(errors), "\n".join(e for e in errors if e)


# ----------------------------------------------------------------------------
# Shell blocks: every command runs, in order, in the block's scratch directory.

SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.language in SHELL]


def program(command: str) -> str:
  """The program a command runs: its words up to the first option, environment assignments dropped.

  ``PALLAX_TEST_PLATFORM=gpu pytest -n 0 tests/verify`` runs ``pytest``;
  ``python -m pallax.verify --ops x`` runs ``python -m pallax.verify``.
  """
  words = shlex.split(command)
  while words and re.match(r"\w+=", words[0]):
    words = words[1:]
  head = ["python", "-m", words[2]] if words[:2] == ["python", "-m"] else words[:1]
  return shlex.join(head)


def plan(block: Block) -> tuple[list[str], list[str]]:
  """A shell block's commands to run, in order, and its ``# slow:`` ones (checked by --help)."""
  to_run, slow = [], []
  for command, comment in commands(block):
    if command.startswith("pip install") or command == README_TEST_COMMAND:
      continue  # installed already; CI runs the suite (test_readme_test_command_is_what_ci_runs)
    (slow if comment.startswith("slow:") else to_run).append(command)
  return to_run, slow


def _run_block(block: Block, commands: list[str], base: Path) -> str:
  """Runs commands in order in a scratch directory of their own: the first failure, or ""."""
  base.mkdir()
  cwd, env = scratch_dir(base), environment(base)
  try:
    for command in commands:
      run(command, cwd, env, block.where)
  except AssertionError as error:
    return str(error)
  return ""


def needs_compilers(block: Block) -> bool:
  """Whether a shell block installs the ``verify`` extra (its commands compile for GPUs, TPUs)."""
  return any(c.startswith("pip install") and "verify" in c for c, _ in commands(block))


def _check_blocks(blocks: list[Block], tmp_path: Path) -> None:
  """Runs ``blocks`` side by side (one a core) and checks their slow commands' options."""
  plans = [(block, *plan(block)) for block in blocks]
  programs = sorted({program(c) for _, _, slow in plans for c in slow})
  help_dir = tmp_path / "help"
  help_dir.mkdir()
  cwd, env = scratch_dir(help_dir), environment(help_dir)
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    helps = {name: pool.submit(run, f"{name} --help", cwd, env, name) for name in programs}
    runs = [
      pool.submit(_run_block, block, to_run, tmp_path / f"block{i}")
      for i, (block, to_run, _) in enumerate(plans)
    ]
    errors = [done.result() for done in runs]
    helps = {name: done.result() for name, done in helps.items()}
  for block, _, slow in plans:
    for command in slow:
      missing = [flag for flag in option_flags(command) if flag not in helps[program(command)]]
      if missing:
        errors.append(f"{block.where}: `{command}` uses options its --help lacks: {missing}")
  assert not any(errors), "\n\n".join(e for e in errors if e)


def test_shell_blocks(tmp_path):
  """Every shell block's commands but those that need the verify compilers."""
  _check_blocks([b for b in SHELL_BLOCKS if not needs_compilers(b)], tmp_path)


@pytest.mark.compilers
def test_shell_blocks_with_the_compilers(tmp_path):
  """The shell blocks that install the ``verify`` extra: they compile for H100 and TPUs."""
  blocks = [b for b in SHELL_BLOCKS if needs_compilers(b)]
  assert len(blocks) >= 2, "docs/verify.md and docs/custom_ops.md compile kernels"
  _check_blocks(blocks, tmp_path)
