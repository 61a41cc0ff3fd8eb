"""The matmul kernel on Pallas Mosaic GPU (Hopper): TMA pipeline, ``wgmma``, fused epilogue.

One block of threads (one warpgroup) per ``tile_m x tile_n`` output tile and
batch: ``plgpu.emit_pipeline`` walks K in ``tile_k`` steps, its TMA loads
filling a ``stages``-deep ring of 128-byte-swizzled SMEM tiles, each step
issuing an asynchronous ``wgmma`` into a float32 accumulator and keeping one
in flight (``delay_release=1``). The bias tile arrives by TMA meanwhile. The
epilogue (bias, activation, the pre-activation where saved: the code the other
matmul kernels run, ``common.KernelArgs.finish``) runs on the accumulator in
registers; each result tile leaves through SMEM by a TMA store.

Layouts: batch dims are folded as for the other kernels (``common.fold``),
the remaining ones flattened into one grid axis from which each operand
reads the batch index it has (a shared operand is never broadcast).
Transposed operands (the backward's ``dA = dC B^T``, ``dB = A^T dC``) are
``wgmma``'s transposed SMEM operands, never copies. Dims that are not
multiples of their tile are padded with zeros by XLA around the kernel.

Interpreted (JAX's GPU interpreter, the CPU check; docs/mosaic_gpu.md), the
transposed operands are transposed by XLA before the kernel, which then
loads and multiplies plain tiles: the same tiles, pipeline and epilogue.

Selection: the heuristic returns None, so the executor keeps the kernel's own
choice on an H100 or H200 (``config.py``: XLA's GEMM for plain 16-bit
products, the Pallas-Triton kernel for fused epilogues) and the configs here
are autotuning candidates, timed by ``pallax.autotune`` next to Triton's and
XLA's (cuBLAS). Measured on an H200 with jax 0.11.2 (bench/test_matmul_hopper.py,
two runs, bf16): correct (max error 3.2e-3 of the largest value against
float64), 313-559 TFLOP/s, 0.67-1.20x cuBLAS's speed and within the runs'
noise of the Triton kernel, so it did not replace either as the heuristic's
choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallax import pallas_mosaic_gpu as mgpu
from pallax.kernels.matmul import common
from pallax.kernels.matmul.layout import Problem, problem_of
from pallax.pallas_mosaic_gpu import plgpu

IMPLEMENTATION = mgpu.IMPLEMENTATION


@dataclasses.dataclass(frozen=True)
class MosaicGpuMatmulConfig(mgpu.GemmTiles):
  """Tiles of the Mosaic GPU matmul kernel (``pallas_mosaic_gpu.GemmTiles``)."""


CONFIG_CLS = MosaicGpuMatmulConfig


def smem_bytes(avals: Sequence[Any], config: MosaicGpuMatmulConfig, **params) -> int:
  """SMEM of one block of threads: the pipeline's ring, the result tiles, the bias tile."""
  c, item = config, avals[0].dtype
  buffers = [
    ((c.stages, c.tile_m, c.tile_k), item),
    ((c.stages, c.tile_k, c.tile_n), item),
    ((1 + params["save_preactivation"], c.tile_m, c.tile_n), params["out_dtype"]),
  ]
  if len(avals) > 2:
    buffers.append(((c.tile_n,), avals[2].dtype))
  return mgpu.smem_bytes(*buffers)


def call_reason(avals: Sequence[Any], **params) -> Optional[str]:
  """Why the kernel cannot run this call whatever its tiles, if it cannot."""
  results = {"out_dtype": params["out_dtype"]}
  if len(avals) > 2:
    results["bias"] = avals[2].dtype
  return mgpu.gemm_dtypes_reason(
    "matmul kernel", {"a": avals[0].dtype, "b": avals[1].dtype}, results
  )


def supports(
  avals: Sequence[Any], target: str, config: MosaicGpuMatmulConfig, **params
) -> Optional[str]:
  """Why the Mosaic GPU kernel cannot run this call with ``config``, if it cannot."""
  reason = call_reason(avals, **params)
  if reason is not None:
    return reason
  smem = smem_bytes(avals, config, **params)
  return mgpu.gemm_tiles_reason(config, smem, activation=params["activation"])


