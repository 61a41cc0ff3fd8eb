"""The op framework: the declarations that turn an op's pieces into JAX primitives.

One module per concern: ``primitive`` (``define_primitive`` and the
framework params), ``autodiff`` (``define_residual_op``), ``signature``
(named operands), ``declaration`` (one primitive from a reference, kernels
and dims: what ``pallax.custom_op`` builds), ``dims_rule`` (sharding dims as
an einsum-like string), ``fold`` (the generic vmap rule), ``composite``
(``define_composite``), ``kernel`` (an op's kernels for the executor),
``sharding`` (``Dims`` and the partitioning rule) and ``collectives`` (the
per-shard programs that compute a sharded factor the kernel cannot split, and
the record of which one ran).

The declaration API
-------------------

A user's op and a built-in op are declared the same way: ``pallax.custom_op``
is the public face of these declarations (``primitives/paged_attention.py``
declares a built-in op through it). The names a user may rely on, kept
compatible across releases:

* ``pallax.custom_op``, ``pallax.CustomOp``, ``pallax.ConfigSpace``
  (also ``pallax.op.ConfigSpace``), ``pallax.KernelStage``,
  ``pallax.ResidualJVP``: an op in one call.
* ``Dims``, ``DimsRule``: sharding dims (a ``Dims``, or a ``DimsRule`` from a
  string such as ``"... c, ... c -> ... c"``); ``Program``, ``Shards``,
  ``explain_programs``: per-shard programs with collectives for a factor the
  kernel cannot split.
* ``Kernel``: an op's kernels and config space (``Kernel.of_family`` reads a
  ``kernels/<family>/`` package; ``Kernel.space`` is its ``ConfigSpace``).
* ``Declaration``: one primitive's pieces; ``Declaration.spec()`` gives the
  ``PrimitiveSpec`` and ``Declaration.jvp_rule`` its JVP rule.
* ``PrimitiveSpec``, ``define_primitive``, ``define_residual_op``,
  ``ResidualOp``, ``Operand``, ``ResidualSignature``, ``define_composite``:
  primitives built from specs, for ops whose pieces ``custom_op`` does not
  cover (residual stages with named optional operands, peephole rewrites).
* ``fold_rule``, ``merge_into``, ``BATCHED``: the generic vmap rule and its
  piece for a rule of one's own; ``bind``, ``op_params``, ``instantiate``,
  ``derived_aval``, ``full_spec``, ``match_manual_axes``: helpers for
  public functions, abstract evals and rules.

The other names (``FRAMEWORK_PARAMS``, ``KernelPrimitive``, ``Rewrite``,
``produced_by``, ``kernel_runner``, ``select_config``, ``Choice``,
``CompositePrimitive``) are the framework's own and may change.

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

from pallax.executor.registry import ConfigSpace
from pallax.op.autodiff import ResidualOp, define_residual_op, instantiate
from pallax.op.collectives import Choice, Program, Shards, explain_programs
from pallax.op.composite import CompositePrimitive, define_composite
from pallax.op.declaration import Declaration
from pallax.op.dims_rule import DimsRule
from pallax.op.fold import BATCHED, fold_rule, merge_into
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
from pallax.op.signature import Operand, ResidualSignature

__all__ = [
  "BATCHED",
  "FRAMEWORK_PARAMS",
  "Choice",
  "ConfigSpace",
  "CompositePrimitive",
  "Declaration",
  "Dims",
  "DimsRule",
  "Kernel",
  "KernelPrimitive",
  "Operand",
  "PrimitiveSpec",
  "Program",
  "ResidualOp",
  "ResidualSignature",
  "Rewrite",
  "Shards",
  "bind",
  "define_composite",
  "define_primitive",
  "define_residual_op",
  "derived_aval",
  "explain_programs",
  "fold_rule",
  "full_spec",
  "instantiate",
  "kernel_runner",
  "match_manual_axes",
  "merge_into",
  "op_params",
  "produced_by",
  "select_config",
]
