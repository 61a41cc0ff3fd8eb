"""What ``pallax.verify`` compiles: op cases, their kernel calls, and the configs to try.

A case is one public op at one size and dtype, in one stage: ``fwd`` (the op),
``bwd`` (its gradient: forward and backward kernels; log_softmax's backward
alone, as it takes the input) or ``jvp`` (forward and
tangent kernels). Tracing a case gives its kernel calls; a job is one kernel
call compiled for one target with one config the executor can choose there:
the heuristic's, every autotuning candidate ``supports`` accepts, and shipped
defaults. Identical jobs from different cases (the forward kernel appears in
most stages) are compiled once.

The heuristic's config is compiled at every case; the candidates at every
case only in an exhaustive sweep, else at each op's candidate cases (its first
size in float32: the bench's shape with the largest blocks' footprint). A
cold exhaustive sweep of every op takes about an hour on 2 cores, the default
one under 20 minutes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend.core import JaxprEqn

import pallax
from pallax.executor.cache import shipped_defaults
from pallax.executor.config import KernelConfig
from pallax.executor.executor import (
  cache_key,
  candidate_configs,
  heuristic_config,
  unsupported_reason,
)
from pallax.executor.registry import kernel_spec, registered_ops
from pallax.executor.tools import kernel_calls
from pallax.op import op_params
from pallax.verify.targets import Target

STAGES = ("fwd", "bwd", "jvp")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Op:
  """A public op as the sweep calls it: ``fn(*arrays)`` with shapes from a size.

  The last ``masks`` arrays are boolean masks, and the ``ints`` arrays before
  them int32 (lengths, indices): neither is differentiated. ``stages``: those
  the op has (an inference op has no ``bwd`` or ``jvp``). ``candidates``:
  whether the default sweep compiles the autotuning candidates at the first
  size (``candidate_cases``).
  """

  fn: Callable
  shapes: Callable[..., list[tuple[int, ...]]]
  sizes: tuple[tuple[int, ...], ...]
  quick: tuple[tuple[int, ...], ...]
  masks: int = 0
  ints: int = 0
  stages: tuple[str, ...] = STAGES
  candidates: bool = True


_rows = lambda r, h: [(r, h)]
_norm = lambda r, h: [(r, h), (h,)]

# Sizes: the benches' (bench/), odd ones (rows and widths that no block
# divides), and wide rows (vocabulary-sized softmax, 16K hidden norms).
_NORM_SIZES = ((1024, 1024), (8192, 4096), (1000, 4000), (64, 16384))
_NORM_QUICK = ((1024, 1024), (1000, 4000))
_SOFTMAX_SIZES = ((1024, 1024), (8192, 4096), (1000, 4000), (16, 50257))
_MATMUL_SIZES = ((1024, 1024, 1024), (4096, 4096, 4096), (1000, 4000, 300), (8, 1000, 1000))
# Attention (B, T, N, K, H), self-attention: head dims 64, a padded 80 and
# 128 with GQA and odd lengths, 256, 32.
_attention = lambda b, t, n, kv, h: [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
_ATTENTION_SIZES = (
  (2, 1024, 8, 8, 64),
  (1, 1000, 8, 2, 80),
  (1, 1000, 8, 2, 128),
  (1, 2048, 4, 4, 256),
  (4, 512, 8, 8, 32),
)
_ATTENTION_QUICK = ((2, 1024, 8, 8, 64), (1, 1000, 8, 2, 128))
# Causal: all but head dim 32.
_CAUSAL_SIZES = _ATTENTION_SIZES[:4]
# Paged attention (B, N, K, H, page_size, pages_per_sequence), a pool of
# B * pages_per_sequence pages: the bench's decode step, a padded head dim 80
# with odd counts and small pages, MQA, head dim 256, MHA with large pages.
_paged = lambda b, n, kv, h, ps, pps: [
  (b, n, h),
  (kv, b * pps, ps, h),
  (kv, b * pps, ps, h),
  (b,),
  (b, pps),
]
_PAGED_SIZES = (
  (32, 32, 8, 128, 16, 256),
  (3, 12, 4, 80, 8, 37),
  (8, 8, 1, 64, 32, 64),
  (4, 16, 2, 256, 16, 64),
  (4, 8, 8, 128, 128, 8),
)
_PAGED_QUICK = ((32, 32, 8, 128, 16, 256), (3, 12, 4, 80, 8, 37))

# LM-head losses (N tokens, D hidden, V vocabulary): the bench's, GPT-2's odd
# vocabulary with a wide hidden dim, a few tokens of a Llama-2 one, Llama-3's.
_lm_head = lambda n, d, v: [(n, d), (d, v), (n,)]
_LM_HEAD_SIZES = ((8192, 1024, 32768), (1000, 4096, 50257), (16, 2048, 32001), (2048, 4096, 128256))
_LM_HEAD_QUICK = ((8192, 1024, 32768), (1000, 4096, 50257))
_LOGITS_SIZES = ((4096, 32768), (1000, 50257), (16, 128256))

OPS = {
  "rms_norm": Op(pallax.rms_norm, _norm, _NORM_SIZES, _NORM_QUICK),
  "layer_norm": Op(pallax.layer_norm, lambda r, h: [(r, h), (h,), (h,)], _NORM_SIZES, _NORM_QUICK),
  "fused_add_rms_norm": Op(
    pallax.fused_add_rms_norm, lambda r, h: [(r, h), (r, h), (h,)], _NORM_SIZES, _NORM_QUICK
  ),
  "softmax": Op(pallax.softmax, _rows, _SOFTMAX_SIZES, _NORM_QUICK),
  "log_softmax": Op(pallax.log_softmax, _rows, _SOFTMAX_SIZES, _NORM_QUICK),
  "softmax_where": Op(
    lambda x, where: pallax.softmax(x, where=where),
    lambda r, h: [(r, h), (r, h)],
    _NORM_QUICK,
    _NORM_QUICK,
    masks=1,
  ),
  "matmul": Op(
    lambda a, b, c: pallax.matmul(a, b, bias=c, activation="gelu"),
    lambda m, k, n: [(m, k), (k, n), (n,)],
    _MATMUL_SIZES,
    ((1024, 1024, 1024), (1000, 4000, 300)),
  ),
  "attention": Op(pallax.dot_product_attention, _attention, _ATTENTION_SIZES, _ATTENTION_QUICK),
  # Its candidates compile in the exhaustive sweep; by default those of the
  # packed-documents case below (the same blocks, with segments, a soft cap
  # and sinks on top of the causal mask) stand for them.
  "attention_causal": Op(
    lambda q, k, v: pallax.dot_product_attention(q, k, v, is_causal=True),
    _attention,
    _CAUSAL_SIZES,
    _ATTENTION_QUICK,
    candidates=False,
  ),
  # Packed documents with Gemma 2's soft cap and sinks: causal within each
  # segment; the two trailing int32 arrays are the query's and key's segment ids.
  "attention_features": Op(
    lambda q, k, v, sinks, q_seg, kv_seg: pallax.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      q_segment_ids=q_seg,
      kv_segment_ids=kv_seg,
      logits_soft_cap=30.0,
      sinks=sinks,
    ),
    lambda b, t, n, kv, h: [*_attention(b, t, n, kv, h), (n,), (b, t), (b, t)],
    _ATTENTION_QUICK + ((1, 2048, 4, 4, 256),),
    _ATTENTION_QUICK,
    ints=2,
  ),
  # Candidates as for causal attention: the features case below stands for them.
  "linear_cross_entropy": Op(
    pallax.linear_cross_entropy, _lm_head, _LM_HEAD_SIZES, _LM_HEAD_QUICK, ints=1, candidates=False
  ),
  # Gemma 2's soft cap with a bias, label smoothing and z-loss.
  "linear_cross_entropy_features": Op(
    lambda x, w, b, labels: pallax.linear_cross_entropy(
      x, w, labels, bias=b, logit_soft_cap=30.0, label_smoothing=0.1, z_loss=1e-4
    ),
    lambda n, d, v: [(n, d), (d, v), (v,), (n,)],
    _LM_HEAD_QUICK,
    _LM_HEAD_QUICK,
    ints=1,
  ),
  "cross_entropy": Op(
    pallax.cross_entropy, lambda n, v: [(n, v), (n,)], _LOGITS_SIZES, _LOGITS_SIZES[:2], ints=1
  ),
  "paged_attention": Op(
    pallax.paged_attention, _paged, _PAGED_SIZES, _PAGED_QUICK, ints=2, stages=("fwd",)
  ),
}


# pallax's own ops: the sweep when no ops are named (``register_op`` adds others).
LIBRARY_OPS = tuple(OPS)
MODULES_ENV = "PALLAX_VERIFY_MODULES"


def register_op(name: str, op: Op) -> None:
  """Adds a user's op (``pallax.custom_op``) to the sweep under ``name``.

  Call it when the op's module is imported; ``import_modules`` (the command
  line's ``--module``) imports that module here and in the compile workers.

  Raises:
    ValueError: another op is registered under ``name``.
  """
  if not isinstance(op, Op):
    raise TypeError(f"op must be a pallax.verify.Op, got {type(op).__name__}")
  if OPS.get(name, op) is not op:
    raise ValueError(f"name: an op is already registered as {name!r} in pallax.verify")
  OPS[name] = op


def import_modules(names: Sequence[str]) -> None:
  """Imports modules that register ops (``register_op``), here and in the compile workers.

  The workers, started from this process's environment, import the modules
  named in ``PALLAX_VERIFY_MODULES`` (``worker.py``).
  """
  known = [n for n in os.environ.get(MODULES_ENV, "").split(",") if n]
  for name in names:
    importlib.import_module(name)
    if name not in known:
      known.append(name)
  os.environ[MODULES_ENV] = ",".join(known)


@dataclasses.dataclass(frozen=True)
class Case:
  """One op at one size and dtype in one stage; ``id`` names it in jobs and reports."""

  op: str
  stage: str
  size: tuple[int, ...]
  dtype: str

  @property
  def id(self) -> str:
    return f"{self.op}:{self.stage}:{'x'.join(map(str, self.size))}:{self.dtype}"

  @classmethod
  def from_id(cls, case_id: str) -> Case:
    op, stage, size, dtype = case_id.split(":")
    return cls(op, stage, tuple(int(n) for n in size.split("x")), dtype)

  def structs(self) -> list[jax.ShapeDtypeStruct]:
    op = OPS[self.op]
    shapes = op.shapes(*self.size)
    floats = len(shapes) - op.masks - op.ints
    dtypes = [self.dtype] * floats + ["int32"] * op.ints + ["bool"] * op.masks
    return [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]

  def function(self) -> Callable:
    """The case as a function of its op's arrays (masks last)."""
    op = OPS[self.op]
    if self.stage == "fwd":
      return op.fn
    n = len(self.structs()) - op.masks - op.ints
    if self.stage == "jvp":
      return lambda *args: jax.jvp(lambda *x: op.fn(*x, *args[n:]), args[:n], args[:n])
    loss = lambda *args: sum(jnp.sum(y.astype(jnp.float32)) for y in jax.tree.leaves(op.fn(*args)))
    return jax.grad(loss, argnums=tuple(range(n)))


