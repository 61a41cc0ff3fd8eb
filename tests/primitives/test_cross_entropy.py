"""cross_entropy / linear_cross_entropy forward: float64 reference, every option, bad input.

Everything is compared with the independent float64 reference of
cross_entropy_reference.py (itself first checked against a per-token NumPy
loop over the smoothed target distribution). The XLA path runs every option
alone and all together, with every reduction and ``return_lse``; both
interpreted kernels run the combined options with the executor's configs and
with small pinned blocks that split tokens, vocabulary and hidden dim into
ragged blocks. Also: float32 / bfloat16 / float64, 2-D and 3-D ``x``, odd
vocabularies (up to 50257), all-ignored batches, labels at 0 and V - 1,
out-of-range labels (NaN when traced, ValueError when concrete), a tied
embedding's transpose, the tokamax-compatible alias and bad input.
AD is in test_cross_entropy_ad.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies

import pallax
from tests.helpers import assert_close, lower_text, on_path, rand, to64, x64
from tests.primitives.cross_entropy_reference import (
  IGNORE,
  KERNEL_PATH_CONFIGS,
  OPS,
  OPTIONS,
  REDUCTIONS,
  assert_loss_close,
  inputs,
  labels_for,
  linear_reference,
  loss_dtype,
  numpy_reference,
  pallax_loss,
  pc_config,
  pc_id,
  reference,
  reference_loss,
)

V = 301  # not a multiple of any block
TOKENS = (2, 7)  # 3-D x / logits


def _ignore_index(options: dict):
  return options.get("ignore_index", IGNORE)


def _all_reductions(op, ops, config=None, **options):
  """Losses of every reduction, then the lse (return_lse with reduction "none")."""
  outs = [pallax_loss(op, ops, config, reduction=r, **options) for r in REDUCTIONS]
  _, lse = pallax_loss(op, ops, config, reduction="none", return_lse=True, **options)
  return outs + [lse]


def _reference_all_reductions(op, ops, **options):
  outs = [reference_loss(op, ops, reduction=r, **options) for r in REDUCTIONS]
  return outs + [reference_loss(op, ops, reduction="none", return_lse=True, **options)[1]]


def _check_all_reductions(got, want, ops, dtype, what, options):
  labels = np.asarray(ops["labels"])
  ignore_index = _ignore_index(options)
  for g, w, name in zip(got, want, REDUCTIONS + ("lse",)):
    assert g.dtype == loss_dtype(dtype), (what, name, g.dtype)
    assert g.shape == (() if name in ("mean", "sum") else labels.shape), (what, name, g.shape)
    assert_loss_close(g, w, dtype, f"{what}: {name}")
  if ignore_index is not None:
    ignored = labels == ignore_index
    assert ignored.any()
    np.testing.assert_array_equal(np.asarray(got[2])[ignored], 0.0, err_msg=f"{what}: ignored")


# ----------------------------------------------------------------------------
# The reference itself.


@pytest.mark.parametrize("name", list(OPTIONS) + ["labels_only_ignore_0"])
def test_reference_against_numpy(name):
  """The reference equals a per-token loop over the smoothed target distribution."""
  options = dict(OPTIONS.get(name, dict(ignore_index=0)))
  rng = np.random.default_rng(0)
  z = rng.standard_normal((3, 11, 37)) * 3
  labels = np.asarray(labels_for(rng, (3, 11), 37, _ignore_index(options)))
  with x64():
    got = reference(jnp.asarray(z), jnp.asarray(labels), reduction="none", **options)
  want = numpy_reference(z, labels, **options)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
  ignore_index = _ignore_index(options)
  count = labels.size if ignore_index is None else np.sum(labels != ignore_index)
  with x64():
    mean = reference(jnp.asarray(z), jnp.asarray(labels), **options)
  np.testing.assert_allclose(float(mean), want.sum() / count, rtol=1e-12)


def test_reference_smoothing_matches_optax_formulation():
  """Uniform smoothing over V (PyTorch / Optax): the loss against ``(1 - eps) onehot + eps / V``."""
  rng = np.random.default_rng(1)
  z, labels = rng.standard_normal((5, 13)), np.arange(5) * 3
  eps = 0.3
  q = np.full((5, 13), eps / 13)
  q[np.arange(5), labels] += 1 - eps
  logp = z - np.log(np.sum(np.exp(z), -1, keepdims=True))
  with x64():
    got = reference(jnp.asarray(z), jnp.asarray(labels), label_smoothing=eps, reduction="none")
  np.testing.assert_allclose(np.asarray(got), -np.sum(q * logp, -1), rtol=1e-12)


# ----------------------------------------------------------------------------
# Options and reductions on the XLA path.

XLA_OPTIONS = dict(OPTIONS, smoothing_1=dict(label_smoothing=1.0), big_z_loss=dict(z_loss=0.5))


@pytest.mark.parametrize("name", list(XLA_OPTIONS))
@pytest.mark.parametrize("op", OPS)
def test_options_and_reductions(op, name):
  options = XLA_OPTIONS[name]
  rng = np.random.default_rng(2)
  ops = inputs(op, rng, TOKENS, V, ignore_index=_ignore_index(options))
  got = jax.jit(lambda ops: _all_reductions(op, ops, **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, jnp.float32, f"{op} {name}", options)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("cap", [None, 2.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("ignore_index", [5, None], ids=str)
def test_linear_combinations(ignore_index, cap, bias):
  """Every combination of bias, soft cap and ignore index, with smoothing and z-loss."""
  options = dict(ignore_index=ignore_index, logit_soft_cap=cap, label_smoothing=0.15, z_loss=3e-3)
  rng = np.random.default_rng(3)
  ops = inputs("linear_cross_entropy", rng, (19,), V, d=33, bias=bias, ignore_index=ignore_index)
  got = jax.jit(lambda ops: _all_reductions("linear_cross_entropy", ops, **options))(ops)
  with x64():
    want = _reference_all_reductions("linear_cross_entropy", ops, **options)
  _check_all_reductions(got, want, ops, jnp.float32, "combination", options)


def test_lse_includes_the_soft_cap_and_ignored_tokens():
  rng = np.random.default_rng(4)
  z = rand(rng, (6, 50), scale=8.0)
  labels = jnp.asarray([IGNORE, 3, IGNORE, 0, 49, IGNORE], jnp.int32)
  _, lse = pallax.cross_entropy(z, labels, logit_soft_cap=2.0, return_lse=True)
  with x64():
    zc = 2.0 * jnp.tanh(to64(z) / 2.0)
    want = jax.nn.logsumexp(zc, -1)
  assert lse.shape == (6,) and lse.dtype == jnp.float32
  assert_close(lse, want, jnp.float32, "lse")


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("op", OPS)
def test_all_ignored(op, reduction):
  """All tokens ignored: "mean" is 0.0 (not NaN), "sum" 0, "none" zeros; lse is still right."""
  rng = np.random.default_rng(5)
  ops = inputs(op, rng, (3, 4), V)
  ops["labels"] = jnp.full((3, 4), IGNORE, jnp.int32)
  loss, lse = jax.jit(
    lambda ops: pallax_loss(op, ops, reduction=reduction, return_lse=True, z_loss=1e-2)
  )(ops)
  np.testing.assert_array_equal(np.asarray(loss), np.zeros(() if reduction != "none" else (3, 4)))
  assert loss.dtype == jnp.float32
  with x64():
    want = reference_loss(op, ops, reduction="none", return_lse=True)[1]
  assert_close(lse, want, jnp.float32, "lse")


@pytest.mark.parametrize("op", OPS)
def test_labels_at_the_vocabulary_edges(op):
  rng = np.random.default_rng(6)
  ops = inputs(op, rng, (16,), V)
  ops["labels"] = jnp.asarray(np.tile([0, V - 1], 8), jnp.int32)
  options = dict(label_smoothing=0.1, logit_soft_cap=3.0, reduction="none")
  got = jax.jit(lambda ops: pallax_loss(op, ops, **options))(ops)
  with x64():
    want = reference_loss(op, ops, **options)
  assert_close(got, want, jnp.float32, "labels 0 and V-1")


@pytest.mark.parametrize("op", OPS)
def test_out_of_range_labels_are_nan_when_traced(op):
  """Labels V, -1 and (with ignore_index=None) -100: NaN there, the right loss elsewhere."""
  rng = np.random.default_rng(7)
  ops = inputs(op, rng, (8,), V)
  ops["labels"] = jnp.asarray([0, V, 3, -1, IGNORE, V - 1, V + 1000, 7], jnp.int32)
  for ignore_index, bad in ((IGNORE, [1, 3, 6]), (None, [1, 3, 4, 6])):
    loss, mean = jax.jit(
      lambda ops, i=ignore_index: [
        pallax_loss(op, ops, reduction=r, ignore_index=i) for r in ("none", "mean")
      ]
    )(ops)
    loss = np.asarray(loss)
    nan = np.zeros(8, bool)
    nan[bad] = True
    np.testing.assert_array_equal(np.isnan(loss), nan, err_msg=f"ignore_index={ignore_index}")
    assert np.isnan(mean)
    with x64():
      want = np.asarray(reference_loss(op, ops, reduction="none", ignore_index=ignore_index))
    assert_close(loss[~nan], want[~nan], jnp.float32, f"valid tokens, ignore_index={ignore_index}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
  "labels, ignore_index",
  [([0, V], IGNORE), ([-1, 2], IGNORE), ([IGNORE, 2], None)],
  ids=["V", "-1", "-100 with ignore_index None"],
)
def test_out_of_range_concrete_labels_raise(op, labels, ignore_index):
  rng = np.random.default_rng(8)
  ops = inputs(op, rng, (2,), V)
  for concrete in (jnp.asarray(labels, jnp.int32), np.asarray(labels, np.int32)):
    with pytest.raises(ValueError, match="labels"):
      pallax_loss(op, {**ops, "labels": concrete}, ignore_index=ignore_index)
  # Concrete labels that are all in range (or ignored) are fine.
  pallax_loss(op, {**ops, "labels": np.asarray([V - 1, IGNORE], np.int32)})


# ----------------------------------------------------------------------------
# Both interpreted kernels, and the XLA path, on the combined options.


def _kernel_shape(pc):
  """Tokens, D: several token and hidden blocks of the small pinned configs (ragged)."""
  path, small = pc
  return ((20,), 160) if path == "mosaic_tpu" and small else ((4, 5), 40)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("pc", KERNEL_PATH_CONFIGS, ids=pc_id)
def test_kernel_paths(pc, op):
  path, _ = pc
  options = dict(label_smoothing=0.1, z_loss=1e-2, logit_soft_cap=3.0)
  tokens, d = _kernel_shape(pc)
  rng = np.random.default_rng(9)
  ops = inputs(op, rng, tokens, V, d=d)
  with on_path(path):
    got = jax.jit(lambda ops: _all_reductions(op, ops, pc_config(pc), **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, jnp.float32, f"{pc_id(pc)} {op}", options)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_kernel_bfloat16(path, op):
  rng = np.random.default_rng(10)
  options = dict(label_smoothing=0.1, logit_soft_cap=5.0)
  ops = inputs(op, rng, (24,), V, d=64, dtype=jnp.bfloat16)
  with on_path(path):
    got = jax.jit(lambda ops: _all_reductions(op, ops, **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, jnp.bfloat16, f"{path} bfloat16 {op}", options)


# ----------------------------------------------------------------------------
# Dtypes, shapes, vocabularies.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64], ids=jnp.dtype)
@pytest.mark.parametrize("op", OPS)
def test_dtypes(op, dtype):
  """float32, bfloat16 (its rounded inputs in the reference) and float64 (tight)."""
  options = dict(label_smoothing=0.1, z_loss=1e-3, logit_soft_cap=4.0)
  rng = np.random.default_rng(11)
  with jax.enable_x64(dtype == jnp.float64):
    ops = inputs(op, rng, TOKENS, V, dtype=dtype)
    got = jax.jit(lambda ops: _all_reductions(op, ops, **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, dtype, f"{op} {jnp.dtype(dtype).name}", options)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("tokens", [(), (13,), (2, 3, 4)], ids=str)
def test_leading_dims(op, tokens):
  """Any number of token dims, a single token with a scalar label included."""
  rng = np.random.default_rng(12)
  ops = inputs(op, rng, tokens, 97, d=16, ignore_index=None)
  got = jax.jit(lambda ops: _all_reductions(op, ops, ignore_index=None))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, ignore_index=None)
  for g, w, name in zip(got, want, REDUCTIONS + ("lse",)):
    assert g.shape == (() if name in ("mean", "sum") else tokens)
    assert_close(g, w, jnp.float32, f"{name} {tokens}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("v", [2, 7, 1031, 50257], ids=str)
def test_odd_vocabularies(op, v):
  """Vocabularies not a multiple of any block or chunk, GPT-2's 50257 with few tokens."""
  rng = np.random.default_rng(13)
  options = dict(label_smoothing=0.1, z_loss=1e-3)
  ops = inputs(op, rng, (5,) if v > 2000 else (3, 7), v, d=8)
  got = jax.jit(lambda ops: _all_reductions(op, ops, **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, jnp.float32, f"V={v}", options)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("path", ["triton", "mosaic_tpu"])
def test_kernel_large_vocabulary(path, op):
  """V = 50257 with the executor's configs: many vocabulary blocks, a ragged last one."""
  rng = np.random.default_rng(14)
  options = dict(label_smoothing=0.1, logit_soft_cap=10.0)
  ops = inputs(op, rng, (16,), 50257, d=32)
  with on_path(path):
    got = jax.jit(lambda ops: _all_reductions(op, ops, **options))(ops)
  with x64():
    want = _reference_all_reductions(op, ops, **options)
  _check_all_reductions(got, want, ops, jnp.float32, f"{path} V=50257", options)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int32], ids=jnp.dtype)
