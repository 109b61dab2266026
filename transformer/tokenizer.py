"""Shared SentencePiece vocabulary (unigram, or BPE) for source and target.

(A model imported with a SentencePiece model per side, as OPUS-MT's, keeps the target's at
`config.data.target_vocab_path`: the same pieces under the same ids, segmented its own way.)

Trained on the training split (both languages, at most
`config.data.spm_train_sentences` sentences) with `config.vocab_size` pieces, by
SentencePiece's `config.data.spm_model_type` algorithm ('unigram' or 'bpe'),
normalizing text by `config.data.spm_normalization` ('nmt_nfkc', or 'nmt_nfkc_cf',
which also case-folds: such a model lowercases everything it encodes, so its
translations are lowercase, as in the Multi30k literature's lowercased data).
The model is saved at `config.data.vocab_path`, or by default next to the
prepared data at `<dataset_dir>/spm_<lang>-<lang>_<vocab_size>_<sentences>.model`
(`..._bpe.model` for BPE, `..._cf.model` case-folded; `dataset_dir` is keyed by
the data fingerprint). An existing model is loaded, never retrained or
overwritten, and must be of the configured type and normalization. For
language-model data (one language) the vocabulary is trained on its texts and
named `spm_<lang>_...` (`spm_lm1b_...` for lm1b): the dataset's registry entry
names it (`registry.Dataset.vocabulary_languages`).
"""

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ml_collections
import numpy as np
import sentencepiece as spm
from absl import logging
from sentencepiece import sentencepiece_model_pb2

from transformer import datasets, storage
from transformer.datasets import registry
from transformer.errors import InvalidInput

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3

_READ_CHUNK = 1024  # Examples read at once from the data source.


