"""paged_attention: every path against the float64 reference, no derivatives, bad input, lowering.

Caches come from paged_attention_reference.py: random page tables (a
permutation of the pool, or pages shared between and within sequences),
lengths 0, 1, page_size - 1, page_size, page_size + 1 and the full table, and
every pool row no sequence reads below its length set to NaN, so a path that
lets one into its result fails. The XLA path gets the broad coverage; the
interpreted Triton and Mosaic kernels run pinned configs that split the key
axis (several splits and blocks on Triton, several pages a step on Mosaic)
and the executor's own choice.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import (
  CALL_TARGET,
  FLOAT_DTYPES,
  assert_close,
  lower_text,
  on_path,
  primitive_names,
)
from tests.primitives.paged_attention_reference import Case, inputs, reference

KERNEL_PATHS = ("triton", "mosaic_tpu")
Config = pallax.PagedAttentionConfig


def _run(case: Case, dtype, path: str, config=None, seed: int = 0, **statics) -> None:
  args = inputs(case, dtype, seed)
  with on_path(path):
    got = jax.jit(lambda *a: pallax.paged_attention(*a, config=config, **statics))(*args)
  want = reference(*args, **statics)
  assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
  assert_close(got, want, dtype, f"{path} {case} {statics}")
  lengths = np.asarray(args[3])
  np.testing.assert_array_equal(np.asarray(got, np.float32)[lengths == 0], 0.0)


# ------------------------------------------------------------------------------
# The XLA path.

CASES = {
  "gqa": Case(),
  "mha": Case(n=4, k=4),
  "mqa-shared-pages": Case(n=6, k=1, table="shared"),
  "value-head-dim": Case(n=4, k=2, hv=16, table="shared"),
  "page-size-1": Case(page_size=1, pages_per_sequence=9, lengths=(0, 1, 2, 9)),
  "odd-head-and-pages": Case(n=6, k=3, h=24, page_size=5, pages_per_sequence=7),
  # More tokens than one 512-token block of the XLA program: several loop steps.
  "long": Case(page_size=16, pages_per_sequence=40, lengths=(0, 1, 17, 511, 512, 513, 640)),
}


@pytest.mark.parametrize("name", CASES)
def test_xla(name):
  _run(CASES[name], jnp.float32, "xla")


@pytest.mark.parametrize(
  "statics",
  [dict(logits_soft_cap=1.5), dict(scale=0.9), dict(scale=2.0, logits_soft_cap=4.0)],
  ids=str,
)
def test_xla_scale_and_soft_cap(statics):
  _run(CASES["gqa"], jnp.float32, "xla", seed=1, **statics)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
def test_xla_16_bit_dtypes(dtype):
  _run(CASES["mqa-shared-pages"], dtype, "xla", seed=2, logits_soft_cap=3.0)


def test_xla_float64():
  with jax.enable_x64(True):
    _run(CASES["gqa"], jnp.float64, "xla", seed=3, logits_soft_cap=2.0)


# ------------------------------------------------------------------------------
# The interpreted kernels.

PINNED = {
  # Three splits of 16-token blocks over a 20-token table: splits with one
  # block, a split past short sequences' lengths, blocks spanning pages.
  "triton": Config(block_k=16, num_splits=3),
  # Two pages a step (stacked), three steps, the last one half past the table.
  "mosaic_tpu": Config(pages_per_block=2),
}
KERNEL_CASES = {
  "gqa-soft-cap": (CASES["gqa"], dict(logits_soft_cap=2.0)),
  "mha-shared-pages": (Case(n=2, k=2, table="shared"), {}),
  "mqa-value-head-dim": (Case(n=4, k=1, hv=16, page_size=8, pages_per_sequence=3), {}),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel(path, name):
  case, statics = KERNEL_CASES[name]
  args = inputs(case)
  with on_path(path):
    report = pallax.explain(lambda *a: pallax.paged_attention(*a, config=PINNED[path]), *args)
  assert [s.implementation for s in report] == ["pallas"], str(report)
  _run(case, jnp.float32, path, PINNED[path], seed=4, **statics)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_default_config(path):
  """The executor's own config on the kernels."""
  _run(CASES["odd-head-and-pages"], jnp.float32, path, seed=5, logits_soft_cap=3.0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES[1:], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_16_bit_dtypes(path, dtype):
  _run(Case(n=4, k=2, page_size=16, pages_per_sequence=3), dtype, path, PINNED[path], seed=6)


# ------------------------------------------------------------------------------
# An inference op: no derivatives, one primitive.


def _small():
  return inputs(CASES["gqa"], nan_fill=False)


@pytest.mark.parametrize(
  "transform",
  [
    lambda f, q: jax.grad(lambda q: jnp.sum(f(q)))(q),
    lambda f, q: jax.jvp(f, (q,), (q,)),
    lambda f, q: jax.vjp(f, q),
    lambda f, q: jax.linearize(f, q),
    lambda f, q: jax.jacfwd(f)(q),
  ],
  ids=["grad", "jvp", "vjp", "linearize", "jacfwd"],
)
def test_derivatives_raise(transform):
  q, k, v, lengths, table = _small()
  f = lambda q: pallax.paged_attention(q, k, v, lengths, table)
  with pytest.raises(NotImplementedError, match="inference op"):
    transform(f, q)
  with pytest.raises(NotImplementedError, match="inference op"):  # the pools too
    jax.grad(lambda k: jnp.sum(pallax.paged_attention(q, k, v, lengths, table)))(k)


def test_stop_gradient_on_the_inputs_is_fine():
  q, k, v, lengths, table = _small()
  sg = jax.lax.stop_gradient
  f = lambda q: jnp.sum(pallax.paged_attention(sg(q), sg(k), sg(v), lengths, table))
  np.testing.assert_array_equal(jax.grad(f)(q), 0.0)


def test_one_primitive():
  names = primitive_names(jax.make_jaxpr(pallax.paged_attention)(*_small()).jaxpr)
  assert collections.Counter(n for n in names if "attention" in n) == {"paged_attention": 1}


def test_eager_matches_jit():
  args = _small()
  assert_close(pallax.paged_attention(*args), jax.jit(pallax.paged_attention)(*args), jnp.float32)


def test_pinned_xla_and_config_class():
  args = _small()
  xla = Config(implementation="xla")
  with on_path("triton"):
    report = pallax.explain(lambda *a: pallax.paged_attention(*a, config=xla), *args)
    got = pallax.paged_attention(*args, config=xla)
  assert [s.implementation for s in report] == ["xla"], str(report)
  assert_close(got, reference(*args), jnp.float32)
  assert isinstance(Config(), pallax.KernelConfig)


def test_empty_calls():
  q, k, v, lengths, table = _small()
  assert pallax.paged_attention(q[:0], k, v, lengths[:0], table[:0]).shape == (0, 4, 32)
  out = pallax.paged_attention(q, k, v, lengths * 0, table[:, :0])
  np.testing.assert_array_equal(out, 0.0)


# ------------------------------------------------------------------------------
# Lengths and page indices: checked when concrete, clamped when traced.


def test_traced_lengths_and_pages_are_clamped():
  q, k, v, lengths, table = _small()
  full = table.shape[1] * k.shape[2]
  long = lengths.at[1].set(full + 7)
  wild = table.at[5, 0].set(-3).at[5, 1].set(k.shape[1] + 2)
  got = jax.jit(pallax.paged_attention)(q, k, v, long, wild)
  want = reference(q, k, v, np.minimum(long, full), np.clip(wild, 0, k.shape[1] - 1))
  assert_close(got, want, jnp.float32, "clamped")


def test_unread_page_indices_may_be_anything():
  """Entries past a sequence's length are never read, so they are not checked."""
  q, k, v, lengths, table = _small()
  padded = np.asarray(table).copy()
  padded[1, 1:] = -1  # length 1: only its first page is read
  assert_close(pallax.paged_attention(q, k, v, lengths, padded), reference(*_small()), jnp.float32)


_Q, _POOL = (2, 8, 32), (2, 10, 4, 32)


def _ones(shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


BAD_INPUTS = {
  "q rank 2": (dict(q=_ones((8, 32))), "q"),
  "q rank 4": (dict(q=_ones((1,) + _Q)), "q"),
  "k_pages rank 3": (dict(k_pages=_ones(_POOL[1:])), "k_pages"),
  "v_pages rank 5": (dict(v_pages=_ones((1,) + _POOL)), "v_pages"),
  "k head dim": (dict(k_pages=_ones((2, 10, 4, 16)), v_pages=_ones((2, 10, 4, 16))), "k_pages"),
  "v pages mismatch": (dict(v_pages=_ones((2, 9, 4, 32))), "v_pages"),
  "v page size mismatch": (dict(v_pages=_ones((2, 10, 8, 32))), "v_pages"),
  "kv heads not dividing": (
    dict(k_pages=_ones((3, 10, 4, 32)), v_pages=_ones((3, 10, 4, 32))),
    "kv heads",
  ),
  "integer q": (dict(q=_ones(_Q, jnp.int32)), "q"),
  "mixed dtypes": (dict(v_pages=_ones(_POOL, jnp.bfloat16)), "dtype"),
  "float lengths": (dict(lengths=_ones((2,))), "lengths"),
  "lengths shape": (dict(lengths=_ones((3,), jnp.int32)), "lengths"),
  "lengths rank": (dict(lengths=_ones((2, 1), jnp.int32)), "lengths"),
  "float page_indices": (dict(page_indices=_ones((2, 3))), "page_indices"),
  "page_indices rank": (dict(page_indices=_ones((2,), jnp.int32)), "page_indices"),
  "page_indices batch": (dict(page_indices=_ones((3, 3), jnp.int32)), "page_indices"),
  "soft cap zero": (dict(logits_soft_cap=0.0), "logits_soft_cap"),
  "soft cap negative": (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
  "soft cap string": (dict(logits_soft_cap="big"), "logits_soft_cap"),
  "scale string": (dict(scale="big"), "scale"),
  "config class": (dict(config=pallax.AttentionConfig(block_q=16, block_k=16)), "config"),
  "length past the table": (dict(lengths=jnp.asarray([3, 13], jnp.int32)), "lengths"),
  "negative length": (dict(lengths=jnp.asarray([-1, 3], jnp.int32)), "lengths"),
  "page index past the pool": (
    dict(page_indices=jnp.asarray([[0, 1, 2], [10, 0, 0]], jnp.int32)),
    "page_indices",
  ),
  "negative page index": (
    dict(page_indices=jnp.asarray([[0, 1, 2], [1, -1, 0]], jnp.int32)),
    "page_indices",
  ),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input(name):
  overrides, word = BAD_INPUTS[name]
  call = dict(
    q=_ones(_Q),
    k_pages=_ones(_POOL),
    v_pages=_ones(_POOL),
    lengths=jnp.asarray([3, 12], jnp.int32),
    page_indices=jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32),
  )
  call.update(overrides)
  with pytest.raises((ValueError, TypeError)) as err:
    pallax.paged_attention(
      call.pop("q"),
      call.pop("k_pages"),
      call.pop("v_pages"),
      call.pop("lengths"),
      call.pop("page_indices"),
      **call,
    )
  assert word in str(err.value), str(err.value)


# ------------------------------------------------------------------------------
# Lowering for every platform, and larger sizes.


@pytest.mark.lowering
@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_lowers_to_the_kernel(platform, dtype):
  b, n, kv, h, ps, pps = 4, 32, 8, 128, 16, 16
  args = (
    jnp.zeros((b, n, h), dtype),
    jnp.zeros((kv, b * pps, ps, h), dtype),
    jnp.zeros((kv, b * pps, ps, h), dtype),
    jnp.zeros((b,), jnp.int32),
    jnp.zeros((b, pps), jnp.int32),
  )
  text = lower_text(lambda *a: pallax.paged_attention(*a, logits_soft_cap=30.0), platform, *args)
  assert CALL_TARGET[platform] in text


@pytest.mark.slow
@pytest.mark.parametrize("path", ["xla", *KERNEL_PATHS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_larger(path, dtype):
  case = Case(
    n=16, k=4, h=64, page_size=16, pages_per_sequence=48, table="shared",
    lengths=(0, 1, 15, 16, 17, 300, 767, 768),
  )  # fmt: skip
  _run(case, dtype, path, seed=7, logits_soft_cap=20.0)
