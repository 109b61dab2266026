"""Fine-tuning: a new run that starts from the parameters of another run's checkpoint.

With `config.init_from` set, a new run starts from the parameters of that source's checkpoint
`config.init_checkpoint` instead of random ones (eval.py's --checkpoint grammar: 'latest', a
step, 'avg:N', 'avg:N@STEP', 'best', 'avg_best:N'; several checkpoints are averaged as eval.py
averages them, `evaluation.load_params`). Its optimizer state, learning-rate schedule (step 0)
and data position start fresh.

- `resolve(config, workdir)` finds the source and checks it against `config` before anything
  is written or compiled: every field that shapes the parameters or gives them their meaning
  (the model, the vocabulary size and type, the language pair: `runs.weight_meaning_changes`)
  must be the source's, and the vocabulary must have the content (sha256) of the one the
  source trained with; every difference is named in one message. A workdir that holds
  checkpoints of its own resumes from them, never from the source (`runs.check_resume`
  refuses another `init_from` or `init_checkpoint`): `resolve` then returns None.
- `load(source, target)` reads the parameters into the new run's shardings (a source trained
  on another number of devices loads), logs what it loaded and returns the record that
  provenance.jsonl keeps: where from, which steps, and the sha256 of the parameters.

A kind of source is one function from `config.init_from` to a `Source` (`_source`): the
workdir of a training run (`_run_source`: a path, or a gs:// URL), or `hf:DIR`, a Hugging Face
Marian directory (`_hf_source`, read by `interop.workdirs.load_hf` as `convert.py --from_hf`
reads it). The parameters of `hf:DIR` come with their vocabulary: `config.data.vocab_path`
must name it, a file with that content or a new one that `write_vocabulary` writes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Collection
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from transformer import (
  best_checkpoints,
  checkpoint_spec,
  checkpoints,
  evaluation,
  optim,
  path_checks,
  provenance,
  ranking,
  runs,
  sharding,
  storage,
  tasks,
  train_steps,
)
from transformer.errors import InvalidInput, MissingInput
from transformer.model import Transformer


@dataclasses.dataclass(frozen=True)
class Target:
  """The new run's model laid out on its mesh: what a source's parameters are read into."""

  model: Transformer
  task: tasks.Task
  mesh: Mesh
  rules: sharding.Rules
  shardings: Any  # The NamedSharding of every parameter (the train state's `params`).


@dataclasses.dataclass(frozen=True)
class Source:
  """Parameters to start from, found and described (`resolve`); `read(target)` loads them."""

  location: str  # config.init_from, resolved.
  checkpoint: str  # config.init_checkpoint.
  steps: tuple[int, ...]  # The checkpoints it names; several are averaged.
  config: ml_collections.ConfigDict  # The source's model, vocabulary and languages, as keys.
  vocabulary: dict[str, str | None]  # {'path', 'hash'} of the vocabulary it trained with.
  read: Callable[[Target], Any]  # The parameters, in the target's shapes.
  vocabulary_model: bytes | None = None  # The serialized vocabulary, where it comes along,
  target_vocabulary_model: bytes | None = None  # and the target side's own, where it has one.
  # {'path', 'hash'} of the target side's own vocabulary; None: `vocabulary` encodes both.
  target_vocabulary: dict[str, str | None] | None = None

  def describe(self) -> str:
    """'workdirs/a, checkpoint 'avg:2' (steps 400, 500 averaged)'."""
    if not self.steps:
      return self.location
    steps = ', '.join(map(str, self.steps))
    which = f'steps {steps} averaged' if len(self.steps) > 1 else f'step {steps}'
    return f'{self.location}, checkpoint {self.checkpoint!r} ({which})'


def resolve(
  config: ml_collections.ConfigDict, workdir: str | None = None, overridden: Collection[str] = ()
) -> Source | None:
  """The source of a new run's parameters, checked against `config`; None without one.

  `overridden`: the keys set on the command line (`--config.KEY`), so that a refusal says
  where each differing value came from.

  None too when `workdir` holds committed checkpoints: the run resumes from its own. Raises
  `InvalidInput` (or `MissingInput`) naming the config key: a source that is not there or
  holds no such checkpoint, or whose model or vocabulary differ from `config`'s (every
  difference in one message). Reads the source only; writes and compiles nothing.
  """
  if not config.init_from:
    return None
  if workdir is not None and checkpoints.committed_steps(storage.join(workdir, 'checkpoints')):
    return None  # A resume: from the run's own checkpoints (`runs.check_resume`).
  name = f'config.init_from={config.init_from}'
  if config.init_from.startswith(HF_PREFIX):
    return _checked(_hf_source(config), config, overridden)
  errors = storage.path_errors(config.init_from, 'config.init_from') or (
    storage.checkpoint_errors(config.init_from, 'config.init_from')
  )
  if errors:
    raise InvalidInput(errors[0])
  if workdir is not None and path_checks.absolute(config.init_from) == path_checks.absolute(
    workdir
  ):
    raise InvalidInput(
      f"{name} is this run's own --workdir: a run starts from another run's parameters. "
      'Fine-tune in a new --workdir.'
    )
  return _checked(_source(config), config, overridden)


def _checked(
  source: Source, config: ml_collections.ConfigDict, overridden: Collection[str] = ()
) -> Source:
  """`source`, once its model, languages and vocabulary are found to be `config`'s."""
  name = f'config.init_from={config.init_from}'

  def origin(key, source_value):
    if key in overridden:
      return f' (--config.{key} on the command line: drop it)'
    return f" (the config file's value: override it, --config.{key}={source_value!r})"

  problems = runs.weight_meaning_changes(runs.flatten(source.config), runs.flatten(config), origin)
  problems += _vocabulary_problems(source, config)
  if problems:
    raise InvalidInput(
      f'{name}: its parameters do not fit this run. Differing between the run that trained '
      f'them and this one (source -> this run):\n  '
      + '\n  '.join(problems)
      + '\nNothing was written. The model, its vocabulary and its language pair come with the '
      "parameters: give each the source's value as said (or point config.data.vocab_path at "
      f'the vocabulary the source trained with, {source.vocabulary["path"]}), or train without '
      'config.init_from. Dropout, label smoothing, the learning rate and its schedule, the '
      'number of steps, the batch size and the data may differ.'
    )
  return source


