"""The op framework: the declarations that turn an op's pieces into JAX primitives.

One module per concern: ``primitive`` (``define_primitive`` and the
framework params), ``autodiff`` (``define_residual_op``), ``composite``
(``define_composite``), ``kernel`` (an op's kernels for the executor),
``sharding`` (``Dims`` and the partitioning rule) and ``collectives`` (the
per-shard programs that compute a sharded factor the kernel cannot split, and
the record of which one ran).

An op author writes the pieces (abstract eval, XLA program, Pallas kernels per
backend, sharding dims, batching rule) and declares them here, once:

* ``define_primitive(name, PrimitiveSpec(...))`` builds one primitive: the
  public primitive (the one users' jaxprs hold), whose lowering wraps the
  kernel primitive in ``custom_partitioning`` so that sharded inputs are
  partitioned, not gathered; and the kernel primitive, lowered per platform as
  the executor's config says: the XLA program, or the Pallas kernel (Triton on
  ``cuda``/``rocm``, Mosaic on ``tpu``, interpreted on ``cpu``). It registers
  the batching rule and the kernel's ``KernelSpec`` under ``name`` with the
  executor, so a kernel cannot be left unregistered or registered under
  another name. Pallas' interpreter fills padding and unwritten outputs with
  NaN, so a kernel that leaves elements unwritten, or lets padded rows or
  columns leak into a reduction, fails the tests.
* ``define_residual_op(name, fwd=..., tangent=..., bwd=..., ...)`` builds the
  forward, tangent and backward primitives of an op with residuals and
  registers its AD: the JVP, the transpose (the backward kernel) and the
  second-order JVPs (design.md section 2).
* ``define_composite(name, ...)`` builds a primitive that means a composition
  of pallax primitives, optionally with its own JVP rule and a fused XLA
  program for the CPU.
* ``Kernel.of_family`` reads a ``kernels/<family>/`` package: the kernel
  function of each backend module and the config space of ``config.py``.

Every primitive has ``multiple_results=True`` and three framework params, set
by ``bind`` when the public function is traced: ``config`` (None or a pinned
``KernelConfig``), ``interpret`` (the interpret switch) and ``executor`` (the
executor scope: executor and overlays). They are params rather than globals
read at lowering so that the jaxpr, and with it JAX's lowering cache key,
changes with them. The kernel's config is selected at lowering time, from the
final (vmapped, per-shard) shapes. Rules that bind further primitives pass all
three on.
"""

from pallax.op.autodiff import ResidualOp, define_residual_op, instantiate
from pallax.op.collectives import Choice, Program, Shards, explain_programs
from pallax.op.composite import CompositePrimitive, define_composite
from pallax.op.kernel import Kernel, kernel_runner, select_config
from pallax.op.primitive import (
  FRAMEWORK_PARAMS,
  KernelPrimitive,
  PrimitiveSpec,
  Rewrite,
  bind,
  define_primitive,
  op_params,
  produced_by,
)
from pallax.op.sharding import Dims, derived_aval, full_spec, match_manual_axes

__all__ = [
  "FRAMEWORK_PARAMS",
  "Choice",
  "CompositePrimitive",
  "Dims",
  "Kernel",
  "KernelPrimitive",
  "PrimitiveSpec",
  "Program",
  "ResidualOp",
  "Rewrite",
  "Shards",
  "bind",
  "define_composite",
  "define_primitive",
  "define_residual_op",
  "derived_aval",
  "explain_programs",
  "full_spec",
  "instantiate",
  "kernel_runner",
  "match_manual_axes",
  "op_params",
  "produced_by",
  "select_config",
]