@pytest.mark.parametrize("op", OPS)
def test_label_dtypes(op, dtype):
  rng = np.random.default_rng(15)
  ops = inputs(op, rng, (9,), 120, ignore_index=None)
  labels = ops["labels"]
  got = jax.jit(lambda ops: pallax_loss(op, ops, reduction="none", ignore_index=None))(
    {**ops, "labels": labels.astype(dtype)}
  )
  with x64():
    want = reference_loss(op, ops, reduction="none", ignore_index=None)
  assert_close(got, want, jnp.float32, jnp.dtype(dtype).name)


def test_tied_embedding_transpose():
  """A tied embedding ``(V, D)`` passes ``embedding.T``; forward equals the reference."""
  rng = np.random.default_rng(16)
  x, emb = rand(rng, (3, 6, 32)), rand(rng, (V, 32), scale=0.3)
  labels = labels_for(rng, (3, 6), V)
  got = jax.jit(
    lambda x, emb, labels: pallax.linear_cross_entropy(x, emb.T, labels, reduction="none")
  )(x, emb, labels)
  with x64():
    want = linear_reference(to64(x), to64(emb).T, labels, reduction="none")
  assert_close(got, want, jnp.float32, "tied embedding")


def _table_programs(v: int, d: int):
  """``value_and_grad`` of the loss through ``embedding.T``, and with the transpose hidden.

  The second passes the transpose through a nested jit, whose result the
  lowering cannot trace back to the table: it is the copy the first avoids.
  """
  labels = jnp.zeros((64,), jnp.int32)
  direct = lambda x, emb: pallax.linear_cross_entropy(x, emb.T, labels)
  hidden = lambda x, emb: pallax.linear_cross_entropy(x, jax.jit(lambda e: e.T)(emb), labels)
  return [jax.jit(jax.value_and_grad(f, (0, 1))) for f in (direct, hidden)]


