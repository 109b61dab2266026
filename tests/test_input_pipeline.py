"""Tests of the Grain input pipelines (training, evaluation, decoding)."""

import collections
import pathlib

import numpy as np
import psutil
import pytest
from conftest import make_config, synthetic_pairs, write_lines

from transformer import datasets, input_pipeline
from transformer import tokenizer as tokenizer_lib
from transformer.tasks import translation
from transformer.tokenizer import BOS_ID, EOS_ID

LONG_VAL_WORDS = 80  # Far beyond max_eval_len pieces: must be truncated, not dropped.


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  """(config, tokenizer) on a synthetic en-de corpus: train 300, val 39, test 12."""
  root = tmp_path_factory.mktemp('pipeline')
  corpus = root / 'raw'
  train = synthetic_pairs(300, seed=1, max_words=16)
  val = synthetic_pairs(37, seed=2) + synthetic_pairs(
    2, seed=3, min_words=LONG_VAL_WORDS, max_words=LONG_VAL_WORDS
  )
  test = synthetic_pairs(12, seed=4)
  test[5] = ('', test[5][1])  # An empty source line: dropped when preparing.
  for split, pairs in (('train', train), ('val', val), ('test', test)):
    write_lines(corpus / f'{split}.en', [p[0] for p in pairs])
    write_lines(corpus / f'{split}.de', [p[1] for p in pairs])
  config = make_config(root / 'tfds', corpus)  # max_len 32, max_eval_len 64, 256 tokens.
  return config, tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )


def _segments(tokens: np.ndarray, segments: np.ndarray) -> list[tuple[int, ...]]:
  """The token sequences of every segment of every row."""
  return [
    tuple(tokens[row][segments[row] == s])
    for row in range(tokens.shape[0])
    for s in np.unique(segments[row])
    if s
  ]


def _pairs(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
  """(source, target) token sequences of a batch, in segment order."""
  return list(
    zip(
      _segments(batch['src_tokens'], batch['src_segments']),
      _segments(batch['tgt_tokens'], batch['tgt_segments']),
      strict=True,
    )
  )


def _encoded(config, tok, split, limit=None):
  """Expected (source + EOS, target + EOS) of every example, truncated to `limit`."""
  out = []
  for ex in datasets.get_data_source(config.data, split):
    src, tgt = (tok.encode(t) for t in datasets.translation_pair(ex, 'en', 'de'))
    if limit and (len(src) >= limit or len(tgt) >= limit):
      src, tgt = src[: limit - 1], tgt[: limit - 1]
    out.append((tuple(src + [EOS_ID]), tuple(tgt + [EOS_ID])))
  return out


def _check_batch(batch, rows: int, length: int) -> None:
  assert set(batch) == set(translation.data.BATCH_KEYS)
  for key, value in batch.items():
    assert value.dtype == np.int32 and value.shape == (rows, length), key
  for side, token_keys in (('src', ['src_tokens']), ('tgt', ['tgt_tokens', 'tgt_input_tokens'])):
    segments, positions = batch[f'{side}_segments'], batch[f'{side}_positions']
    for key in token_keys:
      np.testing.assert_array_equal(batch[key] == 0, segments == 0)
    for row in range(rows):
      ids = [s for s in np.unique(segments[row]) if s]
      assert ids == list(range(1, len(ids) + 1))
      for s in ids:
        where = np.flatnonzero(segments[row] == s)
        assert np.all(np.diff(where) == 1)  # Contiguous.
        np.testing.assert_array_equal(positions[row, where], np.arange(len(where)))
      assert np.all(positions[row][segments[row] == 0] == 0)
  for row in range(rows):  # Packed jointly: the same examples on both sides.
    src_ids, tgt_ids = (
      set(np.unique(batch[k][row])) - {0} for k in ('src_segments', 'tgt_segments')
    )
    assert src_ids == tgt_ids
  for src, tgt in _pairs(batch):
    assert src[-1] == EOS_ID and EOS_ID not in src[:-1]
    assert tgt[-1] == EOS_ID and EOS_ID not in tgt[:-1]
  inputs = _segments(batch['tgt_input_tokens'], batch['tgt_segments'])
  for dec_in, (_, tgt) in zip(inputs, _pairs(batch), strict=True):
    assert dec_in == (BOS_ID,) + tgt[:-1]  # Target shifted right by one, BOS first.


def test_train_batches_shapes_and_packing(small):
  config, tok = small
  rows = input_pipeline.train_rows(config.data)
  assert rows == 256 // 32
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  for _ in range(5):
    _check_batch(next(it), rows, config.data.max_len)


def test_train_epoch_drops_only_long_pairs(small):
  config, tok = small
  short = {p for p in _encoded(config, tok, 'train') if max(map(len, p)) <= config.data.max_len}
  assert 0 < len(short) < 300  # Some pairs are too long: the filter is exercised.
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  seen = collections.Counter(p for _ in range(60) for p in _pairs(next(it)))
  assert set(seen) == short  # Over several epochs: every kept pair, nothing else.
  assert max(seen.values()) - min(seen.values()) <= 2  # Each epoch sees each pair once.


@pytest.mark.parametrize('num_workers', [0, 2])
def test_state_restore_reproduces_next_batches(small, num_workers):
  config, tok = small
  config = config.copy_and_resolve_references()
  config.data.num_workers = num_workers
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  for _ in range(7):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  restored = translation.data.train_iterator(config.data, tok, seed=config.seed)
  restored.set_state(state)
  for want in expected:
    got = next(restored)
    for key in translation.data.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], want[key])
  for iterator in (it, restored):
    getattr(iterator, 'close', lambda: None)()


