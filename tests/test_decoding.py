"""Greedy decoding, sampling and beam search against toy models and oracles.

The toy model ("hashed Markov model") keeps in its state the history of the
tokens it was fed, a per-sentence source id, and a shared scalar step counter.
Its logits are a fixed random table indexed by (step, hash(source, history)),
so they depend on the whole prefix: if a decoder fed the wrong token or did not
reorder the state with the beams, the scores it reports would no longer match
the numpy oracle below, which rescores sequences by replaying the same model.
The step counter is a scalar leaf used as an index, so it must pass through
beam expansion and reordering untouched.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import beam_search, decoding

PAD, EOS, BOS = 0, 1, 2
NUM_BUCKETS = 97  # Hash buckets of the toy model's prefix code.
HASH_WEIGHTS = np.random.default_rng(1234).integers(1, NUM_BUCKETS, size=32).astype(np.int32)


# ------------------------------------------------------------------------------
# Toy model and numpy oracle.
# ------------------------------------------------------------------------------


def make_table(seed, num_steps, vocab_size, *, eos_bias=0.0, scale=2.0):
  """Random logits float32[num_steps, NUM_BUCKETS, V]; PAD is never emitted."""
  table = np.random.default_rng(seed).normal(size=(num_steps, NUM_BUCKETS, vocab_size)) * scale
  table[..., PAD] = -np.inf
  table[..., EOS] += eos_bias
  return table.astype(np.float32)


def toy_state(source_B, max_decode_len):
  return {
    'step': jnp.array(0, jnp.int32),  # Shared scalar leaf.
    'source': jnp.asarray(source_B, jnp.int32),  # int32[B]
    'history': jnp.full((len(source_B), max_decode_len), -1, jnp.int32),  # Tokens fed.
  }


def toy_logits_fn(table):
  weights = jnp.asarray(HASH_WEIGHTS)

  def logits_fn(tokens_N1, state):
    step = state['step']
    assert step.ndim == 0  # The scalar leaf was passed through untouched.
    history_NH = state['history'].at[:, step].set(tokens_N1[:, 0])
    width = history_NH.shape[1]
    code_N = (state['source'] + jnp.sum((history_NH + 1) * weights[:width], axis=1)) % NUM_BUCKETS
    logits_NV = jnp.asarray(table)[step, code_N]
    return logits_NV, {'step': step + 1, 'source': state['source'], 'history': history_NH}

  return logits_fn


def oracle_log_probs(table, source, fed):
  """log softmax of the toy model's logits after being fed `fed` (BOS first)."""
  fed = np.asarray(fed)
  code = (source + np.sum((fed + 1) * HASH_WEIGHTS[: len(fed)])) % NUM_BUCKETS
  logits = table[len(fed) - 1, code].astype(np.float64)
  finite = logits[np.isfinite(logits)]
  return logits - (finite.max() + np.log(np.sum(np.exp(finite - finite.max()))))


def oracle_log_prob(table, source, seq):
  """Log-probability of an output sequence (no BOS, no padding)."""
  fed = [BOS]
  total = 0.0
  for token in seq:
    total += oracle_log_probs(table, source, fed)[token]
    fed.append(token)
  return total


def oracle_greedy(table, source, limit):
  seq = []
  while len(seq) < limit and (not seq or seq[-1] != EOS):
    seq.append(int(np.argmax(oracle_log_probs(table, source, [BOS, *seq]))))
  return seq


def penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def exhaustive_ranking(table, source, limit, alpha):
  """All complete outputs up to `limit` tokens with their scores, best first.

  Complete: ends with EOS, or has exactly `limit` tokens (truncated).
  """
  vocab = table.shape[-1]
  non_eos = [t for t in range(vocab) if t not in (PAD, EOS)]
  ranked = []
  for length in range(1, limit + 1):
    for prefix in itertools.product(non_eos, repeat=length - 1):
      endings = [EOS] + (non_eos if length == limit else [])
      for last in endings:
        seq = (*prefix, last)
        ranked.append((oracle_log_prob(table, source, seq) / penalty(length, alpha), seq))
  ranked.sort(key=lambda item: -item[0])
  return ranked


def strip(row):
  """Output row -> list of tokens before padding."""
  row = list(np.asarray(row))
  return row[: len(row) - next((i for i, t in enumerate(row[::-1]) if t != PAD), len(row))]