class Tokenizer:
  """SentencePiece tokenizer with fixed special ids (pad 0, eos 1, bos 2, unk 3)."""

  def __init__(self, model_proto: bytes, target_proto: bytes | None = None):
    """Creates the tokenizer from a serialized SentencePiece model.

    `target_proto`: another model that segments the target side (a model imported with a
    vocabulary per side, as OPUS-MT's); it must hold the same pieces under the same ids.
    """
    self._proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    specials = {
      'pad': (self._sp.pad_id(), PAD_ID),
      'eos': (self._sp.eos_id(), EOS_ID),
      'bos': (self._sp.bos_id(), BOS_ID),
      'unk': (self._sp.unk_id(), UNK_ID),
    }
    for name, (got, want) in specials.items():
      if got != want:
        raise InvalidInput(f'SentencePiece model has {name} id {got}, expected {want}.')
    self._target = None
    if target_proto is not None and target_proto != model_proto:
      self._target = Tokenizer(target_proto)
      if self._target.vocab_size != self.vocab_size:
        raise InvalidInput(
          f'The target SentencePiece model has {self._target.vocab_size} pieces, the source '
          f'model {self.vocab_size}: one vocabulary has one id per piece on both sides.'
        )
      for i in range(self.vocab_size):
        if self._target.id_to_piece(i) != self.id_to_piece(i):
          raise InvalidInput(
            f'Id {i} is {self.id_to_piece(i)!r} in the source SentencePiece model but '
            f'{self._target.id_to_piece(i)!r} in the target one: they must hold the same '
            'pieces under the same ids.'
          )

  @classmethod
  def load(cls, path: str, target_path: str | None = None) -> 'Tokenizer':
    """Loads a `.model` file (and the target side's, if it has its own)."""
    target = storage.read_bytes(target_path) if target_path else None
    return cls(storage.read_bytes(path), target)

  def __reduce__(self):
    return (Tokenizer, (self._proto, self._target and self._target._proto))

  @property
  def target(self) -> 'Tokenizer':
    """The tokenizer of the target side: this one, unless the target has its own model."""
    return self._target or self

  def target_model(self) -> bytes | None:
    """The target side's serialized model, where it has its own; else None."""
    return self._target and self._target.serialized_model()

  @property
  def vocab_size(self) -> int:
    """Number of pieces, special ids included."""
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    """Returns the piece ids of `text` (no BOS or EOS)."""
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Returns the piece ids of each of `texts` (one SentencePiece call)."""
    return self._sp.encode(list(texts))

  def decode(self, ids: Iterable[int]) -> str:
    """Returns the text of `ids`, up to the first EOS; PAD and BOS are ignored.

    By the target side's model: what is decoded is a translation (both sides hold the same
    pieces, so a source's ids read the same).
    """
    if self._target is not None:
      return self._target.decode(ids)
    kept = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i not in (PAD_ID, BOS_ID):
        kept.append(i)
    return self._sp.decode(kept)

  def id_to_piece(self, piece_id: int) -> str:
    """Returns the piece string of an id (e.g. '▁the', '<pad>')."""
    return self._sp.id_to_piece(int(piece_id))

  def serialized_model(self) -> bytes:
    """Returns the serialized SentencePiece model."""
    return self._proto

  @property
  def model_type(self) -> str:
    """The SentencePiece algorithm that trained the model: 'unigram', 'bpe', ..."""
    proto = sentencepiece_model_pb2.ModelProto.FromString(self._proto)
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()

  @property
  def normalization(self) -> str:
    """The normalization rule the model applies to text it encodes: 'nmt_nfkc', 'nmt_nfkc_cf'."""
    return sentencepiece_model_pb2.ModelProto.FromString(self._proto).normalizer_spec.name


def train_tokenizer(
  sentences: Iterable[str],
  vocab_size: int,
  *,
  model_path: str | None = None,
  max_sentences: int | None = None,
  num_threads: int = 2,
  model_type: str = 'unigram',
  normalization: str = 'nmt_nfkc',
) -> Tokenizer:
  """Trains a SentencePiece model from an iterator of sentences.

  Args:
    sentences: Training sentences (no temporary text file is written).
    vocab_size: Number of pieces, special ids included.
    model_path: Where to save the model (written atomically, never replacing
      an existing file); None: not saved.
    max_sentences: SentencePiece's `input_sentence_size` (0/None: all).
    num_threads: Trainer threads.
    model_type: SentencePiece's algorithm: 'unigram' or 'bpe'.
    normalization: SentencePiece's normalization rule: 'nmt_nfkc' (its default), or
      'nmt_nfkc_cf' (also case folding: the model lowercases what it encodes).

  Returns:
    The trained tokenizer.

  Raises:
    ValueError: If the corpus cannot give `vocab_size` pieces.
  """
  model = _InMemoryFile()
  source = _Sentences(sentences)
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=source,
      model_writer=model,
      model_type=model_type,
      normalization_rule_name=normalization,
      vocab_size=vocab_size,
      pad_id=PAD_ID,
      eos_id=EOS_ID,
      bos_id=BOS_ID,
      unk_id=UNK_ID,
      pad_piece='<pad>',
      eos_piece='</s>',
      bos_piece='<s>',
      unk_piece='<unk>',
      character_coverage=1.0,
      input_sentence_size=max_sentences or 0,
      shuffle_input_sentence=True,
      num_threads=num_threads,
      minloglevel=1,
    )
  except RuntimeError as e:
    if source.error is not None:  # SentencePiece reports it as its own; raise it as it was.
      raise source.error from None
    raise InvalidInput(f'SentencePiece training with vocab_size={vocab_size} failed: {e}') from e
  tokenizer = Tokenizer(model.data)
  if model_path:
    _write_atomically(model_path, model.data)
    logging.info('Saved SentencePiece model (%d pieces) to %s.', vocab_size, model_path)
  return tokenizer


def vocab_path(data_config: ml_collections.ConfigDict, vocab_size: int) -> str:
  """Where the vocabulary of `data_config` (`config.data`) and `vocab_size` lives.

  `config.data.vocab_path`, or by default a name of its kind beside the prepared data.
  """
  if data_config.vocab_path:
    return os.path.expanduser(data_config.vocab_path)
  langs = registry.get(data_config).vocabulary_languages(data_config)
  # The unigram, cased vocabulary keeps the name it had before BPE and case folding existed;
  # another type or normalization is named.
  kind = '' if data_config.spm_model_type == 'unigram' else f'_{data_config.spm_model_type}'
  if data_config.spm_normalization == 'nmt_nfkc_cf':
    kind += '_cf'
  name = f'spm_{langs}_{vocab_size}_{data_config.spm_train_sentences}{kind}.model'
  return os.path.join(datasets.dataset_dir(data_config), name)


def target_vocab_path(data_config: ml_collections.ConfigDict) -> str | None:
  """Where the target side's own model lives (`config.data.target_vocab_path`); None: none."""
  path = data_config.get('target_vocab_path')
  return os.path.expanduser(path) if path else None


