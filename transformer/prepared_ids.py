"""Token ids of a split, encoded once after the vocabulary is trained (fairseq's binarized data).

Training and loss evaluation read these ids instead of text, so SentencePiece
never runs in the training loop. A split's ids live beside the prepared data,
keyed by the vocabulary's hash and by what was encoded (`key`, e.g. the
language pair `en-de`):

  <dataset_dir>/ids-<sha256(vocabulary)[:16]>/<key>/<split>.array_record
  <dataset_dir>/ids-<sha256(vocabulary)[:16]>/<key>/<split>.json

so a new vocabulary encodes again into a new directory and a reused one never
does. Each record holds one example: int32 little-endian, first the number of
ids of each text, then the ids of each text in turn (no BOS or EOS). The JSON
file, written last, names the full vocabulary hash and the number of records;
ids whose JSON names another vocabulary are encoded again, never mixed.

Encoding runs in `os.cpu_count()` processes for large splits (SentencePiece
and the TFDS decoding are both CPU-bound), with a progress bar.
"""

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import ml_collections
import numpy as np
import tqdm
from absl import logging
from array_record.python import array_record_module

from transformer import atomic, datasets
from transformer import tokenizer as tokenizer_lib
from transformer.errors import Refusal

RECORD_DTYPE = np.dtype('<i4')
# Examples encoded per task; large enough that a task's overhead is small.
_BLOCK = 4096
# Splits with fewer examples are encoded in this process (a worker starts in seconds).
_PARALLEL_MIN_EXAMPLES = 50_000
# One record per group: random access reads only the records it asks for.
_WRITER_OPTIONS = 'group_size:1'

Texts = Callable[[Any], Sequence[str]]


def _malloc_trim() -> Callable[[], None]:
  """glibc's `malloc_trim(0)`, or a no-op where the C library has none (macOS, musl).

  array_record reads a batch of records in a thread pool, and glibc gives each
  thread its own malloc arena: the record buffers freed after a read stay
  resident there, so without trimming the reading process grows with the number
  of distinct records read. Trimming after each read keeps its memory flat
  (docs/benchmarks.md, "Input pipeline", has the figures).
  """
  try:
    trim = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim
  except (OSError, AttributeError):
    return lambda: None
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

  def release() -> None:
    trim(0)

  return release


_release_freed_memory = _malloc_trim()


class PreparedIdsError(Refusal, RuntimeError):
  """A prepared ids file cannot be read: it names the file and how to prepare it again."""


def vocabulary_hash(tokenizer: tokenizer_lib.Tokenizer) -> str:
  """sha256 (hex) of the serialized SentencePiece model (and of the target side's own)."""
  digest = hashlib.sha256(tokenizer.serialized_model())
  if target := tokenizer.target_model():
    digest.update(b'\0target\0' + target)
  return digest.hexdigest()


def ids_dir(
  data_config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer, key: str
) -> str:
  """Directory of the ids of `config.data.dataset` under this vocabulary and `key`."""
  root = datasets.local_dataset_dir(data_config)  # Read by local path (array_record).
  return os.path.join(root, f'ids-{vocabulary_hash(tokenizer)[:16]}', key)


def _reprepare_hint(directory: str) -> str:
  return (
    f'Delete {directory} and run the same command (train.py --config=...) again: '
    'it encodes the split anew from the prepared text.'
  )


