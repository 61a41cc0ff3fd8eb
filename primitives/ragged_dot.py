"""Grouped matmul: ``pallax.ragged_dot``, ``jax.lax.ragged_dot`` as a pallax op.

Rows of ``lhs [M, K]`` are sorted by group; group ``g`` has
``group_sizes[g]`` of them, and its rows are multiplied by ``rhs[g]``
(``[G, K, N]``). Two primitives, declared through ``pallax.custom_op``:

* ``ragged_dot (lhs, rhs, group_sizes, group_offset) -> [M, N]``, the
  grouped GEMM (ragged non-contracting);
* ``ragged_dot_tgmm (lhs, rhs, group_sizes, group_offset) -> [G, K, N]``,
  ``lhs[rows of g]^T @ rhs[rows of g]`` for ``lhs [M, K]``, ``rhs [M, N]``
  (ragged contracting: the weight gradient).

Both are bilinear: the JVP is one product per nonzero tangent, and each
product's transposes are the two of them: for the
GEMM, ``dlhs = ragged_dot(dout, rhs^T)`` and ``drhs = tgmm(lhs, dout)``; for
tgmm, ``dlhs = ragged_dot(rhs, dout^T)`` and ``drhs = ragged_dot(lhs,
dout)``. Their JVPs are sums of such products, so ``grad``, ``jvp``, HVPs
and ``grad`` of ``grad`` all run them, never a G-fold dense product.

vmap: a mapped ``rhs`` alone folds into N (tgmm: a mapped ``lhs`` or ``rhs``
alone folds into K or N); other combinations add a grid-batch axis, one
primitive either way.

Sharding: N shards freely and a sharded K is summed across devices. The
rows (M) and the groups (G) shard through a per-shard program
(``_per_shard``): a shard of the rows takes its own group sizes, a shard of
the groups (expert parallelism: each device its experts' weights) its own
``group_offset``, and the partial results are summed (an all-reduce of the
output, never a gather of the weights). M and G over the same mesh axes
send each row to its expert's device and back (``_exchanged``: a ragged
``all_to_all``, padded on CPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad

from pallax.activations import ACTIVATIONS, activate, activation_derivative
from pallax.custom_op import custom_op
from pallax.kernels import ragged_dot as kernels
from pallax.kernels.ragged_dot import RaggedDotConfig
from pallax.kernels.ragged_dot.mosaic_gpu import MosaicGpuRaggedDotConfig
from pallax.op import Dims, Program, Shards
from pallax.op.collectives import ragged_all_to_all
from pallax.validation import check_config, check_floating, check_precision

__all__ = ["ragged_dot", "RaggedDotConfig", "MosaicGpuRaggedDotConfig"]

_OP = "ragged_dot"


class _Exchange(NamedTuple):
  """Where one device's rows go when tokens (M) and experts (G) split over the same devices.

  The rows are sorted by group, so the rows of a device's experts are one
  range of the global rows, and what device ``p`` sends device ``q`` is the
  overlap of ``p``'s rows with ``q``'s range: sent in ``p`` order, the
  ranges pack ``q``'s experts' rows in order. Every field is ``[devices]``
  but ``sizes``.

  Attributes:
    send: rows this device sends each device.
    send_from: where they start among this device's rows.
    send_to: where they land among the receiver's.
    recv: rows this device receives from each device.
    recv_at: where they land among this device's received rows.
    recv_from: where they start among the sender's rows.
    sizes: ``[local]``, the received rows' group sizes (this device's experts).
  """

  send: jax.Array
  send_from: jax.Array
  send_to: jax.Array
  recv: jax.Array
  recv_at: jax.Array
  recv_from: jax.Array
  sizes: jax.Array


def _exchange(sizes, offset, rows: int, devices: int, local: int, me) -> _Exchange:
  """Device ``me``'s ``_Exchange``: ``devices`` of ``rows`` rows and ``local`` groups each."""
  m = rows * devices
  firsts = offset[0] + jnp.arange(devices, dtype=jnp.int32) * local
  starts, ends = jax.vmap(lambda f: kernels.held_bounds(sizes, f[None], m, local))(firsts)
  lo, hi = starts[:, 0], ends[:, -1]  # each device's experts' rows
  first = jnp.arange(devices, dtype=jnp.int32) * rows  # each device's first row

  def overlap(lo, hi, first):
    begin = jnp.maximum(lo, first)
    return jnp.maximum(jnp.minimum(hi, first + rows) - begin, 0), begin

  send, begin = overlap(lo, hi, me * rows)
  recv, begin_in = overlap(lo[me], hi[me], first)
  return _Exchange(
    send,
    jnp.clip(begin - me * rows, 0, rows),
    jnp.clip(begin - lo, 0, m),
    recv,
    jnp.clip(begin_in - lo[me], 0, m),
    jnp.clip(begin_in - first, 0, rows),
    ends[me] - starts[me],
  )


