"""Optuna as a sweep's search and study store: `sweep.py --search=optuna`.

A sweep file whose `space()` returns {dotted key: sampler} (`sweeps.uniform`, `log_uniform`,
`int_uniform`, `choice`: the helpers of `random_search`) is an Optuna study of `--num_trials`
trials; its `sweep()`, if it has one, gives the first trials (enqueued). Any other sweep file
runs as a study with `--search=optuna`: its trials are enqueued and its space is each swept
key's listed values (`choice`), so the same trials run, and the pruner stops the poor ones.

The driver, this process, asks the study for trials and tells it their results; a trial is
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
* Stale trials: a worker records its host, process and a heartbeat on each trial it runs.
  A running trial whose worker process on this host is gone, or whose heartbeat is older
  than STALE_SECONDS, is failed and enqueued again with the same values (Optuna's
  `RetryHeartbeatStaleTrialCallback`): the same folder, resumed from its checkpoint. That is
  how a study interrupted (Ctrl-C, SIGTERM, a lost machine) resumes: run the command again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections
from absl import logging

from transformer import runs, storage
from transformer.errors import InvalidInput
from transformer.tools import sweep_devices, sweep_results, sweep_runner, sweeps
from transformer.tools.sweeps import Overrides, Sweep, Trial

SEARCHES = ('list', 'optuna')
SAMPLERS = ('tpe', 'random')
PRUNERS = ('median', 'halving', 'hyperband', 'none')
DEFAULT_STORAGE = 'study.db'  # In the sweep root: sqlite:///ROOT/study.db.
HEARTBEAT_SECONDS = 20.0  # How often a worker records that a trial it runs is alive.
STALE_SECONDS = 120.0  # A running trial without a heartbeat for this long is failed, retried.
MAX_RETRIES = 3  # Times a stale trial is enqueued again.
POLL_SECONDS = 0.1  # How often a running trial's metrics.jsonl is looked at (a bucket: 5 s).
_BUCKET_POLL_SECONDS = 5.0


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


def _optuna():
  import optuna  # pylint: disable=g-import-not-at-top

  # The constant liar and the retry callback are experimental; the driver relies on both.
  warnings.filterwarnings('ignore', category=optuna.exceptions.ExperimentalWarning)
  return optuna


def _distribution(sampler: sweeps.Sampler):
  optuna = _optuna()
  if isinstance(sampler, sweeps.Choice):
    return optuna.distributions.CategoricalDistribution(sampler.values)
  if isinstance(sampler, sweeps.IntUniform):
    return optuna.distributions.IntDistribution(sampler.low, sampler.high)
  return optuna.distributions.FloatDistribution(sampler.low, sampler.high, log=sampler.log)


def _sampler(study: Study, seed: int):
  """The study's sampler, seeded per trial: config.seed + the trial's number."""
  optuna = _optuna()

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
  optuna = _optuna()
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
  optuna = _optuna()
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


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


class _Reports:
  """A running trial's validation values, read from its metrics.jsonl as it grows: the
  summary's column as it stood at each validation (the last eval_loss; best_eval_bleu: the
  highest eval_bleu so far)."""

  def __init__(self, workdir: str, column: str):
    self.path = storage.join(workdir, 'metrics.jsonl')
    self.best = column.startswith('best_')
    self.key = column.removeprefix('best_')
    self._size = -1
    self._reported: set[int] = set()

  def new(self) -> list[tuple[int, float]]:
    """(step, value) of the validation rows not seen before, in order."""
    if not storage.exists(self.path):
      return []
    if not storage.is_url(self.path):
      size = os.path.getsize(self.path)
      if size == self._size:
        return []
      self._size = size
    found, value = [], None
    for line in storage.read_text(self.path).splitlines():
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        break  # A line being written.
      if self.key not in row:
        continue
      value = max(value, row[self.key]) if self.best and value is not None else row[self.key]
      if row['step'] not in self._reported:
        self._reported.add(row['step'])
        found.append((row['step'], value))
    return found


class _Runner(sweep_runner._Runner):
  """`sweep_runner`'s runner, watching each running trial for the study (`_wait`)."""

  def __init__(self, sweep: Sweep, slots, driver: _Driver):
    super().__init__(sweep, slots)
    self.driver = driver

  def _wait(self, trial: Trial, stage: str, process: subprocess.Popen) -> int:
    asked = self.driver.asked.get(trial.name)
    if asked is None:
      return process.wait()
    reports = _Reports(self.sweep.workdir(trial), self.driver.column)
    poll = _BUCKET_POLL_SECONDS if storage.is_url(self.sweep.root) else POLL_SECONDS
    returncode = None
    while returncode is None:
      with contextlib.suppress(subprocess.TimeoutExpired):
        returncode = process.wait(timeout=poll)
      self.driver.heartbeat(asked)
      if stage != 'train':
        continue
      for step, value in reports.new():  # After the exit too: the pruner sees whole curves.
        prune = self.driver.report(asked, step, value)
        # The last evaluation ends the run: nothing is left to prune.
        last = step >= trial.config.num_train_steps
        if prune and not last and returncode is None and trial.name not in self._stopped:
          logging.info(
            '%s: pruned at step %d (%s %.4f); it checkpoints and stops.',
            trial.name,
            step,
            self.driver.column,
            value,
          )
          self._stopped[trial.name] = 'pruned'
          process.terminate()  # SIGTERM: train.py checkpoints the step in hand and exits.
    if trial.name in self._stopped and runs.is_finished(self.sweep.workdir(trial), trial.config):
      del self._stopped[trial.name]  # It ended before the signal came: finished, not pruned.
    return returncode


