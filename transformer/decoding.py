"""Autoregressive decoding: the decoders' contract, greedy decoding and sampling.

Beam search, on the same contract and shapes, is `beam_search.py`.

All decoders drive a model through one step function and run in a single
`lax.while_loop` with static shapes, so they can be traced inside `jax.jit`
(pass the step function by closure; `batch_size`, `beam_size`,
`max_decode_len` and `top_k` are static, everything else may be traced).

Shape vocabulary (suffixes on array names). B and V are the package's (batch,
vocabulary); K and L, its head dim and length, are not used here, so that the
beam and output letters cannot be read as them:
  B: batch size (source sentences).
  W: beam size (beam width, `beam_size`).
  N: rows given to the model per step: B for greedy decoding and sampling,
     B * W for beam search, where row b * W + w is beam w of sentence b.
  V: vocabulary size.
  T: the static number of output positions (time steps) decoded: `max_steps`,
     by default `max_decode_len`.
  C: candidates kept per sentence in one beam-search step (2 * W).
  M: finished hypotheses and candidates merged (W + C).
  R: hypotheses returned per sentence by beam search (`num_results`, <= W).

Step-function contract:
  `logits_fn(tokens_N1, state) -> (logits_NV, new_state)`. `tokens_N1` holds
  the last token of every row (BOS on the first call); each call advances the
  state by one position. `state` is any pytree: leaves with ndim >= 1 have
  leading dimension N (one row per hypothesis) and are expanded and reordered
  with the beams; leaves with ndim 0 are shared scalars (a cache index, a step
  counter) and are passed through untouched. Logits may be any float dtype;
  they are cast to float32.

Output conventions:
  Every decoder returns a `Decoded`. Tokens are int32 without BOS. A sequence
  ends with its EOS token and every later position holds `pad_id` (0).

Length limits (`max_lengths`, int32[B]):
  `max_lengths[b]`, clipped to [1, max_decode_len], is the largest number of
  output tokens for sentence b, EOS included. A hypothesis that reaches it
  without EOS is finished there: it is not extended, no EOS is written (its
  row simply stops after `max_lengths[b]` tokens) and nothing is added to its
  log-probability. In beam search such a truncated hypothesis competes with
  the EOS-terminated ones under the same length penalty.

Fewer steps than the limit (`max_steps`, static, default `max_decode_len`):
  the decoder runs at most `max_steps` steps and its token arrays are that long;
  the limits above are unchanged. A row (beam search: a sentence) that has not
  finished by then is returned with `done` False, and decoding it again with
  more steps gives the same first `max_steps` positions. Callers use it to
  decode in a short first pass, with a step function whose state (the
  self-attention cache) is sized to `max_steps`, and to decode again the rare
  rows that need more (`inference.TwoPass`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PyTree = Any
LogitsFn = Callable[[jax.Array, PyTree], tuple[jax.Array, PyTree]]

NEG_INF = float('-inf')


class Decoded(NamedTuple):
  """What a decoder returns (T = `max_steps`)."""

  tokens: jax.Array  # int32 [B, T] (greedy, sampling) or [B, R, T] (beam search, best first).
  scores: jax.Array | None  # Beam search: float32 [B, R], length-normalised log-probs.
  done: jax.Array  # bool [B]: the row finished within the T steps (always without max_steps).
  # int32 [B]: the steps the row was decoded until it was done (T where it was not); the loop
  # ran max(steps) steps, the rows of done ones along (bench/decode_speed.py --profile).
  steps: jax.Array | None = None


# ------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------


def filter_logits(
  logits: jax.Array, *, top_k: int = 0, top_p: jax.Array | float = 1.0
) -> jax.Array:
  """Masks to -inf every token outside the top-k set and the top-p nucleus.

  Tokens are ranked by logit (ties broken by lower token id). Top-k keeps the
  `top_k` highest ranked tokens; 0 (or >= V) disables it. Top-p (nucleus) then
  keeps the smallest highest-ranked set whose probability mass is >= `top_p`,
  with the mass measured on the distribution renormalised after top-k; the top
  token is always kept and `top_p >= 1` disables it. Both filters act on ranks,
  so exactly the stated number of tokens survives even with tied logits.

  Args:
    logits: float[..., V].
    top_k: static int.
    top_p: float in (0, 1]; may be a traced scalar.

  Returns:
    float[..., V]: `logits` with excluded tokens set to -inf.
  """
  vocab_size = logits.shape[-1]
  use_top_k = 0 < top_k < vocab_size
  use_top_p = not (isinstance(top_p, (int, float)) and top_p >= 1.0)
  if not (use_top_k or use_top_p):
    return logits

  order = jnp.argsort(-logits, axis=-1, stable=True)  # Token ids, best first.
  rank = jnp.argsort(order, axis=-1)  # Rank of every token id.
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  position = jnp.arange(vocab_size)
  keep_sorted = jnp.ones(sorted_logits.shape, dtype=bool)
  if use_top_k:
    keep_sorted = jnp.broadcast_to(position < top_k, sorted_logits.shape)
    sorted_logits = jnp.where(keep_sorted, sorted_logits, NEG_INF)
  if use_top_p:
    probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate(
      [jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], axis=-1
    )
    in_nucleus = (mass_before < top_p) | (position == 0) | (top_p >= 1.0)
    keep_sorted = keep_sorted & in_nucleus
  keep = jnp.take_along_axis(keep_sorted, rank, axis=-1)
  return jnp.where(keep, logits, NEG_INF)


def argmax_first(logits_BV: jax.Array) -> jax.Array:
  """`jnp.argmax(logits_BV, axis=-1)`: the first index of each row's maximum (or first NaN).

  On a CPU, computed as the row maximum and then the smallest index holding it: two
  plain reductions, which XLA:CPU vectorises, where `jnp.argmax`'s reduction of
  (value, index) pairs runs element by element (921 against 208 us over [32, 8,000]
  logits on one core, docs/benchmarks.md). Elsewhere `jnp.argmax` itself. A NaN is
  the maximum, as for `jnp.argmax`.
  """
  vocab_size = logits_BV.shape[-1]

  def two_reductions(logits_BV):
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)  # NaN where the row holds one.
    holds_max_BV = (logits_BV == max_B1) | jnp.isnan(logits_BV)
    # Indices as float32 (exact below 2**24) keep the reduction a vectorised float min.
    index_dtype = jnp.float32 if vocab_size < 2**24 else jnp.int32
    index_BV = lax.broadcasted_iota(index_dtype, logits_BV.shape, logits_BV.ndim - 1)
    return jnp.min(jnp.where(holds_max_BV, index_BV, vocab_size), axis=-1).astype(jnp.int32)

  return lax.platform_dependent(
    logits_BV,
    cpu=two_reductions,
    default=lambda logits_BV: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32),
  )


def row_keys(rng: jax.Array, row_ids_B) -> jax.Array:
  """One key per row, [B]: `jax.random.fold_in(rng, id)` for each of `row_ids_B` (int32 [B])."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.asarray(row_ids_B, jnp.int32))