def test_device_prefetch_places_ahead_and_resumes_at_the_first_unused_batch(small):
  config, tok = small
  reference = translation.data.train_iterator(config.data, tok, seed=config.seed)
  expected = [next(reference) for _ in range(5)]
  placed = []

  def place(batch):  # Stands for sharding.global_batch: records what was placed, and when.
    placed.append(batch)
    return {k: v.copy() for k, v in batch.items()}

  it = input_pipeline.DevicePrefetch(
    translation.data.train_iterator(config.data, tok, seed=config.seed), place, ahead=2
  )
  got = [next(it) for _ in range(2)]
  assert len(placed) == 4  # Batches 3 and 4 are placed before the step of batch 2 runs.
  state = it.get_state()  # The position of batch 3, the first no step has used.
  restored = input_pipeline.DevicePrefetch(
    translation.data.train_iterator(config.data, tok, seed=config.seed), lambda b: b, ahead=2
  )
  restored.set_state(state)
  got.append(next(restored))
  it.set_state(state)  # Drops the placed batches 3 and 4, then places them again.
  got += [next(it), next(it)]
  for want, batch in zip([*expected[:3], *expected[2:4]], got, strict=True):
    for key in translation.data.BATCH_KEYS:
      np.testing.assert_array_equal(batch[key], want[key])
  assert it.wait_seconds > 0


def test_workers_read_each_pair_once_an_epoch(small):
  config, tok = small
  config = config.copy_and_resolve_references()
  config.data.num_workers = 2
  short = {p for p in _encoded(config, tok, 'train') if max(map(len, p)) <= config.data.max_len}
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  seen = collections.Counter(p for _ in range(60) for p in _pairs(next(it)))
  it.close()
  # Every kept pair, nothing else (worker i packs chunks i, i + 2, ..., so the workers'
  # batches interleave chunks: epochs overlap by up to a chunk per worker).
  assert set(seen) == short


def test_a_dying_worker_stops_the_iterator(small):
  config, tok = small
  config = config.copy_and_resolve_references()
  config.data.num_workers = 1
  before = set(psutil.Process().children())
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  next(it)
  (worker,) = [
    p
    for p in set(psutil.Process().children()) - before
    if 'resource_tracker' not in ' '.join(p.cmdline())
  ]
  worker.kill()  # Not reaped here: the iterator must notice by itself.
  with pytest.raises(RuntimeError, match='terminated unexpectedly'):
    for _ in range(1000):  # The batches it had prefetched, then the error (never a hang).
      next(it)
  it.close()


def test_train_order_follows_the_seed(small):
  config, tok = small
  first = [
    _pairs(b) for b in [next(translation.data.train_iterator(config.data, tok, seed=config.seed))]
  ]
  again = [
    _pairs(b) for b in [next(translation.data.train_iterator(config.data, tok, seed=config.seed))]
  ]
  assert first == again  # Same seed, same order.
  config = config.copy_and_resolve_references()
  config.seed = 1
  other = [
    _pairs(b) for b in [next(translation.data.train_iterator(config.data, tok, seed=config.seed))]
  ]
  assert other != first