def _exchanged(axes, lhs, rhs, sizes, offset, *, name: str, params: dict, devices: int):
  """One device's product with its experts' rows brought to it by ragged all-to-alls.

  Tokens and experts over the same ``axes``: each device sends its rows to
  the devices holding their experts (a ragged ``all_to_all``: on GPU and
  TPU each row once), computes its experts' products of what arrives, and
  (grouped GEMM) sends each result row back to where it came from. tgmm
  sends both operands and keeps its groups' products: nothing comes back.
  """
  rows = lhs.shape[0]
  local = params["groups"] // devices if name == tgmm_op.name else rhs.shape[0]
  plan = _exchange(sizes, offset, rows, devices, local, lax.axis_index(axes))

  def gather(x):  # this device's experts' rows of every device, packed from row 0
    buffer = jnp.zeros((rows * devices, *x.shape[1:]), x.dtype)
    return ragged_all_to_all(
      x, buffer, plan.send_from, plan.send, plan.send_to, plan.recv, axis_name=axes
    )

  lhs = gather(lhs)
  if name == tgmm_op.name:
    rhs, params = gather(rhs), dict(params, groups=local)
  start = jnp.zeros((1,), jnp.int32)
  (out,) = _OPS[name].primitive.kernel.bind(lhs, rhs, plan.sizes, start, **params)
  if name == tgmm_op.name:
    return out
  back = jnp.zeros((rows, *out.shape[1:]), out.dtype)
  return ragged_all_to_all(
    out, back, plan.recv_at, plan.recv, plan.recv_from, plan.send, axis_name=axes
  )


def _per_shard(shards: Shards, lhs, rhs, sizes, offset, *, name: str, params: dict):
  """One device's grouped product when its rows (M) or its groups (G) are a shard.

  A shard of the rows takes its own group sizes (the sorted rows' split
  clipped to its range); a shard of the groups (expert parallelism) holds
  groups ``[offset + i * G_local, ...)``, the rows of the others giving
  zeros. Results are summed over the sharded factors they reduce (the
  groups for the grouped GEMM, the rows for tgmm; K for both).

  Rows and groups over the same mesh axes (tokens and experts split alike):
  each row goes to its expert's device and back (``_exchanged``); with a
  batch axis (``vmap``'s grid), the rows are gathered instead (never the
  weights, which are most of the bytes), each device computes its experts'
  rows of all of them, and the grouped GEMM's output is reduce-scattered
  back to the row shards.
  """
  m_axes, g_axes = shards.axes("m"), shards.axes("g")
  together = bool(m_axes) and m_axes == g_axes
  if set(m_axes) & set(g_axes) and not together:
    raise NotImplementedError(
      f"{name}: rows sharded over {m_axes} and groups over {g_axes} share some mesh axes but "
      "not all; shard them over the same axes or over disjoint ones"
    )
  summed = tuple(a for a in shards.summed[0] if not (together and a in m_axes))
  rows = lhs.ndim - 2
  if together and rows == 0:
    out = _exchanged(
      m_axes, lhs, rhs, sizes, offset, name=name, params=params, devices=shards.size("m")
    )
    return [lax.psum(out, summed) if summed else out]
  if together:
    lhs = lax.all_gather(lhs, m_axes, axis=rows, tiled=True)
    if name == tgmm_op.name:
      rhs = lax.all_gather(rhs, m_axes, axis=rows, tiled=True)
  elif m_axes:
    here = lhs.shape[rows]
    sizes = kernels.shard_group_sizes(sizes, lax.axis_index(m_axes) * here, here)
  if name == tgmm_op.name:
    local = params["groups"] // shards.size("g")
    params = dict(params, groups=local)
  else:
    local = rhs.shape[-3]
  if g_axes:
    offset = offset + lax.axis_index(g_axes) * local
  (out,) = _OPS[name].primitive.kernel.bind(lhs, rhs, sizes, offset, **params)
  out = lax.psum(out, summed) if summed else out
  if together and name != tgmm_op.name:
    out = lax.psum_scatter(out, m_axes, scatter_dimension=rows, tiled=True)
  return [out]


