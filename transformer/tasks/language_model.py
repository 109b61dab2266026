"""The language-model task: monolingual text, the decoder-only model, perplexity, generation.

The batches are the target half of the translation batches
(`tasks.translation`), int32 arrays of shape [rows, length] under the same keys:

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

Generation (`generate`) continues prompts through the decoders of
`decoding.py`: they start from BOS as in translation, and while a row is
inside its prompt the step function allows only the prompt's next token (every
other logit is -inf), so greedy decoding and sampling (any temperature, top-k,
top-p) copy the prompt into the cache one token per step, then continue it
freely. Rows with prompts of different lengths decode together.

Perplexity is exp(mean negative log-likelihood) over every token of every
document of the split (EOS included), the documents cut into windows of a given
length (`eval_batches`): at the training `max_len` it is the validation
perplexity that training logs. Scored at longer windows, tokens sit at
positions the model never trained on; `perplexity_by_position` splits the
tokens into bands of the training length (positions 0-63, 64-127, ... for
`max_len=64`), so the bands beyond the first show what the position encoding
does there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from transformer import (
  datasets,
  decoding,
  distributed,
  inference,
  input_pipeline,
  losses,
  packing,
  prepared_ids,
  sharding,
)
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer

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
      raise ValueError(f'config.data.lines_per_document={lines} must be positive.')
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


def documents(config: ml_collections.ConfigDict, split: str) -> Documents:
  """The documents of `split` of `config.data.dataset` (prepared if needed)."""
  source = datasets.get_data_source(config.data, split)
  return Documents(source, config.data.lines_per_document)


def encoded_lines(
  config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer, split: str
) -> prepared_ids.EncodedSplit:
  """The prepared ids of the examples (lines) of `split`, encoded first if needed."""
  return prepared_ids.encoded_split(config, tokenizer, split, prepared_ids.DocumentText())


def prepare_ids(config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer) -> None:
  """Encodes the training and validation splits into ids now (else on first use)."""
  for split in (config.data.train_split, config.data.eval_split):
    encoded_lines(config, tokenizer, split)


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
  config: ml_collections.ConfigDict,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.DatasetIterator:
  """The infinite iterator of packed training batches of one process.

  As `translation.train_iterator`, with documents instead of sentence pairs:
  documents `shard_index::shard_count` of `config.data.train_split`, shuffled
  with `config.seed` (differently each epoch), cut into windows of
  `config.data.max_len` (nothing is dropped), packed, `train_rows` rows a
  batch, in `config.data.num_workers` worker processes. `get_state()` /
  `set_state()` checkpoint its position.
  """
  data = config.data
  split = encoded_lines(config, tokenizer, data.train_split)
  return input_pipeline.packed_train_iterator(
    config,
    _num_documents(split, data.lines_per_document),
    lambda length, open_rows: PackDocuments(split, data.lines_per_document, length, open_rows),
    shard_index=shard_index,
    shard_count=shard_count,
  )


def eval_batches(
  config: ml_collections.ConfigDict,
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
  encoded = encoded_lines(config, tokenizer, split)
  lines = config.data.lines_per_document
  return input_pipeline.packed_eval_batches(
    config,
    _num_documents(encoded, lines),
    lambda length, open_rows: PackDocuments(encoded, lines, length, open_rows),
    length or config.data.max_eval_len,
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
      raise ValueError(f'Prompt {index + 1} has {len(ids)} tokens; at most {self.max_len} fit.')
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
  `translation_batches`, so few shapes compile), `index` int32 [batch_size]
  (the prompt's position in `prompts`; -1 on padding rows) and `valid` bool.
  An empty prompt is allowed: the model then writes a document from scratch.
  A prompt of more than `max_len` pieces is an error naming it.
  """
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be positive.')
  ds = grain.MapDataset.source(list(enumerate(prompts))).map(_EncodePrompt(tokenizer, max_len))
  return ds.batch(batch_size, batch_fn=_PadPrompts(batch_size, max_len))


# --- Generation -----------------------------------------------------------------------------------