def steps_to_decode(max_steps: int | None, max_decode_len: int) -> int:
  """Validates `max_steps` (default `max_decode_len`)."""
  if max_decode_len < 1:
    raise ValueError(f'max_decode_len must be >= 1, got {max_decode_len}.')
  if max_steps is None:
    return max_decode_len
  if not 1 <= max_steps <= max_decode_len:
    raise ValueError(f'max_steps must be in [1, max_decode_len={max_decode_len}], got {max_steps}.')
  return max_steps


def row_limits(max_lengths: jax.Array, batch_size: int, max_decode_len: int) -> jax.Array:
  """Validates `max_lengths` and clips it to [1, max_decode_len]."""
  max_lengths = jnp.asarray(max_lengths, jnp.int32)
  if max_lengths.shape != (batch_size,):
    raise ValueError(f'max_lengths must have shape ({batch_size},), got {max_lengths.shape}.')
  return jnp.clip(max_lengths, 1, max_decode_len)


# ------------------------------------------------------------------------------
# Greedy decoding and sampling.
# ------------------------------------------------------------------------------


def _decode_one_per_row(
  logits_fn: LogitsFn,
  init_state: PyTree,
  choose_fn: Callable[[jax.Array, jax.Array], jax.Array],
  *,
  batch_size: int,
  max_decode_len: int,
  max_lengths: jax.Array,
  bos_id: int,
  eos_id: int,
  pad_id: int,
  max_steps: int | None,
) -> Decoded:
  """Extends one hypothesis per row; `choose_fn(logits_BV, step) -> int[B]`."""
  num_steps = steps_to_decode(max_steps, max_decode_len)
  limits_B = row_limits(max_lengths, batch_size, max_decode_len)

  def cond_fn(carry):
    step, _, _, done_B, _, _ = carry
    return (step < num_steps) & ~jnp.all(done_B)

  def body_fn(carry):
    step, tokens_BT, last_B, done_B, steps_B, state = carry
    steps_B = steps_B + ~done_B
    logits_BV, state = logits_fn(last_B[:, None], state)
    next_B = choose_fn(logits_BV.astype(jnp.float32), step).astype(jnp.int32)
    next_B = jnp.where(done_B, pad_id, next_B)  # Finished rows only get padding.
    tokens_BT = tokens_BT.at[:, step].set(next_B)
    done_B = done_B | (next_B == eos_id) | (step + 1 >= limits_B)
    return step + 1, tokens_BT, next_B, done_B, steps_B, state

  init = (
    jnp.array(0, jnp.int32),
    jnp.full((batch_size, num_steps), pad_id, jnp.int32),
    jnp.full((batch_size,), bos_id, jnp.int32),
    jnp.zeros((batch_size,), bool),
    jnp.zeros((batch_size,), jnp.int32),
    init_state,
  )
  _, tokens_BT, _, done_B, steps_B, _ = lax.while_loop(cond_fn, body_fn, init)
  return Decoded(tokens=tokens_BT, scores=None, done=done_B, steps=steps_B)