def get_tokenizer(
  data_config: ml_collections.ConfigDict, *, vocab_size: int, seed: int
) -> Tokenizer:
  """The model at `vocab_path` (`_source_tokenizer`), with the target side's own model at
  `config.data.target_vocab_path` where one is named (an imported model's: this project
  trains one vocabulary for both sides, never one per side).

  Args:
    data_config: The config's data fields (`config.data`).
    vocab_size: `config.vocab_size`.
    seed: `config.seed`, which orders the sentences a new vocabulary is trained on.
  """
  tokenizer = _source_tokenizer(data_config, vocab_size, seed)
  path = target_vocab_path(data_config)
  if path is None:
    return tokenizer
  if not storage.isfile(path):
    raise InvalidInput(
      f'{path} (config.data.target_vocab_path) is not a file. A vocabulary of the target '
      'side alone comes with an imported model (convert.py --from_hf writes '
      'target_vocabulary.model); runs here train one vocabulary for both sides '
      '(config.data.vocab_path). Point the key at that file, or leave it unset.'
    )
  try:
    combined = Tokenizer(tokenizer.serialized_model(), storage.read_bytes(path))
  except RuntimeError as e:  # SentencePiece's.
    reason = str(e).strip().rstrip('.')
    raise InvalidInput(
      f'{path} (config.data.target_vocab_path) is not a usable SentencePiece model: {reason}.'
    ) from e
  except InvalidInput as e:
    raise InvalidInput(f'{path} (config.data.target_vocab_path): {e}') from None
  logging.info("Loaded the target side's SentencePiece model %s.", path)
  return combined


