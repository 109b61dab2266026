"""Optuna studies behind sweep.py: spaces checked against the config, the driver's ask/tell with
pruning and stale trials on stand-in trials (no JAX), and a study of tiny train.py trials by two
workers, interrupted and resumed.
"""

import csv
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from test_sweeps import _sweep_py, _write_sweep, sweep_env  # noqa: F401  (a fixture)

from configs import tiny
from transformer.tools import sweep_optuna, sweep_runner, sweep_study, sweeps

REPO = Path(__file__).resolve().parents[1]

# --- Spaces --------------------------------------------------------------------------------------


def _create(tmp_path, body: str, **kwargs):
  sweep_file = tmp_path / 'study.py'
  sweep_file.write_text(f'from transformer.tools import sweeps\n\n\n{body}')
  return sweep_optuna.create(
    'configs/tiny.py', tiny.get_config(), str(sweep_file), str(tmp_path / 'root'), **kwargs
  )


def test_a_space_is_checked_against_the_config_and_its_trials_named_by_every_key(tmp_path):
  sweep, study = _create(
    tmp_path,
    'def space():\n'
    "  return {'lr_scale': sweeps.log_uniform(0.1, 10),"
    " 'model.num_layers': sweeps.int_uniform(1, 3),"
    " 'model.norm': sweeps.choice(['pre_ln', 'post_ln'])}\n\n\n"
    "def sweep():\n  return [{'lr_scale': 2}]\n",
    num_trials=5,
  )
  assert study.space['lr_scale'] == sweeps.Uniform(0.1, 10.0, log=True)
  assert study.storage == f'sqlite:///{tmp_path}/root/study.db' and study.name == 'root'
  # The enqueued trial keeps the base value of the keys it does not set, and names them.
  [trial] = sweep.trials
  assert trial.overrides == {'lr_scale': 2.0, 'model.num_layers': 1, 'model.norm': 'post_ln'}
  assert trial.name == 'lr_scale=2.0,norm=post_ln,num_layers=1'
  assert sweep_optuna.search_of(sweep.sweep_file) == 'optuna'

  for body, message in [
    ("{'model.num_layer': sweeps.int_uniform(1, 3)}", r"'model.num_layer' is not a key"),
    ("{'model.num_layers': sweeps.uniform(1, 3)}", 'has type float, but config.model'),
    ("{'model.dropout_rate': sweeps.uniform(0.0, 1.5)}", r'must be a finite number in \[0, 1\)'),
    ("{'lr_scale': [1.0, 2.0]}", 'is not one of sweeps.uniform'),
  ]:
    with pytest.raises(ValueError, match=message):
      _create(tmp_path, f'def space():\n  return {body}\n', num_trials=2)
  with pytest.raises(ValueError, match=r"trial 0 of sweep\(\) sets \['warmup_steps'\]"):
    _create(
      tmp_path,
      "def space():\n  return {'lr_scale': sweeps.uniform(1, 2)}\n\n\n"
      "def sweep():\n  return [{'warmup_steps': 3}]\n",
    )
  with pytest.raises(ValueError, match=r"is outside space\(\) in \['lr_scale'\]"):
    _create(
      tmp_path,
      "def space():\n  return {'lr_scale': sweeps.uniform(1, 2)}\n\n\n"
      "def sweep():\n  return [{'lr_scale': 3.0}]\n",
    )
  with pytest.raises(ValueError, match='give the study --num_trials'):
    _create(tmp_path, "def space():\n  return {'lr_scale': sweeps.uniform(1, 2)}\n")
  with pytest.raises(ValueError, match='--seeds=2: an Optuna study runs each configuration once'):
    _create(tmp_path, "def space():\n  return {'lr_scale': sweeps.uniform(1, 2)}\n", seeds=2)


