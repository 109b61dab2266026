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

from transformer import datasets
from transformer import tokenizer as tokenizer_lib

# Read and tokenize in the consuming thread: the work is Python-bound, and
# reader threads only contend for the GIL (measured ~3x slower on 2 cores).
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# Packing bins per batch of rows: more bins pack tighter.
PACKING_BINS_PER_ROW = 2
_READ_CHUNK = 1024  # Examples read at once when scanning a split.
# Training splits up to this many examples keep their tokenized examples in
# memory after first use, so later epochs skip reading and tokenizing.
MEMOIZE_MAX_EXAMPLES = 1_000_000

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


@dataclasses.dataclass(frozen=True)
class _EncodePair:
  """Tokenizes a data source element into source, decoder input and target.

  With `truncate_to`, each side is cut to at most `truncate_to` tokens (EOS
  kept last) and truncated pairs are counted.
  """

  tokenizer: tokenizer_lib.Tokenizer
  source_lang: str
  target_lang: str
  truncate_to: int | None = None
  truncated: _Counter | None = None

  def __call__(self, example: Mapping[str, Any]) -> dict[str, np.ndarray]:
    src_text, tgt_text = datasets.translation_pair(
        example, self.source_lang, self.target_lang
    )
    src = self.tokenizer.encode(src_text)
    tgt = self.tokenizer.encode(tgt_text)
    if self.truncate_to is not None:
      limit = self.truncate_to - 1  # Room for EOS (and BOS on the input).
      if len(src) > limit or len(tgt) > limit:
        src, tgt = src[:limit], tgt[:limit]
        if self.truncated is not None:
          self.truncated.increment()
    return {
        'src': np.asarray(src + [tokenizer_lib.EOS_ID], np.int32),
        'tgt_in': np.asarray([tokenizer_lib.BOS_ID] + tgt, np.int32),
        'tgt': np.asarray(tgt + [tokenizer_lib.EOS_ID], np.int32),
    }


@dataclasses.dataclass(frozen=True)
class _FitsMaxLen:
  """Keeps pairs whose sides (with EOS) have at most `max_len` tokens."""

  max_len: int
  dropped: _Counter

  def __call__(self, element: Mapping[str, np.ndarray]) -> bool:
    if len(element['src']) <= self.max_len and len(element['tgt']) <= self.max_len:
      return True
    self.dropped.increment()
    return False


class Memoized:
  """Random-access source of `transform(source[i])`, computed once per index.

  Only the first epoch reads and tokenizes; the result must not depend on
  anything but the element (no randomness). Safe for grain's reader threads: at
  worst an element is computed twice.
  """

  def __init__(self, source: Sequence[Any], transform: Any):
    self._source = source
    self._transform = transform
    self._cache: dict[int, Any] = {}

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> Any:
    element = self._cache.get(index)
    if element is None:
      element = self._cache[index] = self._transform(self._source[index])
    return element


# Batch key -> the packer's key (`tgt_in` shares `tgt`'s segments and positions).
_PACKED_KEYS = {
    'src_tokens': 'src',
    'src_segments': 'src_segment_ids',
    'src_positions': 'src_positions',
    'tgt_input_tokens': 'tgt_in',
    'tgt_tokens': 'tgt',
    'tgt_segments': 'tgt_segment_ids',
    'tgt_positions': 'tgt_positions',
}


def rename_packed(packed: Mapping[str, np.ndarray]) -> Batch:
  """Maps the packer's keys to the batch keys, for the sides present (an LM has no source)."""
  return {key: packed[name] for key, name in _PACKED_KEYS.items() if name in packed}


def _pack(
    ds: grain.IterDataset, length: int, rows: int, *, seed: int, shuffle: bool
) -> grain.IterDataset:
  """Packs source and target jointly into rows of `length` tokens."""
  ds = grain.experimental.FirstFitPackIterDataset(
      ds,
      length_struct={'src': length, 'tgt_in': length, 'tgt': length},
      num_packing_bins=rows * PACKING_BINS_PER_ROW,
      seed=seed,
      shuffle_bins=shuffle,
  )
  return ds.map(rename_packed)


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
  source = datasets.get_data_source(data, data.train_split)
  dropped = _Counter(
      f'Dropped %d training pairs longer than config.data.max_len={data.max_len} '
      '(running count).'
  )
  encode = _EncodePair(tokenizer, data.source_lang, data.target_lang)
  if len(source) <= MEMOIZE_MAX_EXAMPLES:
    ds = grain.MapDataset.source(Memoized(source, encode))
  else:
    ds = grain.MapDataset.source(source).map(encode)
  ds = ds[shard_index::shard_count].shuffle(seed=config.seed).repeat(None)
  ds = ds.filter(_FitsMaxLen(data.max_len, dropped))
  it = ds.to_iter_dataset(READ_OPTIONS)
  it = _pack(it, data.max_len, rows, seed=config.seed, shuffle=True)
  return iter(it.batch(rows, drop_remainder=True))


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
  source = datasets.get_data_source(data, split)
  truncated = _Counter(
      f'Truncated %d {split} pairs to config.data.max_eval_len='
      f'{data.max_eval_len} tokens (running count).'
  )
  encode = _EncodePair(
      tokenizer, data.source_lang, data.target_lang, data.max_eval_len, truncated
  )
  it = grain.MapDataset.source(source).map(encode).to_iter_dataset(READ_OPTIONS)
  it = _pack(it, data.max_eval_len, rows, seed=config.seed, shuffle=False)
  it = it.batch(rows, drop_remainder=False).map(PadRows(rows))
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
