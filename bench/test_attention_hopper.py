"""dot_product_attention on Hopper: the Mosaic GPU kernels against Pallas-Triton and cuDNN.

Run on an H100 or H200 (issue 28's table)::

  XLA_PYTHON_CLIENT_PREALLOCATE=false pytest -n 0 bench/test_attention_hopper.py \\
      --benchmark-json hopper.json

Cases: bfloat16, N = 16 query and key/value heads, H = 128, B = 4 at S = 4096
and B = 2 at S = 8192, causal or not, ``fwd``, ``fwd+bwd`` and ``jvp``
(``bench/modes.py``). Each case times, in one process and one test, three to eight
implementations:

* ``pallax``: the executor's choice, on Hopper the Mosaic GPU kernels
  (``pallax.explain``'s picks are recorded in ``pallax_kernels``);
* ``pallax-triton``: the same call with the Pallas-Triton kernels' own
  heuristic configs pinned (an executor overlay);
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``; under
  ``jvp``, where cuDNN's ``custom_vjp`` raises, ``xla``: the same with
  ``implementation="xla"`` (what JAX users get for a tangent);
* ``pallax-fused`` and ``pallax-fused2`` (``fwd+bwd``): the backward pinned
  to the Mosaic GPU dk/dv kernel computing dQ too (``fuse_dq``: 5 products
  against 7, TMA reduce-adds) in one consumer warpgroup, and in two
  (``dkdv_consumers=2``, FlashAttention-3's shape) of 32-query steps, and
  ``pallax-fa3``: the two in 64-query steps (FlashAttention-3's tile,
  ``fused_wide_steps``; its causal steps in loops of masked and unmasked
  ones here, one query head a kv head: ``causal_loops``), autotuning
  candidates (never the heuristic's) until their times here say more; left out under
  ``PALLAX_BENCH_FUSED=0``
  (``bench/hopper.sh`` sets it when the fused kernel's tests failed on the
  GPU);
* ``pallax-dq2``, ``pallax-wide`` and ``pallax-two`` (``fwd+bwd``): the
  backward pinned to its dq kernel with two consumer warpgroups
  (``dq_consumers=2``), and with the dk/dv kernel's two consumers of
  32-query steps (``dkdv_rows=32``) or of 64 (``dkdv_consumers=2``) too:
  autotuning candidates;
* ``pallax-overlap`` (``fwd``): the forward pinned to its autotuning
  candidate with FlashAttention-3's intra-warpgroup overlap
  (``fwd_overlap``: a block's ``S`` beside the previous block's ``P V``);
* ``pallax-k192`` (``fwd``, not causal): the forward pinned to its autotuning
  candidate of 192-key blocks (FlashAttention-3's unmasked forward takes 176
  at head dim 128; a causal mask takes 128 there).

``jvp`` counts 3x the forward's FLOPs (``Q K^T``, ``P V`` and, for the
tangent, ``dQ K^T``, ``Q dK^T``, ``(P dS) V`` and ``P dV``) and twice its bytes.

The benchmark itself is pallax's; the others are timed the same way (median
of ``side_by_side.ROUNDS`` samples of calls back to back, the same count a
sample for each, ``calls_per_sample``; and ``one_call_*``: each call alone,
the host's dispatch and wait included, as the sessions before stop 55
measured). ``extra_info``: ``tflop_per_s`` of each
(``pallax.roofline.attention_work``'s FLOPs, causal counting the visible half),
``fraction_of_peak_flops`` (989 TFLOP/s dense bf16 on an H100 SXM) and
``ratio_to_cudnn`` (cuDNN's time over the implementation's: above 1 is faster;
``ratio_to_xla`` under ``jvp``).
``test_hopper_autotuning_candidates`` times forward+backward at head dim 256 (B = 2,
S = 4096) and with a soft cap of 50 at 128 (B = 4): the executor's choice
(the Triton backward), ``pallax-mosaic`` (the Mosaic GPU backward, an
autotuning candidate there, pinned) and cuDNN (without the cap: it takes none);
the tangent at head dim 256 likewise (the Mosaic GPU tangent splitting its
output's columns, against the Triton one and XLA);
and Gemma 2's global layers (head dim 256, causal, a cap of 50), forward
and forward+backward, where the Mosaic GPU forward's one consumer is the
autotuning candidate too. ``test_hopper_biased_forward`` times the forward
with a bf16 bias of every head (B = 2, S = 4096): the executor's choice (the
Triton kernel), the Mosaic GPU forward pinned in 64- and 128-key blocks (an
autotuning candidate) and cuDNN; ``test_hopper_biased_tangent`` its
``jax.jvp`` with the bias' tangent: the executor's choice (Triton) and the
Mosaic GPU forward and tangent pinned (an autotuning candidate);
``test_hopper_biased_backward`` its gradient along q, k, v and the bias:
the executor's choice (the Triton backward), the Mosaic GPU forward and
backward pinned (an autotuning candidate) and cuDNN.
Each implementation's first call is checked against a float64 reference on
the first 128 query rows. Without an NVIDIA GPU the cases are not collected:
nothing here runs on a CPU.
"""

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import modes
import numpy as np
import pytest
from side_by_side import compare, rel_err
from test_attention import CHECK_ROWS, Case, attention_work, reference_rows