def test_a_list_sweep_becomes_a_study_of_its_trials_and_their_values(tmp_path):
  sweep, study = _create(
    tmp_path,
    "def sweep():\n  return sweeps.one_at_a_time({'lr_scale': [2.0], 'warmup_steps': [5]})\n",
  )
  assert study.space == {
    'lr_scale': sweeps.Choice((1.0, 2.0)),  # The base value of the trials that keep it.
    'warmup_steps': sweeps.Choice((20, 5)),
  }
  assert [t.name for t in sweep.trials] == [
    'lr_scale=1.0,warmup_steps=20',
    'lr_scale=2.0,warmup_steps=20',
    'lr_scale=1.0,warmup_steps=5',
  ]
  assert study.num_trials == 3  # As many as it lists.
  assert sweep_optuna.search_of(sweep.sweep_file) == 'list'


# --- The driver, on stand-in trials ---------------------------------------------------------------


class _StandInSweep(sweeps.Sweep):
  """Trials of a stand-in for train.py: a validation row per step, `eval_loss` = |ln lr_scale| +
  1/step (the best trial: lr_scale nearest 1), 20 steps of 50 ms. It resumes from its last
  checkpoint, and on SIGTERM checkpoints the step in hand and exits 0, as train.py does."""

  def commands(self, trial):
    script = """
import json, math, os, signal, sys, time
workdir, steps, scale = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
checkpoints = os.path.join(workdir, 'checkpoints')
os.makedirs(checkpoints, exist_ok=True)
start = max([int(n) for n in os.listdir(checkpoints)], default=0)
print(f'Training from step {start} to {steps}', flush=True)
for step in range(start + 1, steps + 1):
  time.sleep(0.05)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as f:
    loss = abs(math.log(scale)) + 1 / step
    f.write(json.dumps({'step': step, 'train_loss': loss, 'eval_loss': loss}) + '\\n')
  if stop or step == steps:
    os.makedirs(os.path.join(checkpoints, str(step)))
    break
"""
    arguments = [self.workdir(trial), str(trial.config.num_train_steps), str(trial.config.lr_scale)]
    return [('train', [sys.executable, '-c', script, *arguments])]


def _stand_in_study(tmp_path, body: str, **kwargs):
  config = tiny.get_config()
  config.num_train_steps, config.eval_every_steps = 20, 1
  sweep_file = tmp_path / 'study.py'
  sweep_file.write_text(f'from transformer.tools import sweeps\n\n\n{body}')
  sweep, study = sweep_optuna.create(
    'configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'), **kwargs
  )
  return _StandInSweep(**{f: getattr(sweep, f) for f in sweep.__dataclass_fields__}), study


def _trials(sweep, study):
  return sweep_optuna.load(sweep, study, create_if_missing=False).get_trials()