def _table_sized(hlo: str, v: int, d: int) -> list[str]:
  """Instructions of a compiled HLO module that write a (transposed) table besides the kernels."""
  shapes = re.compile(rf"\[(1,)?({v},{d}|{d},{v})\]")
  return [
    line.strip()
    for line in hlo.splitlines()
    if " = " in line
    and shapes.search(line.split(" = ")[1].split("(")[0])
    and not re.search(r"custom-call|parameter\(|bitcast\(|ROOT %tuple", line)
  ]


@pytest.mark.compilers
@pytest.mark.lowering
def test_embedding_transpose_is_not_copied_on_tpu():
  """Compiled for TPU v5e: ``embedding.T`` costs no copy of the table, forward or backward."""
  from pallax.verify.targets import TARGETS

  v, d = 1000, 128
  mesh = jax.sharding.Mesh(
    np.array(topologies.get_topology_desc(**TARGETS["v5e"].topology_kwargs()).devices[:1]), ("x",)
  )
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((64, d), jnp.bfloat16, sharding=s)
  emb = jax.ShapeDtypeStruct((v, d), jnp.bfloat16, sharding=s)
  direct, hidden = (f.trace(x, emb).lower().compile().as_text() for f in _table_programs(v, d))
  assert _table_sized(direct, v, d) == []
  assert _table_sized(hidden, v, d), "the control program should copy the table"


