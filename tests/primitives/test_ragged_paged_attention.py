"""ragged_paged_attention: every path against the float64 reference, vmap, bad input, lowering.

Batches come from ragged_paged_attention_reference.py: sequences mixing
decode (q_len 1), speculative (5) and prefill chunks (up to 300) with caches
from empty to several pages, a shuffled pool whose rows no sequence reads
are NaN, tokens past the last sequence and spare sequence slots with garbage.
The XLA path gets the broad coverage; the interpreted Triton and Mosaic
kernels run the executor's choice and pinned configs (several items a
sequence, several pages a step).
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from pallax.kernels.ragged_paged_attention import triton as ragged_triton
from tests.helpers import (
  CALL_TARGET,
  FLOAT_DTYPES,
  assert_close,
  lower_text,
  on_path,
  primitive_names,
)
from tests.primitives.ragged_paged_attention_reference import Batch, inputs, reference

KERNEL_PATHS = ("triton", "mosaic_tpu")
Config = pallax.RaggedPagedAttentionConfig


def _run(batch: Batch, dtype, path: str, config=None, seed: int = 0, **statics) -> None:
  args = inputs(batch, dtype, seed)
  f = functools.partial(pallax.ragged_paged_attention, config=config, **statics)
  with on_path(path):
    got = jax.jit(f)(*args)
  want = reference(*args, **statics)
  assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
  assert_close(got, want, dtype, f"{path} {batch} {statics}")
  end = int(np.asarray(args[5])[int(args[6][0])])
  np.testing.assert_array_equal(np.asarray(got, np.float32)[end:], 0.0)  # no sequence's tokens


# ------------------------------------------------------------------------------
# The XLA path.

BATCHES = {
  "mixed-gqa": Batch(),
  "mha-value-head-dim": Batch(n=2, k=2, hv=16),
  "mqa-odd-sizes": Batch(
    n=3, k=1, h=24, page_size=5, pages_per_sequence=7, kv_lens=(9, 12, 33, 3, 1)
  ),
  "page-size-1": Batch(q_lens=(1, 2, 0), kv_lens=(1, 9, 4), page_size=1, pages_per_sequence=9),
  # A prefill chunk of 300 tokens after 100 cached, decode and speculative
  # tokens beside it, an empty cache with no query: several blocks of keys.
  "prefill-chunk": Batch(
    q_lens=(300, 1, 5, 0), kv_lens=(400, 517, 64, 0), page_size=16, pages_per_sequence=40
  ),
  "decode-only": Batch(q_lens=(1,) * 6, kv_lens=(1, 7, 8, 9, 16, 40), pad_tokens=0),
}


@pytest.mark.parametrize("name", BATCHES)
def test_xla(name):
  _run(BATCHES[name], jnp.float32, "xla")


@pytest.mark.parametrize(
  "statics",
  [
    dict(logits_soft_cap=1.5, scale=0.9),
    dict(sliding_window=1),
    dict(sliding_window=7, logits_soft_cap=4.0),
    # -inf: no sink for that head (and no NaN for tokens that see no key).
    dict(sinks=np.asarray([0.5, -np.inf, 2.0, 0.0], np.float32)),
  ],
  ids=["cap-scale", "window-1", "window-7-cap", "sinks"],
)
def test_xla_features(statics):
  _run(BATCHES["mixed-gqa"], jnp.float32, "xla", seed=1, **statics)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
def test_xla_16_bit_dtypes(dtype):
  _run(BATCHES["mqa-odd-sizes"], dtype, "xla", seed=2, sliding_window=9)


def test_xla_float64():
  with jax.enable_x64(True):
    _run(BATCHES["mixed-gqa"], jnp.float64, "xla", seed=3, logits_soft_cap=2.0)


# ------------------------------------------------------------------------------
# The interpreted kernels.

PINNED = {
  # Two tokens an item (several items a sequence, a last one half full),
  # 16-token steps, three splits of each item's keys (some empty).
  "triton": Config(block_q=2, block_k=16, num_splits=3),
  # Two pages a step, the speculative sequence in items of 4 tokens.
  "mosaic_tpu": Config(block_q=4, pages_per_block=2),
}
KERNEL_CASES = {
  "mixed-window-cap": (Batch(), dict(sliding_window=6, logits_soft_cap=3.0)),
  "mqa-value-head-dim-sinks": (
    Batch(n=4, k=1, hv=16, q_lens=(3, 1, 0, 7), kv_lens=(3, 20, 2, 30)),
    dict(sinks=np.asarray([0.5, -1.0, 2.0, 0.0], np.float32)),
  ),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel(path, name):
  batch, statics = KERNEL_CASES[name]
  args = inputs(batch)
  f = functools.partial(pallax.ragged_paged_attention, config=PINNED[path], **statics)
  with on_path(path):
    report = pallax.explain(f, *args)
  assert [s.implementation for s in report] == ["pallas"], str(report)
  _run(batch, jnp.float32, path, PINNED[path], seed=4, **statics)


def test_triton_wide_items_read_a_gathered_copy():
  """Items of more than 16 rows read an XLA-gathered copy of their queries, not q's tokens."""
  config = Config(block_q=16, block_k=16, num_splits=2)  # 16 tokens x 2 heads: 32 rows
  assert 16 * Batch().n // Batch().k > ragged_triton._DIRECT_ROWS
  # bfloat16: float32 items are held to 16 rows (``max_rows``).
  _run(Batch(), jnp.bfloat16, "triton", config, seed=8, sliding_window=6)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_default_config(path):
  """The executor's own config on the kernels."""
  _run(BATCHES["mqa-odd-sizes"], jnp.float32, path, seed=5, logits_soft_cap=3.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_16_bit_dtypes(path, dtype):
  batch = Batch(q_lens=(4, 1), kv_lens=(20, 33), page_size=16, pages_per_sequence=3)
  _run(batch, dtype, path, PINNED[path], seed=6)


@pytest.mark.slow
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_prefill_chunk(path):
  _run(BATCHES["prefill-chunk"], jnp.float32, path, seed=7, sliding_window=100)


# ------------------------------------------------------------------------------
# vmap: one call, equal to a loop.


def test_vmap_matches_a_loop_and_is_one_call():
  """Examples with their own pools, sequence counts and padding; a shared pool too."""
  batch = Batch(q_lens=(2, 1, 4), kv_lens=(5, 9, 12), pad_tokens=2, spare_slots=2)
  examples = [inputs(batch, seed=s) for s in range(3)]
  # Another number of sequences in use in the second example (its third slot spare).
  examples[1] = (*examples[1][:6], jnp.asarray([2], jnp.int32))
  stacked = [jnp.stack(xs) for xs in zip(*examples)]
  f = functools.partial(pallax.ragged_paged_attention, sliding_window=6)
  got = jax.jit(jax.vmap(f))(*stacked)
  for i, args in enumerate(examples):
    assert_close(got[i], f(*args), jnp.float32, f"example {i}")
    assert_close(got[i], reference(*args, sliding_window=6), jnp.float32, f"example {i}")
  shared = jax.vmap(f, in_axes=(0, None, None, 0, 0, 0, 0))
  pools = inputs(batch, nan_fill=False)[1:3]  # every row some example's table reads
  mixed = [stacked[0], *pools, *stacked[3:]]
  got = jax.jit(shared)(*mixed)
  for i, args in enumerate(examples):
    assert_close(got[i], f(args[0], *pools, *args[3:]), jnp.float32, f"shared pools {i}")
  names = primitive_names(jax.make_jaxpr(jax.vmap(f))(*stacked).jaxpr)
  assert collections.Counter(n for n in names if "attention" in n) == {"ragged_paged_attention": 1}


# ------------------------------------------------------------------------------
# An inference op.


def _small():
  return inputs(Batch(), nan_fill=False)


@pytest.mark.parametrize(
  "transform",
  [
    lambda f, q: jax.grad(lambda q: jnp.sum(f(q)))(q),
    lambda f, q: jax.jvp(f, (q,), (q,)),
    lambda f, q: jax.linearize(f, q),
  ],
  ids=["grad", "jvp", "linearize"],
)
def test_derivatives_raise(transform):
  q, *rest = _small()
  f = lambda q: pallax.ragged_paged_attention(q, *rest)
  with pytest.raises(NotImplementedError, match="inference op"):
    transform(f, q)


def test_one_primitive_and_eager_matches_jit():
  args = _small()
  names = primitive_names(jax.make_jaxpr(pallax.ragged_paged_attention)(*args).jaxpr)
  assert collections.Counter(n for n in names if "attention" in n) == {"ragged_paged_attention": 1}
  eager = pallax.ragged_paged_attention(*args)
  assert_close(eager, jax.jit(pallax.ragged_paged_attention)(*args), jnp.float32)


def test_pinned_xla_and_scalar_num_seqs():
  args = _small()
  xla = Config(implementation="xla")
  with on_path("triton"):
    f = functools.partial(pallax.ragged_paged_attention, config=xla)
    assert [s.implementation for s in pallax.explain(f, *args)] == ["xla"]
    got = f(*args[:6], int(args[6][0]))
  assert_close(got, reference(*args), jnp.float32)


def test_traced_values_are_clamped():
  q, k, v, kv_lens, table, cu, num = _small()
  full = table.shape[1] * k.shape[2]
  wild_kv = kv_lens.at[2].set(full + 7)
  wild_table = table.at[0, 4].set(-3)  # past sequence 0's 9 tokens: never read
  got = jax.jit(pallax.ragged_paged_attention)(q, k, v, wild_kv, wild_table, cu, num + 5)
  want = reference(q, k, v, np.minimum(wild_kv, full), table, cu, num + 1)  # every slot used
  assert_close(got, want, jnp.float32, "clamped")


def test_unused_slots_may_hold_anything():
  """Only the num_seqs slots in use are checked when concrete, as when traced."""
  q, k, v, kv_lens, table, cu, num = _small()
  wild_kv = kv_lens.at[-1].set(10**6)  # the spare slot
  wild_table = table.at[-1].set(-5)
  got = pallax.ragged_paged_attention(q, k, v, wild_kv, wild_table, cu, num)
  assert_close(got, reference(q, k, v, kv_lens, table, cu, num), jnp.float32)


def test_traced_offsets_start_at_zero_unbatched_and_vmapped():
  q, k, v, kv_lens, table, cu, num = _small()
  shifted = cu.at[0].set(1)  # invalid: clamped to 0, alike with and without vmap
  one = jax.jit(pallax.ragged_paged_attention)(q, k, v, kv_lens, table, shifted, num)
  many = jax.jit(jax.vmap(pallax.ragged_paged_attention))(
    *(x[None] for x in (q, k, v, kv_lens, table, shifted, num))
  )
  assert_close(many[0], one, jnp.float32)
  assert_close(one, reference(q, k, v, kv_lens, table, cu, num), jnp.float32)


def test_a_config_pinning_only_block_q_runs_float32_on_triton():
  with on_path("triton"):
    config = Config(block_q=2)
    got = pallax.ragged_paged_attention(*_small(), config=config)
  assert_close(got, reference(*_small()), jnp.float32)


_T, _POOL = (8, 4, 32), (2, 12, 4, 32)


def _ones(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


def _i32(*values):
  return jnp.asarray(values, jnp.int32)


BAD_INPUTS = {
  "q rank 2": (dict(q=_ones((8, 32))), "q"),
  "k head dim": (dict(k_pages=_ones((2, 12, 4, 16)), v_pages=_ones((2, 12, 4, 16))), "k_pages"),
  "kv heads not dividing": (
    dict(k_pages=_ones((3, 12, 4, 32)), v_pages=_ones((3, 12, 4, 32))),
    "kv heads",
  ),
  "mixed dtypes": (dict(v_pages=_ones(_POOL, jnp.bfloat16)), "dtype"),
  "float kv_lens": (dict(kv_lens=_ones((2,))), "kv_lens"),
  "page_indices rows": (dict(page_indices=_ones((3, 3), jnp.int32)), "page_indices"),
  "cu_q_lens shape": (dict(cu_q_lens=_i32(0, 2)), "cu_q_lens"),
  "float cu_q_lens": (dict(cu_q_lens=_ones((3,))), "cu_q_lens"),
  "num_seqs shape": (dict(num_seqs=_i32(1, 1)), "num_seqs"),
  "num_seqs past the slots": (dict(num_seqs=_i32(3)), "num_seqs"),
  "offsets not from 0": (dict(cu_q_lens=_i32(1, 2, 5)), "cu_q_lens[0]"),
  "offsets decreasing": (dict(cu_q_lens=_i32(0, 4, 3)), "decrease"),
  "offsets past the tokens": (dict(cu_q_lens=_i32(0, 2, 9)), "past q"),
  "q_len above kv_len": (dict(cu_q_lens=_i32(0, 4, 5)), "more queries than cached"),
  "kv_len past the table": (dict(kv_lens=_i32(3, 13)), "kv_lens"),
  "page index past the pool": (dict(page_indices=_i32([0, 1, 2], [12, 0, 0])), "page_indices"),
  "window zero": (dict(sliding_window=0), "sliding_window"),
  "window float": (dict(sliding_window=2.5), "sliding_window"),
  "sinks shape": (dict(sinks=_ones((2,))), "sinks"),
  "soft cap negative": (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
  "config class": (dict(config=pallax.PagedAttentionConfig()), "config"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input(name):
  overrides, word = BAD_INPUTS[name]
  call = dict(
    q=_ones(_T),
    k_pages=_ones(_POOL),
    v_pages=_ones(_POOL),
    kv_lens=_i32(3, 12),
    page_indices=_i32([0, 1, 2], [3, 4, 5]),
    cu_q_lens=_i32(0, 2, 5),
    num_seqs=_i32(2),
  )
  call.update(overrides)
  names = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")
  with pytest.raises((ValueError, TypeError)) as err:
    pallax.ragged_paged_attention(*[call.pop(n) for n in names], **call)
  assert word in str(err.value), str(err.value)


# ------------------------------------------------------------------------------
# Lowering for every platform.


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_lowers_to_the_kernel(platform, dtype):
  s, t, n, kv, h, ps, pps = 4, 64, 32, 8, 128, 16, 16
  args = (
    jnp.zeros((t, n, h), dtype),
    jnp.zeros((kv, s * pps, ps, h), dtype),
    jnp.zeros((kv, s * pps, ps, h), dtype),
    jnp.zeros((s,), jnp.int32),
    jnp.zeros((s, pps), jnp.int32),
    jnp.zeros((s + 1,), jnp.int32),
    jnp.zeros((1,), jnp.int32),
  )
  f = functools.partial(pallax.ragged_paged_attention, sliding_window=64, logits_soft_cap=30.0)
  assert CALL_TARGET[platform] in lower_text(f, platform, *args)


def test_triton_splits_the_keys_of_few_long_sequences():
  """Flash-decoding: few items over long caches get several programs each; many get one."""
  from pallax.executor import Target

  def config(seqs, context):
    args = (
      jnp.zeros((seqs, 32, 128), jnp.bfloat16),
      jnp.zeros((8, seqs * context // 16, 16, 128), jnp.bfloat16),
      jnp.zeros((8, seqs * context // 16, 16, 128), jnp.bfloat16),
      jnp.full((seqs,), context, jnp.int32),
      jnp.zeros((seqs, context // 16), jnp.int32),
      jnp.arange(seqs + 1, dtype=jnp.int32),
      jnp.asarray([seqs], jnp.int32),
    )
    (row,) = pallax.explain_on(Target("cuda", "h100"), pallax.ragged_paged_attention, *args)
    return row.config

  assert config(2, 4096).num_splits > 1 and config(2, 4096).block_q == 1
  assert config(64, 4096).num_splits == 1