import pallax
from pallax.executor.executor import device_target
from pallax.executor.registry import kernel_spec
from pallax.executor.tools import kernel_calls, local_target
from pallax.kernels.attention.mosaic_gpu import MosaicGpuAttentionConfig
from pallax.op import op_params

TOLERANCE = 5e-2  # bfloat16 against float64, max error over max value
CASES = [
  Case(seq, causal=causal, heads=16, kv_heads=16, batch=batch, head_dim=128, dtype="bfloat16")
  for batch, seq in ((4, 4096), (2, 8192))
  for causal in (False, True)
]
IMPLS = {"fwd": "cudnn", "fwd+bwd": "cudnn", "jvp": "xla"}  # mode -> the baseline
# Head dim 256, and a soft cap at 128 (Gemma 2's 50), forward+backward: the
# executor runs the Triton backward there, and the Mosaic GPU one (blocks of
# threads splitting the results' columns) is an autotuning candidate until
# timed here: ``pallax-mosaic`` pins it (``test_hopper_autotuning_candidates``).
SPLIT_CASES = [
  *(
    Case(4096, causal=causal, heads=16, kv_heads=16, batch=2, head_dim=256, dtype="bfloat16")
    for causal in (False, True)
  ),
  Case(4096, heads=16, kv_heads=16, batch=4, head_dim=128, dtype="bfloat16", soft_cap=50.0),
]
# Gemma 2 9B's global layers (head dim 256, 16 query heads on 8, causal, a
# soft cap of 50): the Mosaic GPU forward runs one consumer there (two spill),
# an autotuning candidate like the split backward; timed alone and with it.
GEMMA2_GLOBAL = Case(
  4096, causal=True, heads=16, kv_heads=8, batch=2, head_dim=256, dtype="bfloat16", soft_cap=50.0
)
SPLIT_RUNS = [
  *((case, "fwd+bwd") for case in SPLIT_CASES),
  *((case, "jvp") for case in SPLIT_CASES if case.head_dim == 256),
  (GEMMA2_GLOBAL, "fwd"),
  (GEMMA2_GLOBAL, "fwd+bwd"),
]
MOSAIC_PIN = MosaicGpuAttentionConfig(block_k=64, num_stages=2)
# The backward's dk/dv kernel computing dQ too (TMA reduce-adds, not bitwise
# reproducible): ``pallax-fused`` on the cases' fwd+bwd, ``pallax-fused2``
# with two consumer warpgroups of 64 keys sharing dQ's columns
# (FlashAttention-3's shape).
FUSED_PIN = MosaicGpuAttentionConfig(block_k=64, num_stages=2, fuse_dq=True)
FUSED2_PIN = dataclasses.replace(FUSED_PIN, dkdv_consumers=2, dkdv_rows=32)
FA3_PIN = dataclasses.replace(FUSED2_PIN, dkdv_rows=64)
# The backward's autotuning candidates of two consumers on the cases' fwd+bwd:
# ``pallax-dq2`` the dq kernel's, ``pallax-wide`` and ``pallax-two`` the dk/dv
# kernel's too (32- and 64-query steps).
TWO_DQ_PIN = MosaicGpuAttentionConfig(block_k=64, num_stages=2, dq_consumers=2)
WIDE_PIN = dataclasses.replace(TWO_DQ_PIN, dkdv_rows=32)
TWO_PIN = dataclasses.replace(TWO_DQ_PIN, dkdv_consumers=2)
# The forward's candidate with a block's softmax beside the previous block's P V
# (the heuristic's blocks and ring): ``pallax-overlap`` on the cases' fwd.
OVERLAP_PIN = MosaicGpuAttentionConfig(fwd_overlap=True)
# The forward's candidate of 192-key blocks: ``pallax-k192`` on the unmasked cases' fwd.
K192_PIN = MosaicGpuAttentionConfig(block_k=192)