class EncodedSplit:
  """Random access to the prepared ids of one split.

  `read(indices)` returns every id of the asked records at once (no per-record
  Python objects): the ids of record i's text f are
  `ids[starts[i, f]:starts[i, f] + lengths[i, f]]`.
  """

  def __init__(self, path: str, num_texts: int, num_records: int):
    self.path = path
    self.num_texts = num_texts
    try:
      self._source = grain.sources.ArrayRecordDataSource([path])
      found = len(self._source)
    except Exception as e:  # array_record raises bare RuntimeErrors / absl statuses.
      raise PreparedIdsError(
        f'Prepared ids file {path} is unreadable ({e}). {_reprepare_hint(os.path.dirname(path))}'
      ) from e
    if found != num_records:
      raise PreparedIdsError(
        f'Prepared ids file {path} holds {found} records, its .json says {num_records}: it '
        f'is truncated or was replaced. {_reprepare_hint(os.path.dirname(path))}'
      )

  def __len__(self) -> int:
    return len(self._source)

  def __getstate__(self):
    return {'path': self.path, 'num_texts': self.num_texts, 'num_records': len(self)}

  def __setstate__(self, state):
    self.__init__(state['path'], state['num_texts'], state['num_records'])

  def read(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns (ids, starts, lengths) of the records at `indices` (see class docstring).

    Raises:
      PreparedIdsError: If the file cannot be read or a record is malformed.
    """
    try:
      records = self._source.__getitems__([int(i) for i in indices])
    except Exception as e:
      raise PreparedIdsError(
        f'Prepared ids file {self.path} is unreadable ({e}). '
        f'{_reprepare_hint(os.path.dirname(self.path))}'
      ) from e
    words = np.fromiter((len(r) for r in records), np.int64, len(records)) // 4
    flat = np.frombuffer(b''.join(records), RECORD_DTYPE)
    record_starts = np.concatenate([[0], np.cumsum(words)[:-1]])
    header = record_starts[:, None] + np.arange(self.num_texts)
    lengths = (
      flat[header].astype(np.int64) if len(records) else np.zeros((0, self.num_texts), np.int64)
    )
    if (lengths < 0).any() or not np.array_equal(lengths.sum(1) + self.num_texts, words):
      raise PreparedIdsError(
        f'Prepared ids file {self.path} has a malformed record. '
        f'{_reprepare_hint(os.path.dirname(self.path))}'
      )
    mask = np.ones(len(flat), bool)
    mask[header.ravel()] = False
    ids = flat[mask]
    ends = np.cumsum(lengths.ravel())
    starts = (ends - lengths.ravel()).reshape(lengths.shape)
    del records, flat  # `ids` and `lengths` are copies: the read buffers can go back to the OS.
    _release_freed_memory()
    return ids, starts, lengths


def encoded_split(
  data_config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  split: str,
  texts: Texts,
) -> EncodedSplit:
  """The ids of `split`: `tokenizer.encode` of each of `texts(example)`, encoded once.

  Args:
    data_config: The config's data fields (`config.data`, which names the dataset).
    tokenizer: The vocabulary; its hash keys the ids.
    split: Split name.
    texts: Picklable; the texts of a data source element to encode, always as many;
      `texts.key` names them in the directory (e.g. `en-de`).

  Returns:
    The split's `EncodedSplit`, encoded now if it was not yet.
  """
  directory = ids_dir(data_config, tokenizer, texts.key)
  path = os.path.join(directory, f'{split}.array_record')
  meta_path = os.path.join(directory, f'{split}.json')
  vocab_hash = vocabulary_hash(tokenizer)
  meta = _read_meta(meta_path)
  if meta is not None and meta.get('vocabulary_sha256') != vocab_hash:
    logging.warning(
      '%s was encoded with another vocabulary (%s); encoding it again with %s.',
      path,
      meta.get('vocabulary_sha256'),
      vocab_hash,
    )
    meta = None
  if meta is None:
    meta = _encode(data_config, split, texts, tokenizer, directory, vocab_hash)
  return EncodedSplit(path, meta['num_texts'], meta['num_records'])


def _read_meta(meta_path: str) -> dict | None:
  try:
    with open(meta_path, encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    logging.warning('Unreadable %s (%s); encoding the split again.', meta_path, e)
    return None


def _encode(
  data_config: ml_collections.ConfigDict,
  split: str,
  texts: Texts,
  tokenizer: tokenizer_lib.Tokenizer,
  directory: str,
  vocab_hash: str,
) -> dict:
  """Encodes every example of `split` into `<directory>/<split>.array_record` (+ .json)."""
  os.makedirs(directory, exist_ok=True)
  source = datasets.get_data_source(data_config, split)
  num = len(source)
  blocks = [(start, min(start + _BLOCK, num)) for start in range(0, num, _BLOCK)]
  processes = min(os.cpu_count() or 1, len(blocks)) if num >= _PARALLEL_MIN_EXAMPLES else 1
  logging.info(
    'Encoding %d examples of split %s into %s (%d processes).', num, split, directory, processes
  )
  num_texts = None
  with atomic.replacing(os.path.join(directory, f'{split}.array_record')) as tmp:
    writer = array_record_module.ArrayRecordWriter(tmp, _WRITER_OPTIONS)
    # Both closed at once on an error or interrupt: the workers' queued blocks are cancelled,
    # and the progress bar ends before the error is printed.
    with (
      tqdm.tqdm(total=num, unit=' examples', desc=f'Encoding {split}') as progress,
      contextlib.closing(
        _encoded_blocks(data_config, split, texts, tokenizer, blocks, processes)
      ) as encoded_blocks,
    ):
      for encoded in encoded_blocks:
        for record in encoded:
          writer.write(record)
        progress.update(len(encoded))
    writer.close()
    if num:
      num_texts = len(texts(source[0]))
  meta = {
    'vocabulary_sha256': vocab_hash,
    'num_records': num,
    'num_texts': num_texts or 1,
    'record': 'int32: the length of each text, then the ids of each text',
  }
  atomic.write_json(os.path.join(directory, f'{split}.json'), meta, indent=1)
  return meta


def _encoded_blocks(
  data_config, split, texts, tokenizer, blocks, processes
) -> Iterator[list[bytes]]:
  """Encoded records of each block in order, from `processes` processes (1: this one)."""
  args = (data_config, split, texts, tokenizer)
  if processes == 1:
    _init_worker(*args)
    try:
      yield from map(_encode_block, blocks)
    finally:
      _worker.clear()
    return
  # Spawned, not forked: the training process may hold threads (JAX) that fork would copy.
  # An executor, not a Pool: a worker that dies or fails to start raises here (a Pool
  # would start another and wait forever).
  pool = concurrent.futures.ProcessPoolExecutor(
    processes, multiprocessing.get_context('spawn'), _init_worker, args
  )
  try:
    yield from pool.map(_encode_block, blocks)
  finally:  # On an error or interrupt, the blocks not yet started are dropped, not waited for.
    pool.shutdown(wait=True, cancel_futures=True)


_worker: dict[str, Any] = {}  # The encoding process's data source, texts and tokenizer.


def _init_worker(data_config, split, texts, tokenizer) -> None:
  # Each process opens the prepared data itself (TFDS sources do not pickle).
  source = datasets.get_data_source(data_config, split)
  _worker.update(source=source, texts=texts, tokenizer=tokenizer)


def _encode_block(block: tuple[int, int]) -> list[bytes]:
  """Records of `source[start:stop]` (in a worker process)."""
  source, texts, tokenizer = _worker['source'], _worker['texts'], _worker['tokenizer']
  examples = datasets.read_examples(source, list(range(*block)))
  fields = [texts(example) for example in examples]
  num_texts = len(fields[0])
  # Each text by its side's model (`texts.sides`: a translation's target by the target's).
  columns = [
    (tokenizer.target if side == 'target' else tokenizer).encode_batch([f[k] for f in fields])
    for k, side in enumerate(texts.sides)
  ]
  ids = [columns[k][i] for i in range(len(fields)) for k in range(num_texts)]
  lengths = np.fromiter(map(len, ids), np.int64, len(ids)).reshape(-1, num_texts)
  words = lengths.sum(1) + num_texts
  ends = np.cumsum(words)
  header = (ends - words)[:, None] + np.arange(num_texts)
  flat = np.empty(int(ends[-1]), RECORD_DTYPE)
  flat[header.ravel()] = lengths.ravel()
  is_id = np.ones(len(flat), bool)
  is_id[header.ravel()] = False
  flat[is_id] = np.fromiter(itertools.chain.from_iterable(ids), RECORD_DTYPE, int(lengths.sum()))
  data = flat.tobytes()
  return [
    data[4 * (end - n) : 4 * end] for end, n in zip(ends.tolist(), words.tolist(), strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class PairTexts:
  """The (source, target) texts of a translation data source element."""

  source_lang: str
  target_lang: str

  sides = ('source', 'target')  # Which side's vocabulary encodes each text.

  def __call__(self, example: Any) -> tuple[str, str]:
    return datasets.translation_pair(example, self.source_lang, self.target_lang)

  @property
  def key(self) -> str:
    return f'{self.source_lang}-{self.target_lang}'


@dataclasses.dataclass(frozen=True)
class DocumentText:
  """The one text of a language-model data source element."""

  sides = ('source',)

  def __call__(self, example: Any) -> tuple[str]:
    return (datasets.document_text(example),)

  @property
  def key(self) -> str:
    return 'text'
