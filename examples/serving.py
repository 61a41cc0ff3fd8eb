"""Serving a small Llama-architecture model on pallax ops with continuous batching.

The model: token embedding, ``LAYERS`` pre-norm blocks (``pallax.rms_norm``,
``pallax.matmul`` projections, ``pallax.apply_rotary`` on queries and keys,
grouped-query attention, a SwiGLU MLP), a final norm and an untied head.

``serve`` runs requests through one jitted step a call over a paged KV cache:

* every step takes a fixed budget of ``TOKENS`` query tokens: each running
  request's next prefill chunk (at most ``chunk`` tokens of its prompt) or,
  once its prompt is in, its last generated token; requests join when their
  arrival step comes and leave when they have their tokens;
* each sequence's new keys and values go into its pages
  (``pallax.kv_cache_slots`` and ``pallax.update_kv_cache``, the pools
  donated), and ``pallax.ragged_paged_attention`` attends every query token
  to its sequence's cache, bottom-right causal;
* a sequence whose last query was its prompt's last token or a generated one
  gets its next token greedily from that query's logits.

Pages are handed out from a shuffled free list as sequences grow.
``generate_alone`` is the reference: one request, no cache, the whole
sequence through causal ``pallax.dot_product_attention`` each step.
``tests/test_serving.py`` checks that every request's tokens are the same
both ways.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import pallax

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD, HIDDEN, LAYERS = 97, 64, 4, 2, 16, 128, 2
PAGE_SIZE, PAGES, MAX_SEQS, TOKENS = 4, 64, 4, 48
ROPE = dict(theta=10000.0)


def init_params(seed: int = 0) -> dict:
  """Random weights, scaled so that the logits are well separated (greedy ties are rare)."""
  keys = iter(jax.random.split(jax.random.key(seed), 4 + 8 * LAYERS))
  normal = lambda shape, scale: jax.random.normal(next(keys), shape) * scale
  layers = [
    dict(
      attn_norm=1.0 + normal((WIDTH,), 0.1),
      wq=normal((WIDTH, HEADS * HEAD), WIDTH**-0.5),
      wk=normal((WIDTH, KV_HEADS * HEAD), WIDTH**-0.5),
      wv=normal((WIDTH, KV_HEADS * HEAD), WIDTH**-0.5),
      wo=normal((HEADS * HEAD, WIDTH), (HEADS * HEAD) ** -0.5),
      mlp_norm=1.0 + normal((WIDTH,), 0.1),
      w_gate_up=normal((WIDTH, 2 * HIDDEN), WIDTH**-0.5),
    )
    for _ in range(LAYERS)
  ]
  for layer in layers:
    layer["w_down"] = normal((HIDDEN, WIDTH), HIDDEN**-0.5)
  return dict(
    embed=normal((VOCAB, WIDTH), 1.0),
    layers=layers,
    norm=1.0 + normal((WIDTH,), 0.1),
    head=normal((WIDTH, VOCAB), 3 * WIDTH**-0.5),
  )


def _qkv(layer, x, positions):
  """Queries, keys and values of ``x (T, WIDTH)``, rotated at ``positions (T,)``."""
  h = pallax.rms_norm(x, layer["attn_norm"])
  q = pallax.matmul(h, layer["wq"]).reshape(-1, HEADS, HEAD)
  k = pallax.matmul(h, layer["wk"]).reshape(-1, KV_HEADS, HEAD)
  v = pallax.matmul(h, layer["wv"]).reshape(-1, KV_HEADS, HEAD)
  return pallax.apply_rotary(q, positions, **ROPE), pallax.apply_rotary(k, positions, **ROPE), v


def _finish_block(layer, x, attended):
  x = x + pallax.matmul(attended.reshape(x.shape[0], -1), layer["wo"])
  gate, up = jnp.split(
    pallax.matmul(pallax.rms_norm(x, layer["mlp_norm"]), layer["w_gate_up"]), 2, -1
  )
  return x + pallax.matmul(jax.nn.silu(gate) * up, layer["w_down"])


def _logits(params, x):
  return pallax.matmul(pallax.rms_norm(x, params["norm"]), params["head"])


@jax.jit
def full_logits(params, tokens):
  """The reference forward: every position's logits, causal attention over ``tokens (S,)``."""
  x = params["embed"][tokens]
  positions = jnp.arange(tokens.shape[0])
  for layer in params["layers"]:
    q, k, v = _qkv(layer, x, positions)
    attended = pallax.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    x = _finish_block(layer, x, attended)
  return _logits(params, x)


def generate_alone(params, prompt, steps: int, length: int = 64):
  """``(tokens, logits)``: one request's greedy tokens, the whole sequence recomputed each step.

  No cache. ``logits``: the row each token was taken from. The sequence is
  padded to ``length`` tokens (one compiled forward): causal attention keeps
  the padding out of every earlier position's logits.
  """
  if len(prompt) + steps > length:
    raise ValueError(f"a prompt of {len(prompt)} and {steps} new tokens exceed length={length}")
  tokens, rows = list(prompt), []
  for _ in range(steps):
    padded = jnp.asarray(tokens + [0] * (length - len(tokens)), jnp.int32)
    rows.append(np.asarray(full_logits(params, padded)[len(tokens) - 1]))
    tokens.append(int(np.argmax(rows[-1])))
  return tokens[len(prompt) :], rows


