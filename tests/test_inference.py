"""The model wired to the decoders: cached greedy decoding equals argmax of the full pass."""

import functools
import os
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer import decoding, inference
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.tasks import translation

VOCAB = 24


@functools.cache
def _setup():
  cfg = ModelConfig(
    vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, d_ff=32, deterministic=True
  )
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(3), tokens, tokens)['params'])
  src = np.random.default_rng(0).integers(4, VOCAB, size=(3, 6)).astype(np.int32)
  src[:, -1] = tokenizer_lib.EOS_ID
  src[1, 3:] = 0  # A shorter row.
  src[1, 2] = tokenizer_lib.EOS_ID
  return cfg, params, jnp.asarray(src)


def _translate(**options):
  cfg, params, src = _setup()
  fn = translation.decode.make_translate_fn(
    cfg, inference.DecodeOptions(max_extra_len=5, **options)
  )
  return np.asarray(fn(params, src, jax.random.key(0)))


def test_greedy_equals_argmax_of_full_forward_pass():
  cfg, params, src = _setup()
  out = _translate(decoder='greedy')
  assert out.shape == (3, 6 + 5)
  model = Transformer(cfg)
  for row in range(3):
    tokens = list(out[row])
    length = (
      tokens.index(tokenizer_lib.EOS_ID) + 1
      if tokenizer_lib.EOS_ID in tokens
      else len([t for t in tokens if t])
    )
    assert length <= int((src[row] != 0).sum()) + 5  # Per-row limit: source length + 5.
    tgt_in = jnp.asarray([[tokenizer_lib.BOS_ID] + tokens[: length - 1]])
    logits = model.apply({'params': params}, src[row : row + 1], tgt_in)
    np.testing.assert_array_equal(np.argmax(logits[0], -1), tokens[:length])
    assert not any(tokens[length:])  # Padding after EOS.


def test_beam_of_one_equals_greedy():
  np.testing.assert_array_equal(
    _translate(decoder='beam', beam_size=1), _translate(decoder='greedy')
  )


def test_beam_search_runs_and_sampling_is_seeded():
  beam = _translate(decoder='beam', beam_size=3)
  assert beam.shape == (3, 11) and beam.dtype == np.int32
  np.testing.assert_array_equal(
    _translate(decoder='sample', top_k=5), _translate(decoder='sample', top_k=5)
  )


def test_unknown_decoder_is_rejected():
  with pytest.raises(ValueError, match='decoder'):
    inference.DecodeOptions(decoder='viterbi')


def test_tags_name_non_default_settings():
  assert inference.DecodeOptions().tag() == ''
  assert inference.DecodeOptions(decoder='greedy').tag() == 'greedy'
  assert inference.DecodeOptions(beam_size=8, alpha=1.0).tag() == 'beam8_alpha1'
  assert inference.DecodeOptions(decoder='sample', top_p=0.9).tag() == 'sample_t1_k0_p0.9'