def _source_tokenizer(
  data_config: ml_collections.ConfigDict, vocab_size: int, seed: int
) -> Tokenizer:
  """Loads the model at `vocab_path`, training it first if absent.

  Training reads `config.data.train_split` of `config.data.dataset` (both
  languages, or the text of language-model data; at most
  `config.data.spm_train_sentences` sentences drawn in a random order seeded by
  `config.seed`).

  Args:
    data_config: The config's data fields (`config.data`).
    vocab_size: `config.vocab_size`.
    seed: `config.seed`.

  Raises:
    ValueError: If an existing model's vocabulary size differs from
      `config.vocab_size`, its type from `config.data.spm_model_type`, or its
      normalization from `config.data.spm_normalization`.
  """
  path = vocab_path(data_config, vocab_size)
  if storage.exists(path):
    try:
      tokenizer = Tokenizer.load(path)
    except (RuntimeError, OSError, ValueError) as e:  # SentencePiece raises RuntimeError.
      key = (
        'config.data.vocab_path'
        if data_config.vocab_path
        else 'the vocabulary beside the prepared data, under config.data.data_dir'
      )
      if data_config.vocab_path:
        fix = (
          'Point config.data.vocab_path at a SentencePiece model trained by this project, or '
          'at a path where no file exists yet, to have one trained and written there.'
        )
      else:
        fix = (
          'This project writes its trained vocabulary there, so the file was damaged: move '
          f'it aside (mv {path} {path}.bad) to have a new one trained.'
        )
      reason = str(e).strip().rstrip('.')
      raise InvalidInput(
        f'{path} ({key}) is not a usable SentencePiece model: {reason}. It was left as it is. {fix}'
      ) from e
    if tokenizer.vocab_size != vocab_size:
      raise InvalidInput(
        f'SentencePiece model {path} has vocab size {tokenizer.vocab_size} but '
        f'config.vocab_size is {vocab_size}; use a matching '
        'config.vocab_size or another config.data.vocab_path.'
      )
    if tokenizer.model_type != data_config.spm_model_type:
      raise InvalidInput(
        f'SentencePiece model {path} is a {tokenizer.model_type} model but '
        f'config.data.spm_model_type is {data_config.spm_model_type!r}; use a matching '
        'config.data.spm_model_type or another config.data.vocab_path.'
      )
    if tokenizer.normalization != data_config.spm_normalization:
      raise InvalidInput(
        f'SentencePiece model {path} normalizes text by {tokenizer.normalization!r} but '
        f'config.data.spm_normalization is {data_config.spm_normalization!r}; use a matching '
        'config.data.spm_normalization or another config.data.vocab_path.'
      )
    logging.info('Loaded SentencePiece model %s.', path)
    return tokenizer
  logging.info('Training SentencePiece model %s.', path)
  source = datasets.get_data_source(data_config, data_config.train_split)
  if datasets.is_monolingual(data_config):
    texts = lambda example: (datasets.document_text(example),)
  else:
    texts = lambda example: datasets.translation_pair(
      example, data_config.source_lang, data_config.target_lang
    )
  sentences = _training_sentences(source, texts, data_config.spm_train_sentences, seed)
  train_tokenizer(
    sentences,
    vocab_size,
    model_path=path,
    max_sentences=data_config.spm_train_sentences,
    model_type=data_config.spm_model_type,
    normalization=data_config.spm_normalization,
  )
  return Tokenizer.load(path)  # The file wins if another process wrote it first.


def _training_sentences(
  source: Sequence,
  texts: Callable[[Any], Sequence[str]],
  max_sentences: int,
  seed: int,
) -> Iterator[str]:
  """Yields the `texts(example)` of examples in a seeded random order, up to a limit."""
  order = np.random.default_rng(seed).permutation(len(source))
  count = 0
  for start in range(0, len(order), _READ_CHUNK):
    positions = order[start : start + _READ_CHUNK].tolist()
    for example in datasets.read_examples(source, positions):
      for text in texts(example):
        if count >= max_sentences:
          return
        count += 1
        yield text


class _Sentences:
  """An iterator over `sentences` that keeps what it raised (an error reading the data, a
  KeyboardInterrupt), which SentencePiece would otherwise report as its own failure."""

  def __init__(self, sentences: Iterable[str]):
    self._sentences = iter(sentences)
    self.error: BaseException | None = None

  def __iter__(self) -> '_Sentences':
    return self

  def __next__(self) -> str:
    try:
      return next(self._sentences)
    except StopIteration:
      raise
    except BaseException as e:
      self.error = e
      raise


class _InMemoryFile:
  """Receives the model bytes from SentencePiece's `model_writer`."""

  def __init__(self):
    self.data = b''

  def write(self, data: bytes) -> None:
    self.data += data


def _write_atomically(path: str, data: bytes) -> None:
  """Writes `data` to a new file `path`, atomically; never overwrites.

  If `path` appeared meanwhile (another process trained too), it is kept.
  """
  storage.makedirs(storage.dirname(storage.resolve(path)))
  try:
    storage.write_bytes(path, data, overwrite=False)
  except FileExistsError:
    logging.warning('%s appeared while training; keeping it.', path)
