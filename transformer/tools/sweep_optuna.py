"""Optuna as a sweep's search and study store: `sweep.py --search=optuna`.

A sweep file whose `space()` returns {dotted key: sampler} (`sweeps.uniform`, `log_uniform`,
`int_uniform`, `choice`: the helpers of `random_search`) is an Optuna study of `--num_trials`
trials; its `sweep()`, if it has one, gives the first trials (enqueued). Any other sweep file
runs as a study with `--search=optuna`: its trials are enqueued and its space is each swept
key's listed values (`choice`), so the same trials run, and the pruner stops the poor ones.

The driver (`sweep_study`) asks the study for trials and tells it their results; a trial is
the project's own: its overrides checked against the config, its folder ROOT/<name> named by
its overrides (every key of the space), its train.py (then eval.py) run, resumed and recorded
by `sweep_runner`, the summary and the TensorBoard table as for any sweep. Trials never
import Optuna, so a trial may be a multi-host run.

* Samplers: TPE (`--sampler=tpe`, with the constant liar for trials running at once) or
  random. Each trial's draw is seeded with config.seed + its number: a study run again
  draws the same trials, and workers drawing at once draw different ones.
* Pruners: `--pruner=median` (after `--startup_trials` complete), `halving` (successive
  halving from the first validation) or `hyperband`; none with `--pruner=none`. Each of a
  running trial's validation rows in metrics.jsonl is reported at its step (the summary's
  target column as it stood then: the last eval_loss, or the best validation BLEU so far).
  A trial the pruner stops gets SIGTERM: train.py checkpoints and exits, the trial is
  `pruned` (resumable, like an interrupted one, by a list sweep over the same root) and is
  not ranked in the summary.
* The objective: the summary's column of `config.target_metric` (`sweeps.TARGET_METRICS`),
  so the study's best trial is the summary's best.
* The study: SQLite in ROOT/study.db by default (one machine, its workers in one or more
  sweep.py processes); `--storage=PATH` a journal file (`JournalFileBackend`) on a file
  system the machines share; `--storage=postgresql://...` (or mysql://, sqlite:///) a
  database. Workers on several machines run the same sweep.py command with the same root
  and storage; `--num_trials` counts the trials of the whole study.
* Running the study (ask, run, report, tell; stale trials retried): `sweep_study`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections

from transformer import storage
from transformer.errors import InvalidInput
from transformer.tools import sweeps
from transformer.tools.sweeps import Overrides, Sweep, Trial

SEARCHES = ('list', 'optuna')
SAMPLERS = ('tpe', 'random')
PRUNERS = ('median', 'halving', 'hyperband', 'none')
DEFAULT_STORAGE = 'study.db'  # In the sweep root: sqlite:///ROOT/study.db.


@dataclasses.dataclass(frozen=True)
class Study:
  """An Optuna study over a sweep's base config: where it is kept and how it searches."""

  space: dict[str, sweeps.Sampler]  # Dotted key -> its sampler, every trial sets every key.
  num_trials: int  # Trials of the whole study (complete, pruned, failed on their own).
  sampler: str  # SAMPLERS.
  pruner: str  # PRUNERS.
  storage: str  # A database URL or a journal file's path.
  name: str  # The study's name in the storage.
  startup_trials: int  # The median pruner's: trials that complete before it prunes.


# --- The search space, checked against the config -------------------------------------------------


def search_of(sweep_file: str) -> str:
  """'optuna' for a sweep file that defines `space()`, else 'list'."""
  return 'optuna' if callable(getattr(sweeps.load_module(sweep_file), 'space', None)) else 'list'


def _value(config: ml_collections.ConfigDict, key: str) -> Any:
  node = config
  for part in key.split('.'):
    node = node[part]
  return node


def _derived_space(config: ml_collections.ConfigDict, trials: Sequence[Trial]) -> dict:
  """Each swept key's values in order of appearance (the base value where a trial keeps it)."""
  keys = list(dict.fromkeys(key for trial in trials for key in trial.overrides))
  space = {}
  for key in keys:
    values = [trial.overrides.get(key, _value(config, key)) for trial in trials]
    space[key] = sweeps.choice(list(dict.fromkeys(values)))
  return space


def _contains(sampler: sweeps.Sampler, value: Any) -> bool:
  if isinstance(sampler, sweeps.Choice):
    return value in sampler.values
  return sampler.low <= value <= sampler.high


