"""Beam search over the decoders' step function (`decoding.py`), and its beam helpers.

The step-function contract, the output conventions, the length limits and the shape
vocabulary (B, W, N, V, T, C, M, R) are `decoding.py`'s. `beam_search` keeps W
hypotheses per sentence in rows b * W + w of the step function's state, which
`reorder_beam_rows` (or a caller's `reorder_fn`, e.g. one built on
`reorder_beam_prefix`) makes follow the beams chosen at each step.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from transformer import decoding

PyTree = Any
# (state, beam_indices_BW) -> state whose rows follow the selected beams.
ReorderFn = Callable[[PyTree, jax.Array], PyTree]


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
  logits_fn: decoding.LogitsFn,
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
) -> decoding.Decoded:
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
  num_steps = decoding.steps_to_decode(max_steps, max_decode_len)
  limits_B = decoding.row_limits(max_lengths, batch_size, max_decode_len)
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
    admitted_BC = (
      ends_BC & (jnp.arange(num_cands) < beam_size)[None, :] & (top_logp_BC > decoding.NEG_INF)
    )
    cand_scores_BC = jnp.where(
      admitted_BC, top_logp_BC / length_penalty(length, alpha), decoding.NEG_INF
    )
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
    alive_logp_BW, alive_pick_BW = lax.top_k(
      jnp.where(ends_BC, decoding.NEG_INF, top_logp_BC), beam_size
    )
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
  alive_logp_BW = jnp.where(jnp.arange(beam_size) == 0, 0.0, decoding.NEG_INF)
  init = BeamState(
    step=jnp.array(0, jnp.int32),
    alive_seqs_BWT=seqs_BWT,
    alive_logp_BW=jnp.broadcast_to(alive_logp_BW, (batch_size, beam_size)).astype(jnp.float32),
    last_BW=jnp.full((batch_size, beam_size), bos_id, jnp.int32),
    fin_seqs_BWT=seqs_BWT,
    fin_scores_BW=jnp.full((batch_size, beam_size), decoding.NEG_INF, jnp.float32),
    done_B=jnp.zeros((batch_size,), bool),
    steps_B=jnp.zeros((batch_size,), jnp.int32),
    model_state=expand_to_beams(init_state, beam_size),
  )
  final = lax.while_loop(cond_fn, body_fn, init)
  fin_seqs_BRT = final.fin_seqs_BWT[:, :num_results]
  fin_scores_BR = final.fin_scores_BW[:, :num_results]
  fin_seqs_BRT = jnp.where((fin_scores_BR > decoding.NEG_INF)[:, :, None], fin_seqs_BRT, pad_id)
  return decoding.Decoded(
    tokens=fin_seqs_BRT, scores=fin_scores_BR, done=final.done_B, steps=final.steps_B
  )
