"""One trial of a Slurm sweep as the task of a job array (`sweep_slurm` submits them).

`SlurmTrial` is the `submitit.helpers.Checkpointable` that each task runs through srun. Process
0, the leader, runs the trial as sweep.py does here (`sweep_runner`) and rewrites the summary
when it ends; the others wait for its word (ROOT/slurm/TRIAL.go.json) and run the trial's
train.py as their rank of `jax.distributed`. On Slurm's notice (SIGUSR2) the leader stops the
trial and returns the task to be requeued (`SlurmTrial.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import types
from collections.abc import Mapping
from typing import Any

from absl import logging

from transformer import storage, workdir_lock
from transformer.tools import slurm_jobs, sweep_runner
from transformer.tools.sweeps import Sweep, Trial

try:  # The sweeps extra; without it no task is made (`sweep_slurm.require_submitit`).
  import submitit
except ImportError:
  submitit = None

FOLDER = 'slurm'  # Under the sweep root: submitit's files, jobs.jsonl, the go words.
# How long the other processes of a start wait for the leader's word.
_GO_TIMEOUT_SECONDS = 600.0


# --- A trial as a Slurm task ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Start:
  """This process's place in the start of a task: which job, which start of it, which rank."""

  cluster: str  # submitit's: 'slurm' or 'local'.
  job_id: str  # '12_3': task 3 of array job 12.
  restarts: int  # Slurm's requeues of the job (SLURM_RESTART_COUNT).
  requeues: int  # The task's requeues through `SlurmTrial.checkpoint` (local ones too).
  rank: int
  tasks: int

  @classmethod
  def here(cls, requeues: int) -> _Start:
    env = submitit.JobEnvironment()
    return cls(
      cluster=env.cluster,
      job_id=env.job_id,
      restarts=int(os.environ.get('SLURM_RESTART_COUNT') or 0),
      requeues=requeues,
      rank=env.global_rank,
      tasks=env.num_tasks,
    )

  @property
  def key(self) -> str:
    return f'{self.job_id}.{self.restarts}.{self.requeues}'

  def record(self) -> dict[str, Any]:
    """trial.json's `slurm`: what `slurm_jobs.job_alive` asks about."""
    return {'job_id': self.job_id, 'restarts': self.restarts, 'tasks': self.tasks}

  def process_flags(self, coordinator: str | None) -> list[str]:
    """train.py's flags for this process: none where srun's variables say it all."""
    if self.tasks == 1 or coordinator is None:
      return []
    return [
      f'--coordinator_address={coordinator}',
      f'--num_processes={self.tasks}',
      f'--process_id={self.rank}',
    ]


def _go_path(sweep: Sweep, trial_name: str) -> str:
  return os.path.join(sweep.root, FOLDER, f'{trial_name}.go.json')


def now() -> str:
  return datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')


class _TaskRunner(sweep_runner._Runner):
  """The leader's runner: records the job in trial.json, tells the others when train.py starts."""

  def __init__(self, sweep: Sweep, trial: Trial, start: _Start):
    super().__init__(sweep)
    self.trial = trial
    self.start = start
    self.told = False

  def _run_stage(
    self,
    trial: Trial,
    state: dict[str, Any],
    stage: str,
    command: list[str],
    environment: Mapping[str, str],
  ) -> str:
    if self.start.cluster == 'slurm':
      state['slurm'] = self.start.record()  # Written with the stage's start.
    return super()._run_stage(trial, state, stage, command, environment)

  def launch_command(self, stage: str, command: list[str]) -> list[str]:
    if stage != 'train' or self.start.tasks == 1:
      return command
    coordinator = None
    if self.start.cluster != 'slurm':  # No srun step: process 0 serves on a free local port.
      with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        coordinator = f'127.0.0.1:{s.getsockname()[1]}'
    self.tell(train=True, coordinator=coordinator)
    return command + self.start.process_flags(coordinator)

  def stop(self) -> None:
    """Stops the trial as Slurm would: the notice (SIGUSR2), which train.py checkpoints on.

    Slurm sent it to train.py already; submitit's LocalExecutor signals the task alone.
    """
    with self._lock:
      self.stopping.set()
      processes = list(self._processes.values())
    for process in processes:
      process.send_signal(signal.SIGUSR2)

  def tell(self, train: bool, coordinator: str | None = None) -> None:
    """Tells the other processes of this start whether to run train.py (once per start)."""
    if self.told or self.start.tasks == 1:
      return
    word = {'start': self.start.key, 'train': train, 'coordinator': coordinator}
    storage.write_json(_go_path(self.sweep, self.trial.name), word)
    self.told = True


# Without submitit no SlurmTrial is made (`submit` refuses first), but the class is defined.
_Checkpointable = submitit.helpers.Checkpointable if submitit else object


