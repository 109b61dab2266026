"""Evaluating a trained run: its config loaded, its checkpoints restored, followed, and scored.

`setup(config)` turns the run's config into model config, task, mesh, rules and
restore target once; eval.py passes them down, with its flags, as a
`tasks.EvalRequest`. What is evaluated, and how, is the task's
(`Task.evaluator`: BLEU of translations, perplexity of a language model); what
both share is here: `write` puts a task's `Evaluation` in WORKDIR/eval/, and
`watch` evaluates each new checkpoint of a run as training writes it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.sharding import Mesh

from transformer import (
  atomic,
  checkpoints,
  metrics,
  optim,
  provenance,
  sharding,
  tasks,
  training,
  workdir_lock,
)
from transformer import config as config_lib
from transformer.config import ModelConfig


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config that train.py wrote to WORKDIR/config.json, fitted to this machine.

  Keys added to the project after the run was written get the values that run
  had (`config.upgrade`); then every value is checked (`config.validate`). A
  mesh that needs other devices than this machine has (say, a run trained on 8
  GPUs, evaluated on 1) becomes data-parallel over the devices here: restore
  reshards the checkpoint onto it.
  """
  config = config_lib.read_run_config(workdir)
  if config is None:
    path = os.path.join(os.path.expanduser(workdir), 'config.json')
    raise FileNotFoundError(
      f'No resolved config at {path}: --workdir must be a directory written by train.py.'
    )
  config_lib.validate(config)
  _check_vocabulary(config, workdir)
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except ValueError as e:
    logging.info(
      '%s Evaluating data-parallel over the %d devices here instead.', e, jax.device_count()
    )
    config.mesh.update(data=-1, fsdp=1, tensor=1)
  return config


def _check_vocabulary(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses a vocabulary whose content differs from the one the run trained with."""
  recorded = provenance.recorded_inputs(workdir).get('vocabulary')
  if not recorded:
    return  # A run from before inputs were recorded.
  changes = provenance.input_changes(
    {'vocabulary': recorded}, {'vocabulary': provenance.vocabulary_input(config)}
  )
  if changes:
    raise ValueError(
      f'The run in {workdir} trained with another vocabulary than the one its config names '
      f'now (recorded in {workdir}/{provenance.FILENAME} -> now):\n  {changes[0]}\nIts '
      'checkpoints would translate into other pieces. Put the original vocabulary back at '
      'that path (or point config.data.vocab_path in its config.json at a copy of it).'
    )


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a run's config becomes for evaluation, built once (`setup`) and passed down."""

  config: ml_collections.ConfigDict
  model_config: ModelConfig
  task: tasks.Task
  mesh: Mesh  # The config's mesh over every device.
  rules: sharding.Rules  # Its logical axis rules.
  abstract_state: Any  # Shapes and shardings of the train state (the restore target).


def setup(config: ml_collections.ConfigDict) -> Setup:
  """The model config, task, mesh, rules and restore target of `config` (nothing allocated)."""
  model_config = ModelConfig.from_config(config)
  task = tasks.get_task(config)
  mesh, rules = sharding.create_mesh(config.mesh), sharding.axis_rules(config.mesh)
  model, _ = training.create_models(model_config)
  abstract_state, _ = training.abstract_state_and_shardings(
    model, optim.create_optimizer(config), task, mesh, rules
  )
  return Setup(config, model_config, task, mesh, rules, abstract_state)


def restore_params(run: Setup, workdir: str, checkpoint: str):
  """(params, label) of `checkpoint` ('latest', a step, 'avg:N', 'best', 'avg_best:N')."""
  return checkpoints.load_params(
    workdir, run.abstract_state, checkpoint, keep=run.config.keep_checkpoints
  )


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


def write(workdir: str, label: str, split: str, evaluation: tasks.Evaluation) -> str:
  """Writes `evaluation` to WORKDIR/eval/; returns the path of its .json.

  `<label>-<split>[-<tag>].json` holds the results and `.txt` beside it the
  output lines, if any (the tag keeps, say, a greedy evaluation from
  overwriting the beam-search one of the same checkpoint). With references,
  `references-<split>.txt` (`references_path`) holds them: with them a result
  file is self-contained, for `compare.py` and sacreBLEU's own command line
  (`sacrebleu REFERENCES -i A.txt B.txt --paired-bs`).
  """
  out_dir = os.path.join(workdir, 'eval')
  os.makedirs(out_dir, exist_ok=True)
  tag = f'-{evaluation.tag}' if evaluation.tag else ''
  stem = os.path.join(out_dir, f'{label}-{split}{tag}')
  if evaluation.lines is not None:
    atomic.write_text(stem + '.txt', ''.join(line + '\n' for line in evaluation.lines))
  atomic.write_json(stem + '.json', evaluation.results, indent=2, sort_keys=True)
  if evaluation.references is not None:
    atomic.write_text(
      references_path(workdir, split), ''.join(line + '\n' for line in evaluation.references)
    )
  return stem + '.json'


def references_path(workdir: str, split: str) -> str:
  """WORKDIR/eval/references-<split>.txt: the references eval.py scored `split` against."""
  return os.path.join(workdir, 'eval', f'references-{split}.txt')


def watch(
  run: Setup,
  workdir: str,
  request: tasks.EvalRequest,
  *,
  poll_seconds: float = 30.0,
  timeout_seconds: float | None = None,
) -> list[int]:
  """Evaluates each new checkpoint as it appears, until the run's final step is done.

  A side-car next to a training job: each checkpoint's `Evaluation` goes to
  WORKDIR/eval/ (`write`), its metrics (`{split}_bleu`, ...) to
  WORKDIR/eval/metrics.jsonl and TensorBoard. It never takes the workdir's
  lock; it reads it (`workdir_lock`) to know whether the run is still
  training, logs what it waits for, and stops with a warning once the run is
  no longer running and every checkpoint it left has been evaluated (no new one
  can come). Returns the steps evaluated.
  """
  config = request.config
  evaluate = run.task.evaluator(request)  # Compiled once, for every checkpoint.
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
            workdir, run.abstract_state, str(step), keep=config.keep_checkpoints
          )
        except checkpoints.CheckpointGoneError as e:
          logging.info('Skipping step %d: %s', step, e)
          rotated_out.add(step)
          continue
        evaluation = evaluate(params, label)
        write(workdir, label, request.split, evaluation)
        writer.write(step, evaluation.metrics)
        writer.flush()
        logging.info('step %d: %s', step, evaluation.summary.splitlines()[0])
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
