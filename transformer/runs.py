"""A training run's workdir through its life: resume checks, its config read and written, clean-up.

- `check_resume` and `check_inputs`: a resume that would read the checkpoints
  as something else (another model, fewer steps, other input files) is refused
  before anything is written; `RESUMABLE_KEYS` may change on resume.
- `write_config` writes WORKDIR/config.json (reporting what changed since the
  last start); `read_run_config` reads it back, `upgrade`d: a key added to the
  project after the run was written gets the value that run had (`ADDED_KEYS`).
- `owned_workdir` holds the workdir's lock (`workdir_lock`) for the run and,
  after a failed start, removes the empty folders the run created.
- `EarlyStopping` and `is_finished`: whether a run has anything left to train;
  `final_metrics`: what a finished run's metrics.jsonl says at its last step.

What a workdir holds and which paths may be written are `path_checks.RUN_ENTRIES`
and `path_checks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from transformer import (
  best_checkpoints,
  checkpoints,
  config_fields,
  metrics,
  path_checks,
  provenance,
  ranking,
  shutdown,
  storage,
  workdir_lock,
)
from transformer import config as config_lib
from transformer.errors import InvalidInput

# What a change of each config key means on resume is declared with the key
# (`config_fields.OnResume`): these may change without a warning ...
RESUMABLE_KEYS = config_fields.keys(config_fields.OnResume.FREE)
# ... these are refused: where the run's parameters started (`initialization`); its checkpoints
# go on from there, and a resume never initialises again.
_INITIALIZATION_KEYS = config_fields.keys(config_fields.OnResume.START)


def _changes_weight_meaning(key: str) -> bool:
  """Every model field (sizes, norm, position, activation, bias, ...) and the vocabulary."""
  return config_fields.on_resume(key) == config_fields.OnResume.WEIGHTS


def weight_meaning_changes(
  before: dict[str, Any], now: dict[str, Any], note: Callable[[str, Any], str] = lambda k, v: ''
) -> list[str]:
  """'config.KEY: before -> now' for each key of two flattened configs (`flatten`) whose
  change would read saved weights as another model's (`_changes_weight_meaning`), each
  followed by `note(key, before)` (where the value came from, say)."""
  return [
    f'config.{key}: {before.get(key)!r} -> {now.get(key)!r}{note(key, before.get(key))}'
    for key in sorted(set(before) | set(now))
    if _changes_weight_meaning(key) and before.get(key) != now.get(key)
  ]


def flatten(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'model.d_model': 256, ...} with values as JSON holds them (tuples become lists)."""
  return config_lib.flatten(json.loads(config.to_json_best_effort()))