def test_length_sorted_batches_keep_every_row_once_in_few_shapes():
  rng = np.random.default_rng(1)
  lengths = rng.integers(0, 40, size=50)
  tokens = np.zeros((50, 64), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(3, VOCAB, size=n)
  valid = lengths > 0  # Empty rows stand for padding rows of the input batches.
  batches = [
    {
      'src_tokens': tokens[i : i + 16],
      'index': np.arange(i, i + 16)[: len(tokens[i : i + 16])],
      'valid': valid[i : i + 16],
    }
    for i in range(0, 50, 16)
  ]
  out = inference.length_sorted_batches(batches, max_tokens=128, max_rows=8, max_len=64)
  seen = []
  for batch in out:
    rows, width = batch['src_tokens'].shape
    assert rows & (rows - 1) == 0 and width & (width - 1) == 0 and width >= 8
    assert rows <= 8 and (rows * width <= 128 or rows == 1)
    for row, index, ok in zip(batch['src_tokens'], batch['index'], batch['valid'], strict=True):
      if ok:
        np.testing.assert_array_equal(row, tokens[index, :width])
        seen.append(int(index))
      else:
        assert index == -1 and not row.any()
  assert sorted(seen) == np.flatnonzero(valid).tolist()
  assert [lengths[i] for i in seen] == sorted(lengths[valid], reverse=True)


def _key_bits(key_data) -> np.ndarray:
  return np.asarray(key_data, np.int64).sum(axis=-1) % 1000 + 3


class _Slow:
  """A decode function over numbers: row r's output is [its first token + 1, its key's bits],
  after a sleep that makes batches decoded at once finish out of order; records the calls."""

  def __init__(self):
    self.calls, self.threads, self.lock = [], set(), threading.Lock()

  def __call__(self, params, tokens_BS, rng):
    assert rng.shape == (len(tokens_BS),)  # A key per row.
    with self.lock:
      self.calls.append(int(tokens_BS[0, 0]))
      self.threads.add(threading.get_ident())
    time.sleep(0.05 if int(tokens_BS[0, 0]) % 2 else 0.0)  # Odd batches end later.
    return np.stack([tokens_BS[:, 0] + 1, _key_bits(jax.random.key_data(rng))], axis=1)


class _Digits:
  def decode(self, ids):
    return ' '.join(map(str, ids))


@pytest.mark.parametrize('max_sentences', [None, 5])
def test_batches_decoded_at_once_give_the_outputs_of_one_at_a_time(max_sentences):
  batches = [
    {
      'src_tokens': np.array([[10 * b + r + 1, 0] for r in range(2)], np.int32),
      'index': np.array([2 * b, 2 * b + 1]),
      'valid': np.array([True, b != 3]),  # Batch 3's second row is padding.
    }
    for b in range(6)
  ]
  decoded = {}
  for concurrency in (1, 3):
    fn = _Slow()
    decoded[concurrency], speed = inference.decode_batches(
      fn, None, batches, _Digits(), jax.random.key(7), max_sentences, concurrency=concurrency
    )
    assert list(decoded[concurrency]) == sorted(decoded[concurrency])  # Batch order.
    if max_sentences:  # Stops after batch 2 (6 sentences); at most the window ran beyond.
      assert len(decoded[concurrency]) == 6 and len(fn.calls) <= 3 + concurrency - 1
    else:
      assert sorted(fn.calls) == [10 * b + 1 for b in range(6)]
    assert speed['sentences_per_sec'] > 0
    assert (len(fn.threads) > 1) == (concurrency > 1)
  assert decoded[1] == decoded[3]
  # Each row had its own key, fold_in of its index, whichever batch or thread decoded it.
  for index, text in decoded[3].items():
    expected = _key_bits(jax.random.key_data(jax.random.fold_in(jax.random.key(7), index)))
    assert int(text.split()[1]) == expected, index
  assert len({text.split()[1] for text in decoded[3].values()}) == len(decoded[3])


def test_sampled_translations_do_not_depend_on_batch_size_or_concurrency():
  # eval.py's batches differ by device (accelerators: 256 rows, one CPU: 32 hypotheses) and
  # cores (batches at once): a sentence's samples depend on the seed and its line alone.
  cfg, params, _ = _setup()
  sources = np.random.default_rng(5).integers(4, VOCAB, size=(7, 8)).astype(np.int32)
  for row, length in enumerate([8, 3, 6, 2, 7, 5, 4]):
    sources[row, length - 1] = tokenizer_lib.EOS_ID
    sources[row, length:] = 0
  rows = [{'src_tokens': sources, 'index': np.arange(7), 'valid': np.ones(7, bool)}]

  def translations(decoder, max_rows, concurrency, seed=0):
    fn = translation.decode.make_translate_fn(
      cfg, inference.DecodeOptions(decoder=decoder, max_extra_len=5)
    )
    batches = inference.length_sorted_batches(rows, max_tokens=64, max_rows=max_rows, max_len=8)
    decoded, _ = inference.decode_batches(
      fn, params, batches, _Digits(), jax.random.key(seed), concurrency=concurrency
    )
    return decoded

  sampled = translations('sample', max_rows=8, concurrency=1)
  assert translations('sample', max_rows=1, concurrency=3) == sampled
  assert translations('sample', max_rows=2, concurrency=2) == sampled
  assert translations('sample', max_rows=8, concurrency=1, seed=1) != sampled
  assert translations('greedy', max_rows=8, concurrency=1) != sampled


def test_default_batches_are_small_and_side_by_side_on_one_cpu_device_only():
  beam = inference.DecodeOptions(beam_size=5)
  greedy = inference.DecodeOptions(decoder='greedy')
  one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  for mesh in (None, one):  # The default device, or a mesh of one: this CPU.
    assert inference.batch_size(beam, mesh) == inference.CPU_DECODE_HYPOTHESES // 5
    assert inference.batch_size(greedy, mesh) == inference.CPU_DECODE_HYPOTHESES
    assert inference.concurrent_batches(mesh) == 2 * len(os.sched_getaffinity(0))  # Linux.
  assert inference.batch_size(inference.DecodeOptions(beam_size=64), None) == 1
  if jax.device_count() > 1:  # A mesh of several devices starts its programs in one order.
    two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ('data',))
    assert inference.batch_size(beam, two) == inference.MAX_DECODE_ROWS
    assert inference.concurrent_batches(two) == 1


