"""``pallax.op.collectives.ragged_all_to_all``: XLA's ragged all-to-all, and a padded one on CPU.

On 8 fake CPU devices the padded program runs: checked against a numpy model
of ``jax.lax.ragged_all_to_all``'s semantics (random sizes and offsets, one
mesh axis and two), and its gradient against that model's transpose. The
``compilers`` test compiles the same program for TPU v5e (4 chips) and an
8-GPU H100 topology without the hardware, where it must be XLA's
``ragged-all-to-all`` and nothing padded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pallax.op.collectives import ragged_all_to_all
from tests.helpers import deviceless_mesh, mesh_4x2, sharding_devices

ROWS, OUT, WIDTH = 9, 14, 3


def _plan(rng, devices: int):
  """Per sender: input offsets, send sizes, output offsets (in each receiver's output), recv sizes.

  Each receiver gets disjoint slots of its ``OUT`` rows; each sender's
  chunks are disjoint ranges of its ``ROWS`` rows.
  """
  send = np.zeros((devices, devices), np.int32)  # send[i, j]: rows i sends j
  for i in range(devices):
    send[i] = rng.multinomial(rng.integers(0, ROWS + 1), np.ones(devices) / devices)
  while (send.sum(0) > OUT).any():  # keep each receiver's total within its output
    j = int(np.argmax(send.sum(0)))
    send[int(np.argmax(send[:, j])), j] -= 1
  in_off = np.zeros_like(send)
  for i in range(devices):
    order = rng.permutation(devices)  # chunks in any order among the sender's rows
    starts = np.concatenate([[0], np.cumsum(send[i, order])[:-1]])
    slack = ROWS - send[i].sum()
    in_off[i, order] = starts + rng.integers(0, slack + 1)
  out_off = np.zeros_like(send)
  for j in range(devices):
    order = rng.permutation(devices)
    starts = np.concatenate([[0], np.cumsum(send[order, j])[:-1]])
    out_off[order, j] = starts + rng.integers(0, OUT - send[:, j].sum() + 1)
  return in_off, send, out_off, send.T.copy()


def _model(x, init, in_off, send, out_off):
  """``ragged_all_to_all`` in numpy: ``out[j]`` from ``init[j]`` and every sender's chunk."""
  out = init.copy()
  for i in range(len(x)):
    for j in range(len(x)):
      n = send[i, j]
      out[j, out_off[i, j] : out_off[i, j] + n] = x[i, in_off[i, j] : in_off[i, j] + n]
  return out


def _run(mesh, axes):
  spec = P(axes)
  body = lambda x, init, *plan: ragged_all_to_all(
    x[0], init[0], *(p[0] for p in plan), axis_name=axes
  )[None]
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))


@pytest.mark.parametrize("mesh_name", ["8", "4x2"])
def test_matches_the_model_forward_and_transposed(mesh_name):
  if mesh_name == "8":
    auto = (jax.sharding.AxisType.Auto,)
    mesh, axes = jax.make_mesh((8,), ("e",), axis_types=auto, devices=sharding_devices()), "e"
  else:
    mesh, axes = mesh_4x2(), ("a", "b")
  rng = np.random.default_rng(3)
  for _ in range(3):
    plan = _plan(rng, 8)
    x = rng.standard_normal((8, ROWS, WIDTH)).astype(np.float32)
    init = rng.standard_normal((8, OUT, WIDTH)).astype(np.float32)
    f = _run(mesh, axes)
    np.testing.assert_array_equal(np.asarray(f(x, init, *plan)), _model(x, init, *plan[:3]))
    # The transpose: a cotangent of the output goes back to the rows it came
    # from (rows sent nowhere get 0); the initial output keeps the slots
    # nothing landed on.
    cot = rng.standard_normal((8, OUT, WIDTH)).astype(np.float32)
    dx, dinit = jax.vjp(lambda x, init: f(x, init, *plan), x, init)[1](cot)
    landed = _model(np.ones_like(x), np.zeros_like(init), *plan[:3])
    want_dx = np.zeros_like(x)
    in_off, send, out_off, _ = plan
    for i in range(8):
      for j in range(8):
        n = send[i, j]
        want_dx[i, in_off[i, j] : in_off[i, j] + n] = cot[j, out_off[i, j] : out_off[i, j] + n]
    np.testing.assert_array_equal(np.asarray(dx), want_dx)
    np.testing.assert_array_equal(np.asarray(dinit), np.where(landed == 1, 0, cot))


def test_one_slice_a_device():
  mesh = mesh_4x2()
  f = _run(mesh, ("a", "b"))
  plan = [np.zeros((8, 16), np.int32)] * 4  # two slices a device: lax's, not this program's
  x, init = np.zeros((8, ROWS, WIDTH), np.float32), np.zeros((8, OUT, WIDTH), np.float32)
  with pytest.raises(ValueError, match="input_offsets must have one entry per device"):
    f(x, init, *plan)


@pytest.mark.compilers
@pytest.mark.parametrize("target", ["v5e", "h100"])
def test_compiles_to_xla_ragged_all_to_all(target):
  mesh = deviceless_mesh(target, "e")
  n = mesh.size
  sharded = jax.sharding.NamedSharding(mesh, P("e"))
  shapes = [((n, ROWS, WIDTH), jnp.bfloat16), ((n, OUT, WIDTH), jnp.bfloat16)]
  shapes += [((n, n), jnp.int32)] * 4
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharded) for s, d in shapes]
  hlo = _run(mesh, "e").trace(*args).lower().compile().as_text()
  assert "ragged-all-to-all" in hlo
  assert " all-to-all(" not in hlo  # the CPU program's padded exchange is not lowered