@pytest.mark.lowering
def test_embedding_transpose_is_read_in_place_on_gpu():
  """Lowered for CUDA: the kernels read the table itself, not its transpose."""
  v, d = 1000, 128
  x = jax.ShapeDtypeStruct((64, d), jnp.bfloat16)
  emb = jax.ShapeDtypeStruct((v, d), jnp.bfloat16)
  direct, hidden = (lower_text(f, "cuda", x, emb) for f in _table_programs(v, d))
  read_in_place = f"stablehlo.broadcast_in_dim %arg1, dims = [1, 2] : (tensor<{v}x{d}xbf16>)"
  assert read_in_place in direct
  assert read_in_place not in hidden


def test_eager_matches_jit():
  rng = np.random.default_rng(17)
  for op in OPS:
    ops = inputs(op, rng, (2, 5), 64, d=16)
    for r in REDUCTIONS:
      eager = pallax_loss(op, ops, reduction=r, z_loss=1e-3)
      jitted = jax.jit(lambda ops, r=r: pallax_loss(op, ops, reduction=r, z_loss=1e-3))(ops)
      np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# The tokamax-compatible alias.


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_softmax_cross_entropy_loss(reduction):
  rng = np.random.default_rng(18)
  b, h = 24, 40
  x, w = rand(rng, (b, h)), rand(rng, (h, V), scale=0.3)
  labels = labels_for(rng, (b,), V, ignore_index=None)
  fn = lambda x, labels, w: pallax.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction=reduction
  )
  loss = jax.jit(fn)(x, labels, w)
  dx, dw = jax.jit(jax.grad(fn, (0, 2)))(x, labels, w)
  with x64():
    ref = lambda x, w: linear_reference(x, w, labels, ignore_index=None, reduction=reduction)
    want = ref(to64(x), to64(w))
    dx_ref, dw_ref = jax.grad(ref, (0, 1))(to64(x), to64(w))
  assert loss.shape == () and loss.dtype == jnp.float32
  assert_close(loss, want, jnp.float32, f"alias {reduction}")
  assert_close(dx, dx_ref, jnp.float32, "alias dx")
  assert_close(dw, dw_ref, jnp.float32, "alias dweights")


