"""pallax.roofline: work counted by hand for small calls, the peak table, achieved rates."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallax import roofline
from pallax.roofline import Work

F32, BF16 = jnp.float32, jnp.bfloat16


def test_matmul_work():
  # [2, 3] @ [3, 4]: 24 multiply-adds; A 6, B 12, C 8 elements.
  assert roofline.matmul_work(2, 3, 4, F32, "fwd") == Work(48, (6 + 12 + 8) * 4)
  assert roofline.matmul_work(2, 3, 4, F32, "fwd", bias=True) == Work(48, (6 + 12 + 8 + 4) * 4)
  # Backward: dA = dC B^T reads dC 8, B 12, writes dA 6; dB = A^T dC reads A 6, dC 8, writes dB 12.
  backward = 8 + 12 + 6 + 6 + 8 + 12
  assert roofline.matmul_work(2, 3, 4, BF16, "fwd+bwd") == Work(144, (26 + backward) * 2)
  assert roofline.matmul_work(2, 3, 4, BF16, "fwd+bwd", bias=True) == Work(
    144, (30 + backward + 4) * 2
  )


@pytest.mark.parametrize(
  "op, forward, backward",
  [
    # x (2, 3), D = 3. Forward: x 6 (+ residual 6) in, params, y 6 (+ sum 6) out.
    ("rms_norm", 6 + 3 + 6, 6 + 6 + 3 + 6 + 3),  # bwd: x, dy, w in; dx, dw out
    ("layer_norm", 6 + 6 + 6, 6 + 6 + 3 + 6 + 6),  # bwd: x, dy, w in; dx, dw, db out
    ("fused_add_rms_norm", 12 + 3 + 12, 6 + 12 + 3 + 6 + 3),  # bwd: sum, dy, dsum, w; dx, dw
  ],
)
def test_norm_work(op, forward, backward):
  assert roofline.norm_work(op, (2, 3), BF16, "fwd") == Work(None, 2 * forward)
  assert roofline.norm_work(op, (2, 3), F32, "fwd+bwd") == Work(None, 4 * (forward + backward))


def test_dtype_names():
  by_name = roofline.softmax_work((2, 3), "bfloat16", "fwd")
  assert by_name == roofline.softmax_work((2, 3), BF16, "fwd") == Work(None, 24)
  work = Work(10**12, 10**9)
  assert roofline.throughput(work, 1.0, "TPU v5 lite", "bfloat16")["fraction_of_peak_flops"] == (
    pytest.approx(1 / 197)
  )


def test_softmax_and_cross_entropy_work():
  assert roofline.softmax_work((2, 3), F32, "fwd") == Work(None, 2 * 6 * 4)  # x in, y out
  assert roofline.softmax_work((2, 3), F32, "fwd+bwd") == Work(None, 5 * 6 * 4)  # + y, dy; dx
  assert roofline.cross_entropy_work(2, 5, BF16, "fwd") == Work(None, 10 * 2)
  assert roofline.cross_entropy_work(2, 5, BF16, "fwd+bwd") == Work(None, 30 * 2)


def test_linear_cross_entropy_work():
  # x (2, 3), W (3, 5): 30 multiply-adds for the logits.
  assert roofline.linear_cross_entropy_work(2, 3, 5, F32, "fwd") == Work(60, (6 + 15) * 4)
  assert roofline.linear_cross_entropy_work(2, 3, 5, F32, "fwd+bwd") == Work(180, 3 * 21 * 4)


def test_attention_work_counts_unmasked_pairs():
  # B=1, N=2 query heads, K=1 kv head, T=S=3, H=4: q/o 24 elements, k/v 12 each.
  full = roofline.attention_work(1, 2, 1, 3, 3, 4, F32, "fwd")
  assert full == Work(4 * 2 * 9 * 4, (24 + 12 + 12 + 24) * 4)
  causal = roofline.attention_work(1, 2, 1, 3, 3, 4, F32, "fwd", causal=True)
  assert causal.flops == 4 * 2 * 6 * 4  # pairs (0,0), (1,0..1), (2,0..2)
  # Fewer queries than keys: query i sees keys 0..i.
  assert roofline.attention_work(1, 1, 1, 2, 5, 1, F32, "fwd", causal=True).flops == 4 * 3
  # Two packed documents of 2 tokens, causal: pairs (0,0), (1,0..1) in each.
  packed = roofline.attention_work(1, 1, 1, 4, 4, 1, F32, "fwd", causal=True, documents=2)
  assert packed.flops == 4 * 2 * 3
  both = roofline.attention_work(1, 2, 1, 3, 3, 4, F32, "fwd+bwd", causal=True)
  # 3.5x the FLOPs; backward: q, o, do, k, v in, dq, dk, dv out.
  assert both == Work(4 * 2 * 6 * 4 * 7 // 2, (72 + 3 * 24 + 24 + 4 * 12) * 4)


def test_paged_decode_work():
  # Two sequences of 3 and 5 tokens, N=4, K=2, H=8: 8 tokens of keys and values.
  work = roofline.paged_decode_work([3, 5], 4, 2, 8, BF16)
  assert work == Work(4 * 4 * 8 * 8, (2 * 8 * 2 * 8 + 2 * 2 * 4 * 8) * 2)


def test_ragged_paged_work_reads_each_cache_with_queries_once():
  # q_lens 1, 2, 0 over caches of 3, 4 and 6 tokens, N=4, K=2, H=8: queries see
  # 3, then 3 and 4 keys; sequences 0 and 1 read 7 tokens of keys and values.
  work = roofline.ragged_paged_work([1, 2, 0], [3, 4, 6], 4, 2, 8, BF16)
  assert work == Work(4 * 4 * 8 * 10, (2 * 7 * 2 * 8 + 2 * 3 * 4 * 8) * 2)


@pytest.mark.parametrize(
  "kind, name",
  [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB"),
    ("NVIDIA L4", "L4"),
    ("AMD Instinct MI300X", "MI300X"),
    ("TPU v4", "TPU v4"),
    ("TPU v5 lite", "TPU v5e"),
    ("TPU v5e", "TPU v5e"),
    ("TPU v5", "TPU v5p"),
    ("TPU v5p", "TPU v5p"),
    ("TPU v6 lite", "TPU v6e"),
  ],
)
def test_peak_of_known_devices(kind, name):
  assert roofline.peak_of(kind).name == name


@pytest.mark.parametrize("kind", ["cpu", "TPU v3", "NVIDIA L40S", "NVIDIA H100 NVL", "TPU7x"])
def test_peak_of_unknown_devices(kind):
  assert roofline.peak_of(kind) is None


def test_peak_table_figures():
  h100 = roofline.peak_of("NVIDIA H100 80GB HBM3")
  assert (h100.tflops["bfloat16"], h100.tflops["float32"], h100.hbm_gbps) == (989.4, 66.9, 3350)
  v5e = roofline.peak_of("TPU v5 lite")
  assert (v5e.tflops, v5e.hbm_gbps) == ({"bfloat16": 197.0}, 819)


def test_throughput():
  work = Work(flops=2 * 10**12, bytes=10**9)
  on_h100 = roofline.throughput(work, 0.5, "NVIDIA H100 80GB HBM3", BF16)
  assert on_h100 == pytest.approx(
    dict(
      tflop_per_s=4.0,
      gbyte_per_s=2.0,
      peak_device="H100 SXM",
      fraction_of_peak_flops=4.0 / 989.4,
      fraction_of_peak_bandwidth=2.0 / 3350,
    )
  )
  # A CPU: absolute rates only. float32 on a TPU: no matrix peak to compare with.
  assert roofline.throughput(work, 2.0, "cpu", F32) == {"tflop_per_s": 1.0, "gbyte_per_s": 0.5}
  on_tpu = roofline.throughput(work, 1.0, "TPU v6 lite", F32)
  assert "fraction_of_peak_flops" not in on_tpu
  assert on_tpu["fraction_of_peak_bandwidth"] == pytest.approx(1.0 / 1638)
  assert roofline.throughput(Work(None, 10**9), 1.0, "cpu", F32) == {"gbyte_per_s": 1.0}


def test_bad_arguments():
  with pytest.raises(ValueError, match="mode"):
    roofline.matmul_work(2, 3, 4, F32, "bwd")
  with pytest.raises(ValueError, match="op"):
    roofline.norm_work("group_norm", (2, 3), F32, "fwd")
  with pytest.raises(ValueError, match="documents"):
    roofline.attention_work(1, 1, 1, 5, 5, 1, F32, "fwd", documents=2)
  with pytest.raises(ValueError, match="seconds"):
    roofline.throughput(Work(1, 1), 0.0, "cpu", F32)


def test_work_models_are_found_by_name():
  """Each family's model lives in its kernels/<family>/tools.py; roofline finds it by name."""
  from pallax.kernels.paged_attention import tools

  assert roofline.paged_decode_work is tools.paged_decode_work
  names = {
    "attention_work",
    "cross_entropy_work",
    "linear_cross_entropy_work",
    "matmul_work",
    "norm_work",
    "paged_decode_work",
    "softmax_work",
  }
  assert names <= set(dir(roofline))
  with pytest.raises(AttributeError, match="no attribute 'group_norm_work'"):
    roofline.group_norm_work  # noqa: B018
  assert not hasattr(roofline, "__wrapped__")
