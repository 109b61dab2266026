"""Autoregressive decoding: greedy, sampling and beam search.

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
# (state, beam_indices_BW) -> state whose rows follow the selected beams.
ReorderFn = Callable[[PyTree, jax.Array], PyTree]

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


def length_penalty(length: jax.Array | int, alpha: jax.Array | float) -> jax.Array:
  """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al., 2016).

  Beam search divides the log-probability of a finished hypothesis by this.

  Args:
    length: number of output tokens (EOS included), any integer shape.
    alpha: exponent; 0 disables length normalisation.

  Returns:
    float32 array with the shape of `length`.
  """
  length = jnp.asarray(length, jnp.float32)
  return ((5.0 + length) / 6.0) ** jnp.asarray(alpha, jnp.float32)


def expand_to_beams(tree: PyTree, beam_size: int) -> PyTree:
  """Repeats every row `beam_size` times: leaves [B, ...] -> [B * W, ...].

  Row b * W + w of the result is a copy of row b. Scalar (ndim 0) leaves are
  shared and returned unchanged.
  """

  def expand(x):
    x = jnp.asarray(x)
    return x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0)

  return jax.tree.map(expand, tree)


def gather_beams(x_BW: jax.Array, beam_indices_BJ: jax.Array) -> jax.Array:
  """Selects beams per sentence: x[B, W, ...], indices[B, J] -> [B, J, ...]."""
  batch_B1 = jnp.arange(x_BW.shape[0])[:, None]
  return x_BW[batch_B1, beam_indices_BJ]


def reorder_beam_rows(tree: PyTree, beam_indices_BW: jax.Array) -> PyTree:
  """Reorders the rows of a flat beam state after beams were selected.

  Args:
    tree: pytree whose ndim >= 1 leaves have leading dimension N = B * W (row
      b * W + w is beam w of sentence b). Scalar leaves are returned unchanged.
    beam_indices_BW: int[B, W]; new beam w of sentence b continues old beam
      `beam_indices_BW[b, w]` of the same sentence.

  Returns:
    The pytree with row b * W + w taken from row b * W + beam_indices_BW[b, w].
  """
  batch_size, beam_size = beam_indices_BW.shape
  rows_N = (jnp.arange(batch_size)[:, None] * beam_size + beam_indices_BW).reshape(-1)

  def gather(x):
    x = jnp.asarray(x)
    return x if x.ndim == 0 else jnp.take(x, rows_N, axis=0, mode='clip')

  return jax.tree.map(gather, tree)


def reorder_beam_prefix(
  caches: PyTree, beam_indices_BW: jax.Array, length: jax.Array, chunk: int = 16
) -> PyTree:
  """`reorder_beam_rows` of caches whose last axis is time, moving only positions < `length`.

  A self-attention cache [N, ..., T] holds the steps decoded so far at positions
  0 .. length - 1 and zeros after them (a step writes its own position before it reads
  any), so the rows of the written positions are all a reorder must move: the result
  equals `reorder_beam_rows(caches, beam_indices_BW)`. They move `chunk` positions at a
  time, in place, in a loop of ceil(length / chunk) iterations, so a step early in a
  long cache moves little; a whole-cache gather reads, writes and then copies every
  position into the loop's buffer (21% of a beam step at T = 32 on a CPU,
  docs/benchmarks.md). Caches whose T `chunk` does not divide move whole.

  Args:
    caches: pytree of arrays [N, ..., T], one T for all.
    beam_indices_BW: as in `reorder_beam_rows`.
    length: int32 scalar, the positions written (may be traced).
    chunk: static, positions moved per iteration (16: 8 cost more than they saved).
  """
  leaves, treedef = jax.tree.flatten(caches)
  if not leaves:
    return caches
  (num_positions,) = {x.shape[-1] for x in leaves}
  if num_positions % chunk:
    return reorder_beam_rows(caches, beam_indices_BW)
  batch_size, beam_size = beam_indices_BW.shape
  rows_N = (jnp.arange(batch_size)[:, None] * beam_size + beam_indices_BW).reshape(-1)

  def move_chunk(i, leaves):
    start = i * chunk
    moved = [
      jnp.take(lax.dynamic_slice_in_dim(x, start, chunk, axis=-1), rows_N, axis=0, mode='clip')
      for x in leaves
    ]
    return [
      lax.dynamic_update_slice_in_dim(x, part, start, axis=-1)
      for x, part in zip(leaves, moved, strict=True)
    ]

  num_chunks = jnp.minimum((length + chunk - 1) // chunk, num_positions // chunk)
  return jax.tree.unflatten(treedef, lax.fori_loop(0, num_chunks, move_chunk, leaves))


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


def _num_steps(max_steps: int | None, max_decode_len: int) -> int:
  """Validates `max_steps` (default `max_decode_len`)."""
  if max_decode_len < 1:
    raise ValueError(f'max_decode_len must be >= 1, got {max_decode_len}.')
  if max_steps is None:
    return max_decode_len
  if not 1 <= max_steps <= max_decode_len:
    raise ValueError(f'max_steps must be in [1, max_decode_len={max_decode_len}], got {max_steps}.')
  return max_steps


def _row_limits(max_lengths: jax.Array, batch_size: int, max_decode_len: int) -> jax.Array:
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
  num_steps = _num_steps(max_steps, max_decode_len)
  limits_B = _row_limits(max_lengths, batch_size, max_decode_len)

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
  tiny temperature cannot overflow). Step t uses `jax.random.fold_in(rng, t)`,
  so a fixed key gives reproducible samples. Length handling is as in
  `greedy_decode`.

  Args:
    logits_fn: step function (see module doc) over N = B rows.
    init_state: initial state, ndim >= 1 leaves with leading dimension B.
    rng: a typed key from `jax.random.key` (legacy uint32 keys are rejected).
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
  greedy_only = isinstance(temperature, (int, float)) and temperature <= 0

  def choose_fn(logits_BV, step):
    greedy_B = argmax_first(logits_BV)
    if greedy_only:
      return greedy_B
    positive = temperature > 0
    shifted_BV = logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)
    scaled_BV = shifted_BV / jnp.where(positive, temperature, 1.0)
    filtered_BV = filter_logits(scaled_BV, top_k=top_k, top_p=top_p)
    sampled_B = jax.random.categorical(jax.random.fold_in(rng, step), filtered_BV, axis=-1)
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


# ------------------------------------------------------------------------------
# Beam search.
# ------------------------------------------------------------------------------


def _top_k_over_beams(cand_BWV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the flattened [B, W * V] candidates, in two stages.

  First the best k of each beam (over V), then the best k of those W * k: the same
  values and flat indices, ties included (both stages prefer the lower index, and
  the second stage sees the beams in order), without one selection over W * V.
  """
  batch_size, beam_size, vocab_size = cand_BWV.shape
  if k > vocab_size:
    return lax.top_k(cand_BWV.reshape(batch_size, beam_size * vocab_size), k)
  beam_top_BWk, beam_token_BWk = lax.top_k(cand_BWV, k)
  top_BC, pick_BC = lax.top_k(beam_top_BWk.reshape(batch_size, beam_size * k), k)
  token_BC = jnp.take_along_axis(beam_token_BWk.reshape(batch_size, beam_size * k), pick_BC, axis=1)
  return top_BC, (pick_BC // k) * vocab_size + token_BC


class BeamState(NamedTuple):
  """The loop state of `beam_search` (B sentences, W beams, T output positions)."""

  step: jax.Array  # int32 scalar: output position chosen in this iteration.
  alive_seqs_BWT: jax.Array  # int32: alive hypotheses (no EOS yet), pad after `step`.
  alive_logp_BW: jax.Array  # float32: their log-probabilities, best first (-inf: empty).
  last_BW: jax.Array  # int32: the last token of each alive hypothesis (fed next).
  fin_seqs_BWT: jax.Array  # int32: finished hypotheses, best first.
  fin_scores_BW: jax.Array  # float32: their length-normalised scores (-inf: empty slot).
  done_B: jax.Array  # bool: sentence finished (its finished set is frozen).
  steps_B: jax.Array  # int32: steps decoded while the sentence was not done.
  model_state: PyTree  # The step function's state, rows b * W + w.


def beam_search(
  logits_fn: LogitsFn,
  init_state: PyTree,
  *,
  beam_size: int,
  alpha: jax.Array | float,
  max_decode_len: int,
  max_lengths: jax.Array,
  bos_id: int,
  eos_id: int,
  pad_id: int = 0,
  reorder_fn: ReorderFn | None = None,
  max_steps: int | None = None,
  num_results: int | None = None,
) -> Decoded:
  """Beam search with the GNMT length penalty and early stopping.

  Every sentence keeps W alive hypotheses (no EOS yet) and the W best finished
  ones. Per step, the W * V one-token extensions of the alive hypotheses are
  scored by log-probability and the best C = 2W candidates kept:
    * finished: candidates ranked among the best W that end here, by EOS or by
      reaching `max_lengths[b]`, enter the finished set with score
      `log_prob / length_penalty(length, alpha)` (the finished set keeps its
      best W). Admitting only the top W ranks, as fairseq does, means that
      beam_size 1 with alpha 0 is exactly greedy decoding.
    * alive: the best W candidates that do not end here become the new alive
      set, and the state rows are gathered to follow them.
  Finished hypotheses are never extended and their scores never change.

  Sentence b is done once it has reached `max_lengths[b]` or once no alive
  hypothesis can beat the R-th best of its finished ones (R = `num_results`, by
  default W; so it needs R finished): its best R are then final. Every
  future hypothesis extends an alive one, so its log-prob is at most the best
  alive log-prob (<= 0), and its length lies in (current, max_lengths[b]];
  hence its score is at most
  `best_alive_logp / max(lp(current + 1), lp(max_lengths[b]))`, as lp is
  monotone in the length. With alpha >= 0 that is the usual bound with the
  penalty at the maximum length; with alpha < 0 it uses the next length. The
  finished set of a done sentence is frozen and the loop ends when every
  sentence is done. A later hypothesis that ties a finished one ranks below it, so
  stopping early changes none of the best R: a caller that reads only the best
  hypothesis (R = 1) gets the one of the whole search, in fewer steps.

  Since reaching the limit finishes a hypothesis, every sentence that is done
  ends with finished hypotheses, so the usual "return the alive beams of a
  sentence that finished none" fallback never applies and is not needed. Slots left
  empty (fewer than W possible outputs with non-zero probability) have score
  -inf and all-pad tokens.

  Args:
    logits_fn: step function (see module doc) over N = B * W rows.
    init_state: initial state, ndim >= 1 leaves with leading dimension B; it
      is expanded to B * W rows here.
    beam_size: W (static).
    alpha: length-penalty exponent (paper: 0.6); may be traced.
    max_decode_len: static bound on the output length.
    max_lengths: int32[B], per-sentence maximum output length, EOS included;
      its shape gives B.
    bos_id: token fed on the first step.
    eos_id: end-of-sequence token.
    pad_id: token written after EOS.
    reorder_fn: `(state, beam_indices_BW) -> state`, how the step function's
      state follows the selected beams; default `reorder_beam_rows` (every
      row). A caller whose state holds leaves that are equal across the beams
      of a sentence (the encoder's keys and values) may leave those in place.
    max_steps: T, static, steps decoded (see module doc; default `max_decode_len`). A
      sentence not done within them has `done` False and its hypotheses are
      not final.
    num_results: R, static, in [1, W] (default W): the hypotheses returned per
      sentence, the best R of the search.

  Returns:
    `Decoded`: tokens int32[B, R, T] and scores float32[B, R] (length-normalised
    log-probabilities), best first; done bool[B].
  """
  max_lengths = jnp.asarray(max_lengths)
  (batch_size,) = max_lengths.shape
  num_rows = batch_size * beam_size
  num_steps = _num_steps(max_steps, max_decode_len)
  limits_B = _row_limits(max_lengths, batch_size, max_decode_len)
  max_penalty_B = length_penalty(limits_B, alpha)
  num_results = beam_size if num_results is None else num_results
  if not 1 <= num_results <= beam_size:
    raise ValueError(f'num_results must be in [1, beam_size={beam_size}], got {num_results}.')

  reorder_fn = reorder_beam_rows if reorder_fn is None else reorder_fn

  def cond_fn(carry: BeamState):
    return (carry.step < num_steps) & ~jnp.all(carry.done_B)

  def body_fn(carry: BeamState) -> BeamState:
    step = carry.step
    length = step + 1  # Output length of every candidate made in this step.

    logits_NV, model_state = logits_fn(carry.last_BW.reshape(num_rows, 1), carry.model_state)
    vocab_size = logits_NV.shape[-1]
    # Best C candidates per sentence; C = 2W leaves at least W without EOS.
    num_cands = min(2 * beam_size, beam_size * vocab_size)
    with jax.named_scope('choose'):  # Named for profiles (bench/decode_speed.py --profile).
      logp_BWV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1).reshape(
        batch_size, beam_size, vocab_size
      )
      cand_logp_BWV = carry.alive_logp_BW[:, :, None] + logp_BWV
      top_logp_BC, top_flat_BC = _top_k_over_beams(cand_logp_BWV, num_cands)
    top_beam_BC = top_flat_BC // vocab_size
    top_token_BC = (top_flat_BC % vocab_size).astype(jnp.int32)
    top_seqs_BCT = gather_beams(carry.alive_seqs_BWT, top_beam_BC).at[:, :, step].set(top_token_BC)
    at_limit_B = length >= limits_B
    ends_BC = (top_token_BC == eos_id) | at_limit_B[:, None]

    # Finished set: best W of the old finished and the admitted candidates.
    admitted_BC = ends_BC & (jnp.arange(num_cands) < beam_size)[None, :] & (top_logp_BC > NEG_INF)
    cand_scores_BC = jnp.where(admitted_BC, top_logp_BC / length_penalty(length, alpha), NEG_INF)
    merged_scores_BM = jnp.concatenate([carry.fin_scores_BW, cand_scores_BC], axis=1)
    merged_seqs_BMT = jnp.concatenate([carry.fin_seqs_BWT, top_seqs_BCT], axis=1)
    with jax.named_scope('finished'):
      new_fin_scores_BW, fin_pick_BW = lax.top_k(merged_scores_BM, beam_size)
      new_fin_seqs_BWT = gather_beams(merged_seqs_BMT, fin_pick_BW)
    # A done sentence's finished set is frozen.
    done_B = carry.done_B
    fin_scores_BW = jnp.where(done_B[:, None], carry.fin_scores_BW, new_fin_scores_BW)
    fin_seqs_BWT = jnp.where(done_B[:, None, None], carry.fin_seqs_BWT, new_fin_seqs_BWT)

    # Alive set: best W candidates that do not end here.
    alive_logp_BW, alive_pick_BW = lax.top_k(jnp.where(ends_BC, NEG_INF, top_logp_BC), beam_size)
    with jax.named_scope('reorder'):
      model_state = reorder_fn(model_state, gather_beams(top_beam_BC, alive_pick_BW))

    # Early stopping (see docstring); scores are sorted, so index 0 / -1.
    best_penalty_B = jnp.maximum(length_penalty(length + 1, alpha), max_penalty_B)
    best_reachable_B = alive_logp_BW[:, 0] / best_penalty_B
    return BeamState(
      step=step + 1,
      alive_seqs_BWT=gather_beams(top_seqs_BCT, alive_pick_BW),
      alive_logp_BW=alive_logp_BW,
      last_BW=gather_beams(top_token_BC, alive_pick_BW),
      fin_seqs_BWT=fin_seqs_BWT,
      fin_scores_BW=fin_scores_BW,
      done_B=done_B | at_limit_B | (fin_scores_BW[:, num_results - 1] >= best_reachable_B),
      steps_B=carry.steps_B + ~done_B,
      model_state=model_state,
    )

  seqs_BWT = jnp.full((batch_size, beam_size, num_steps), pad_id, jnp.int32)
  # All beams start identical; only beam 0 is live so the first step does not
  # produce W copies of every candidate.
  alive_logp_BW = jnp.where(jnp.arange(beam_size) == 0, 0.0, NEG_INF)
  init = BeamState(
    step=jnp.array(0, jnp.int32),
    alive_seqs_BWT=seqs_BWT,
    alive_logp_BW=jnp.broadcast_to(alive_logp_BW, (batch_size, beam_size)).astype(jnp.float32),
    last_BW=jnp.full((batch_size, beam_size), bos_id, jnp.int32),
    fin_seqs_BWT=seqs_BWT,
    fin_scores_BW=jnp.full((batch_size, beam_size), NEG_INF, jnp.float32),
    done_B=jnp.zeros((batch_size,), bool),
    steps_B=jnp.zeros((batch_size,), jnp.int32),
    model_state=expand_to_beams(init_state, beam_size),
  )
  final = lax.while_loop(cond_fn, body_fn, init)
  fin_seqs_BRT = final.fin_seqs_BWT[:, :num_results]
  fin_scores_BR = final.fin_scores_BW[:, :num_results]
  fin_seqs_BRT = jnp.where((fin_scores_BR > NEG_INF)[:, :, None], fin_seqs_BRT, pad_id)
  return Decoded(tokens=fin_seqs_BRT, scores=fin_scores_BR, done=final.done_B, steps=final.steps_B)
