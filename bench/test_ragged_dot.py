"""ragged_dot vs ``lax.ragged_dot``, tokamax's ``ragged_dot`` and a dense GEMM of the same FLOPs.

Run (``-n 0``: pytest-benchmark does not time under xdist)::

  pytest -n 0 bench/test_ragged_dot.py --benchmark-group-by=param:shape,param:groups,param:mode

Shapes are ``(M, K, N, G)``: ``[M, K]`` rows in G groups times ``[G, K, N]``.
Groups: ``even`` (M / G rows each), ``skewed`` (halving: M/2, M/4, ...,
an empty group, the rest in the last) or ``random`` (G - 1 uniform cuts, as
routing gives). Impls: ``pallax``, ``lax`` (XLA's
``ragged_dot``, on CPU and GPU a masked dense product over every group: G
times the FLOPs; its ``hvp`` raises, reported as the peer's error),
``tokamax`` (``tokamax.ragged_dot``, its default implementation: the
``bench`` extra installs tokamax; ``custom_vjp``, so ``jvp`` raises) and
``dense`` (``[M, K] @ [K, N]``: the same FLOPs as one GEMM, the bound a
grouped GEMM aims at). Modes as in ``bench/modes.py``.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from modes import MODES
from peers import tokamax
from throughput import record_throughput

import pallax
from pallax import roofline

SHAPES = [(8192, 1024, 2048, 8)]
GROUPS = ("even", "skewed", "random")
IMPLS = ("pallax", "lax", "tokamax", "dense")


def group_sizes(m: int, g: int, kind: str) -> np.ndarray:
  if kind == "even":
    return np.full(g, m // g, np.int32)
  if kind == "random":  # what routing gives: a group boundary inside nearly every tile
    cuts = np.sort(np.random.default_rng(2).integers(0, m, g - 1))
    return np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
  sizes = [m // 2**i for i in range(1, g)]
  sizes[-1] = 0
  return np.asarray([*sizes, m - sum(sizes)], np.int32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("dtype", [jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_ragged_dot(benchmark, bench, impl, mode, groups, dtype, shape):
  m, k, n, g = shape
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  sizes = jnp.asarray(group_sizes(m, g, groups))
  if impl == "dense":
    fn, args = (lambda a, b: a @ b), [lhs, jnp.asarray(rng.standard_normal((k, n)), dtype)]
  else:
    op = {"pallax": pallax.ragged_dot, "lax": lax.ragged_dot}.get(impl)
    op = op or tokamax().ragged_dot
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), dtype)
    fn, args = (lambda a, b: op(a, b, sizes)), [lhs, rhs]
  info = dict(op="ragged_dot", impl=impl, mode=mode, dtype=jnp.dtype(dtype).name, shape=list(shape))
  benchmark.extra_info.update(info, variant=groups)
  peer = impl != "pallax"
  call = bench.transformed(fn, args, mode, np.random.default_rng(1), peer)
  if call is None or not bench(call[0], *call[1], rounds=5, peer=peer):
    return
  if mode in roofline.MODES:
    record_throughput(benchmark, roofline.ragged_dot_work(m, k, n, g, dtype, mode), dtype)
