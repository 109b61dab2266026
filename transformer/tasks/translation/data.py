"""Translation batches: parallel text packed for training and loss, sources batched for decoding.

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

Decoding reads sources in input order (`translation_batches`, or any lines with
`text_batches`); `translation_references` gives the targets in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import ml_collections
import numpy as np

from transformer import datasets, input_pipeline, packing, prepared_ids
from transformer import tokenizer as tokenizer_lib
from transformer.errors import InvalidInput

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
  counter: input_pipeline.Counter

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


def encoded_pairs(
  data_config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer, split: str
) -> prepared_ids.EncodedSplit:
  """The prepared ids of `split` (source and target), encoded first if needed."""
  texts = prepared_ids.PairTexts(data_config.source_lang, data_config.target_lang)
  return prepared_ids.encoded_split(data_config, tokenizer, split, texts)


def prepare_ids(data_config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> None:
  """Encodes the training and validation splits into ids now (else on first use)."""
  for split in (data_config.train_split, data_config.eval_split):
    encoded_pairs(data_config, tokenizer, split)


def train_iterator(
  data_config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  seed: int,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.DatasetIterator:
  """Returns the infinite iterator of packed training batches of one process.

  Reads `config.data.train_split`, keeps examples `shard_index::shard_count`,
  shuffles them with `config.seed` (differently each epoch), drops pairs with a
  side longer than `config.data.max_len` tokens (EOS included), packs rows of
  `config.data.max_len` and batches `train_rows(config, shard_count)` rows
  (`input_pipeline.packed_train_iterator`).

  Args:
    data_config: The config's data fields (`config.data`).
    tokenizer: The shared tokenizer.
    seed: The shuffle's seed (`config.seed`).
    shard_index: This process's index (`jax.process_index()`).
    shard_count: Number of processes (`jax.process_count()`).

  Returns:
    A grain `DatasetIterator`; `get_state()` / `set_state()` checkpoint its
    position.
  """
  split = encoded_pairs(data_config, tokenizer, data_config.train_split)
  dropped = input_pipeline.Counter(
    f'Dropped %d training pairs longer than config.data.max_len={data_config.max_len} '
    '(running count).'
  )
  return input_pipeline.packed_train_iterator(
    data_config,
    len(split),
    lambda length, open_rows: PackChunk(split, length, open_rows, False, dropped),
    seed=seed,
    shard_index=shard_index,
    shard_count=shard_count,
  )


def eval_batches(
  data_config: ml_collections.ConfigDict,
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
  `input_pipeline.eval_rows(config, rows_multiple_of)` rows, the last one padded with
  all-zero rows. With several processes, each packs the same global batches
  (so all of them run the same number of steps) and keeps its own block of
  rows: `shard_index` of `shard_count` equal blocks.

  Args:
    data_config: The config's data fields (`config.data`).
    tokenizer: The shared tokenizer.
    split: Split name, e.g. `config.data.eval_split`.
    rows_multiple_of: The mesh's batch shards; global rows are a multiple of it.
    shard_index: This process's index (`jax.process_index()`).
    shard_count: Number of processes (`jax.process_count()`).

  Returns:
    A grain `IterDataset` (iterate it once per evaluation).
  """
  encoded = encoded_pairs(data_config, tokenizer, split)
  truncated = input_pipeline.Counter(
    f'Truncated %d {split} pairs to config.data.max_eval_len='
    f'{data_config.max_eval_len} tokens (running count).'
  )
  return input_pipeline.packed_eval_batches(
    data_config,
    len(encoded),
    lambda length, open_rows: PackChunk(encoded, length, open_rows, True, truncated),
    data_config.max_eval_len,
    rows_multiple_of=rows_multiple_of,
    shard_index=shard_index,
    shard_count=shard_count,
  )