def test_linear_softmax_cross_entropy_loss_defaults_and_precision():
  """The default reduction is "sum"; a precision is accepted; -100 is a label like any other."""
  rng = np.random.default_rng(19)
  x, w = rand(rng, (10, 16)), rand(rng, (16, 50), scale=0.3)
  labels = labels_for(rng, (10,), 50, ignore_index=None)
  default = pallax.linear_softmax_cross_entropy_loss(x, labels, w)
  highest = pallax.linear_softmax_cross_entropy_loss(
    x, labels, w, reduction="sum", precision=jax.lax.Precision.HIGHEST
  )
  with x64():
    want = linear_reference(to64(x), to64(w), labels, ignore_index=None, reduction="sum")
  assert_close(default, want, jnp.float32, "default reduction")
  assert_close(highest, want, jnp.float32, "precision=HIGHEST")
  bad = labels.at[3].set(IGNORE)
  assert np.isnan(jax.jit(pallax.linear_softmax_cross_entropy_loss)(x, bad, w))


# ----------------------------------------------------------------------------
# Bad input.

_X, _W, _B = jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16,))
_LABELS = jnp.zeros((4,), jnp.int32)

# (overrides of a valid linear_cross_entropy call, exception, words in the message)
BAD_LINEAR = {
  "x scalar": (dict(x=jnp.float32(1.0), labels=jnp.zeros((), jnp.int32)), ValueError, ["x"]),
  "x integer": (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, ["x"]),
  "labels float": (dict(labels=jnp.zeros((4,))), TypeError, ["labels"]),
  "labels bool": (dict(labels=jnp.zeros((4,), bool)), TypeError, ["labels"]),
  "labels shape": (dict(labels=jnp.zeros((5,), jnp.int32)), ValueError, ["labels"]),
  "labels rank": (dict(labels=jnp.zeros((4, 1), jnp.int32)), ValueError, ["labels"]),
  "weight 1-D": (dict(weight=jnp.ones((8,))), ValueError, ["weight"]),
  "weight 3-D": (dict(weight=jnp.ones((1, 8, 16))), ValueError, ["weight"]),
  "weight D": (dict(weight=jnp.ones((9, 16))), ValueError, ["weight"]),
  "weight transposed": (dict(weight=jnp.ones((16, 8))), ValueError, ["weight"]),
  "bias shape": (dict(bias=jnp.ones((15,))), ValueError, ["bias"]),
  "bias rank": (dict(bias=jnp.ones((1, 16))), ValueError, ["bias"]),
  "smoothing negative": (dict(label_smoothing=-0.1), ValueError, ["label_smoothing"]),
  "smoothing > 1": (dict(label_smoothing=1.5), ValueError, ["label_smoothing"]),
  "z_loss negative": (dict(z_loss=-1e-4), ValueError, ["z_loss"]),
  "cap zero": (dict(logit_soft_cap=0.0), ValueError, ["logit_soft_cap"]),
  "cap negative": (dict(logit_soft_cap=-5.0), ValueError, ["logit_soft_cap"]),
  "reduction": (dict(reduction="avg"), ValueError, ["reduction"]),
  "config string": (dict(config="fast"), TypeError, ["config"]),
  "config class": (dict(config=pallax.NormConfig(block_rows=8)), TypeError, ["config"]),
}