def test_shards_are_disjoint_and_cover_the_data(small):
  config, tok = small
  seen = []
  for index in range(2):
    it = translation.data.train_iterator(
      config.data, tok, seed=config.seed, shard_index=index, shard_count=2
    )
    batch = next(it)
    assert batch['src_tokens'].shape == (input_pipeline.train_rows(config.data) // 2, 32)
    seen.append({p for _ in range(40) for p in _pairs(next(it))})
  assert not seen[0] & seen[1]
  short = {p for p in _encoded(config, tok, 'train') if max(map(len, p)) <= 32}
  assert seen[0] | seen[1] == short


def test_batch_size_errors_name_the_config_keys(small):
  config, _ = small
  bad = config.copy_and_resolve_references()
  bad.data.tokens_per_batch = 250
  message = r'config\.data\.tokens_per_batch=250 .*config\.data\.max_len=32'
  with pytest.raises(ValueError, match=message):
    input_pipeline.train_rows(bad.data)
  with pytest.raises(ValueError, match='process count 3'):
    input_pipeline.train_rows(config.data, shard_count=3)
  with pytest.raises(ValueError, match='process count 16'):
    input_pipeline.train_rows(config.data, shard_count=16)


def test_eval_covers_every_example_exactly_once(small):
  config, tok = small
  rows, length = input_pipeline.eval_rows(config.data), config.data.max_eval_len
  assert rows == 256 // 64
  batches = list(translation.data.eval_batches(config.data, tok, 'validation'))
  assert len(batches) > 2
  for batch in batches:
    _check_batch(batch, rows, length)
  got = collections.Counter(p for b in batches for p in _pairs(b))
  expected = collections.Counter(_encoded(config, tok, 'validation', limit=length))
  assert got == expected and sum(got.values()) == 39
  assert sum(len(s) == length for s, _ in got) == 2  # The two long pairs, truncated.
  assert not batches[-1]['src_segments'][-1].any()  # Padded with all-zero rows.
  again = list(translation.data.eval_batches(config.data, tok, 'validation'))
  for a, b in zip(batches, again, strict=True):
    for key in translation.data.BATCH_KEYS:
      np.testing.assert_array_equal(a[key], b[key])


def test_translation_batches_in_input_order(small):
  config, tok = small
  batches = list(translation.data.translation_batches(config.data, tok, 'test', batch_size=4))
  refs = translation.data.translation_references(config.data, 'test')
  assert len(batches) == 3 and len(refs) == 11
  index = np.concatenate([b['index'][b['valid']] for b in batches])
  np.testing.assert_array_equal(index, [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11])  # Line 5 was empty.
  assert datasets.split_num_lines(config.data, 'test') == 12
  raw = pathlib.Path(config.data.manual_dir)
  src_lines, tgt_lines = ((raw / f'test.{lang}').read_text().splitlines() for lang in ('en', 'de'))
  assert refs == [tgt_lines[i] for i in index]
  decoded = []
  for b in batches:
    assert b['src_tokens'].shape[0] == 4 and b['src_tokens'].shape[1] in (8, 16, 32, 64)
    assert b['src_tokens'].dtype == np.int32 and b['valid'].dtype == bool
    assert not b['src_tokens'][~b['valid']].any() and (b['index'][~b['valid']] == -1).all()
    for row in np.flatnonzero(b['valid']):
      ids = b['src_tokens'][row]
      assert ids[ids != 0][-1] == EOS_ID
      decoded.append(tok.decode(ids))
  assert decoded == [src_lines[i] for i in index]
  assert batches[-1]['valid'].tolist() == [True, True, True, False]


def test_bucket_lengths():
  assert [input_pipeline.bucket_length(n, 256) for n in (1, 8, 9, 17, 100, 256)] == [
    8,
    8,
    16,
    32,
    128,
    256,
  ]
  assert input_pipeline.bucket_length(70, 70) == 72


@pytest.mark.full_data  # Packing of the real corpus' length distribution.
def test_real_tokens_share_on_multi30k(multi30k_data_dir, multi30k_dir):
  config = make_config(
    multi30k_data_dir,
    multi30k_dir,
    'multi30k',
    vocab_size=1000,
    spm_train_sentences=10_000,
    max_len=64,
    tokens_per_batch=4096,
  )
  tok = tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  it = translation.data.train_iterator(config.data, tok, seed=config.seed)
  batches = [next(it) for _ in range(20)]
  assert batches[0]['tgt_tokens'].shape == (64, 64)
  real = sum(int((b['tgt_segments'] > 0).sum()) for b in batches)
  total = sum(b['tgt_segments'].size for b in batches)
  assert real / total >= 0.85, real / total
