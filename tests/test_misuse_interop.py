"""Misuse, round five: models in and out as safe as train.py (issue 62).

No output of convert.py inside a run's files, an input or the code; a Hugging Face directory
or any other folder of someone else's files refused as a workdir and named as what it is; the
overrides an import would drop refused; a run's own files named relative to its workdir and
its vocabulary checked by content wherever it is read. The damaged Marian directories are
tests/test_interop_damaged.py's; every command's output flags, tests/test_output_flags.py's.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from configs import tiny
from transformer import (
  best_checkpoints,
  config_fields,
  errors,
  evaluation,
  initialization,
  path_checks,
  provenance,
  runs,
)
from transformer import config as config_lib
from transformer.interop import workdirs

REPO = Path(__file__).resolve().parents[1]


def _fake_run(path: Path) -> Path:
  """A folder `path_checks.is_run` takes for a run: config.json beside checkpoints/."""
  (path / 'checkpoints' / '50').mkdir(parents=True)
  (path / 'best_checkpoints' / '99').mkdir(parents=True)
  (path / 'config.json').write_text('{}')
  return path


def _hugging_face_dir(path: Path) -> Path:
  """What `save_pretrained` leaves: its config.json names the model type."""
  path.mkdir(parents=True)
  marian = {'model_type': 'marian', 'architectures': ['MarianMTModel'], 'd_model': 32}
  (path / 'config.json').write_text(json.dumps(marian))
  (path / 'model.safetensors').write_bytes(b'weights')
  (path / 'vocab.json').write_text('{}')
  return path


def _snapshot(folder: Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob('*') if p.is_file()}


def _command(script: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, script, *args],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )


def _refusal(result: subprocess.CompletedProcess) -> str:
  """The one message a refused command ends with (`errors.run`), with no traceback."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert lines[-1].startswith(f'(set {errors.TRACEBACK_ENV}=1'), lines[-3:]
  return lines[-2]


# --- Items 1, 2, 9: convert.py's outputs go through the rule of every output -------------------


@pytest.mark.parametrize(
  ('flag', 'inside', 'entry'),
  [
    ('--to_hf', 'checkpoints/50', 'checkpoints'),
    ('--to_ctranslate2', 'best_checkpoints/99', 'best_checkpoints'),
    ('--workdir', 'checkpoints/70', 'checkpoints'),  # --from_hf's new workdir.
  ],
)
def test_an_output_of_convert_py_in_a_runs_files_is_refused(tmp_path, flag, inside, entry):
  run = _fake_run(tmp_path / 'run')
  target = run / inside
  with pytest.raises(errors.InvalidInput) as refusal:
    workdirs.check_new_output(str(target), flag)
  assert str(refusal.value) == (
    f'{flag}={target} lies in {entry} of the training run in {run}, which only that run '
    'writes; write elsewhere.'
  )


def test_an_import_into_its_own_source_or_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
  source = _hugging_face_dir(tmp_path / 'hf')
  inputs = {'the Hugging Face directory (--from_hf)': str(source)}
  with pytest.raises(errors.InvalidInput, match=re.escape('lies in the Hugging Face directory')):
    workdirs.check_new_output(str(source / 'imported'), '--workdir', inputs)
  locked = tmp_path / 'locked'
  locked.mkdir()
  access = os.access  # As root every folder is writable: this one is not, by os.access.
  monkeypatch.setattr(os, 'access', lambda p, mode: str(p) != str(locked) and access(p, mode))
  for flag in ('--to_hf', '--to_ctranslate2', '--workdir'):
    with pytest.raises(errors.InvalidInput) as refusal:
      workdirs.check_new_output(str(locked / 'new'), flag)
    assert str(refusal.value) == (
      f'{flag}: {locked} is not writable, so nothing can be written to {locked}/new.'
    )


def test_convert_py_refuses_an_export_into_the_runs_checkpoints_before_reading_it(tmp_path):
  run = _fake_run(tmp_path / 'run')
  before = _snapshot(run)
  result = _command('convert.py', f'--workdir={run}', f'--to_hf={run}/checkpoints/50')
  assert _refusal(result) == (
    f'convert.py: error: --to_hf={run}/checkpoints/50 lies in checkpoints of the training run in '
    f'{run}, which only that run writes; write elsewhere.'
  )
  assert _snapshot(run) == before and sorted(os.listdir(run / 'checkpoints')) == ['50']


