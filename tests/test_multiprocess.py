"""pallax across processes: a training step over two CPU processes equals one process's.

``examples/multihost.py`` runs as two processes on this machine
(``jax.distributed.initialize`` with a coordinator on 127.0.0.1, four host
CPU devices each) over a ``("sp", "tp")`` mesh of 4 x 2 devices: ``"sp"``
spans both processes and shards the activations' sequence dim, so causal
attention runs sequence-sharded across the process boundary; ``"tp"`` shards
the language-model head's weight along the vocabulary. Process 0 writes the
loss and every gradient; they must equal the same step computed here in one
process on one device, which is itself checked against the model in plain
JAX in float64. float32 tolerances: the shards sum in another order than one
device does (``helpers.TOL``: a max error of 1e-5 relative to the largest
value).
"""

import sys
from pathlib import Path

import jax
import numpy as np

from tests.helpers import TOL, outside_xdist, rel_err, x64

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ sits at the repository root, not installed
  sys.path.insert(0, str(ROOT))

from examples import multihost  # noqa: E402

TIMEOUT = 180  # seconds; the two processes took 8 to 25 s on two shared cores


def _one_process_step():
  """The loss and gradients of the example's step, unsharded, on this process's first device."""
  k_params, k_batch = jax.random.split(jax.random.key(0))
  params = multihost.init(k_params)
  tokens, labels = multihost.batch(k_batch)
  value, grads = jax.jit(multihost.train_step)(params, tokens, labels)
  with x64():
    params64 = {name: np.asarray(p, np.float64) for name, p in params.items()}
    want = jax.jit(jax.value_and_grad(multihost.reference_loss))(params64, tokens, labels)
  names = ["loss", *sorted(grads)]  # the order of jax.tree.leaves
  for name, got, ref in zip(names, jax.tree.leaves((value, grads)), jax.tree.leaves(want)):
    err = rel_err(got, ref)
    assert err < TOL["float32"], f"one process, {name}: error {err:.3g} against float64"
  return value, grads


def test_two_processes_equal_one(tmp_path):
  out = tmp_path / "step.npz"
  codes = multihost.run_local(2, str(out), devices=4, env=outside_xdist(), timeout=TIMEOUT)
  assert codes == [0, 0], f"the processes exited with {codes} (their output is above)"
  step = np.load(out)
  assert int(step["process_count"]) == 2 and int(step["device_count"]) == 8
  # Mesh axis "sp" (its rows) spans both processes, "tp" stays within one: the
  # sequence is sharded 4 ways, across the processes, the vocabulary 2 ways.
  assert step["mesh_processes"].tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
  assert int(step["sequence_shard"]) == multihost.SEQ // 4
  # The vocabulary-parallel head's gradient stays sharded like its weight.
  assert int(step["head_grad_shard"]) == multihost.VOCAB // 2

  value, grads = _one_process_step()
  err = rel_err(step["loss"], value)
  assert err < TOL["float32"], f"loss {float(step['loss'])} != {float(value)} (error {err:.3g})"
  assert sorted(k for k in step if k.startswith("grad_")) == sorted(f"grad_{n}" for n in grads)
  for name, want in grads.items():
    err = rel_err(step[f"grad_{name}"], want)
    assert err < TOL["float32"], f"gradient of {name}: error {err:.3g} against one process"
