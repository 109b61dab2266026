"""A sweep on Slurm: job arrays submitted through submitit, each trial through srun, requeued.

`sweep.py --launcher=slurm` calls `submit`. Every trial that has not finished and is not queued
or running already becomes one task of a job array (`submitit.AutoExecutor`). Slurm gives every
task of an array one shape, so the trials are grouped by `config.launch.nodes` x
`config.launch.tasks_per_node`: one array per shape (one for a sweep that sets neither).
`--parallel=N` caps the tasks of an array that run at once (`--array=0-K%N`).

A task is a `SlurmTrial`, a `submitit.helpers.Checkpointable` that submitit's sbatch script
starts through `srun` as nodes x tasks_per_node processes. Process 0, the leader, runs the trial
as sweep.py does here (`sweep_runner`: trial.json, train.log, skipping what finished, resuming,
eval.py) and rewrites the summary when it ends; the others start the trial's train.py when the
leader starts its own (`_go_path`) and nothing else. Each train.py then joins `jax.distributed`
through the `SLURM_*` variables of the srun step (transformer/distributed.py), which only srun
sets. Under submitit's `LocalExecutor` (a stand-in for Slurm on one machine) the leader gives
the processes a coordinator instead.

Requeue: submitit asks Slurm for SIGUSR2 90 s before the time limit (`--signal=USR2@90`;
`scancel --signal=USR2 JOB` sends it by hand). Slurm sends it to every process of the job:
train.py checkpoints its step and exits (transformer/preemption.py), and the leader's submitit
handler calls `SlurmTrial.checkpoint`, which stops the trial (marked 'interrupted'), waits for
train.py, and returns the task to be requeued (`scontrol requeue`); its next start resumes from
the checkpoint. The jobs are also submitted with `--requeue`, so that Slurm requeues a trial
whose node failed.

A dead holder is recognised through the scheduler: trial.json (`slurm`) and train.lock
(`slurm_job`) name the job and the start of it that runs the trial, and `slurm_jobs.job_alive` asks
`scontrol` whether that start still runs. A trial whose job ended, was cancelled or requeued is
not shown running, and the lock it left on another host is removed before the trial starts again.

Written, besides each trial's own files: ROOT/slurm/, submitit's folder (the sbatch scripts,
pickled tasks, each task's output `JOB_TASK_log.out`), `jobs.jsonl` (one line per trial
submitted: its job) and `TRIAL.go.json` (the leader's word to the other processes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from transformer import extras, storage, workdir_lock
from transformer.errors import InvalidInput
from transformer.tools import slurm_jobs, sweep_runner
from transformer.tools.sweeps import REPO_DIR, Sweep, Trial

try:  # The sweeps extra: sweep.py imports this module for its local trials too.
  import submitit
  from submitit.slurm import slurm as submitit_slurm
except ImportError:  # --launcher=slurm is refused (`require_submitit`).
  submitit = submitit_slurm = None

FOLDER = 'slurm'  # Under the sweep root.
JOBS_FILE = 'jobs.jsonl'
DEFAULT_TIME = '4:00:00'  # A trial's time limit per start; it is requeued on reaching it.
# Requeues after time-outs before submitit gives a task up; each start resumes from a checkpoint.
MAX_TIMEOUTS = 100
# How long the other processes of a trial wait for the leader's word.
_GO_TIMEOUT_SECONDS = 600.0

# --slurm_option keys that the sweep sets itself.
_OWN_OPTIONS = {
  'nodes': 'config.launch.nodes',
  'ntasks_per_node': 'config.launch.tasks_per_node',
  'ntasks': 'config.launch.tasks_per_node',
  'array': '--parallel (the array is one task per trial)',
  'output': f'the sweep (ROOT/{FOLDER}/)',
  'error': f'the sweep (ROOT/{FOLDER}/)',
  'signal': 'submitit (use signal_delay_s=SECONDS)',
  'requeue': 'the sweep (always requeued)',
  'open_mode': 'submitit',
}
_INT_OPTIONS = ('cpus_per_task', 'gpus_per_node', 'gpus_per_task', 'signal_delay_s')


def require_submitit() -> None:
  """Refuses --launcher=slurm without submitit (the sweeps extra), before any work."""
  extras.require('submitit', 'sweeps', '--launcher=slurm')


def _job_waiting_or_running(job_id: str) -> bool:
  state = slurm_jobs.job_state(job_id)
  return state is not None and state.state in slurm_jobs.RUNNING | slurm_jobs.QUEUED


# --- Submitting ----------------------------------------------------------------------------------


def parse_options(options: Sequence[str]) -> dict[str, Any]:
  """`--slurm_option=KEY=VALUE` flags as {key: value}: sbatch's long options, `_` for `-`.

  `time` is in minutes or Slurm's [D-]HH:MM[:SS]; keys the sweep sets itself are refused.
  """
  parsed = {}
  for option in options:
    key, equals, value = option.removeprefix('--').partition('=')
    key = key.replace('-', '_')
    if not equals or not key:
      raise InvalidInput(
        f'--slurm_option={option}: give KEY=VALUE, sbatch long options without --, e.g. '
        '--slurm_option=time=4:00:00 --slurm_option=partition=gpu --slurm_option=gres=gpu:8.'
      )
    if key in _OWN_OPTIONS:
      raise InvalidInput(f'--slurm_option={option}: {key} is set by {_OWN_OPTIONS[key]}.')
    if not value.strip():
      raise InvalidInput(
        f"--slurm_option={option}: {key} is empty (sbatch would get --{key.replace('_', '-')}=''); "
        'give it a value, or leave the option out for the cluster default.'
      )
    if key == 'time':
      parsed[key] = _minutes(value, option)
    elif key in _INT_OPTIONS:
      if not value.isdigit():
        raise InvalidInput(f'--slurm_option={option}: {key} takes a whole number.')
      parsed[key] = int(value)
    else:
      parsed[key] = value
  parsed.setdefault('time', _minutes(DEFAULT_TIME, DEFAULT_TIME))
  return parsed


def _minutes(value: str, option: str) -> int:
  """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes."""
  match = re.fullmatch(r'(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?', value)
  seconds = 0
  if match:
    days, first, second, third = (int(part) if part else None for part in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
      seconds = days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    elif third is not None:  # HH:MM:SS
      seconds = first * 3600 + second * 60 + third
    else:  # MM[:SS]
      seconds = first * 60 + (second or 0)
  if seconds <= 0:
    raise InvalidInput(
      f'--slurm_option={option}: a time limit is minutes or [D-]HH:MM:SS, and more than 0.'
    )
  return -(-seconds // 60)


@dataclasses.dataclass(frozen=True)
class Shape:
  """The processes of a trial: `nodes` x `tasks_per_node` srun tasks."""

  nodes: int
  tasks_per_node: int

  @classmethod
  def of(cls, trial: Trial) -> Shape:
    return cls(trial.config.launch.nodes, trial.config.launch.tasks_per_node)

  def __str__(self) -> str:
    node = 'node' if self.nodes == 1 else 'nodes'
    task = 'task' if self.tasks_per_node == 1 else 'tasks'
    return f'{self.nodes} {node} x {self.tasks_per_node} {task}'


def _parameters(
  sweep: Sweep, shape: Shape, num_trials: int, parallel: int, options: Mapping[str, Any]
) -> dict[str, Any]:
  """submitit.AutoExecutor's parameters of one array (generic ones, and slurm_ ones)."""
  setup = [
    f'export PYTHONPATH={shlex.quote(REPO_DIR)}${{PYTHONPATH:+:$PYTHONPATH}}',
    f'cd {shlex.quote(sweep.cwd)}',
  ]
  parameters = {
    'name': f'sweep-{os.path.basename(sweep.root)}',
    'nodes': shape.nodes,
    'tasks_per_node': shape.tasks_per_node,
    'timeout_min': options['time'],
    'stderr_to_stdout': True,
    'slurm_array_parallelism': parallel if parallel > 1 else num_trials,
    'slurm_setup': setup,
    'local_setup': setup,
  }
  valid = submitit.SlurmExecutor._valid_parameters()
  additional = {'requeue': True}
  for key, value in options.items():
    if key == 'time':
      continue
    if key in valid:
      parameters[f'slurm_{key}'] = value
    else:
      additional[key] = value
  parameters['slurm_additional_parameters'] = additional
  return parameters