def saved_config(workdir: str) -> dict[str, Any] | None:
  """WORKDIR/config.json flattened, with the keys older runs lack as they had them (`upgrade`)."""
  saved = read_run_config(workdir)
  return None if saved is None else flatten(saved)


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses a resume that would read the workdir's checkpoints as something else.

  Once the workdir holds a checkpoint: every model field and the vocabulary size
  (`_changes_weight_meaning`) must equal WORKDIR/config.json's, and so must where the run's
  parameters started (`config.init_from`, `config.init_checkpoint`: a resume goes on from its
  own checkpoints and never initialises again) and what the optimizer state and a decayed
  schedule depend on (`_continuation_changes`); other keys may change (`write_config` reports
  them); `config.num_train_steps` must not lie below the latest checkpoint, and the data and
  an existing vocabulary must have the content the run recorded (`check_inputs`). Runs before
  anything is written.
  """
  metrics.read_rows(storage.join(workdir, metrics.FILENAME))  # Damaged: refused before writing.
  imported = next((e for e in provenance.read(workdir) if provenance.IMPORTED_KEY in e), None)
  if imported is not None:
    raise InvalidInput(
      f'{workdir} holds a model that convert.py imported from '
      f'{imported[provenance.IMPORTED_KEY].get("path")}, not a run to resume. Nothing was '
      f'changed. Fine-tune it in a new workdir: train.py --config.init_from={workdir} '
      '--workdir=NEW.'
    )
  steps = checkpoints.committed_steps(storage.join(workdir, 'checkpoints'))
  if not steps:
    return
  checkpoint_dir = storage.join(workdir, 'checkpoints')
  saved = saved_config(workdir)
  current = flatten(config)
  changed = [] if saved is None else weight_meaning_changes(saved, current)
  restarted = [
    f'config.{key}: {saved.get(key)!r} -> {current.get(key)!r}'
    for key in _INITIALIZATION_KEYS
    if saved is not None and saved.get(key) != current.get(key)
  ]
  if changed or restarted:
    since = f'Changed since {workdir}/config.json (saved -> now):\n  '
    problems = []
    if changed:
      problems.append(
        f'The checkpoints in {checkpoint_dir} belong to another model: resuming would read '
        f'their weights with a changed meaning. {since}' + '\n  '.join(changed)
      )
    if restarted:
      problems.append(
        f'The checkpoints in {checkpoint_dir} go on from the parameters this run started from: '
        'a resume continues from its own checkpoints and never initialises again, so where it '
        f'started cannot change. {since}' + '\n  '.join(restarted)
      )
    raise InvalidInput(
      '\n'.join(problems) + '\nNothing was changed. Train this model in a new --workdir, '
      'or resume with the saved values (drop these overrides).'
    )
  if config.num_train_steps < steps[-1]:
    raise InvalidInput(
      f'config.num_train_steps={config.num_train_steps} lies below the latest checkpoint, step '
      f'{steps[-1]} of {checkpoint_dir}: this run is past it, and training cannot go back. '
      f'Nothing was changed. To evaluate an earlier checkpoint, run eval.py --workdir={workdir} '
      f'--checkpoint=STEP (steps {steps}); to train on, set config.num_train_steps above '
      f'{steps[-1]}; to train {config.num_train_steps} steps from scratch, use a new --workdir.'
    )
  if saved is not None and (
    problem := _continuation_changes(saved, current, config, workdir, steps[-1])
  ):
    raise InvalidInput(problem)
  if saved is not None and (problem := _stopped_early(saved, config, workdir, steps[-1])):
    raise InvalidInput(problem)
  check_inputs(config, workdir)


def _stopped_early(
  saved: dict[str, Any], config: ml_collections.ConfigDict, workdir: str, latest: int
) -> str | None:
  """Why more steps of a run that stopped early at checkpoint `latest` would train none, or None.

  The same command again (the saved config.num_train_steps) still changes nothing and ends
  well; asking for more steps while config.early_stopping_patience still stops the run is
  refused, saying how to go on.
  """
  before = saved.get('num_train_steps')
  if not isinstance(before, int) or config.num_train_steps <= before:
    return None
  metric = ranking.selection_metric(config.target_metric)
  stopping = EarlyStopping(config.early_stopping_patience, metric).replay(
    storage.join(workdir, metrics.FILENAME), latest
  )
  if not stopping.stop:
    return None
  return (
    f'config.num_train_steps={config.num_train_steps} (was {before}) would train nothing: the '
    f'run in {workdir} stopped early at step {latest}, its validation BLEU ({metric}) not '
    f'improved on {stopping.best:.2f} (step {stopping.best_step}) for {stopping.since_best} '
    f'evaluations, and config.early_stopping_patience={config.early_stopping_patience} keeps '
    f'it stopped. Nothing was changed. To train on, raise it above {stopping.since_best} '
    f'(--config.early_stopping_patience={stopping.since_best + 1}), or set it to 0 never to '
    f'stop early; to train {config.num_train_steps} steps from scratch, use a new --workdir.'
  )


# Keys that add an entry to the optimizer state when > 0, and what they switch.
_OPTIMIZER_SWITCH_KEYS = {
  'weight_decay': "AdamW's weight decay",
  'grad_clip_norm': 'gradient clipping by global norm',
}


def _continuation_changes(
  saved: dict[str, Any],
  current: dict[str, Any],
  config: ml_collections.ConfigDict,
  workdir: str,
  latest: int,
) -> str | None:
  """Why the run cannot go on from checkpoint `latest` with `config`, or None.

  The checkpoint holds an optimizer state whose layout depends on which optional
  transforms are on (`_OPTIMIZER_SWITCH_KEYS`) and best checkpoints ranked by one metric;
  a linear or cosine schedule past warm-up is already shaped by `config.num_train_steps`.
  (Its data position is carried over to another `config.data.num_workers`:
  `data_position`.) `saved` and `current`: the saved and the new config, flattened.
  """
  keep = 'Nothing was changed. Resume with the saved value (drop the override)'
  for key, what in _OPTIMIZER_SWITCH_KEYS.items():
    if key in saved and key in current and (saved[key] > 0) != (current[key] > 0):
      return (
        f'The checkpoints in {workdir}/checkpoints hold the optimizer state of another '
        f'optimizer: config.{key}: {saved[key]!r} -> {current[key]!r} turns {what} on or off, '
        f'which adds or removes an entry of that state. {keep} (any value > 0 if it was on), '
        'or train in a new --workdir.'
      )
  best_steps = checkpoints.committed_steps(storage.join(workdir, best_checkpoints.DIRECTORY))
  saved_target = saved.get('target_metric')
  kept_by = ranking.selection_metric(saved_target) if saved_target else None
  selects_by = ranking.selection_metric(config.target_metric)
  # Also with keep_best_checkpoints=0 now: eval.py's 'best' would rank them by the new metric.
  if best_steps and kept_by not in (None, selects_by):
    return (
      f'The best checkpoints {best_steps} in {workdir}/{best_checkpoints.DIRECTORY} were kept '
      f'by {kept_by} (config.target_metric={saved_target!r}); '
      f'config.target_metric={config.target_metric!r} would rank them by {selects_by}, mixing '
      'two selections. Nothing was changed. Resume with the saved config.target_metric, or '
      'train in a new --workdir.'
    )
  return _schedule_change(saved, config, workdir, latest)


def _schedule_change(
  saved: dict[str, Any], config: ml_collections.ConfigDict, workdir: str, latest: int
) -> str | None:
  """A linear or cosine decay that `config.num_train_steps` would reshape after it began."""
  before = saved.get('num_train_steps', config.num_train_steps)
  if (
    config.schedule not in config_lib.DECAYING_TO_LAST_STEP
    or saved.get('schedule') != config.schedule
    or before == config.num_train_steps
    or latest < config.warmup_steps  # The rise to the peak does not depend on the length.
  ):
    return None
  from transformer import optim  # pylint: disable=g-import-not-at-top  (jax-heavy)

  new = optim.OptimizerConfig.from_config(config)
  old = dataclasses.replace(new, num_train_steps=before)
  rate_now = float(optim.learning_rate_schedule(old)(latest))  # Optax count = step - 1.
  rate_new = float(optim.learning_rate_schedule(new)(latest))
  peak = optim.peak_learning_rate(new)
  return (
    f'config.num_train_steps: {before} -> {config.num_train_steps} reshapes the {config.schedule} '
    f'decay that this run (latest checkpoint: step {latest}) has followed since step '
    f'{config.warmup_steps}: the learning rate would jump from {rate_now:.3g} '
    f'({rate_now / peak:.1%} of the peak) to {rate_new:.3g} ({rate_new / peak:.1%}) at step '
    f'{latest + 1}, then decay to step {config.num_train_steps}: a curve no run of '
    f'{config.num_train_steps} steps follows. Nothing was changed. For a {config.num_train_steps}'
    '-step schedule, train from scratch in a new --workdir with that config.num_train_steps; '
    f'to finish this run, resume with config.num_train_steps={before}.'
  )


def check_inputs(
  config: ml_collections.ConfigDict, workdir: str, vocabulary: bytes | None = None
) -> dict[str, Any]:
  """Refuses inputs whose content differs from what the run recorded; returns the current ones.

  `provenance.inputs`: the training data (by the fingerprint of its source files) and the
  vocabulary (by sha256: of `vocabulary`, the model's bytes, or of its file if it exists),
  compared with the last start's record in WORKDIR/provenance.jsonl while the workdir holds
  a checkpoint. The same content at another path is accepted.
  """
  current = provenance.inputs(config, vocabulary)
  if not checkpoints.committed_steps(storage.join(workdir, 'checkpoints')):
    return current
  changes = provenance.input_changes(provenance.recorded_inputs(workdir), current)
  if changes:
    raise InvalidInput(
      f'The checkpoints in {workdir}/checkpoints were trained on other files: resuming would '
      f'read them with a changed meaning. Changed in content since the run recorded them in '
      f'{workdir}/{provenance.FILENAME} (recorded -> now):\n  '
      + '\n  '.join(changes)
      + '\nNothing was changed. Resume with the files the run started with (at any path: '
      'only their content counts), or train in a new --workdir.'
    )
  return current


# How config.json names a file of the run's own (one inside its workdir, e.g. an imported
# model's vocabulary.model): relative to the workdir, so that a moved workdir still finds it.
WORKDIR_PREFIX = '$WORKDIR/'


# The config's paths of files that a workdir may hold (an imported model's vocabularies).
_FILE_KEYS = ('data.vocab_path', 'data.target_vocab_path')


def _anchored(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """`config` as a dict, each of `_FILE_KEYS` that lies in local `workdir` as `$WORKDIR/REL`."""
  anchored = json.loads(config.to_json_best_effort())
  root = storage.resolve(workdir)
  for key in _FILE_KEYS:
    group, name = key.split('.')
    value = anchored.get(group, {}).get(name)
    if not (value and isinstance(value, str)) or storage.is_url(value) or storage.is_url(root):
      continue
    path = storage.resolve(value)
    if path != root and os.path.commonpath([path, root]) == root:
      anchored[group][name] = WORKDIR_PREFIX + os.path.relpath(path, root).replace(os.sep, '/')
  return anchored


def _expanded(loaded: dict[str, Any], workdir: str) -> dict[str, Any]:
  """`loaded` (config.json's dict) with each `$WORKDIR/REL` named where `workdir` is now."""
  root = storage.resolve(workdir)
  for key in _FILE_KEYS:
    group, name = key.split('.')
    value = loaded.get(group, {}).get(name)
    if isinstance(value, str) and value.startswith(WORKDIR_PREFIX):
      loaded[group][name] = storage.join(root, value[len(WORKDIR_PREFIX) :])
  return loaded


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes the resolved config to WORKDIR/config.json, warning about changes on resume.

  A path inside the workdir is written relative to it (`WORKDIR_PREFIX`): the run's own
  files are found where the workdir is, also once it was moved.
  """
  path = storage.join(workdir, 'config.json')
  anchored = _anchored(config, workdir)
  previous = saved_config(workdir)
  if previous is not None:
    current = config_lib.flatten(_expanded(anchored, workdir))
    for key in sorted(set(previous) | set(current)):
      if previous.get(key) != current.get(key):
        level = logging.INFO if key in RESUMABLE_KEYS else logging.WARNING
        logging.log(
          level,
          'Config key %s changed since the last run: %r -> %r (the command line wins).',
          key,
          previous.get(key),
          current.get(key),
        )
  storage.write_text(path, json.dumps(anchored, indent=2, sort_keys=True))


@contextlib.contextmanager
def owned_workdir(workdir: str):
  """Holds WORKDIR/train.lock (process 0, for the whole run).

  On an error, removes the empty folders that this run created (the workdir
  itself included), so a failed start leaves no trace.
  """
  # What a failed start must leave: local folders only (a bucket has none to remove). Not looked
  # up on a bucket, where a new workdir "exists" only while some object lies under it: another
  # process's probe (`storage.bucket_errors`) could make it appear and vanish between two looks.
  existed = None
  if not storage.is_url(workdir) and os.path.isdir(workdir):
    existed = set(os.listdir(workdir))
  lock = workdir_lock.WorkdirLock(workdir)
  error = None
  if jax.process_index() == 0:
    storage.makedirs(workdir)
    try:
      lock.acquire()
    except workdir_lock.WorkdirLockedError as e:
      error = e
  if jax.process_count() > 1:  # Every process stops if process 0 could not take the lock.
    locked = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if not locked and error is None:
      error = workdir_lock.WorkdirLockedError(
        f'Process 0 could not take {lock.path} (another run holds the workdir; see its log).'
      )
  try:
    if error is not None:
      raise error
    yield
  except BaseException:
    if jax.process_index() == 0:
      with shutdown.part(f'releasing {lock.path}'):
        lock.release()
      _remove_new_empty_folders(workdir, existed)
    raise
  finally:
    with shutdown.part(f'releasing {lock.path}'):
      lock.release()


def _remove_new_empty_folders(workdir: str, existed: set[str] | None) -> None:
  """Removes the empty folders under `workdir` that were not there before (then it, if new).

  A bucket has no empty folders: a prefix exists while an object lies under it.
  """
  if storage.is_url(workdir) or not os.path.isdir(workdir):
    return
  for name in sorted(set(os.listdir(workdir)) - (existed or set())):
    path = storage.join(workdir, name)
    if os.path.isdir(path) and not os.listdir(path):
      os.rmdir(path)
  if existed is None and not os.listdir(workdir):
    os.rmdir(workdir)


@dataclasses.dataclass
class EarlyStopping:
  """Evaluations since the validation BLEU last improved; `stop` after `patience` of them."""

  patience: int  # config.early_stopping_patience; 0: never stops.
  metric: str = 'eval_bleu'  # The BLEU it reads: `ranking.selection_metric(target_metric)`.
  best: float = -math.inf  # The highest validation BLEU so far ...
  best_step: int | None = None  # ... and the step that scored it.
  since_best: int = 0  # Evaluations since then (a tie does not improve).

  def record(self, step: int, bleu: float) -> None:
    if ranking.METRICS[self.metric].improves(bleu, self.best):
      self.best, self.best_step, self.since_best = bleu, step, 0
    else:
      self.since_best += 1

  @property
  def stop(self) -> bool:
    return self.patience > 0 and self.since_best >= self.patience

  def replay(self, metrics_path: str, last_step: int) -> EarlyStopping:
    """Records the validation BLEU of the run's evaluations up to `last_step` (metrics.jsonl).

    A resumed run so continues counting where it stopped, and a run that stopped
    early stays stopped.
    """
    bleus = {}  # Step -> BLEU; a step evaluated twice (a run resumed at its end) counts once.
    for row in metrics.read_rows(metrics_path):  # Without a last line cut short by a crash.
      if self.metric in row and row['step'] <= last_step:
        bleus[row['step']] = row[self.metric]
    for step in sorted(bleus):
      self.record(step, bleus[step])
    return self


def is_finished(workdir: str, config: ml_collections.ConfigDict) -> bool:
  """Whether the run in `workdir` has nothing left to train under `config`.

  Its newest committed checkpoint is at `config.num_train_steps` (or later), or its
  validation BLEU stopped improving for `config.early_stopping_patience`
  evaluations. train.py exits 0 after checkpointing on SIGTERM or SIGINT too, so a
  caller that sees it exit 0 asks this (the sweep runner) before calling a run done.
  """
  steps = checkpoints.committed_steps(storage.join(workdir, 'checkpoints'))
  last = steps[-1] if steps else 0
  metrics_path = storage.join(workdir, metrics.FILENAME)
  metric = ranking.selection_metric(config.target_metric)
  stopping = EarlyStopping(config.early_stopping_patience, metric).replay(metrics_path, last)
  return last >= config.num_train_steps or stopping.stop


def final_metrics(workdir: str, step: int) -> dict[str, float] | None:
  """The rows of metrics.jsonl at `step` merged, if they hold its evaluation; else None."""
  merged = {}
  for row in metrics.read_rows(storage.join(workdir, metrics.FILENAME)):
    if row['step'] == step:
      merged.update({k: v for k, v in row.items() if k not in ('step', metrics.WALL_SECONDS)})
  return merged if 'eval_loss' in merged else None


# --- WORKDIR/config.json of runs written before a key existed ------------------------------------

# Keys added to the project after runs were written -> the value those runs had (the paper's
# model and schedule, Adam without clipping, the sharding table of the time): each field's
# `before` in `config_fields`. `upgrade` fills them in.
ADDED_KEYS: dict[str, Any] = config_fields.added_keys()


def upgrade(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of a run's `config` (its WORKDIR/config.json) with every `ADDED_KEYS` key it lacks."""
  config = ml_collections.ConfigDict(config.to_dict())
  for key, value in ADDED_KEYS.items():
    *groups, leaf = key.split('.')
    target = config
    for group in groups:
      if group not in target:  # A group added since (e.g. decode).
        target[group] = ml_collections.ConfigDict()
      target = target[group]
    if leaf not in target:  # A following value (`config_fields.follows`): the run's own.
      following = isinstance(value, config_fields.Follows)
      target[leaf] = config_fields.value_of(config, value.key) if following else value
  return config


def read_run_config(workdir: str) -> ml_collections.ConfigDict | None:
  """WORKDIR/config.json as train.py wrote it, `upgrade`d, its own files named where the
  workdir is now (`WORKDIR_PREFIX`); None if there is none.

  A file that is not such a config is refused naming it: a Hugging Face model's (a model
  directory given as a workdir) with the commands that read one, any other (damaged, or
  overwritten by something else) as a `config.ConfigError` saying how to recover.
  """
  path = storage.join(os.path.expanduser(workdir), 'config.json')
  if not storage.exists(path):
    return None
  try:
    loaded = json.loads(storage.read_text(path))
    if path_checks.is_hugging_face_config(loaded):
      hugging_face = path_checks.hugging_face_directory_error(workdir, loaded)
    elif not isinstance(loaded, dict) or not {'model', 'data'} <= set(loaded):
      raise ValueError('not a JSON object with the groups model and data')
    else:
      return upgrade(ml_collections.ConfigDict(_expanded(loaded, workdir)))
  except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeError are too.
    raise config_lib.ConfigError(
      f'{path} is not a config written by train.py ({type(e).__name__}: {e}): it was damaged '
      'or overwritten. The checkpoints beside it are not affected. Restore it, or move it aside '
      f'(mv {path} {path}.bad) and run the train.py command of this run again: it checks the '
      "checkpoint's arrays against the model instead, and writes config.json anew."
    ) from None
  raise InvalidInput(hugging_face)