def _read_all(source: Sequence[Any]) -> Iterator[tuple[int, Any]]:
  """Yields (position, element) of a whole data source, in chunks."""
  getitems = getattr(source, '__getitems__', None)
  for start in range(0, len(source), input_pipeline.READ_CHUNK):
    positions = list(range(start, min(start + input_pipeline.READ_CHUNK, len(source))))
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


@dataclasses.dataclass(frozen=True)
class _EncodeSource:
  """Tokenizes the source of an (index, element) pair, truncating if needed."""

  tokenizer: tokenizer_lib.Tokenizer
  source_lang: str
  target_lang: str
  max_len: int
  truncated: input_pipeline.Counter

  def __call__(self, indexed: tuple[int, Any]) -> dict[str, Any]:
    index, example = indexed
    text, _ = datasets.translation_pair(example, self.source_lang, self.target_lang)
    return _encode_source(self.tokenizer, index, text, self.max_len, self.truncated)


def _encode_source(
  tokenizer: tokenizer_lib.Tokenizer,
  index: int,
  text: str,
  max_len: int,
  truncated: input_pipeline.Counter,
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
    length = input_pipeline.bucket_length(max(len(e['src']) for e in elements), self.max_len)
    tokens = np.zeros((self.batch_size, length), np.int32)
    index = np.full((self.batch_size,), -1, np.int32)
    valid = np.zeros((self.batch_size,), bool)
    for row, element in enumerate(elements):
      tokens[row, : len(element['src'])] = element['src']
      index[row] = element['index']
      valid[row] = True
    return {'src_tokens': tokens, 'index': index, 'valid': valid}


def translation_batches(
  data_config: ml_collections.ConfigDict,
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
    data_config: The config's data fields (`config.data`).
    tokenizer: The shared tokenizer.
    split: Split name.
    batch_size: Rows per batch.

  Returns:
    A finite grain `MapDataset` of batches (`len()` is the number of batches).
  """
  if batch_size < 1:
    raise InvalidInput(f'batch_size={batch_size} must be positive.')
  source = datasets.get_data_source(data_config, split)
  truncated = input_pipeline.Counter(
    f'Truncated %d {split} sources to config.data.max_eval_len='
    f'{data_config.max_eval_len} tokens (running count).'
  )
  encode = _EncodeSource(
    tokenizer, data_config.source_lang, data_config.target_lang, data_config.max_eval_len, truncated
  )
  ds = grain.MapDataset.source(_input_order(source)).map(encode)
  return ds.batch(batch_size, batch_fn=_PadTranslationBatch(batch_size, data_config.max_eval_len))


def translation_texts(data_config: ml_collections.ConfigDict, split: str) -> list[tuple[str, str]]:
  """Returns the (source, target) strings of a split in input order.

  Aligned with the valid rows of `translation_batches(config, ..., split, ...)`
  taken in order.
  """
  ordered = _input_order(datasets.get_data_source(data_config, split))
  return [
    datasets.translation_pair(ordered[i][1], data_config.source_lang, data_config.target_lang)
    for i in range(len(ordered))
  ]


def translation_references(data_config: ml_collections.ConfigDict, split: str) -> list[str]:
  """Returns the target strings of a split in input order (as `translation_texts`)."""
  return [target for _, target in translation_texts(data_config, split)]


@dataclasses.dataclass(frozen=True)
class _EncodeText:
  """Tokenizes an (index, raw text) pair like `_EncodeSource` does a dataset example."""

  tokenizer: tokenizer_lib.Tokenizer
  max_len: int
  truncated: input_pipeline.Counter

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
    raise InvalidInput(f'batch_size={batch_size} must be positive.')
  truncated = input_pipeline.Counter(
    f'Truncated %d input lines to {max_len} tokens (running count).'
  )
  indexed = [(i, text) for i, text in enumerate(texts) if text.strip()]
  ds = grain.MapDataset.source(indexed).map(_EncodeText(tokenizer, max_len, truncated))
  return ds.batch(batch_size, batch_fn=_PadTranslationBatch(batch_size, max_len))
