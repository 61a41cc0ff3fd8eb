"""cross_entropy / linear_cross_entropy on several devices: sharded jit and shard_map.

Runs on 8 fake CPU devices (tests/conftest.py). Tokens shard freely (``x``
and labels along their token dims) and so does the vocabulary: a
tensor-parallel LM head's weight sharded on its last dim (and its bias), or
logits sharded on the vocabulary, combine per-shard statistics by small
all-reduces. The compiled HLO of the forward and of the gradient holds no
all-gather, and no all-reduce as large as a shard of the logits (the forward
reduces only per-token statistics and the loss); the results equal the
float64 reference.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pallax
from tests.helpers import assert_close, mesh_4x2, on_path, rand, to64, x64
from tests.primitives.cross_entropy_reference import (
  labels_for,
  linear_reference,
  reference,
  small_blocks,
)

# 128 tokens as (32, 4), D = 8, V = 256: a shard of the logits (16 x 256 at
# least) is larger than any shard of x, weight or their gradients.
TOKENS, D, V = (32, 4), 8, 256
N = math.prod(TOKENS)
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=5.0)

# (x and labels, weight, bias) partition specs of linear_cross_entropy.
LINEAR_SPECS = {
  "tokens": (P("a"), P(), P()),
  "tokens-all-devices": (P(("a", "b")), P(), P()),
  "tokens-2d": (P("a", "b"), P(), P()),
  "vocab": (P(), P(None, "b"), P("b")),
  "vocab-all-devices": (P(), P(None, ("a", "b")), P(("a", "b"))),
  "tokens-vocab": (P("a"), P(None, "b"), P("b")),
}


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rand(rng, TOKENS + (D,))
  w, b = rand(rng, (D, V), scale=0.7), rand(rng, (V,), scale=0.5)
  labels = labels_for(rng, TOKENS, V)
  ct = rand(rng, TOKENS)
  return x, w, b, labels, ct


def _forward(fn):
  def f(x, w, b, labels):
    per_token, lse = fn(x, w, labels, bias=b, reduction="none", return_lse=True, **OPTIONS)
    return fn(x, w, labels, bias=b, **OPTIONS), per_token, lse

  return f


def _grad(fn):
  def g(x, w, b, labels, ct):
    def loss(x, w, b):
      mean = fn(x, w, labels, bias=b, **OPTIONS)
      return mean + jnp.sum(fn(x, w, labels, bias=b, reduction="none", **OPTIONS) * ct)

    return jax.grad(loss, (0, 1, 2))(x, w, b)

  return g


def _linear_ref(x, w, labels, bias=None, **kw):
  return linear_reference(x, w, labels, bias=bias, **kw)


def _all_reduce_sizes(hlo: str) -> list[int]:
  """Element counts of the largest array each all-reduce of the HLO text produces."""
  sizes = []
  for line in hlo.splitlines():
    if not re.search(r"\ball-reduce(-start)?\(", line):
      continue
    result_type = line.split("=", 1)[1].split("all-reduce")[0]
    shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", result_type)
    sizes.append(max(math.prod(int(d) for d in s.split(",") if d) for s in shapes))
  return sizes


def _shard_sizes(spec) -> tuple[int, int, int]:
  """Elements of one device's shard of x, of the weight and of the logits under the specs."""
  mesh_sizes = {"a": 4, "b": 2}
  parts = lambda entry: math.prod(
    mesh_sizes[a] for a in ((entry,) if isinstance(entry, str) else entry or ())
  )
  x_spec, w_spec, _ = spec
  token_parts = math.prod(parts(e) for e in tuple(x_spec))
  vocab_parts = parts(tuple(w_spec)[1]) if len(tuple(w_spec)) > 1 else 1
  return N // token_parts * D, D * V // vocab_parts, N // token_parts * V // vocab_parts


def _check_hlo(fwd_hlo: str, grad_hlo: str, spec, name: str) -> None:
  assert "all-gather" not in fwd_hlo, f"{name}: all-gather in the forward"
  assert "all-gather" not in grad_hlo, f"{name}: all-gather in the gradient"
  fwd_sizes, grad_sizes = _all_reduce_sizes(fwd_hlo), _all_reduce_sizes(grad_hlo)
  # The forward reduces per-token statistics and the loss, nothing per vocabulary entry.
  assert all(s <= N for s in fwd_sizes), f"{name}: forward all-reduces {fwd_sizes}"
  # The gradient may sum dx, dweight and dbias across shards, never the logits' cotangent.
  x_shard, w_shard, logits_shard = _shard_sizes(spec)
  largest = max(x_shard, w_shard, N)
  assert largest < logits_shard  # the shapes tell the two apart
  assert all(s <= largest for s in grad_sizes), f"{name}: gradient all-reduces {grad_sizes}"


def _check_linear(mesh, name, path="xla", seed=0):
  x, w, b, labels, ct = _data(seed)
  xs, ws, bs = LINEAR_SPECS[name]
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  args = (put(x, xs), put(w, ws), put(b, bs), put(labels, xs))
  sct = put(ct, xs)
  config = small_blocks(path)
  fn = lambda *a, **kw: pallax.linear_cross_entropy(*a, **kw, config=config)
  fwd, grad = jax.jit(_forward(fn)), jax.jit(_grad(fn))
  with on_path(path):
    fwd_c, grad_c = fwd.lower(*args).compile(), grad.lower(*args, sct).compile()
    (mean, per_token, lse), grads = fwd_c(*args), grad_c(*args, sct)
  _check_hlo(fwd_c.as_text(), grad_c.as_text(), LINEAR_SPECS[name], name)
  with x64():
    mean_ref, per_token_ref, lse_ref = _forward(_linear_ref)(to64(x), to64(w), to64(b), labels)
    grads_ref = jax.jit(_grad(_linear_ref))(to64(x), to64(w), to64(b), labels, to64(ct))
  assert_close(mean, mean_ref, jnp.float32, f"{name}: mean")
  assert_close(per_token, per_token_ref, jnp.float32, f"{name}: per-token losses")
  assert_close(lse, lse_ref, jnp.float32, f"{name}: lse")
  for g, want, what in zip(grads, grads_ref, ("dx", "dweight", "dbias")):
    assert_close(g, want, jnp.float32, f"{name}: {what}")
  return args, per_token, grads