def assert_well_formed(row, limit):
  """At most `limit` tokens; EOS only last; only padding after; no inner pads."""
  seq = strip(row)
  assert 1 <= len(seq) <= limit
  assert PAD not in seq
  assert EOS not in seq[:-1]
  if seq[-1] != EOS:
    assert len(seq) == limit  # Truncated exactly at the row's limit.
  return seq


# ------------------------------------------------------------------------------
# Jitted runners (small, shared compiles).
# ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=('max_decode_len', 'max_steps'))
def decode_greedy(table, source_B, max_lengths_B, *, max_decode_len, max_steps=None):
  return decoding.greedy_decode(
    toy_logits_fn(table),
    toy_state(source_B, max_decode_len),
    batch_size=source_B.shape[0],
    max_decode_len=max_decode_len,
    max_lengths=max_lengths_B,
    bos_id=BOS,
    eos_id=EOS,
    max_steps=max_steps,
  )


def run_greedy(table, source_B, max_lengths_B, *, max_decode_len):
  return decode_greedy(table, source_B, max_lengths_B, max_decode_len=max_decode_len).tokens


@functools.partial(jax.jit, static_argnames=('max_decode_len', 'top_k'))
def run_sample(table, source_B, max_lengths_B, rng, temperature, top_p, *, max_decode_len, top_k=0):
  return decoding.sample_decode(
    toy_logits_fn(table),
    toy_state(source_B, max_decode_len),
    rng,
    batch_size=source_B.shape[0],
    max_decode_len=max_decode_len,
    max_lengths=max_lengths_B,
    bos_id=BOS,
    eos_id=EOS,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
  ).tokens


@functools.partial(
  jax.jit, static_argnames=('beam_size', 'max_decode_len', 'max_steps', 'num_results')
)
def decode_beam(
  table,
  source_B,
  max_lengths_B,
  alpha,
  *,
  beam_size,
  max_decode_len,
  max_steps=None,
  num_results=None,
):
  return beam_search.beam_search(
    toy_logits_fn(table),
    toy_state(source_B, max_decode_len),
    beam_size=beam_size,
    alpha=alpha,
    max_decode_len=max_decode_len,
    max_lengths=max_lengths_B,
    bos_id=BOS,
    eos_id=EOS,
    max_steps=max_steps,
    num_results=num_results,
  )


def run_beam(table, source_B, max_lengths_B, alpha, *, beam_size, max_decode_len):
  """(tokens, scores) of the finished beams."""
  out = decode_beam(
    table, source_B, max_lengths_B, alpha, beam_size=beam_size, max_decode_len=max_decode_len
  )
  return out.tokens, out.scores


# Shared setting for the greedy / beam-1 / sampling tests: 8 sentences, V = 6, L = 8.
L8 = 8
TABLE8 = make_table(0, L8, 6, eos_bias=0.5)
SOURCE8 = np.arange(8, dtype=np.int32) * 11
LIMITS8 = np.array([8, 8, 3, 5, 8, 1, 8, 6], np.int32)


# ------------------------------------------------------------------------------
# Helpers.
# ------------------------------------------------------------------------------


def test_length_penalty():
  np.testing.assert_allclose(beam_search.length_penalty(1, 0.6), 1.0)
  np.testing.assert_allclose(beam_search.length_penalty(np.array([7, 13]), 1.0), [2.0, 3.0])
  np.testing.assert_allclose(beam_search.length_penalty(4, 0.0), 1.0)


def test_expand_and_reorder_beam_rows_keep_scalars():
  state = {'index': jnp.array(5), 'rows': jnp.arange(2 * 3).reshape(2, 3)}
  expanded = beam_search.expand_to_beams(state, 3)
  assert expanded['index'].shape == () and int(expanded['index']) == 5
  np.testing.assert_array_equal(expanded['rows'][:, 0], [0, 0, 0, 3, 3, 3])
  # Make rows distinguishable, then let sentence 0 keep beams (2, 2, 0), sentence 1 (1, 0, 2).
  expanded = {'index': expanded['index'], 'rows': jnp.arange(6)}
  reordered = beam_search.reorder_beam_rows(expanded, jnp.array([[2, 2, 0], [1, 0, 2]]))
  np.testing.assert_array_equal(reordered['rows'], [2, 2, 0, 4, 3, 5])
  assert reordered['index'].shape == () and int(reordered['index']) == 5