def _source(config: ml_collections.ConfigDict) -> Source:
  """The `Source` that `config.init_from` names, by its kind (one function each)."""
  return _run_source(config)


def _run_source(config: ml_collections.ConfigDict) -> Source:
  """The workdir of a training run: its config.json, a checkpoint and its recorded vocabulary."""
  location = storage.resolve(config.init_from)
  name = f'config.init_from={config.init_from}'
  if not storage.isdir(location):
    raise MissingInput(
      f'{name}: there is no directory {location}. Name the workdir of the training run to '
      'start from.'
    )
  try:
    source_config = runs.read_run_config(location)
  except InvalidInput as e:  # Damaged, or a Hugging Face directory named without hf:.
    raise InvalidInput(f'{name}: {e}') from None
  if source_config is None:
    raise MissingInput(
      f'{name}: {location} holds no config.json, so it is not the workdir of a training run '
      '(train.py writes one there). Name the workdir of the training run to start from.'
    )
  spec = config.init_checkpoint
  best = checkpoint_spec.parse(spec).is_best
  metric = ranking.selection_metric(source_config.target_metric)
  committed = checkpoints.committed_steps(storage.join(location, 'checkpoints'))
  if not committed and not best:
    raise MissingInput(
      f'{name}: the run in {location} holds no committed checkpoint yet, so there are no '
      'parameters to start from. Start once it has saved one (config.checkpoint_every_steps), '
      'or name another run.'
    )
  try:
    if best:
      kept = best_checkpoints.BestCheckpoints(location, metric=metric, read_only=True)
      try:
        steps = checkpoint_spec.select_best_steps(kept.scores(), spec)
      finally:
        kept.close()
    else:
      steps = checkpoint_spec.select_steps(committed, spec)
  except (InvalidInput, MissingInput) as e:  # NoSuchCheckpoint is an InvalidInput.
    raise InvalidInput(f'config.init_checkpoint={spec!r} of {name}: {e}') from None
  read = functools.partial(_read_run, location, source_config, spec, tuple(steps))
  vocabulary = provenance.recorded_inputs(location).get('vocabulary')
  if not (vocabulary and vocabulary.get('hash')):  # A run from before inputs were recorded.
    vocabulary = provenance.vocabulary_input(source_config)  # Its config's file, if here.
  target_vocabulary = provenance.recorded_inputs(location).get('target_vocabulary')
  return Source(
    location, spec, tuple(steps), source_config, vocabulary, read, None, None, target_vocabulary
  )