# --- Item 3: a folder that is not a run's is no workdir, and a model directory is named -------


def test_a_hugging_face_directory_is_named_as_what_it_is_wherever_a_run_is_expected(tmp_path):
  hf = _hugging_face_dir(tmp_path / 'export')
  named = (
    f'{hf} is a Hugging Face model directory (config.json model_type {"marian"!r}), not the '
    'workdir of a training run, and nothing is written into it. Import it as a workdir with '
    f'convert.py --from_hf={hf} --workdir=NEW, or fine-tune from it with train.py '
    f'--config.init_from=hf:{hf} --workdir=NEW.'
  )
  config = tiny.get_config()
  assert path_checks.workdir_errors(config, str(hf)) == [f'--workdir: {named}']  # train.py
  with pytest.raises(errors.InvalidInput) as refusal:  # eval.py's and convert.py's reader.
    evaluation.load_run_config(str(hf))
  assert str(refusal.value) == named
  config.init_from = str(hf)  # Without hf:.
  with pytest.raises(errors.InvalidInput) as refusal:
    initialization.resolve(config)
  assert str(refusal.value) == f'config.init_from={hf}: {named}'


def test_train_py_on_a_hugging_face_export_refuses_and_leaves_it_as_it_was(tmp_path):
  hf = _hugging_face_dir(tmp_path / 'export')
  before = _snapshot(hf)
  result = _command('train.py', '--config=configs/tiny.py', f'--workdir={hf}')
  assert _refusal(result).startswith(f'  --workdir: {hf} is a Hugging Face model directory')
  assert 'train.py: error: Invalid paths:' in result.stderr
  assert _snapshot(hf) == before


def test_a_folder_of_other_files_is_refused_as_a_workdir_and_a_run_to_be_is_not(tmp_path):
  config = tiny.get_config()
  notes = tmp_path / 'notes'
  notes.mkdir()
  for name in ('a.txt', 'b.txt', 'c', 'd', 'e', 'f', 'trial.json'):
    (notes / name).write_text('mine')
  assert path_checks.workdir_errors(config, str(notes)) == [
    f"--workdir={notes} holds files that are not a training run's (a.txt, b.txt, c, d, e and "
    '1 more): name a new or empty folder, or the workdir of a run to resume. Nothing was '
    'written.'
  ]
  trial = tmp_path / 'trial'  # What sweep.py writes before train.py starts there.
  trial.mkdir()
  (trial / 'trial.json').write_text('{}')
  (trial / 'train.log').write_text('')
  assert path_checks.workdir_errors(config, str(trial)) == []


# --- Item 6: one file for the vocabularies of both sides ----------------------------------------


def test_one_file_for_both_sides_vocabularies_is_refused(tmp_path):
  config = tiny.get_config()
  config.data.vocab_path = str(tmp_path / 'vocab.model')
  config.data.target_vocab_path = str(tmp_path / '.' / 'vocab.model')
  message = (
    f'config.data.target_vocab_path={config.data.target_vocab_path!r} names the file of '
    'config.data.vocab_path'
  )
  assert any(e.startswith(message) for e in config_lib.config_errors(config))
  config.data.target_vocab_path = str(tmp_path / 'target.model')
  assert not [e for e in config_lib.config_errors(config) if 'target_vocab_path' in e]


# --- Item 7: a run's own files relative to its workdir; its vocabulary by content -----------------


def _run_with_vocabulary(workdir: Path) -> Path:
  """A run whose vocabulary lives in its workdir (as an imported one's), recorded by hash."""
  workdir.mkdir()
  vocabulary = workdir / 'vocabulary.model'
  vocabulary.write_bytes(b'the pieces')
  config = tiny.get_config()
  config.data.vocab_path = str(vocabulary)
  runs.write_config(config, str(workdir))
  entry = {'inputs': {'vocabulary': provenance.vocabulary_input(config)}}
  (workdir / provenance.FILENAME).write_text(json.dumps(entry) + '\n')
  return vocabulary