class _Driver:
  """Asks the study for trials, runs them, tells it their results; `parallel` at once."""

  def __init__(self, sweep: Sweep, study: Study, parallel: int):
    optuna = _optuna()
    self.sweep, self.study, self.parallel = sweep, study, parallel
    self.optuna_study = load(sweep, study)
    self.column = sweeps.TARGET_METRICS[sweep.config.target_metric][0]
    self.distributions = {key: _distribution(s) for key, s in study.space.items()}
    self.states = optuna.trial.TrialState
    self.lock = threading.RLock()  # Around every call into Optuna.
    self.asked: dict[str, Any] = {}  # Trial name -> its optuna.Trial, while it runs.
    self.outcomes: dict[str, str] = {}
    self._beats: dict[int, float] = {}
    self._prepared: set[str] = set()
    self._preparing = threading.Lock()
    self._worker = {'host': socket.gethostname(), 'pid': os.getpid()}
    self.runner: _Runner | None = None

  # The study, under the lock.

  def _fail_stale(self) -> None:
    """Fails the running trials whose worker is gone, and enqueues each again (the docstring)."""
    optuna = _optuna()
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)
    for trial in self.optuna_study.get_trials(deepcopy=False, states=(self.states.RUNNING,)):
      worker = trial.user_attrs.get('worker') or {}
      if worker == self._worker:
        continue
      gone = worker.get('host') == self._worker['host'] and not _alive(worker['pid'])
      silent = time.time() - trial.user_attrs.get('heartbeat', 0.0) > STALE_SECONDS
      if not (gone or silent):
        continue
      try:
        failed = self.optuna_study.tell(trial.number, state=self.states.FAIL)
      except (ValueError, RuntimeError):
        continue  # Another worker failed it first, and enqueued it again.
      logging.warning(
        'Trial %d (%s) was left running by %s, which is gone; it runs again.',
        trial.number,
        trial.user_attrs.get('name', '?'),
        worker or 'a worker',
      )
      retry(self.optuna_study, failed)

  def _wanted(self) -> bool:
    """Whether the study wants another trial: fewer than --num_trials counted."""
    counted = 0
    for trial in self.optuna_study.get_trials(deepcopy=False):
      if trial.state in (self.states.COMPLETE, self.states.PRUNED, self.states.RUNNING):
        counted += 1
      elif trial.state == self.states.FAIL and 'error' in trial.user_attrs:
        counted += 1  # Failed on its own (not left by a lost worker, which runs again).
    return counted < self.study.num_trials

  def _enqueue_next(self) -> None:
    """Enqueues the first listed trial the study has not run, unless a trial waits already.

    One at a time, as each is wanted, so that a stale trial enqueued again (`_fail_stale`)
    runs before the listed trials that no worker has started (Optuna asks the oldest first).
    """
    trials = self.optuna_study.get_trials(deepcopy=False)
    if any(trial.state == self.states.WAITING for trial in trials):
      return
    ran = [trial.params for trial in trials]
    for trial in self.sweep.trials:
      if dict(trial.overrides) not in ran:
        self.optuna_study.enqueue_trial(dict(trial.overrides), skip_if_exists=True)
        return

  def _ask(self):
    with self.lock:
      self._fail_stale()
      if not self._wanted():
        return None
      self._enqueue_next()
      asked = self.optuna_study.ask(self.distributions)
      asked.set_user_attr('worker', self._worker)
      asked.set_user_attr('heartbeat', time.time())
      return asked

  def heartbeat(self, asked) -> None:
    now = time.time()
    if now - self._beats.get(asked.number, 0.0) >= HEARTBEAT_SECONDS:
      self._beats[asked.number] = now
      with self.lock:
        asked.set_user_attr('heartbeat', now)

  def report(self, asked, step: int, value: float) -> bool:
    """Reports a validation value; True if the pruner stops the trial."""
    with self.lock:
      asked.report(value, step)
      return asked.should_prune()

  def _tell(self, asked, value: float | None = None, state=None, error: str | None = None):
    with self.lock:
      if error is not None:
        asked.set_user_attr('error', error)
      self.optuna_study.tell(asked, value, state=state)

  # A trial.

  def _trial(self, params: Mapping[str, Any]) -> Trial:
    """The sweep's trial of the asked values (floats drawn to 3 significant digits)."""
    overrides = {
      key: sweeps.round_significant(value) if isinstance(value, float) else value
      for key, value in params.items()
    }
    [trial] = sweeps.make_trials(
      self.sweep.config,
      [overrides],
      source='the study',
      fixed=self.sweep.shared_overrides,
      keys=list(self.study.space),
    )
    return trial

  def _prepare(self, trial: Trial) -> None:
    """Its data once, before trials running at once would each prepare it (`prepare_data`)."""
    if self.parallel == 1:
      return
    with self._preparing:
      key = json.dumps(trial.config.data.to_dict(), sort_keys=True, default=str) + str(
        trial.config.vocab_size
      )
      if key not in self._prepared:
        sweep_runner.prepare_data([trial])
        self._prepared.add(key)

  def work(self) -> None:
    """One worker: trials one after another until the study has enough, or the sweep stops."""
    while not self.runner.stopping.is_set():
      asked = self._ask()
      if asked is None:
        return
      try:
        trial = self._trial(asked.params)
      except ValueError as e:
        logging.error('Trial %d %s: %s', asked.number, asked.params, e)
        self._tell(asked, state=self.states.FAIL, error=str(e))
        continue
      with self.lock:
        asked.set_user_attr('name', trial.name)
        asked.set_user_attr('overrides', trial.overrides)
      self._prepare(trial)
      self.asked[trial.name] = asked
      try:
        outcome = self.runner.run_trial(trial)
      finally:
        del self.asked[trial.name]
      self.outcomes[trial.name] = outcome
      self._finish(asked, trial, outcome)

  def _finish(self, asked, trial: Trial, outcome: str) -> None:
    """Tells the study how the trial ended."""
    if outcome == 'interrupted' and self.runner.stopping.is_set():
      return  # Left running: the next start finds its worker gone and runs it again.
    if outcome in ('finished', 'skipped'):
      value = getattr(sweep_results.collect(self.sweep, trial), self.column)
      if value is None:
        self._tell(asked, state=self.states.FAIL, error=f'no {self.column} in metrics.jsonl')
      else:
        self._tell(asked, value)
    elif outcome == 'pruned':
      self._tell(asked, state=self.states.PRUNED)
    elif outcome == 'interrupted':  # Stopped from outside the sweep: it runs again.
      with self.lock:
        failed = self.optuna_study.tell(asked, state=self.states.FAIL)
        _optuna().storages.RetryHeartbeatStaleTrialCallback(MAX_RETRIES)(self.optuna_study, failed)
    else:
      stages = (sweep_runner.read_state(self.sweep.workdir(trial)) or {}).get('stages', {})
      errors = [r.get('error') for r in stages.values() if r.get('status') == 'failed']
      reason = {'running': 'its folder is in use by another run'}.get(outcome, outcome)
      self._tell(asked, state=self.states.FAIL, error=next(filter(None, errors), reason))
    logging.info('Trial %d, %s: %s.', asked.number, trial.name, outcome)


