"""Weights & Biases, opt-in (`config.wandb`): real W&B runs in offline mode, read back from disk."""

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from configs import tiny
from transformer import config as config_lib
from transformer import training, wandb_run
from transformer.errors import InvalidInput
from transformer.tools import sweeps

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
  """W&B's settings and caches in the test's folder, quiet, never asked to log in."""
  for name in ('WANDB_CONFIG_DIR', 'WANDB_CACHE_DIR', 'WANDB_DATA_DIR', 'WANDB_ARTIFACT_DIR'):
    monkeypatch.setenv(name, str(tmp_path / 'wandb_home' / name.lower()))
  monkeypatch.setenv('WANDB_SILENT', 'true')
  monkeypatch.delenv('WANDB_API_KEY', raising=False)
  monkeypatch.delenv('WANDB_MODE', raising=False)


def _config(synthetic_multi30k_dir, synthetic_multi30k_data_dir, **overrides):
  config = tiny.get_config()
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(synthetic_multi30k_data_dir)
  return sweeps.apply_overrides(config, overrides)


def _records(path):
  """The protobuf records of a W&B run file (`run-ID.wandb`): a log of 32 KiB blocks.

  The file starts with ':W&B', a magic number and a version (7 bytes); each record is cut
  into chunks that never cross a block, each with a CRC, its length and its kind (1 whole,
  2 first, 3 middle, 4 last); a block's last bytes are padding where no header fits.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top

  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B'
  block, position, pieces, records = 32768, 7, b'', []
  while position + 7 <= len(data):
    if block - position % block < 7:
      position += block - position % block
      continue
    _, length, kind = struct.unpack('<IHB', data[position : position + 7])
    pieces += data[position + 7 : position + 7 + length]
    position += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pieces)
      records.append(record)
      pieces = b''
  return records


def _offline_runs(workdir):
  """{folder: (run id, its config as a dict, {step: {key: value}})} of WORKDIR/wandb/."""
  runs = {}
  for folder in sorted(glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*'))):
    (path,) = glob.glob(os.path.join(folder, 'run-*.wandb'))
    run_id, config, history = None, {}, {}
    for record in _records(path):
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        run_id = record.run.run_id
        config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
      elif kind == 'history':
        row = {
          i.key or '.'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item
        }
        history.setdefault(record.history.step.num, {}).update(row)
    runs[os.path.basename(folder)] = run_id, config, history
  return runs


def _metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _train_py(workdir, data, steps, env):
  """train.py on configs/tiny.py, as a user runs it, sending to W&B offline."""
  manual_dir, data_dir = data
  flags = {
    'num_train_steps': steps,
    'log_every_steps': 5,
    'eval_every_steps': 10,
    'checkpoint_every_steps': 5,
    'data.manual_dir': manual_dir,
    'data.data_dir': data_dir,
    'wandb.project': 'transformer-tests',
    'wandb.group': 'sweep-a',
    'wandb.mode': 'offline',
  }
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}']
    + [f'--config.{key}={value}' for key, value in flags.items()],
    cwd=REPO,
    env={**os.environ, **env, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-5000:]


def _rows_by_step(workdir):
  """{step: every key metrics.jsonl has at that step} (training and validation rows merged)."""
  by_step = {}
  for row in _metrics(workdir):
    by_step.setdefault(row.pop('step'), {}).update(row)
  return by_step


def test_a_run_and_its_resume_send_every_row_and_the_config_to_one_wandb_run(
  synthetic_multi30k_dir, synthetic_multi30k_data_dir, tmp_path
):
  workdir = str(tmp_path / 'run')
  data = (synthetic_multi30k_dir, synthetic_multi30k_data_dir)
  env = {name: os.environ[name] for name in os.environ if name.startswith('WANDB_')}
  _train_py(workdir, data, 10, env)
  with open(os.path.join(workdir, 'wandb.json')) as f:
    run_id = json.load(f)['id']
  ((_, (first_id, sent_config, first_history)),) = _offline_runs(workdir).items()
  assert first_id == run_id
  assert sent_config['model']['d_model'] == tiny.get_config().model.d_model
  assert sent_config['wandb']['group'] == 'sweep-a'
  rows = _rows_by_step(workdir)
  assert sorted(first_history) == sorted(rows) == [5, 10]
  for step, row in rows.items():  # Every value of every row, as metrics.jsonl has it.
    for key, value in row.items():
      if key != 'wall_seconds':
        assert first_history[step][key] == pytest.approx(value, rel=1e-6), (step, key)

  # The resume goes on in the same W&B run (offline: a second folder with the same id).
  _train_py(workdir, data, 15, env)
  runs = _offline_runs(workdir)
  assert len(runs) == 2
  assert {run_id for run_id, _, _ in runs.values()} == {run_id}
  _, _, second_history = runs[sorted(runs)[-1]]
  assert sorted(second_history) == [15]
  for key, value in _rows_by_step(workdir)[15].items():
    if key != 'wall_seconds':
      assert second_history[15][key] == pytest.approx(value, rel=1e-6), key


def test_wandb_that_cannot_start_leaves_the_workdir_as_it_was(
  synthetic_multi30k_dir, synthetic_multi30k_data_dir, tmp_path, monkeypatch
):
  import wandb  # pylint: disable=g-import-not-at-top

  def refuse(**kwargs):
    del kwargs
    raise wandb.errors.UsageError('api_key not configured (no-tty). call wandb.login(key=...)')

  monkeypatch.setattr(wandb, 'init', refuse)
  config = _config(
    synthetic_multi30k_dir,
    synthetic_multi30k_data_dir,
    num_train_steps=2,
    **{'wandb.project': 'transformer-tests'},
  )
  workdir = tmp_path / 'run'
  with pytest.raises(InvalidInput, match=r'(?s)did not start .*api_key not configured.*offline'):
    training.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_the_wandb_id_file_is_checked_before_anything_is_written(tmp_path):
  config = tiny.get_config()
  config.wandb.project = 'transformer-tests'
  config.wandb.mode = 'offline'
  (tmp_path / 'wandb.json').write_text('{"id": ')  # Cut short.
  with pytest.raises(InvalidInput, match=r'wandb.json is damaged: not JSON'):
    wandb_run.WandbRun.start(config, str(tmp_path))
  (tmp_path / 'wandb.json').write_text('{"run": "abc"}')
  with pytest.raises(InvalidInput, match=r'does not name a W&B run'):
    wandb_run.WandbRun.start(config, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ['wandb.json']
  config.wandb.project = ''  # Off: nothing is written, W&B is not imported.
  assert wandb_run.WandbRun.start(config, str(tmp_path / 'off')) is None
  assert not (tmp_path / 'off').exists()


def test_wandb_settings_are_checked_against_their_domains(monkeypatch):
  config = tiny.get_config()
  config.wandb.project = 'a/b'
  config.wandb.mode = 'disabled'
  errors = config_lib.config_errors(config)
  assert any(e.startswith("config.wandb.project='a/b'") for e in errors), errors
  assert any(e.startswith("config.wandb.mode='disabled'") for e in errors), errors
  config.wandb.project, config.wandb.mode = 'transformer-tests', 'offline'
  assert config_lib.machine_errors(config) == []
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, 'find_spec', lambda name, *a: None if name == 'wandb' else real_find_spec(name)
  )
  (error,) = config_lib.machine_errors(config)
  assert 'needs wandb, which is not installed: pip install -r requirements/tracking.txt' in error
