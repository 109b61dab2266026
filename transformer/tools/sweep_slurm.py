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
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from transformer import extras, storage
from transformer.errors import InvalidInput
from transformer.tools import slurm_jobs, sweep_runner

# SlurmTrial is what the jobs run; imported here, where tasks pickled before it moved name it.
from transformer.tools.slurm_trial import FOLDER, SlurmTrial, now
from transformer.tools.sweeps import REPO_DIR, Sweep, Trial

try:  # The sweeps extra: sweep.py imports this module for its local trials too.
  import submitit
  from submitit.slurm import slurm as submitit_slurm
except ImportError:  # --launcher=slurm is refused (`require_submitit`).
  submitit = submitit_slurm = None

JOBS_FILE = 'jobs.jsonl'
DEFAULT_TIME = '4:00:00'  # A trial's time limit per start; it is requeued on reaching it.
# Requeues after time-outs before submitit gives a task up; each start resumes from a checkpoint.
MAX_TIMEOUTS = 100

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
    submitted_at = now()
    with open(os.path.join(folder, JOBS_FILE), 'a') as f:
      for trial, job in zip(trials, jobs, strict=True):
        submitted[trial.name] = job
        entry = {
          'trial': trial.name,
          'job_id': job.job_id,
          'submitted': submitted_at,
          'cluster': cluster,
        }
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
