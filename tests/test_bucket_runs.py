"""Runs kept in buckets end to end: train.py, resume and eval.py on gs://; refusals on s3://.

The buckets are served on 127.0.0.1 (fake-gcs-server and moto, `object_stores`); the network
guard (tests/netguard) fails any connection elsewhere, here and in the train.py processes.
A tiny run on gs:// is stopped by SIGTERM mid-run, resumed, and must end identical to the same
run trained uninterrupted on a local disk: every metrics row and every checkpoint array.
"""

import csv
import io
import json
import os
import re
import subprocess
import sys
import time

import conftest
import pytest
from test_reliability import (  # noqa: F401  (the `train` fixture)
  _TIMING,
  REPO,
  _assert_same_state,
  _assert_tensorboard_shows_the_rows_once,
  sigterm_when,
  train,
)
from test_sweeps import (  # noqa: F401  (fixtures: sweep_env, synthetic_corpus)
  _sweep_py,
  _write_sweep,
  sweep_env,
  synthetic_corpus,
)

from transformer import checkpoints, path_checks, storage, workdir_lock

pytestmark = pytest.mark.slow

# test_reliability's run (6 steps, checkpoints at 2, 4 and 6; `train` applies its OVERRIDES), with
# BLEU at 3 and 6 and the best checkpoint kept.
RUN = {
  'eval_every_steps': 3,
  'eval_bleu_sentences': 8,
  'target_metric': 'eval_bleu',
  'keep_best_checkpoints': 1,
}


@pytest.fixture(scope='module')
def local_reference(train, tmp_path_factory):  # noqa: F811
  workdir = tmp_path_factory.mktemp('local_reference')
  result = train(workdir, **RUN)
  assert result.returncode == 0, result.stderr[-3000:]
  return str(workdir)


def _rows(workdir: str) -> list[dict]:
  text = storage.read_text(storage.join(workdir, 'metrics.jsonl'))
  return [
    {k: v for k, v in json.loads(line).items() if k not in _TIMING and 'per_sec' not in k}
    for line in text.splitlines()
  ]


