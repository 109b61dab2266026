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
  assert [worker.returncode for worker in workers] == [0, 0], [log[-3000:] for log in logs]
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