def cases(ops: Optional[Iterable[str]] = None, quick: bool = False) -> list[Case]:
  """The sweep of ``ops`` (default: pallax's own): each size in float32 and bfloat16.

  The first size is also swept in float16.

  ``quick``: two sizes, the first in float32 and the second in bfloat16.
  """
  out = []
  for name in ops or LIBRARY_OPS:
    op = OPS[name]
    if quick:
      sized = [(op.quick[0], "float32"), (op.quick[1], "bfloat16")]
    else:
      sized = [(s, d) for s in op.sizes for d in DTYPES[:2]] + [(op.sizes[0], "float16")]
    out += [Case(name, stage, size, dtype) for size, dtype in sized for stage in op.stages]
  return out


def candidate_cases(case_list: Sequence[Case]) -> set[str]:
  """The ids of the cases of ``case_list`` at their op's first size in float32.

  Ops with ``candidates=False`` have none.
  """
  return {
    case.id
    for case in case_list
    if OPS[case.op].candidates and case.size == OPS[case.op].sizes[0] and case.dtype == "float32"
  }


@functools.cache
def kernel_calls_of(case_id: str) -> tuple:
  """The kernel calls (jaxpr equations) of a case, in trace order."""
  case = Case.from_id(case_id)
  return tuple(kernel_calls(jax.make_jaxpr(case.function())(*case.structs()).jaxpr))