def _init_state(
  params, prompt_tokens_BP: jax.Array, model_config: ModelConfig, max_decode_len: int
):
  """Creates the decoder-only model's cache and the prompt-forcing state."""
  model = Transformer(
    model_config.replace(deterministic=True, decode=True, max_decode_len=max_decode_len)
  )
  bos_B1 = jnp.full((prompt_tokens_BP.shape[0], 1), tokenizer_lib.BOS_ID, jnp.int32)
  _, variables = model.apply(
    {'params': params}, None, None, bos_B1, method=Transformer.decode, mutable=['cache']
  )
  state = {
    'cache': variables['cache'],
    'prompt': prompt_tokens_BP,
    'prompt_lengths': jnp.sum(prompt_tokens_BP != 0, axis=1).astype(jnp.int32),
    'step': jnp.array(0, jnp.int32),  # Shared scalar: the output position being chosen.
  }
  return model, state


def _logits_fn(model: Transformer, params):
  """One step of the decoder-only model; inside its prompt a row can only copy the prompt.

  Never chooses PAD or BOS: they are not tokens of a document.
  """

  def step(tokens_N1, state):
    logits_N1V, variables = model.apply(
      {'params': params, 'cache': state['cache']},
      None,
      None,
      tokens_N1,
      method=Transformer.decode,
      mutable=['cache'],
    )
    logits_NV = logits_N1V[:, 0]
    prompt_NP, position = state['prompt'], state['step']
    forced_N = jax.lax.dynamic_index_in_dim(
      prompt_NP, jnp.minimum(position, prompt_NP.shape[1] - 1), axis=1, keepdims=False
    )
    only_forced_NV = jnp.where(
      jnp.arange(logits_NV.shape[-1]) == forced_N[:, None], 0.0, decoding.NEG_INF
    )
    in_prompt_N1 = (position < state['prompt_lengths'])[:, None]
    logits_NV = jnp.where(in_prompt_N1, only_forced_NV, logits_NV)
    # PAD and BOS never occur inside a document (they are never training targets).
    vocab_V = jnp.arange(logits_NV.shape[-1])
    logits_NV = jnp.where(
      (vocab_V == tokenizer_lib.PAD_ID) | (vocab_V == tokenizer_lib.BOS_ID),
      decoding.NEG_INF,
      logits_NV,
    )
    return logits_NV, {**state, 'cache': variables['cache'], 'step': position + 1}

  return step


def generate(
  params,
  prompt_tokens_BP: jax.Array,
  rng: jax.Array,
  *,
  model_config: ModelConfig,
  options: inference.DecodeOptions,
) -> jax.Array:
  """Each prompt followed by its continuation, int32 [B, P + max_extra_len], 0-padded after EOS.

  `prompt_tokens_BP`: pieces without BOS or EOS, 0-padded on the right (an
  all-zero row is an empty prompt). Row b holds its prompt in its first P_b
  positions, then at most `max_extra_len` new tokens (EOS included): the
  continuation ends at EOS, the end of the document. Greedy or sampling only.
  """
  if options.decoder == 'beam':
    raise ValueError(
      "Generation decodes greedily or by sampling; decoder='beam' is for translation."
    )
  max_decode_len = prompt_tokens_BP.shape[1] + options.max_extra_len
  model, state = _init_state(params, prompt_tokens_BP, model_config, max_decode_len)
  max_lengths_B = state['prompt_lengths'] + options.max_extra_len
  return inference.run_decoder(
    _logits_fn(model, params), state, rng, options, max_decode_len, max_lengths_B
  ).tokens


def make_generate_fn(
  model_config: ModelConfig,
  options: inference.DecodeOptions,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
):
  """`generate(params, prompt_tokens, rng)` jitted once per prompt width (`inference.jit_rows`)."""
  return inference.jit_rows(
    functools.partial(generate, model_config=model_config, options=options), mesh, rules
  )


# --- Evaluation -----------------------------------------------------------------------------------


