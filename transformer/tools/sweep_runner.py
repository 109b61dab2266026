"""Running a sweep's trials: one train.py (then eval.py) process each, its state in trial.json.

Each trial runs in ROOT/<name>/, recording its status, command lines and
attempts in ROOT/<name>/trial.json and the output in ROOT/<name>/train.log
(eval.log). A trial whose recorded commands equal the current ones and that
finished is skipped; any other is (re)started, and train.py resumes it from its
latest checkpoint. Trials run at once get devices of their own (`sweep_devices`).
`sweep_slurm` runs the same trials as Slurm job arrays (submitit).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import itertools
import json
import os
import queue
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from transformer import runs, storage, workdir_lock
from transformer.errors import InvalidInput
from transformer.tools import slurm_jobs, sweep_devices
from transformer.tools.sweeps import REPO_DIR, Sweep, Trial, flag_value

STATE_FILE = 'trial.json'


# --- Checks before anything runs ----------------------------------------------------------------


def check_eval_flags(sweep: Sweep) -> None:
  """eval.py checks the sweep's `--eval_flags` itself (`eval.py --dry_run`), before any trial.

  Names, types and domains of every flag, and what each trial's own config makes of them
  (`--dry_run_configs`): checkpoints it does not keep (`--checkpoint=best` without
  config.keep_best_checkpoints), a split its dataset lacks, flags its task does not take.
  Raises `InvalidInput` with eval.py's error. Takes one eval.py start (a few seconds).
  """
  if sweep.eval_flags is None:
    return
  with tempfile.TemporaryDirectory(prefix='sweep-eval-flags-') as folder:
    configs = os.path.join(folder, 'trial_configs.json')
    with open(configs, 'w') as f:
      json.dump({t.name: json.loads(t.config.to_json_best_effort()) for t in sweep.trials}, f)
    command = sweep.commands(sweep.trials[0])[-1][1] + [
      '--dry_run',
      f'--dry_run_configs={configs}',
    ]
    result = subprocess.run(
      command, cwd=sweep.cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600
    )
  if result.returncode != 0:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    start = next(
      (
        i
        for i in range(len(lines) - 1, -1, -1)
        if lines[i].startswith(('FATAL Flags parsing error', 'Invalid flags:'))
      ),
      max(len(lines) - 3, 0),
    )
    raise InvalidInput(
      f'--eval_flags={shlex.join(sweep.eval_flags)}: eval.py refuses them, so no trial was '
      'run:\n  ' + '\n  '.join(lines[start:])
    )


def check_parallel(parallel: int, slurm: bool = False) -> None:
  """`--parallel`: trials at once here (1 up to the CPU cores), or with Slurm a cap (>= 1)."""
  cores = os.cpu_count() or 1
  if parallel < 1:
    raise InvalidInput(f'--parallel={parallel} must be at least 1.')
  if not slurm and parallel > cores:
    raise InvalidInput(
      f'--parallel={parallel} exceeds the {cores} CPU cores of this machine: each trial is a '
      'train.py process that uses every core it gets, so more at once than cores only slow '
      f'each other down. Use --parallel={cores} or fewer (or --launcher=slurm for a cluster).'
    )


# --- Trial state: ROOT/<name>/trial.json ----------------------------------------------------------


def read_state(workdir: str) -> dict[str, Any] | None:
  path = storage.join(workdir, STATE_FILE)
  if not storage.exists(path):
    return None
  return storage.read_json(
    path,
    "It records the trial's stages (train, eval): delete it and run sweep.py again. The "
    'stages run again: a finished training run is found finished (nothing is retrained), and '
    'an evaluation is done anew.',
  )


def _write_state(workdir: str, state: dict[str, Any]) -> None:
  storage.write_json(storage.join(workdir, STATE_FILE), state, indent=2, sort_keys=True)


def _process_alive(state: Mapping[str, Any], workdir: str) -> bool | None:
  """Whether the process recorded as running the trial still runs; None if it cannot be known.

  A trial run by a Slurm job is dead when the scheduler says that start of the job ended.
  Otherwise only a process on this host can be looked at; on Linux it must also still be
  the trial's (its command line names the workdir), not a later one that got its pid.
  """
  if not state.get('pid'):
    return False  # Between stages, or stopped cleanly.
  job_alive = None
  if state.get('slurm'):
    job_alive = slurm_jobs.job_alive(state['slurm'])
    if job_alive is False:
      return False
  if state.get('host') != socket.gethostname():
    return job_alive
  if os.path.isdir('/proc/self'):
    try:
      with open(f'/proc/{state["pid"]}/cmdline', 'rb') as f:
        return f'--workdir={workdir}'.encode() in f.read()
    except OSError:
      return False
  try:
    os.kill(state['pid'], 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def trial_status(workdir: str) -> str:
  """'pending' (never started), 'running', 'interrupted', 'failed', 'finished' or, in an Optuna
  study, 'pruned' (stopped by its pruner, with a checkpoint)."""
  state = read_state(workdir)
  if state is None:
    return 'pending'
  if state['status'] == 'running' and _process_alive(state, workdir) is False:
    return 'interrupted'
  return state['status']


def _is_done(state: Mapping[str, Any] | None, stage: str, command: Sequence[str]) -> bool:
  """Finished earlier with the same command line (the Python executable aside)."""
  record = (state or {}).get('stages', {}).get(stage)
  return bool(record) and record['status'] == 'finished' and record['command'][1:] == command[1:]


# A Python exception's last line, absl's fatal flag error, or a refusal (`errors.run`).
_ERROR_LINE = re.compile(r'^(\w+\.)*\w*(Error|Exception|Interrupt)\b|^FATAL|^[\w.-]+: error: ')


def _error_line(log_path: str, offset: int) -> str:
  """The exception (with its message's following lines) or last line of the log since `offset`."""
  with open(log_path, errors='replace') as f:
    f.seek(offset)
    lines = [line.rstrip() for line in f if line.strip()]
  for index in range(len(lines) - 1, -1, -1):
    if _ERROR_LINE.match(lines[index]):
      message = [lines[index]] + list(
        itertools.takewhile(lambda line: line.startswith(' '), lines[index + 1 :])
      )
      return ' '.join(part.strip() for part in message)[:500]
  return lines[-1][:500] if lines else ''


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


# --- Running --------------------------------------------------------------------------------------


def prepare_data(trials: Sequence[Trial]) -> None:
  """Prepares each distinct dataset and vocabulary of `trials` once, in this process.

  Trials running at the same time (or as Slurm array tasks) would otherwise all
  prepare the same data at once and fail when renaming it into place.
  """
  from transformer import datasets, tokenizer  # TFDS: a slow import, only when needed.

  done = set()
  for trial in trials:
    key = (
      datasets.dataset_dir(trial.config.data),
      tokenizer.vocab_path(trial.config.data, trial.config.vocab_size),
    )
    if key not in done:
      logging.info('Preparing data and vocabulary once for all trials: %s, %s.', *key)
      datasets.prepare(trial.config.data)
      tokenizer.get_tokenizer(
        trial.config.data, vocab_size=trial.config.vocab_size, seed=trial.config.seed
      )
      done.add(key)


class _Runner:
  """Runs trials as subprocesses, each in its workdir, recording their state."""

  def __init__(self, sweep: Sweep, slots: Sequence[Mapping[str, str]] = ({},)):
    """`slots`: the environment of each trial running at once (`sweep_devices`: its devices)."""
    self.sweep = sweep
    self.stopping = threading.Event()
    self._processes: dict[str, subprocess.Popen] = {}
    self._lock = threading.Lock()
    self._slots: queue.SimpleQueue[Mapping[str, str]] = queue.SimpleQueue()
    for slot in slots:
      self._slots.put(slot)
    self._stopped: dict[str, str] = {}  # Trial -> its status, when `_wait` stopped it (pruned).

  def run_trial(self, trial: Trial) -> str:
    """'skipped', 'finished', 'failed', 'interrupted' or 'running' (by another process)."""
    workdir = self.sweep.workdir(trial)
    state = read_state(workdir)
    if state and state['status'] == 'running' and _process_alive(state, workdir):
      logging.warning('%s: already running in process %s; left alone.', trial.name, state['pid'])
      return 'running'
    holder = workdir_lock.read_holder(workdir)
    if holder is not None and workdir_lock.holder_alive(holder) is not False:
      logging.warning(
        '%s: its workdir is in use by another training run, %s; left alone.',
        trial.name,
        workdir_lock.describe(holder),
      )
      return 'running'
    commands = self.sweep.commands(trial)
    # After a stage runs, the later ones run again: they read what it wrote.
    first = next(
      (i for i, (stage, command) in enumerate(commands) if not _is_done(state, stage, command)),
      None,
    )
    if first is None:
      return 'skipped'
    storage.makedirs(workdir)
    state = state or {'stages': {}}
    state.update(name=trial.name, overrides=trial.overrides)
    slot = self._slots.get()  # Its devices, while its stages run.
    try:
      for stage, command in commands[first:]:
        if self.stopping.is_set():
          state['status'] = 'interrupted'
          _write_state(workdir, state)
          return 'interrupted'
        status = self._run_stage(trial, state, stage, command, slot)
        if status != 'finished':
          return status
    finally:
      self._slots.put(slot)
    return 'finished'

  def _run_stage(
    self,
    trial: Trial,
    state: dict[str, Any],
    stage: str,
    command: list[str],
    environment: Mapping[str, str],
  ) -> str:
    workdir = self.sweep.workdir(trial)
    log_path = storage.join(workdir, f'{stage}.log')
    previous = state['stages'].get(stage, {})
    record = {
      'command': command,
      'status': 'running',
      'started': _now(),
      'attempts': previous.get('attempts', 0) + 1,
      'log': storage.basename(log_path),
    }
    if environment:
      record['environment'] = dict(environment)  # The devices of its share (`sweep_devices`).
    started = time.time()
    with _stage_log(log_path) as local_log, open(local_log, 'a') as log:
      variables = ''.join(f'{k}={shlex.quote(v)} ' for k, v in environment.items())
      log.write(
        f'\n=== {record["started"]} attempt {record["attempts"]}: '
        f'{variables}{shlex.join(command)}\n'
      )
      log.flush()
      offset = log.tell()
      with self._lock:
        if self.stopping.is_set():
          return 'interrupted'
        process = subprocess.Popen(
          self.launch_command(stage, command),
          stdout=log,
          stderr=subprocess.STDOUT,
          stdin=subprocess.DEVNULL,
          cwd=self.sweep.cwd,
          env={**os.environ, **environment},
        )
        self._processes[trial.name] = process
      state.update(status='running', host=socket.gethostname(), pid=process.pid)
      state['stages'][stage] = record
      _write_state(workdir, state)
      returncode = self._wait(trial, stage, process)
      with self._lock:
        del self._processes[trial.name]
    trained = stage == 'train' and returncode == 0 and runs.is_finished(workdir, trial.config)
    if trial.name in self._stopped:  # Stopped on purpose, by `_wait`: a status of its own.
      status = self._stopped.pop(trial.name)
    elif self.stopping.is_set() and not trained:
      # train.py exits 0 after checkpointing on SIGTERM: stopped, not finished (unless the
      # signal came after its last step, while it evaluated or committed it).
      status = 'interrupted'
    elif returncode != 0:
      status = 'failed'
    elif stage == 'train' and not trained:
      # The same exit after a signal from elsewhere (a preemption, a kill by hand).
      logging.warning(
        '%s: train.py exited before config.num_train_steps=%d (a signal from outside the '
        'sweep?); the trial is interrupted and resumes when the sweep runs again.',
        trial.name,
        trial.config.num_train_steps,
      )
      status = 'interrupted'
    else:
      status = 'finished'
    record.update(status=status, returncode=returncode, seconds=round(time.time() - started, 1))
    if status == 'failed':
      record['error'] = _error_line(local_log, offset)
    if stage == 'eval' and status == 'finished':
      record['result'] = _newest_eval_result(workdir, started)
    eval_follows = stage == 'train' and self.sweep.eval_flags is not None
    state['status'] = 'running' if status == 'finished' and eval_follows else status
    state['pid'] = None
    _write_state(workdir, state)
    return status

  def launch_command(self, stage: str, command: list[str]) -> list[str]:
    """The command line that runs `stage`: `command` (which trial.json records) here.

    A launcher may add what only this start needs (`sweep_slurm`: the processes of a run).
    """
    del stage
    return command

  def _wait(self, trial: Trial, stage: str, process: subprocess.Popen) -> int:
    """Waits for the stage's process; returns its exit code. A study watches it here
    (`sweep_study`), and a trial it stops (SIGTERM) gets the status it puts in `_stopped`."""
    del trial, stage
    return process.wait()

  def stop(self) -> None:
    """Stops every running trial (they resume from their checkpoints next time)."""
    with self._lock:
      self.stopping.set()
      processes = list(self._processes.values())
    for process in processes:
      process.terminate()


@contextlib.contextmanager
def _stage_log(log_path: str):
  """A local file for a stage's output: `log_path`, or on a bucket a copy uploaded at the end.

  An object cannot be appended to while a process writes it: on a bucket the stage writes a
  local temporary file, added to the log object when the stage ends (however it ends).
  """
  if not storage.is_url(log_path):
    yield log_path
    return
  with tempfile.TemporaryDirectory(prefix='sweep-log-') as folder:
    local = os.path.join(folder, storage.basename(log_path))
    try:
      yield local
    finally:
      if os.path.exists(local):
        with open(local, encoding='utf-8', errors='replace') as f:
          storage.append_text(log_path, f.read())


def _newest_eval_result(workdir: str, since: float) -> str | None:
  """The eval/*.json that eval.py wrote (relative to the workdir), or None."""
  times = {p: storage.mtime(p) for p in storage.glob(storage.join(workdir, 'eval'), '*.json')}
  paths = [p for p, written in times.items() if written >= since - 1]
  return max(paths, key=times.get)[len(workdir) :].lstrip('/' + os.sep) if paths else None


def pending_trials(sweep: Sweep, only: str | None = None) -> list[Trial]:
  """The trials (only the one named `only` if given) that have a command left to run."""
  trials = [sweep.trial(only)] if only else list(sweep.trials)
  return [
    t
    for t in trials
    if not all(
      _is_done(read_state(sweep.workdir(t)), stage, command) for stage, command in sweep.commands(t)
    )
  ]


def run(sweep: Sweep, parallel: int = 1, only: str | None = None) -> dict[str, str]:
  """Runs the trials (`parallel` at a time; only the one named `only` if given).

  Returns {trial name: 'skipped' | 'finished' | 'failed' | 'interrupted' |
  'running'}, the last for a trial that another sweep process is running. A
  failing trial does not stop the others. On KeyboardInterrupt (or SIGTERM made
  one by the caller) the running trials are stopped, marked 'interrupted' and the
  exception is raised again.
  """
  check_parallel(parallel)
  trials = [sweep.trial(only)] if only else list(sweep.trials)
  pending = pending_trials(sweep, only)
  slots = sweep_devices.trial_environments(pending, parallel)  # Before anything starts.
  if parallel > 1 and len(pending) > 1:
    prepare_data(pending)
  runner = _Runner(sweep, slots)
  pending_names = {t.name for t in pending}
  outcomes = {t.name: 'skipped' for t in trials if t.name not in pending_names}
  for name in outcomes:
    logging.info('%s: finished earlier with the same commands, skipped.', name)
  with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    futures = {pool.submit(runner.run_trial, t): t for t in pending}
    try:
      for future in concurrent.futures.as_completed(futures):
        trial = futures[future]
        outcomes[trial.name] = future.result()
        stages = (read_state(sweep.workdir(trial)) or {}).get('stages', {}).values()
        error = next((r['error'] for r in stages if r['status'] == 'failed'), None)
        logging.info(
          '[%d/%d] %s: %s%s',
          len(outcomes),
          len(trials),
          trial.name,
          outcomes[trial.name],
          f' ({error})' if error else '',
        )
    except KeyboardInterrupt:
      runner.stop()
      pool.shutdown(wait=True, cancel_futures=True)
      for trial in pending:
        state = read_state(sweep.workdir(trial))
        if state is not None and state['status'] == 'running':
          state['status'] = 'interrupted'
          _write_state(sweep.workdir(trial), state)
      raise
  return {t.name: outcomes[t.name] for t in trials}


def dry_run(sweep: Sweep) -> list[str]:
  """One line per command of every trial, with its current status; nothing runs or is written."""
  lines = [f'# in {sweep.cwd}']
  for trial in sweep.trials:
    workdir = sweep.workdir(trial)
    state = read_state(workdir)
    status = trial_status(workdir)
    for stage, command in sweep.commands(trial):
      if _is_done(state, stage, command):
        note = 'finished: skipped'
      else:
        note = 'new' if state is None else f'{status}: runs again, resuming its checkpoints'
      lines.append(f'# {trial.name} [{stage}, {note}]\n{shlex.join(command)}')
  return lines


# --- Slurm ----------------------------------------------------------------------------------------


def sweep_command(sweep: Sweep, *extra: str) -> list[str]:
  """The sweep.py command line that reproduces `sweep` (plus `extra` flags)."""
  command = [
    sys.executable,
    os.path.join(REPO_DIR, 'sweep.py'),
    f'--config={sweep.config_file}',
    f'--sweep={sweep.sweep_file}',
    f'--workdir={sweep.root}',
  ]
  if sweep.eval_flags is not None:
    command += ['--eval', f'--eval_flags={shlex.join(sweep.eval_flags)}']
  if sweep.seeds > 1:
    command.append(f'--seeds={sweep.seeds}')
  if sweep.compare_to is not None:
    command.append(f'--compare_to={sweep.compare_to}')
  command += [
    f'--config.{key}={flag_value(value)}' for key, value in sweep.shared_overrides.items()
  ]
  return command + list(extra)