pytestmark = pytest.mark.nvidia_gpu  # deselected off an NVIDIA GPU (bench/conftest.py)


def _inputs(case, mode):
  """``q, k, v`` and the mode's extras: the output's cotangent, or the inputs' tangents."""
  keys = jax.random.split(jax.random.key(0), 6)
  b, t, n, h = case.batch, case.seq, case.heads, case.head_dim
  shape = (b, t, n, h)
  normal = lambda key: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  if mode == "jvp":
    return tuple(normal(key) for key in keys)
  return (*(normal(key) for key in keys[:3]), jax.random.normal(keys[3], shape, jnp.float32))


def _function(impl, case, mode):
  if impl in ("cudnn", "xla"):
    f = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=case.causal, implementation=impl
    )
  else:
    f = lambda q, k, v: pallax.dot_product_attention(
      q, k, v, is_causal=case.causal, logits_soft_cap=case.soft_cap
    )
  if mode == "jvp":
    return lambda q, k, v, dq, dk, dv: jax.jvp(f, (q, k, v), (dq, dk, dv))
  return f if mode == "fwd" else modes.fwd_bwd(f, 3)


def _tangent_rows(case, inputs, rows=CHECK_ROWS):
  """Float64 tangent of the output of the first ``rows`` queries (``jvp``).

  ``inputs``: ``q, k, v``, their tangents, and optionally a ``(1, N, T, S)``
  bias and its tangent.
  """
  q, k, v, dq, dk, dv, *bias = (np.asarray(x.astype(jnp.float32), np.float64) for x in inputs)
  q, dq = q[:, :rows], dq[:, :rows]
  group = case.heads // case.kv_heads  # query head i uses key/value head i // group, as jax.nn
  k, v, dk, dv = (np.repeat(x, group, axis=2) for x in (k, v, dk, dv))
  scale = 1 / math.sqrt(case.head_dim)
  s = np.einsum("brnh,bsnh->bnrs", q, k, optimize=True) * scale
  ds = np.einsum("brnh,bsnh->bnrs", dq, k, optimize=True) + np.einsum(
    "brnh,bsnh->bnrs", q, dk, optimize=True
  )
  ds = ds * scale
  if bias:
    s, ds = s + bias[0][:, :, :rows], ds + bias[1][:, :, :rows]
  if case.causal:
    visible = np.arange(k.shape[1])[None, :] <= np.arange(rows)[:, None]
    s = np.where(visible, s, -np.inf)
    ds = np.where(visible, ds, 0.0)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dp = p * (ds - np.sum(p * ds, -1, keepdims=True))
  return np.einsum("bnrs,bsnh->brnh", dp, v, optimize=True) + np.einsum(
    "bnrs,bsnh->brnh", p, dv, optimize=True
  )