HF_PREFIX = 'hf:'


def _hf_source(config: ml_collections.ConfigDict) -> Source:
  """A Hugging Face Marian directory, `hf:DIR`: its one set of parameters and vocabulary."""
  from transformer.interop import workdirs  # pylint: disable=g-import-not-at-top

  name = f'config.init_from={config.init_from}'
  directory = path_checks.absolute(config.init_from[len(HF_PREFIX) :])
  if storage.is_url(directory) or not storage.isdir(directory):
    raise MissingInput(
      f'{name}: {directory} is not a local directory. Name a Hugging Face Marian model '
      'directory (its config.json, weights and tokenizer files), e.g. one saved by '
      "transformers' save_pretrained or by convert.py --to_hf."
    )
  if config.init_checkpoint != 'latest':
    raise InvalidInput(
      f'config.init_checkpoint={config.init_checkpoint!r} of {name}: a Hugging Face '
      "directory holds one set of parameters; leave it at 'latest'."
    )
  if not config.data.vocab_path:
    raise InvalidInput(
      f'{name}: set config.data.vocab_path. The parameters come with their vocabulary, '
      'which this run reads from there: a file that holds it, or a new file that the run '
      'writes from the model directory before it starts.'
    )
  try:
    imported = workdirs.load_hf(directory)
  except (InvalidInput, MissingInput) as e:
    raise InvalidInput(f'{name}: {e}') from None
  if (imported.target_vocabulary is None) != (not config.data.target_vocab_path):
    raise InvalidInput(
      f'{name}: '
      + (
        'its target.spm differs from its source.spm (a SentencePiece model per side): set '
        "config.data.target_vocab_path to where the target's is (a file that holds it, or a "
        'new file the run writes before it starts).'
        if imported.target_vocabulary is not None
        else f'one SentencePiece model segments both its sides: leave '
        f'config.data.target_vocab_path={config.data.target_vocab_path!r} unset.'
      )
    )
  source_config = ml_collections.ConfigDict(config.to_dict())
  workdirs.apply_fields(source_config, {**imported.fields, 'decode': {}})
  for side, key in zip(imported.languages, ('source_lang', 'target_lang'), strict=True):
    if side:  # tokenizer_config.json's languages, where it names them.
      source_config.data[key] = side
  vocabulary = {
    'path': f'{directory} (source.spm, vocab.json)',
    'hash': hashlib.sha256(imported.vocabulary).hexdigest(),
  }
  target_vocabulary = None
  if imported.target_vocabulary is not None:
    target_vocabulary = {
      'path': f'{directory} (target.spm, vocab.json)',
      'hash': hashlib.sha256(imported.target_vocabulary).hexdigest(),
    }
  return Source(
    location=f'{HF_PREFIX}{directory}',
    checkpoint=config.init_checkpoint,
    steps=(),
    config=source_config,
    vocabulary=vocabulary,
    read=lambda target: imported.params,
    vocabulary_model=imported.vocabulary,
    target_vocabulary_model=imported.target_vocabulary,
    target_vocabulary=target_vocabulary,
  )


def write_vocabulary(source: Source | None, config: ml_collections.ConfigDict) -> None:
  """Writes the vocabulary that comes with `source`'s parameters to `config.data.vocab_path`
  where no file is there yet (`resolve` checked an existing one's content)."""
  if source is None:
    return
  for model, found in (
    (source.vocabulary_model, provenance.vocabulary_input(config)),
    (source.target_vocabulary_model, provenance.target_vocabulary_input(config)),
  ):
    if model is not None and not storage.exists(found['path']):
      storage.write_bytes(found['path'], model)
      logging.info('Wrote the vocabulary of %s to %s.', source.location, found['path'])