def greedy_decode(
  logits_fn: LogitsFn,
  init_state: PyTree,
  *,
  batch_size: int,
  max_decode_len: int,
  max_lengths: jax.Array,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  max_steps: int | None = None,
) -> Decoded:
  """Decodes by taking the most likely token at every step.

  Row b stops after EOS or after `max_lengths[b]` tokens (see module doc); the
  loop stops when every row has stopped. Finished rows keep being fed `pad_id`
  until then, and their outputs are padded.

  Args:
    logits_fn: step function (see module doc) over N = B rows.
    init_state: initial state, ndim >= 1 leaves with leading dimension B.
    batch_size: B (static).
    max_decode_len: static bound on the output length.
    max_lengths: int32[B], per-row maximum output length, EOS included.
    bos_id: token fed on the first step.
    eos_id: end-of-sequence token.
    pad_id: token written after EOS.
    max_steps: T, static, steps decoded (see module doc; default `max_decode_len`).

  Returns:
    `Decoded`: tokens int32[B, T], done bool[B].
  """
  return _decode_one_per_row(
    logits_fn,
    init_state,
    lambda logits_BV, _: argmax_first(logits_BV),
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    max_lengths=max_lengths,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    max_steps=max_steps,
  )


def sample_decode(
  logits_fn: LogitsFn,
  init_state: PyTree,
  rng: jax.Array,
  *,
  batch_size: int,
  max_decode_len: int,
  max_lengths: jax.Array,
  bos_id: int,
  eos_id: int,
  temperature: jax.Array | float = 1.0,
  top_k: int = 0,
  top_p: jax.Array | float = 1.0,
  pad_id: int = 0,
  max_steps: int | None = None,
) -> Decoded:
  """Decodes by sampling with temperature, top-k and top-p (combinable).

  At every step the logits are divided by `temperature`, filtered with
  `filter_logits(top_k=..., top_p=...)` (so the nucleus is measured on the
  tempered distribution) and one token per row is sampled. A temperature <= 0
  decodes greedily; small positive temperatures approach greedy decoding
  continuously (the logits are shifted by their maximum before scaling, so a
  tiny temperature cannot overflow). Every row has its own key, and step t of
  row b samples with `jax.random.fold_in(key_b, t)`: a row's samples depend on
  its key and its logits alone, not on the other rows of the batch, so a row
  decoded in another batch (or again, with more steps: `max_steps`) with its key
  gets the same tokens. Length handling is as in `greedy_decode`.

  Args:
    logits_fn: step function (see module doc) over N = B rows.
    init_state: initial state, ndim >= 1 leaves with leading dimension B.
    rng: typed keys from `jax.random.key` (legacy uint32 keys are rejected): one per
      row, [B]; or one, whose `jax.random.fold_in(rng, b)` is row b's key.
    batch_size: B (static).
    max_decode_len: static bound on the output length.
    max_lengths: int32[B], per-row maximum output length, EOS included.
    bos_id: token fed on the first step.
    eos_id: end-of-sequence token.
    temperature: softmax temperature; may be traced.
    top_k: static; keep only the k most likely tokens (0: all).
    top_p: nucleus mass in (0, 1]; may be traced (1: all).
    pad_id: token written after EOS.
    max_steps: T, static, steps decoded (see module doc; default `max_decode_len`).

  Returns:
    `Decoded`: tokens int32[B, T], done bool[B].
  """
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    raise TypeError(
      'sample_decode expects a typed key from jax.random.key, got an array '
      f'of dtype {rng.dtype} (a legacy PRNGKey?).'
    )
  if rng.ndim == 0:
    rng = row_keys(rng, jnp.arange(batch_size))
  if rng.shape != (batch_size,):
    raise ValueError(f'rng must be one key or {batch_size} (one per row), got {rng.shape}.')
  greedy_only = isinstance(temperature, (int, float)) and temperature <= 0

  def choose_fn(logits_BV, step):
    greedy_B = argmax_first(logits_BV)
    if greedy_only:
      return greedy_B
    positive = temperature > 0
    shifted_BV = logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)
    scaled_BV = shifted_BV / jnp.where(positive, temperature, 1.0)
    filtered_BV = filter_logits(scaled_BV, top_k=top_k, top_p=top_p)

    def sample_row(key, logits_V):
      return jax.random.categorical(jax.random.fold_in(key, step), logits_V)

    sampled_B = jax.vmap(sample_row)(rng, filtered_BV)
    return jnp.where(positive, sampled_B, greedy_B)

  return _decode_one_per_row(
    logits_fn,
    init_state,
    choose_fn,
    batch_size=batch_size,
    max_decode_len=max_decode_len,
    max_lengths=max_lengths,
    bos_id=bos_id,
    eos_id=eos_id,
    pad_id=pad_id,
    max_steps=max_steps,
  )
