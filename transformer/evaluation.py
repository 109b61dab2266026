"""A trained run, loaded for evaluation: its config, mesh, restored parameters; input lines.

What is evaluated, and how, is the task's (`transformer.tasks`): BLEU of
translations, perplexity of a language model.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import ml_collections
from absl import logging

from transformer import checkpoints, optim, sharding, tasks, training
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
  path = os.path.join(os.path.expanduser(workdir), 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(
      f'No resolved config at {path}: --workdir must be a directory written by train.py.'
    )
  with open(path) as f:
    config = config_lib.upgrade(ml_collections.ConfigDict(json.load(f)))
  config_lib.validate(config)
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except ValueError as e:
    logging.info(
      '%s Evaluating data-parallel over the %d devices here instead.', e, jax.device_count()
    )
    config.mesh.update(data=-1, fsdp=1, tensor=1)
  return config


def mesh_and_rules(config: ml_collections.ConfigDict):
  """The config's mesh over every device, and its logical axis rules."""
  return sharding.create_mesh(config.mesh), sharding.axis_rules(config.mesh)


def abstract_state(config: ml_collections.ConfigDict):
  """Shapes and shardings of the train state (restore targets), nothing allocated."""
  model, _ = training.create_models(ModelConfig.from_config(config))
  abstract, _ = training.abstract_state_and_shardings(
    model, optim.create_optimizer(config), tasks.get_task(config), *mesh_and_rules(config)
  )
  return abstract


def restore_params(config: ml_collections.ConfigDict, workdir: str, checkpoint: str):
  """(params, label) of `checkpoint` ('latest', a step, or 'avg:N') in `workdir`."""
  return checkpoints.load_params(workdir, abstract_state(config), checkpoint)


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
