"""The operands autotuning times candidates on: a kernel's own (``ConfigSpace.inputs``) or random.

A paged kernel's time depends on its lengths and page table: timed on the
executor's random small integers, it would be tuned for a few tokens a
sequence. Its config module's ``tune_inputs`` gives full caches instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallax.executor import (
  ConfigSpace,
  Executor,
  KernelConfig,
  KernelSpec,
  register_kernel,
  register_kernel_implementation,
)
from pallax.executor import autotune as autotune_lib
from pallax.executor.registry import kernel_spec


@dataclasses.dataclass(frozen=True)
class _Config(KernelConfig):
  block: int = 1


AVALS = [jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)]


def _lengths_inputs(avals, seed, *, full):
  """Operands as a kernel's ``tune_inputs`` gives them: the int operand ``full``."""
  x, n = avals
  return [np.ones(x.shape, np.float32), np.full(n.shape, full, np.int32)]


register_kernel(
  KernelSpec(
    "tune_inputs_op",
    _Config,
    heuristic=lambda avals, target, **p: _Config(),
    candidates=lambda avals, target, **p: [_Config(1), _Config(2)],
    supports=lambda avals, target, config, **p: None,
    inputs=_lengths_inputs,
  )
)


def test_wall_clock_benchmark_draws_the_given_inputs_else_random_ones():
  given = autotune_lib.wall_clock_benchmark(
    lambda c: None, AVALS, inputs=lambda avals, seed: _lengths_inputs(avals, seed, full=7)
  )
  x, n = given.inputs()
  assert isinstance(n, jax.Array) and n.tolist() == [7, 7, 7, 7] and float(x.sum()) == 32.0
  x, n = autotune_lib.wall_clock_benchmark(lambda c: None, AVALS).inputs()
  assert float(jnp.std(x)) > 0.5


def test_inputs_of_the_wrong_shape_or_dtype_raise_naming_both():
  wrong = lambda avals, seed: [np.ones((4, 8), np.float32), np.ones((5,), np.int32)]
  benchmark = autotune_lib.wall_clock_benchmark(lambda c: None, AVALS, inputs=wrong)
  with pytest.raises(ValueError, match=r"gave \(float32\[4, 8\], int32\[5\]\) for its operands"):
    benchmark.inputs()


def test_the_executor_times_every_candidate_on_the_kernels_inputs():
  """Each candidate runs on the spec's inputs, with the call's params (``full``)."""
  seen = []

  def make_fn(config):
    def run(x, n):
      jax.debug.callback(lambda n: seen.append((config.block, n.tolist())), n)
      return x * config.block

    return run

  ex = Executor(policy="autotune", cache_dir=False)
  chosen = ex.select("tune_inputs_op", AVALS, "cpu", {"full": 5}, make_fn=make_fn)
  assert chosen.source == "autotune"
  assert {block for block, _ in seen} == {1, 2}
  assert all(n == [5, 5, 5, 5] for _, n in seen)


def _structs(*shapes_dtypes):
  return [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]


def test_paged_attention_tunes_on_full_caches_through_a_shuffled_table():
  b, pages, pool = 3, 4, 16
  avals = _structs(
    ((b, 2, 4, 64), jnp.bfloat16),
    ((2, pool, 8, 64), jnp.bfloat16),
    ((2, pool, 8, 64), jnp.bfloat16),
    ((b,), jnp.int32),
    ((b, pages), jnp.int32),
  )
  q, k, v, lengths, table = kernel_spec("paged_attention").inputs(avals, 0)
  assert [x.dtype for x in (q, k, v, lengths, table)] == [a.dtype for a in avals]
  assert lengths.tolist() == [pages * 8] * b
  table = np.asarray(table)
  assert len(set(table.ravel().tolist())) == b * pages and table.min() >= 0 and table.max() < pool
  assert table.ravel().tolist() != sorted(table.ravel().tolist())  # shuffled


def test_ragged_paged_attention_tunes_on_every_slot_with_tokens_shared_out():
  tokens, seqs, pages = 50, 4, 2  # 12 or 13 tokens a sequence, at most 16 cached
  avals = _structs(
    ((tokens, 2, 4, 64), jnp.bfloat16),
    ((2, 8, 8, 64), jnp.bfloat16),
    ((2, 8, 8, 64), jnp.bfloat16),
    ((seqs,), jnp.int32),
    ((seqs, pages), jnp.int32),
    ((seqs + 1,), jnp.int32),
    ((1,), jnp.int32),
  )
  *_, kv_lens, table, cu_q_lens, num_seqs = kernel_spec("ragged_paged_attention").inputs(avals, 1)
  assert kv_lens.tolist() == [16] * seqs and num_seqs.tolist() == [seqs]
  q_lens = np.diff(np.asarray(cu_q_lens))
  assert cu_q_lens[0] == 0 and cu_q_lens[-1] == tokens and sorted(q_lens) == [12, 12, 13, 13]
  assert np.asarray(table).max() < 8


def test_an_added_implementations_space_takes_no_inputs():
  space = ConfigSpace(_Config, lambda avals, target, **p: _Config(), inputs=_lengths_inputs)
  with pytest.raises(ValueError, match="timed on the kernel's operands"):
    register_kernel_implementation("tune_inputs_op", "triton_raw", lambda *a, **k: a, space)
