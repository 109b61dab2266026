"""An Optuna study's trials run: the driver of `sweep.py --search=optuna` (`run`).

The driver, this process, asks the study (`sweep_optuna.load`) for trials, runs each with
`sweep_runner`'s runner (`--parallel` at once, on their own devices: `sweep_devices`),
watches its metrics.jsonl and reports each validation row to the pruner, stops (SIGTERM)
the trials the pruner prunes, and tells the study each result: the summary's column of
`config.target_metric`. `studied` and `best` read the study back for the summary.

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
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

from absl import logging

from transformer import ranking, runs, storage
from transformer.tools import sweep_devices, sweep_optuna, sweep_results, sweep_runner, sweeps
from transformer.tools.sweep_optuna import Study
from transformer.tools.sweeps import Sweep, Trial

HEARTBEAT_SECONDS = 20.0  # How often a worker records that a trial it runs is alive.
STALE_SECONDS = 120.0  # A running trial without a heartbeat for this long is failed, retried.
MAX_RETRIES = 3  # Times a stale trial is enqueued again.
MAX_DUPLICATES = 10  # Draws in a row of values a trial holds already, before a worker stops.
POLL_SECONDS = 0.1  # How often a running trial's metrics.jsonl is looked at (a bucket: 5 s).
_BUCKET_POLL_SECONDS = 5.0


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


_LISTED = 'listed_values'  # The user attribute that holds a listed trial's values.


def _values(trial) -> dict[str, Any]:
  """A trial's values: those it was enqueued with (set before it is asked), else its params."""
  return trial.user_attrs.get(_LISTED) or trial.params


def _rounded(values: Mapping[str, Any]) -> dict[str, Any]:
  """Floats to 3 significant digits: the values a trial's name and folder are made of."""
  return {
    key: sweeps.round_significant(value) if isinstance(value, float) else value
    for key, value in values.items()
  }


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
    optuna = sweep_optuna.import_optuna()
    self.sweep, self.study, self.parallel = sweep, study, parallel
    self.optuna_study = sweep_optuna.load(sweep, study)
    self.column = ranking.METRICS[sweep.config.target_metric].summary_column
    self.distributions = {key: sweep_optuna.distribution(s) for key, s in study.space.items()}
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
    optuna = sweep_optuna.import_optuna()
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)
    for trial in self.optuna_study.get_trials(deepcopy=False, states=(self.states.RUNNING,)):
      worker = trial.user_attrs.get('worker') or {}
      if worker == self._worker:
        continue
      gone = worker.get('host') == self._worker['host'] and not _alive(worker['pid'])
      # A trial asked a moment ago may not carry its worker's heartbeat yet: its start counts.
      started = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
      silent = time.time() - trial.user_attrs.get('heartbeat', started) > STALE_SECONDS
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
    """Enqueues the first listed trial that no trial of the study holds (waiting, run or running).

    One at each ask, whatever waits already: a worker that found a listed trial waiting and
    enqueued none could see another worker take it and then draw a trial of its own, while a
    listed one was never run. A stale trial enqueued again (`_fail_stale`) is older than this
    one, so it runs first (Optuna asks the oldest first).
    """
    held = [_values(trial) for trial in self.optuna_study.get_trials(deepcopy=False)]
    for trial in self.sweep.trials:
      if dict(trial.overrides) not in held:
        values = dict(trial.overrides)
        self.optuna_study.enqueue_trial(values, user_attrs={_LISTED: values})
        return

  def _held_before(self, asked) -> int | None:
    """The number of an earlier trial, not failed, of the same folder as `asked`; None if none.

    Two workers may enqueue the same listed trial at once (Optuna's `enqueue_trial` is not
    atomic across processes) and each ask a copy: the later copy is the duplicate. So is a
    draw whose values, as `_trial` rounds them, a trial holds already.
    """
    values = _rounded(asked.params)
    for trial in self.optuna_study.get_trials(deepcopy=False):
      held = trial.number < asked.number and trial.state != self.states.FAIL
      if held and _rounded(_values(trial)) == values:
        return trial.number
    return None

  def _ask(self):
    """The next trial to run, marked as this worker's; None once the study has enough."""
    with self.lock:
      for _ in range(MAX_DUPLICATES + 1):
        self._fail_stale()
        if not self._wanted():
          return None
        self._enqueue_next()
        asked = self.optuna_study.ask(self.distributions)
        earlier = self._held_before(asked)
        if earlier is None:
          asked.set_user_attr('worker', self._worker)
          asked.set_user_attr('heartbeat', time.time())
          return asked
        # Failed without an error: not counted (`_wanted`), not run again, not summarized.
        asked.set_user_attr('duplicate_of', earlier)
        self.optuna_study.tell(asked, state=self.states.FAIL)
        logging.info('Trial %d %s is trial %d again: not run.', asked.number, asked.params, earlier)
      logging.warning(
        'The study drew only trials it holds already (%d times); this worker stops.',
        MAX_DUPLICATES + 1,
      )
      return None

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
    [trial] = sweeps.make_trials(
      self.sweep.config,
      [_rounded(params)],
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
        sweep_optuna.import_optuna().storages.RetryHeartbeatStaleTrialCallback(MAX_RETRIES)(
          self.optuna_study, failed
        )
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
  optuna_study = sweep_optuna.load(sweep, study, create_if_missing=False)
  trials: dict[str, Trial] = {}
  for asked in optuna_study.get_trials(deepcopy=False):
    name, overrides = asked.user_attrs.get('name'), asked.user_attrs.get('overrides')
    if name and name not in trials:
      config = sweeps.apply_overrides(sweep.config, overrides)
      trials[name] = Trial(name=name, overrides=overrides, config=config)
  return dataclasses.replace(sweep, trials=tuple(trials.values()))


def best(sweep: Sweep, study: Study) -> tuple[str, float] | None:
  """The study's best complete trial: (name, value), or None before one completed."""
  optuna_study = sweep_optuna.load(sweep, study, create_if_missing=False)
  complete = optuna_study.get_trials(
    deepcopy=False, states=(sweep_optuna.import_optuna().trial.TrialState.COMPLETE,)
  )
  if not complete:
    return None
  return optuna_study.best_trial.user_attrs['name'], optuna_study.best_value