def _work(case, mode):
  """The case's FLOPs and bytes (``jvp``: the module docstring's estimate)."""
  if mode != "jvp":
    return attention_work(case, mode)
  fwd = attention_work(case, "fwd")
  return dataclasses.replace(fwd, flops=3 * fwd.flops, bytes=2 * fwd.bytes)


def _triton_pins(fn, inputs) -> dict:
  """Per kernel call of ``fn``, the Pallas-Triton kernel's own heuristic config on this device."""
  target = device_target(local_target())
  pins = {}
  for eqn in kernel_calls(jax.make_jaxpr(fn)(*inputs).jaxpr):
    spec = kernel_spec(eqn.primitive.name)
    pins[spec.op] = spec.heuristic([v.aval for v in eqn.invars], target, **op_params(eqn.params))
  return pins


def _mosaic_pins(fn, inputs) -> dict:
  """Every kernel call of ``fn`` on the Mosaic GPU kernels (``MOSAIC_PIN``)."""
  return {e.primitive.name: MOSAIC_PIN for e in kernel_calls(jax.make_jaxpr(fn)(*inputs).jaxpr)}


def _stage_pins(config, stage="bwd"):
  """A ``_PINS`` entry that pins one stage to the Mosaic GPU kernels with ``config``.

  Args:
    config: the stage's ``MosaicGpuAttentionConfig``.
    stage: ``"fwd"``, ``"bwd"`` or ``"jvp"``.

  Returns:
    ``(fn, inputs) -> {primitive name: config}`` for ``fn``'s kernel calls of that stage.
  """

  def pins(fn, inputs) -> dict:
    calls = kernel_calls(jax.make_jaxpr(fn)(*inputs).jaxpr)
    return {e.primitive.name: config for e in calls if e.primitive.name.endswith(f"_{stage}")}

  return pins


_PINS = {
  "pallax-triton": _triton_pins,
  "pallax-mosaic": _mosaic_pins,
  "pallax-fused": _stage_pins(FUSED_PIN),
  "pallax-fused2": _stage_pins(FUSED2_PIN),
  "pallax-fa3": _stage_pins(FA3_PIN),
  "pallax-dq2": _stage_pins(TWO_DQ_PIN),
  "pallax-wide": _stage_pins(WIDE_PIN),
  "pallax-two": _stage_pins(TWO_PIN),
  "pallax-overlap": _stage_pins(OVERLAP_PIN, "fwd"),
  "pallax-k192": _stage_pins(K192_PIN, "fwd"),
}


def _compiled(impl, case, mode, inputs):
  fn = _function(impl, case, mode)
  args = inputs[:3] if mode == "fwd" else inputs
  if impl in _PINS:
    with pallax.default_executor().overlay(_PINS[impl](fn, args)):
      return jax.jit(fn).lower(*args).compile(), args
  return jax.jit(fn).lower(*args).compile(), args


def _checked(mode, result):
  out = {"fwd": result, "fwd+bwd": result[1][0], "jvp": result[1]}[mode]
  return np.asarray(out[:, :CHECK_ROWS].astype(jnp.float32), np.float64)