@dataclasses.dataclass
class Job:
  """One kernel call compiled for one target with one config.

  ``case`` and ``call`` locate the call (the ``call``-th kernel call of the
  case's trace), so a worker process can rebuild it. ``sources`` says why the
  config is tried (``heuristic``, ``candidate``, ``default``, ``pinned``) and
  ``cases`` every case that has this call.
  """

  target: str
  kernel: str
  key: str
  config: dict
  case: str
  call: int
  sources: set = dataclasses.field(default_factory=set)
  cases: list = dataclasses.field(default_factory=list)

  @property
  def id(self) -> str:
    return f"{self.target}|{self.key}|{json.dumps(self.config, sort_keys=True)}"

  def message(self) -> dict:
    """What a worker needs to compile it."""
    return {
      "id": self.id,
      "target": self.target,
      "case": self.case,
      "call": self.call,
      "config": self.config,
    }


def configs_for(
  eqn: JaxprEqn, target: Target, heuristic_only: bool = False
) -> list[tuple[str, KernelConfig]]:
  """The ``"pallas"`` configs the executor can choose for ``eqn`` on ``target``, with sources.

  Configs ``supports`` rejects are left out: the executor never runs them.
  """
  spec = kernel_spec(eqn.primitive.name)
  avals = [v.aval for v in eqn.invars]
  params = op_params(eqn.params)
  found = [("heuristic", heuristic_config(spec, avals, target.platform, params))]
  if not heuristic_only:
    found += [("candidate", c) for c in candidate_configs(spec, avals, target.platform, params)]
    entry = shipped_defaults(target.device_kind, spec.op, spec.version).get(
      cache_key(spec, avals, target.platform, params)
    )
    if entry is not None:
      found.append(("default", spec.config_cls.from_dict(entry["config"])))
  return [
    (source, config)
    for source, config in found
    if config.implementation != "xla"
    and unsupported_reason(spec, avals, target.platform, config, params) is None
  ]


