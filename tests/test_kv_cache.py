"""update_kv_cache and kv_cache_slots against NumPy: the writes, skipped slots, in place, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallax
from tests.helpers import rand
from tests.primitives.ragged_paged_attention_reference import Batch, inputs


def _numpy_slots(table, kv_lens, cu, num, page_size, tokens):
  slots = np.full(tokens, -1)
  for i in range(num):
    q_len = cu[i + 1] - cu[i]
    for j in range(q_len):
      position = kv_lens[i] - q_len + j
      slots[cu[i] + j] = table[i, position // page_size] * page_size + position % page_size
  return slots


def test_slots_without_sequences_or_pages_skip_every_token():
  z = jnp.zeros((0,), jnp.int32)
  got = pallax.kv_cache_slots(jnp.zeros((0, 3), jnp.int32), z, jnp.zeros((1,), jnp.int32), 0, 4, 5)
  np.testing.assert_array_equal(got, -1)


@pytest.mark.parametrize(
  "kwargs, word",
  [
    (dict(page_size=0), "page_size"),
    (dict(tokens=-1), "tokens"),
    (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "must agree"),
    (dict(kv_lens=jnp.zeros((2,))), "kv_lens"),
  ],
  ids=["page size", "tokens", "shapes", "float lengths"],
)
def test_slots_bad_input(kwargs, word):
  call = dict(
    page_indices=jnp.zeros((2, 3), jnp.int32),
    kv_lens=jnp.zeros((2,), jnp.int32),
    cu_q_lens=jnp.zeros((3,), jnp.int32),
    num_seqs=2,
    page_size=4,
    tokens=5,
  )
  with pytest.raises((ValueError, TypeError), match=word):
    pallax.kv_cache_slots(**{**call, **kwargs})


def test_slots_of_a_mixed_batch():
  q, k_pages, _, kv_lens, table, cu, num = inputs(Batch())
  got = pallax.kv_cache_slots(table, kv_lens, cu, num, k_pages.shape[2], q.shape[0])
  want = _numpy_slots(*map(np.asarray, (table, kv_lens, cu)), int(num[0]), 8, q.shape[0])
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_writes_each_token_into_its_slot_and_skips_negative_ones(dtype):
  rng = np.random.default_rng(0)
  k_pages, v_pages = rand(rng, (2, 6, 4, 8), dtype), rand(rng, (2, 6, 4, 5), dtype)
  k, v = rand(rng, (5, 2, 8), jnp.float32), rand(rng, (5, 2, 5), jnp.float32)
  slots = jnp.asarray([0, 23, -1, 9, 10], jnp.int32)
  new_k, new_v = jax.jit(pallax.update_kv_cache)(k_pages, v_pages, k, v, slots)
  want_k, want_v = np.asarray(k_pages).copy(), np.asarray(v_pages).copy()
  for t, s in enumerate(np.asarray(slots)):
    if s >= 0:
      want_k[:, s // 4, s % 4] = np.asarray(k[t].astype(dtype))
      want_v[:, s // 4, s % 4] = np.asarray(v[t].astype(dtype))
  assert new_k.dtype == dtype and new_v.dtype == dtype
  np.testing.assert_array_equal(new_k, want_k)
  np.testing.assert_array_equal(new_v, want_v)


def test_in_place_when_the_pools_are_donated():
  rng = np.random.default_rng(1)
  k_pages, v_pages = rand(rng, (2, 6, 4, 8)), rand(rng, (2, 6, 4, 8))
  k, v = rand(rng, (3, 2, 8)), rand(rng, (3, 2, 8))
  slots = jnp.asarray([1, 2, 3], jnp.int32)
  step = jax.jit(pallax.update_kv_cache, donate_argnums=(0, 1))
  assert "input_output_alias" in step.lower(k_pages, v_pages, k, v, slots).compile().as_text()
  before = k_pages.unsafe_buffer_pointer()
  new_k, _ = step(k_pages, v_pages, k, v, slots)
  assert k_pages.is_deleted() and new_k.unsafe_buffer_pointer() == before


def test_vmap_matches_a_loop():
  rng = np.random.default_rng(2)
  k_pages, v_pages = rand(rng, (3, 2, 4, 4, 8)), rand(rng, (3, 2, 4, 4, 8))
  k, v = rand(rng, (3, 2, 2, 8)), rand(rng, (3, 2, 2, 8))
  slots = jnp.asarray([[0, 5], [-1, 15], [7, 3]], jnp.int32)
  got = jax.vmap(pallax.update_kv_cache)(k_pages, v_pages, k, v, slots)
  for i in range(3):
    want = pallax.update_kv_cache(k_pages[i], v_pages[i], k[i], v[i], slots[i])
    np.testing.assert_array_equal(got[0][i], want[0])
    np.testing.assert_array_equal(got[1][i], want[1])


_POOL, _KV = (2, 6, 4, 8), (3, 2, 8)
BAD = {
  "k_pages rank": (dict(k_pages=jnp.ones((6, 4, 8))), "k_pages"),
  "pools mismatch": (dict(v_pages=jnp.ones((2, 5, 4, 8))), "v_pages"),
  "k shape": (dict(k=jnp.ones((3, 1, 8))), "(T, K, H)"),
  "integer k": (dict(k=jnp.ones(_KV, jnp.int32)), "k"),
  "float slots": (dict(slot_mapping=jnp.ones((3,))), "slot_mapping"),
  "slots shape": (dict(slot_mapping=jnp.zeros((4,), jnp.int32)), "slot_mapping"),
  "slot past the pool": (dict(slot_mapping=jnp.asarray([0, 1, 24], jnp.int32)), "below"),
  "slot twice": (dict(slot_mapping=jnp.asarray([0, 5, 5], jnp.int32)), "twice"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input(name):
  overrides, word = BAD[name]
  call = dict(
    k_pages=jnp.ones(_POOL),
    v_pages=jnp.ones(_POOL),
    k=jnp.ones(_KV),
    v=jnp.ones(_KV),
    slot_mapping=jnp.asarray([0, 1, 2], jnp.int32),
  )
  call.update(overrides)
  with pytest.raises((ValueError, TypeError)) as err:
    pallax.update_kv_cache(**call)
  assert word in str(err.value), str(err.value)
