"""Grain input pipelines: packed training/eval batches and decoding batches.

Every batch of `train_iterator` and `eval_batches` is a dict of int32 arrays of
shape [rows, length]:

  src_tokens        source pieces, each segment ending with EOS.
  src_segments      1, 2, ... per packed example; 0 is padding.
  src_positions     position within the segment, restarting at 0.
  tgt_input_tokens  decoder input: BOS + target pieces (target shifted right).
  tgt_tokens        target pieces, each segment ending with EOS.
  tgt_segments      as src_segments, for both target arrays.
  tgt_positions     as src_positions, for both target arrays.

Token 0 (PAD) and segment 0 mean padding. Source and target are packed jointly:
a row's segment k on the source side is the same example as its segment k on
the target side.
"""

import dataclasses
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import logging

from transformer import datasets, packing, prepared_ids
from transformer import tokenizer as tokenizer_lib

# Read and pack in the consuming thread (a worker process, or the training process with
# `config.data.num_workers=0`): the packing loop is Python-bound, and reader threads
# would only contend for the GIL.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# Rows open for packing per row of a batch (grain's packing bins): more pack tighter.
PACKING_BINS_PER_ROW = 2
# Examples packed together per open row and per 16 positions of a row: rows are full
# but for the last open ones of each chunk, a small share of a chunk this long.
PACK_CHUNK_PER_ROW = 8
_READ_CHUNK = 1024  # Examples read at once when scanning a split.

Batch = dict[str, np.ndarray]
# Keys of every `train_iterator` / `eval_batches` batch.
BATCH_KEYS = (
    'src_tokens',
    'src_segments',
    'src_positions',
    'tgt_input_tokens',
    'tgt_tokens',
    'tgt_segments',
    'tgt_positions',
)


class _Counter:
  """Thread-safe running count, logged at 1, 2, 4, 8, ... occurrences."""

  def __init__(self, message: str):
    self._message = message
    self._count = 0
    self._lock = threading.Lock()

  def increment(self) -> None:
    with self._lock:
      self._count += 1
      count = self._count
    if count & (count - 1) == 0:
      logging.info(self._message, count)

  @property
  def count(self) -> int:
    return self._count

  def __reduce__(self):
    # A worker process counts on its own, from 0.
    return (_Counter, (self._message,))


@dataclasses.dataclass(frozen=True)
class PackChunk:
  """Reads a chunk of examples' prepared ids and packs them into rows of `length`.

  `__call__(indices)` returns a batch of the rows (the number of rows varies).
  Each example contributes one item per side: the source (`src_*`: pieces + EOS) and the target
  (`tgt_input_tokens`: BOS + pieces; `tgt_*`: pieces + EOS). Examples with a
  side longer than `length` (EOS included) are dropped (counted), or with
  `truncate` cut to fit (counted). Rows follow the chunk's order of examples
  (first fit: a row opens for the first example that fits nowhere yet).
  """

  split: prepared_ids.EncodedSplit
  length: int
  open_rows: int
  truncate: bool
  counter: _Counter

  def __call__(self, indices: np.ndarray) -> Batch:
    ids, starts, num_ids = self.split.read(indices)
    limit = self.length - 1  # Room for EOS (and BOS on the input).
    too_long = (num_ids > limit).any(axis=1)
    for _ in range(int(too_long.sum())):
      self.counter.increment()
    if self.truncate:
      num_ids = np.minimum(num_ids, limit)
    else:
      starts, num_ids = starts[~too_long], num_ids[~too_long]
    return packing.pack(
        {
            'src': packing.Windows.whole(ids, starts[:, 0], num_ids[:, 0], with_inputs=False),
            'tgt': packing.Windows.whole(ids, starts[:, 1], num_ids[:, 1], with_inputs=True),
        },
        self.length,
        self.open_rows,
    )