def _stop_seconds(options: Mapping[str, Any]) -> float:
  """How long a task's leader waits for train.py's checkpoint before it is requeued."""
  return max(options.get('signal_delay_s', 90) - 20, 10)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `submit` does: the arrays (shape -> trials) and the trials it leaves, with why."""

  arrays: dict[Shape, list[Trial]]
  left: dict[str, str]  # Trial name -> why it is not submitted.


def plan(sweep: Sweep, only: str | None = None) -> Plan:
  """The trials to submit (the one named `only`), by shape; finished, queued, running are left."""
  latest_jobs = _latest_jobs(sweep.root)
  arrays: dict[Shape, list[Trial]] = {}
  left = {}
  for trial in [sweep.trial(only)] if only else sweep.trials:
    workdir = sweep.workdir(trial)
    state = sweep_runner.read_state(workdir)
    job_id = latest_jobs.get(trial.name)
    if all(sweep_runner._is_done(state, s, c) for s, c in sweep.commands(trial)):
      left[trial.name] = 'finished: skipped'
    elif job_id is not None and _job_waiting_or_running(job_id):
      left[trial.name] = f'queued or running as Slurm job {job_id}: left alone'
    elif sweep_runner.trial_status(workdir) == 'running':
      left[trial.name] = 'running (here, or in a job Slurm cannot be asked about): left alone'
    else:
      arrays.setdefault(Shape.of(trial), []).append(trial)
  return Plan(arrays, left)


def _latest_jobs(root: str) -> dict[str, str]:
  """Trial name -> its latest Slurm job id, from ROOT/slurm/jobs.jsonl."""
  path = os.path.join(root, FOLDER, JOBS_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    entries = [json.loads(line) for line in f if line.strip()]
  # A LocalExecutor's job id is a process id, which Slurm knows nothing of.
  return {e['trial']: e['job_id'] for e in entries if e.get('cluster', 'slurm') == 'slurm'}


def _check_root(sweep: Sweep) -> None:
  if storage.is_url(sweep.root):
    raise InvalidInput(
      f"--launcher=slurm keeps submitit's files and the tasks' logs in the sweep root, which "
      f'every node must see: a shared file system, not {sweep.root}.'
    )


PING_SECONDS = 20  # How long `scontrol ping` may take to say the controller answers.


def cluster_errors() -> list[str]:
  """Why no Slurm cluster would take the jobs from here ([] when one answers).

  Checked before any work (the data is prepared first, the sweep root's slurm/ made): sbatch,
  srun and scontrol on PATH, and `scontrol ping` answering that a controller is UP.
  """
  missing = [tool for tool in ('sbatch', 'srun', 'scontrol') if shutil.which(tool) is None]
  advice = (
    'Run sweep.py --launcher=slurm on a node of the cluster (a login node), or without '
    '--launcher=slurm to run the trials here.'
  )
  if missing:
    return [f'--launcher=slurm: no Slurm here: {", ".join(missing)} not on PATH. {advice}']
  try:
    ping = subprocess.run(
      ['scontrol', 'ping'], capture_output=True, text=True, timeout=PING_SECONDS
    )
  except subprocess.TimeoutExpired:
    return [
      f'--launcher=slurm: scontrol ping did not answer in {PING_SECONDS} s: no Slurm controller '
      f'is reachable from here. {advice}'
    ]
  except OSError as e:
    return [f'--launcher=slurm: scontrol ping could not run ({e}). {advice}']
  said = ' '.join((ping.stdout + ping.stderr).split())
  if ping.returncode != 0 or ' UP' not in f' {said}':
    return [
      f'--launcher=slurm: no Slurm controller answers (scontrol ping: '
      f'{said or f"exit status {ping.returncode}"}). {advice}'
    ]
  return []


def submit(
  sweep: Sweep,
  parallel: int,
  options: Mapping[str, Any],
  only: str | None = None,
  cluster: str = 'slurm',
) -> tuple[dict[str, submitit.Job], dict[str, str]]:
  """Submits the trials `plan` gives, one array per shape; ({trial: job}, {trial: why left}).

  `options` are `parse_options`'s; `cluster` is submitit's: 'slurm', or 'local' for its
  LocalExecutor (every trial at once on this machine, without Slurm).
  """
  require_submitit()
  _check_root(sweep)
  if cluster == 'slurm':
    for error in cluster_errors():
      raise InvalidInput(error)
  todo = plan(sweep, only)
  folder = os.path.join(sweep.root, FOLDER)
  made = folder  # The first folder of the path that this call creates, if any.
  while not os.path.exists(os.path.dirname(made)):
    made = os.path.dirname(made)
  made = None if os.path.exists(made) else made
  os.makedirs(folder, exist_ok=True)
  submitted = {}
  printed = io.StringIO()  # submitit prints sbatch's errors: they go into the one message.
  try:
    with contextlib.redirect_stderr(printed):
      _submit_arrays(sweep, todo, folder, parallel, options, cluster, submitted)
  except Exception as e:
    if submitted:
      sys.stderr.write(printed.getvalue())
      raise  # Jobs are queued: their files stay.
    if made:
      shutil.rmtree(made, ignore_errors=True)  # Nothing was submitted: nothing is left.
    utils = submitit.core.utils
    if isinstance(
      e, utils.FailedJobError | utils.FailedSubmissionError | subprocess.SubprocessError
    ):
      said = ' '.join((str(e) or printed.getvalue()).split())[-2000:]
      raise InvalidInput(
        f'--launcher=slurm: sbatch refused the job ({said}); nothing was submitted. Check the '
        '--slurm_option values (partition, account, ...) with sinfo and sacctmgr.'
      ) from None
    sys.stderr.write(printed.getvalue())
    raise
  sys.stderr.write(printed.getvalue())
  return submitted, todo.left


def _submit_arrays(sweep, todo, folder, parallel, options, cluster, submitted) -> None:
  for shape, trials in todo.arrays.items():
    executor = submitit.AutoExecutor(folder, cluster=cluster, slurm_max_num_timeout=MAX_TIMEOUTS)
    parameters = _parameters(sweep, shape, len(trials), parallel, options)
    if cluster != 'slurm':
      parameters = {k: v for k, v in parameters.items() if not k.startswith('slurm_')}
    executor.update_parameters(**parameters)
    tasks = [SlurmTrial(sweep, trial.name, _stop_seconds(options)) for trial in trials]
    jobs = executor.submit_array(tasks)
    now = _now()
    with open(os.path.join(folder, JOBS_FILE), 'a') as f:
      for trial, job in zip(trials, jobs, strict=True):
        submitted[trial.name] = job
        entry = {'trial': trial.name, 'job_id': job.job_id, 'submitted': now, 'cluster': cluster}
        f.write(json.dumps(entry | dataclasses.asdict(shape)) + '\n')
    first = jobs[0].job_id.split('_')[0]
    logging.info('Submitted %d trials (%s each) as job %s.', len(jobs), shape, first)


def dry_run(
  sweep: Sweep, parallel: int, options: Mapping[str, Any], only: str | None = None
) -> list[str]:
  """What `submit` would submit: each array's sbatch script, then every trial's commands."""
  require_submitit()
  _check_root(sweep)
  todo = plan(sweep, only)
  folder = os.path.join(sweep.root, FOLDER)
  trial_lines = sweep_runner.dry_run(sweep)
  lines = [
    trial_lines[0],
    f'# {sum(map(len, todo.arrays.values()))} of {len(sweep.trials)} trials to submit through '
    f'submitit, one job array per shape (nodes x tasks); files in {folder}',
  ]
  equivalent = submitit.SlurmExecutor._equivalence_dict()
  for shape, trials in todo.arrays.items():
    parameters = _parameters(sweep, shape, len(trials), parallel, options)
    sbatch = {equivalent.get(k, k): v for k, v in parameters.items() if not k.startswith('local_')}
    sbatch = {k.removeprefix('slurm_'): v for k, v in sbatch.items()}
    if len(trials) > 1:  # submitit submits a single task as a job of its own, not an array.
      sbatch['map_count'] = len(trials)
    # The script submitit writes (a private function of submitit 1.5.4, pinned).
    script = submitit_slurm._make_sbatch_string(
      command=f'{shlex.quote(sys.executable)} -u -m submitit.core._submit {folder}',
      folder=folder,
      **sbatch,
    )
    names = ', '.join(trial.name for trial in trials)
    what = f'an array of {len(trials)} trials' if len(trials) > 1 else 'a job of 1 trial'
    lines.append(f'# {what}, {shape} each: {names}\n{script}')
  for line in trial_lines[1:]:
    name = line[2:].split(' [', 1)[0]
    if only and name != only:
      continue
    if name in todo.left:
      line = line.replace('\n', f' (Slurm: {todo.left[name]})\n', 1)
    lines.append(line)
  return lines


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


def _now() -> str:
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
