"""Reproducibility records: WORKDIR/provenance.jsonl and the config comparison on resume."""

import json
import logging
import sys

import jax

from configs import tiny
from transformer import provenance, runs


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_each_start_appends_command_code_and_package_versions(tmp_path, caplog):
  with caplog.at_level(logging.INFO):
    first = provenance.record(str(tmp_path))
    provenance.record(str(tmp_path))
  history = provenance.read(str(tmp_path))
  assert history[0] == first and len(history) == 2
  assert first['command'] == [sys.executable, *sys.argv]
  assert first['packages']['jax'] == jax.__version__ and 'flax' in first['packages']
  assert set(first['git']) == {'commit', 'dirty', 'diff_sha256'}
  assert first['devices'].startswith(f'{jax.device_count()} x ')
  assert not _warnings(caplog)  # Same code, same packages.


def test_resuming_under_other_code_or_packages_warns(tmp_path, caplog):
  previous = provenance.current()
  previous['git'] = {'commit': 'f' * 40, 'dirty': False, 'diff_sha256': None}
  previous['packages'] = {**previous['packages'], 'optax': '0.0.1'}
  (tmp_path / provenance.FILENAME).write_text(json.dumps(previous) + '\n')
  with caplog.at_level(logging.INFO):
    entry = provenance.record(str(tmp_path))
  [warning] = _warnings(caplog)
  assert f'git commit {"f" * 40} -> {entry["git"]["commit"]}' in warning
  assert f'optax 0.0.1 -> {entry["packages"]["optax"]}' in warning
  assert len(provenance.read(str(tmp_path))) == 2  # The earlier entry is kept.


def test_same_commit_with_other_uncommitted_changes_is_a_difference():
  entry = provenance.current()
  edited = {**entry, 'git': {**entry['git'], 'diff_sha256': 'other'}}
  assert provenance.differences(edited, entry) == [
    'uncommitted changes to the code differ (git diff HEAD)'
  ]
  assert provenance.differences(entry, entry) == []


def test_resumed_config_changes_warn_unless_resumable(tmp_path, caplog):
  config = tiny.get_config()
  runs.write_config(config, str(tmp_path))
  config.lr_scale = 2.0  # Changes the optimisation: a warning.
  config.num_train_steps = 120  # Training longer is what resuming is for: info only.
  with caplog.at_level(logging.INFO):
    runs.write_config(config, str(tmp_path))
  [warning] = _warnings(caplog)
  assert 'Config key lr_scale changed since the last run: 1.0 -> 2.0' in warning
  assert any(
    'num_train_steps changed' in r.getMessage() and r.levelno == logging.INFO
    for r in caplog.records
  )
  assert json.loads((tmp_path / 'config.json').read_text())['lr_scale'] == 2.0
