"""The translation task: parallel text, the encoder-decoder model, loss and BLEU, beam search.

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

Decoding (`translate`) is the model side of the decoders' contract in
`decoding.py`: `_init_state` encodes the source once and builds the decoder's
cache (self-attention key/value buffers plus the cross-attention keys and
values of the encoder output); `_logits_fn` runs one decoder step.
Everything is a pure function of (params, source tokens, key), jitted once
per source length. Evaluation translates a split and scores it with sacreBLEU
(`evaluate_split`), or follows a training run (`watch`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import Mesh

from transformer import (
  checkpoints,
  datasets,
  decoding,
  inference,
  input_pipeline,
  metrics,
  packing,
  prepared_ids,
  scoring,
  sharding,
  workdir_lock,
)
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer

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
  `config.data.max_len` and batches `train_rows(config, shard_count)` rows
  (`input_pipeline.packed_train_iterator`).

  Args:
    config: The full config.
    tokenizer: The shared tokenizer.
    shard_index: This process's index (`jax.process_index()`).
    shard_count: Number of processes (`jax.process_count()`).

  Returns:
    A grain `DatasetIterator`; `get_state()` / `set_state()` checkpoint its
    position.
  """
  data = config.data
  split = encoded_pairs(config, tokenizer, data.train_split)
  dropped = input_pipeline.Counter(
    f'Dropped %d training pairs longer than config.data.max_len={data.max_len} (running count).'
  )
  return input_pipeline.packed_train_iterator(
    config,
    len(split),
    lambda length, open_rows: PackChunk(split, length, open_rows, False, dropped),
    shard_index=shard_index,
    shard_count=shard_count,
  )


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
  `input_pipeline.eval_rows(config, rows_multiple_of)` rows, the last one padded with
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
  encoded = encoded_pairs(config, tokenizer, split)
  truncated = input_pipeline.Counter(
    f'Truncated %d {split} pairs to config.data.max_eval_len='
    f'{data.max_eval_len} tokens (running count).'
  )
  return input_pipeline.packed_eval_batches(
    config,
    len(encoded),
    lambda length, open_rows: PackChunk(encoded, length, open_rows, True, truncated),
    data.max_eval_len,
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
  truncated = input_pipeline.Counter(
    f'Truncated %d {split} sources to config.data.max_eval_len='
    f'{data.max_eval_len} tokens (running count).'
  )
  encode = _EncodeSource(
    tokenizer, data.source_lang, data.target_lang, data.max_eval_len, truncated
  )
  ds = grain.MapDataset.source(_input_order(source)).map(encode)
  return ds.batch(batch_size, batch_fn=_PadTranslationBatch(batch_size, data.max_eval_len))


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
    raise ValueError(f'batch_size={batch_size} must be positive.')
  truncated = input_pipeline.Counter(
    f'Truncated %d input lines to {max_len} tokens (running count).'
  )
  indexed = [(i, text) for i, text in enumerate(texts) if text.strip()]
  ds = grain.MapDataset.source(indexed).map(_EncodeText(tokenizer, max_len, truncated))
  return ds.batch(batch_size, batch_fn=_PadTranslationBatch(batch_size, max_len))


# --- Decoding -------------------------------------------------------------------------------------


def _init_state(params, src_tokens_BS: jax.Array, model_config: ModelConfig, max_decode_len: int):
  """Encodes the source and creates the decoding cache (index 0, cross K/V filled)."""
  model = Transformer(
    model_config.replace(deterministic=True, decode=True, max_decode_len=max_decode_len)
  )
  src_segments_BS = (src_tokens_BS != 0).astype(jnp.int32)
  encoded_BSD = model.apply(
    {'params': params}, src_tokens_BS, src_segments_BS, method=Transformer.encode
  )
  bos_B1 = jnp.full((src_tokens_BS.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply(
    {'params': params},
    encoded_BSD,
    src_segments_BS,
    bos_B1,
    method=Transformer.decode,
    mutable=['cache'],
  )
  return model, {'cache': variables['cache'], 'src_segments': src_segments_BS}


def _logits_fn(model: Transformer, params):
  """One decoder step: (tokens [N, 1], state) -> (logits [N, V], state)."""

  def step(tokens_N1, state):
    # The encoder output is only read when the cache is created; steps use the
    # cross-attention keys and values held in the cache.
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']},
      None,
      state['src_segments'],
      tokens_N1,
      method=Transformer.decode,
      mutable=['cache'],
    )
    return logits_N1V[:, 0], {**state, 'cache': variables['cache']}

  return step


# Decoding-state leaves that are equal across the beams of a sentence (the encoder output's
# keys/values and the source segments): beam search leaves them where they are.
_BEAM_INVARIANT = ('cross_key', 'cross_value', 'src_segments')


def _reorder_beam_state(state, beam_indices_BW: jax.Array):
  """`decoding.reorder_beam_rows` on every leaf but the beam-invariant ones."""

  def reorder(path, x):
    if any(getattr(key, 'key', None) in _BEAM_INVARIANT for key in path):
      return x
    return decoding.reorder_beam_rows(x, beam_indices_BW)

  return jax.tree_util.tree_map_with_path(reorder, state)


def first_pass_steps(src_len: int, max_decode_len: int) -> int:
  """Steps of the first decoding pass (`inference.TwoPass`) for sources of width `src_len`.

  Twice the width: a translation rarely needs more, while the length limit, the
  width + `max_extra_len` (50), is usually far longer. Every step costs in
  proportion to the self-attention cache, which is sized to the pass's steps. At
  least 24: with shorter caches XLA:CPU sums the attention in another order, and
  the logits would differ from one pass's in the last bits (docs/benchmarks.md).
  """
  return min(max_decode_len, max(24, 2 * src_len))


def translate(
  params,
  src_tokens_BS: jax.Array,
  rng: jax.Array,
  *,
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  first_pass: bool = False,
) -> decoding.Decoded:
  """Best translation of each source row: tokens int32 [B, S + max_extra_len], 0-padded after EOS.

  Each row's output is limited to its own source length + `max_extra_len`
  tokens (EOS included), as in the paper. With `first_pass`, only
  `first_pass_steps` steps are decoded (the rest of each row is padding) and
  `done` says which rows finished within them.
  """
  src_len = src_tokens_BS.shape[1]
  max_decode_len = src_len + options.max_extra_len
  max_steps = first_pass_steps(src_len, max_decode_len) if first_pass else max_decode_len
  model, state = _init_state(params, src_tokens_BS, model_config, max_steps)
  src_lengths_B = jnp.sum(src_tokens_BS != 0, axis=1).astype(jnp.int32)
  # An all-PAD row (batch padding) is no sentence: one step ends it, instead of its running
  # to the length limit and holding up the loop.
  max_lengths_B = jnp.where(src_lengths_B > 0, src_lengths_B + options.max_extra_len, 1)
  decoded = inference.run_decoder(
    _logits_fn(model, params),
    state,
    rng,
    options,
    max_decode_len,
    max_lengths_B,
    _reorder_beam_state,
    max_steps=max_steps,
  )
  return decoded._replace(tokens=jnp.pad(decoded.tokens, [(0, 0), (0, max_decode_len - max_steps)]))


def make_translate_fn(
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
):
  """`translate(params, src_tokens, rng) -> tokens` as a host array, jitted per source shape.

  Beam search runs in two passes (`inference.TwoPass`): `first_pass_steps` steps
  first, then all of them for the rows that need more. Greedy decoding and sampling
  run in one: a greedy step is cheap beside a beam step, so that the compiles of a
  second pass would cost more than the shorter cache saves (docs/benchmarks.md).
  Rows are split over the mesh (`inference.jit_rows`).
  """

  def jitted(first_pass: bool):
    decode_fn = functools.partial(
      translate, model_config=model_config, options=options, first_pass=first_pass
    )
    return inference.jit_rows(decode_fn, mesh, rules)

  full = jitted(first_pass=False)
  if options.decoder != 'beam':
    return lambda params, src_tokens_BS, rng: np.asarray(full(params, src_tokens_BS, rng).tokens)
  return inference.TwoPass(jitted(first_pass=True), full)


# --- Evaluation -----------------------------------------------------------------------------------


def validation_bleu(
  config: ml_collections.ConfigDict, params, vocab: tokenizer_lib.Tokenizer, translate_fn
) -> dict[str, float]:
  """sacreBLEU of the first `config.eval_bleu_sentences` validation sentences."""
  count = config.eval_bleu_sentences
  split = config.data.eval_split
  batches = translation_batches(config, vocab, split, min(64, count))
  translations, speed = inference.decode_batches(
    translate_fn, params, batches, vocab, jax.random.key(config.seed), max_sentences=count
  )
  hypotheses = [translations[i] for i in sorted(translations)][:count]
  references = translation_references(config, split)[: len(hypotheses)]
  return {
    'eval_bleu': scoring.corpus_scores(hypotheses, references)['bleu'],
    'eval_decode_sentences_per_sec': speed['sentences_per_sec'],
  }


def evaluate_split(
  config: ml_collections.ConfigDict,
  params,
  translate_fn,
  *,
  split: str,
  batch_size: int,
  seed: int = 0,
  tokenizer: tokenizer_lib.Tokenizer | None = None,
  max_tokens: int = inference.MAX_DECODE_TOKENS,
  n_bootstrap: int = scoring.DEFAULT_BOOTSTRAP,
) -> tuple[list[str], dict]:
  """Translates every line of `split` in input order and scores it against the references.

  Sentences are decoded sorted by length, in batches of at most `batch_size`
  sentences and `max_tokens` source token slots (`inference.length_sorted_batches`).
  Returns one output line per line of the split's source file (lines that were
  empty there stay empty) and the scores, each BLEU and chrF with its bootstrap
  95% interval from `n_bootstrap` resamples (1: none); `unscored_lines` lists the
  (1-based) lines left out of the scores (empty source lines), and
  `references_sha256` identifies the references scored against. `translate_fn`
  comes from `make_translate_fn` (built once by the caller, so that evaluating
  several checkpoints compiles once).
  """
  tokenizer = tokenizer or tokenizer_lib.get_tokenizer(config)
  batches = inference.length_sorted_batches(
    translation_batches(config, tokenizer, split, batch_size),
    max_tokens=max_tokens,
    max_rows=batch_size,
    max_len=config.data.max_eval_len,
  )
  translations, speed = inference.decode_batches(
    translate_fn, params, batches, tokenizer, jax.random.key(seed)
  )
  references = translation_references(config, split)
  ordered = [translations[i] for i in sorted(translations)]
  results = scoring.corpus_scores(ordered, references, n_bootstrap)
  if config.data.target_lang == 'de':
    results.update(scoring.tokenized_compound_split_scores(ordered, references, 'de', n_bootstrap))
  results.update(speed)
  num_lines = datasets.split_num_lines(config.data, split) or len(references)
  lines = [translations.get(i, '') for i in range(num_lines)]
  results['unscored_lines'] = [i + 1 for i in range(num_lines) if i not in translations]
  results['references_sha256'] = scoring.references_digest(references)
  return lines, results


def translate_lines(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  lines: Sequence[str],
  *,
  options: inference.DecodeOptions,
  batch_size: int,
  seed: int = 0,
  max_tokens: int = inference.MAX_DECODE_TOKENS,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> list[str]:
  """One translation per input line; empty input lines give empty output lines.

  Decoded sorted by length, as `evaluate_split` does.
  """
  tokenizer = tokenizer_lib.get_tokenizer(config)
  max_len = config.data.max_eval_len
  too_long = [
    number
    for number, line in enumerate(lines, start=1)
    if line.strip() and len(tokenizer.encode(line)) > max_len - 1
  ]
  if too_long:
    shown = ', '.join(map(str, too_long[:20])) + (
      f' and {len(too_long) - 20} more' if len(too_long) > 20 else ''
    )
    logging.warning(
      '%d input lines are longer than the model reads (config.data.max_eval_len=%d tokens, EOS '
      'included): each was truncated to fit, so its translation covers only its start. '
      'Lines: %s.',
      len(too_long),
      max_len,
      shown,
    )
  translate_fn = make_translate_fn(model_config, options, mesh, rules)
  batches = inference.length_sorted_batches(
    text_batches(lines, tokenizer, batch_size, max_len),
    max_tokens=max_tokens,
    max_rows=batch_size,
    max_len=max_len,
  )
  translations, _ = inference.decode_batches(
    translate_fn, params, batches, tokenizer, jax.random.key(seed)
  )
  return [translations.get(i, '') for i in range(len(lines))]


def _write_text(path: str, lines: Sequence[str]) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(line + '\n' for line in lines)
  os.replace(tmp, path)


def references_path(workdir: str, split: str) -> str:
  """WORKDIR/eval/references-<split>.txt: the references eval.py scored `split` against."""
  return os.path.join(workdir, 'eval', f'references-{split}.txt')


def write_references(config: ml_collections.ConfigDict, workdir: str, split: str) -> str:
  """Writes the split's references (as scored, in input order) next to the results; its path.

  With them a result file is self-contained: `compare.py` and sacreBLEU's own
  command line (`sacrebleu REFERENCES -i A.txt B.txt --paired-bs`) read them.
  """
  path = references_path(workdir, split)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  _write_text(path, translation_references(config, split))
  return path


def write_split_results(
  workdir: str, label: str, split: str, lines: Sequence[str], results: dict, tag: str = ''
) -> str:
  """WORKDIR/eval/<label>-<split>[-<tag>].{txt,json}; returns the .json path.

  `tag` names non-default decoding settings (`DecodeOptions.tag()`), so that a
  greedy evaluation never overwrites the beam-search one of the same checkpoint.
  """
  out_dir = os.path.join(workdir, 'eval')
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f'{label}-{split}' + (f'-{tag}' if tag else ''))
  _write_text(stem + '.txt', lines)
  tmp = stem + '.json.tmp'
  with open(tmp, 'w') as f:
    json.dump(results, f, indent=2, sort_keys=True)
  os.replace(tmp, stem + '.json')
  return stem + '.json'


def watch(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  workdir: str,
  abstract_state,
  *,
  split: str,
  options: inference.DecodeOptions,
  batch_size: int,
  poll_seconds: float = 30.0,
  timeout_seconds: float | None = None,
  max_tokens: int = inference.MAX_DECODE_TOKENS,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> list[int]:
  """Evaluates each new checkpoint as it appears, until the run's final step is done.

  A side-car next to a training job: BLEU per step goes to WORKDIR/eval/*.json,
  metrics.jsonl (`{split}_bleu` rows) and TensorBoard. It never takes the
  workdir's lock; it reads it (`workdir_lock`) to know whether the run is still
  training, logs what it waits for, and stops with a warning once the run is no
  longer running and every checkpoint it left has been evaluated (no new one
  can come). `abstract_state` is the restore target (`evaluation.Setup`).
  Returns the steps evaluated.
  """
  target = abstract_state
  tokenizer = tokenizer_lib.get_tokenizer(config)
  translate_fn = make_translate_fn(model_config, options, mesh, rules)  # One compile per shape.
  references_written = False
  writer = metrics.MetricsWriter(os.path.join(workdir, 'eval'))
  evaluated: list[int] = []
  rotated_out: set[int] = set()  # Removed by the run's rotation before they could be read.
  started = time.monotonic()
  waiting_for = None
  try:
    while True:
      # The lock first: a run that ends after this look left its last checkpoint in the listing.
      holder = workdir_lock.read_holder(workdir)
      steps = checkpoints.available_steps(workdir)
      for step in sorted(set(steps) - set(evaluated) - rotated_out):
        try:
          params, label = checkpoints.load_params(
            workdir, target, str(step), keep=config.keep_checkpoints
          )
        except checkpoints.CheckpointGoneError as e:
          logging.info('Skipping step %d: %s', step, e)
          rotated_out.add(step)
          continue
        lines, results = evaluate_split(
          config,
          params,
          translate_fn,
          split=split,
          batch_size=batch_size,
          tokenizer=tokenizer,
          max_tokens=max_tokens,
        )
        write_split_results(workdir, label, split, lines, results, options.tag())
        if not references_written:  # The same file for every checkpoint.
          write_references(config, workdir, split)
          references_written = True
        writer.write(
          step,
          {
            f'{split}_bleu': results['bleu'],
            f'{split}_bleu_lc': results['bleu_lc'],
            f'{split}_chrf': results['chrf'],
          },
        )
        writer.flush()
        logging.info('step %d: %s BLEU %s', step, split, scoring.format_score(results, 'bleu'))
        evaluated.append(step)
      if evaluated and max(evaluated) >= config.num_train_steps:
        return evaluated
      last = f'step {max(steps)}' if steps else 'none yet'
      alive = None if holder is None else workdir_lock.holder_alive(holder)
      if holder is None or alive is False:
        why = (
          f'no {workdir_lock.LOCK_FILE} in it'
          if holder is None
          else f'{workdir_lock.describe(holder)} is dead'
        )
        logging.warning(
          'Stopped watching: the training run of %s is no longer running (%s), so no new '
          'checkpoint can come; its last checkpoint (%s) is evaluated, short of the final step '
          '%d. Run the same train.py command to resume it, then eval.py --watch again.',
          workdir,
          why,
          last,
          config.num_train_steps,
        )
        return evaluated
      message = (
        f'Waiting for a checkpoint after {last} (the run ends at step '
        f'{config.num_train_steps}; it is trained by {workdir_lock.describe(holder)}'
        + ('' if alive else ', on another host: not checked')
        + f'); looking every {poll_seconds:g} s.'
      )
      if message != waiting_for:
        logging.info('%s', message)
        waiting_for = message
      if timeout_seconds is not None and time.monotonic() - started > timeout_seconds:
        logging.warning('Stopped watching after %.0f s.', timeout_seconds)
        return evaluated
      time.sleep(poll_seconds)
  finally:
    writer.close()


# --- The task -------------------------------------------------------------------------------------


class Translation:
  """The translation task as training, evaluation and eval.py use it (see `transformer.tasks`)."""

  name = 'translation'
  batch_keys = BATCH_KEYS
  unsupported_eval_flags = ('prompt', 'lengths')  # eval.py's flags that do not apply.
  default_decoder = 'beam'  # The paper's.
  train_iterator = staticmethod(train_iterator)
  eval_batches = staticmethod(eval_batches)
  make_decode_fn = staticmethod(make_translate_fn)
  decode_lines = staticmethod(translate_lines)
  watch = staticmethod(watch)

  @staticmethod
  def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Transformer.__call__` for a batch of `batch_keys`."""
    return {
      'src_tokens_BS': batch['src_tokens'],
      'tgt_input_tokens_BL': batch['tgt_input_tokens'],
      'src_segments_BS': batch['src_segments'],
      'tgt_segments_BL': batch['tgt_segments'],
      'src_positions_BS': batch['src_positions'],
      'tgt_positions_BL': batch['tgt_positions'],
    }

  @staticmethod
  def validation_metrics_fn(
    config: ml_collections.ConfigDict,
    model_config: ModelConfig,
    tokenizer: tokenizer_lib.Tokenizer,
    mesh: Mesh,
    rules: sharding.Rules,
  ) -> Callable[[Any], dict[str, float]]:
    """`params -> metrics` that training adds to each evaluation.

    BLEU of the first `config.eval_bleu_sentences` validation sentences (none
    if 0), decoded by `config.eval_bleu_decoder` with `config.decode`'s settings.
    """
    if config.eval_bleu_sentences == 0:
      return lambda params: {}
    options = inference.DecodeOptions.from_config(config, config.eval_bleu_decoder)
    translate_fn = make_translate_fn(model_config, options, mesh, rules)
    return lambda params: validation_bleu(config, params, tokenizer, translate_fn)

  @staticmethod
  def decode_option_errors(
    config: ml_collections.ConfigDict, options: inference.DecodeOptions
  ) -> list[str]:
    """eval.py's decoding options that this model cannot decode with."""
    longest = config.data.max_eval_len + options.max_extra_len
    if longest > config.model.max_len:
      return [
        f'--max_extra_len={options.max_extra_len}: outputs of up to '
        f'config.data.max_eval_len + {options.max_extra_len} = {longest} tokens exceed '
        f'config.model.max_len={config.model.max_len}, the longest position the model '
        'supports.'
      ]
    return []

  @staticmethod
  def evaluate_checkpoint(
    config: ml_collections.ConfigDict,
    model_config: ModelConfig,
    params,
    *,
    workdir: str,
    label: str,
    split: str,
    options: inference.DecodeOptions,
    batch_size: int,
    max_tokens: int,
    seed: int,
    n_bootstrap: int,
    lengths: Sequence[int],
    mesh: Mesh,
    rules: sharding.Rules,
  ) -> tuple[str, str]:
    """eval.py on a split: translations, BLEU and chrF, written to WORKDIR/eval/.

    Writes the references next to them; returns the .json path and the lines
    to print.
    """
    del lengths  # Language models only.
    lines, results = evaluate_split(
      config,
      params,
      make_translate_fn(model_config, options, mesh, rules),
      split=split,
      batch_size=batch_size,
      max_tokens=max_tokens,
      seed=seed,
      n_bootstrap=n_bootstrap,
    )
    results.update(
      checkpoint=label,
      split=split,
      decoder=options.decoder,
      beam_size=options.beam_size,
      alpha=options.alpha,
    )
    tag = options.tag() + (f'_seed{seed}' if options.decoder == 'sample' else '')
    path = write_split_results(workdir, label, split, lines, results, tag)
    write_references(config, workdir, split)
    interval = f' (± 95% bootstrap interval, {n_bootstrap} resamples)' if n_bootstrap > 1 else ''
    text = (
      f'{label} {split} ({results["num_sentences"]} sentences): BLEU '
      f'{scoring.format_score(results, "bleu")}, chrF '
      f'{scoring.format_score(results, "chrf")}, lowercased BLEU '
      f'{scoring.format_score(results, "bleu_lc")}{interval}\n'
      + json.dumps(
        {
          k: v
          for k, v in results.items()
          if k in ('bleu', 'bleu_ci', 'bleu_lc', 'bleu_lc_ci', 'chrf', 'chrf_ci', 'num_sentences')
        }
      )
    )
    return path, text