def _check_space(
  config: ml_collections.ConfigDict, space: Mapping[str, Any], source: str, fixed: Mapping
) -> dict[str, sweeps.Sampler]:
  """`space` with its values typed as the config's fields; errors name the key."""
  if not isinstance(space, Mapping) or not space:
    raise InvalidInput(f'{source}: space() must return a non-empty dict of key: sampler.')
  checked = {}
  for key, sampler in space.items():
    if not isinstance(sampler, sweeps.Uniform | sweeps.IntUniform | sweeps.Choice):
      raise InvalidInput(
        f'{source}: space()[{key!r}] = {sampler!r} is not one of sweeps.uniform, '
        'log_uniform, int_uniform or choice.'
      )
    if key in fixed:
      raise InvalidInput(
        f'{source}: space() searches {key!r}, which the command line sets for every trial.'
      )
    if isinstance(sampler, sweeps.Choice):
      values = sampler.values
    elif isinstance(sampler, sweeps.Uniform):  # Draws floats, whatever the bounds' type.
      values = (float(sampler.low), float(sampler.high))
    else:
      values = (sampler.low, sampler.high)
    try:
      typed = [sweeps.check_overrides(config, {key: value})[key] for value in values]
    except ValueError as e:
      raise InvalidInput(f'{source}: space()[{key!r}]: {e}') from None
    if isinstance(sampler, sweeps.Choice):
      checked[key] = sweeps.choice(typed)
    elif isinstance(sampler, sweeps.IntUniform):
      checked[key] = sampler
    else:
      checked[key] = dataclasses.replace(sampler, low=typed[0], high=typed[1])
  return checked


def create(
  config_file: str,
  config: ml_collections.ConfigDict,
  sweep_file: str,
  root: str,
  shared_overrides: Overrides | None = None,
  eval_flags: Sequence[str] | None = None,
  *,
  num_trials: int = 0,
  sampler: str = 'tpe',
  pruner: str = 'median',
  storage_spec: str = '',
  study_name: str = '',
  startup_trials: int = 5,
  seeds: int = 1,
) -> tuple[Sweep, Study]:
  """The sweep of a study's first (enqueued) trials, and the study; checked, nothing runs.

  The sweep file's `space()` (or the values its `sweep()` lists) is checked against the
  config: every key, both bounds and every choice, as a trial's overrides are.
  """
  if seeds != 1:
    raise InvalidInput(
      f'--seeds={seeds}: an Optuna study runs each configuration once. Run the configurations '
      'it found best with seeds as a sweep of their own (a sweep file listing them, --seeds).'
    )
  if sampler not in SAMPLERS or pruner not in PRUNERS:
    raise InvalidInput(f'--sampler must be one of {SAMPLERS}, --pruner one of {PRUNERS}.')
  if startup_trials < 0 or num_trials < 0:
    raise InvalidInput('--num_trials and --startup_trials must be >= 0.')
  shared_overrides = dict(shared_overrides or {})
  module = sweeps.load_module(sweep_file)
  listed = sweeps.load_overrides(sweep_file) if callable(getattr(module, 'sweep', None)) else []
  sweep = sweeps.create(
    config_file, config, sweep_file, root, shared_overrides, eval_flags, overrides_list=listed
  )
  if callable(getattr(module, 'space', None)):
    space = _check_space(config, module.space(), sweep_file, shared_overrides)
  elif listed:
    space = _derived_space(config, sweep.trials)
  else:
    raise InvalidInput(f'{sweep_file} defines neither space() nor sweep().')
  enqueued = []
  for index, trial in enumerate(sweep.trials):
    outside = sorted(set(trial.overrides) - set(space))
    if outside:
      raise InvalidInput(
        f'{sweep_file}: trial {index} of sweep() sets {outside}, which space() does not search.'
      )
    values = {key: trial.overrides.get(key, _value(config, key)) for key in space}
    wrong = [key for key, value in values.items() if not _contains(space[key], value)]
    if wrong:
      raise InvalidInput(
        f'{sweep_file}: trial {index} of sweep() {trial.overrides} is outside space() in {wrong}.'
      )
    enqueued.append(values)
  trials = sweeps.make_trials(
    config, enqueued, source=sweep_file, fixed=shared_overrides, keys=list(space)
  )
  sweep = dataclasses.replace(sweep, trials=tuple(trials))
  if num_trials == 0:
    if not trials:
      raise InvalidInput(f'{sweep_file} defines a space(): give the study --num_trials.')
    num_trials = len(trials)
  if not storage_spec:
    if storage.is_url(sweep.root):
      raise InvalidInput(
        f'An Optuna study of a sweep in {sweep.root} needs --storage: a database URL '
        '(postgresql://...) or a journal file on a file system the workers share.'
      )
    storage_spec = 'sqlite:///' + os.path.join(sweep.root, DEFAULT_STORAGE)
  elif storage.is_url(storage_spec):
    raise InvalidInput(
      f'--storage={storage_spec}: a bucket holds no study; give a database URL or a journal '
      'file on a file system the workers share.'
    )
  elif '://' not in storage_spec:
    storage_spec = os.path.abspath(os.path.expanduser(storage_spec))
  study = Study(
    space=space,
    num_trials=num_trials,
    sampler=sampler,
    pruner=pruner,
    storage=storage_spec,
    name=study_name or storage.basename(sweep.root.rstrip('/')),
    startup_trials=startup_trials,
  )
  return sweep, study


