"""matmul kernels: lowering for every claimed platform, tile layouts, and configs.

Lowering holds the kernels to each backend's rules that interpret mode does
not check: Pallas-Triton takes only power-of-two blocks, Mosaic TPU wants the
last two block dims divisible by (8, 128) or equal to the array's.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.executor import Executor
from pallax.executor.registry import TARGETS
from pallax.kernels.matmul import TPU_VMEM_BUDGET, TRITON_SMEM_BYTES, MatmulConfig, Problem
from pallax.op import bind
from pallax.primitives.matmul import matmul_p
from tests.conftest import PLATFORM
from tests.helpers import (
  CALL_TARGET,
  as64,
  assert_close,
  executor_view,
  f64,
  lower_text,
  on_path,
  rand,
  x64,
)
from tests.primitives.test_matmul import matmul_ref

matmul_heuristic, matmul_candidates, matmul_supports = executor_view("matmul")

SHAPES = [
  ((7, 33), (33, 200)),
  ((1, 33), (33, 200)),
  ((2, 5, 33), (33, 200)),
  ((2, 5, 33), (2, 33, 17)),
  ((300, 1000), (1000, 520)),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
S = jax.ShapeDtypeStruct


def _op(a, b, bias):
  return pallax.matmul(a, b, bias=bias, activation="gelu")


def _loss(a, b, bias):
  return jnp.sum(_op(a, b, bias).astype(jnp.float32) ** 2)


FUNCTIONS = {
  "forward": (_op, 1),
  "backward": (jax.grad(_loss, (0, 1, 2)), 3),  # forward, dA, dB
  # A vmapped b adds a batch axis to the grid of all three kernels.
  "vmapped_b": (jax.vmap(jax.grad(_loss, (0, 1, 2)), in_axes=(None, 0, None)), 3),
}


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("kind", list(FUNCTIONS))
def test_lowers(platform, dtype, shapes, kind):
  fn, kernels = FUNCTIONS[kind]
  a_shape, b_shape = shapes
  b_shape = ((3,) if kind == "vmapped_b" else ()) + b_shape
  text = lower_text(fn, platform, S(a_shape, dtype), S(b_shape, dtype), S(b_shape[-1:], dtype))
  if platform == "tpu" and dtype == jnp.float16:
    # libtpu cannot compile float16 Mosaic kernels for v5e/v6e: the XLA program runs.
    kernels = 0
  assert text.count(CALL_TARGET[platform]) == kernels, text[:2000]


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_with_pinned_config(platform):
  config = MatmulConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=2)
  fn = lambda a, b: pallax.matmul(a, b, config=config)
  assert CALL_TARGET[platform] in lower_text(
    fn, platform, S((100, 300), jnp.float32), S((300, 200), jnp.float32)
  )


@pytest.mark.lowering
def test_cpu_lowering_is_the_xla_program():
  text = jax.jit(_op).lower(jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones(3)).as_text()
  assert "custom_call" not in text and "while" not in text
  assert text.count("stablehlo.dot_general") == 1


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_interpret_switch_runs_the_kernel(backend):
  a, b = jnp.ones((300, 64)), jnp.ones((64, 300))
  with pallax.interpret(backend):
    text = jax.jit(pallax.matmul).lower(a, b).as_text()
  assert "while" in text  # the interpreted kernel's grid loop


def _avals(a_shape, b_shape, dtype=jnp.float32):
  return [S(a_shape, dtype), S(b_shape, dtype)]


def _params(nb=0, out_dtype=jnp.float32, **changes):
  params = dict(
    a_batch=(True,) * nb,
    b_batch=(False,) * nb,
    bias_batch=(False,) * nb,
    contract_batch=0,
    transpose_a=False,
    transpose_b=False,
    activation=None,
    out_dtype=jnp.dtype(out_dtype),
    precision=None,
    save_preactivation=False,
  )
  params.update(changes)
  return params


@pytest.mark.parametrize(
  "shapes", SHAPES + [((4096, 4096), (4096, 4096)), ((5, 7), (7, 3))], ids=str
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("transposed", [False, True])
def test_heuristic_respects_backend_rules(shapes, dtype, transposed):
  a_shape, b_shape = shapes
  nb = len(a_shape) - 2
  params = _params(nb, dtype, b_batch=(len(b_shape) > 2,) * nb)
  if transposed:  # the backward's layouts: a and b stored transposed
    a_shape = a_shape[:-2] + a_shape[-2:][::-1]
    b_shape = b_shape[:-2] + b_shape[-2:][::-1]
    params.update(transpose_a=True, transpose_b=True)
  avals = _avals(a_shape, b_shape, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  triton = matmul_heuristic(avals, "cuda", **params)
  assert triton.implementation == "pallas"
  assert matmul_supports(avals, "cuda", triton, **params) is None
  smem = triton.num_stages * (triton.block_m + triton.block_n) * triton.block_k * itemsize
  assert smem <= TRITON_SMEM_BYTES
  tpu = matmul_heuristic(avals, "tpu", **params)
  assert matmul_supports(avals, "tpu", tpu, **params) is None, tpu
  prob = Problem.of([a_shape, b_shape], **params)
  bm, bn, bk = (
    min(x, d) for x, d in zip((tpu.block_m, tpu.block_n, tpu.block_k), (prob.m, prob.n, prob.k))
  )
  assert 2 * (bm * bk + bk * bn + bm * bn) * itemsize + 4 * bm * bn <= TPU_VMEM_BUDGET
  assert matmul_heuristic(avals, "cpu", **params).implementation == "xla"
  assert matmul_heuristic(avals, "interpret-mosaic_tpu", **params).implementation == "pallas"


def test_heuristic_picks_smaller_tiles_for_small_m():
  for rows, block_m in ((1, 16), (7, 16), (40, 64), (4096, 128)):
    config = matmul_heuristic(_avals((rows, 4096), (4096, 4096)), "cuda", **_params())
    assert config.block_m == block_m, (rows, config)
  # TPU: a small M is one whole-dim block.
  assert matmul_heuristic(_avals((7, 4096), (4096, 4096)), "tpu", **_params()).block_m >= 7
  # Folded batch dims count as rows: 256 vectors are M = 256.
  folded = matmul_heuristic(_avals((256, 1, 1024), (1024, 4096)), "cuda", **_params(1))
  assert folded.block_m == 128


@pytest.mark.parametrize("target", TARGETS)
def test_candidates_are_legal(target):
  avals = _avals((300, 1000), (1000, 520), jnp.bfloat16)
  params = _params(out_dtype=jnp.bfloat16)
  candidates = matmul_candidates(avals, target, **params)
  assert candidates and len(set(candidates)) == len(candidates)
  for config in candidates:
    assert matmul_supports(avals, target, config, **params) is None, config
  has_xla = any(c.implementation == "xla" for c in candidates)
  assert has_xla == (not target.startswith("interpret-"))


def test_config_validation_and_json_round_trip():
  config = MatmulConfig(block_m=64, block_n=128, block_k=32, num_warps=8, num_stages=4)
  assert MatmulConfig.from_json(config.to_json()) == config
  assert hash(config) == hash(MatmulConfig.from_json(config.to_json()))
  for bad in (
    dict(block_m=0),
    dict(block_n=-16),
    dict(block_k=2.5),
    dict(num_warps=0),
    dict(block_m=True),
  ):
    with pytest.raises(ValueError, match="must be a positive int"):
      MatmulConfig(**{**dict(block_m=16, block_n=16, block_k=16), **bad})
  assert str(config) == "pallas(block_m=64, block_n=128, block_k=32, num_warps=8, num_stages=4)"


@pytest.mark.lowering
@pytest.mark.parametrize(
  "platform, config, words",
  [
    ("cuda", MatmulConfig(block_m=24, block_n=64, block_k=32), "powers of two"),
    ("cuda", MatmulConfig(block_m=8, block_n=64, block_k=32), ">= 16"),
    ("tpu", MatmulConfig(block_m=128, block_n=200, block_k=128), "divisible by"),
  ],
)
def test_config_not_legal_for_backend(platform, config, words):
  fn = lambda a, b: pallax.matmul(a, b, config=config)
  with pytest.raises(ValueError, match=words):
    lower_text(fn, platform, S((300, 256), jnp.float32), S((256, 1000), jnp.float32))


def test_unsupported_calls_run_the_xla_program_visibly():
  ex = Executor(cache_dir=False)
  with jax.enable_x64(True):
    avals = _avals((16, 128), (128, 128), jnp.float64)
    for target in ("cuda", "tpu"):
      chosen = ex.select("matmul", avals, target, _params(out_dtype=jnp.float64))
      assert chosen.implementation == "xla" and "float64" in chosen.note
    text = lower_text(pallax.matmul, "cuda", *avals)
    assert CALL_TARGET["cuda"] not in text
  high = _params(precision=(jax.lax.Precision.HIGH,) * 2)
  chosen = ex.select("matmul", _avals((16, 128), (128, 128)), "tpu", high)
  assert chosen.implementation == "xla" and "precision" in chosen.note
  # Under the interpret switch there is no XLA fallback: a clear error instead.
  with jax.enable_x64(True), pallax.interpret():
    with pytest.raises(NotImplementedError, match="float64"):
      pallax.matmul(jnp.ones((4, 4), jnp.float64), jnp.ones((4, 4), jnp.float64))


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_inside_shard_map(platform):
  mesh = jax.make_mesh((8,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  fn = jax.grad(
    lambda a, b: jax.shard_map(
      lambda a, b: pallax.matmul(a, b, activation="relu"),
      mesh=mesh,
      in_specs=(P("a"), P()),
      out_specs=P("a"),
    )(a, b).sum(),
    (0, 1),
  )
  text = (
    jax.jit(fn)
    .trace(S((64, 200), jnp.float32), S((200, 96), jnp.float32))
    .lower(lowering_platforms=(platform,))
    .as_text()
  )
  assert text.count(CALL_TARGET[platform]) == 3


# ----------------------------------------------------------------------------
# Every operand layout, on both interpreted kernels.


def _stored(x, transpose):
  return jnp.swapaxes(x, -1, -2) if transpose else x


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize(
  "transpose_a, transpose_b", list(itertools.product([False, True], repeat=2))
)
@pytest.mark.parametrize(
  "masks",
  [((True,), (False,)), ((False,), (True,)), ((True,), (True,))],
  ids=["a_batched", "b_batched", "both_batched"],
)
def test_transposed_layouts_and_batch_masks(backend, transpose_a, transpose_b, masks):
  """The primitive itself: all four operand layouts, shared and batched operands.

  The blocks leave tails in M, N and K (150, 140 and 300 are no multiples of the blocks).
  """
  rng = np.random.default_rng(0)
  batch, m, k, n = 2, 150, 300, 140
  a_batch, b_batch = masks
  a = rand(rng, (batch,) * a_batch[0] + (m, k))
  b = rand(rng, (batch,) * b_batch[0] + (k, n))
  bias = rand(rng, (n,))
  config = (
    MatmulConfig(block_m=16, block_n=64, block_k=32)
    if backend == "triton"
    else MatmulConfig(block_m=128, block_n=128, block_k=128)
  )
  params = _params(
    1,
    a_batch=a_batch,
    b_batch=b_batch,
    transpose_a=transpose_a,
    transpose_b=transpose_b,
    activation="gelu_tanh",
    save_preactivation=True,
  )
  with on_path(backend):
    y, z = jax.jit(lambda a, b, bias: bind(matmul_p, a, b, bias, config=config, **params))(
      _stored(a, transpose_a), _stored(b, transpose_b), bias
    )
  want_z = np.matmul(f64(a), f64(b)) + f64(bias)
  want_y = jax.nn.gelu(want_z, approximate=True)
  assert y.shape == z.shape == (batch, m, n)
  with x64():
    assert_close(z, want_z, jnp.float32, "pre-activation")
    assert_close(y, np.asarray(want_y, np.float64), jnp.float32, "activation")


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_whole_blocks(backend):
  """Dims that are multiples of their blocks: no masks, no tails."""
  rng = np.random.default_rng(3)
  a, b, bias = rand(rng, (2, 32, 256)), rand(rng, (256, 256)), rand(rng, (256,))
  config = (
    MatmulConfig(block_m=16, block_n=64, block_k=32)
    if backend == "triton"
    else MatmulConfig(block_m=128, block_n=128, block_k=128)
  )
  with on_path(backend):
    y = jax.jit(
      lambda a, b, bias: pallax.matmul(a, b, bias=bias, activation="silu", config=config)
    )(a, b, bias)
  with x64():
    z = np.matmul(f64(a), f64(b)) + f64(bias)
    assert_close(y, z / (1 + np.exp(-z)), jnp.float32, "silu")


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_contracted_batch_dims(backend):
  """``contract_batch``: batch dims of a and b summed with K (a weight gradient)."""
  rng = np.random.default_rng(1)
  a, b = rand(rng, (2, 3, 40, 37)), rand(rng, (2, 3, 40, 30))  # a stored (*C, K, M)
  config = (
    MatmulConfig(block_m=16, block_n=16, block_k=32)
    if backend == "triton"
    else MatmulConfig(block_m=128, block_n=128, block_k=128)
  )
  params = _params(0, contract_batch=2, transpose_a=True)
  with on_path(backend):
    (y,) = jax.jit(lambda a, b: bind(matmul_p, a, b, config=config, **params))(a, b)
  with x64():
    assert_close(y, np.einsum("cdkm,cdkn->mn", f64(a), f64(b)), jnp.float32, "contracted")


def test_tile_sizes_from_the_config_reach_the_kernel():
  """The Triton grid follows the pinned config: (M/bm, N/bn) programs."""
  a, b = S((100, 64), jnp.float32), S((64, 300), jnp.float32)
  for config, grid in (
    (MatmulConfig(block_m=32, block_n=128, block_k=32), (4, 3)),
    (MatmulConfig(block_m=128, block_n=64, block_k=64), (1, 5)),
  ):
    text = lower_text(lambda a, b: pallax.matmul(a, b, config=config), "cuda", a, b)
    assert f"grid_x = {grid[0]} : i32, grid_y = {grid[1]} : i32, grid_z = 1" in text


def test_autotune_times_compiled_programs_never_an_interpreted_kernel(tmp_path):
  """On a CPU autotuning times the XLA program only; on a GPU its compiled kernels too."""
  rng = np.random.default_rng(2)
  a, b, bias = rand(rng, (24, 40)), rand(rng, (40, 32)), rand(rng, (32,))
  ex = Executor(policy="autotune", cache_dir=tmp_path)
  report = pallax.autotune(jax.grad(_loss, (0, 1, 2)), a, b, bias, executor=ex)
  assert [s.op for s in report] == ["matmul"] * 3  # forward, dA, dB: three shapes
  assert all(s.source == "autotune" for s in report)
  for _, result in ex.tune_log:
    timed = {c.implementation for c, _ in result.timings}
    assert timed == ({"xla"} if PLATFORM == "cpu" else {"xla", "pallas"})
  with ex:
    got = jax.jit(jax.grad(_loss, (0, 1, 2)))(a, b, bias)
  # Whichever implementation autotuning picked, the gradients match float64.
  with x64():
    ref_loss = lambda a, b, bias: jnp.sum(matmul_ref(a, b, bias, "gelu") ** 2)
    want = jax.grad(ref_loss, (0, 1, 2))(*as64(a, b, bias))
  for g, w, name in zip(got, want, ("da", "db", "dbias")):
    assert_close(g, w, jnp.float32, name)