def _python(env, *args) -> subprocess.CompletedProcess:
  """`python ARGS` in the repository with `env`; it must exit 0."""
  result = subprocess.run(
    [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _eval(train, workdir, *flags):  # noqa: F811
  return _python(train.env, 'eval.py', f'--workdir={workdir}', '--split=validation', *flags)


def test_gs_run_stopped_resumed_and_evaluated(train, local_reference, object_stores, tmp_path):  # noqa: F811
  workdir = storage.join(object_stores.bucket('gs'), 'runs', 'tiny')
  # 1. Stopped by SIGTERM mid-run: the step in hand is checkpointed, the lock released.
  command = train.command(workdir, **RUN)
  process, log = sigterm_when(train, command, 'step 3/6 |')
  assert process.returncode == 0, log[-3000:]
  stopped = int(log.split('Stopped by SIGTERM after step ')[1].split(';')[0])
  assert 3 <= stopped < 6, log[-3000:]
  assert checkpoints.committed_steps(storage.join(workdir, 'checkpoints'))[-1] == stopped
  assert workdir_lock.read_holder(workdir) is None
  assert {'config.json', 'metrics.jsonl', 'provenance.jsonl', 'tensorboard'} <= set(
    storage.listdir(workdir)
  )

  # Nothing may write into the run's files, a URL as much as a path.
  for inside in ('metrics.jsonl', 'checkpoints/4/state'):
    (error,) = path_checks.protected_path_errors(storage.join(workdir, inside), '--output_file')
    assert f'of the training run in {workdir}, which only that run writes' in error

  # 2. Resumed to the end: identical to the uninterrupted local run.
  result = train(workdir, **RUN)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Restored checkpoint {workdir}/checkpoints/{stopped}.' in result.stderr
  assert _rows(workdir) == _rows(local_reference)
  assert checkpoints.committed_steps(storage.join(workdir, 'checkpoints')) == [2, 4, 6]
  for step in (4, 6):
    _assert_same_state(local_reference, workdir, step)
  assert len(storage.listdir(storage.join(workdir, 'tensorboard'))) == 2  # One file per start.
  local = tmp_path / 'copy'
  storage.copytree(storage.join(workdir, 'tensorboard'), str(local / 'tensorboard'))
  storage.copy_files(workdir, str(local), ['metrics.jsonl'])
  _assert_tensorboard_shows_the_rows_once(local)

  # 3. eval.py --watch follows it from the bucket: every kept checkpoint, to the final step,
  # each one's results written beside the run.
  _eval(train, workdir, '--watch', '--poll_seconds=0.1', '--beam_size=2')
  rows = storage.read_text(storage.join(workdir, 'eval', 'metrics.jsonl')).splitlines()
  assert [json.loads(row)['step'] for row in rows] == [2, 4, 6]
  # An average and the best checkpoint, read from the bucket (the arrays of steps 4 and 6 are
  # the local run's, above).
  for checkpoint in ('avg:2', 'best'):
    _eval(train, workdir, f'--checkpoint={checkpoint}', '--beam_size=2')
  written = set(storage.listdir(storage.join(workdir, 'eval')))
  for label in ('step_2', 'step_4', 'step_6', 'avg2_4-6', 'best_step_6'):
    assert {f'{label}-validation-beam2_alpha0.6.{ext}' for ext in ('json', 'txt')} <= written
  assert 'references-validation.txt' in written

  # 4. compare.py reads two of those results from the bucket and writes to another (s3://).
  output = storage.join(object_stores.bucket('s3'), 'comparisons', 'avg_vs_last.json')
  results = [
    storage.join(workdir, 'eval', f'{label}-validation-beam2_alpha0.6.json')
    for label in ('step_6', 'avg2_4-6')
  ]
  _python(train.env, 'compare.py', *results, '--n_samples=100', f'--output={output}')
  comparison = json.loads(storage.read_text(output))
  assert [system['result'] for system in comparison['systems']] == results
  assert comparison['references'] == storage.join(workdir, 'eval', 'references-validation.txt')

  # 5. curves draws the bucket's metrics into the bucket.
  figure = storage.join(storage.dirname(workdir), 'figures', 'loss.png')
  curves = ('-m', 'transformer.tools.curves', f'--run=gs={workdir}', '--x=step', '--y=train_loss')
  _python(train.env, *curves, f'--output={figure}')
  assert storage.read_bytes(figure).startswith(b'\x89PNG')


def test_second_run_on_a_bucket_workdir_is_refused(train, object_stores):  # noqa: F811
  workdir = storage.join(object_stores.bucket('gs'), 'busy')
  holder = {
    'host': 'tpu-host-0',
    'pid': 17,
    'command': 'python train.py --workdir=' + workdir,
    'token': 'x',
    'lease_seconds': 120.0,
    'renewed': time.time(),
  }
  storage.write_json(workdir_lock.lock_path(workdir), holder)
  result = train(workdir, **RUN)
  assert result.returncode != 0
  assert 'is in use by another training run: pid 17 on host tpu-host-0' in result.stderr
  assert storage.listdir(workdir) == [workdir_lock.LOCK_FILE]  # Nothing else was written.


@pytest.mark.parametrize(
  'workdir, expected',
  [
    ('s3://{bucket}/run', 'checkpoints cannot live on s3:// yet'),
    ('gs://no-such-bucket-anywhere/run', 'the bucket gs://no-such-bucket-anywhere does not exist'),
    ('hdfs://namenode/run', 'the scheme hdfs:// is not handled'),
    ('gs:/bucket/run', 'gs:// takes two slashes'),
  ],
)
def test_bad_bucket_workdirs_are_refused_before_anything(
  train,  # noqa: F811
  object_stores,
  workdir,
  expected,
):
  workdir = workdir.format(bucket=object_stores.bucket('s3').split('://')[1])
  result = train(workdir, **RUN)
  assert result.returncode != 0
  assert expected in result.stderr, result.stderr[-2000:]
  for leftover in ('gs:', 's3:', 'hdfs:'):
    assert not os.path.exists(os.path.join(REPO, leftover))  # No URL became a local folder.


def test_sweep_with_its_root_in_a_bucket(object_stores, synthetic_corpus, sweep_env, tmp_path):  # noqa: F811
  """Two trials trained and evaluated into gs://, their summary there; compare.py reads them."""
  env = {**os.environ, **{k: v for k, v in sweep_env.items() if k.startswith(('JAX', 'XLA'))}}
  sweep_file = _write_sweep(tmp_path / 'two.py', "sweeps.grid({'lr_scale': [1.0, 2.0]})")
  root = storage.join(object_stores.bucket('gs'), 'sweeps', 'two')
  run = lambda *flags: _sweep_py(
    sweep_file,
    root,
    synthetic_corpus,
    env,
    '--config.data.dataset=parallel_text',
    '--eval',
    '--eval_flags=--split=validation --decoder=greedy --n_bootstrap=100',
    *flags,
  )
  result = run()
  assert result.returncode == 0, result.stderr[-3000:]
  rows = list(csv.DictReader(io.StringIO(storage.read_text(storage.join(root, 'summary.csv')))))
  assert sorted(row['status'] for row in rows) == ['finished', 'finished']
  assert {'summary.csv', 'summary.md', 'summary.png'} <= set(storage.listdir(root))
  results = []
  for row in rows:
    trial = storage.join(root, row['trial'])
    state = json.loads(storage.read_text(storage.join(trial, 'trial.json')))
    assert state['status'] == 'finished'
    assert 'Restored checkpoint' in storage.read_text(storage.join(trial, 'eval.log'))
    results.append(storage.join(trial, state['stages']['eval']['result']))
  # TensorBoard's hparams table: a session per trial, its event file in the bucket.
  sessions = {
    row['trial']: storage.join(root, row['trial'], 'tensorboard', 'hparams') for row in rows
  }
  for name, folder in sessions.items():
    storage.copytree(folder, str(tmp_path / 'copy' / name))
  _, shown = conftest.tensorboard_hparams(tmp_path / 'copy')
  assert {name: shown[name]['hparams'] for name in sessions} == {
    row['trial']: {'lr_scale': float(row['lr_scale'])} for row in rows
  }

  # Run again: every trial is done, nothing trains or evaluates again.
  again = run()
  assert again.returncode == 0, again.stderr[-3000:]
  for row in rows:
    state = json.loads(storage.read_text(storage.join(root, row['trial'], 'trial.json')))
    assert [stage['attempts'] for stage in state['stages'].values()] == [1, 1]
  assert {n: os.listdir(tmp_path / 'copy' / n) for n in sessions} == {
    n: storage.listdir(folder) for n, folder in sessions.items()
  }  # Nothing changed: no session written again.

  _python(env, 'compare.py', *results, '--n_samples=100')


def test_prepared_data_in_a_bucket_is_shared_between_hosts(train, object_stores, tmp_path):  # noqa: F811
  """The first host prepares the data and vocabulary into gs://; a second copies, not prepares."""
  data_dir = storage.join(object_stores.bucket('gs'), 'tfds')
  rows = []
  for host in ('first', 'second'):
    env = {**train.env, 'TRANSFORMER_DATA_CACHE': str(tmp_path / host / 'cache')}
    workdir = str(tmp_path / host / 'run')
    command = train.command(workdir, **{**RUN, 'data.data_dir': data_dir})
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    prepared = 'Downloading and preparing dataset' in result.stdout + result.stderr
    pulled = rf'Copying \d+ files of {data_dir}/\S+ to \S+ \(this host reads them locally\)'
    copied = re.search(pulled, result.stderr)
    assert prepared == (host == 'first'), host
    assert host == 'first' or copied, result.stderr[-3000:]
    rows.append(_rows(workdir))
  assert rows[0] == rows[1]  # The same data and vocabulary: the same run.
  (dataset,) = storage.listdir(data_dir)
  names = storage.listdir(storage.join(data_dir, dataset))
  assert any(name.endswith('.model') for name in names), names  # The vocabulary, once.