def describe(study: Study) -> list[str]:
  """The study's settings, one line each (the dry run's header)."""
  space = ', '.join(f'{key}: {sampler}' for key, sampler in study.space.items())
  return [
    f'# Optuna study {study.name!r} in {study.storage}: {study.num_trials} trials, '
    f'{study.sampler} sampler, {study.pruner} pruner',
    f'# space: {space}',
  ]


# --- The Optuna study ---------------------------------------------------------------------------


def import_optuna():
  import optuna  # pylint: disable=g-import-not-at-top

  # The constant liar and the retry callback are experimental; the driver relies on both.
  warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)
  return optuna


def distribution(sampler: sweeps.Sampler):
  optuna = import_optuna()
  if isinstance(sampler, sweeps.Choice):
    return optuna.distributions.CategoricalDistribution(sampler.values)
  if isinstance(sampler, sweeps.IntUniform):
    return optuna.distributions.IntDistribution(sampler.low, sampler.high)
  return optuna.distributions.FloatDistribution(sampler.low, sampler.high, log=sampler.log)


def _sampler(study: Study, seed: int):
  """The study's sampler, seeded per trial: config.seed + the trial's number."""
  optuna = import_optuna()

  def make(trial_seed: int):
    if study.sampler == 'random':
      return optuna.samplers.RandomSampler(seed=trial_seed)
    return optuna.samplers.TPESampler(seed=trial_seed, constant_liar=True)

  class PerTrialSeed(optuna.samplers.BaseSampler):
    """`make(seed + trial number)`'s sampler for each trial (`Study`'s docstring: why)."""

    def __init__(self):
      self._samplers: dict[int, Any] = {}

    def _of(self, trial):
      if trial.number not in self._samplers:
        self._samplers[trial.number] = make(seed + trial.number)
      return self._samplers[trial.number]

    def infer_relative_search_space(self, study, trial):
      return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
      return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
      return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
      self._of(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
      self._of(trial).after_trial(study, trial, state, values)
      self._samplers.pop(trial.number, None)

  return PerTrialSeed()


def _pruner(study: Study, config: ml_collections.ConfigDict):
  optuna = import_optuna()
  first = config.eval_every_steps  # The first validation: the first step a trial reports.
  if study.pruner == 'median':
    return optuna.pruners.MedianPruner(n_startup_trials=study.startup_trials)
  if study.pruner == 'halving':
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=first, reduction_factor=3)
  if study.pruner == 'hyperband':
    return optuna.pruners.HyperbandPruner(
      min_resource=first, max_resource=config.num_train_steps, reduction_factor=3
    )
  return optuna.pruners.NopPruner()


@contextlib.contextmanager
def _creating(study: Study) -> Iterator[None]:
  """A local SQLite file is created by one process at a time (workers started together)."""
  if not study.storage.startswith('sqlite:///'):
    yield
    return
  path = study.storage[len('sqlite:///') :]
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + '.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def load(sweep: Sweep, study: Study, create_if_missing: bool = True):
  """The `optuna.Study` (created if it does not exist yet)."""
  optuna = import_optuna()
  column, higher_is_better = sweeps.TARGET_METRICS[sweep.config.target_metric]
  with _creating(study):
    if '://' in study.storage:
      backend = optuna.storages.RDBStorage(
        study.storage,
        engine_kwargs={'connect_args': {'timeout': 60}}
        if study.storage.startswith('sqlite')
        else None,
      )
    else:
      os.makedirs(os.path.dirname(study.storage), exist_ok=True)
      backend = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(study.storage)
      )
    if not create_if_missing:
      return optuna.load_study(study_name=study.name, storage=backend)
    loaded = optuna.create_study(
      storage=backend,
      study_name=study.name,
      sampler=_sampler(study, sweep.config.seed),
      pruner=_pruner(study, sweep.config),
      direction='maximize' if higher_is_better else 'minimize',
      load_if_exists=True,
    )
    if loaded.user_attrs.get('objective') not in (None, column):
      raise InvalidInput(
        f'Study {study.name!r} in {study.storage} optimises {loaded.user_attrs["objective"]}, '
        f'not {column} (config.target_metric); give this sweep a study of its own.'
      )
    loaded.set_user_attr('objective', column)
  return loaded


# --- Running the study --------------------------------------------------------------------------