def test_a_moved_workdir_reads_its_own_vocabulary_and_never_a_new_one(tmp_path):
  _run_with_vocabulary(tmp_path / 'run')
  saved = json.loads((tmp_path / 'run' / 'config.json').read_text())
  assert saved['data']['vocab_path'] == '$WORKDIR/vocabulary.model'
  moved = tmp_path / 'elsewhere' / 'run'
  moved.parent.mkdir()
  shutil.move(tmp_path / 'run', moved)
  config = evaluation.load_run_config(str(moved))
  assert config.data.vocab_path == str(moved / 'vocabulary.model')
  assert runs.saved_config(str(moved))['data.vocab_path'] == str(moved / 'vocabulary.model')

  (moved / 'vocabulary.model').unlink()  # Gone: evaluation refuses, and trains none.
  with pytest.raises(errors.MissingInput) as refusal:
    evaluation.load_run_config(str(moved))
  assert f'its config names {moved}/vocabulary.model, which does not exist' in str(refusal.value)
  assert 'Evaluation never trains a vocabulary' in str(refusal.value)
  assert not (tmp_path / 'run').exists() and not (moved / 'vocabulary.model').exists()

  (moved / 'vocabulary.model').write_bytes(b'other pieces')  # Another one: refused by hash.
  with pytest.raises(errors.InvalidInput, match='trained with another vocabulary'):
    evaluation.load_run_config(str(moved))


def test_a_path_outside_the_workdir_is_kept_as_it_was_given(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  config = tiny.get_config()
  config.data.vocab_path = str(tmp_path / 'shared.model')
  config.data.manual_dir = str(workdir / 'raw')  # Not a file of the run's own: as given.
  runs.write_config(config, str(workdir))
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['data']['vocab_path'] == str(tmp_path / 'shared.model')
  assert saved['data']['manual_dir'] == str(workdir / 'raw')


# --- Item 8: an override the import would drop ----------------------------------------------------


def test_an_import_refuses_overrides_of_what_the_directory_gives_before_reading_it(tmp_path):
  hf = _hugging_face_dir(tmp_path / 'hf')  # Not read: the refusal comes first.
  overridden = {'model.d_model': 64, 'vocab_size': 300, 'decode.beam_size': 5, 'seed': 3}
  with pytest.raises(errors.InvalidInput) as refusal:
    workdirs.import_hf(str(hf), str(tmp_path / 'new'), tiny.get_config(), overridden)
  dropped = 'so an override would be dropped; leave it out.'
  assert str(refusal.value) == (
    'Invalid overrides:\n'
    f'  --config.model.d_model: the imported model takes it from {hf} (its config.json and '
    f'vocabulary files), {dropped}\n'
    f'  --config.vocab_size: the imported model takes it from {hf} (its config.json and '
    f'vocabulary files), {dropped}'
  )
  assert not (tmp_path / 'new').exists()


# --- Item 13: hf: with no directory ---------------------------------------------------------------


def test_init_from_hf_without_a_directory_is_outside_the_domain():
  config = tiny.get_config()
  config.init_from = 'hf:'
  [error] = [e for e in config_lib.config_errors(config) if e.startswith('config.init_from')]
  assert error == f"config.init_from='hf:' must be {config_fields.INIT_SOURCE.text}."
  assert 'named after the hf:' in error and '--from_hf' not in error


def test_init_from_names_its_own_key_not_convert_pys_flag(tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  config = tiny.get_config()
  config.init_from, config.data.vocab_path = f'hf:{empty}', str(tmp_path / 'vocab.model')
  with pytest.raises(errors.InvalidInput) as refusal:
    initialization.resolve(config)
  assert str(refusal.value) == (
    f'config.init_from=hf:{empty}: {empty}: no config.json there (a Hugging Face model directory).'
  )


# --- Item 17: a healthy read of the best checkpoints warns of nothing ---------------------------


def test_reading_the_best_checkpoints_prints_no_orbax_read_only_warning(tmp_path, caplog):
  best_checkpoints.BestCheckpoints(str(tmp_path)).close()  # Makes best_checkpoints/.
  with caplog.at_level(logging.INFO):
    best_checkpoints.BestCheckpoints(str(tmp_path), read_only=True).close()
  assert best_checkpoints.DIRECTORY in os.listdir(tmp_path)
  assert not [r for r in caplog.records if 'read only' in r.getMessage()], caplog.text