def _dims(name: str, operands: str, result: str):
  """The dims of ``name``'s calls, with the per-shard program of the rows and the groups.

  With an epilogue, K (summed before it) is replicated, and so is a gated
  weight's ``2N`` (its halves pair columns ``j`` and ``N + j``).
  """
  labels = tuple(tuple(o.split()) for o in operands.split(","))

  def dims(*avals, **params) -> Dims:
    replicated = {"gt", "o"}
    if params.get("activation") or params.get("gated"):
      replicated |= {"k"} | ({"n"} if params.get("gated") else set())
    out = tuple("n_out" if f == "n" and params.get("gated") else f for f in result.split())
    order = [f for names in (*labels, out) for f in names]  # Shardy wants them in this order
    return Dims(
      labels,
      (out,),
      replicated=tuple(sorted(replicated, key=order.index)),
      programs=(
        Program(
          "group_shards",
          ("m", "g"),
          functools.partial(_per_shard, name=name),
          shares_axes=True,
          takes_params=True,
        ),
      ),
    )

  return dims


def _declare(name: str, reference, dims: str, kernel, **kw):
  """The op ``name`` over ``kernel``'s backends, with ``dims`` (``"operands -> result"``)."""
  operands, result = dims.split("->")
  return custom_op(
    name,
    reference=reference,
    dims=_dims(name, operands, result),
    kernels=kernel.impls,
    config=kernel.space,
    own_configs=kernel.spaces,
    **kw,
  )


gmm_op = _declare(_OP, kernels.gmm, "m k, g k n, gt, o -> m n", kernels.GMM)
tgmm_op = _declare(f"{_OP}_tgmm", kernels.tgmm, "m k, m n, gt, o -> g k n", kernels.TGMM)


def _epilogue_jvp(primals, tangents, out, *, activation, gated, out_dtype, precision):
  """``act'(h) * dh`` (gated: ``act'(a) b da + act(a) db``), ``h`` recomputed by the GEMM.

  Linear in the tangents, which reach ``h`` through grouped products, so
  ``grad`` transposes them into ``ragged_dot`` and tgmm kernels.
  """
  lhs, rhs, sizes, offset = primals
  dlhs, drhs = tangents[:2]
  wide = kernels.acc_dtype(lhs.dtype, rhs.dtype)
  gemm = lambda a, b, dtype: gmm_op(a, b, sizes, offset, out_dtype=dtype, precision=precision)
  split = lambda h: jnp.split(h, 2, axis=-1) if gated else [h]
  # The tangent products in the result's dtype, as jnp.dot's JVP gives them:
  # a 16-bit result's transposes (the backward's GEMMs) take 16-bit cotangents.
  dh = (gemm(dlhs, rhs, out_dtype) + gemm(lhs, drhs, out_dtype)).astype(wide)
  h, dh = split(gemm(lhs, rhs, wide)), split(dh)
  tangent = activation_derivative(activation, h[0]) * dh[0]
  if gated:
    tangent = tangent * h[1] + activate(activation, h[0]) * dh[1]
  return tangent.astype(out_dtype)


# The grouped GEMM with an activation, or gated (``act(lhs @ rhs[g][:, :N]) *
# (lhs @ rhs[g][:, N:])``): its kernels are the GEMM's with the epilogue.
epilogue_op = _declare(
  f"{_OP}_epilogue",
  kernels.gmm_epilogue,
  "m k, g k n, gt, o -> m n",
  kernels.GMM,
  jvp=_epilogue_jvp,
)
_OPS = {op.name: op for op in (gmm_op, tgmm_op, epilogue_op)}


def _swap(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, -1, -2)