@pytest.mark.parametrize(
  ('sampler', 'pruner'), [('tpe', 'median'), ('random', 'halving'), ('tpe', 'hyperband')]
)
def test_a_study_asks_runs_prunes_and_tells_on_a_journal_file(
  tmp_path, monkeypatch, sampler, pruner
):
  monkeypatch.setattr(sweep_runner, 'prepare_data', lambda trials: None)  # Stand-ins read none.
  space = "def space():\n  return {'lr_scale': sweeps.log_uniform(0.05, 20.0)}\n"
  sweep, study = _stand_in_study(
    tmp_path,
    space + "\n\ndef sweep():\n  return [{'lr_scale': 1.0}, {'lr_scale': 1.1}]\n",
    num_trials=8,
    sampler=sampler,
    pruner=pruner,
    startup_trials=2,
    storage_spec=str(tmp_path / 'shared' / 'study.journal'),  # JournalFileBackend.
  )
  outcomes = sweep_study.run(sweep, study, parallel=2)
  trials = _trials(sweep, study)
  assert len(trials) == 8 and len(outcomes) == 8
  assert [t.params['lr_scale'] for t in trials[:2]] == [1.0, 1.1]  # Enqueued first.
  for trial in trials:
    name = trial.user_attrs['name']
    assert name == f'lr_scale={sweeps.round_significant(trial.params["lr_scale"])!r}'
    state = sweep_runner.read_state(str(tmp_path / 'root' / name))
    status = {'COMPLETE': 'finished', 'PRUNED': 'pruned'}[trial.state.name]
    assert outcomes[name] == state['status'] == status
    rows = (tmp_path / 'root' / name / 'metrics.jsonl').read_text().splitlines()
    assert sorted(trial.intermediate_values) == [json.loads(r)['step'] for r in rows]
    if status == 'pruned':
      assert len(rows) < 20  # Stopped early, with a checkpoint of the step in hand.
      assert os.listdir(tmp_path / 'root' / name / 'checkpoints') == [str(len(rows))]
    else:
      assert trial.value == pytest.approx(json.loads(rows[-1])['eval_loss'])
  assert 'PRUNED' in [trial.state.name for trial in trials]
  # The draws are the sampler's, seeded per trial number: the same again.
  assert sweep_optuna._sampler(study, 0).__class__.__name__ == 'PerTrialSeed'

  sweep = sweep_study.studied(sweep, study)
  assert [t.name for t in sweep.trials] == [t.user_attrs['name'] for t in trials]
  from transformer.tools import sweep_summary

  [best] = [r for r in sweep_summary.write(sweep) if r.rank == 1]
  assert sweep_study.best(sweep, study) == (best.name, best.eval_loss)
  assert best.name == 'lr_scale=1.0'

  # Run again: the study has its trials; nothing runs.
  assert sweep_study.run(sweep, study, parallel=2) == {}


