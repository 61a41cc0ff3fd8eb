"""pallax.pallas_triton: the tile masks the Pallas-Triton kernels share, and their launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallax.kernels.attention.config import AttentionConfig
from pallax.pallas_triton import padded_ok, tile_mask, triton_call


@pytest.mark.parametrize("size, extent", [(16, 16), (16, 9), (128, 80), (8, 0)])
def test_padded_ok_marks_the_positions_below_the_extent(size, extent):
  got = padded_ok(size, extent)
  if size == extent:
    assert got is None
  else:
    np.testing.assert_array_equal(np.asarray(got), np.arange(size) < extent)


def test_tile_mask_is_the_outer_and_of_the_row_and_column_masks():
  rows = np.array([True, True, False])
  cols = np.array([True, False, True, True])
  assert tile_mask(None, None) is None
  np.testing.assert_array_equal(np.asarray(tile_mask(rows, None)), rows[:, None])
  np.testing.assert_array_equal(np.asarray(tile_mask(None, cols)), cols[None, :])
  np.testing.assert_array_equal(np.asarray(tile_mask(rows, cols)), np.outer(rows, cols))


def test_triton_call_runs_the_kernel_over_its_grid_interpreted():
  """A blockwise ``2 x + 1`` over a (24, 8) array in (8, 8) blocks."""
  x = jnp.arange(24 * 8, dtype=jnp.float32).reshape(24, 8)

  def kernel(x_ref, o_ref):
    o_ref[...] = 2 * x_ref[...] + 1

  spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
  config = AttentionConfig(block_q=16, block_k=16, num_warps=2, num_stages=1)
  [out] = triton_call(
    kernel,
    (3,),
    [x],
    [spec],
    [jax.ShapeDtypeStruct(x.shape, x.dtype)],
    [spec],
    config,
    True,
    "double_plus_one",
  )
  np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x) + 1)
