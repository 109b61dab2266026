"""Tests of the shared SentencePiece tokenizer."""

import os
import pickle

import pytest
from conftest import synthetic_pairs

from transformer import datasets
from transformer import tokenizer as tokenizer_lib

VOCAB = 500


@pytest.fixture(scope='module')
def small_tokenizer() -> tokenizer_lib.Tokenizer:
  sentences = [s for pair in synthetic_pairs(400) for s in pair]
  return tokenizer_lib.train_tokenizer(sentences, VOCAB)


def test_special_ids_and_vocab_size(small_tokenizer):
  assert small_tokenizer.vocab_size == VOCAB
  assert (
    tokenizer_lib.PAD_ID,
    tokenizer_lib.EOS_ID,
    tokenizer_lib.BOS_ID,
    tokenizer_lib.UNK_ID,
  ) == (0, 1, 2, 3)
  pieces = [small_tokenizer.id_to_piece(i) for i in range(4)]
  assert pieces == ['<pad>', '</s>', '<s>', '<unk>']


def test_encode_decode_round_trip(small_tokenizer):
  en, de = synthetic_pairs(3, seed=99)[2]
  for text in (en, de):
    ids = small_tokenizer.encode(text)
    assert ids and all(3 < i < VOCAB for i in ids)  # No EOS/BOS/PAD added.
    assert small_tokenizer.decode(ids) == text


def test_decode_stops_at_eos_and_ignores_pad_and_bos(small_tokenizer):
  first = small_tokenizer.encode('Bada kemi.')
  second = small_tokenizer.encode('Zuzu.')
  ids = [tokenizer_lib.BOS_ID, *first, tokenizer_lib.PAD_ID, tokenizer_lib.EOS_ID, *second]
  assert small_tokenizer.decode(ids) == 'Bada kemi.'
  assert small_tokenizer.decode([tokenizer_lib.EOS_ID, *second]) == ''


def test_pickles(small_tokenizer):
  copy = pickle.loads(pickle.dumps(small_tokenizer))
  assert copy.encode('Bada kemi.') == small_tokenizer.encode('Bada kemi.')


def test_trains_once_next_to_the_data_and_reuses(
  tmp_path, write_parallel_corpus, config_for, monkeypatch
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 300, 'val': 5})
  config = config_for(tmp_path / 'tfds', corpus, vocab_size=VOCAB, spm_train_sentences=250)
  seen = []
  real_train = tokenizer_lib.train_tokenizer

  def spy(sentences, *args, **kwargs):
    sentences = list(sentences)
    seen.append(sentences)
    return real_train(sentences, *args, **kwargs)

  monkeypatch.setattr(tokenizer_lib, 'train_tokenizer', spy)
  tok = tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)

  path = tokenizer_lib.vocab_path(config.data, config.vocab_size)
  assert os.path.dirname(path) == datasets.dataset_dir(config.data)
  assert datasets.fingerprint(config.data)[:16] in path and f'_{VOCAB}_' in path
  assert os.listdir(os.path.dirname(path)).count(os.path.basename(path)) == 1
  assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith('.tmp')]
  # At most spm_train_sentences sentences, from both sides of the train split.
  (sentences,) = seen
  assert len(sentences) == 250
  train_en = set((corpus / 'train.en').read_text().splitlines())
  train_de = set((corpus / 'train.de').read_text().splitlines())
  assert set(sentences) <= train_en | train_de
  assert set(sentences) & train_en and set(sentences) & train_de

  mtime = os.path.getmtime(path)
  again = tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  assert len(seen) == 1 and os.path.getmtime(path) == mtime
  assert again.encode('Bada kemi.') == tok.encode('Bada kemi.')


def test_existing_model_with_other_vocab_size_is_an_error(
  tmp_path, write_parallel_corpus, config_for, small_tokenizer
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 5, 'val': 2})
  model = tmp_path / 'vocab' / 'spm.model'
  model.parent.mkdir()
  model.write_bytes(small_tokenizer.serialized_model())
  config = config_for(tmp_path / 'tfds', corpus, vocab_size=VOCAB, vocab_path=str(model))
  assert (
    tokenizer_lib.get_tokenizer(
      config.data, vocab_size=config.vocab_size, seed=config.seed
    ).vocab_size
    == VOCAB
  )

  config.vocab_size = 8000
  with pytest.raises(ValueError, match=f'vocab size {VOCAB} but config.vocab_size is 8000'):
    tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  assert model.read_bytes() == small_tokenizer.serialized_model()