def _zeros_or(cts, operands, run):
  """The transpose's cotangents: ``run(ct, undefined)`` for the undefined operand."""
  (ct,) = cts
  undefined = [ad.is_undefined_primal(x) for x in operands[:2]]
  out = [None] * len(operands)
  i = undefined.index(True)
  out[i] = ad.Zero(operands[i].aval) if type(ct) is ad.Zero else run(ct, i)
  return out


def _gmm_transpose(cts, lhs, rhs, sizes, offset, **params):
  """``dlhs = ragged_dot(ct, rhs^T)``, ``drhs = tgmm(lhs, ct)``."""

  def run(ct, i):
    if i == 0:
      args, own = (ct, _swap(rhs)), {}
    else:  # tgmm has no Mosaic GPU kernel: a pinned Mosaic config leaves it to the executor
      args, own = (lhs, ct), {"groups": rhs.aval.shape[-3]}
      if not isinstance(params["config"], (RaggedDotConfig, type(None))):
        own["config"] = None
    prim = (gmm_op, tgmm_op)[i].primitive
    (d,) = prim.bind(*args, sizes, offset, **(params | own), out_dtype=(lhs, rhs)[i].aval.dtype)
    return d

  params.pop("out_dtype")
  return _zeros_or(cts, (lhs, rhs, sizes, offset), run)


def _tgmm_transpose(cts, lhs, rhs, sizes, offset, *, groups, **params):
  """``dlhs = ragged_dot(rhs, ct^T)``, ``drhs = ragged_dot(lhs, ct)``."""

  def run(ct, i):
    args = (rhs, _swap(ct)) if i == 0 else (lhs, ct)
    dtype = (lhs, rhs)[i].aval.dtype
    (d,) = gmm_op.primitive.bind(*args, sizes, offset, **params, out_dtype=dtype)
    return d

  params.pop("out_dtype")
  return _zeros_or(cts, (lhs, rhs, sizes, offset), run)


def _bilinear_jvp_rule(prim):
  """The JVP of a product bilinear in ``(lhs, rhs)``: one product per nonzero tangent.

  Written as the primitive's own rule (not ``custom_op``'s ``jvp``, which
  instantiates zero tangents): ``grad`` with respect to one operand runs no
  product for the other.
  """

  def rule(primals, tangents, **params):
    lhs, rhs, sizes, offset = primals
    (out,) = prim.bind(*primals, **params)
    pairs = ((tangents[0], (tangents[0], rhs)), (tangents[1], (lhs, tangents[1])))
    # Each product in the result's dtype, as jnp.dot's JVP: the transposes
    # (the backward's GEMMs) then take cotangents of that dtype, not float32.
    live = [ab for t, ab in pairs if type(t) is not ad.Zero]
    terms = [prim.bind(*ab, sizes, offset, **params)[0] for ab in live]
    if not terms:
      return [out], [ad.Zero.from_primal_value(out)]
    return [out], [functools.reduce(jnp.add, terms)]

  return rule


for _op, _transpose in ((gmm_op, _gmm_transpose), (tgmm_op, _tgmm_transpose)):
  ad.primitive_jvps[_op.primitive] = _bilinear_jvp_rule(_op.primitive)
  ad.primitive_transposes[_op.primitive] = _transpose


# ----------------------------------------------------------------------------
# The public function.


def int_array(name: str, x, shape_doc: str, ndim: int, op: str = _OP) -> jax.Array:
  """``x`` as int32, or a TypeError naming ``op`` and ``name`` unless integer of rank ``ndim``."""
  x = jnp.asarray(x)
  if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
      f"{op}: {name} must be an integer array {shape_doc}, got {x.dtype} of shape {x.shape}"
    )
  return x.astype(jnp.int32)