def _vocabulary_problems(source: Source, config: ml_collections.ConfigDict) -> list[str]:
  """[A line] if `config`'s vocabulary is not the one the source trained with, by content."""
  what = 'the vocabulary (every token id would mean another piece)'
  before, now = source.vocabulary, provenance.vocabulary_input(config)
  if now['hash'] is None and source.vocabulary_model is not None:
    return []  # Written from the source before the run reads it (`write_vocabulary`).
  if not before.get('hash'):
    return [
      f'{what}: the one the source trained with is not recorded in its '
      f'{provenance.FILENAME}, and its config names {before["path"]}, which does not exist '
      'here: copy it there, so that this run can be checked against it'
    ]
  if now['hash'] is None:
    return [
      f'{what}: {before["path"]} (sha256 {before["hash"][:16]}) -> {now["path"]}, which does '
      'not exist yet: this run would train a new one'
    ]
  return provenance.input_changes({'vocabulary': before}, {'vocabulary': now}) + (
    _target_vocabulary_problems(source, config)
  )


def _target_vocabulary_problems(source: Source, config: ml_collections.ConfigDict) -> list[str]:
  """[A line] if the target side's own vocabulary (config.data.target_vocab_path) is not the
  source's, or one side has one and the other not."""
  what = "the target side's vocabulary (targets would be segmented otherwise)"
  before, now = source.target_vocabulary, provenance.target_vocabulary_input(config)
  one = 'none (one vocabulary for both sides)'
  if before is None and now is None:
    return []
  if before is None or now is None:
    before_path, now_path = ((e or {}).get('path', one) for e in (before, now))
    return [f'{what}: {before_path} -> {now_path} (config.data.target_vocab_path)']
  if now['hash'] is None:
    if source.target_vocabulary_model is not None:
      return []  # Written from the source (`write_vocabulary`).
    return [f'{what}: {before["path"]} -> {now["path"]}, which does not exist']
  return provenance.input_changes({'target_vocabulary': before}, {'target_vocabulary': now})


def _read_run(
  location: str,
  source_config: ml_collections.ConfigDict,
  spec: str,
  steps: tuple[int, ...],
  target: Target,
):
  """The parameters of checkpoints `steps` of the run in `location`, as eval.py reads them.

  Restored into the layout of the source's train state (its optimizer's) on the target's
  mesh; only the parameters are kept.
  """
  abstract_state, _ = train_steps.abstract_state_and_shardings(
    target.model,
    optim.create_optimizer(optim.OptimizerConfig.from_config(source_config)),
    target.task,
    target.mesh,
    target.rules,
  )
  # The steps `resolve` found, even if the run has saved newer ones since.
  pinned = checkpoint_spec.pinned(spec, list(steps))
  expected = checkpoint_spec.label(spec, list(steps))
  params, label = evaluation.load_params(
    location,
    abstract_state,
    pinned,
    keep=source_config.keep_checkpoints,
    best_metric=ranking.selection_metric(source_config.target_metric),
  )
  if label != expected:
    raise InvalidInput(
      f'config.init_checkpoint={spec!r} of config.init_from={location} named {expected} '
      f'when this run started, but {label} when it was read: the run there is still training '
      'and changed its checkpoints meanwhile. Start again, or name fixed steps.'
    )
  return params


def load(source: Source, target: Target) -> tuple[Any, dict[str, Any]]:
  """The source's parameters placed with `target.shardings`, and the record of what they are.

  The record (provenance.jsonl's `initialization`): `init_from` (the source's location),
  `init_checkpoint`, the `steps` read and `params_sha256` (`params_sha256`). Logged once.
  """
  params = jax.device_put(source.read(target), target.shardings)
  digest = params_sha256(params)
  logging.info(
    'Initialised the parameters from %s: sha256 %s. The optimizer state, the learning-rate '
    'schedule (step 0) and the data position start fresh.',
    source.describe(),
    digest,
  )
  record = {
    'init_from': source.location,
    'init_checkpoint': source.checkpoint,
    'steps': list(source.steps),
    'params_sha256': digest,
  }
  return params, record


def params_sha256(params) -> str:
  """sha256 of every parameter's path, dtype, shape and values: the same on any mesh."""
  if jax.process_count() > 1:
    params = multihost_utils.process_allgather(params, tiled=True)
  leaves, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(params))
  digest = hashlib.sha256()
  for path, leaf in leaves:
    array = np.ascontiguousarray(leaf)
    digest.update(f'{jax.tree_util.keystr(path)} {array.dtype} {array.shape}\n'.encode())
    digest.update(array.tobytes())
  return digest.hexdigest()