@pytest.mark.parametrize("mode", list(IMPLS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c.batch}-{c.id}")
def test_hopper_attention(benchmark, request, case, mode):
  benchmark.group = f"hopper-B{case.batch}-{case.id}-{mode}"
  inputs = jax.block_until_ready(_inputs(case, mode))
  want = _tangent_rows(case, inputs) if mode == "jvp" else reference_rows(case, mode, inputs)
  baseline = IMPLS[mode]
  impls = ("pallax", "pallax-triton", baseline)
  if mode == "fwd":
    impls = (*impls, "pallax-overlap", *([] if case.causal else ["pallax-k192"]))
  if mode == "fwd+bwd":
    impls = (*impls, "pallax-dq2", "pallax-wide", "pallax-two")
  if mode == "fwd+bwd" and os.environ.get("PALLAX_BENCH_FUSED") != "0":
    impls = (*impls, "pallax-fused", "pallax-fused2", "pallax-fa3")
  compiled = {impl: _compiled(impl, case, mode, inputs) for impl in impls}
  picks = pallax.explain(_function("pallax", case, mode), *compiled["pallax"][1])
  benchmark.extra_info["pallax_kernels"] = [
    f"{s.op}: {s.implementation} ({s.source})" for s in picks
  ]
  calls = {impl: functools.partial(exe, *args) for impl, (exe, args) in compiled.items()}
  error = lambda result: rel_err(_checked(mode, result), want)
  compare(benchmark, request, calls, error, TOLERANCE, _work(case, mode), case.dtype, baseline)


def _run_id(x) -> str:
  return x if isinstance(x, str) else f"B{x.batch}-H{x.head_dim}-{x.id}"


@pytest.mark.parametrize(("case", "mode"), SPLIT_RUNS, ids=_run_id)
def test_hopper_autotuning_candidates(benchmark, request, case, mode):
  """The executor's choice, the Mosaic GPU kernels pinned, cuDNN (no cap): autotuning candidates."""
  benchmark.group = f"hopper-B{case.batch}-H{case.head_dim}-{case.id}-{mode}"
  inputs = jax.block_until_ready(_inputs(case, mode))
  want = _tangent_rows(case, inputs) if mode == "jvp" else reference_rows(case, mode, inputs)
  baseline = "pallax" if case.soft_cap is not None else IMPLS[mode]  # cuDNN takes no soft cap
  impls = dict.fromkeys(("pallax", "pallax-mosaic", baseline))
  compiled = {impl: _compiled(impl, case, mode, inputs) for impl in impls}
  calls = {impl: functools.partial(exe, *args) for impl, (exe, args) in compiled.items()}
  error = lambda result: rel_err(_checked(mode, result), want)
  compare(benchmark, request, calls, error, TOLERANCE, _work(case, mode), case.dtype, baseline)


# A bias of every query head (bfloat16, as an ALiBi or relative-position bias
# is passed), forward: the Mosaic GPU forward streams a tile of it with each
# key block, an autotuning candidate until timed here (``pallax-mosaic``: 64-key
# blocks; ``pallax-mosaic128``: 128, in 2 slots), against the executor's
# choice (the Triton kernel) and cuDNN. The bias is the largest operand (512 MiB).
BIAS_CASE = Case(4096, causal=False, heads=16, kv_heads=16, batch=2, head_dim=128, dtype="bfloat16")
BIAS_PINS = {
  "pallax-mosaic": MOSAIC_PIN,
  "pallax-mosaic128": dataclasses.replace(MOSAIC_PIN, block_k=128),
}


def _bias(case, seed: int) -> jax.Array:
  """A bfloat16 bias of every query head, ``(1, N, T, S)``."""
  shape = (1, case.heads, case.seq, case.seq)
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def test_hopper_biased_forward(benchmark, request):
  """The executor's choice, the Mosaic GPU forward pinned (two blocks), cuDNN: with a bias."""
  case = BIAS_CASE
  benchmark.group = f"hopper-B{case.batch}-H{case.head_dim}-{case.id}-bias-fwd"
  q, k, v = _inputs(case, "fwd")[:3]
  bias = _bias(case, 1)
  args = jax.block_until_ready((q, k, v, bias))
  want = reference_rows(case, "fwd", args, bias=bias)
  fns = {
    "pallax": lambda q, k, v, b: pallax.dot_product_attention(q, k, v, b),
    "cudnn": lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, implementation="cudnn"),
  }
  compiled = {}
  for impl in ("pallax", *BIAS_PINS, "cudnn"):
    fn = fns.get(impl, fns["pallax"])
    pins = _stage_pins(BIAS_PINS[impl], "fwd")(fn, args) if impl in BIAS_PINS else {}
    with pallax.default_executor().overlay(pins):
      compiled[impl] = jax.jit(fn).lower(*args).compile()
  calls = {impl: functools.partial(exe, *args) for impl, exe in compiled.items()}
  error = lambda out: rel_err(_checked("fwd", out), want)
  compare(benchmark, request, calls, error, TOLERANCE, _work(case, "fwd"), case.dtype, "cudnn")