@pytest.mark.parametrize('num_positions', [32, 20])
def test_reordering_the_written_prefix_of_caches_equals_reordering_them_whole(num_positions):
  rng = np.random.default_rng(0)
  beam_indices_BW = rng.integers(0, 3, size=(2, 3)).astype(np.int32)
  reorder = jax.jit(beam_search.reorder_beam_prefix)
  for length in (0, 1, 15, 16, 17, num_positions):
    # Positions not yet written hold zeros, as in a decoding cache.
    written = np.arange(num_positions) < length
    caches = {
      'key': rng.normal(size=(6, 2, 3, num_positions)).astype(np.float32) * written,
      'value': rng.normal(size=(6, 4, num_positions)).astype(np.float32) * written,
    }
    got = reorder(caches, beam_indices_BW, jnp.int32(length))
    expected = beam_search.reorder_beam_rows(caches, beam_indices_BW)
    jax.tree.map(np.testing.assert_array_equal, got, expected)


def test_gather_beams():
  x_BK2 = jnp.arange(2 * 3 * 2).reshape(2, 3, 2)
  out = beam_search.gather_beams(x_BK2, jnp.array([[2, 0], [1, 1]]))
  np.testing.assert_array_equal(out, [[[4, 5], [0, 1]], [[8, 9], [8, 9]]])


def _kept(filtered):
  return set(np.flatnonzero(np.isfinite(np.asarray(filtered))).tolist())


def test_filter_logits_top_k():
  logits = jnp.array([1.0, 3.0, 2.0, 0.0, -1.0])
  assert _kept(decoding.filter_logits(logits, top_k=2)) == {1, 2}
  np.testing.assert_array_equal(decoding.filter_logits(logits, top_k=2)[1:3], [3.0, 2.0])
  # Ties are ranked by token id: exactly k survive.
  assert _kept(decoding.filter_logits(jnp.array([1.0, 1.0, 1.0, 0.0]), top_k=2)) == {0, 1}
  # Disabled: 0 or >= V.
  np.testing.assert_array_equal(decoding.filter_logits(logits, top_k=0), logits)
  np.testing.assert_array_equal(decoding.filter_logits(logits, top_k=9), logits)


def test_filter_logits_top_p_smallest_set_with_mass_at_least_p():
  probs = np.array([0.05, 0.5, 0.15, 0.3])  # Ranked: 1 (.5), 3 (.3), 2 (.15), 0 (.05).
  logits = jnp.log(jnp.asarray(probs, jnp.float32))
  assert _kept(decoding.filter_logits(logits, top_p=0.4)) == {1}
  assert _kept(decoding.filter_logits(logits, top_p=0.75)) == {1, 3}
  assert _kept(decoding.filter_logits(logits, top_p=0.82)) == {1, 3, 2}
  assert _kept(decoding.filter_logits(logits, top_p=0.96)) == {0, 1, 2, 3}
  assert _kept(decoding.filter_logits(logits, top_p=1e-6)) == {1}  # The top token always.
  assert _kept(decoding.filter_logits(logits, top_p=1.0)) == {0, 1, 2, 3}
  # Top-p is measured after top-k renormalises: over {1, 3, 2} the mass before
  # token 2 is .8 / .95 = .84 >= .82, so it drops out.
  assert _kept(decoding.filter_logits(logits, top_k=3, top_p=0.82)) == {1, 3}
  # Traced top_p and batch dimensions.
  batch = jnp.stack([logits, logits[::-1]])[None]  # [1, 2, 4]
  out = jax.jit(lambda x, p: decoding.filter_logits(x, top_p=p))(batch, 0.75)
  assert _kept(out[0, 0]) == {1, 3} and _kept(out[0, 1]) == {0, 2}


# ------------------------------------------------------------------------------
# Greedy decoding.
# ------------------------------------------------------------------------------


def test_greedy_matches_oracle_and_respects_max_lengths():
  tokens = np.asarray(run_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8))
  assert tokens.shape == (8, L8) and tokens.dtype == np.int32
  kinds = set()
  for b in range(8):
    seq = assert_well_formed(tokens[b], LIMITS8[b])
    assert seq == oracle_greedy(TABLE8, SOURCE8[b], LIMITS8[b])
    kinds.add('eos' if seq[-1] == EOS else 'truncated')
  assert kinds == {'eos', 'truncated'}  # The setting exercises both endings.


# ------------------------------------------------------------------------------
# Beam search.
# ------------------------------------------------------------------------------


