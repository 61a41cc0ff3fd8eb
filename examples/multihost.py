"""One training step of a small transformer on pallax ops, run as one of several processes.

The same program runs on every host of a cluster (docs/multihost.md). Each
process calls ``jax.distributed.initialize``, builds one mesh over the
devices of all processes and hands in its own slice of the batch with
``jax.make_array_from_process_local_data``; pallax's ops then shard by
their inputs' shardings, collectives crossing the process boundary where
the mesh does:

* the mesh is ``("sp", "tp")``, its devices in process order: axis
  ``"sp"`` runs across the processes, ``"tp"`` within each one (on a
  cluster: tensor parallelism inside a host, context parallelism across
  hosts);
* the sequence dim of the activations (and so attention's query, key and
  value sequence dim) is sharded over ``"sp"``: causal attention runs
  sequence-sharded across the process boundary (context parallelism);
* the language-model head's ``(width, vocab)`` weight is sharded along the
  vocabulary over ``"tp"`` (a tensor-parallel head):
  ``pallax.linear_cross_entropy`` combines its statistics across the
  shards and never gathers the weight or the logits. (Sharding the
  vocabulary over ``"sp"`` too would make it gather the weight: the tokens
  already use that axis.)

The model is one pre-norm block (``pallax.rms_norm``, ``pallax.matmul``
projections, causal ``pallax.dot_product_attention``, a GELU MLP) and the
head's ``pallax.linear_cross_entropy``; ``train_step`` returns the loss and
the gradients of every parameter. ``reference_loss`` is the same model in
plain JAX (``jax.nn``, materialised logits). Process 0 writes the loss, the
gradients (gathered from every process) and what the run saw (process
count, device count, the process of each device of the mesh, the shards'
sizes) to an ``.npz`` file, which ``tests/test_multiprocess.py`` compares
with a one-process run.

Run from the repository root, two processes on this machine with four CPU
devices each::

  python -m examples.multihost --local 2 --out step.npz

or start each process yourself (``--coordinator``, ``--num-processes``,
``--process-id``), or, on a cluster whose environment
``jax.distributed.initialize()`` reads (SLURM, TPU pods), with no
arguments but ``--out``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax

# A batch of 2 sequences of 32 tokens (8 a shard of "sp"), width 32, 4 heads
# of 8, an MLP of 64, a vocabulary of 64 (32 a shard of "tp").
BATCH, SEQ, WIDTH, HEADS, HIDDEN, VOCAB = 2, 32, 32, 4, 64, 64
TENSOR = 2  # the size of mesh axis "tp"

Params = dict[str, jax.Array]


def init(key: jax.Array) -> Params:
  """Random float32 parameters of the one-block model."""
  keys = iter(jax.random.split(key, 9))
  normal = lambda shape, fan_in: jax.random.normal(next(keys), shape) * fan_in**-0.5
  norm = lambda: 1.0 + 0.1 * jax.random.normal(next(keys), (WIDTH,))
  return {
    "embedding": normal((VOCAB, WIDTH), 1.0),
    "norm_attn": norm(),
    "w_qkv": normal((WIDTH, 3 * WIDTH), WIDTH),
    "w_out": normal((WIDTH, WIDTH), WIDTH),
    "norm_mlp": norm(),
    "w_up": normal((WIDTH, HIDDEN), WIDTH),
    "w_down": normal((HIDDEN, WIDTH), HIDDEN),
    "norm_head": norm(),
    "w_head": normal((WIDTH, VOCAB), WIDTH),
  }


def batch(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Random ``(BATCH, SEQ)`` tokens and the next-token labels."""
  sequence = jax.random.randint(key, (BATCH, SEQ + 1), 0, VOCAB)
  return sequence[:, :-1], sequence[:, 1:]