def test_hopper_biased_tangent(benchmark, request):
  """``jax.jvp`` with a bias and its tangent: the executor's choice, the Mosaic GPU kernels pinned.

  The Mosaic GPU tangent streams the bias' tile and its tangent's with each
  key block, an autotuning candidate until timed here (``pallax-mosaic``:
  its forward and tangent; by default both run on Triton). cuDNN's
  attention has no forward-mode AD (a ``custom_vjp``).
  """
  case = BIAS_CASE
  benchmark.group = f"hopper-B{case.batch}-H{case.head_dim}-{case.id}-bias-jvp"
  args = jax.block_until_ready((*_inputs(case, "jvp"), _bias(case, 1), _bias(case, 2)))
  want = _tangent_rows(case, args)
  attend = lambda q, k, v, b: pallax.dot_product_attention(q, k, v, b)
  fn = lambda q, k, v, dq, dk, dv, b, db: jax.jvp(attend, (q, k, v, b), (dq, dk, dv, db))
  mosaic = {**_stage_pins(MOSAIC_PIN, "fwd")(fn, args), **_stage_pins(MOSAIC_PIN, "jvp")(fn, args)}
  compiled = {}
  for impl, pins in (("pallax", {}), ("pallax-mosaic", mosaic)):
    with pallax.default_executor().overlay(pins):
      compiled[impl] = jax.jit(fn).lower(*args).compile()
  calls = {impl: functools.partial(exe, *args) for impl, exe in compiled.items()}
  error = lambda result: rel_err(_checked("jvp", result), want)
  compare(benchmark, request, calls, error, TOLERANCE, _work(case, "jvp"), case.dtype, "pallax")


def test_hopper_biased_backward(benchmark, request):
  """``jax.grad`` along q, k, v and the bias: the executor's choice, the Mosaic GPU kernels, cuDNN.

  The Mosaic GPU backward streams the bias' tile in both its kernels and
  writes the bias' gradient from the dq kernel, an autotuning candidate
  until timed here (``pallax-mosaic``: its forward and backward; by default
  the backward runs on Triton). The error: dq's rows' or the bias'
  gradient's, the larger.
  """
  case = BIAS_CASE
  benchmark.group = f"hopper-B{case.batch}-H{case.head_dim}-{case.id}-bias-fwd+bwd"
  q, k, v, ct = _inputs(case, "fwd+bwd")
  args = jax.block_until_ready((q, k, v, _bias(case, 1), ct))
  want = reference_rows(case, "fwd+bwd", (q, k, v, ct), bias=args[3], bias_grad=True)
  fns = {
    "pallax": modes.fwd_bwd(lambda q, k, v, b: pallax.dot_product_attention(q, k, v, b), 4),
    "cudnn": modes.fwd_bwd(
      lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, implementation="cudnn"), 4
    ),
  }
  fn = fns["pallax"]
  mosaic = {**_stage_pins(MOSAIC_PIN, "fwd")(fn, args), **_stage_pins(MOSAIC_PIN, "bwd")(fn, args)}
  compiled = {}
  for impl, pins in (("pallax", {}), ("pallax-mosaic", mosaic), ("cudnn", {})):
    with pallax.default_executor().overlay(pins):
      compiled[impl] = jax.jit(fns.get(impl, fn)).lower(*args).compile()
  calls = {impl: functools.partial(exe, *args) for impl, exe in compiled.items()}
  rows = lambda dbias: np.asarray(dbias[:, :, :CHECK_ROWS].astype(jnp.float32), np.float64)
  dq_err = lambda result: rel_err(_checked("fwd+bwd", result), want[0])
  error = lambda result: max(dq_err(result), rel_err(rows(result[1][3]), want[1]))
  work = _work(case, "fwd+bwd")
  compare(benchmark, request, calls, error, TOLERANCE, work, case.dtype, "cudnn")