def test_beam_size_one_equals_greedy():
  greedy = np.asarray(run_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8))
  tokens, scores = run_beam(TABLE8, SOURCE8, LIMITS8, 0.0, beam_size=1, max_decode_len=L8)
  assert tokens.shape == (8, 1, L8) and scores.shape == (8, 1)
  np.testing.assert_array_equal(tokens[:, 0], greedy)
  expected = [oracle_log_prob(TABLE8, s, strip(g)) for s, g in zip(SOURCE8, greedy, strict=True)]
  np.testing.assert_allclose(scores[:, 0], expected, rtol=1e-5)


@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0, -0.5])
def test_wide_beam_matches_exhaustive_search(alpha):
  # V = 4 with PAD impossible: tokens {EOS, 2, 3}. With L = 4 there are at most
  # 2^3 alive prefixes and 24 finite candidates per step, so K = 24 keeps every
  # hypothesis and the finished set must be the exact top K of all outputs.
  table = make_table(7, 4, 4)
  source = np.array([3, 5, 8, 13], np.int32)
  limits = np.array([4, 2, 1, 3], np.int32)
  beam_size = 24
  tokens, scores = run_beam(table, source, limits, alpha, beam_size=beam_size, max_decode_len=4)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  for b in range(4):
    ranked = exhaustive_ranking(table, source[b], limits[b], alpha)[:beam_size]
    found = len(ranked)
    assert tokens[b, 0].tolist()[: len(ranked[0][1])] == list(ranked[0][1])
    np.testing.assert_allclose(scores[b, :found], [s for s, _ in ranked], rtol=1e-5)
    assert np.all(scores[b, :-1] >= scores[b, 1:])  # Best first.
    # Slots without a hypothesis: -inf and padding.
    assert np.all(scores[b, found:] == -np.inf) and np.all(tokens[b, found:] == PAD)
    # Every returned hypothesis is well formed, distinct, and rescores to its score.
    seqs = [tuple(assert_well_formed(row, limits[b])) for row in tokens[b, :found]]
    assert set(seqs) == {seq for _, seq in ranked}
    rescored = [oracle_log_prob(table, source[b], s) / penalty(len(s), alpha) for s in seqs]
    np.testing.assert_allclose(scores[b, :found], rescored, rtol=1e-5)


def test_beam_hypotheses_are_finished_once_and_rescore_exactly():
  # Narrow beam, long outputs, likely EOS: finished hypotheses must never be
  # extended (padding after EOS) and keep the score they had when they ended.
  table = make_table(3, 12, 6, eos_bias=1.0)
  source = np.arange(6, dtype=np.int32) * 7
  limits = np.array([12, 12, 4, 9, 2, 12], np.int32)
  alpha = 0.6
  tokens, scores = run_beam(table, source, limits, alpha, beam_size=4, max_decode_len=12)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  assert tokens.shape == (6, 4, 12) and tokens.dtype == np.int32 and scores.dtype == np.float32
  assert np.all(np.isfinite(scores))
  lengths = set()
  for b in range(6):
    assert np.all(scores[b, :-1] >= scores[b, 1:])
    seqs = [tuple(assert_well_formed(row, limits[b])) for row in tokens[b]]
    assert len(set(seqs)) == 4
    lengths.update(len(s) for s in seqs)
    rescored = [oracle_log_prob(table, source[b], s) / penalty(len(s), alpha) for s in seqs]
    np.testing.assert_allclose(scores[b], rescored, rtol=1e-5)
    # The beam result is at least as good as greedy under the same scoring.
    greedy = oracle_greedy(table, source[b], limits[b])
    greedy_score = oracle_log_prob(table, source[b], greedy) / penalty(len(greedy), alpha)
    assert scores[b, 0] >= greedy_score - 1e-5
  assert len(lengths) > 3  # Hypotheses of many lengths were compared.