def _bad_linear(overrides):
  call = dict(x=_X, weight=_W, labels=_LABELS, bias=_B)
  call.update(overrides)
  return pallax.linear_cross_entropy(call.pop("x"), call.pop("weight"), call.pop("labels"), **call)


@pytest.mark.parametrize("name", list(BAD_LINEAR))
def test_bad_input_linear(name):
  overrides, exc, words = BAD_LINEAR[name]
  with pytest.raises(exc) as err:
    _bad_linear(overrides)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


# (overrides of a valid cross_entropy call, exception, words in the message)
BAD_LOGITS = {
  "logits scalar": (
    dict(logits=jnp.float32(1.0), labels=jnp.zeros((), jnp.int32)),
    ValueError,
    ["logits"],
  ),
  "logits integer": (dict(logits=jnp.ones((4, 16), jnp.int32)), TypeError, ["logits"]),
  "labels float": (dict(labels=jnp.zeros((4,))), TypeError, ["labels"]),
  "labels shape": (dict(labels=jnp.zeros((4, 16), jnp.int32)), ValueError, ["labels"]),
  "smoothing > 1": (dict(label_smoothing=1.01), ValueError, ["label_smoothing"]),
  "z_loss negative": (dict(z_loss=-1.0), ValueError, ["z_loss"]),
  "cap zero": (dict(logit_soft_cap=0), ValueError, ["logit_soft_cap"]),
  "reduction": (dict(reduction="batchmean"), ValueError, ["reduction"]),
  "reduction None": (dict(reduction=None), (ValueError, TypeError), ["reduction"]),
  "config": (dict(config=pallax.SoftmaxConfig(block_rows=4, block_cols=32)), TypeError, ["config"]),
}


@pytest.mark.parametrize("name", list(BAD_LOGITS))
def test_bad_input_logits(name):
  overrides, exc, words = BAD_LOGITS[name]
  call = dict(logits=jnp.ones((4, 16)), labels=_LABELS)
  call.update(overrides)
  with pytest.raises(exc) as err:
    pallax.cross_entropy(call.pop("logits"), call.pop("labels"), **call)
  for word in words:
    assert word in str(err.value), (word, str(err.value))


def test_bad_input_alias():
  with pytest.raises(ValueError, match="reduction"):
    pallax.linear_softmax_cross_entropy_loss(_X, _LABELS, _W, reduction="avg")
  with pytest.raises(ValueError, match="weights|weight"):
    pallax.linear_softmax_cross_entropy_loss(_X, _LABELS, jnp.ones((9, 16)))


def test_valid_options_are_accepted():
  """The bad-input table's valid call with every option set at its limits: no error."""
  loss, lse = _bad_linear(
    dict(
      label_smoothing=1.0,
      z_loss=0.0,
      logit_soft_cap=1e-3,
      reduction="none",
      return_lse=True,
      ignore_index=None,
      config=pallax.CrossEntropyConfig(block_n=16, block_v=32, block_d=16, implementation="xla"),
    )
  )
  assert loss.shape == lse.shape == (4,)


def test_bad_input_inside_jit_and_vmap():
  with pytest.raises(ValueError, match="labels"):
    jax.jit(lambda x, labels: pallax.linear_cross_entropy(x, _W, labels))(
      _X, jnp.zeros((3,), jnp.int32)
    )
  with pytest.raises(TypeError, match="labels"):
    jax.jit(lambda z, labels: pallax.cross_entropy(z, labels))(jnp.ones((4, 16)), jnp.zeros(4))
  with pytest.raises(ValueError, match="weight"):
    jax.vmap(lambda x: pallax.linear_cross_entropy(x, jnp.ones((7, 16)), _LABELS))(
      jnp.ones((2, 4, 8))
    )