def ragged_dot(
  lhs: jax.Array,
  rhs: jax.Array,
  group_sizes: jax.Array,
  precision=None,
  preferred_element_type=None,
  group_offset: Optional[jax.Array] = None,
  *,
  activation: Optional[str] = None,
  gated: bool = False,
  config: Optional[Union[RaggedDotConfig, MosaicGpuRaggedDotConfig]] = None,
) -> jax.Array:
  """Grouped matmul, as ``jax.lax.ragged_dot``: each group of rows times its own matrix.

  The rows of ``lhs`` are sorted by group: the first ``group_sizes[0]`` rows
  are group 0's, the next ``group_sizes[1]`` group 1's, and so on. Products
  accumulate in float32 (float64 for float64 inputs), and the work is that
  of one dense GEMM, not one per group.

  Args:
    lhs: ``[M, K]`` floating.
    rhs: ``[G, K, N]`` floating: group ``g``'s matrix is ``rhs[g]``.
    group_sizes: ``[Gt]`` integers, the rows of each group (``Gt = G``
      without ``group_offset``). Rows past ``sum(group_sizes)`` give zeros.
    precision: as in ``jax.lax.ragged_dot``: None, a ``lax.Precision`` or its
      name, or a pair of them.
    preferred_element_type: the result's dtype; default the promoted dtype
      of ``lhs`` and ``rhs``.
    group_offset: ``[1]`` integer: ``rhs`` holds groups ``[offset, offset +
      G)`` of ``group_sizes`` (expert parallelism); rows of other groups give
      zeros.
    activation: a fused epilogue, one of ``pallax.activations.ACTIVATIONS``
      (``"silu"``, ``"gelu"``, ...) applied to the product; None: none.
    gated: ``rhs`` is ``[G, K, 2N]``, two weights side by side, and the
      result ``act(lhs @ rhs[g][:, :N]) * (lhs @ rhs[g][:, N:])`` (the MoE
      FFN's gate and up projections in one kernel; ``act`` the identity
      without ``activation``).
    config: pin the kernels' ``RaggedDotConfig`` (the forward's and the
      gradients'), or a ``MosaicGpuRaggedDotConfig`` (the grouped GEMMs on
      Mosaic GPU, the weight gradient the executor's choice); None: the
      executor's choice.

  Returns:
    ``[M, N]``.
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  check_floating(_OP, "lhs", lhs)
  check_floating(_OP, "rhs", rhs)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(
      f"{_OP}: lhs must be [M, K] and rhs [G, K, N] with one K; got lhs of shape "
      f"{lhs.shape} and rhs of shape {rhs.shape}"
    )
  sizes = int_array("group_sizes", group_sizes, "[G]", 1)
  if group_offset is None:
    if sizes.shape[0] != rhs.shape[0]:
      raise ValueError(
        f"{_OP}: group_sizes must have one entry per group of rhs ({rhs.shape[0]}); got "
        f"shape {sizes.shape}"
      )
    offset = jnp.zeros((1,), jnp.int32)
  else:
    offset = int_array("group_offset", group_offset, "[1]", 1)
    if offset.shape != (1,) or sizes.shape[0] < rhs.shape[0]:
      raise ValueError(
        f"{_OP}: group_offset must have shape (1,) and group_sizes at least rhs's "
        f"{rhs.shape[0]} groups; got {offset.shape} and {sizes.shape}"
      )
  if activation is not None and activation not in ACTIVATIONS:
    raise ValueError(f"{_OP}: activation must be one of {ACTIVATIONS} or None, got {activation!r}")
  if gated and rhs.shape[2] % 2:
    raise ValueError(f"{_OP}: gated takes rhs [G, K, 2N], got an odd last dim: {rhs.shape}")
  if activation is None and not gated:
    return product(gmm_op, lhs, rhs, sizes, offset, precision, preferred_element_type, config)
  return product(
    epilogue_op,
    lhs,
    rhs,
    sizes,
    offset,
    precision,
    preferred_element_type,
    config,
    activation=activation,
    gated=bool(gated),
  )


def product(op, lhs, rhs, sizes, offset, precision, preferred_element_type, config, **params):
  """Binds ``op`` (``gmm_op`` or ``tgmm_op``) on checked operands: dtypes promoted as jnp's."""
  check_config(_OP, config, (RaggedDotConfig, MosaicGpuRaggedDotConfig))
  dtype = jnp.result_type(lhs, rhs)
  out_dtype = dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(f"{_OP}: preferred_element_type must be a floating dtype, got {out_dtype}")
  return op(
    lhs.astype(dtype),
    rhs.astype(dtype),
    sizes,
    offset,
    out_dtype=out_dtype,
    precision=check_precision(_OP, precision),
    config=config,
    **params,
  )
