"""What the Pallas Mosaic GPU (Hopper) kernels share: their two forms, SMEM layouts, launch.

A Mosaic GPU kernel runs compiled on sm_90a (H100, H200) and sm_100a, and
interpreted on the CPU by JAX's GPU interpreter, which runs most of the
constructs but not all (docs/mosaic_gpu.md): transposed ``wgmma`` operands,
register ``wgmma`` operands, ``pl.run_state`` accumulators and
``plgpu.layout_cast`` fail there. So each kernel has two forms with the same
tile maths, chosen by ``Form``: the Hopper form on a GPU, and the interpreted
form, which keeps the same warpgroups, barriers and tiles but takes the
transposed operands from GMEM, stages register operands through SMEM and
accumulates scoped accumulators by value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallax._jax_private import (
  mosaic_gpu_interpret_params,
  mosaic_gpu_race_found,
  reset_mosaic_gpu_interpreter,
)
from pallax.executor.config import KernelConfig

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError as _err:  # jax's Mosaic GPU imports absl-py, which jax does not require
  _MISSING = f"Pallas Mosaic GPU does not import here ({_err}): pip install absl-py"

  class _Missing:
    def __getattr__(self, name):
      raise ImportError(_MISSING)

  plgpu = _Missing()
else:
  _MISSING = None


def unavailable_reason() -> Optional[str]:
  """Why Pallas Mosaic GPU cannot be used in this process, if it cannot."""
  return _MISSING


# Shared memory a block may use on sm_90a with opt-in (H100, H200): 227 KiB.
SMEM_LIMIT = 232448
# What a kernel's own buffers may take: Mosaic GPU adds its barriers and
# alignment, each buffer rounded up to 1 KiB (an attention kernel whose
# buffers take 229888 bytes, one of them 512, needs 230489 compiled for H100;
# 232536 before ``compiler_params`` gave up the reductions' scratch, over the
# limit). Configs of several buffers under 1 KiB near the limit could pass
# this and fail to compile: ``pallax.verify`` compiles every choosable one.
SMEM_BUDGET = SMEM_LIMIT - 1024
# The granule each SMEM buffer is rounded up to. ``SMEM_BUDGET`` holds one
# buffer's rounding; a kernel's estimate counts its other small buffers (the
# attention kernels' segment ids) in whole granules.
SMEM_ALIGN = 1024
# Rows of one warpgroup's ``wgmma`` (its M): a consumer warpgroup's tile height.
WGMMA_ROWS = 64
# Beside two consumers, a consumer warpgroup's and the producer's registers a
# thread after the producer gives its own up (``setmaxnreg``, multiples of 8):
# the warpgroups of a block share 64K registers, 512 a thread of each (one
# consumer and the producer fit 255 each). ``WIDE_REGISTERS`` gives the
# consumers all a producer of TMA copies can spare (FlashAttention-3's 240
# and 24; a producer held to 24 spilled 4 bytes).
REGISTERS = (232, 40)
WIDE_REGISTERS = (240, 32)
# The PTX entry of a kernel ``Form.launch`` runs with ``sums``: JAX traces it
# again under this name when it discharges their refs (``<name>_mosaic_gpu_kernel``).
SUMS_KERNEL = "new_body"
_BLOCK_REGISTERS = 512  # 64K registers over a block's 128 threads of each warpgroup


IMPLEMENTATION = "pallas_mosaic_gpu"
# A GEMM kernel's operands (one 16-bit dtype for both) and results.
GEMM_INPUTS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GEMM_OUTPUTS = (*GEMM_INPUTS, jnp.dtype(jnp.float32))
# GEMM tiles: multiples of 64 (a 128-byte swizzled row of 16-bit elements,
# and one warpgroup's ``wgmma`` M), at most 256 (a TMA box's and ``wgmma``'s
# N limit); the float32 accumulators at most 128 registers a thread.
_TILE_QUANTUM, _TILE_MAX, _ACC_MAX = 64, 256, 128 * 128
# The exact GELU's arithmetic erfc on a 128x128 accumulator spills (ptxas:
# 255 registers, 736 bytes, H100); on 64x128 it takes 110-120 registers.
_GELU_ACC_MAX = 64 * 128


@dataclasses.dataclass(frozen=True)
class GemmTiles(KernelConfig):
  """Tiles of a Mosaic GPU GEMM kernel, one warpgroup an output tile (matmul, ragged_dot).

  tile_m, tile_n: the output tile; multiples of 64 up to 256, its float32
    accumulators (``tile_m * tile_n`` each) at most ``128 * 128`` in all.
  tile_k: the K step of the pipeline (a multiple of 64).
  stages: SMEM slots of the TMA pipeline (at least 2).
  """

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  implementation: str = dataclasses.field(default=IMPLEMENTATION, kw_only=True)


def round_up(n: int, m: int) -> int:
  """``n`` rounded up to a multiple of ``m``."""
  return -(-n // m) * m


def gemm_dtypes_reason(kernel: str, operands: dict[str, Any], results: dict[str, Any]):
  """Why a GEMM kernel cannot take these dtypes, if it cannot.

  ``operands``: the two multiplied operands' dtypes by name (one 16-bit
  dtype); ``results``: other dtypes by name (16-bit or float32).
  """
  (a, da), (b, db) = ((name, jnp.dtype(d)) for name, d in operands.items())
  if da != db or da not in GEMM_INPUTS:
    return (
      f"the Mosaic GPU {kernel} takes {a} and {b} of one 16-bit dtype (bfloat16 or float16), "
      f"got {da} and {db}"
    )
  for name, dtype in results.items():
    if jnp.dtype(dtype) not in GEMM_OUTPUTS:
      return (
        f"the Mosaic GPU {kernel}'s {name} must be bfloat16, float16 or float32, got "
        f"{jnp.dtype(dtype)}"
      )
  return None


def gemm_tiles_reason(
  config: GemmTiles, smem: int, *, accumulators: int = 1, activation: Optional[str] = None
) -> Optional[str]:
  """Why a GEMM kernel cannot run with ``config``'s tiles, if it cannot.

  ``smem``: the bytes of its buffers; ``accumulators``: float32 tiles it
  holds (two for a gated weight's halves); ``activation``: its epilogue's.
  """
  c = config
  tiles = (c.tile_m, c.tile_n, c.tile_k)
  if any(t % _TILE_QUANTUM for t in tiles) or max(c.tile_m, c.tile_n) > _TILE_MAX:
    return f"tiles {tiles} must be multiples of 64 (tile_m, tile_n at most 256) on Mosaic GPU"
  if c.tile_m * c.tile_n * accumulators > _ACC_MAX:
    return (
      f"{accumulators} float32 accumulator(s) of {c.tile_m}x{c.tile_n} are over the 128 "
      "registers a thread one warpgroup may give them"
    )
  if activation == "gelu" and c.tile_m * c.tile_n * accumulators > _GELU_ACC_MAX:
    return (
      f"the exact GELU with {accumulators} {c.tile_m}x{c.tile_n} accumulator(s) spills "
      f"registers on Mosaic GPU (at most {_GELU_ACC_MAX} elements in all)"
    )
  if c.stages < 2:
    return f"stages={c.stages}: the TMA pipeline needs at least 2"
  if smem > SMEM_BUDGET:
    return f"{config} needs {smem} bytes of SMEM, over {SMEM_BUDGET}"
  return None


def swizzle_transforms(dtype, cols: int = 0) -> tuple[Any, ...]:
  """SMEM transforms for swizzled rows of ``cols`` elements: what TMA and ``wgmma`` want.

  128-byte rows (64 16-bit elements) where they fit, else 64 or 32 bytes;
  ``cols`` 0: 128.
  """
  row = cols * jnp.dtype(dtype).itemsize if cols else 128
  swizzle = next(b for b in (128, 64, 32) if row % b == 0)
  return (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


def compiler_params(approx_math: bool) -> Any:
  """``plgpu.CompilerParams`` of pallax's Mosaic GPU kernels: lane semantics, explicitly.

  The kernels are written in lane semantics (arrays in explicit register
  layouts, ``plgpu.layout_cast``), jax 0.10's default. jax 0.11 lowers with
  warpgroup semantics unless told otherwise, and there the attention kernels
  fail to lower (a loop's constant carry: "Shaped arrays must be represented
  by ir.Values", seen on an H200 with jax 0.11.2).

  No SMEM is reserved for reductions across warps (``reduction_scratch_bytes``:
  2 KiB a block by default, reserved for any kernel that reduces): the kernels
  reduce a ``wgmma`` tile's rows, within a warp's lanes, and a reduction that
  needed the scratch would fail to lower, not run without it. The 2 KiB let
  the forward's 192-key blocks at head dim 128 fit (229888 bytes of buffers).
  """
  return plgpu.CompilerParams(
    approx_math=approx_math,
    lowering_semantics=plgpu.LoweringSemantics.Lane,
    reduction_scratch_bytes=0,
  )


class _StepZero(threading.local):
  """The GMEM zeros of the kernels ``Form.launch`` is tracing in this thread, innermost last.

  ``Form.opaque_zero`` reads the innermost. A thread's own: autotuning traces
  candidates in a pool of threads (``pallax.executor.autotune``).
  """

  def __init__(self):
    self.refs: list[Any] = []


_STEP_ZERO = _StepZero()


@dataclasses.dataclass(frozen=True)
class Form:
  """Which form of a kernel runs: the Hopper one (``hopper``) or the interpreted one."""

  hopper: bool

  @classmethod
  def of(cls, interpret: bool) -> Form:
    return cls(hopper=not interpret)

  @property
  def interpret(self) -> Any:
    """The kernel's ``interpret=`` argument: GPU interpret params, or None on a GPU."""
    return None if self.hopper else mosaic_gpu_interpret_params(_RACES.active)

  def layout(self, x: jax.Array, layout: Any) -> jax.Array:
    """``plgpu.layout_cast`` on a GPU (a register layout hint); ``x`` interpreted."""
    return plgpu.layout_cast(x, layout) if self.hopper else x

  def zeros(self, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
    """Zeros in a ``wgmma`` accumulator's register layout (a fresh accumulator's start)."""
    return self.layout(jnp.zeros(tuple(shape), dtype), plgpu.Layout.WGMMA)

  def iota(self, shape: Sequence[int], dim: int) -> jax.Array:
    """int32 positions along ``dim`` of a ``wgmma`` accumulator's tile."""
    if self.hopper:
      return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
    return lax.broadcasted_iota(jnp.int32, shape, dim)

  def positions(self, n: int, dim: int) -> jax.Array:
    """int32 positions ``0..n-1`` along ``dim`` of a ``wgmma`` accumulator's tile, as a vector.

    Broadcast to the tile (``broadcast_in_dim`` to ``[dim]``), its values are
    shared by the tile's elements: a mask compared from two of them held
    fewer registers than one from two ``iota`` tiles (compiled for H100).
    """
    if self.hopper:
      layout = plgpu.Layout.WGMMA.reduce(1 - dim)
      return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout)
    return lax.broadcasted_iota(jnp.int32, (n,), 0)

  def vector(self, ref: Any, dim: int) -> jax.Array:
    """A 1-D SMEM ref's value indexing ``dim`` of a ``wgmma`` accumulator's tile.

    A row statistic (``dim`` 0: one value a row, ``broadcast_in_dim`` to
    ``[0]``) or a column one (``dim`` 1), in the matching register layout on
    a GPU.
    """
    return self._load(ref, plgpu.Layout.WGMMA.reduce(1 - dim))

  def tile(self, ref: Any) -> jax.Array:
    """A 2-D SMEM ref's value in a ``wgmma`` accumulator's register layout on a GPU."""
    return self._load(ref, plgpu.Layout.WGMMA)

  def _load(self, ref: Any, layout: Any) -> jax.Array:
    """An SMEM ref's value, in ``layout`` on a GPU (the interpreter takes no layouts)."""
    return plgpu.load(ref, (), layout=layout) if self.hopper else ref[...]

  def launch(
    self,
    body: Callable[..., None],
    operands: Sequence[jax.Array],
    out_types: Sequence[jax.ShapeDtypeStruct],
    *,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    scratch: Sequence[Any],
    name: str,
    consumers: int = 2,
    approx_math: bool = True,
    sums: Sequence[jax.ShapeDtypeStruct] = (),
    parts: int = 1,
  ) -> list:
    """Runs a warp-specialised kernel: ``consumers`` warpgroups and a producer, named ``"wg"``.

    ``body(*operand_refs, *sum_refs, *out_refs, scoped)`` runs in every
    warpgroup of a block of threads over ``grid`` (axes ``grid_names``);
    ``scoped`` holds ``scratch`` (SMEM buffers, barriers), allocated once for
    the block. ``name`` names the kernel (its PTX entry is ``<name>_kernel``:
    the compiler's reports tell kernels apart by it; with ``sums`` the
    entry is ``SUMS_KERNEL``'s instead). ``approx_math``: fast
    approximate ``exp2``, ``tanh``, ... on a GPU (the interpreter computes them
    exactly). Interpreted, the kernel runs in a host callback (``on_host``).
    The kernel's first operand, before ``operands``, is ``opaque_zero``'s
    zero; ``body`` does not see it.

    ``sums``: results that many blocks of threads add tiles to (``add_to``),
    zero before the kernel, returned after ``out_types``' results. Their refs
    are GMEM refs the kernel's results alias (``jax.new_ref``). On a GPU a
    TMA reduce-add adds each tile, in the order the blocks of threads get
    there, so a sum is not bitwise reproducible from run to run. JAX's GPU
    interpreter has no TMA reductions: interpreted, each sum has a leading
    axis of ``parts``, ``add_to`` stores a tile to the part it names, and the
    parts are summed after the kernel.
    """

    def entry(zero_ref, *refs):
      _STEP_ZERO.refs.append(zero_ref)
      try:
        pl.run_scoped(lambda *scoped: body(*refs, scoped), *scratch, collective_axes="wg")
      finally:
        _STEP_ZERO.refs.pop()

    entry.__name__ = entry.__qualname__ = name
    mesh = dict(grid=grid, grid_names=grid_names, num_threads=consumers + 1, thread_name="wg")
    common = dict(compiler_params=compiler_params(approx_math), interpret=self.interpret)
    races = name if _RACES.active else None
    operands = (jnp.zeros((1,), jnp.int32), *operands)  # ``opaque_zero``'s
    if not sums:
      kernel = plgpu.kernel(entry, out_type=tuple(out_types), **mesh, **common)
      if self.hopper:
        return list(kernel(*operands))
      return on_host(kernel, out_types, *operands, races=races)
    # ``plgpu.kernel``'s ``custom_vmap`` takes no ``jax.new_ref`` operand; ``pl.kernel`` does.
    out_type, mesh = tuple(out_types), plgpu.Mesh(**mesh)
    kernel = pl.kernel(entry, out_type=out_type, mesh=mesh, **common)
    shapes = [s.shape if self.hopper else (parts, *s.shape) for s in sums]
    types = [jax.ShapeDtypeStruct(shape, s.dtype) for shape, s in zip(shapes, sums)]

    def run(*operands):
      zeros = [jnp.zeros(t.shape, t.dtype) for t in types]
      refs = [jax.new_ref(z, memory_space=plgpu.GMEM) for z in zeros]
      return [*kernel(*operands, *refs), *(ref[...] for ref in refs)]

    if self.hopper:
      return run(*operands)
    outs = on_host(run, [*out_types, *types], *operands, races=races)
    return [*outs[: len(out_types)], *(x.sum(0) for x in outs[len(out_types) :])]

  def opaque_zero(self) -> jax.Array:
    """0 as an int32 ptxas cannot prove constant, loaded from GMEM where it is called.

    For the index of a ``wgmma`` operand constant in a loop (a consumer's own
    tile: the dk/dv kernel's K and V; with segment ids the forward's Q and,
    above head dim 128, the query-side kernels' own tiles): at a constant
    index its descriptors (64 bits for each 16-wide slice of the
    contraction: 16 registers a 128-wide operand) are loop invariants, which
    ptxas computes before the loop and holds in registers across it; at the
    index plus this zero, read in each step, they are computed in the step,
    in uniform registers. Compiled for H100, the fused dk/dv kernel in
    FlashAttention-3's tile with a window spilled 300 bytes with them held,
    none computed in the step. The zero is ``launch``'s first operand.

    Raises:
      RuntimeError: outside the body of a kernel ``launch`` traces.
    """
    if not _STEP_ZERO.refs:
      raise RuntimeError("opaque_zero: only in the body of a kernel Form.launch runs")
    return _STEP_ZERO.refs[-1][0]

  def add_to(self, tile: Any, sum_ref: Any, index: tuple, part: Any) -> None:
    """Adds SMEM ``tile`` to ``sum_ref.at[index]`` (a ``launch`` sum), asynchronously.

    On a GPU a TMA reduce-add; interpreted, a store to the sum's part ``part``
    (each part's tiles written once). ``plgpu.wait_smem_to_gmem`` waits for it.
    """
    if self.hopper:
      plgpu.copy_smem_to_gmem(tile, sum_ref.at[index], reduction_op="add")
    else:
      plgpu.copy_smem_to_gmem(tile, sum_ref.at[(part, *index)])

  def store_to(self, tile: Any, sum_ref: Any, index: tuple) -> None:
    """Stores SMEM ``tile`` to ``sum_ref.at[index]`` (a ``launch`` sum of one part), asynchronously.

    For a result whose tiles are each written once at most, zero where none
    is (a TMA store on a GPU; interpreted, to its one part).
    """
    plgpu.copy_smem_to_gmem(tile, sum_ref.at[index if self.hopper else (0, *index)])

  def staging(self, shape: Sequence[int], dtype: Any, smem: bool = False) -> Any:
    """SMEM for the interpreted form's register ``wgmma`` operands (on a GPU only with ``smem``)."""
    transforms = swizzle_transforms(dtype, shape[-1])
    return None if self.hopper and not smem else plgpu.SMEM(shape, dtype, transforms=transforms)

  def operand(self, x: jax.Array, staging: Any, *index: Any, smem: bool = False) -> Any:
    """``x`` as a ``wgmma`` left operand: itself on a GPU (not ``smem``), else stored to SMEM.

    ``smem``: from SMEM on a GPU too, where the registers ``x`` would hold
    beside the product in flight are wanted for others (``staging`` from
    ``staging(..., smem=True)``).
    """
    if self.hopper and not smem:
      return x
    ref = staging.at[index] if index else staging
    ref[...] = x
    plgpu.commit_smem()
    return ref

  def warpgroups(
    self,
    consumers: int,
    consumer: Callable[[Any], None],
    producer: Optional[Callable[[], None]] = None,
    copies: bool = True,
    registers: tuple[int, int] = REGISTERS,
  ) -> None:
    """Runs ``consumer(wg)`` in consumer warpgroups ``wg < consumers``, ``producer()`` in the last.

    ``copies``: on a GPU one copy of ``consumer`` a consumer, ``wg`` a Python
    int, so each one's SMEM addresses (its tiles, barriers and ``wgmma``
    descriptors) are constants, where a traced index keeps them in
    registers: compiled for H100, the fused dk/dv kernel's two consumers at
    head dim 128 spilled 96 bytes with a traced index and none as copies,
    and a step took 358 instructions where it took 432. Else, and always
    interpreted (no registers to save; each copy would be traced), one copy
    for all, ``wg`` traced.
    With two consumers (on a GPU) the producer first gives up registers and
    the consumers take them: ``registers``, a consumer's and the producer's,
    given once for both sides; one consumer and the producer fit 255
    registers a thread each without (held to 24, a producer spilled 4
    bytes beside a consumer of 255).
    """
    wg = lax.axis_index("wg")

    def run(c):
      self._registers(consumers, registers, producer=False)
      consumer(c)

    if copies and self.hopper:
      for c in range(consumers):
        pl.when(wg == c)(functools.partial(run, c))
    else:
      pl.when(wg < consumers)(lambda: run(wg))
    if producer is not None:

      @pl.when(wg == consumers)
      def _producer():
        self._registers(consumers, registers, producer=True)
        producer()

  def _registers(self, consumers: int, registers: tuple[int, int], producer: bool) -> None:
    """Beside two consumers (on a GPU), the producer gives up registers and they take them.

    Raises:
      ValueError: ``registers`` (a consumer's, the producer's) over the 512 a
        thread the warpgroups share (the consumers' increase would wait forever).
    """
    if consumers * registers[0] + registers[1] > _BLOCK_REGISTERS:
      raise ValueError(
        f"registers={registers}: {consumers} consumers and a producer take more"
        f" than {_BLOCK_REGISTERS} a thread"
      )
    if self.hopper and consumers == 2:
      count = registers[1] if producer else registers[0]
      plgpu.set_max_registers(count, action="decrease" if producer else "increase")

  def barrier(self, values):
    """An optimization barrier on a GPU (it orders the softmax against the ``wgmma``)."""
    return lax.optimization_barrier(values) if self.hopper else values

  def accumulate(self, acc: jax.Array, product: Callable[[Any], None]) -> jax.Array:
    """``acc`` plus the ``wgmma`` products that ``product(acc_ref)`` issues, in float32."""
    (acc,), _ = self.pipeline((acc,), lambda refs, read: product(*refs))
    return acc

  def pipeline_after(
    self,
    shape: Sequence[int],
    first: Callable[[Any], None],
    then: Callable[[jax.Array], Any],
    together: bool,
    starts: Callable[[], tuple],
    issue: Callable[[tuple, Callable, Callable[[int], Any]], Optional[tuple]],
    like: tuple = (),
  ) -> tuple[tuple, tuple]:
    """``pipeline`` after a first product, with ``then`` of it beside the later ones or before.

    ``first(ref)`` issues products into a fresh float32 accumulator of
    ``shape``. With ``together`` they are issued first in the pipeline, and
    ``issue(refs, read, ready)``'s ``ready(pending)`` returns ``then`` of
    their value, read while the ``pending`` groups issued after them run
    (FlashAttention-3's intra-warpgroup overlap: the forward's softmax beside
    the previous block's ``P V``). Else the first products and ``then`` run
    before the pipeline, neither ``then``'s registers nor the accumulators'
    beside products in flight, and ``ready`` returns its result.
    ``starts()`` makes the pipeline's accumulators: before ``first`` is
    issued with ``together``, after ``then`` without (a start loaded before
    ``then`` stayed live beside it: the fused dk/dv kernel spilled). So it
    is also where a kernel waits for what the later products read (its ring
    slots): before the first products with ``together``, after ``then``
    without. Returns ``pipeline``'s.
    """
    if not together:
      ready = then(fresh_product(shape, first))
      return self.pipeline(starts(), lambda refs, read: issue(refs, read, lambda _: ready), like)
    accs = starts()
    n = len(accs)

    def body(refs, read):
      first(refs[n])
      return issue(refs[:n], read, lambda pending: then(read(n, pending)))

    sums, results = self.pipeline((*accs, self.zeros(shape)), body, like)
    return sums[:n], results

  def pipeline(
    self,
    accs: tuple,
    issue: Callable[[tuple, Callable[[int, int], jax.Array]], Optional[tuple]],
    like: tuple = (),
  ) -> tuple[tuple, tuple]:
    """Float32 accumulators ``accs`` plus the ``wgmma`` products ``issue`` has in flight at once.

    ``issue(refs, read)`` issues products onto the accumulators' refs, each
    ``plgpu.wgmma`` call a group, and works between them: ``read(k,
    pending)`` waits until at most ``pending`` groups run (the last issued;
    they finish in order) and returns accumulator ``k``'s value, its start
    plus its products so far, so work on it overlaps the products still in
    flight (FlashAttention-3's intra-warpgroup overlap). None of those
    ``pending`` groups may add to accumulator ``k`` (on a GPU the read
    would race them; interpreted, where ``read`` waits for every group, it
    would not show). ``issue`` may return results (arrays shaped and laid
    out as ``like``'s: on a GPU they leave ``pl.run_state`` as its state).
    Everything is waited for once it returns. Returns ``(the accumulators,
    issue's results)``.

    On a GPU the products accumulate in place (``pl.run_state`` of
    accumulators initialised from ``accs``); interpreted they go to fresh
    scoped accumulators that are added to ``accs`` (rounded once more), and
    ``read`` waits for every group.
    """
    n = len(accs)
    if self.hopper:

      def body(refs):
        read = lambda k, pending: plgpu.wgmma_accumulator_load(refs[k], wait_n=pending)
        for ref, x in zip(refs[n:], issue(refs[:n], read) or ()):
          ref[...] = x

      out = pl.run_state(body)((*(plgpu.ACC.init(a) for a in accs), *like))
      return tuple(out[:n]), tuple(out[n:])

    def run(*refs):
      def read(k, pending):
        plgpu.wgmma_wait(0)
        return accs[k] + refs[k][...]

      results = issue(refs, read) or ()
      plgpu.wgmma_wait(0)
      return tuple(ref[...] for ref in refs), tuple(results)

    fresh, results = pl.run_scoped(run, *(plgpu.ACC(a.shape, jnp.float32) for a in accs))
    return tuple(a + f for a, f in zip(accs, fresh)), results


def fresh_product(shape: Sequence[int], product: Callable[[Any], None]) -> jax.Array:
  """The float32 result of the ``wgmma`` ``product(acc_ref)`` issues into a fresh accumulator.

  It waits for them once ``product`` returns (which may do other work meanwhile).
  """

  def run(acc_ref):
    product(acc_ref)
    plgpu.wgmma_wait(0)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(tuple(shape), jnp.float32))


# The GPU interpreter keeps global state: one interpreted kernel at a time.
_INTERPRETER = threading.Lock()


class _RaceDetection(threading.local):
  active = False


_RACES = _RaceDetection()


@contextlib.contextmanager
def detecting_races():
  """Interpreted kernels traced in this block check for data races, and raise on one.

  The GPU interpreter's race detection (slow: for tests) checks each SMEM
  access against the other threads' since their last synchronisation, which
  catches a consumer reading a ring slot after releasing it to the producer.
  """
  before, _RACES.active = _RACES.active, True
  try:
    yield
  finally:
    _RACES.active = before


def on_host(
  kernel: Callable[..., Any],
  out_types: Sequence[Any],
  *operands: jax.Array,
  races: Optional[str] = None,
) -> list:
  """Runs ``kernel``'s interpreted form on ``operands`` in a host callback.

  The GPU interpreter orders its simulation with an ordered IO callback,
  whose token a primitive's lowering has no way to thread through; a jitted
  call of its own, on the host, has. A kernel that raises leaves the
  interpreter's state poisoned: it is reset before the error goes on.
  ``races``: the kernel's name where it runs with race detection
  (``detecting_races``): a race it found raises ``RuntimeError``.
  """
  run = jax.jit(kernel)

  def host(*arrays):
    with _INTERPRETER:
      try:
        outs = [np.asarray(x) for x in run(*arrays)]
      except Exception:
        reset_mosaic_gpu_interpreter()
        raise
      if races is not None and mosaic_gpu_race_found():
        raise RuntimeError(f"{races}: JAX's GPU interpreter found a data race on SMEM")
      return outs

  return list(jax.pure_callback(host, tuple(out_types), *operands))


@dataclasses.dataclass(frozen=True)
class Ring:
  """A producer warpgroup's ring of ``stages`` SMEM slots over a loop's steps ``[lo, hi)``.

  Each step fills one slot with groups of TMA copies (``produce``); every
  copy of a group lands on the group's "full" barrier of the slot, and every
  consumer releases a group of a slot on its "consumed" barrier when done
  with it, so the producer may refill it ``stages`` steps later. Each thread
  observes every phase of the barriers it waits on (JAX's GPU interpreter
  checks it): the producer waits for the last releases before it exits.

  Attributes:
    stages: slots of the ring.
    lo, hi: the steps (traced int32 scalars); step ``j`` uses slot
      ``(j - lo) % stages``.
    full, consumed: per group, its barriers (``barriers`` allocates them).
  """

  stages: int
  lo: Any
  hi: Any
  full: Sequence[Any]
  consumed: Sequence[Any]

  @staticmethod
  def barriers(copies: Sequence[int], stages: int, consumers: int) -> tuple[tuple, tuple]:
    """``(full, consumed)`` scratch: per group of ``copies[i]`` copies, ``stages`` barriers."""
    full = tuple(plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in copies)
    consumed = tuple(plgpu.Barrier(num_arrivals=consumers, num_barriers=stages) for _ in copies)
    return full, consumed

  def slot(self, j) -> jax.Array:
    return lax.rem(j - self.lo, jnp.int32(self.stages))

  def wait(self, group: int, j) -> None:
    """Waits until group ``group`` of step ``j`` is in its slot."""
    plgpu.barrier_wait(self.full[group].at[self.slot(j)])

  def release(self, group: int, j) -> None:
    """This consumer is done with group ``group`` of step ``j``'s slot."""
    plgpu.barrier_arrive(self.consumed[group].at[self.slot(j)])

  def skip(self, j) -> None:
    """A step this consumer does not compute: waits for each group and releases it."""
    for group in range(len(self.full)):
      self.wait(group, j)
      self.release(group, j)

  def produce(self, copies: Callable[[Any, Any], Sequence[Sequence[tuple[Any, Any]]]]) -> None:
    """The producer's loop: ``copies(j, slot)`` gives step ``j``'s groups of ``(src, dst)``."""

    def load(j, refill: bool):
      s = self.slot(j)
      for group, pairs in enumerate(copies(j, s)):
        if refill:
          plgpu.barrier_wait(self.consumed[group].at[s])
        for src, dst in pairs:
          plgpu.copy_gmem_to_smem(src, dst, self.full[group].at[s])

    for i in range(self.stages):
      pl.when(self.lo + i < self.hi)(lambda i=i: load(self.lo + i, False))
    pl.loop(self.lo + self.stages, self.hi)(lambda j: load(j, True))

    @pl.loop(jnp.maximum(self.hi - self.stages, self.lo), self.hi)
    def _(j):
      for barrier in self.consumed:
        plgpu.barrier_wait(barrier.at[self.slot(j)])


def smem_bytes(*buffers: tuple[Sequence[int], Any]) -> int:
  """Bytes of SMEM buffers given as ``(shape, dtype)``."""
  total = 0
  for shape, dtype in buffers:
    count = 1
    for n in shape:
      count *= n
    total += count * jnp.dtype(dtype).itemsize
  return total
