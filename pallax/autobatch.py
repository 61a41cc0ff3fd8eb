"""Memory-bounded batching driver: :func:`autobatch`.

A vectorised JAX function evaluated over a long axis holds the inputs, outputs
and intermediates of the whole axis at once. :func:`autobatch` runs such a
function over the axis in chunks whose inputs + outputs fit in a byte budget,
so peak memory follows the chunk, not the axis. The full chunks run in one
``lax.scan``. When the axis length is not a multiple of the chunk length, the
shorter remainder chunk runs once, first, before the ``lax.scan`` over the
full chunks, and its result seeds the scan's carry (the output buffers the
scan fills in, or the running reduction), so the scan depends on it. Run after
the scan, the remainder chunk was independent of it: XLA:CPU overlapped it
with the scan and peak memory doubled. Optionally the outputs are reduced over
the axis while looping (a sum of per-row losses, a running maximum), which
keeps even the output small.

It is call-compatible with ``bartz``'s ``autobatch`` (same argument names and
meanings), so code can switch by changing the import. Unlike it, the chunk
count never has to divide the axis length: a prime length gets
``ceil(io bytes / budget)`` chunks, not chunks of one element. It also seeds
``jnp.maximum`` / ``jnp.minimum`` reductions, can derive the budget from the
device, can account for the function's temporaries, and rematerialises chunks
under reverse-mode differentiation so gradients stay memory-bounded too.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["autobatch"]

# Fraction of the free device memory (or available host RAM on CPU) used as the
# io budget when ``max_io_nbytes=None``. The rest is left to the function's
# intermediates, which are commonly a few times its inputs + outputs.
FREE_MEMORY_FRACTION = 1 / 8

# Chunk lengths at which ``count_intermediates`` compiles the function; the
# difference of the two temporary sizes gives the bytes per element.
_PROBE_LENGTHS = (16, 32)


@dataclass(frozen=True)
class _Options:
  """The static arguments of one :func:`autobatch` call, validated."""

  max_io_nbytes: int | None
  in_axes: Any
  out_axes: Any
  return_nbatches: bool
  reduce_ufunc: Any
  reduce_vary_axes: tuple[str, ...]
  warn_on_overflow: bool
  result_shape_dtype: Any
  count_intermediates: bool


def autobatch(
  func: Callable,
  max_io_nbytes: int | None = None,
  in_axes: Any = 0,
  out_axes: Any = 0,
  *,
  return_nbatches: bool = False,
  reduce_ufunc: Any = None,
  reduce_vary_axes: Sequence[str] = (),
  warn_on_overflow: bool = True,
  result_shape_dtype: Any = None,
  count_intermediates: bool = False,
) -> Callable:
  """Batch ``func`` over an axis in chunks whose inputs + outputs fit a budget.

  Args:
    func: A jittable function of positional arguments, taking and returning
      pytrees of arrays, batched over one axis of each batched input and of
      every output (as a function passed to ``jax.vmap`` would return).
    max_io_nbytes: The budget: the largest number of bytes of batched inputs +
      outputs of one chunk (unbatched arguments do not count; with
      ``reduce_ufunc``, the outputs are ``func``'s, before the reduction). A
      positive ``int``. ``None`` derives it from the default backend when the
      function is traced: ``FREE_MEMORY_FRACTION`` (1/8) of the smallest free
      memory of the local devices (``bytes_limit - bytes_in_use`` of
      ``Device.memory_stats()``) on accelerators, or of the available host RAM
      (``MemAvailable`` on Linux) on CPU. The remaining 7/8 is left to the
      function's intermediates and to the full input and output arrays.
    in_axes: A pytree prefix of the positional arguments, as in ``jax.vmap``:
      the axis of each array along which to batch, or ``None`` to pass the
      array whole to every chunk. At least one array must be batched and all
      batched axes must have the same length ``n``.
    out_axes: A pytree prefix of the output: the batched axis of each output
      array. ``None`` is not allowed, every output must have the batched axis.
    return_nbatches: If true, also return the number of chunks (calls of
      ``func``) as a second output.
    reduce_ufunc: A binary ``jnp.ufunc`` (``jnp.add``, ``jnp.multiply``,
      ``jnp.maximum``, ``jnp.minimum``, the logical and bitwise ones, ...) to
      reduce every output over its batched axis. Chunks are reduced with
      ``ufunc.reduce`` and accumulated with ``ufunc``, starting from its
      identity (for ``maximum`` / ``minimum``: the lowest / highest value of
      the dtype), in the dtype ``ufunc.reduce`` returns (e.g. ``int32`` sums of
      ``int8``).
    reduce_vary_axes: ``jax.shard_map`` mesh axis names over which the loop
      body's output varies. The accumulator seed is
      ``jax.lax.pcast(..., to='varying')`` over them so the scan carry type
      matches under the varying-manual-axes check. Ignored unless
      ``reduce_ufunc`` is set.
    warn_on_overflow: Warn when a single element along the axis exceeds the
      budget; the function then runs on chunks of one element.
    result_shape_dtype: A pytree of ``jax.ShapeDtypeStruct`` describing
      ``func``'s output on the full arguments (before any reduction). If
      ``None``, ``func`` is traced once more with ``jax.eval_shape`` to find
      it.
    count_intermediates: If true, also count ``func``'s temporaries: the
      function is compiled at two small chunk lengths and the growth of XLA's
      reported temporary bytes
      (``compiled.memory_analysis().temp_size_in_bytes``) per element is added
      to each element's io bytes, so chunks shrink until io + temporaries fit
      the budget. This assumes temporaries grow linearly with the chunk length
      and that ``func`` compiles on its own (no collectives over enclosing
      ``shard_map`` axes, no closed-over tracers); otherwise, or where the
      backend reports no temporaries, the io budget is kept and a warning is
      given once per ``autobatch`` instance.

  Returns:
    A callable: a jitted function with ``func``'s signature returning
    ``func``'s output (reduced when ``reduce_ufunc`` is set), and the chunk
    count as a second output when ``return_nbatches`` is set.

  Notes:
    With ``e`` the bytes of one element of the batched inputs and outputs
    (plus its temporaries when ``count_intermediates``), ``n`` the axis length
    and ``B`` the budget, the driver aims for ``k = ceil(n * e / B)`` chunks of
    length ``c = ceil(n / k)``. It runs ``n // c`` full chunks in a
    ``lax.scan`` and, when ``n % c > 0``, one shorter chunk outside it, so
    ``nbatches = ceil(n / c)``. That equals ``k`` except when fewer chunks of
    length ``c`` cover the axis (``n = 10, k = 6`` gives ``c = 2`` and 5
    chunks) or an element exceeds the budget (``k > n`` gives ``n`` chunks of
    one). The shorter chunk is computed first and the scan's carry starts from
    its result: XLA:CPU runs independent work concurrently and would otherwise
    hold two chunks' temporaries at once. A single chunk (including
    ``n == 0``) calls ``func`` directly, without a scan. Chunks hold whole
    elements, so a chunk can exceed the budget by less than one element's
    bytes (``c <= ceil(B / e)``).

    The chunking is decided when the function is traced, from static shapes;
    it works under ``jax.jit``, ``jax.vmap`` (each vmapped example is chunked
    as if alone, so a chunk's memory grows by the vmapped size), ``jax.grad``
    and ``jax.jvp`` (chunks are rematerialised with ``jax.checkpoint``, so
    reverse mode holds the intermediates of one chunk's forward and backward
    pass at a time, not the whole axis's, at the price of one more forward
    pass) and ``jax.shard_map`` (shapes there are per shard). An
    ``autobatch`` nested inside another with the same budget runs in a single
    call whenever the outer chunk already fits the budget.
  """
  options = _Options(
    max_io_nbytes=_check_budget(max_io_nbytes),
    in_axes=tuple(in_axes) if isinstance(in_axes, list) else in_axes,
    out_axes=out_axes,
    return_nbatches=bool(return_nbatches),
    reduce_ufunc=_check_reduce_ufunc(reduce_ufunc),
    reduce_vary_axes=_check_vary_axes(reduce_vary_axes),
    warn_on_overflow=bool(warn_on_overflow),
    result_shape_dtype=result_shape_dtype,
    count_intermediates=bool(count_intermediates),
  )
  warned: set[str] = set()

  @functools.wraps(func)
  def batched(*args: Any, **kwargs: Any) -> Any:
    if kwargs:
      args = _bind_positional(func, args, kwargs)
    return _batched_call(func, args, options, warned)

  return jax.jit(batched)


def _check_budget(max_io_nbytes: Any) -> int | None:
  """Validate ``max_io_nbytes``: ``None`` or a positive int."""
  if max_io_nbytes is None:
    return None
  if isinstance(max_io_nbytes, bool) or not isinstance(max_io_nbytes, numbers.Integral):
    raise TypeError(f"max_io_nbytes must be a positive int or None, got {max_io_nbytes!r}")
  if max_io_nbytes <= 0:
    raise ValueError(f"max_io_nbytes must be positive, got {max_io_nbytes}")
  return int(max_io_nbytes)


def _check_reduce_ufunc(ufunc: Any) -> Any:
  """Validate ``reduce_ufunc``: ``None`` or a binary ufunc with a seed."""
  if ufunc is None:
    return None
  if not (callable(ufunc) and hasattr(ufunc, "reduce") and hasattr(ufunc, "identity")):
    raise TypeError(
      "reduce_ufunc must be a binary ufunc such as jnp.add or jnp.maximum "
      f"(callable, with .reduce and .identity), got {ufunc!r}"
    )
  if getattr(ufunc, "nin", 2) != 2 or getattr(ufunc, "nout", 1) != 1:
    raise TypeError(f"reduce_ufunc must take two inputs and give one output, got {ufunc!r}")
  if ufunc.identity is None and ufunc is not jnp.maximum and ufunc is not jnp.minimum:
    raise TypeError(
      f"reduce_ufunc={ufunc!r} has no identity to seed the accumulator with; "
      "use a ufunc with an identity, jnp.maximum or jnp.minimum"
    )
  return ufunc


def _check_vary_axes(axes: Any) -> tuple[str, ...]:
  """Validate ``reduce_vary_axes``: a mesh axis name or a sequence of them."""
  if isinstance(axes, str):
    return (axes,)
  if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
    raise TypeError(f"reduce_vary_axes must be a sequence of mesh axis names, got {axes!r}")
  return tuple(axes)


def _bind_positional(func: Callable, args: tuple, kwargs: dict) -> tuple:
  """Turn keyword arguments naming positional parameters into positional ones."""
  bound = inspect.signature(func).bind(*args, **kwargs)
  if bound.kwargs:
    raise TypeError(
      f"autobatch: keyword-only arguments {sorted(bound.kwargs)} are not "
      "supported; in_axes describes the positional arguments"
    )
  return bound.args


def _batched_call(func: Callable, args: tuple, opts: _Options, warned: set[str]) -> Any:
  """Trace ``func`` over ``args`` in chunks; the body of the jitted wrapper."""
  in_paths, in_leaves, in_tree = _flatten(args)
  in_axes = _leaf_axes(opts.in_axes, args, in_paths, in_leaves, "in_axes")
  n = _batch_length(in_paths, in_leaves, in_axes)

  out_shape = opts.result_shape_dtype
  if out_shape is None:
    out_shape = jax.eval_shape(func, *args)
  out_paths, out_structs, out_tree = _flatten(out_shape)
  out_axes = _leaf_axes(opts.out_axes, out_shape, out_paths, out_structs, "out_axes")
  _check_output_lengths(out_paths, out_structs, out_axes, n)

  elem_nbytes = _element_nbytes(in_leaves, in_axes) + _element_nbytes(out_structs, out_axes)
  if opts.count_intermediates and n:
    elem_nbytes += _temp_nbytes_per_element(func, in_leaves, in_tree, in_axes, warned)
  budget = opts.max_io_nbytes if opts.max_io_nbytes is not None else _default_budget()
  if opts.warn_on_overflow and n and elem_nbytes > budget:
    warnings.warn(
      f"autobatch({_name(func)}): one element along the batched axis takes "
      f"{elem_nbytes:_} bytes > max_io_nbytes={budget:_}; running chunks of "
      "one element",
      stacklevel=2,
    )
  length, nbatches = _chunking(n, elem_nbytes, budget)

  chunk = _Chunk(
    func,
    in_tree,
    in_axes,
    out_tree,
    out_paths,
    out_structs,
    out_axes,
    opts.reduce_ufunc,
    opts.result_shape_dtype is not None,
  )
  batched = [x for x, ax in zip(in_leaves, in_axes) if ax is not None]
  unbatched = [x for x, ax in zip(in_leaves, in_axes) if ax is None]
  if nbatches == 1:
    out_leaves = chunk(batched, unbatched)
  elif opts.reduce_ufunc is None:
    out_leaves = _ChunkLoop(chunk, unbatched, n, length).map(batched)
  else:
    seeds = [_seed(opts.reduce_ufunc, s, opts.reduce_vary_axes) for s in chunk.reduced_structs]
    out_leaves = _ChunkLoop(chunk, unbatched, n, length).reduce(batched, seeds)

  result = jax.tree.unflatten(out_tree, out_leaves)
  return (result, nbatches) if opts.return_nbatches else result


def _chunking(n: int, elem_nbytes: int, budget: int) -> tuple[int, int]:
  """Chunk length and number of chunks for ``n`` elements of ``elem_nbytes``.

  ``ceil(n * elem_nbytes / budget)`` chunks are aimed for; their length is
  ``ceil(n / that)`` and ``ceil(n / length)`` chunks of it cover the axis.
  """
  if n == 0:
    return 0, 1
  target = max(1, -(-n * elem_nbytes // budget))
  length = -(-n // target)
  return length, -(-n // length)


@dataclass(frozen=True, eq=False)
class _Chunk:
  """``func`` on one chunk: batched leaves in, (reduced) output leaves out."""

  func: Callable
  in_tree: Any
  in_axes: list
  out_tree: Any
  out_paths: list[str]
  out_structs: list
  out_axes: list[int]
  ufunc: Any
  user_shapes: bool

  @property
  def batched_axes(self) -> list[int]:
    return [ax for ax in self.in_axes if ax is not None]

  def __call__(self, batched: list, unbatched: list) -> list:
    batched_it, unbatched_it = iter(batched), iter(unbatched)
    leaves = [next(unbatched_it) if ax is None else next(batched_it) for ax in self.in_axes]
    out_leaves, tree = jax.tree.flatten(self.func(*jax.tree.unflatten(self.in_tree, leaves)))
    self._check(tree, out_leaves, batched[0].shape[self.batched_axes[0]])
    if self.ufunc is None:
      return out_leaves
    return [
      self.ufunc.reduce(y, axis=ax).astype(s.dtype)
      for y, ax, s in zip(out_leaves, self.out_axes, self.reduced_structs)
    ]

  @functools.cached_property
  def reduced_structs(self) -> list[jax.ShapeDtypeStruct]:
    """Shape and dtype of each output reduced over its batched axis (computed once)."""
    return [
      jax.ShapeDtypeStruct(_drop_axis(s.shape, ax), _reduction_dtype(self.ufunc, s.dtype))
      for s, ax in zip(self.out_structs, self.out_axes)
    ]

  def _check(self, tree: Any, out_leaves: list, length: int) -> None:
    """Check a chunk's output against the expected (or user-given) structure."""
    source = "result_shape_dtype" if self.user_shapes else "jax.eval_shape(func)"
    if tree != self.out_tree:
      raise ValueError(
        f"autobatch({_name(self.func)}): func returned the structure {tree}, "
        f"but {source} gives {self.out_tree}"
      )
    for path, y, s, ax in zip(self.out_paths, out_leaves, self.out_structs, self.out_axes):
      expected = _resize_axis(s.shape, ax, length)
      if y.shape != expected or y.dtype != s.dtype:
        raise ValueError(
          f"autobatch({_name(self.func)}): output{path} of a chunk of "
          f"{length} is {y.dtype}{list(y.shape)}, but {source} implies "
          f"{s.dtype}{list(expected)}"
        )


@dataclass(frozen=True)
class _ChunkLoop:
  """The full chunks in one ``lax.scan``; a shorter remainder chunk once.

  The remainder chunk runs first and the scan's carry starts from its
  result, so the scan depends on it. Otherwise XLA may run the two side by
  side (XLA:CPU schedules independent work concurrently) and hold the
  temporaries of two chunks at once. Chunks are rematerialised under
  reverse-mode AD (``jax.checkpoint``), so the backward pass too holds one
  chunk's intermediates at a time.
  """

  chunk: _Chunk
  unbatched: list
  n: int
  length: int

  def map(self, batched: list) -> list:
    """The chunks' outputs, joined along the output axes."""
    nfull, rest = divmod(self.n, self.length)
    run = jax.checkpoint(self.chunk, prevent_cse=False)
    out_axes = self.chunk.out_axes
    if not rest:
      _, ys = lax.scan(
        lambda carry, xs: (carry, run(xs, self.unbatched)), None, self._full(batched, nfull)
      )
      return [_merge_axis(y, ax) for y, ax in zip(ys, out_axes)]

    # the remainder's outputs start the output buffers the scan fills in
    tail = run(self._tail(batched, nfull), self.unbatched)
    outs = [
      lax.dynamic_update_slice_in_dim(jnp.zeros(s.shape, s.dtype), t, nfull * self.length, ax)
      for s, t, ax in zip(self.chunk.out_structs, tail, out_axes)
    ]

    def step(carry: tuple[list, jax.Array], xs: list) -> tuple[tuple[list, jax.Array], None]:
      outs, i = carry
      ys = run(xs, self.unbatched)
      outs = [
        lax.dynamic_update_slice_in_dim(o, y, i * self.length, ax)
        for o, y, ax in zip(outs, ys, out_axes)
      ]
      return (outs, i + 1), None

    (outs, _), _ = lax.scan(step, (outs, jnp.int32(0)), self._full(batched, nfull))
    return outs

  def reduce(self, batched: list, seeds: list) -> list:
    """The chunks' reduced outputs, accumulated from ``seeds``."""
    nfull, rest = divmod(self.n, self.length)
    run = jax.checkpoint(self.chunk, prevent_cse=False)
    ufunc = self.chunk.ufunc

    def combine(acc: list, part: list) -> list:
      return [ufunc(a, p).astype(a.dtype) for a, p in zip(acc, part)]

    acc = seeds
    if rest:
      acc = combine(acc, run(self._tail(batched, nfull), self.unbatched))
    acc, _ = lax.scan(
      lambda acc, xs: (combine(acc, run(xs, self.unbatched)), None), acc, self._full(batched, nfull)
    )
    return acc

  def _full(self, batched: list, nfull: int) -> list:
    return [
      _split_axis(x, ax, nfull, self.length) for x, ax in zip(batched, self.chunk.batched_axes)
    ]

  def _tail(self, batched: list, nfull: int) -> list:
    start = nfull * self.length
    return [
      lax.slice_in_dim(x, start, self.n, axis=ax) for x, ax in zip(batched, self.chunk.batched_axes)
    ]


def _split_axis(x: jax.Array, axis: int, nchunks: int, length: int) -> jax.Array:
  """The first ``nchunks * length`` elements along ``axis``, chunk index first."""
  x = lax.slice_in_dim(x, 0, nchunks * length, axis=axis)
  x = x.reshape(x.shape[:axis] + (nchunks, length) + x.shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def _merge_axis(y: jax.Array, axis: int) -> jax.Array:
  """Inverse of :func:`_split_axis` for the stacked outputs of a scan."""
  y = jnp.moveaxis(y, 0, axis)
  return y.reshape(y.shape[:axis] + (y.shape[axis] * y.shape[axis + 1],) + y.shape[axis + 2 :])


def _drop_axis(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
  return shape[:axis] + shape[axis + 1 :]


def _resize_axis(shape: tuple[int, ...], axis: int, length: int) -> tuple[int, ...]:
  return shape[:axis] + (length,) + shape[axis + 1 :]


def _flatten(tree: Any) -> tuple[list[str], list, Any]:
  """Leaves of ``tree`` with their key paths (for messages) and treedef."""
  with_paths, treedef = jax.tree.flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in with_paths], [x for _, x in with_paths], treedef


def _leaf_axes(axes: Any, tree: Any, paths: list[str], leaves: list, name: str) -> list:
  """Broadcast the prefix ``axes`` to one normalised axis (or None) per leaf."""
  try:
    full = jax.tree.broadcast(axes, tree, is_leaf=lambda x: x is None)
    flat = jax.tree.structure(tree).flatten_up_to(full)
  except (ValueError, TypeError) as err:
    raise ValueError(
      f"{name}={axes!r} is not a pytree prefix of the "
      f"{'arguments' if name == 'in_axes' else 'outputs'}: {err}"
    ) from None
  return [_normalize_axis(ax, path, x, name) for ax, path, x in zip(flat, paths, leaves)]


def _normalize_axis(axis: Any, path: str, x: Any, name: str) -> int | None:
  """Check one axis against its leaf; negative axes count from the end."""
  what = "argument" if name == "in_axes" else "output"
  if axis is None:
    if name == "out_axes":
      raise ValueError(
        f"out_axes: None for output{path} is not supported; every output must have the batched axis"
      )
    return None
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"{name}: the axis for {what}{path} must be an int or None, got {axis!r}")
  ndim = len(np.shape(x))
  if not -ndim <= axis < ndim:
    raise ValueError(
      f"{name}: axis {axis} is out of range for {what}{path} of shape {tuple(np.shape(x))}"
    )
  return int(axis) % ndim


def _batch_length(paths: list[str], leaves: list, axes: list) -> int:
  """The common length of the batched axes of the arguments."""
  lengths = {path: x.shape[ax] for path, x, ax in zip(paths, leaves, axes) if ax is not None}
  if not lengths:
    raise ValueError("in_axes: no argument is batched (all axes are None)")
  if len(set(lengths.values())) > 1:
    seen = ", ".join(f"args{path}: {m}" for path, m in lengths.items())
    raise ValueError(f"in_axes: the batched axes have different lengths ({seen})")
  return next(iter(lengths.values()))


def _check_output_lengths(paths: list[str], structs: list, axes: list[int], n: int) -> None:
  for path, s, ax in zip(paths, structs, axes):
    if s.shape[ax] != n:
      raise ValueError(
        f"out_axes: output{path} has length {s.shape[ax]} along axis {ax}, "
        f"but the batched arguments have length {n}"
      )


def _element_nbytes(leaves: list, axes: list) -> int:
  """Bytes of one element along the batched axis, summed over batched leaves."""
  return sum(
    math.prod(_drop_axis(x.shape, ax)) * np.dtype(x.dtype).itemsize
    for x, ax in zip(leaves, axes)
    if ax is not None
  )


def _temp_nbytes_per_element(
  func: Callable, leaves: list, in_tree: Any, axes: list, warned: set[str]
) -> int:
  """Growth of XLA's temporary bytes per element, from two small compilations."""
  temps = []
  for length in _PROBE_LENGTHS:
    structs = [
      jax.ShapeDtypeStruct(x.shape if ax is None else _resize_axis(x.shape, ax, length), x.dtype)
      for x, ax in zip(leaves, axes)
    ]
    try:
      compiled = jax.jit(func).trace(*jax.tree.unflatten(in_tree, structs)).lower().compile()
    # Best effort: func may use collectives of an enclosing shard_map or
    # otherwise fail to compile alone; the io budget still applies.
    except Exception as err:  # noqa: BLE001
      _warn_once(
        warned,
        f"autobatch({_name(func)}): count_intermediates could not "
        f"compile func on its own ({type(err).__name__}: {err}); "
        "counting io bytes only",
      )
      return 0
    analysis = compiled.memory_analysis()
    temps.append(None if analysis is None else analysis.temp_size_in_bytes)
  if not any(temps):
    _warn_once(
      warned,
      f"autobatch({_name(func)}): count_intermediates: the "
      f"{jax.default_backend()} backend reports no temporaries for func; "
      "counting io bytes only",
    )
    return 0
  growth = temps[1] - temps[0]
  return max(0, -(-growth // (_PROBE_LENGTHS[1] - _PROBE_LENGTHS[0])))


def _warn_once(warned: set[str], message: str) -> None:
  """Warn about ``count_intermediates`` once per :func:`autobatch` instance."""
  if "count_intermediates" not in warned:
    warned.add("count_intermediates")
    warnings.warn(message, stacklevel=3)


def _default_budget() -> int:
  """``FREE_MEMORY_FRACTION`` of the free memory of the default backend."""
  devices = jax.local_devices()
  free = free_memory(devices)
  if free is None:
    raise ValueError(
      f"max_io_nbytes=None: the free memory of the {devices[0].platform} devices "
      "is not known (no memory statistics); pass max_io_nbytes explicitly"
    )
  return max(1, int(free * FREE_MEMORY_FRACTION))


def free_memory(devices: Sequence[jax.Device]) -> Optional[int]:
  """The least free memory of ``devices`` in bytes, or None where it is not known.

  Accelerators report ``bytes_limit - bytes_in_use`` in ``Device.memory_stats()``;
  CPU devices share the host's available RAM (``MemAvailable`` on Linux, else
  ``sysconf``).
  """
  if devices[0].platform != "cpu":
    stats = [d.memory_stats() for d in devices]
    if any(s is None or "bytes_limit" not in s for s in stats):
      return None
    return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return None


def _reduction_dtype(ufunc: Any, dtype: Any) -> np.dtype:
  """The dtype ``ufunc.reduce`` returns for inputs of ``dtype``."""
  one = jax.ShapeDtypeStruct((1,), dtype)
  return jax.eval_shape(functools.partial(ufunc.reduce, axis=0), one).dtype


def _seed(ufunc: Any, struct: jax.ShapeDtypeStruct, vary_axes: tuple[str, ...]) -> jax.Array:
  """The accumulator's start: ``ufunc``'s identity, varying over ``vary_axes``."""
  if ufunc.identity is not None:
    value = np.asarray(ufunc.identity).astype(struct.dtype)
  else:
    value = _extreme(struct.dtype, lowest=ufunc is jnp.maximum)
  seed = jnp.full(struct.shape, value, struct.dtype)
  return lax.pcast(seed, vary_axes, to="varying") if vary_axes else seed


def _extreme(dtype: np.dtype, *, lowest: bool) -> Any:
  """The identity of maximum (``lowest``) or minimum over ``dtype``."""
  if dtype == np.bool_:
    return not lowest
  if jnp.issubdtype(dtype, jnp.floating):
    return -np.inf if lowest else np.inf
  if jnp.issubdtype(dtype, jnp.integer):
    info = jnp.iinfo(dtype)
    return info.min if lowest else info.max
  raise TypeError(f"reduce_ufunc: maximum / minimum have no identity for dtype {dtype}")


def _name(func: Callable) -> str:
  return getattr(func, "__name__", repr(func))
