"""Prepared token ids: encoded once per vocabulary, read back exactly, bad files named."""

import json
import os

import numpy as np
import pytest
from conftest import make_config, synthetic_pairs, write_lines

from transformer import datasets, prepared_ids
from transformer import tokenizer as tokenizer_lib
from transformer.tasks import translation


@pytest.fixture
def prepared(tmp_path):
  """(config, tokenizer, EncodedSplit of train) on a small synthetic corpus."""
  pairs = synthetic_pairs(120, seed=7)
  for split in ('train', 'val'):
    write_lines(tmp_path / 'raw' / f'{split}.en', [p[0] for p in pairs])
    write_lines(tmp_path / 'raw' / f'{split}.de', [p[1] for p in pairs])
  config = make_config(tmp_path / 'tfds', tmp_path / 'raw')
  tok = tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  return config, tok, translation.data.encoded_pairs(config.data, tok, 'train')


def test_ids_are_the_tokenizer_encoding_of_every_example(prepared):
  config, tok, split = prepared
  source = datasets.get_data_source(config.data, 'train')
  ids, starts, lengths = split.read(range(len(source)))
  for i, example in enumerate(source):
    for side, text in enumerate(datasets.translation_pair(example, 'en', 'de')):
      got = ids[starts[i, side] : starts[i, side] + lengths[i, side]]
      assert got.tolist() == tok.encode(text)


def test_a_reused_vocabulary_never_encodes_again_a_new_one_does(prepared, tmp_path):
  config, tok, split = prepared
  mtime = os.stat(split.path).st_mtime_ns
  again = translation.data.encoded_pairs(config.data, tok, 'train')
  assert again.path == split.path and os.stat(split.path).st_mtime_ns == mtime
  other_config = config.copy_and_resolve_references()
  other_config.vocab_size = 200
  other_config.data.vocab_path = str(tmp_path / 'other.model')
  other = translation.data.encoded_pairs(
    other_config.data,
    tokenizer_lib.get_tokenizer(
      other_config.data, vocab_size=other_config.vocab_size, seed=other_config.seed
    ),
    'train',
  )
  assert os.path.dirname(other.path) != os.path.dirname(split.path)  # Keyed by the hash.


def test_ids_of_another_vocabulary_are_encoded_again_never_mixed(prepared):
  config, tok, split = prepared
  meta_path = split.path.replace('.array_record', '.json')
  with open(meta_path) as f:
    meta = json.load(f)
  meta['vocabulary_sha256'] = '0' * 64  # As if another vocabulary had written these ids.
  with open(meta_path, 'w') as f:
    json.dump(meta, f)
  with open(split.path, 'wb') as f:
    f.write(b'ids of another vocabulary')
  again = translation.data.encoded_pairs(config.data, tok, 'train')
  with open(meta_path) as f:
    assert json.load(f)['vocabulary_sha256'] == prepared_ids.vocabulary_hash(tok)
  np.testing.assert_array_equal(again.read([0, 5])[0], split.read([0, 5])[0])


@pytest.mark.parametrize('damage', ['truncate', 'garbage'])
def test_a_damaged_ids_file_is_named_with_how_to_prepare_it_again(prepared, damage):
  config, tok, split = prepared
  size = os.path.getsize(split.path)
  with open(split.path, 'r+b') as f:
    if damage == 'truncate':
      f.truncate(size // 2)
    else:
      f.seek(size // 2)
      f.write(b'\xff' * 64)
  with pytest.raises(prepared_ids.PreparedIdsError) as error:
    it = translation.data.train_iterator(config.data, tok, seed=config.seed)
    for _ in range(20):
      next(it)
  assert split.path in str(error.value)
  assert 'Delete' in str(error.value) and 'run the same command' in str(error.value)