def heuristic_config(prob: Problem) -> MosaicGpuMatmulConfig:
  """The config the heuristic would choose: 128x128 tiles, 64 wide ones for small M or N."""
  return MosaicGpuMatmulConfig(
    tile_m=128 if prob.m > 64 else 64, tile_n=128 if prob.n > 64 else 64, stages=4
  )


def heuristic(avals: Sequence[Any], target: str, **params) -> None:
  """None: the kernel's own heuristic chooses; these configs are autotuning candidates.

  Why: the module's docstring (measured on an H200, not faster than either).
  """
  return None


# The autotuning space: (tile_m, tile_n, stages), tile_k 64.
_SPACE = ((128, 128, 4), (128, 128, 3), (128, 64, 4), (64, 128, 4), (64, 256, 3), (64, 64, 4))


def candidates(avals: Sequence[Any], target: str, **params) -> list[MosaicGpuMatmulConfig]:
  """``heuristic_config``'s tiles, then the space's tiles that the problem fills, within SMEM."""
  prob = problem_of(avals, params)
  out = [heuristic_config(prob)]
  for tm, tn, stages in _SPACE:
    if tm <= mgpu.round_up(prob.m, 64) and tn <= mgpu.round_up(prob.n, 64):
      out.append(MosaicGpuMatmulConfig(tile_m=tm, tile_n=tn, stages=stages))
  return [c for c in dict.fromkeys(out) if supports(avals, target, c, **params) is None]


def _batch_index(g, sizes: Sequence[int], mask: Sequence[bool]):
  """An operand's flat batch index at the flat grid batch index ``g`` (its dims: ``mask``)."""
  index, stride = 0, 1
  for size, has in reversed(list(zip(sizes, mask))):
    if has:
      index = index + lax.rem(g, jnp.int32(size)) * stride
      stride *= size
    g = lax.div(g, jnp.int32(size))
  return index


def _pad(x: jax.Array, sizes: Sequence[int]) -> jax.Array:
  """``x`` padded with zeros at the end of its last dims to ``sizes``."""
  lead = x.ndim - len(sizes)
  pads = [(0, 0)] * lead + [(0, s - d) for s, d in zip(sizes, x.shape[lead:])]
  return jnp.pad(x, pads) if any(hi for _, hi in pads) else x