def step_fn(params, cache, tokens, kv_lens, page_indices, cu_q_lens, num_seqs):
  """One step of the batch: ``(cache, logits of every query token)`` (``serving_step`` jits it).

  ``tokens (TOKENS,)``: the sequences' query tokens concatenated (the rest
  padding); ``kv_lens`` counts each sequence's new tokens too.
  """
  slots = pallax.kv_cache_slots(
    page_indices, kv_lens, cu_q_lens, num_seqs, PAGE_SIZE, tokens.shape[0]
  )
  seq = jnp.searchsorted(cu_q_lens[1:], jnp.arange(tokens.shape[0]), side="right")
  seq = jnp.minimum(seq, MAX_SEQS - 1)
  positions = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + jnp.arange(tokens.shape[0])
  positions = jnp.maximum(positions - cu_q_lens[seq], 0)
  x = params["embed"][tokens]
  new_cache = []
  for layer, (k_pages, v_pages) in zip(params["layers"], cache):
    q, k, v = _qkv(layer, x, positions)
    k_pages, v_pages = pallax.update_kv_cache(k_pages, v_pages, k, v, slots)
    attended = pallax.ragged_paged_attention(
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs
    )
    x = _finish_block(layer, x, attended)
    new_cache.append((k_pages, v_pages))
  return new_cache, _logits(params, x)


serving_step = jax.jit(step_fn, donate_argnums=(1,))  # the cache is donated: written in place


@dataclasses.dataclass
class Request:
  prompt: list[int]
  new_tokens: int
  arrival: int  # the step it joins at
  done: int = 0  # prompt tokens in the cache
  generated: list[int] = dataclasses.field(default_factory=list)
  logits: list = dataclasses.field(default_factory=list)  # the row each token was taken from
  pages: list[int] = dataclasses.field(default_factory=list)

  @property
  def cached(self) -> int:
    return self.done + max(0, len(self.generated) - 1)

  @property
  def finished(self) -> bool:
    return len(self.generated) == self.new_tokens


def serve(
  params, requests: list[Request], chunk: int = 16, seed: int = 0, step=serving_step
) -> list[list[int]]:
  """Runs ``requests`` to completion with continuous batching; each step's query lengths.

  ``step``: the jitted ``step_fn`` to run. The pools start as NaN: a key
  read that was never written would poison its logits.
  """
  pool = lambda: jnp.full((KV_HEADS, PAGES, PAGE_SIZE, HEAD), jnp.nan)
  cache = [(pool(), pool()) for _ in params["layers"]]  # distinct buffers: all are donated
  free = list(np.random.default_rng(seed).permutation(PAGES))
  steps = []
  while not all(r.finished for r in requests):
    running = [r for r in requests if r.arrival <= len(steps) and not r.finished][:MAX_SEQS]
    tokens, cu, kv_lens, table = [], [0], [], np.zeros((MAX_SEQS, PAGES), np.int32)
    for i, r in enumerate(running):
      new = r.prompt[r.done : r.done + chunk] if r.done < len(r.prompt) else r.generated[-1:]
      if len(tokens) + len(new) > TOKENS:
        break
      total = r.cached + len(new)
      while len(r.pages) * PAGE_SIZE < total:
        r.pages.append(int(free.pop()))
      tokens += new
      cu.append(len(tokens))
      kv_lens.append(total)
      table[i, : len(r.pages)] = r.pages
    count = len(kv_lens)
    cu += [len(tokens)] * (MAX_SEQS - count)
    kv_lens += [0] * (MAX_SEQS - count)
    cache, logits = step(
      params,
      cache,
      jnp.asarray(tokens + [0] * (TOKENS - len(tokens)), jnp.int32),
      jnp.asarray(kv_lens, jnp.int32),
      jnp.asarray(table),
      jnp.asarray(cu, jnp.int32),
      jnp.asarray([count], jnp.int32),
    )
    for i, r in enumerate(running[:count]):
      if r.done < len(r.prompt):
        r.done += cu[i + 1] - cu[i]
        if r.done < len(r.prompt):
          continue  # more of its prompt to go
      r.logits.append(np.asarray(logits[cu[i + 1] - 1]))
      r.generated.append(int(np.argmax(r.logits[-1])))
      if r.finished:  # its pages go back to the pool
        free += r.pages
        r.pages = []
    steps.append([cu[i + 1] - cu[i] for i in range(count)])
  return steps


def main() -> None:
  """Three requests, one joining at step 3, against each one run alone."""
  params = init_params()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (37, 21, 30)]
  requests = [Request(p, new_tokens=6, arrival=a) for p, a in zip(prompts, (0, 0, 3))]
  steps = serve(params, requests)
  print(f"{len(steps)} steps; query tokens of each sequence a step: {steps}")
  for i, r in enumerate(requests):
    alone, _ = generate_alone(params, r.prompt, r.new_tokens)
    print(f"request {i}: {r.generated} ({'equal' if r.generated == alone else 'NOT equal'} alone)")
    assert r.generated == alone


if __name__ == "__main__":
  main()