def _score_sums(params, batch, *, model: Transformer, band_width: int, num_bands: int):
  """Summed NLL, correct predictions and token counts, overall and per position band."""
  logits_BLV = model.apply(
    {'params': params},
    None,
    batch['tgt_input_tokens'],
    tgt_segments_BL=batch['tgt_segments'],
    tgt_positions_BL=batch['tgt_positions'],
  )
  _, nll_BL = losses.token_losses(logits_BLV, batch['tgt_tokens'], 0.0)
  weights_BL = (batch['tgt_tokens'] != 0).astype(jnp.float32)
  correct_BL = (jnp.argmax(logits_BLV, -1) == batch['tgt_tokens']).astype(jnp.float32)
  band_BLN = (
    jax.nn.one_hot(jnp.minimum(batch['tgt_positions'] // band_width, num_bands - 1), num_bands)
    * weights_BL[..., None]
  )
  return {
    'nll_sum': jnp.sum(nll_BL * weights_BL),
    'correct_sum': jnp.sum(correct_BL * weights_BL),
    'num_tokens': jnp.sum(weights_BL),
    'band_nll_sum': jnp.einsum('bl,bln->n', nll_BL, band_BLN),
    'band_num_tokens': jnp.sum(band_BLN, axis=(0, 1)),
  }


def score_split(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  split: str,
  *,
  length: int | None = None,
  tokenizer: tokenizer_lib.Tokenizer | None = None,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> dict[str, Any]:
  """Perplexity of `split` in windows of `length` tokens (default `config.data.max_eval_len`).

  Returns `length`, `num_tokens`, `loss` (mean NLL, nats), `perplexity`,
  `accuracy` (argmax = next token) and `perplexity_by_position` ({'0-63': ...}
  per band of `config.data.max_len` positions). Batches are split over `mesh`
  (default: `config.mesh` over every device).
  """
  tokenizer = tokenizer or tokenizer_lib.get_tokenizer(config)
  length = length or config.data.max_eval_len
  band_width = config.data.max_len
  num_bands = -(-length // band_width)
  model = Transformer(model_config.replace(deterministic=True))
  if mesh is None:
    mesh, rules = sharding.create_mesh(config.mesh), sharding.axis_rules(config.mesh)
  step = jax.jit(
    functools.partial(_score_sums, model=model, band_width=band_width, num_bands=num_bands),
    out_shardings=sharding.replicated(mesh),
  )
  batches = eval_batches(
    config,
    tokenizer,
    split,
    length,
    rows_multiple_of=sharding.batch_shards(dict(mesh.shape), rules),
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
  )
  total = None
  for batch in batches:
    with sharding.activated(mesh, rules):
      sums = distributed.ordered(step(params, sharding.global_batch(batch, mesh, rules)))
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  if total is None:
    raise ValueError(f'Split {split!r} is empty.')
  total = jax.device_get(total)
  num_tokens = float(total['num_tokens'])
  bands = {}
  for band, (nll, count) in enumerate(
    zip(total['band_nll_sum'], total['band_num_tokens'], strict=True)
  ):
    last = min((band + 1) * band_width, length) - 1
    bands[f'{band * band_width}-{last}'] = _perplexity(float(nll), float(count))
  return {
    'length': length,
    'num_tokens': int(num_tokens),
    'loss': float(total['nll_sum']) / max(num_tokens, 1.0),
    'perplexity': _perplexity(float(total['nll_sum']), num_tokens),
    'accuracy': float(total['correct_sum']) / max(num_tokens, 1.0),
    'perplexity_by_position': bands,
  }


def _perplexity(nll_sum: float, num_tokens: float) -> float | None:
  return math.exp(min(nll_sum / num_tokens, 50.0)) if num_tokens else None


def length_extrapolation(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  split: str,
  lengths: Sequence[int],
  *,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> dict[str, Any]:
  """`score_split` at each window length, e.g. (64, 128, 256) for a model trained on 64.

  A model with learned positions has no embedding past `config.model.max_len`
  positions: longer lengths are not scored, and say so (`skipped`).
  """
  tokenizer = tokenizer_lib.get_tokenizer(config)
  results: dict[str, Any] = {
    'position': model_config.position,
    'train_length': config.data.max_len,
    'split': split,
  }
  for length in lengths:
    if model_config.position == 'learned' and length > model_config.max_len:
      results[str(length)] = {
        'skipped': f'learned positions exist for {model_config.max_len} positions only '
        f'(config.model.max_len)'
      }
      continue
    results[str(length)] = score_split(
      config,
      model_config,
      params,
      split,
      length=length,
      tokenizer=tokenizer,
      mesh=mesh,
      rules=rules,
    )
  return results


def continue_prompts(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  prompts: Sequence[str],
  *,
  options: inference.DecodeOptions,
  batch_size: int,
  seed: int = 0,
  mesh: Mesh | None = None,
  rules: sharding.Rules = (),
) -> list[str]:
  """Each prompt followed by the model's continuation (up to EOS or `max_extra_len` tokens).

  One output per prompt, in order; an empty prompt gets a document written from
  scratch. Greedy decoding or sampling (temperature, top-k, top-p), seeded.
  """
  tokenizer = tokenizer_lib.get_tokenizer(config)
  generate_fn = make_generate_fn(model_config, options, mesh, rules)
  batches = prompt_batches(prompts, tokenizer, batch_size, config.model.max_len)
  texts, _ = inference.decode_batches(
    generate_fn, params, batches, tokenizer, jax.random.key(seed), input_key='prompt_tokens'
  )
  return [texts[i] for i in range(len(prompts))]


def write_results(workdir: str, label: str, split: str, tag: str, results: dict) -> str:
  """Writes WORKDIR/eval/<label>-<split>-<tag>.json; returns its path."""
  out_dir = os.path.join(workdir, 'eval')
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f'{label}-{split}-{tag}.json')
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(results, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
  return path


# --- The task -------------------------------------------------------------------------------------


class LanguageModel:
  """The language-model task as training, evaluation and eval.py use it (`transformer.tasks`)."""

  name = 'language model'
  batch_keys = BATCH_KEYS
  unsupported_eval_flags = ('watch', 'attention_plot')  # eval.py's flags that do not apply.
  default_decoder = 'greedy'  # Beam search is for translation.
  train_iterator = staticmethod(train_iterator)
  eval_batches = staticmethod(eval_batches)
  make_decode_fn = staticmethod(make_generate_fn)

  @staticmethod
  def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `Transformer.__call__` for a batch of `batch_keys` (no source)."""
    return {
      'src_tokens_BS': None,
      'tgt_input_tokens_BL': batch['tgt_input_tokens'],
      'tgt_segments_BL': batch['tgt_segments'],
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

    None: the validation loss already gives the perplexity.
    """
    del config, model_config, tokenizer, mesh, rules
    return lambda params: {}

  @staticmethod
  def decode_option_errors(
    config: ml_collections.ConfigDict, options: inference.DecodeOptions
  ) -> list[str]:
    """eval.py's decoding options that this model cannot decode with."""
    del config
    if options.decoder == 'beam':
      return ['A language model continues prompts with --decoder=greedy or sample.']
    return []

  @staticmethod
  def decode_lines(
    config: ml_collections.ConfigDict,
    model_config: ModelConfig,
    params,
    lines: Sequence[str],
    *,
    options: inference.DecodeOptions,
    batch_size: int,
    seed: int = 0,
    max_tokens: int = 0,
    mesh: Mesh | None = None,
    rules: sharding.Rules = (),
  ) -> list[str]:
    """Each line (a prompt) followed by its continuation (`continue_prompts`)."""
    del max_tokens  # Prompts are decoded in input order.
    return continue_prompts(
      config,
      model_config,
      params,
      lines,
      options=options,
      batch_size=batch_size,
      seed=seed,
      mesh=mesh,
      rules=rules,
    )

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
    """eval.py on a split: perplexity, written to WORKDIR/eval/.

    With `lengths`, at each window length (length extrapolation). Returns the
    .json path and the line to print.
    """
    del options, batch_size, max_tokens, seed, n_bootstrap  # Translation only.
    if lengths:
      results = length_extrapolation(
        config, model_config, params, split, lengths, mesh=mesh, rules=rules
      )
      tag = 'extrapolation'
    else:
      results = score_split(config, model_config, params, split, mesh=mesh, rules=rules)
      tag = 'perplexity'
    results['checkpoint'] = label
    return write_results(workdir, label, split, tag, results), json.dumps(results)
