"""A sweep's hparams table in TensorBoard, read back through TensorBoard's own plugin code.

Trials are made up (what a trial leaves in its workdir); the end-to-end check on a sweep that
trained is in tests/test_sweeps.py (`test_tensorboard_shows_the_sweep_as_an_hparams_table`).
"""

import json
import os
from pathlib import Path

import conftest
from conftest import write_lines

from configs import tiny
from transformer.tools import sweep_runner, sweep_tensorboard, sweeps


def _leave(workdir: Path, rows: list[dict], status: str) -> None:
  """What a trial leaves: its metrics rows and its recorded state."""
  write_lines(workdir / 'metrics.jsonl', [json.dumps(row) for row in rows])
  state = {'status': status, 'pid': None, 'stages': {}}
  (workdir / sweep_runner.STATE_FILE).write_text(json.dumps(state))


def test_every_started_trial_is_a_session_with_its_values_results_and_status(tmp_path):
  sweep_file = tmp_path / 's.py'
  sweep_file.write_text(
    'def sweep():\n'
    "  return [{}, {'lr_scale': 2.0}, {'model.num_layers': 2}, {'model.norm': 'pre_ln'}]\n"
  )
  sweep = sweeps.create('configs/tiny.py', tiny.get_config(), str(sweep_file), str(tmp_path / 'r'))
  base, doubled, deeper, _ = (Path(sweep.workdir(trial)) for trial in sweep.trials)
  train_row = {'step': 6, 'train_loss': 5.0}
  _leave(base, [train_row, {'step': 6, 'eval_loss': 4.5, 'eval_bleu': 1.5}], 'finished')
  _leave(doubled, [{'step': 3, 'train_loss': 6.0}], 'failed')
  _leave(deeper, [train_row | {'step': 3}], 'running')  # No process: interrupted.
  # The fourth never started: no session.

  assert sweep_tensorboard.write(sweep) == 3
  columns, sessions = conftest.tensorboard_hparams(sweep.root)
  assert sorted(columns['hparams']) == ['lr_scale', 'model.norm', 'model.num_layers']
  assert sorted(columns['metrics']) == [
    'best_eval_bleu',
    'eval_loss',
    'steps',
    'train_loss',
  ]
  run = f'{{}}/tensorboard/{sweep_tensorboard.RUN}'.format
  assert sorted(sessions) == sorted(run(t.name) for t in sweep.trials[:3])
  # Every swept key, the base value where the trial keeps it.
  assert sessions[run('base')]['hparams'] == {
    'lr_scale': 1.0,
    'model.num_layers': 1.0,
    'model.norm': 'post_ln',
  }
  assert sessions[run('base')]['metrics'] == {
    'eval_loss': 4.5,
    'best_eval_bleu': 1.5,
    'train_loss': 5.0,
    'steps': 6.0,
  }
  assert sessions[run('lr_scale=2.0')]['hparams']['lr_scale'] == 2.0
  assert sessions[run('lr_scale=2.0')]['metrics'] == {'train_loss': 6.0, 'steps': 3.0}
  assert [sessions[run(t.name)]['status'] for t in sweep.trials[:3]] == [
    'STATUS_SUCCESS',
    'STATUS_FAILURE',
    'STATUS_UNKNOWN',
  ]

  # Written again only where what it holds changed, replacing the file.
  folder = base / 'tensorboard' / sweep_tensorboard.RUN
  before = {p: os.listdir(p / 'tensorboard' / 'hparams') for p in (base, doubled, deeper)}
  assert sweep_tensorboard.write(sweep) == 0
  assert {p: os.listdir(p / 'tensorboard' / 'hparams') for p in before} == before
  _leave(base, [train_row, {'step': 6, 'eval_loss': 4.0, 'eval_bleu': 2.0}], 'finished')
  assert sweep_tensorboard.write(sweep) == 1
  [written] = os.listdir(folder)
  assert written != before[base][0]
  _, sessions = conftest.tensorboard_hparams(sweep.root)
  assert sessions[run('base')]['metrics']['eval_loss'] == 4.0
  assert sessions[run('base')]['metrics']['best_eval_bleu'] == 2.0


def test_a_session_another_worker_replaced_first_is_no_error(tmp_path, monkeypatch):
  """Two workers of one study finish together and both rewrite each trial's session: the file
  one lists as the one to replace may be gone when it removes it (CI saw FileNotFoundError)."""
  sweep_file = tmp_path / 's.py'
  sweep_file.write_text('def sweep():\n  return [{}]\n')
  sweep = sweeps.create('configs/tiny.py', tiny.get_config(), str(sweep_file), str(tmp_path / 'r'))
  [trial] = sweep.trials
  workdir = Path(sweep.workdir(trial))
  _leave(workdir, [{'step': 3, 'train_loss': 6.0}], 'running')  # No process: interrupted.
  assert sweep_tensorboard.write(sweep) == 1
  folder = workdir / 'tensorboard' / sweep_tensorboard.RUN
  [first] = os.listdir(folder)
  _leave(workdir, [{'step': 6, 'train_loss': 5.0}], 'finished')
  listed = sweep_tensorboard.storage.glob
  # The other worker replaces the file between this one's listing and its removal.
  monkeypatch.setattr(
    sweep_tensorboard.storage,
    'glob',
    lambda *args: [*listed(*args), str(folder / (first + '.replaced-by-the-other-worker'))],
  )
  assert sweep_tensorboard.write(sweep) == 1
  [written] = os.listdir(folder)
  assert written != first
  _, sessions = conftest.tensorboard_hparams(sweep.root)
  assert sessions[f'base/tensorboard/{sweep_tensorboard.RUN}']['status'] == 'STATUS_SUCCESS'