@pytest.mark.parametrize(
  'alpha, eos_probs',
  [
    # alpha > 0: after step 1 the finished set is full and the alive "2 2"
    # divided by lp(3) cannot beat it, but "2 2 2 2 2 2 2 2" (truncated at
    # 8) divided by lp(8) can: a bound using the next length stops too soon.
    (2.0, [0.5, 0.9] + [0.001] * 6),
    # alpha < 0: lp shrinks with length, so the best reachable score is at
    # the next length; "2 2 EOS" enters the top 2, which a bound using
    # lp(max length) would have cut off.
    (-1.0, [0.5, 0.3] + [0.999] * 6),
  ],
)
def test_early_stopping_bound_is_exact_for_both_signs_of_alpha(alpha, eos_probs):
  # V = 3 with PAD impossible: one non-EOS token, so K = 2 admits every
  # candidate and only the early-stopping bound can lose a hypothesis.
  eos_probs = np.array(eos_probs)
  with np.errstate(divide='ignore'):
    base = np.log(np.stack([np.zeros_like(eos_probs), eos_probs, 1 - eos_probs], axis=1))
  table = step_only_table(base)
  tokens, scores = run_beam(
    table, np.array([0], np.int32), np.array([8], np.int32), alpha, beam_size=2, max_decode_len=8
  )
  ranked = exhaustive_ranking(table, 0, 8, alpha)[:2]
  assert [tuple(strip(row)) for row in np.asarray(tokens[0])] == [seq for _, seq in ranked]
  np.testing.assert_allclose(scores[0], [score for score, _ in ranked], rtol=1e-5)
  assert len(ranked[1][1]) > 2  # The runner-up is only found by continuing.


def test_beam_search_stops_early():
  # EOS is by far the most likely token everywhere: after a few steps no alive
  # hypothesis can beat the finished ones, so the loop must stop long before
  # max_decode_len (the model counts its calls through a debug callback).
  max_decode_len = 20
  table = make_table(5, max_decode_len, 5, eos_bias=12.0, scale=0.5)
  source = np.array([1, 2], np.int32)
  limits = np.array([max_decode_len, max_decode_len], np.int32)
  calls = []

  @jax.jit
  def run(table):
    inner = toy_logits_fn(table)

    def counting_logits_fn(tokens_N1, state):
      jax.debug.callback(lambda step: calls.append(int(step)), state['step'])
      return inner(tokens_N1, state)

    return beam_search.beam_search(
      counting_logits_fn,
      toy_state(source, max_decode_len),
      beam_size=2,
      alpha=0.6,
      max_decode_len=max_decode_len,
      max_lengths=limits,
      bos_id=BOS,
      eos_id=EOS,
    )

  out = jax.block_until_ready(run(table))
  tokens, scores, done = out.tokens, out.scores, out.done
  assert done.all()
  assert 2 <= len(calls) <= 4, calls
  np.testing.assert_array_equal(tokens[:, 0, :2], [[EOS, PAD], [EOS, PAD]])
  for b in range(2):
    np.testing.assert_allclose(scores[b, 0], oracle_log_prob(table, source[b], [EOS]), atol=1e-6)


@pytest.mark.parametrize('alpha', [0.0, 0.6, -0.5])
def test_the_best_results_of_a_search_stopped_for_them_are_the_full_searchs(alpha):
  # A search returning only its best R stops once no alive hypothesis can beat the R-th
  # finished one: the same best R (tokens, scores, order), in fewer steps where the W-th
  # is still open.
  table = make_table(3, 12, 6, eos_bias=1.0)
  source = np.arange(6, dtype=np.int32) * 7
  limits = np.array([12, 12, 4, 9, 2, 12], np.int32)
  run = functools.partial(decode_beam, table, source, limits, alpha, beam_size=4, max_decode_len=12)
  full = run()
  assert np.asarray(full.done).all()
  fewer_steps = []
  for num_results in (1, 2):
    out = run(num_results=num_results)
    assert out.tokens.shape == (6, num_results, 12) and out.scores.shape == (6, num_results)
    np.testing.assert_array_equal(out.tokens, full.tokens[:, :num_results])
    np.testing.assert_array_equal(out.scores, full.scores[:, :num_results])
    assert np.asarray(out.done).all() and np.all(out.steps <= full.steps)
    fewer_steps.append(int((out.steps < full.steps).sum()))
  assert fewer_steps[0] >= fewer_steps[1] and fewer_steps[0] > 0, fewer_steps
  with pytest.raises(ValueError, match='num_results'):
    run(num_results=5)


def test_argmax_first_is_jnp_argmax():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(8, 300)).astype(np.float32)
  logits[1, [5, 40, 299]] = 9.0  # Ties: the first.
  logits[2] = -np.inf  # All -inf: 0.
  logits[3, [7, 100]] = np.nan  # NaN: the first NaN, as jnp.argmax.
  logits[4, 250] = np.inf
  logits[5] = np.round(logits[5])  # Many ties.
  logits[6, -1] = 50.0
  got = jax.jit(decoding.argmax_first)(logits)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(logits), axis=-1))
  np.testing.assert_array_equal(got[:5], [np.argmax(logits[0]), 5, 0, 7, 250])


