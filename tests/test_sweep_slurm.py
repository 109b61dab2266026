"""Sweeps on Slurm (transformer/tools/sweep_slurm.py): submitit's job arrays on a real Slurm.

The `scheduler` fixture starts a single-node Slurm on 127.0.0.1 (tests/slurm_cluster.py). Where
Slurm cannot run (slurm-wlm not installed, a daemon that does not start), the same tests run
through submitit's LocalExecutor (the sweep) and a stand-in `scontrol` (the job states) instead,
with a warning that gives the reason; `SWEEP_SLURM_TESTS=local` takes that path where Slurm runs.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import slurm_cluster
from conftest import write_lines
from test_sweeps import synthetic_corpus  # noqa: F401  (a fixture: the sweeps' corpus)

from configs import tiny
from transformer import workdir_lock
from transformer.errors import InvalidInput
from transformer.tools import slurm_jobs, slurm_trial, sweep_runner, sweep_slurm, sweeps

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Scheduler:
  """The real cluster, or None and why not (then submitit's LocalExecutor stands in)."""

  cluster: slurm_cluster.Cluster | None
  reason: str = ''


@pytest.fixture(scope='module')
def scheduler(tmp_path_factory):
  if os.environ.get('SWEEP_SLURM_TESTS') == 'local':
    yield Scheduler(None, 'SWEEP_SLURM_TESTS=local')
    return
  try:
    cluster = slurm_cluster.start(tmp_path_factory.mktemp('slurm'))
  except slurm_cluster.Unavailable as e:
    yield Scheduler(None, str(e))
    return
  try:
    yield Scheduler(cluster)
  finally:
    cluster.stop()


def _note_fallback(scheduler: Scheduler, stand_in: str) -> None:
  """Says, where Slurm cannot run, that `stand_in` ran in its place, and why."""
  if scheduler.cluster is None:
    warnings.warn(f'No Slurm here, so {stand_in} ran instead: {scheduler.reason}', stacklevel=2)


def _write_sweep(path: Path, body: str) -> Path:
  path.write_text(f'from transformer.tools import sweeps\n\n\ndef sweep():\n  return {body}\n')
  return path


# --- Options and plans (no cluster) --------------------------------------------------


def test_slurm_options_are_sbatch_options_with_times_in_minutes():
  options = sweep_slurm.parse_options(
    ['time=1-02:30:00', '--partition=gpu', 'gres=gpu:8', 'cpus-per-task=8', 'mail_type=END']
  )
  assert options == {
    'time': (24 + 2) * 60 + 30,
    'partition': 'gpu',
    'gres': 'gpu:8',
    'cpus_per_task': 8,
    'mail_type': 'END',
  }
  times = ['90', '1:30', '2:00:00', '1-0', '1-1:01', '0:0:59']
  assert [sweep_slurm.parse_options([f'time={t}'])['time'] for t in times] == [
    90,
    2,
    120,
    1440,
    1501,
    1,
  ]
  assert sweep_slurm.parse_options([])['time'] == 240  # DEFAULT_TIME.
  for option, message in [
    ('nodes=2', 'nodes is set by config.launch.nodes'),
    ('ntasks-per-node=2', 'set by config.launch.tasks_per_node'),
    ('array=0-3', 'set by --parallel'),
    ('time=0', 'a time limit is minutes or'),
    ('time=soon', 'a time limit is minutes or'),
    ('gres', 'give KEY=VALUE'),
    ('cpus_per_task=many', 'takes a whole number'),
  ]:
    with pytest.raises(InvalidInput, match=message):
      sweep_slurm.parse_options([option])


def test_dry_run_prints_one_array_per_launch_shape_and_writes_nothing(tmp_path):
  sweep_file = _write_sweep(
    tmp_path / 's.py', "[{'seed': 1}, {'seed': 2, 'launch.tasks_per_node': 2}, {'seed': 3}]"
  )
  root = tmp_path / 'root'
  sweep = sweeps.create('configs/tiny.py', tiny.get_config(), str(sweep_file), str(root))
  options = sweep_slurm.parse_options(['time=0:30:00', 'partition=debug', 'gres=gpu:1'])
  lines = sweep_slurm.dry_run(sweep, 2, options)
  assert lines[1].startswith('# 3 of 3 trials to submit through submitit, one job array per')
  one, two = lines[2], lines[3]
  assert one.startswith('# an array of 2 trials, 1 node x 1 task each: seed=1, seed=3\n#!/bin/')
  assert two.startswith('# a job of 1 trial, 1 node x 2 tasks each: tasks_per_node=2,seed=2')
  for line in [
    '#SBATCH --array=0-1%2',
    '#SBATCH --ntasks-per-node=1',
    '#SBATCH --requeue',
    '#SBATCH --signal=USR2@90',
    '#SBATCH --time=30',
    '#SBATCH --partition=debug',
    '#SBATCH --gres=gpu:1',
    f'#SBATCH --output={root}/slurm/%A_%a_0_log.out',
    f'export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}',
    f'srun --unbuffered --output {root}/slurm/%A_%a_%t_log.out',
  ]:
    assert line in one, line
  assert '--array' not in two and '#SBATCH --ntasks-per-node=2' in two
  assert f'#SBATCH --output={root}/slurm/%j_0_log.out' in two
  assert lines[4].startswith('# seed=1 [train, new]\n') and 'train.py' in lines[4]
  assert len(lines) == 7
  only = sweep_slurm.dry_run(sweep, 2, options, only='seed=3')
  assert len(only) == 4 and only[2].startswith('# a job of 1 trial, 1 node x 1 task each: seed=3')
  assert only[3].startswith('# seed=3 [train, new]\n')
  assert not root.exists()


# --- A dead holder, through the scheduler ----------------------------------------------------


class _Jobs:
  """Starts and ends jobs on the real cluster, or on a stand-in `scontrol` that reads a file."""

  def __init__(self, scheduler: Scheduler, folder: Path, monkeypatch):
    self.cluster = scheduler.cluster
    if self.cluster is not None:
      monkeypatch.setenv('SLURM_CONF', self.cluster.env['SLURM_CONF'])
      return
    self.states = folder / 'states.json'
    self.states.write_text('{}')
    scontrol = folder / 'bin' / 'scontrol'
    scontrol.parent.mkdir()
    scontrol.write_text(
      f'#!{sys.executable}\n'
      'import json, sys\n'
      f'states = json.load(open({str(self.states)!r}))\n'
      'job = sys.argv[-1]\n'
      'if job not in states:\n'
      '  sys.exit(print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr) or 1)\n'
      'print(f"JobId={job} JobName=wrap JobState={states[job]} Reason=None Restarts=0")\n'
    )
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv('PATH', f'{scontrol.parent}{os.pathsep}{os.environ["PATH"]}')

  def start(self) -> str:
    if self.cluster is None:
      self.states.write_text(json.dumps({'41': 'RUNNING'}))
      return '41'
    output = f'--output={self.cluster.folder}/slurm-%j.out'
    job = self.cluster.run('sbatch', '--parsable', output, '--wrap=sleep 300').stdout.strip()
    self._wait(job, 'RUNNING')
    return job

  def cancel(self, job: str) -> None:
    if self.cluster is None:
      self.states.write_text(json.dumps({job: 'CANCELLED'}))
      return
    self.cluster.run('scancel', job)
    self._wait(job, 'CANCELLED')

  def _wait(self, job: str, state: str) -> None:
    deadline = time.time() + 30
    while (found := slurm_jobs.job_state(job)) is None or found.state != state:
      assert time.time() < deadline, f'job {job}: {found}, not {state}'
      time.sleep(0.2)


def test_a_trial_whose_slurm_job_ended_is_not_running_and_its_lock_is_removed(
  scheduler, tmp_path, monkeypatch
):
  _note_fallback(scheduler, 'a stand-in scontrol')
  jobs = _Jobs(scheduler, tmp_path, monkeypatch)
  job = jobs.start()
  workdir = tmp_path / 'trial'
  workdir.mkdir()

  def status(slurm: dict) -> str:
    # A train.py on another host, whose process this host cannot look at.
    state = {'status': 'running', 'pid': 12345, 'host': 'another-host', 'stages': {}}
    (workdir / sweep_runner.STATE_FILE).write_text(json.dumps(state | {'slurm': slurm}))
    return sweep_runner.trial_status(str(workdir))

  holder = {'host': 'another-host', 'pid': 12345, 'slurm_job': {'job_id': job, 'restarts': 0}}
  (workdir / workdir_lock.LOCK_FILE).write_text(json.dumps(holder))
  assert status({'job_id': job, 'restarts': 0}) == 'running'
  assert status({'job_id': job, 'restarts': 1}) == 'interrupted'  # That start of it ended.
  slurm_trial._remove_lock_of_an_ended_job(str(workdir))
  assert workdir_lock.read_holder(str(workdir)) == holder  # Its job runs: kept.
  # Submitting again leaves a trial whose job is queued or running.
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  sweep = sweeps.create('configs/tiny.py', tiny.get_config(), str(sweep_file), str(tmp_path))
  jobs_file = tmp_path / sweep_slurm.FOLDER / sweep_slurm.JOBS_FILE
  write_lines(jobs_file, [json.dumps({'trial': 'seed=1', 'job_id': job})])
  left = {'seed=1': f'queued or running as Slurm job {job}: left alone'}
  assert sweep_slurm.plan(sweep) == sweep_slurm.Plan({}, left)

  jobs.cancel(job)
  assert status({'job_id': job, 'restarts': 0}) == 'interrupted'
  assert status({'job_id': '999999', 'restarts': 0}) == 'interrupted'  # Unknown to Slurm.
  assert slurm_jobs.job_state('999999') == slurm_jobs.JobState('GONE', 0)
  slurm_trial._remove_lock_of_an_ended_job(str(workdir))
  assert workdir_lock.read_holder(str(workdir)) is None
  assert sweep_slurm.plan(sweep) == sweep_slurm.Plan({sweep_slurm.Shape(1, 1): [*sweep.trials]}, {})

  monkeypatch.setenv('PATH', '/nonexistent')  # No scheduler to ask: the record is trusted.
  assert status({'job_id': job, 'restarts': 0}) == 'running'


# --- A sweep end to end --------------------------------------------------------------------------

# Trial 3 runs long enough to be stopped by the notice after its first checkpoint (step 3).
_TRIALS = (
  "[{'seed': 1, 'num_train_steps': 6},"
  " {'seed': 2, 'num_train_steps': 6, 'launch.tasks_per_node': 2},"
  " {'seed': 3, 'num_train_steps': 30}]"
)
_SHARED = {
  'data.dataset': 'parallel_text',
  'eval_every_steps': 30,
  'log_every_steps': 3,
  'checkpoint_every_steps': 3,
  'eval_bleu_sentences': 0,
}


def _environment(tmp_path: Path, scheduler: Scheduler) -> dict[str, str]:
  """What sweep.py and the jobs run with: CPU, fast compiles shared through JAX's disk cache."""
  base = scheduler.cluster.env if scheduler.cluster else os.environ
  return {
    **base,
    'JAX_PLATFORMS': 'cpu',
    'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'jax_cache'),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
  }


def _all_ended(scheduler: Scheduler, local_jobs: list) -> bool:
  """Whether every job of the sweep ended; a requeued job is started now, not in 121 s."""
  if scheduler.cluster is None:
    return all(job.done() for job in local_jobs)
  queue = scheduler.cluster.run('squeue', '-h', '-o', '%i %T %r').stdout.split('\n')
  queue = [line.split() for line in queue if line.strip()]
  for job, state, reason in queue:
    if state == 'PENDING' and reason == 'BeginTime':  # Requeued: Slurm waits 121 s.
      scheduler.cluster.run('scontrol', 'update', f'JobId={job}', 'StartTime=now')
  return not queue


@pytest.mark.slow
def test_a_sweep_on_slurm_trains_over_two_tasks_requeues_a_stopped_trial_and_summarizes(
  scheduler,
  synthetic_corpus,  # noqa: F811
  tmp_path,
  monkeypatch,
):
  _note_fallback(scheduler, "submitit's LocalExecutor")
  sweep_file = _write_sweep(tmp_path / 'three.py', _TRIALS)
  root = tmp_path / 'root'
  env = _environment(tmp_path, scheduler)
  manual_dir, data_dir = synthetic_corpus
  shared = _SHARED | {'data.manual_dir': str(manual_dir), 'data.data_dir': str(data_dir)}
  config = sweeps.apply_overrides(tiny.get_config(), shared)
  sweep = sweeps.create('configs/tiny.py', config, str(sweep_file), str(root), shared)
  one, two, stopped = (Path(sweep.workdir(trial)) for trial in sweep.trials)
  local_jobs = []
  if scheduler.cluster is not None:
    flags = [f'--config.{key}={sweeps.flag_value(value)}' for key, value in shared.items()]
    result = subprocess.run(
      [
        sys.executable,
        'sweep.py',
        '--config=configs/tiny.py',
        f'--sweep={sweep_file}',
        f'--workdir={root}',
        *flags,
        '--launcher=slurm',
        '--parallel=2',
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'Submitted 3 of 3 trials to Slurm' in result.stdout
  else:  # The same submission, through submitit's LocalExecutor.
    monkeypatch.chdir(REPO)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
    sweep_runner.prepare_data(sweep.trials)
    submitted, _ = sweep_slurm.submit(sweep, 2, sweep_slurm.parse_options([]), cluster='local')
    local_jobs = list(submitted.values())
  entries = [json.loads(line) for line in (root / 'slurm' / 'jobs.jsonl').read_text().splitlines()]
  job_of = {entry['trial']: entry['job_id'] for entry in entries}
  assert len(job_of) == 3

  # Trial 3's first checkpoint; then its train.py is frozen (SIGSTOP) until the notice was sent
  # to it, so that the notice lands mid-training however loaded the machine is (on a loaded
  # one, train.py once trained all 30 steps before Slurm's signal reached it). Once the task's
  # leader says it is stopping, it has signalled train.py (Slurm has too), whose handler then
  # runs on its first step after SIGCONT.
  deadline = time.time() + 400
  asked = 0.0  # When the queue was last asked about, which is slow beside this loop.
  while not (stopped / 'checkpoints' / '3').exists():
    assert time.time() < deadline, 'trial 3 wrote no checkpoint in time'
    if time.time() > asked + 2:
      assert not _all_ended(scheduler, local_jobs), 'every job ended before trial 3 checkpointed'
      asked = time.time()
    time.sleep(0.05)
  train_pid = json.loads((stopped / 'trial.json').read_text())['pid']
  task_log = root / 'slurm' / f'{job_of[stopped.name]}_0_log.out'
  os.kill(train_pid, signal.SIGSTOP)
  try:
    if scheduler.cluster is not None:
      scheduler.cluster.run('scancel', '--signal=USR2', job_of[stopped.name])
    else:  # The task's process, parent of train.py; Slurm signals every process of the job.
      stat_fields = Path(f'/proc/{train_pid}/stat').read_text().rsplit(')', 1)[1].split()
      os.kill(int(stat_fields[1]), signal.SIGUSR2)
    while 'stopping for a requeue' not in task_log.read_text():
      assert time.time() < deadline, f'the task never stopped the trial: {task_log}'
      time.sleep(0.1)
    time.sleep(1)  # For the signals on their way.
  finally:
    os.kill(train_pid, signal.SIGCONT)

  # Wait for every job.
  while not _all_ended(scheduler, local_jobs):
    assert time.time() < deadline, 'the sweep did not end in time'
    time.sleep(0.5)

  with open(root / 'summary.csv') as f:
    rows = {row['trial']: row for row in csv.DictReader(f)}
  assert len(rows) == 3, rows
  assert {name: (row['status'], row['steps']) for name, row in rows.items()} == {
    one.name: ('finished', '6'),
    two.name: ('finished', '6'),
    stopped.name: ('finished', '30'),
  }, [(root / 'slurm' / p).read_text()[-2000:] for p in os.listdir(root / 'slurm')]

  # Trial 2: two processes over jax.distributed, process 1 in the job's second task.
  assert 'Process 0 of 2; 1 local of 2 devices.' in (two / 'train.log').read_text()
  follower_logs = [p.read_text() for p in (root / 'slurm').glob('*_1_log.out')]
  assert any('Process 1 of 2' in log for log in follower_logs), follower_logs

  # Trial 3: checkpointed on the notice, requeued, resumed from its checkpoint.
  state = json.loads((stopped / 'trial.json').read_text())
  assert state['stages']['train']['attempts'] == 2
  attempts = (stopped / 'train.log').read_text().split('\n=== ')[1:]
  assert len(attempts) == 2
  stops = [line for line in attempts[0].splitlines() if 'Stopped by SIGUSR2 after step' in line]
  assert len(stops) == 1, attempts[0][-3000:]
  [stop] = stops
  step = int(stop.split('after step ')[1].split(';')[0])
  assert 3 <= step < 30
  assert f'Training from step {step} to 30' in attempts[1]
  assert 'Requeued job' in task_log.read_text()
  # Submitting again submits nothing: every trial finished.
  assert sweep_slurm.plan(sweep) == sweep_slurm.Plan({}, dict.fromkeys(rows, 'finished: skipped'))
  if scheduler.cluster is not None:
    assert state['slurm'] == {'job_id': job_of[stopped.name], 'restarts': 1, 'tasks': 1}
    scripts = {p.name: p.read_text() for p in (root / 'slurm').glob('*_submission.sh')}
    assert sum('#SBATCH --array=0-1%2' in s for s in scripts.values()) == 1, scripts
    assert sum('#SBATCH --ntasks-per-node=2' in s for s in scripts.values()) == 1, scripts
    assert all('#SBATCH --requeue' in s for s in scripts.values())


def test_a_local_sweep_refuses_a_launch_shape_and_the_slurm_launcher_takes_it(tmp_path):
  """config.launch.nodes=2 was ignored by a sweep without --launcher=slurm."""
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}, {'seed': 2, 'launch.nodes': 2}]")
  root = tmp_path / 'root'
  command = lambda *flags: subprocess.run(
    [
      sys.executable,
      'sweep.py',
      '--config=configs/tiny.py',
      f'--sweep={sweep_file}',
      f'--workdir={root}',
      '--config.data.manual_dir=/nowhere',
      *flags,
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  for flags in [('--dry_run',), ()]:
    result = command(*flags)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines()[-2] == (
      'sweep.py: error: trial nodes=2,seed=2: config.launch.nodes=2 x '
      'config.launch.tasks_per_node=1 asks for 2 processes, but a local sweep runs each trial '
      'as one train.py process: config.launch takes effect only with sweep.py --launcher=slurm '
      '(which starts them through srun). Add --launcher=slurm, or leave config.launch at 1 x 1 '
      '(to train on several hosts by hand, start train.py on each: docs/devices.md).'
    )
    assert not root.exists()
  result = command('--launcher=slurm', '--dry_run')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '1 node x 1 task each: seed=1' in result.stdout
  assert '2 nodes x 1 task each: nodes=2,seed=2' in result.stdout


def test_an_empty_slurm_option_is_refused():
  """`--slurm_option=partition=` became sbatch's `--partition=''`."""
  for option in ['partition=', 'account= ']:
    with pytest.raises(InvalidInput) as refusal:
      sweep_slurm.parse_options([option])
    key = option.split('=')[0]
    assert str(refusal.value) == (
      f"--slurm_option={option}: {key} is empty (sbatch would get --{key}=''); give it a value, "
      'or leave the option out for the cluster default.'
    )


@pytest.mark.parametrize('case', ['no_slurm_tools', 'no_controller'])
def test_slurm_where_no_cluster_answers_is_refused_before_any_work(tmp_path, case):
  """It ended in submitit's RuntimeError or sbatch's own errors, after the data was prepared,
  with an empty slurm/ folder left."""
  tools = tmp_path / 'bin'
  tools.mkdir()
  if case == 'no_controller':  # Slurm's tools, and a controller that does not answer.
    for tool, script in [
      (
        'sbatch',
        'echo "sbatch: error: Batch job submission failed: Unable to contact slurm '
        'controller (connect failure)" >&2; exit 1',
      ),
      ('srun', 'exit 1'),
      ('scontrol', 'echo "Slurmctld(primary) at ctl is DOWN"; exit 1'),
    ]:
      (tools / tool).write_text(f'#!/bin/sh\n{script}\n')
      (tools / tool).chmod(0o755)
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  root, data_dir = tmp_path / 'root', tmp_path / 'tfds'
  corpus = tmp_path / 'raw'
  write_lines(corpus / 'train.en', ['a b'] * 4)
  result = subprocess.run(
    [
      sys.executable,
      'sweep.py',
      '--config=configs/tiny.py',
      f'--sweep={sweep_file}',
      f'--workdir={root}',
      '--launcher=slurm',
      f'--config.data.manual_dir={corpus}',
      f'--config.data.data_dir={data_dir}',
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PATH': str(tools)},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  expected = {
    'no_slurm_tools': 'no Slurm here: sbatch, srun, scontrol not on PATH.',
    'no_controller': 'no Slurm controller answers (scontrol ping: Slurmctld(primary) at ctl is '
    'DOWN).',
  }[case]
  assert result.stderr.splitlines()[-2] == (
    f'sweep.py: error: --launcher=slurm: {expected} Run sweep.py --launcher=slurm on a node of '
    'the cluster (a login node), or without --launcher=slurm to run the trials here.'
  )
  assert 'Traceback' not in result.stderr
  assert not root.exists() and not data_dir.exists()  # No slurm/ folder, no data prepared.


def test_a_job_sbatch_refuses_is_one_message_and_leaves_no_folder(tmp_path, monkeypatch):
  tools = tmp_path / 'bin'
  tools.mkdir()
  for tool, script in [
    ('sbatch', 'echo "sbatch: error: invalid partition specified: nope" >&2; exit 1'),
    ('srun', 'exit 0'),
    ('scontrol', 'echo "Slurmctld(primary) at ctl is UP"'),
  ]:
    (tools / tool).write_text(f'#!/bin/sh\n{script}\n')
    (tools / tool).chmod(0o755)
  monkeypatch.setenv('PATH', f'{tools}{os.pathsep}{os.environ["PATH"]}')
  assert sweep_slurm.cluster_errors() == []
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  root = tmp_path / 'sweeps' / 'root'
  sweep = sweeps.create('configs/tiny.py', tiny.get_config(), str(sweep_file), str(root))
  with pytest.raises(InvalidInput) as refusal:
    sweep_slurm.submit(sweep, 1, sweep_slurm.parse_options(['partition=nope']))
  assert str(refusal.value).startswith(
    '--launcher=slurm: sbatch refused the job (sbatch: error: invalid partition specified: '
    'nope); nothing was submitted.'
  )
  assert not (tmp_path / 'sweeps').exists()  # The folders it made are gone.