@pytest.mark.parametrize('decoder', ['beam', 'greedy', 'sample'])
def test_translation_does_not_depend_on_batch_or_padding(decoder):
  # Sorted decoding puts each sentence in another batch, padded to another width, with its key.
  cfg, params, src = _setup()
  fn = translation.decode.make_translate_fn(
    cfg, inference.DecodeOptions(decoder=decoder, max_extra_len=5)
  )
  keys = decoding.row_keys(jax.random.key(0), np.arange(src.shape[0]))
  together = np.asarray(fn(params, src, keys))
  for i in range(src.shape[0]):
    alone = np.asarray(
      fn(params, jnp.pad(src[i : i + 1], ((0, 1), (0, 4))), keys[np.array([i, i])])
    )
    np.testing.assert_array_equal(alone[0, : together.shape[1]], together[i])
    assert not alone[0, together.shape[1] :].any()
    assert np.count_nonzero(alone[1]) <= 1  # The all-PAD row ends after one step.


@pytest.mark.parametrize('decoder', ['beam', 'greedy', 'sample'])
def test_two_passes_give_the_one_pass_translations(decoder, monkeypatch):
  # A short first pass, then the rows it left unfinished again with every step: the same
  # tokens as one pass with every step (sources of width 6 + 5 extra: 11 steps).
  cfg, params, src = _setup()
  src = jnp.concatenate([src, jnp.zeros((1, 6), jnp.int32)])  # An all-PAD row: done in 1 step.
  options = inference.DecodeOptions(decoder=decoder, max_extra_len=5)
  translate = functools.partial(translation.decode.translate, model_config=cfg, options=options)
  one_pass = np.asarray(jax.jit(translate)(params, src, jax.random.key(0)).tokens)
  done_counts = set()
  for steps in (3, 8):
    monkeypatch.setattr(inference, 'first_pass_steps', lambda src_len, limit, k=steps: k)
    first_fn = jax.jit(functools.partial(translate, first_pass=True))  # Compiled once, used twice.
    first = first_fn(params, src, jax.random.key(0))
    assert not np.asarray(first.tokens)[:, steps:].any()
    done_counts.add(int(np.asarray(first.done).sum()))
    two_pass = inference.TwoPass(first_fn, jax.jit(translate), second_pass_rows=2)
    np.testing.assert_array_equal(two_pass(params, src, jax.random.key(0)), one_pass)
    assert two_pass.rows_again == 4 - int(np.asarray(first.done).sum())
  # In 8 steps the PAD row and row 1 (limit 3 + 5) finish; the others go again.
  assert max(done_counts) >= 2 and max(done_counts) < 4, done_counts


@pytest.mark.parametrize('decoder', ['beam', 'greedy', 'sample'])
def test_every_decoder_translates_in_two_passes(decoder):
  cfg, _, _ = _setup()
  options = inference.DecodeOptions(decoder=decoder, max_extra_len=5)
  assert isinstance(translation.decode.make_translate_fn(cfg, options), inference.TwoPass)