# ------------------------------------------------------------------------------
# Fewer steps than the length limit (a first pass).
# ------------------------------------------------------------------------------


def test_greedy_in_fewer_steps_is_the_start_of_the_full_decode():
  full = np.asarray(run_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8))
  partly = set()
  for steps in (1, 3, 5, 8):
    out = decode_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8, max_steps=steps)
    tokens, done = np.asarray(out.tokens), np.asarray(out.done)
    assert tokens.shape == (8, steps)
    np.testing.assert_array_equal(tokens, full[:, :steps])
    ended = [EOS in full[b, :steps] or LIMITS8[b] <= steps for b in range(8)]
    np.testing.assert_array_equal(done, ended)
    # A row's steps: its tokens up to EOS or its limit, where it ended; all `steps` where not.
    needed = [list(full[b]).index(EOS) + 1 if EOS in full[b] else LIMITS8[b] for b in range(8)]
    np.testing.assert_array_equal(out.steps, np.where(done, np.minimum(needed, LIMITS8), steps))
    partly.add(0 < done.sum() < 8)
  assert partly == {True, False} and done.all()  # Some passes leave rows unfinished; 8 steps none.


def test_beam_sentences_done_in_fewer_steps_have_their_full_results():
  table = make_table(3, 12, 6, eos_bias=1.0)
  source = np.arange(6, dtype=np.int32) * 7
  limits = np.array([12, 12, 4, 9, 2, 12], np.int32)
  run = functools.partial(decode_beam, table, source, limits, 0.6, beam_size=4, max_decode_len=12)
  full = run()
  assert np.asarray(full.done).all()
  counts, done_before = [], np.zeros(6, bool)
  for steps in (2, 4, 6, 9, 12):
    out = run(max_steps=steps)
    tokens, scores, done = (np.asarray(x) for x in (out.tokens, out.scores, out.done))
    decoded = np.asarray(out.steps)
    assert tokens.shape == (6, 4, steps)
    assert np.all(done >= done_before)  # A sentence done in k steps is done in more.
    # Steps decoded: a sentence's own count where it is done (that of the full run), all of
    # them where it is not.
    np.testing.assert_array_equal(decoded[done], np.asarray(full.steps)[done])
    assert np.all(decoded[done] <= steps) and np.all(decoded[~done] == steps)
    for b in np.flatnonzero(done):
      np.testing.assert_array_equal(tokens[b], full.tokens[b, :, :steps])
      assert not np.asarray(full.tokens[b, :, steps:]).any()
      np.testing.assert_array_equal(scores[b], full.scores[b])
    counts.append(int(done.sum()))
    done_before = done
  assert counts[-1] == 6 and len(set(counts)) > 2, counts


def test_max_steps_out_of_range_is_rejected():
  with pytest.raises(ValueError, match='max_steps'):
    decode_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8, max_steps=L8 + 1)


# ------------------------------------------------------------------------------
# Sampling.
# ------------------------------------------------------------------------------


def step_only_table(base_SV):
  """A toy table whose logits depend on the step only, not on the prefix."""
  base_SV = np.asarray(base_SV, np.float32)
  return np.repeat(base_SV[:, None, :], NUM_BUCKETS, axis=1)


def softmax(x):
  e = np.exp(x - np.max(x))
  return e / e.sum()


def test_top_k_samples_only_the_k_most_likely():
  num_rows, steps, top_k = 2048, 2, 3
  base = np.random.default_rng(11).normal(size=(steps, 8)) * 1.5
  base[:, [PAD, EOS]] = -np.inf  # No row ends early: every position is a sample.
  tokens = run_sample(
    step_only_table(base),
    np.zeros(num_rows, np.int32),
    np.full(num_rows, steps, np.int32),
    jax.random.key(0),
    1.0,
    1.0,
    max_decode_len=steps,
    top_k=top_k,
  )
  tokens = np.asarray(tokens)
  for step in range(steps):
    allowed = np.argsort(-base[step])[:top_k]
    assert set(np.unique(tokens[:, step])) == set(allowed)
    expected = softmax(base[step][allowed])
    freq = np.array([np.mean(tokens[:, step] == t) for t in allowed])
    np.testing.assert_allclose(freq, expected, atol=0.04)