def matmul(a, b, *bias, out_dtype, config: MosaicGpuMatmulConfig, interpret: Any, **params):
  """``(y[, z])`` of one call: the layout, results and epilogue of ``triton.matmul``."""
  done = common.trivial(a, b, *bias, out_dtype=out_dtype, **params)
  if done is not None:
    return done
  reason = call_reason([a, b, *bias], out_dtype=out_dtype, **params)
  if reason is not None:
    raise NotImplementedError(f"matmul: {reason}")
  f = common.fold(a, b, *bias, **params)
  prob, args, form = f.prob, f.args, mgpu.Form.of(interpret)
  tm, tn, tk, stages = config.tile_m, config.tile_n, config.tile_k, config.stages
  mp, np_, kp = mgpu.round_up(prob.m, tm), mgpu.round_up(prob.n, tn), mgpu.round_up(prob.k, tk)
  # Operands as (batch, rows, cols): one flat batch axis each (1 without).
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  a3, b3 = flat(f.a), flat(f.b)
  ta, tb = args.transpose_a, args.transpose_b
  if not form.hopper:  # the interpreter's wgmma takes no transposed operand
    a3 = jnp.swapaxes(a3, 1, 2) if ta else a3
    b3 = jnp.swapaxes(b3, 1, 2) if tb else b3
    ta = tb = False
  a3 = _pad(a3, (kp, mp) if ta else (mp, kp))
  b3 = _pad(b3, (np_, kp) if tb else (kp, np_))
  bias2 = [_pad(x.reshape(-1, prob.n), (np_,)) for x in f.bias]
  grid_batch = math.prod(prob.grid_batch)
  outputs = 1 + args.save_preactivation
  a_mask, b_mask, bias_mask = f.masks
  swizzled = mgpu.swizzle_transforms(a.dtype)

  def mosaic_gpu_matmul(*refs):
    a_ref, b_ref, *bias_ref = refs[: 2 + len(bias2)]
    out_refs = refs[2 + len(bias2) :]
    g, i, j = lax.axis_index("batch"), lax.axis_index("m"), lax.axis_index("n")
    cols = pl.ds(j * tn, tn)

    def tiles(scratch, acc_ref):
      out_smem, bias_smem, bias_full = scratch
      if bias_ref:
        b_row = bias_ref[0].at[_batch_index(g, prob.grid_batch, bias_mask), cols]
        plgpu.copy_gmem_to_smem(b_row, bias_smem, bias_full)

      def step(_, a_smem, b_smem):
        lhs = plgpu.transpose_ref(a_smem, (1, 0)) if ta else a_smem
        rhs = plgpu.transpose_ref(b_smem, (1, 0)) if tb else b_smem
        plgpu.wgmma(acc_ref, lhs, rhs)
        plgpu.wgmma_wait(1)  # one wgmma in flight: the previous step's slot is free

      a_spec = plgpu.BlockSpec(
        (tk, tm) if ta else (tm, tk),
        (lambda s: (s, i)) if ta else (lambda s: (i, s)),
        transforms=swizzled,
        delay_release=1,
      )
      b_spec = plgpu.BlockSpec(
        (tn, tk) if tb else (tk, tn),
        (lambda s: (j, s)) if tb else (lambda s: (s, j)),
        transforms=swizzled,
        delay_release=1,
      )
      plgpu.emit_pipeline(
        step, grid=(kp // tk,), in_specs=[a_spec, b_spec], max_concurrent_steps=stages
      )(
        a_ref.at[_batch_index(g, prob.grid_batch, a_mask)],
        b_ref.at[_batch_index(g, prob.grid_batch, b_mask)],
      )
      plgpu.wgmma_wait(0)
      acc = acc_ref[...]
      if bias_ref:
        plgpu.barrier_wait(bias_full)
        if form.hopper:
          row = plgpu.load(bias_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
        else:
          row = bias_smem[...]
        acc = acc + lax.broadcast_in_dim(row.astype(acc.dtype), acc.shape, [1])
      for k, value in enumerate(args.finish(acc, [], out_dtype)):
        out_smem.at[k][...] = value
      plgpu.commit_smem()
      for k, out_ref in enumerate(out_refs):
        plgpu.copy_smem_to_gmem(out_smem.at[k], out_ref.at[g, pl.ds(i * tm, tm), cols])
      plgpu.wait_smem_to_gmem(0)

    has_bias = bool(bias2)
    scratch = (
      plgpu.SMEM((outputs, tm, tn), out_dtype, transforms=mgpu.swizzle_transforms(out_dtype)),
      plgpu.SMEM((tn,), bias2[0].dtype) if has_bias else None,
      plgpu.Barrier() if has_bias else None,
    )
    # Register and shared-memory allocations in scopes of their own (the interpreter wants it).
    pl.run_scoped(
      lambda scratch: pl.run_scoped(
        lambda acc_ref: tiles(scratch, acc_ref), plgpu.ACC((tm, tn), jnp.float32)
      ),
      scratch,
    )

  out_types = [jax.ShapeDtypeStruct((grid_batch, mp, np_), out_dtype)] * outputs
  kernel = plgpu.kernel(
    mosaic_gpu_matmul,  # the PTX entry's name, which verify tells kernels apart by
    out_type=out_types,
    grid=(grid_batch, mp // tm, np_ // tn),
    grid_names=("batch", "m", "n"),
    compiler_params=mgpu.compiler_params(approx_math=False),
    interpret=form.interpret,
  )
  operands = (a3, b3, *bias2)
  outs = kernel(*operands) if form.hopper else mgpu.on_host(kernel, out_types, *operands)
  shape = prob.grid_batch + (prob.m, prob.n)
  return f.unfold([o[:, : prob.m, : prob.n].reshape(shape) for o in outs])