def test_too_large_vocab_is_a_clear_error():
  with pytest.raises(ValueError, match='vocab_size=5000'):
    tokenizer_lib.train_tokenizer(['ab cd', 'ef gh'] * 10, 5000)


def test_bpe_vocabulary_is_named_apart_and_never_read_as_unigram(
  tmp_path, write_parallel_corpus, config_for, small_tokenizer
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 300, 'val': 5})
  unigram = config_for(tmp_path / 'tfds', corpus, vocab_size=VOCAB, spm_train_sentences=250)
  bpe = config_for(
    tmp_path / 'tfds', corpus, vocab_size=VOCAB, spm_train_sentences=250, spm_model_type='bpe'
  )
  # The unigram vocabulary keeps its name; the BPE one lies beside it under its own.
  unigram_path, bpe_path = (
    tokenizer_lib.vocab_path(unigram.data, unigram.vocab_size),
    tokenizer_lib.vocab_path(bpe.data, bpe.vocab_size),
  )
  assert unigram_path.endswith(f'_{VOCAB}_250.model')
  assert bpe_path == unigram_path[: -len('.model')] + '_bpe.model'
  tokenizer = tokenizer_lib.get_tokenizer(bpe.data, vocab_size=bpe.vocab_size, seed=bpe.seed)
  assert tokenizer.model_type == 'bpe' and tokenizer.vocab_size == VOCAB
  assert os.listdir(os.path.dirname(bpe_path)).count(os.path.basename(bpe_path)) == 1
  assert not os.path.exists(unigram_path)
  assert small_tokenizer.model_type == 'unigram'
  # A model of the other type, named by config.data.vocab_path, is refused and left as it was.
  model = tmp_path / 'spm.model'
  model.write_bytes(small_tokenizer.serialized_model())
  bpe.data.vocab_path = str(model)
  with pytest.raises(
    ValueError, match=r"is a unigram model but config.data.spm_model_type is 'bpe'"
  ):
    tokenizer_lib.get_tokenizer(bpe.data, vocab_size=bpe.vocab_size, seed=bpe.seed)
  assert model.read_bytes() == small_tokenizer.serialized_model()


def test_case_folded_vocabulary_lowercases_and_is_never_read_as_cased(
  tmp_path, write_parallel_corpus, config_for, small_tokenizer
):
  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 300, 'val': 5})
  cased = config_for(tmp_path / 'tfds', corpus, vocab_size=VOCAB, spm_train_sentences=250)
  folded = config_for(
    tmp_path / 'tfds',
    corpus,
    vocab_size=VOCAB,
    spm_train_sentences=250,
    spm_normalization='nmt_nfkc_cf',
  )
  folded_path = tokenizer_lib.vocab_path(folded.data, folded.vocab_size)
  assert (
    folded_path
    == tokenizer_lib.vocab_path(cased.data, cased.vocab_size)[: -len('.model')] + '_cf.model'
  )
  tokenizer = tokenizer_lib.get_tokenizer(
    folded.data, vocab_size=folded.vocab_size, seed=folded.seed
  )
  assert tokenizer.normalization == 'nmt_nfkc_cf' and tokenizer.vocab_size == VOCAB
  assert small_tokenizer.normalization == 'nmt_nfkc'
  # It reads any casing as lowercase, and writes lowercase.
  text = (corpus / 'train.en').read_text().splitlines()[0].title()
  assert text != text.lower()
  assert tokenizer.encode(text) == tokenizer.encode(text.lower())
  assert tokenizer.decode(tokenizer.encode(text)) == text.lower()
  assert small_tokenizer.encode(text) != small_tokenizer.encode(text.lower())
  # A cased model named by config.data.vocab_path is refused and left as it was.
  model = tmp_path / 'spm.model'
  model.write_bytes(small_tokenizer.serialized_model())
  folded.data.vocab_path = str(model)
  with pytest.raises(
    ValueError,
    match=r"normalizes text by 'nmt_nfkc' but config.data.spm_normalization is 'nmt_nfkc_cf'",
  ):
    tokenizer_lib.get_tokenizer(folded.data, vocab_size=folded.vocab_size, seed=folded.seed)
  assert model.read_bytes() == small_tokenizer.serialized_model()