def test_a_trial_left_running_by_a_lost_worker_runs_again_from_its_checkpoint(
  tmp_path, monkeypatch
):
  sweep, study = _stand_in_study(
    tmp_path, "def sweep():\n  return [{'lr_scale': 2.0}, {'lr_scale': 3.0}]\n", pruner='none'
  )
  gone = subprocess.run(
    [sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True
  )
  # A worker asked for the first trial, trained it to step 7 and died.
  optuna_study = sweep_optuna.load(sweep, study)
  optuna_study.enqueue_trial(dict(sweep.trials[0].overrides))
  asked = optuna_study.ask({key: sweep_optuna.distribution(s) for key, s in study.space.items()})
  asked.set_user_attr('worker', {'host': socket.gethostname(), 'pid': int(gone.stdout)})
  asked.set_user_attr('heartbeat', time.time())
  asked.set_user_attr('name', sweep.trials[0].name)
  workdir = Path(sweep.workdir(sweep.trials[0]))
  (workdir / 'checkpoints' / '7').mkdir(parents=True)

  outcomes = sweep_study.run(sweep, study, parallel=1)
  assert outcomes == {'lr_scale=2.0': 'finished', 'lr_scale=3.0': 'finished'}
  trials = _trials(sweep, study)
  # The trial left running first (failed, enqueued again: Optuna's retry lineage), then the next.
  assert [(t.state.name, t.user_attrs['name']) for t in trials] == [
    ('FAIL', 'lr_scale=2.0'),
    ('COMPLETE', 'lr_scale=2.0'),
    ('COMPLETE', 'lr_scale=3.0'),
  ]
  assert trials[1].system_attrs['failed_trial'] == 0
  assert 'Training from step 7 to 20' in (workdir / 'train.log').read_text()


def _two_workers(tmp_path, listed):
  """Two drivers of one study, as two sweep.py processes would hold (each its own lock)."""
  sweep, study = _stand_in_study(
    tmp_path, f'def sweep():\n  return {[{"lr_scale": v} for v in listed]}\n', pruner='none'
  )
  return sweep, study, [sweep_study._Driver(sweep, study, 1) for _ in range(2)]


def _values_of(asked):
  return None if asked is None else asked.params['lr_scale']


def test_a_worker_that_finds_a_listed_trial_waiting_enqueues_the_next_not_a_draw(tmp_path):
  """Worker A enqueues the first listed trial; B, finding it waiting, still enqueues the next one:
  when A takes the first before B asks, B gets the second, never a draw of its own (which ran
  a listed trial twice and left the last one unrun)."""
  sweep, study, (a, b) = _two_workers(tmp_path, [1.0, 2.0, 3.0])
  a._enqueue_next()
  b._enqueue_next()
  taken_by_a = a.optuna_study.ask(a.distributions)
  taken_by_b = b.optuna_study.ask(b.distributions)
  assert (_values_of(taken_by_a), _values_of(taken_by_b)) == (1.0, 2.0)
  fixed = [t.system_attrs.get('fixed_params') for t in _trials(sweep, study)]
  assert fixed == [{'lr_scale': 1.0}, {'lr_scale': 2.0}]  # Both enqueued, none drawn.


def test_a_listed_trial_enqueued_twice_at_once_runs_once(tmp_path):
  """Two workers enqueued the same trial at once (Optuna does not prevent it across processes):
  the worker asking the later copy fails it as a duplicate, uncounted, and runs the next."""
  sweep, study, (a, b) = _two_workers(tmp_path, [1.0, 2.0])
  for driver in (a, b):  # As `_enqueue_next` enqueues a listed trial, each before the other's.
    values = {'lr_scale': 1.0}
    driver.optuna_study.enqueue_trial(values, user_attrs={sweep_study._LISTED: values})
  assert [_values_of(a._ask()), _values_of(b._ask()), _values_of(a._ask())] == [1.0, 2.0, None]
  trials = _trials(sweep, study)
  assert [(t.number, t.state.name, t.params['lr_scale']) for t in trials] == [
    (0, 'RUNNING', 1.0),
    (1, 'FAIL', 1.0),
    (2, 'RUNNING', 2.0),
  ]
  assert 'name' not in trials[1].user_attrs  # Not in the summary.
  assert trials[1].user_attrs['duplicate_of'] == 0
  assert sweep_study.studied(sweep, study).trials == ()  # Names are set as trials start.


def test_a_trial_just_asked_is_not_taken_for_a_stale_one(tmp_path):
  """Between another worker's ask and its first heartbeat, its trial started a moment ago."""
  sweep, study, (a, b) = _two_workers(tmp_path, [1.0, 2.0])
  a._enqueue_next()
  a.optuna_study.ask(a.distributions)  # Not yet marked with its worker or a heartbeat.
  assert _values_of(b._ask()) == 2.0
  assert [t.state.name for t in _trials(sweep, study)] == ['RUNNING', 'RUNNING']


# --- A study of train.py trials: two workers, interrupted, resumed -------------------------------


@pytest.mark.slow
def test_a_study_of_two_workers_interrupted_and_resumed(
  tmp_path,
  synthetic_multi30k_dir,
  synthetic_multi30k_data_dir,
  sweep_env,  # noqa: F811
):
  """8 tiny trials (2 good learning rates first, then 6 far too small) of one study (SQLite in
  the root). Its first worker is stopped (SIGTERM) once the first trial has a validation row;
  then two workers (sweep.py processes) finish the study: the stopped trial resumes from its
  checkpoint, and the pruner stops the poor ones."""
  scales = [1.0, 2.0, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035]
  sweep_file = _write_sweep(tmp_path / 'scales.py', f"sweeps.grid({{'lr_scale': {scales}}})")
  root = tmp_path / 'root'
  command = [
    sys.executable,
    'sweep.py',
    '--config=configs/tiny.py',
    f'--sweep={sweep_file}',
    f'--workdir={root}',
    '--search=optuna',
    '--startup_trials=2',
    f'--config.data.manual_dir={synthetic_multi30k_dir}',
    f'--config.data.data_dir={synthetic_multi30k_data_dir}',
    '--config.num_train_steps=40',
    '--config.eval_every_steps=5',
    '--config.log_every_steps=5',
    '--config.checkpoint_every_steps=20',
    '--config.eval_bleu_sentences=0',
  ]
  start = lambda: subprocess.Popen(
    command, cwd=REPO, env=sweep_env, stderr=subprocess.PIPE, text=True
  )

  first = start()
  metrics = root / 'lr_scale=1.0' / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (metrics.exists() and 'eval_loss' in metrics.read_text()):
    assert time.time() < deadline and first.poll() is None, first.communicate()[1][-3000:]
    time.sleep(0.1)
  first.send_signal(signal.SIGTERM)
  log = first.communicate(timeout=120)[1]
  assert first.returncode == 130, log[-3000:]
  assert json.loads((root / 'lr_scale=1.0' / 'trial.json').read_text())['status'] == 'interrupted'

  workers = [start(), start()]
  logs = [worker.communicate(timeout=600)[1] for worker in workers]
  if [worker.returncode for worker in workers] != [0, 0]:  # Each log whole: pytest cuts a list's.
    pytest.fail(
      '\n\n'.join(
        f'worker rc {w.returncode}:\n{log[-6000:]}' for w, log in zip(workers, logs, strict=True)
      )
    )
  assert sum(log.count('was left running by') for log in logs) == 1
  assert all(re.search(r'Trial \d+, lr_scale=', log) for log in logs)  # Both ran trials.

  with open(root / 'summary.csv') as f:
    rows = {row['trial']: row for row in csv.DictReader(f)}
  assert sorted(rows) == sorted(f'lr_scale={scale}' for scale in scales)
  attempts = (root / 'lr_scale=1.0' / 'train.log').read_text().split('\n=== ')
  assert len(attempts) == 3 and re.search(r'Training from step [1-9]\d* to 40', attempts[2])
  assert rows['lr_scale=1.0']['status'] == 'finished'
  pruned = [name for name, row in rows.items() if row['status'] == 'pruned']
  assert len(pruned) >= 4 and all(int(rows[name]['steps']) < 40 for name in pruned), rows
  assert all(row['status'] in ('finished', 'pruned') for row in rows.values()), rows
  # The summary's best is the study's.
  [best] = [name for name, row in rows.items() if row['rank'] == '1']
  study = optuna.load_study(study_name='root', storage=f'sqlite:///{root}/study.db')
  assert study.best_trial.user_attrs['name'] == best
  assert study.best_value == pytest.approx(float(rows[best]['eval_loss']), rel=1e-6)
  states = [t.state.name for t in study.get_trials()]
  assert states.count('FAIL') == 1 and states.count('COMPLETE') + states.count('PRUNED') == 8


# --- Where a study is kept: database URLs, journals, and files that are no study ---------------


def test_a_study_runs_on_an_explicit_sqlite_url_absolute_or_relative(tmp_path, monkeypatch):
  """`--storage=sqlite:///...` was refused as a bucket; a database URL is a study's storage."""
  monkeypatch.setattr(sweep_runner, 'prepare_data', lambda trials: None)
  body = "def sweep():\n  return [{'lr_scale': 1.0}, {'lr_scale': 2.0}]\n"
  database = tmp_path / 'shared' / 'studies.db'
  sweep, study = _stand_in_study(
    tmp_path, body, pruner='none', storage_spec=f'sqlite:///{database}'
  )
  assert study.storage == f'sqlite:///{database}'
  assert sweep_study.run(sweep, study) == {'lr_scale=1.0': 'finished', 'lr_scale=2.0': 'finished'}
  stored = optuna.load_study(study_name='root', storage=study.storage)
  assert [t.state.name for t in stored.get_trials()] == ['COMPLETE', 'COMPLETE']
  assert not (tmp_path / 'root' / 'study.db').exists()  # Kept where the URL says.

  # A relative path (and a driver named) is taken from the current folder, made absolute.
  monkeypatch.chdir(tmp_path / 'shared')
  sweep, study = _stand_in_study(
    tmp_path, body, pruner='none', storage_spec='sqlite+pysqlite:///studies.db'
  )
  assert study.storage == f'sqlite+pysqlite:///{database}'
  assert sweep_study.run(sweep, study) == {}  # The same study: it has its trials.


def test_a_database_url_is_checked_before_any_work(tmp_path):
  body = "def sweep():\n  return [{'lr_scale': 1.0}]\n"
  with pytest.raises(sweep_optuna.InvalidInput, match='a study in memory ends with the process'):
    _create(tmp_path, body, storage_spec='sqlite://')
  with pytest.raises(sweep_optuna.InvalidInput, match='is not a database URL SQLAlchemy can read'):
    _create(tmp_path, body, storage_spec='postgresql://u:p@127.0.0.1:notaport/db')
  with pytest.raises(sweep_optuna.InvalidInput, match='gs:// URL holds no study'):
    _create(tmp_path, body, storage_spec='gs://bucket/study.db')
  # A server URL passes the check where its driver is installed, else is refused naming it.
  url = 'postgresql+psycopg2://u:p@127.0.0.1:9/db'
  try:
    import psycopg2  # noqa: F401
  except ImportError:
    with pytest.raises(sweep_optuna.InvalidInput, match='its database driver is not installed'):
      _create(tmp_path, body, storage_spec=url)
  else:
    sweep, study = _create(tmp_path, body, storage_spec=url)
    assert study.storage == url
    with pytest.raises(sweep_optuna.InvalidInput, match='cannot be opened as an Optuna study'):
      sweep_optuna.load(sweep, study)  # Nothing answers on port 9.
  assert not (tmp_path / 'root').exists()


def _not_a_study(tmp_path, case):
  """A file given as a study's storage that holds none: (its --storage, its path)."""
  if case == 'source_file':
    return str(REPO / 'sweep.py'), REPO / 'sweep.py'
  if case == 'metrics_jsonl':
    path = tmp_path / 'run' / 'metrics.jsonl'
    path.parent.mkdir()
    path.write_text('{"step": 1, "train_loss": 2.5}\n{"step": 2, "train_loss": 2.4}\n')
    return str(path), path
  if case == 'sqlite_of_another_kind':
    path = tmp_path / 'db' / 'other.db'
    path.parent.mkdir()
    with sqlite3.connect(path) as db:
      db.execute('CREATE TABLE things (a)')
    return f'sqlite:///{path}', path
  path = tmp_path / 'root' / 'study.db'  # A study.db damaged in place (the default storage).
  path.parent.mkdir()
  optuna.create_study(storage=f'sqlite:///{path}', study_name='root')
  path.write_bytes(path.read_bytes()[:3000])
  return '', path


@pytest.mark.parametrize(
  ('case', 'message'),
  [
    ('source_file', 'is not an Optuna journal file (line 1 is not a journal entry)'),
    ('metrics_jsonl', 'is not an Optuna journal file (line 1 is not a journal entry)'),
    ('sqlite_of_another_kind', 'is an SQLite database of something else (tables things)'),
    ('damaged_study_db', 'is a damaged SQLite database (database disk image is malformed)'),
  ],
)
def test_a_storage_that_holds_no_study_is_one_message_naming_it(tmp_path, case, message):
  spec, path = _not_a_study(tmp_path, case)
  before = path.read_bytes()
  entries = sorted(os.listdir(path.parent))
  with pytest.raises(sweep_optuna.InvalidInput) as refusal:
    _create(tmp_path, "def sweep():\n  return [{'lr_scale': 1.0}]\n", storage_spec=spec)
  assert f'{path} {message}' in str(refusal.value)
  assert path.read_bytes() == before
  assert sorted(os.listdir(path.parent)) == entries  # No study.db.lock, nothing else.


def test_sweep_py_refuses_a_storage_that_is_no_study_and_takes_a_database_url(tmp_path):
  root = tmp_path / 'root'
  sweep_file = tmp_path / 'study.py'
  sweep_file.write_text(
    'from transformer.tools import sweeps\n\n\n'
    "def space():\n  return {'lr_scale': sweeps.log_uniform(0.5, 2.0)}\n"
  )
  command = lambda *flags: subprocess.run(
    [
      sys.executable,
      'sweep.py',
      '--config=configs/tiny.py',
      f'--sweep={sweep_file}',
      f'--workdir={root}',
      '--num_trials=2',
      '--config.data.manual_dir=/nowhere',
      *flags,
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  result = command(f'--storage={REPO}/sweep.py')  # Not a dry run: refused before any work.
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.splitlines()[-2] == (
    f'sweep.py: error: --storage={REPO}/sweep.py: {REPO}/sweep.py is not an Optuna journal '
    'file (line 1 is not a journal entry), so it holds no study; name a new file, or the '
    'journal of a study.'
  )
  assert 'Traceback' not in result.stderr
  assert not root.exists() and not (REPO / 'sweep.py.lock').exists()

  result = command(f'--storage=sqlite:///{tmp_path}/shared.db', '--dry_run')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"# Optuna study 'root' in sqlite:///{tmp_path}/shared.db: 2 trials" in result.stdout
  assert sorted(os.listdir(tmp_path)) == ['study.py']  # A dry run writes nothing.


# --- One study, one search -----------------------------------------------------------------------


@pytest.mark.parametrize(
  ('sampler', 'shown'),
  [
    ('sweeps.uniform(2, 1)', 'uniform(2, 1): the low bound 2 is above the high bound 1'),
    ('sweeps.log_uniform(2.0, 0.5)', 'log_uniform(2.0, 0.5): the low bound 2.0 is above'),
    ('sweeps.int_uniform(3, 1)', 'int_uniform(3, 1): the low bound 3 is above'),
    ('sweeps.Uniform(2.0, 1.0)', "space()['lr_scale'] = Uniform(low=2.0, high=1.0, log=False): "),
    ('sweeps.choice([])', 'choice([]): give it at least one value'),
  ],
)
def test_bounds_given_high_first_are_refused_when_the_sweep_file_is_read(tmp_path, sampler, shown):
  """Optuna refused them only when the first trial was asked, after the dry run passed."""
  key = 'model.num_layers' if 'int_uniform' in sampler else 'lr_scale'
  with pytest.raises(sweep_optuna.InvalidInput) as refusal:
    _create(tmp_path, f"def space():\n  return {{'{key}': {sampler}}}\n", num_trials=2)
  assert str(refusal.value).startswith(f'{tmp_path}/study.py: space')
  assert shown in str(refusal.value)


def test_a_study_made_by_another_sweep_is_refused_naming_both(tmp_path):
  storage_spec = str(tmp_path / 'study.journal')
  first = "def space():\n  return {'lr_scale': sweeps.log_uniform(0.5, 2.0)}\n"
  sweep, study = _create(tmp_path, first, num_trials=2, storage_spec=storage_spec)
  sweep_optuna.load(sweep, study)  # The study is made, its search recorded.
  sweep_optuna.load(sweep, study)  # The same sweep again: resumed.

  other = tmp_path / 'other'
  other.mkdir()
  for body in [
    "def space():\n  return {'lr_scale': sweeps.log_uniform(0.5, 4.0)}\n",  # Another space.
    first + "\n\ndef sweep():\n  return [{'lr_scale': 1.0}]\n",  # Other first trials.
  ]:
    sweep, study = _create(other, body, num_trials=2, storage_spec=storage_spec)
    # The same study name (the root's last part, 'root'), in the same storage.
    with pytest.raises(sweep_optuna.InvalidInput) as refusal:
      sweep_optuna.load(sweep, study)
    message = str(refusal.value)
    assert message.startswith(f"Study 'root' in {storage_spec} was made by {tmp_path}/study.py")
    assert f'not by this sweep, {other}/study.py' in message
    assert 'Give this sweep a study of its own (--study_name=NAME' in message
  sweep, study = _create(other, body, num_trials=2, storage_spec=storage_spec, study_name='b')
  sweep_optuna.load(sweep, study)  # A study of its own.