class SlurmTrial(_Checkpointable):
  """One trial as the task of a job: run by the leader (rank 0) with the others' help."""

  def __init__(self, sweep: Sweep, name: str, stop_seconds: float, requeues: int = 0):
    self.sweep = sweep
    self.name = name
    self.stop_seconds = stop_seconds
    self.requeues = requeues
    self._runner: _TaskRunner | None = None
    self._worker: threading.Thread | None = None

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, '_runner': None, '_worker': None}

  def __call__(self) -> str:
    """The trial's outcome ('finished', 'skipped', 'interrupted', ...); raises if it failed."""
    start = _Start.here(self.requeues)
    logging.set_verbosity(logging.INFO)
    logging.info('%s: start %s, process %d of %d.', self.name, start.key, start.rank, start.tasks)
    if start.rank == 0:
      return self._lead(start)
    return self._follow(start)

  def checkpoint(self) -> submitit.helpers.DelayedSubmission:
    """submitit's requeue (rank 0, on the notice): stops the trial, then requeues this task.

    train.py checkpoints and exits, the trial is marked 'interrupted', and the next start
    resumes it.
    """
    if self._runner is not None and self._worker is not None:
      logging.warning('%s: stopping for a requeue.', self.name)
      self._runner.stop()
      self._worker.join(self.stop_seconds)
    requeued = SlurmTrial(self.sweep, self.name, self.stop_seconds, self.requeues + 1)
    return submitit.helpers.DelayedSubmission(requeued)

  def _lead(self, start: _Start) -> str:
    trial = self.sweep.trial(self.name)
    workdir = self.sweep.workdir(trial)
    _remove_lock_of_an_ended_job(workdir)
    self._runner = _TaskRunner(self.sweep, trial, start)
    outcome: dict[str, Any] = {}

    def run() -> None:
      try:
        outcome['status'] = self._runner.run_trial(trial)
      except BaseException as e:  # Raised again in the main thread.
        outcome['error'] = e

    # The trial runs in a thread, so that submitit's signal handler (the main thread's) can stop
    # it and wait for it.
    self._worker = threading.Thread(target=run, name=f'trial-{self.name}', daemon=True)
    self._worker.start()
    while self._worker.is_alive():
      self._worker.join(1.0)
    self._runner.tell(train=False)  # If train.py never started: the others stop waiting.
    if 'error' in outcome:
      raise outcome['error']
    _write_summary(self.sweep)
    status = outcome['status']
    logging.info('%s: %s.', self.name, status)
    if status == 'failed':
      stages = (sweep_runner.read_state(workdir) or {}).get('stages', {}).values()
      error = next((r.get('error') for r in stages if r['status'] == 'failed'), None)
      raise RuntimeError(f'Trial {self.name} failed (see {workdir}/train.log): {error}')
    return status

  def _follow(self, start: _Start) -> str:
    """Runs the trial's train.py as process `start.rank` when the leader starts process 0."""
    path = _go_path(self.sweep, self.name)
    deadline = time.time() + _GO_TIMEOUT_SECONDS
    word = None
    while word is None or word.get('start') != start.key:
      if time.time() > deadline:
        raise RuntimeError(
          f'{self.name}: process 0 of start {start.key} gave no word in {path} within '
          f'{_GO_TIMEOUT_SECONDS:.0f} s (see its log, task 0 of the job).'
        )
      time.sleep(0.5)
      try:
        with open(path) as f:
          word = json.load(f)
      except (FileNotFoundError, json.JSONDecodeError):
        word = None
    if not word['train']:
      return 'skipped'
    trial = self.sweep.trial(self.name)
    [(_, command)] = [c for c in self.sweep.commands(trial) if c[0] == 'train']
    command = command + start.process_flags(word['coordinator'])
    logging.info('%s: process %d runs %s', self.name, start.rank, shlex.join(command))
    process = subprocess.Popen(command, cwd=self.sweep.cwd, stdin=subprocess.DEVNULL)

    def stop(signum: int, frame: types.FrameType | None) -> None:
      del signum, frame
      process.terminate()  # train.py checkpoints with the other processes and exits.

    for signum in (signal.SIGTERM, signal.SIGUSR2, submitit.JobEnvironment._usr_sig()):
      signal.signal(signum, stop)
    returncode = process.wait()
    if returncode != 0:
      raise RuntimeError(f'{self.name}: train.py process {start.rank} exited with {returncode}.')
    return 'finished'


def _remove_lock_of_an_ended_job(workdir: str) -> None:
  """Removes a train.lock whose holder ran in a start of a job that Slurm says has ended."""
  holder = workdir_lock.read_holder(workdir)
  job = holder.get('slurm_job') if holder else None
  if isinstance(job, dict) and slurm_jobs.job_alive(job) is False:
    logging.warning(
      'The Slurm job of %s, which holds %s/%s, no longer runs (a failed node, a requeue).',
      workdir_lock.describe(holder),
      workdir,
      workdir_lock.LOCK_FILE,
    )
    workdir_lock.remove_stale(workdir, holder)


def _write_summary(sweep: Sweep) -> None:
  """Rewrites the summary files, one task at a time (they end at any moment)."""
  from transformer.tools import sweep_summary  # Matplotlib and TFDS: only when a trial ends.

  with open(os.path.join(sweep.root, FOLDER, 'summary.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    sweep_summary.write(sweep)
