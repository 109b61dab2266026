"""Translation quality: a split translated and scored with sacreBLEU, during training and after.

`validation_bleu` is the BLEU training logs at each evaluation; `evaluator`
scores a whole split for eval.py (`Task.evaluator`): translations, BLEU and
chrF with their confidence intervals, and the references scored against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from transformer import datasets, inference, scoring
from transformer import tokenizer as tokenizer_lib
from transformer.tasks import task
from transformer.tasks.translation import data, decode


def validation_bleu(
  data_config: ml_collections.ConfigDict,
  validation: task.ValidationConfig,
  params,
  vocab: tokenizer_lib.Tokenizer,
  translate_fn,
  mesh: Mesh | None = None,
) -> dict[str, float]:
  """sacreBLEU of the first `config.eval_bleu_sentences` validation sentences, cased and not.

  In batches of at most 64 sentences, fewer on one CPU device (`inference.batch_size`,
  several at once there: `inference.concurrent_batches`), in input order.
  """
  count = validation.eval_bleu_sentences
  split = data_config.eval_split
  rows = min(64, count, inference.batch_size(validation.decode_options(), mesh))
  batches = data.translation_batches(data_config, vocab, split, rows)
  translations, speed = inference.decode_batches(
    translate_fn,
    params,
    batches,
    vocab,
    jax.random.key(validation.seed),
    max_sentences=count,
    concurrency=inference.concurrent_batches(mesh),
  )
  hypotheses = [translations[i] for i in sorted(translations)][:count]
  references = data.translation_references(data_config, split)[: len(hypotheses)]
  scores = scoring.corpus_scores(hypotheses, references)
  return {
    'eval_bleu': scores['bleu'],
    'eval_bleu_lc': scores['bleu_lc'],  # The Multi30k papers' score; a case-folding vocabulary's.
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
  concurrency: int = 1,
) -> tuple[list[str], dict, list[str]]:
  """Translates every line of `split` in input order and scores it against the references.

  Sentences are decoded sorted by length, in batches of at most `batch_size`
  sentences and `max_tokens` source token slots (`inference.length_sorted_batches`).

  Args:
    config: The run's config.
    params: The parameters to translate with.
    translate_fn: From `decode.make_translate_fn`, built once by the caller, so
      that evaluating several checkpoints compiles once.
    split: The split to translate.
    batch_size: Most sentences decoded at once.
    seed: Of the decoder's key (sampling).
    tokenizer: The run's vocabulary (default: loaded from `config`).
    max_tokens: Most source token slots per batch.
    n_bootstrap: Resamples of each score's bootstrap 95% interval (1: none).
    concurrency: Batches decoded at once (`inference.concurrent_batches`).

  Returns:
    One output line per line of the split's source file (lines that were empty
    there stay empty); the scores: each BLEU and chrF with its interval,
    `unscored_lines` (the 1-based lines left out of the scores: empty source
    lines) and `references_sha256` (the references scored against); and the
    references, in input order (`data.translation_references`).
  """
  tokenizer = tokenizer or tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
  batches = inference.length_sorted_batches(
    data.translation_batches(config.data, tokenizer, split, batch_size),
    max_tokens=max_tokens,
    max_rows=batch_size,
    max_len=config.data.max_eval_len,
  )
  translations, speed = inference.decode_batches(
    translate_fn, params, batches, tokenizer, jax.random.key(seed), concurrency=concurrency
  )
  references = data.translation_references(config.data, split)
  ordered = [translations[i] for i in sorted(translations)]
  results = scoring.corpus_scores(ordered, references, n_bootstrap)
  if config.data.target_lang == 'de':
    results.update(scoring.tokenized_compound_split_scores(ordered, references, 'de', n_bootstrap))
  results.update(speed)
  num_lines = datasets.split_num_lines(config.data, split) or len(references)
  lines = [translations.get(i, '') for i in range(num_lines)]
  results['unscored_lines'] = [i + 1 for i in range(num_lines) if i not in translations]
  results['references_sha256'] = scoring.references_digest(references)
  return lines, results, references


def evaluator(request: task.EvalRequest) -> Callable[[Any, str], task.Evaluation]:
  """`(params, label) -> Evaluation` of `request.split`: translations, BLEU and chrF.

  The translate function is built once, so that evaluating several checkpoints
  compiles once. The results name the checkpoint, split and decoding settings;
  `tag` names settings other than the paper's (and the seed of sampling).
  """
  config, options, split = request.config, request.options, request.split
  tokenizer = tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
  translate_fn = decode.make_translate_fn(
    request.model_config, options, request.mesh, request.rules
  )
  batch_size = request.batch_size
  if batch_size is None:  # eval.py's default: `inference.batch_size`'s for the devices.
    batch_size = inference.batch_size(options, request.mesh)
  tag = options.tag() + (f'_seed{request.seed}' if options.decoder == 'sample' else '')
  n_bootstrap = request.n_bootstrap
  interval = f' (± 95% bootstrap interval, {n_bootstrap} resamples)' if n_bootstrap > 1 else ''

  def evaluate(params, label: str) -> task.Evaluation:
    lines, results, references = evaluate_split(
      config,
      params,
      translate_fn,
      split=split,
      batch_size=batch_size,
      seed=request.seed,
      tokenizer=tokenizer,
      max_tokens=request.max_tokens,
      n_bootstrap=n_bootstrap,
      concurrency=inference.concurrent_batches(request.mesh),
    )
    results.update(
      checkpoint=label,
      split=split,
      decoder=options.decoder,
      beam_size=options.beam_size,
      alpha=options.alpha,
    )
    summary = (
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
    metrics = {f'{split}_{key}': results[key] for key in ('bleu', 'bleu_lc', 'chrf')}
    return task.Evaluation(results, tag, summary, metrics, lines, references)

  return evaluate
