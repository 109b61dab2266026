"""Checkpoint evaluation: decode a split or a file, score with sacreBLEU, watch a workdir."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from transformer import (
  attention_maps,
  checkpoints,
  datasets,
  inference,
  input_pipeline,
  metrics,
  optim,
  scoring,
  sharding,
  training,
  workdir_lock,
)
from transformer import config as config_lib
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config that train.py wrote to WORKDIR/config.json, fitted to this machine.

  Keys added to the project after the run was written get the values that run
  had (`config.upgrade`); then every value is checked (`config.validate`). A
  mesh that needs other devices than this machine has (say, a run trained on 8
  GPUs, evaluated on 1) becomes data-parallel over the devices here: restore
  reshards the checkpoint onto it.
  """
  path = os.path.join(os.path.expanduser(workdir), 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(
      f'No resolved config at {path}: --workdir must be a directory written by train.py.')
  with open(path) as f:
    config = config_lib.upgrade(ml_collections.ConfigDict(json.load(f)))
  config_lib.validate(config)
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except ValueError as e:
    logging.info('%s Evaluating data-parallel over the %d devices here instead.', e,
                 jax.device_count())
    config.mesh.update(data=-1, fsdp=1, tensor=1)
  return config


def mesh_and_rules(config: ml_collections.ConfigDict):
  """The config's mesh over every device, and its logical axis rules."""
  return sharding.create_mesh(config.mesh), sharding.axis_rules(config.mesh)


def abstract_state(config: ml_collections.ConfigDict):
  """Shapes and shardings of the train state (restore targets), nothing allocated."""
  model, _ = training.create_models(config)
  mesh, _ = mesh_and_rules(config)
  abstract, _ = training.abstract_state_and_shardings(
    config, model, optim.create_optimizer(config), mesh)
  return abstract


def restore_params(config: ml_collections.ConfigDict, workdir: str, checkpoint: str):
  """(params, label) of `checkpoint` ('latest', a step, or 'avg:N') in `workdir`."""
  return checkpoints.load_params(workdir, abstract_state(config), checkpoint)


def _write_text(path: str, lines: Sequence[str]) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    f.writelines(line + '\n' for line in lines)
  os.replace(tmp, path)


def evaluate_split(
  config: ml_collections.ConfigDict, params, *, split: str, options: inference.DecodeOptions,
  batch_size: int, seed: int = 0, tokenizer: tokenizer_lib.Tokenizer | None = None,
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
  `references_sha256` identifies the references scored against.
  """
  tokenizer = tokenizer or tokenizer_lib.get_tokenizer(config)
  translate_fn = inference.make_translate_fn(
    ModelConfig.from_config(config), options, *mesh_and_rules(config))
  batches = inference.length_sorted_batches(
    input_pipeline.translation_batches(config, tokenizer, split, batch_size),
    max_tokens=max_tokens, max_rows=batch_size, max_len=config.data.max_eval_len)
  translations, speed = inference.decode_batches(translate_fn, params, batches, tokenizer,
                                       jax.random.key(seed))
  references = input_pipeline.translation_references(config, split)
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
  _write_text(path, input_pipeline.translation_references(config, split))
  return path


def write_split_results(workdir: str, label: str, split: str, lines: Sequence[str],
                        results: dict, tag: str = '') -> str:
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


def read_input_lines(path: str) -> list[str]:
  """Lines of a UTF-8 file ('-' for stdin); invalid UTF-8 is an error naming the line."""
  if path == '-':
    raw = sys.stdin.buffer.read()
  else:
    with open(path, 'rb') as f:
      raw = f.read()
  lines = raw.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  decoded = []
  for number, line in enumerate(lines, start=1):
    try:
      decoded.append(line.decode('utf-8').rstrip('\r'))
    except UnicodeDecodeError as e:
      raise ValueError(f'{path}: line {number} is not valid UTF-8 ({e.reason}).') from None
  return decoded


def translate_lines(
  config: ml_collections.ConfigDict, params, lines: Sequence[str], *,
  options: inference.DecodeOptions, batch_size: int, seed: int = 0,
  max_tokens: int = inference.MAX_DECODE_TOKENS,
) -> list[str]:
  """One translation per input line; empty input lines give empty output lines.

  Decoded sorted by length, as `evaluate_split` does.
  """
  tokenizer = tokenizer_lib.get_tokenizer(config)
  max_len = config.data.max_eval_len
  too_long = [number for number, line in enumerate(lines, start=1)
              if line.strip() and len(tokenizer.encode(line)) > max_len - 1]
  if too_long:
    shown = ', '.join(map(str, too_long[:20])) + (
      f' and {len(too_long) - 20} more' if len(too_long) > 20 else '')
    logging.warning(
      '%d input lines are longer than the model reads (config.data.max_eval_len=%d tokens, EOS '
      'included): each was truncated to fit, so its translation covers only its start. '
      'Lines: %s.', len(too_long), max_len, shown)
  translate_fn = inference.make_translate_fn(
    ModelConfig.from_config(config), options, *mesh_and_rules(config))
  batches = inference.length_sorted_batches(
    input_pipeline.text_batches(lines, tokenizer, batch_size, max_len),
    max_tokens=max_tokens, max_rows=batch_size, max_len=max_len)
  translations, _ = inference.decode_batches(translate_fn, params, batches, tokenizer,
                                   jax.random.key(seed))
  return [translations.get(i, '') for i in range(len(lines))]


def watch(
  config: ml_collections.ConfigDict, workdir: str, *, split: str,
  options: inference.DecodeOptions, batch_size: int, poll_seconds: float = 30.0,
  timeout_seconds: float | None = None, max_tokens: int = inference.MAX_DECODE_TOKENS,
) -> list[int]:
  """Evaluates each new checkpoint as it appears, until the run's final step is done.

  A side-car next to a training job: BLEU per step goes to WORKDIR/eval/*.json,
  metrics.jsonl (`{split}_bleu` rows) and TensorBoard. It never takes the
  workdir's lock; it reads it (`workdir_lock`) to know whether the run is still
  training, logs what it waits for, and stops with a warning once the run is no
  longer running and every checkpoint it left has been evaluated (no new one
  can come). Returns the steps evaluated.
  """
  target = abstract_state(config)
  tokenizer = tokenizer_lib.get_tokenizer(config)
  writer = metrics.MetricsWriter(os.path.join(workdir, 'eval'))
  evaluated: list[int] = []
  started = time.monotonic()
  waiting_for = None
  try:
    while True:
      # The lock first: a run that ends after this look left its last checkpoint in the listing.
      holder = workdir_lock.read_holder(workdir)
      steps = checkpoints.available_steps(workdir)
      for step in sorted(set(steps) - set(evaluated)):
        params, label = checkpoints.load_params(workdir, target, str(step))
        lines, results = evaluate_split(config, params, split=split, options=options,
                                        batch_size=batch_size, tokenizer=tokenizer,
                                        max_tokens=max_tokens)
        write_split_results(workdir, label, split, lines, results, options.tag())
        write_references(config, workdir, split)
        writer.write(step, {f'{split}_bleu': results['bleu'], f'{split}_chrf': results['chrf']})
        writer.flush()
        logging.info('step %d: %s BLEU %s', step, split, scoring.format_score(results, 'bleu'))
        evaluated.append(step)
      if evaluated and max(evaluated) >= config.num_train_steps:
        return evaluated
      last = f'step {max(steps)}' if steps else 'none yet'
      alive = None if holder is None else workdir_lock.holder_alive(holder)
      if holder is None or alive is False:
        why = (f'no {workdir_lock.LOCK_FILE} in it' if holder is None
               else f'{workdir_lock.describe(holder)} is dead')
        logging.warning(
          'Stopped watching: the training run of %s is no longer running (%s), so no new '
          'checkpoint can come; its last checkpoint (%s) is evaluated, short of the final step '
          '%d. Run the same train.py command to resume it, then eval.py --watch again.',
          workdir, why, last, config.num_train_steps)
        return evaluated
      message = (f'Waiting for a checkpoint after {last} (the run ends at step '
                 f'{config.num_train_steps}; it is trained by {workdir_lock.describe(holder)}'
                 + ('' if alive else ', on another host: not checked') +
                 f'); looking every {poll_seconds:g} s.')
      if message != waiting_for:
        logging.info('%s', message)
        waiting_for = message
      if timeout_seconds is not None and time.monotonic() - started > timeout_seconds:
        logging.warning('Stopped watching after %.0f s.', timeout_seconds)
        return evaluated
      time.sleep(poll_seconds)
  finally:
    writer.close()


def plot_attention(
  config: ml_collections.ConfigDict, params, text: str, options: inference.DecodeOptions,
  out_dir: str,
) -> list[str]:
  """Translates `text`, then draws the model's attention over source and translation.

  One PNG per kind (encoder self, decoder self, cross) and layer, a panel per
  head, subword pieces on the axes. Returns the written paths.
  """
  tokenizer = tokenizer_lib.get_tokenizer(config)
  model_config = ModelConfig.from_config(config)
  src_tokens = np.asarray(tokenizer.encode(text) + [tokenizer_lib.EOS_ID], np.int32)[None]
  translate_fn = inference.make_translate_fn(model_config, options)
  output = np.asarray(translate_fn(params, src_tokens, jax.random.key(0)))[0]
  output = output[:np.flatnonzero(output == tokenizer_lib.EOS_ID)[0] + 1] if (
    output == tokenizer_lib.EOS_ID).any() else output[output != 0]
  logging.info('Translation: %s', tokenizer.decode(output.tolist()))
  weights = attention_maps.collect_attention(params, model_config, src_tokens[0], output)
  os.makedirs(out_dir, exist_ok=True)
  return attention_maps.plot_attention(
    weights, attention_maps.token_labels(tokenizer, src_tokens[0]),
    attention_maps.token_labels(tokenizer, output), out_dir)
