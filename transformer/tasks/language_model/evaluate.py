"""Language-model quality: perplexity of a split, overall and by position, at any window length.

Perplexity is exp(mean negative log-likelihood) over every token of every
document of the split (EOS included), the documents cut into windows of a given
length (`data.eval_batches`): at the training `max_len` it is the validation
perplexity that training logs. Scored at longer windows, tokens sit at
positions the model never trained on; `perplexity_by_position` splits the
tokens into bands of the training length (positions 0-63, 64-127, ... for
`max_len=64`), so the bands beyond the first show what the position encoding
does there.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import Mesh

from transformer import distributed, losses, sharding
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.model import Transformer
from transformer.tasks import task
from transformer.tasks.language_model import data


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

  Args:
    config: The run's config.
    model_config: Its model.
    params: The parameters to score.
    split: The split to score.
    length: The window length (default `config.data.max_eval_len`).
    tokenizer: The run's vocabulary (default: loaded from `config`).
    mesh: The devices batches are split over (default: `config.mesh` over every
      device).
    rules: `mesh`'s logical axis rules.

  Returns:
    `length`, `num_tokens`, `loss` (mean NLL, nats), `perplexity`, `accuracy`
    (argmax = next token) and `perplexity_by_position` ({'0-63': ...} per band
    of `config.data.max_len` positions).
  """
  tokenizer = tokenizer or tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
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
  batches = data.eval_batches(
    config.data,
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
    raise InvalidInput(f'Split {split!r} is empty.')
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
  tokenizer = tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
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


def evaluator(request: task.EvalRequest) -> Callable[[Any, str], task.Evaluation]:
  """`(params, label) -> Evaluation`: perplexity of `request.split` (`score_split`).

  With `request.lengths`, at each window length (`length_extrapolation`, tag
  'extrapolation'); else at `config.data.max_eval_len` (tag 'perplexity').
  """
  config, model_config, split = request.config, request.model_config, request.split
  mesh, rules = request.mesh, request.rules

  def evaluate(params, label: str) -> task.Evaluation:
    if request.lengths:
      results = length_extrapolation(
        config, model_config, params, split, request.lengths, mesh=mesh, rules=rules
      )
      tag = 'extrapolation'
    else:
      results = score_split(config, model_config, params, split, mesh=mesh, rules=rules)
      tag = 'perplexity'
    results['checkpoint'] = label
    metrics = {f'{split}_perplexity': results['perplexity']} if 'perplexity' in results else {}
    return task.Evaluation(results, tag, json.dumps(results), metrics)

  return evaluate