def run(sweep: Sweep, study: Study, parallel: int = 1) -> dict[str, str]:
  """Runs the study's trials, `parallel` at a time, until it has `num_trials`.

  Returns {trial name: outcome} of the trials this process ran ('finished', 'pruned',
  'failed', ...). On KeyboardInterrupt (or SIGTERM made one) the running trials are stopped,
  marked interrupted, left running in the study (they run again on the next start), and the
  exception is raised again.
  """
  sweep_runner.check_parallel(parallel)
  driver = _Driver(sweep, study, parallel)
  base = Trial(name='base', overrides={}, config=sweep.config)
  slots = sweep_devices.trial_environments([*sweep.trials, base], parallel)
  driver.runner = _Runner(sweep, slots, driver)
  with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = [pool.submit(driver.work) for _ in range(parallel)]
    try:
      for future in concurrent.futures.as_completed(futures):
        future.result()
    except KeyboardInterrupt:
      driver.runner.stop()
      pool.shutdown(wait=True, cancel_futures=True)
      raise
  return driver.outcomes


def studied(sweep: Sweep, study: Study) -> Sweep:
  """The sweep of the trials the study has run (each folder once, in order): for the summary."""
  optuna_study = load(sweep, study, create_if_missing=False)
  trials: dict[str, Trial] = {}
  for asked in optuna_study.get_trials(deepcopy=False):
    name, overrides = asked.user_attrs.get('name'), asked.user_attrs.get('overrides')
    if name and name not in trials:
      config = sweeps.apply_overrides(sweep.config, overrides)
      trials[name] = Trial(name=name, overrides=overrides, config=config)
  return dataclasses.replace(sweep, trials=tuple(trials.values()))


def best(sweep: Sweep, study: Study) -> tuple[str, float] | None:
  """The study's best complete trial: (name, value), or None before one completed."""
  optuna_study = load(sweep, study, create_if_missing=False)
  complete = optuna_study.get_trials(deepcopy=False, states=(_optuna().trial.TrialState.COMPLETE,))
  if not complete:
    return None
  return optuna_study.best_trial.user_attrs['name'], optuna_study.best_value