def chunk_examples(rows: int, length: int) -> int:
  """Examples (or documents) packed at once into batches of `rows` rows of `length`."""
  return PACK_CHUNK_PER_ROW * PACKING_BINS_PER_ROW * rows * max(1, length // 16)


def packed_batches(
    chunks: grain.MapDataset, rows: int, num_workers: int, *, drop_remainder: bool
) -> grain.IterDataset:
  """Packed chunks -> batches of `rows` rows, in `num_workers` processes (0: this one).

  Each worker packs and batches every `num_workers`-th chunk; grain interleaves
  their batches deterministically and checkpoints every worker's position. An
  exception in a worker is re-raised by `next` with the worker's traceback; a
  worker killed from outside (out of memory) makes `next` raise `RuntimeError:
  Worker process was terminated unexpectedly with exit code -9`.
  """
  it = chunks.to_iter_dataset(READ_OPTIONS)
  it = grain.experimental.RebatchIterDataset(it, rows, drop_remainder=drop_remainder)
  if num_workers:
    it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return it


def train_rows(config: ml_collections.ConfigDict, shard_count: int = 1) -> int:
  """Rows per training batch on one process.

  `config.data.tokens_per_batch // config.data.max_len // shard_count`.

  Raises:
    ValueError: If that is less than 1 or a division is inexact.
  """
  tokens, max_len = config.data.tokens_per_batch, config.data.max_len
  if max_len < 1 or tokens % max_len:
    raise ValueError(
        f'config.data.tokens_per_batch={tokens} must be a positive multiple of '
        f'config.data.max_len={max_len}.'
    )
  global_rows = tokens // max_len
  if global_rows < shard_count or global_rows % shard_count:
    raise ValueError(
        f'config.data.tokens_per_batch // config.data.max_len = {global_rows} '
        f'rows must be a positive multiple of the process count {shard_count}.'
    )
  return global_rows // shard_count


def encoded_pairs(
    config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer, split: str
) -> prepared_ids.EncodedSplit:
  """The prepared ids of `split` (source and target), encoded first if needed."""
  texts = prepared_ids.PairTexts(config.data.source_lang, config.data.target_lang)
  return prepared_ids.encoded_split(config, tokenizer, split, texts)


def prepare_ids(config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> None:
  """Encodes the training and validation splits into ids now (else on first use)."""
  for split in (config.data.train_split, config.data.eval_split):
    encoded_pairs(config, tokenizer, split)


def train_iterator(
    config: ml_collections.ConfigDict,
    tokenizer: tokenizer_lib.Tokenizer,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.DatasetIterator:
  """Returns the infinite iterator of packed training batches of one process.

  Reads `config.data.train_split`, keeps examples `shard_index::shard_count`,
  shuffles them with `config.seed` (differently each epoch), drops pairs with a
  side longer than `config.data.max_len` tokens (EOS included), packs rows of
  `config.data.max_len` and batches `train_rows(config, shard_count)` rows.

  Args:
    config: The full config.
    tokenizer: The shared tokenizer.
    shard_index: This process's index (`jax.process_index()`).
    shard_count: Number of processes (`jax.process_count()`).

  Returns:
    A grain `DatasetIterator`; `get_state()` / `set_state()` checkpoint its
    position.
  """
  rows = train_rows(config, shard_count)
  if not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index={shard_index} not in [0, {shard_count}).')
  data = config.data
  split = encoded_pairs(config, tokenizer, data.train_split)
  dropped = _Counter(
      f'Dropped %d training pairs longer than config.data.max_len={data.max_len} '
      '(running count).'
  )
  ds = grain.MapDataset.range(len(split))[shard_index::shard_count]
  ds = ds.shuffle(seed=config.seed).repeat(None).batch(chunk_examples(rows, data.max_len))
  ds = ds.map(PackChunk(split, data.max_len, rows * PACKING_BINS_PER_ROW, False, dropped))
  return iter(packed_batches(ds, rows, data.num_workers, drop_remainder=True))


def eval_rows(config: ml_collections.ConfigDict, multiple_of: int = 1) -> int:
  """Global rows per eval batch: `tokens_per_batch // max_eval_len`, at least 1,
  rounded up to a multiple of `multiple_of` (the batch shards of the mesh)."""
  rows = max(1, config.data.tokens_per_batch // config.data.max_eval_len)
  return -(-rows // multiple_of) * multiple_of


@dataclasses.dataclass(frozen=True)
class ProcessRows:
  """This process's contiguous block of the rows of a global batch."""

  shard_index: int
  shard_count: int

  def __call__(self, batch: Batch) -> Batch:
    rows = next(iter(batch.values())).shape[0] // self.shard_count
    return {k: v[self.shard_index * rows:(self.shard_index + 1) * rows] for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class PadRows:
  """Pads a batch with all-zero rows up to `rows` rows."""

  rows: int

  def __call__(self, batch: Batch) -> Batch:
    return {
        k: np.pad(v, [(0, self.rows - v.shape[0])] + [(0, 0)] * (v.ndim - 1))
        for k, v in batch.items()
    }


def eval_batches(
    config: ml_collections.ConfigDict,
    tokenizer: tokenizer_lib.Tokenizer,
    split: str,
    *,
    rows_multiple_of: int = 1,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.IterDataset:
  """Returns the packed batches of a whole split, for loss evaluation.

  Finite and deterministic; every example of the split is in exactly one row
  of one global batch. Pairs with a side longer than `config.data.max_eval_len`
  tokens are truncated to fit (counted and logged), never dropped. Rows have
  `config.data.max_eval_len` tokens; every global batch has
  `eval_rows(config, rows_multiple_of)` rows, the last one padded with
  all-zero rows. With several processes, each packs the same global batches
  (so all of them run the same number of steps) and keeps its own block of
  rows: `shard_index` of `shard_count` equal blocks.

  Args:
    config: The full config.
    tokenizer: The shared tokenizer.
    split: Split name, e.g. `config.data.eval_split`.
    rows_multiple_of: The mesh's batch shards; global rows are a multiple of it.
    shard_index: This process's index (`jax.process_index()`).
    shard_count: Number of processes (`jax.process_count()`).

  Returns:
    A grain `IterDataset` (iterate it once per evaluation).
  """
  data = config.data
  rows = eval_rows(config, math.lcm(rows_multiple_of, shard_count))
  if not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index={shard_index} not in [0, {shard_count}).')
  encoded = encoded_pairs(config, tokenizer, split)
  truncated = _Counter(
      f'Truncated %d {split} pairs to config.data.max_eval_len='
      f'{data.max_eval_len} tokens (running count).'
  )
  ds = grain.MapDataset.range(len(encoded)).batch(chunk_examples(rows, data.max_eval_len))
  ds = ds.map(
      PackChunk(encoded, data.max_eval_len, rows * PACKING_BINS_PER_ROW, True, truncated))
  it = packed_batches(ds, rows, 0, drop_remainder=False).map(PadRows(rows))
  return it.map(ProcessRows(shard_index, shard_count)) if shard_count > 1 else it


def _read_all(source: Sequence[Any]) -> Iterator[tuple[int, Any]]:
  """Yields (position, element) of a whole data source, in chunks."""
  getitems = getattr(source, '__getitems__', None)
  for start in range(0, len(source), _READ_CHUNK):
    positions = list(range(start, min(start + _READ_CHUNK, len(source))))
    chunk = getitems(positions) if getitems else [source[i] for i in positions]
    yield from zip(positions, chunk, strict=True)


@dataclasses.dataclass(frozen=True)
class _InputOrder:
  """A data source viewed in input order (by the `index` feature)."""

  source: Sequence[Any]
  order: np.ndarray  # Positions in `source`, sorted by index.
  indices: np.ndarray  # The index of each position of `order`.

  def __len__(self) -> int:
    return len(self.order)

  def __getitem__(self, i: int) -> tuple[int, Any]:
    return int(self.indices[i]), self.source[int(self.order[i])]


def _input_order(source: Sequence[Any]) -> _InputOrder:
  indices = np.array(
      [datasets.example_index(ex, pos) for pos, ex in _read_all(source)],
      np.int64,
  )
  order = np.argsort(indices, kind='stable')
  return _InputOrder(source, order, indices[order])


def bucket_length(length: int, max_length: int) -> int:
  """Smallest power of two >= `length` (at least 8), capped at `max_length`
  rounded up to a multiple of 8."""
  cap = -(-max_length // 8) * 8
  bucket = 8
  while bucket < length:
    bucket *= 2
  return min(bucket, cap)


@dataclasses.dataclass(frozen=True)
class _EncodeSource:
  """Tokenizes the source of an (index, element) pair, truncating if needed."""

  tokenizer: tokenizer_lib.Tokenizer
  source_lang: str
  target_lang: str
  max_len: int
  truncated: _Counter

  def __call__(self, indexed: tuple[int, Any]) -> dict[str, Any]:
    index, example = indexed
    text, _ = datasets.translation_pair(example, self.source_lang, self.target_lang)
    return _encode_source(self.tokenizer, index, text, self.max_len, self.truncated)


def _encode_source(
    tokenizer: tokenizer_lib.Tokenizer,
    index: int,
    text: str,
    max_len: int,
    truncated: _Counter,
) -> dict[str, Any]:
  """Source pieces + EOS, cut to `max_len` tokens (counted), with the input index."""
  ids = tokenizer.encode(text)
  if len(ids) > max_len - 1:
    ids = ids[: max_len - 1]
    truncated.increment()
  return {'src': np.asarray(ids + [tokenizer_lib.EOS_ID], np.int32), 'index': index}


@dataclasses.dataclass(frozen=True)
class _PadTranslationBatch:
  """Stacks encoded sources into a [batch_size, bucket] batch."""

  batch_size: int
  max_len: int

  def __call__(self, elements: Sequence[Mapping[str, Any]]) -> Batch:
    length = bucket_length(max(len(e['src']) for e in elements), self.max_len)
    tokens = np.zeros((self.batch_size, length), np.int32)
    index = np.full((self.batch_size,), -1, np.int32)
    valid = np.zeros((self.batch_size,), bool)
    for row, element in enumerate(elements):
      tokens[row, : len(element['src'])] = element['src']
      index[row] = element['index']
      valid[row] = True
    return {'src_tokens': tokens, 'index': index, 'valid': valid}


def translation_batches(
    config: ml_collections.ConfigDict,
    tokenizer: tokenizer_lib.Tokenizer,
    split: str,
    batch_size: int,
) -> grain.MapDataset:
  """Returns source batches of a split in input order, for decoding.

  Each batch: `src_tokens` int32 [batch_size, L] (source pieces + EOS, padded
  with 0; L is a power of two >= 8, at most `config.data.max_eval_len` rounded
  up to a multiple of 8, so few shapes occur), `index` int32 [batch_size] (the
  example's 0-based line in the source file; -1 on padding rows) and `valid`
  bool [batch_size] (False on the padding rows of the last batch). Sources
  longer than `config.data.max_eval_len` tokens are truncated (counted and
  logged).

  Lines that are empty in the source or target file were dropped when the data
  was prepared, so their `index` never occurs: to write one output line per
  input line, place each hypothesis at its `index` and leave the others empty
  (`datasets.split_num_lines` gives the file's line count). Catalog datasets
  (WMT) have no line index; their `index` is the position in the data source.

  Args:
    config: The full config.
    tokenizer: The shared tokenizer.
    split: Split name.
    batch_size: Rows per batch.

  Returns:
    A finite grain `MapDataset` of batches (`len()` is the number of batches).
  """
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be positive.')
  data = config.data
  source = datasets.get_data_source(data, split)
  truncated = _Counter(
      f'Truncated %d {split} sources to config.data.max_eval_len='
      f'{data.max_eval_len} tokens (running count).'
  )
  encode = _EncodeSource(
      tokenizer, data.source_lang, data.target_lang, data.max_eval_len, truncated
  )
  ds = grain.MapDataset.source(_input_order(source)).map(encode)
  return ds.batch(
      batch_size, batch_fn=_PadTranslationBatch(batch_size, data.max_eval_len)
  )


def translation_references(config: ml_collections.ConfigDict, split: str) -> list[str]:
  """Returns the target strings of a split in input order.

  Aligned with the valid rows of `translation_batches(config, ..., split, ...)`
  taken in order.
  """
  data = config.data
  source = datasets.get_data_source(data, split)
  ordered = _input_order(source)
  return [
      datasets.translation_pair(ordered[i][1], data.source_lang, data.target_lang)[1]
      for i in range(len(ordered))
  ]


@dataclasses.dataclass(frozen=True)
class _EncodeText:
  """Tokenizes an (index, raw text) pair like `_EncodeSource` does a dataset example."""

  tokenizer: tokenizer_lib.Tokenizer
  max_len: int
  truncated: _Counter

  def __call__(self, indexed: tuple[int, str]) -> dict[str, Any]:
    index, text = indexed
    return _encode_source(self.tokenizer, index, text, self.max_len, self.truncated)


def text_batches(
    texts: Sequence[str],
    tokenizer: tokenizer_lib.Tokenizer,
    batch_size: int,
    max_len: int,
) -> grain.MapDataset:
  """Batches of arbitrary source sentences, shaped like `translation_batches`' batches.

  Empty or whitespace-only lines are skipped (their `index` never occurs), so a
  caller writing one output per input line leaves them empty.
  """
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be positive.')
  truncated = _Counter(f'Truncated %d input lines to {max_len} tokens (running count).')
  indexed = [(i, text) for i, text in enumerate(texts) if text.strip()]
  ds = grain.MapDataset.source(indexed).map(_EncodeText(tokenizer, max_len, truncated))
  return ds.batch(batch_size, batch_fn=_PadTranslationBatch(batch_size, max_len))