@pytest.mark.parametrize(
  "axis_type, name",
  [(AxisType.Auto, name) for name in LINEAR_SPECS] + [(AxisType.Explicit, "tokens-vocab")],
  ids=str,
)
def test_linear_sharded_jit_has_no_all_gather(axis_type, name):
  args, per_token, grads = _check_linear(mesh_4x2(axis_type), name)
  x, w, b, labels = args
  if "tokens" in name:  # per-token results keep the tokens' sharding
    assert per_token.sharding.is_equivalent_to(labels.sharding, per_token.ndim), per_token.sharding
  assert grads[0].sharding.is_equivalent_to(x.sharding, x.ndim), grads[0].sharding
  assert grads[1].sharding.is_equivalent_to(w.sharding, w.ndim), grads[1].sharding


def test_linear_sharded_jit_on_triton():
  _check_linear(mesh_4x2(), "tokens-vocab", "triton", seed=1)


# Logits partition specs of cross_entropy (labels: the tokens' part).
LOGITS_SPECS = {
  "tokens": P("a"),
  "tokens-vocab": P("a", None, "b"),
  "vocab": P(None, None, ("a", "b")),
}


@pytest.mark.parametrize("name", list(LOGITS_SPECS))
def test_logits_sharded_jit_has_no_all_gather(name):
  mesh = mesh_4x2()
  rng = np.random.default_rng(2)
  z = rand(rng, TOKENS + (V,), scale=2.0)
  labels, ct = labels_for(rng, TOKENS, V), rand(rng, TOKENS)
  spec = LOGITS_SPECS[name]
  token_spec = P(*tuple(spec)[:2])
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
  zs, ls, cts = put(z, spec), put(labels, token_spec), put(ct, token_spec)

  def fwd(z, labels):
    per_token, lse = pallax.cross_entropy(z, labels, reduction="none", return_lse=True, **OPTIONS)
    return pallax.cross_entropy(z, labels, **OPTIONS), per_token, lse

  def grad(z, labels, ct):
    loss = lambda z: jnp.sum(pallax.cross_entropy(z, labels, reduction="none", **OPTIONS) * ct)
    return jax.grad(loss)(z)

  fwd_c, grad_c = jax.jit(fwd).lower(zs, ls).compile(), jax.jit(grad).lower(zs, ls, cts).compile()
  fwd_hlo, grad_hlo = fwd_c.as_text(), grad_c.as_text()
  assert "all-gather" not in fwd_hlo and "all-gather" not in grad_hlo, name
  assert all(s <= N for s in _all_reduce_sizes(fwd_hlo)), _all_reduce_sizes(fwd_hlo)
  assert all(s <= N for s in _all_reduce_sizes(grad_hlo)), _all_reduce_sizes(grad_hlo)
  outs, dz = fwd_c(zs, ls), grad_c(zs, ls, cts)
  assert dz.sharding.is_equivalent_to(zs.sharding, dz.ndim), dz.sharding
  with x64():
    z64 = to64(z)
    per_token, lse = reference(z64, labels, reduction="none", return_lse=True, **OPTIONS)
    wants = (reference(z64, labels, **OPTIONS), per_token, lse)
    dz_ref = jax.grad(
      lambda z: jnp.sum(reference(z, labels, reduction="none", **OPTIONS) * to64(ct))
    )(z64)
  for g, w, what in zip(outs, wants, ("mean", "per-token", "lse")):
    assert_close(g, w, jnp.float32, f"{name}: {what}")
  assert_close(dz, dz_ref, jnp.float32, f"{name}: dlogits")


def test_shard_map_over_tokens():
  """Per-shard "sum" losses and their gradients, summed across shards, equal the whole batch's."""
  mesh = mesh_4x2()
  x, w, b, labels, _ = _data(3)

  def loss(x, w, b, labels):
    per_shard = jax.shard_map(
      lambda x, w, b, labels: jax.lax.psum(
        pallax.linear_cross_entropy(x, w, labels, bias=b, reduction="sum", **OPTIONS), ("a", "b")
      ),
      mesh=mesh,
      in_specs=(P(("a", "b")), P(), P(), P(("a", "b"))),
      out_specs=P(),
    )
    return per_shard(x, w, b, labels)

  got = jax.jit(loss)(x, w, b, labels)
  grads = jax.jit(jax.grad(loss, (0, 1, 2)))(x, w, b, labels)
  with x64():
    ref = lambda x, w, b: linear_reference(x, w, labels, bias=b, reduction="sum", **OPTIONS)
    want = ref(to64(x), to64(w), to64(b))
    grads_ref = jax.grad(ref, (0, 1, 2))(to64(x), to64(w), to64(b))
  assert_close(got, want, jnp.float32, "shard_map sum")
  for g, r, what in zip(grads, grads_ref, ("dx", "dweight", "dbias")):
    assert_close(g, r, jnp.float32, f"shard_map {what}")
