"""Language-model batches: documents cut into windows and packed; prompts batched for decoding.

The batches are the target half of the translation batches
(`tasks.translation.data`), int32 arrays of shape [rows, length] under the same keys:

  tgt_input_tokens  decoder input: BOS + document pieces (shifted right).
  tgt_tokens        document pieces + EOS.
  tgt_segments      1, 2, ... per packed window; 0 is padding.
  tgt_positions     position within the window, restarting at 0.

A document is one example of the dataset (a line of `text_lines`, a sentence of
`lm1b`) or, with `config.data.lines_per_document` = N > 1, N consecutive
examples joined by a space (running text longer than a line). Its token stream
(BOS, pieces, EOS) is cut into windows of `length` predictions: `max_len` in
training, `max_eval_len` (or any length asked for) in evaluation. Each window
is a segment of its own, so attention never crosses a document boundary (nor a
window boundary), and short windows are packed several to a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import ml_collections
import numpy as np

from transformer import datasets, input_pipeline, packing, prepared_ids
from transformer import tokenizer as tokenizer_lib
from transformer.errors import InvalidInput

Batch = dict[str, np.ndarray]
# Keys of every `train_iterator` / `eval_batches` batch.
BATCH_KEYS = ('tgt_input_tokens', 'tgt_tokens', 'tgt_segments', 'tgt_positions')


class Documents(Sequence[str]):
  """Random access to the documents of a split: `lines` consecutive examples, space-joined.

  The examples are read in the order of the data source: file order for
  `text_lines` (its TFDS shuffling is disabled for this), the catalog's order
  for `lm1b`.
  """

  def __init__(self, source: Sequence[Any], lines: int):
    if lines < 1:
      raise InvalidInput(f'config.data.lines_per_document={lines} must be positive.')
    self._source = source
    self._lines = lines

  def __len__(self) -> int:
    return -(-len(self._source) // self._lines)

  def __getitem__(self, index: int) -> str:
    if not 0 <= index < len(self):
      raise IndexError(index)
    positions = range(index * self._lines, min((index + 1) * self._lines, len(self._source)))
    getitems = getattr(self._source, '__getitems__', None)
    examples = getitems(list(positions)) if getitems else [self._source[i] for i in positions]
    return ' '.join(datasets.document_text(example) for example in examples)


def documents(data_config: ml_collections.ConfigDict, split: str) -> Documents:
  """The documents of `split` of `config.data.dataset` (prepared if needed)."""
  source = datasets.get_data_source(data_config, split)
  return Documents(source, data_config.lines_per_document)


def encoded_lines(
  data_config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer, split: str
) -> prepared_ids.EncodedSplit:
  """The prepared ids of the examples (lines) of `split`, encoded first if needed."""
  return prepared_ids.encoded_split(data_config, tokenizer, split, prepared_ids.DocumentText())


def prepare_ids(data_config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> None:
  """Encodes the training and validation splits into ids now (else on first use)."""
  for split in (data_config.train_split, data_config.eval_split):
    encoded_lines(data_config, tokenizer, split)


@dataclasses.dataclass(frozen=True)
class PackDocuments:
  """Reads a chunk of documents' prepared ids and packs their windows into rows of `length`.

  `__call__(documents)` returns a batch of the rows (in the order of the documents,
  first fit). Document d is lines `d * lines ... d * lines + lines - 1`;
  its ids are its lines' ids one after the other (SentencePiece splits at
  whitespace, so this is the encoding of the space-joined lines).
  """

  split: prepared_ids.EncodedSplit
  lines: int
  length: int
  open_rows: int

  def __call__(self, documents: np.ndarray) -> Batch:
    documents = np.asarray(documents, np.int64)
    counts = np.minimum(self.lines, len(self.split) - documents * self.lines)
    first = np.cumsum(counts) - counts
    lines = np.repeat(documents * self.lines - first, counts) + np.arange(counts.sum())
    ids, starts, num_ids = self.split.read(lines)
    doc_starts = starts[first, 0]
    doc_ids = np.add.reduceat(num_ids[:, 0], first) if len(first) else num_ids[:0, 0]
    # Windows of `length` positions of each stream (ids + EOS, or BOS + ids).
    windows = -(-(doc_ids + 1) // self.length)
    item = np.repeat(np.arange(len(documents)), windows)
    offsets = np.arange(windows.sum()) - np.repeat(np.cumsum(windows) - windows, windows)
    offsets *= self.length
    lengths = np.minimum(self.length, doc_ids[item] + 1 - offsets)
    return packing.pack(
      {
        'tgt': packing.Windows(
          ids, doc_starts[item], doc_ids[item], offsets, lengths, with_inputs=True
        )
      },
      self.length,
      self.open_rows,
    )


def _num_documents(split: prepared_ids.EncodedSplit, lines: int) -> int:
  return -(-len(split) // lines)


def train_iterator(
  data_config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  seed: int,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.DatasetIterator:
  """The infinite iterator of packed training batches of one process.

  As `translation.data.train_iterator`, with documents instead of sentence pairs:
  documents `shard_index::shard_count` of `config.data.train_split`, shuffled
  with `config.seed` (differently each epoch), cut into windows of
  `config.data.max_len` (nothing is dropped), packed, `train_rows` rows a
  batch, in `config.data.num_workers` worker processes. `get_state()` /
  `set_state()` checkpoint its position.
  """
  split = encoded_lines(data_config, tokenizer, data_config.train_split)
  return input_pipeline.packed_train_iterator(
    data_config,
    _num_documents(split, data_config.lines_per_document),
    lambda length, open_rows: PackDocuments(
      split, data_config.lines_per_document, length, open_rows
    ),
    seed=seed,
    shard_index=shard_index,
    shard_count=shard_count,
  )


def eval_batches(
  data_config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  split: str,
  length: int | None = None,
  *,
  rows_multiple_of: int = 1,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.IterDataset:
  """The packed batches of a whole split, for perplexity.

  Finite and deterministic: every token of every document is predicted exactly
  once, in windows of `length` (default `config.data.max_eval_len`) tokens,
  packed into rows of `length`; `tokens_per_batch // length` global rows a
  batch (at least 1, rounded up to a multiple of `rows_multiple_of` and
  `shard_count`), the last batch padded with all-zero rows. With several
  processes each keeps its own block of rows (`input_pipeline.packed_eval_batches`).
  With a `length` beyond the training `max_len` this scores positions the model
  never trained on (the length-extrapolation study).
  """
  encoded = encoded_lines(data_config, tokenizer, split)
  lines = data_config.lines_per_document
  return input_pipeline.packed_eval_batches(
    data_config,
    _num_documents(encoded, lines),
    lambda length, open_rows: PackDocuments(encoded, lines, length, open_rows),
    length or data_config.max_eval_len,
    rows_multiple_of=rows_multiple_of,
    shard_index=shard_index,
    shard_count=shard_count,
  )


@dataclasses.dataclass(frozen=True)
class _PadPrompts:
  """Stacks encoded prompts into a [batch_size, bucket] batch (0-padded on the right)."""

  batch_size: int
  max_len: int

  def __call__(self, elements: Sequence[Mapping[str, Any]]) -> Batch:
    longest = max(len(e['prompt']) for e in elements)
    length = input_pipeline.bucket_length(longest, self.max_len)
    tokens = np.zeros((self.batch_size, length), np.int32)
    index = np.full((self.batch_size,), -1, np.int32)
    valid = np.zeros((self.batch_size,), bool)
    for row, element in enumerate(elements):
      tokens[row, : len(element['prompt'])] = element['prompt']
      index[row], valid[row] = element['index'], True
    return {'prompt_tokens': tokens, 'index': index, 'valid': valid}


@dataclasses.dataclass(frozen=True)
class _EncodePrompt:
  tokenizer: tokenizer_lib.Tokenizer
  max_len: int

  def __call__(self, indexed: tuple[int, str]) -> dict[str, Any]:
    index, text = indexed
    ids = self.tokenizer.encode(text)
    if len(ids) > self.max_len:
      raise InvalidInput(f'Prompt {index + 1} has {len(ids)} tokens; at most {self.max_len} fit.')
    return {'prompt': np.asarray(ids, np.int32), 'index': index}


def prompt_batches(
  prompts: Sequence[str],
  tokenizer: tokenizer_lib.Tokenizer,
  batch_size: int,
  max_len: int,
) -> grain.MapDataset:
  """Batches of prompts to continue, in input order.

  Each batch: `prompt_tokens` int32 [batch_size, P] (the prompt's pieces, no BOS
  or EOS, 0-padded on the right; P a power of two >= 8 as in
  `translation.data.translation_batches`, so few shapes compile), `index` int32 [batch_size]
  (the prompt's position in `prompts`; -1 on padding rows) and `valid` bool.
  An empty prompt is allowed: the model then writes a document from scratch.
  A prompt of more than `max_len` pieces is an error naming it.
  """
  if batch_size < 1:
    raise InvalidInput(f'batch_size={batch_size} must be positive.')
  ds = grain.MapDataset.source(list(enumerate(prompts))).map(_EncodePrompt(tokenizer, max_len))
  return ds.batch(batch_size, batch_fn=_PadPrompts(batch_size, max_len))
