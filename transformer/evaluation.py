"""A trained run, loaded for evaluation: its config, what it becomes, restored parameters.

`setup(config)` turns the run's config into model config, task, mesh, rules and
restore target once; eval.py passes them down. What is evaluated, and how, is
the task's (`transformer.tasks`): BLEU of translations, perplexity of a
language model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.sharding import Mesh

from transformer import checkpoints, optim, provenance, sharding, tasks, training
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