def call_key(eqn: JaxprEqn, target: Target) -> str:
  """The executor's cache key of kernel call ``eqn`` on ``target``: kernel, avals, params."""
  spec = kernel_spec(eqn.primitive.name)
  return cache_key(spec, [v.aval for v in eqn.invars], target.platform, op_params(eqn.params))


def jobs_for(
  case_list: Sequence[Case],
  targets: Sequence[Target],
  heuristic_only: bool = False,
  pinned: Optional[dict[str, KernelConfig]] = None,
  candidates_at: Optional[set[str]] = None,
  implementations: Optional[Sequence[str]] = None,
) -> list[Job]:
  """The deduplicated jobs of ``case_list`` on ``targets``.

  ``pinned`` maps kernel names to a config to compile instead of the
  executor's choices (for checking a config by hand). ``candidates_at``: the
  ids of the cases whose calls get the candidates too (default: every case).
  ``implementations``: only configs of these (``"pallas"``, ``"triton_raw"``).
  """
  jobs: dict[str, Job] = {}
  configs: dict[tuple, list] = {}  # per call and target: the forward is in every stage
  for case in case_list:
    only = heuristic_only or (candidates_at is not None and case.id not in candidates_at)
    for index, eqn in enumerate(kernel_calls_of(case.id)):
      name = eqn.primitive.name
      if pinned is not None and name not in pinned:
        continue
      for target in targets:
        key = call_key(eqn, target)
        if (target.name, key, only) not in configs:
          configs[target.name, key, only] = (
            [("pinned", pinned[name])] if pinned is not None else configs_for(eqn, target, only)
          )
        for source, config in configs[target.name, key, only]:
          if implementations is not None and config.implementation not in implementations:
            continue
          job = Job(target.name, name, key, config.to_dict(), case.id, index)
          job = jobs.setdefault(job.id, job)
          job.sources.add(source)
          if case.id not in job.cases:
            job.cases.append(case.id)
  return list(jobs.values())


def library_kernels() -> list[str]:
  """The registered kernels of pallax's own ops (not those a user or a test registers)."""
  return [
    op for op in registered_ops() if kernel_spec(op).heuristic.__module__.startswith("pallax.")
  ]


def unswept_kernels(case_list: Sequence[Case]) -> list[str]:
  """The kernels of pallax's ops that no case of ``case_list`` calls."""
  called = {eqn.primitive.name for case in case_list for eqn in kernel_calls_of(case.id)}
  return sorted(set(library_kernels()) - called)