def test_top_p_samples_only_the_nucleus():
  num_rows = 2048
  probs = np.array([0.0, 0.0, 0.5, 0.3, 0.15, 0.05])  # PAD and EOS impossible.
  with np.errstate(divide='ignore'):
    table = step_only_table(np.log(probs)[None])
  source = np.zeros(num_rows, np.int32)
  limits = np.ones(num_rows, np.int32)
  for top_p, nucleus in [(0.75, [2, 3]), (0.85, [2, 3, 4]), (1.0, [2, 3, 4, 5])]:
    tokens = np.asarray(
      run_sample(table, source, limits, jax.random.key(1), 1.0, top_p, max_decode_len=1)
    )[:, 0]
    assert set(np.unique(tokens)) == set(nucleus), top_p
    freq = np.array([np.mean(tokens == t) for t in nucleus])
    np.testing.assert_allclose(freq, probs[nucleus] / probs[nucleus].sum(), atol=0.04)


@pytest.mark.parametrize('temperature', [0.0, 1e-6, -1.0])
def test_temperature_to_zero_is_greedy(temperature):
  greedy = run_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8)
  sampled = run_sample(
    TABLE8, SOURCE8, LIMITS8, jax.random.key(2), temperature, 1.0, max_decode_len=L8
  )
  np.testing.assert_array_equal(sampled, greedy)


def test_static_zero_temperature_is_greedy():
  greedy = run_greedy(TABLE8, SOURCE8, LIMITS8, max_decode_len=L8)
  sampled = decoding.sample_decode(
    toy_logits_fn(TABLE8),
    toy_state(SOURCE8, L8),
    jax.random.key(3),
    batch_size=8,
    max_decode_len=L8,
    max_lengths=LIMITS8,
    bos_id=BOS,
    eos_id=EOS,
    temperature=0.0,
  ).tokens
  np.testing.assert_array_equal(sampled, greedy)


def test_sampling_is_reproducible_per_key_and_well_formed():
  table = make_table(4, L8, 6, scale=0.5)  # Flat-ish: samples vary a lot.
  source = np.arange(16, dtype=np.int32)
  limits = np.full(16, L8, np.int32)
  sample = functools.partial(
    run_sample, table, source, limits, temperature=1.0, top_p=1.0, max_decode_len=L8
  )
  first, again, other = (np.asarray(sample(rng=jax.random.key(s))) for s in (7, 7, 8))
  np.testing.assert_array_equal(first, again)
  assert np.mean(first != other) > 0.3
  for row in np.concatenate([first, other]):
    assert_well_formed(row, L8)


def test_a_sampled_row_depends_on_its_own_key_alone():
  # Row b of a batch, sampled with key k_b, is what the row sampled alone (or in any other
  # batch) with k_b gives; one key k stands for the keys fold_in(k, b).
  table = make_table(4, L8, 6, scale=0.5)
  source, limits = np.arange(16, dtype=np.int32), np.full(16, L8, np.int32)
  sample = functools.partial(run_sample, table, temperature=1.0, top_p=1.0, max_decode_len=L8)
  keys = decoding.row_keys(jax.random.key(9), np.arange(16))
  batch = np.asarray(sample(source, limits, keys))
  np.testing.assert_array_equal(np.asarray(sample(source, limits, jax.random.key(9))), batch)
  order = np.random.default_rng(0).permutation(16)
  shuffled = np.asarray(sample(source[order], limits[order], keys[order]))
  np.testing.assert_array_equal(shuffled, batch[order])
  for b in (0, 5, 11):
    alone = sample(source[b : b + 1], limits[b : b + 1], keys[b : b + 1])
    np.testing.assert_array_equal(np.asarray(alone)[0], batch[b])
  assert len({tuple(row) for row in batch}) > 8  # The rows' keys differ: so do their samples.
  with pytest.raises(ValueError, match=r'rng must be one key or 16 \(one per row\)'):
    sample(source, limits, keys[:3])


def test_sampling_rejects_legacy_keys():
  with pytest.raises(TypeError, match='jax.random.key'):
    decoding.sample_decode(
      toy_logits_fn(TABLE8),
      toy_state(SOURCE8, L8),
      jax.random.PRNGKey(0),
      batch_size=8,
      max_decode_len=L8,
      max_lengths=LIMITS8,
      bos_id=BOS,
      eos_id=EOS,
    )