def loss(params: Params, tokens: jax.Array, labels: jax.Array) -> jax.Array:
  """The mean next-token cross-entropy of the one-block model.

  Args:
    params: as ``init`` returns them.
    tokens: ``(batch, seq)`` token ids.
    labels: ``(batch, seq)`` the ids to predict.

  Returns:
    The scalar loss, float32.
  """
  b, t = tokens.shape
  heads = lambda a: a.reshape(b, t, HEADS, WIDTH // HEADS)
  x = params["embedding"][tokens]  # (batch, seq, width)
  q, k, v = jnp.split(
    pallax.matmul(pallax.rms_norm(x, params["norm_attn"]), params["w_qkv"]), 3, -1
  )
  attended = pallax.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
  x = x + pallax.matmul(attended.reshape(b, t, WIDTH), params["w_out"])
  h = pallax.matmul(pallax.rms_norm(x, params["norm_mlp"]), params["w_up"], activation="gelu")
  x = x + pallax.matmul(h, params["w_down"])
  return pallax.linear_cross_entropy(
    pallax.rms_norm(x, params["norm_head"]), params["w_head"], labels
  )


def reference_loss(params: Params, tokens: jax.Array, labels: jax.Array) -> jax.Array:
  """``loss`` in plain JAX (``jax.nn``, materialised logits): what the pallax ops compute."""
  b, t = tokens.shape
  heads = lambda a: a.reshape(b, t, HEADS, WIDTH // HEADS)

  def rms(a, weight):
    return a * jax.lax.rsqrt(jnp.mean(a**2, -1, keepdims=True) + 1e-6) * weight

  x = params["embedding"][tokens]
  q, k, v = jnp.split(rms(x, params["norm_attn"]) @ params["w_qkv"], 3, -1)
  attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
  x = x + attended.reshape(b, t, WIDTH) @ params["w_out"]
  h = jax.nn.gelu(rms(x, params["norm_mlp"]) @ params["w_up"], approximate=False)
  x = x + h @ params["w_down"]
  logits = rms(x, params["norm_head"]) @ params["w_head"]
  label_logits = jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - label_logits)


def train_step(params: Params, tokens: jax.Array, labels: jax.Array) -> tuple[jax.Array, Params]:
  """The loss and the gradient of every parameter."""
  return jax.value_and_grad(loss)(params, tokens, labels)


def shardings(mesh: Mesh, names) -> tuple[dict[str, NamedSharding], NamedSharding]:
  """The parameters' shardings and the batch's.

  Parameters are replicated but the head's, sharded along the vocabulary
  over ``"tp"``; the batch's sequence dim is sharded over ``"sp"``.
  """
  params = {name: NamedSharding(mesh, P()) for name in names}
  params["w_head"] = NamedSharding(mesh, P(None, "tp"))
  return params, NamedSharding(mesh, P(None, "sp"))


def global_mesh() -> Mesh:
  """A ``("sp", "tp")`` mesh over every device of every process, ``"tp"`` of ``TENSOR``.

  The devices in process order, ``TENSOR`` consecutive ones a row: with 4
  devices a process, ``"sp"`` has 2 rows in each process.
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices).reshape(-1, TENSOR), ("sp", "tp"))


def place(mesh: Mesh, params: dict[str, np.ndarray], tokens: np.ndarray, labels: np.ndarray):
  """``params``, ``tokens`` and ``labels`` as global arrays on ``mesh``, sharded by ``shardings``.

  Every process passes the same full values (the same seed gives them
  everywhere) and places only the slices its own devices hold:
  ``jax.make_array_from_process_local_data`` takes the process's slice of
  the batch, as a data loader would read it.
  """
  param_sharding, data_sharding = shardings(mesh, params)
  params = {
    name: jax.make_array_from_callback(value.shape, param_sharding[name], lambda i, v=value: v[i])
    for name, value in params.items()
  }
  tokens, labels = (
    jax.make_array_from_process_local_data(data_sharding, process_slice(data_sharding, a), a.shape)
    for a in (tokens, labels)
  )
  return params, tokens, labels


def process_slice(sharding: NamedSharding, data: np.ndarray) -> np.ndarray:
  """The block of the global ``data`` that this process's devices hold.

  What ``make_array_from_process_local_data`` takes: the part a data loader
  of this process would read. (On ``global_mesh``, whose devices are in
  process order, a process's devices hold one contiguous block.)
  """
  shards = sharding.addressable_devices_indices_map(data.shape).values()
  block = []
  for dim, size in enumerate(data.shape):
    starts, stops, _ = zip(*(shard[dim].indices(size) for shard in shards))
    block.append(slice(min(starts), max(stops)))
  return data[tuple(block)]


def step_on_cluster(out: str) -> None:
  """One step on ``global_mesh``; process 0 writes the results to ``out`` (an ``.npz``).

  Every process makes the same parameters and batch (the same seed) and
  places its own slices; the gradients, gathered from every process with
  ``process_allgather``, come whole to process 0.
  """
  k_params, k_batch = jax.random.split(jax.random.key(0))
  params = {name: np.asarray(value) for name, value in init(k_params).items()}
  tokens, labels = (np.asarray(a) for a in batch(k_batch))
  mesh = global_mesh()
  params, tokens, labels = place(mesh, params, tokens, labels)
  value, grads = jax.jit(train_step)(params, tokens, labels)
  # How the arrays lie on the devices: the batch's and the head gradient's shards.
  sequence_shard = tokens.addressable_shards[0].data.shape[1]
  head_grad_shard = grads["w_head"].addressable_shards[0].data.shape[1]
  grads = multihost_utils.process_allgather(grads, tiled=True)
  if jax.process_index() == 0:
    np.savez(
      out,
      loss=np.asarray(value),
      process_count=jax.process_count(),
      device_count=jax.device_count(),
      mesh_processes=np.vectorize(lambda d: d.process_index)(mesh.devices),
      sequence_shard=sequence_shard,
      head_grad_shard=head_grad_shard,
      **{f"grad_{name}": g for name, g in grads.items()},
    )
    print(f"loss {float(value):.6f}: {jax.process_count()} processes, {mesh.size} devices")


def run_local(
  num_processes: int, out: str, *, devices: int = 4, env: dict | None = None, timeout: float = 300
) -> list[int]:
  """Starts ``num_processes`` copies of this program on this machine's CPU; their exit codes.

  A free port of 127.0.0.1 is the coordinator; each process gets
  ``devices`` host CPU devices. ``env`` (default: this process's) is
  their environment, with ``JAX_PLATFORMS`` and ``XLA_FLAGS`` set here.
  After ``timeout`` seconds every process still running is killed (its
  exit code is then negative).
  """
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ if env is None else env)
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  command = [sys.executable, "-m", "examples.multihost", "--out", os.path.abspath(out)]
  command += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = [
    subprocess.Popen([*command, "--process-id", str(i)], cwd=root, env=env)
    for i in range(num_processes)
  ]
  codes = []
  for proc in procs:
    try:
      codes.append(proc.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      codes.append(proc.wait())
  return codes


def main(argv: Sequence[str] | None = None) -> None:
  """One process of a cluster, or with ``--local N`` the launcher of N processes here."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="the .npz file process 0 writes")
  cluster = "(default: from the cluster's environment)"
  parser.add_argument("--coordinator", help=f"host:port of process 0 {cluster}")
  parser.add_argument("--num-processes", type=int, help=f"how many processes {cluster}")
  parser.add_argument("--process-id", type=int, help=f"this process's index {cluster}")
  parser.add_argument("--local", type=int, metavar="N", help="start N CPU processes here")
  parser.add_argument("--devices", type=int, default=4, help="with --local: CPU devices a process")
  args = parser.parse_args(argv)
  if args.local:
    codes = run_local(args.local, args.out, devices=args.devices)
    if any(codes):
      sys.exit(f"the processes exited with {codes}")
    return
  # Arguments left None come from the cluster's environment (SLURM, TPU pods, ...).
  jax.distributed.initialize(
    coordinator_address=args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
  )
  step_on_cluster(args.out)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
