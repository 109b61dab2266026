"""Misuse, round three: the newer tools and fields as safe as train.py (issue 45).

Outputs checked before the work and kept when the disk fills; a resume that changes what the
checkpoint's optimizer state, data position or schedule depend on is refused, naming the field.
The run misused is test_reliability's small one (2 steps, a checkpoint at step 2).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from conftest import synthetic_pairs
from test_reliability import _last_lines, _small_config, _snapshot, copied_run, small_run

from configs import multi30k_literature, recipe_study, tiny, wmt14_ende_big
from transformer import config as config_lib
from transformer import (
  data_position,
  divergence,
  dry_run,
  errors,
  google_credentials,
  input_pipeline,
  metrics,
  optim,
  outputs,
  path_checks,
  runs,
  scoring,
  storage,
  training,
)
from transformer.tools import significance, sweep_runner, sweeps

REPO = Path(__file__).resolve().parents[1]

__all__ = ['copied_run', 'small_run']  # Fixtures shared with test_reliability.


def _run(*command, timeout=300):
  return subprocess.run(
    [sys.executable, *command],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


# --- Outputs: checked before any work, kept when the write fails --------------------------------


def test_a_failed_write_keeps_the_content_and_names_the_file(tmp_path):
  good = tmp_path / 'good.json'
  with pytest.raises(outputs.OutputWriteError) as error:
    outputs.write_files([(str(good), '{"a": 1}'), ('/dev/full', 'line 1\nline 2\n')], '--output')
  message = str(error.value)
  assert message.startswith('--output: could not write /dev/full (No space left on device).')
  kept = Path(message.split('is kept in ')[1].split(':')[0])
  assert kept.read_text() == 'line 1\nline 2\n'
  assert good.read_text() == '{"a": 1}'  # What could be written was.
  assert isinstance(error.value, errors.Refusal)


def test_output_paths_are_refused_when_they_are_code_or_cannot_be_written(tmp_path):
  if (REPO / '.git').exists():
    [error] = path_checks.output_errors(str(REPO / 'README.md'), '--out')
    assert f'--out={REPO}/README.md is a file of the code (README.md in {REPO})' in error
  missing = tmp_path / 'no_such_folder' / 'x.json'
  assert path_checks.output_errors(str(missing), '--out') == [
    f'--out={missing}: the folder {missing.parent} does not exist.'
  ]
  assert path_checks.output_errors('-', '--out') == []


@pytest.mark.parametrize('case', ['readme', 'missing_folder'])
def test_accelerator_check_refuses_its_output_before_the_benchmark(tmp_path, case):
  out = {'readme': REPO / 'README.md', 'missing_folder': tmp_path / 'nope' / 'x.json'}[case]
  readme = (REPO / 'README.md').read_bytes()
  root = tmp_path / 'root'
  result = _run('bench/accelerator_check.py', '--smoke', f'--out={out}', f'--root={root}')
  assert result.returncode == 1, result.stderr[-2000:]
  expected = {
    'readme': f'--out={out} is a file of the code',
    'missing_folder': f'--out={out}: the folder {out.parent} does not exist.',
  }[case]
  assert expected in _last_lines(result, 1)[0]
  assert (REPO / 'README.md').read_bytes() == readme
  assert not (root / 'corpus').exists()  # Refused before the corpus, the runs, the devices.


@pytest.mark.parametrize('script', ['input_pipeline.py', 'data_mirror.py'])
def test_a_benchmark_root_in_the_code_is_refused(script):
  result = _run(f'bench/{script}', f'--root={REPO}', '--pairs=10')
  assert result.returncode == 2, result.stderr[-2000:]
  assert f'error: --root={REPO} is the code' in result.stderr.splitlines()[-1]


def test_eval_output_on_a_full_disk_keeps_the_translations(copied_run, tmp_path):
  workdir, before = copied_run
  source = tmp_path / 'in.txt'
  source.write_text('Bada kelo.\nKelo bada.\n')
  result = _run(
    'eval.py',
    f'--workdir={workdir}',
    f'--input_file={source}',
    '--output_file=/dev/full',
    '--decoder=greedy',
  )
  assert result.returncode == 1, result.stderr[-3000:]
  [message] = _last_lines(result, 1)
  assert 'eval.py: error: --output_file: could not write /dev/full (No space left' in message
  kept = Path(message.split('is kept in ')[1].split(':')[0])
  assert len(kept.read_text().splitlines()) == 2  # One translation per input line.
  assert _snapshot(workdir) == before


def test_curves_writes_exactly_the_output_named(tmp_path):
  run = tmp_path / 'run'
  run.mkdir()
  rows = [{'step': s, 'eval_bleu': float(s), 'wall_seconds': 6.0 * s} for s in (10, 20)]
  (run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  out = tmp_path / 'figure'  # No extension: still a PNG, at exactly this path.
  result = _run('-m', 'transformer.tools.curves', f'--run=a={run}', f'--output={out}')
  assert result.returncode == 0, result.stderr[-2000:]
  assert out.read_bytes().startswith(b'\x89PNG')
  assert sorted(p.name for p in tmp_path.iterdir()) == ['figure', 'run']
  assert f'Wrote {out}.' in result.stdout


# --- Resume: what the checkpoint's state depends on is named ------------------------------------


@pytest.mark.parametrize(
  ('overrides', 'messages'),
  [
    (
      {'grad_clip_norm': 1.0},
      [
        'hold the optimizer state of another optimizer',
        'config.grad_clip_norm: 0.0 -> 1.0 turns gradient clipping by global norm on or off',
      ],
    ),
  ],
)
def test_resume_that_changes_the_optimizer_layout_is_refused(
  small_run, copied_run, overrides, messages
):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  config = _small_config(corpus, data_dir, num_train_steps=4, **overrides)
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(config, str(workdir))
  assert str(error.value).startswith(f'The checkpoints in {workdir}/checkpoints ')
  for message in messages:
    assert message in str(error.value)
  assert _snapshot(workdir) == before


def _as_if_trained_with(workdir: Path, **values) -> None:
  """Rewrites the run's config.json as if it had been started with `values`."""
  saved = json.loads((workdir / 'config.json').read_text())
  saved.update(values)
  (workdir / 'config.json').write_text(json.dumps(saved, indent=2, sort_keys=True))


@pytest.mark.parametrize('schedule', ['linear', 'cosine'])
def test_extending_a_decayed_schedule_is_refused_with_the_jump(small_run, copied_run, schedule):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  fields = {'schedule': schedule, 'warmup_steps': 1, 'peak_learning_rate': 0.001}
  _as_if_trained_with(workdir, num_train_steps=2, **fields)
  before = _snapshot(workdir)
  longer = _small_config(corpus, data_dir, num_train_steps=10, **fields)
  with pytest.raises(ValueError) as error:
    runs.check_resume(longer, str(workdir))
  message = str(error.value)
  assert message.startswith(f'config.num_train_steps: 2 -> 10 reshapes the {schedule} decay')
  # At step 2 the 2-step decay is at its end (final_lr_fraction of the peak); the 10-step
  # one would still be near the peak.
  final = longer.final_lr_fraction
  assert f'from {0.001 * final:.3g} ({final:.1%} of the peak)' in message
  assert 'train from scratch in a new --workdir' in message
  assert 'resume with config.num_train_steps=2' in message
  assert _snapshot(workdir) == before
  # The same length goes on; so does a longer run still in its warm-up (not yet decayed).
  runs.check_resume(_small_config(corpus, data_dir, num_train_steps=2, **fields), str(workdir))
  warming = {**fields, 'warmup_steps': 5}
  _as_if_trained_with(workdir, num_train_steps=6, **warming)
  runs.check_resume(_small_config(corpus, data_dir, num_train_steps=10, **warming), str(workdir))


# --- Run files damaged the way crashes and full disks damage them -------------------------------


def test_a_last_metrics_row_cut_short_by_a_crash_is_left_out_on_resume(small_run, copied_run):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  path = workdir / 'metrics.jsonl'
  rows = path.read_text()
  path.write_text(rows + '{"step": 3, "train_lo')  # A crash in the middle of step 3's row.
  training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=3), str(workdir))
  text = path.read_text()
  assert text.startswith(rows) and text.endswith('\n')
  assert [json.loads(line)['step'] for line in text.splitlines()][-1] == 3


def test_a_damaged_metrics_row_is_named_before_anything_is_written(small_run, copied_run):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  path = workdir / 'metrics.jsonl'
  first, *others = path.read_text().splitlines(keepends=True)
  path.write_text(''.join([first, '{"step": 1, "train_loss": 5.\n', *others]))
  before = _snapshot(workdir)
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=4), str(workdir))
  assert str(error.value).startswith(f"{path}, line 2, is damaged (Expecting ',' delimiter)")
  assert 'Repair or delete that line' in str(error.value)
  assert _snapshot(workdir) == before  # config.json not rewritten.


def test_rows_that_cannot_be_appended_wait_and_the_run_trains_to_its_checkpoint(
  small_run, tmp_path, monkeypatch
):
  _, corpus, data_dir = small_run
  workdir = tmp_path / 'run'
  full = {'on': True}

  def open_on_a_full_disk(path, mode='r', *args, **kwargs):
    if full['on'] and str(path).endswith('metrics.jsonl') and 'a' in mode:
      raise OSError(28, 'No space left on device', str(path))
    return open(path, mode, *args, **kwargs)

  monkeypatch.setattr(metrics, 'open', open_on_a_full_disk, raising=False)
  with pytest.raises(metrics.MetricsWriteError) as error:
    training.train_and_evaluate(_small_config(corpus, data_dir), str(workdir))
  message = str(error.value)
  assert message.startswith(f'3 rows could not be appended to {workdir}/metrics.jsonl (No space')
  assert 'The checkpoints are complete' in message
  kept = Path(message.split('they are kept in ')[1].split('. ')[0])
  assert [json.loads(line)['step'] for line in kept.read_text().splitlines()] == [1, 2, 2]
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == ['2']  # Trained, saved.
  # Rows wait in order and reach the file with the first append that works.
  writer = metrics.MetricsWriter(str(tmp_path / 'other'))  # Makes its folder (TensorBoard's).
  writer.write(1, {'train_loss': 3.0})
  writer.write(2, {'train_loss': 2.0})
  assert not (tmp_path / 'other' / 'metrics.jsonl').exists()
  full['on'] = False
  writer.write(3, {'train_loss': 1.0})
  writer.close()
  rows = metrics.read_rows(str(tmp_path / 'other' / 'metrics.jsonl'))
  assert [(r['step'], r['train_loss']) for r in rows] == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_damaged_results_and_trial_files_are_named(tmp_path):
  eval_dir = tmp_path / 'run' / 'eval'
  eval_dir.mkdir(parents=True)
  result = eval_dir / 'step_2-test.json'
  result.write_text('{"bleu": 3.1, "split": "te')  # Cut short.
  for argument in (str(result), str(tmp_path / 'run')):
    with pytest.raises(errors.InvalidInput) as error:
      significance.load_system(argument)
    assert str(error.value).startswith(f'{result} is damaged: not JSON (line 1: Unterminated')
    assert 'Score its checkpoint again with eval.py' in str(error.value)
  trial = tmp_path / 'trial'
  trial.mkdir()
  (trial / sweep_runner.STATE_FILE).write_bytes(b'\x00' * 16)  # A crash on a full disk.
  with pytest.raises(errors.InvalidInput, match=r'trial.json is damaged: not JSON .*delete it'):
    sweep_runner.trial_status(str(trial))


# --- Advice that fits the fields ---------------------------------------------------------------


def test_divergence_advice_names_the_fields_that_set_this_runs_rate():
  config = tiny.get_config()
  assert divergence.advice(optim.OptimizerConfig.from_config(config)).startswith(
    f'Lower config.lr_scale (now {config.lr_scale:g}) or lengthen config.warmup_steps'
  )
  config.peak_learning_rate, config.grad_clip_norm = 0.002, 1.0
  assert divergence.advice(optim.OptimizerConfig.from_config(config)) == (
    'Lower config.peak_learning_rate (now 0.002) or lengthen config.warmup_steps (now '
    f'{config.warmup_steps}), or lower config.grad_clip_norm (now 1)'
  )


def test_dry_run_refuses_what_train_py_refuses_on_this_host(capsys):
  config = tiny.get_config()
  config.model.attention_impl, config.dtype = 'cudnn', 'bfloat16'
  with pytest.raises(config_lib.ConfigError, match="attention_impl='cudnn' needs NVIDIA GPUs"):
    dry_run.run(config)  # This host's CPU devices, which train.py would use.
  dry_run.run(config, num_devices=8)  # Planned for other devices: a note, not a refusal.
  assert "Note: not on this host: config.model.attention_impl='cudnn'" in capsys.readouterr().out


@pytest.mark.parametrize(
  ('devices', 'mesh'),
  [
    (8, {}),  # docs/devices.md: one node with 8 GPUs, data parallel.
    (8, {'data': 1, 'fsdp': 4, 'tensor': 2}),
    (32, {'data': 4, 'fsdp': -1}),  # 4 nodes x 8 GPUs.
    (16, {'data': 1, 'fsdp': -1}),  # A TPU pod slice.
  ],
)
def test_the_documented_multi_device_commands_fit_the_big_config(devices, mesh):
  flags = ' '.join(f'--config.mesh.{key}={value}' for key, value in mesh.items())
  assert flags in (REPO / 'docs' / 'devices.md').read_text()  # The command as shipped.
  config = wmt14_ende_big.get_config()
  config.dtype = 'bfloat16'
  for key, value in mesh.items():
    config.mesh[key] = value
  config_lib.validate(config, devices)


def test_eval_help_shows_no_default_that_the_runs_config_overrides():
  result = _run('eval.py', '--helpfull')
  flags_help = result.stdout.split('eval.py:')[1].split('\n\n')[0]
  for flag in ('alpha', 'beam_size', 'checkpoint', 'decoder', 'max_extra_len'):
    text = flags_help.split(f'--{flag}:')[1].split('\n  --')[0]
    assert '(default: ' in text and "the run's" in text or flag == 'decoder', text
    assert not re.search(r"\(default: '[^']*'\)", text), text  # absl's own: a fixed value.


def test_eval_names_where_a_default_checkpoint_came_from(copied_run):
  workdir, _ = copied_run
  saved = json.loads((workdir / 'config.json').read_text())
  saved['decode']['checkpoint'], saved['keep_checkpoints'] = 'avg:10', 10
  (workdir / 'config.json').write_text(json.dumps(saved, indent=2, sort_keys=True))
  result = _run('eval.py', f'--workdir={workdir}', '--decoder=greedy', '--split=test')
  assert result.returncode == 1, result.stderr[-3000:]
  [message] = _last_lines(result, 1)
  assert "checkpoint='avg:10' needs 10 checkpoints, but there are only 1: [2]." in message
  assert "--checkpoint was not given, so 'avg:10' is the run's config.decode.checkpoint" in message
  assert f'(in {workdir}/config.json); pass --checkpoint=latest' in message


def _result(workdir, references, hypotheses):
  out = workdir / 'eval'
  out.mkdir(parents=True)
  (out / 'references-test.txt').write_text(''.join(r + '\n' for r in references))
  (out / 'step_10-test.txt').write_text(''.join(h + '\n' for h in hypotheses))
  scores = scoring.corpus_scores(hypotheses, references) | {'split': 'test'}
  (out / 'step_10-test.json').write_text(json.dumps(scores))
  return str(out / 'step_10-test.json')


def test_compare_warns_of_too_few_samples_and_compares_case_folded_output_lowercased(tmp_path):
  references = [de.capitalize() + '.' for _, de in synthetic_pairs(60, seed=5)]
  cased = _result(tmp_path / 'cased', references, [r[:-1] for r in references])
  folded = _result(tmp_path / 'folded', references, [r.lower() for r in references])
  result = _run('compare.py', cased, folded, '--n_samples=10')
  assert result.returncode == 0, result.stderr[-2000:]
  assert '--n_samples=10: the smallest p-value 10 samples can give is 1/11 = 0.091' in result.stderr
  assert 'Use at least 20' in result.stderr
  assert f'The translations of {folded} are all lowercase' in result.stdout
  assert 'comparing lowercased BLEU (bleu_lc) instead of cased BLEU' in result.stdout
  assert 'BLEU-lc' in result.stdout
  asked = _run('compare.py', cased, folded, '--metrics=bleu')  # Asked for: warned, kept.
  assert 'Add bleu_lc to --metrics to compare them' in asked.stderr
  assert 'BLEU-lc' not in asked.stdout


# --- The data position, carried over to another worker count -----------------------------------


def _chunks() -> grain.MapDataset:
  """Chunks of 2 or 3 rows (as packing makes them: about even), each row naming its chunk."""
  return grain.MapDataset.range(100_000).map(
    lambda c: {'chunk': np.full((2 + (c % 7 == 0), 2), c, np.int32)}
  )


def _batches(num_workers: int) -> grain.DatasetIterator:
  it = iter(input_pipeline.packed_batches(_chunks(), 4, num_workers, drop_remainder=True))
  return data_position.CarriedOver(it, num_workers)


def _chunks_of(it, batches: int) -> list[int]:
  return [int(c) for _ in range(batches) for c in next(it)['chunk'][:, 0]]


@pytest.mark.parametrize(('before', 'after'), [(2, 0), (0, 2), (2, 3), (3, 1)])
def test_a_data_position_carries_over_to_another_worker_count(before, after):
  it = _batches(before)
  seen = _chunks_of(it, 9)
  state = it.get_state()
  it.close()
  first = data_position.first_unfinished_chunk(state)
  assert all(c < first for c in set(range(first)) & set(seen))
  resumed = _batches(after)
  resumed.set_state(state)
  again = _chunks_of(resumed, 12)
  frontier = data_position.first_unfinished_chunk(resumed.get_state())
  resumed.close()
  # Every chunk before the first one not used whole was used, and is not read again; from
  # it on, chunks are read (again) in the new layout, so nothing is skipped: every chunk
  # before the new layout's own first unfinished one was used, before or after.
  assert set(range(first)) <= set(seen) and min(again) == first
  assert frontier > first and set(range(frontier)) <= set(seen) | set(again)
  assert len(set(seen) & set(again)) <= 2 * max(before, 1)  # At most a chunk or two a worker.
  fresh = _batches(after)  # The same layout started at that chunk reads the same chunks.
  fresh.set_state(data_position.layout(first, after))
  assert _chunks_of(fresh, 12) == again
  fresh.close()


def test_resume_with_another_worker_count_goes_on(small_run, copied_run, caplog):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  config = _small_config(corpus, data_dir, num_train_steps=4, **{'data.num_workers': 1})
  training.train_and_evaluate(config, str(workdir))
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir())[-1] == '4'
  assert 'recorded the data position of 0 worker processes' in caplog.text


# --- config.launch outside the Slurm launcher (issue 52) ----------------------------------------


@pytest.mark.parametrize(('nodes', 'tasks'), [(2, 1), (1, 2)])
def test_train_py_refuses_a_launch_shape_it_is_not(tmp_path, nodes, tasks):
  """config.launch.nodes=2 was ignored by a train.py run of one process."""
  config = tiny.get_config()
  config.launch.nodes, config.launch.tasks_per_node = nodes, tasks
  workdir = tmp_path / 'run'
  with pytest.raises(config_lib.ConfigError) as refusal:
    training.train_and_evaluate(config, str(workdir))
  assert (
    f'config.launch.nodes={nodes} x config.launch.tasks_per_node={tasks} asks for 2 processes, '
    'but this train.py is 1 process: config.launch takes effect only with sweep.py '
    '--launcher=slurm'
  ) in str(refusal.value)
  assert isinstance(refusal.value, errors.Refusal)
  assert not workdir.exists()
  # A train.py started as one of that many processes (srun, by the Slurm launcher) accepts it.
  assert config_lib.launch_errors(config, 2) == []
  assert config_lib.launch_errors(tiny.get_config(), 4) == []  # 1 x 1: the launcher's default.


# --- Misuse, round four (issue 52): one message, before anything changes -----------------------


def _one_error(result) -> str:
  """The one error line of a refused command; there is no traceback."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if 'error:' in line]
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('entry', ['tensorboard', 'checkpoints', 'metrics.jsonl'])
def test_a_run_entry_of_the_wrong_kind_is_refused_before_anything_changes(
  small_run, copied_run, entry
):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  path = workdir / entry
  if path.is_dir():
    shutil.rmtree(path)
    path.write_text('notes of mine\n')  # A file where the run writes a folder.
    expected = f'{path} is a file, but train.py writes'
  else:
    path.unlink()
    path.mkdir()  # A folder where the run appends to a file.
    expected = f'{path} is a directory, but train.py appends its metrics'
  before = _snapshot(workdir)
  with pytest.raises(errors.InvalidInput, match=re.escape(expected)):
    training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=4), str(workdir))
  assert _snapshot(workdir) == before  # config.json not rewritten, no event file, no lock.


def test_a_run_entry_that_is_not_writable_is_refused(small_run, copied_run, monkeypatch):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  tensorboard = str(workdir / 'tensorboard')
  access = os.access  # As root every file is writable: this one is not, by os.access.
  monkeypatch.setattr(os, 'access', lambda p, mode: p != tensorboard and access(p, mode))
  config = _small_config(corpus, data_dir, num_train_steps=4)
  assert path_checks.workdir_errors(config, str(workdir)) == [
    f'--workdir={workdir}: {tensorboard} is not writable, and train.py writes its TensorBoard '
    f'event files there. Make it writable (chmod u+wx {tensorboard}), or name another --workdir.'
  ]


@pytest.mark.parametrize('case', ['missing', 'directory', 'not_json', 'no_type', 'unreadable'])
def test_bad_google_credentials_are_named_before_any_request(tmp_path, monkeypatch, case):
  key = tmp_path / 'key.json'
  if case == 'directory':
    key.mkdir()
  elif case == 'not_json':
    key.write_bytes(b'\x89PNG not a key')
  elif case in ('no_type', 'unreadable'):
    key.write_text('{"project_id": "p"}')
  if case == 'unreadable':  # Root reads any file: the refusal of its open, as a user gets it.
    real_open = open

    def refused(path, *args, **kwargs):
      if str(path) == str(key):
        raise PermissionError(13, 'Permission denied', str(path))
      return real_open(path, *args, **kwargs)

    monkeypatch.setattr(google_credentials, 'open', refused, raising=False)
  monkeypatch.setenv(google_credentials.CREDENTIALS_ENV, str(key))
  problem = {
    'missing': 'names a file that does not exist',
    'directory': 'names a directory, not a credentials file',
    'not_json': 'names a file that is not JSON (not a credentials file)',
    'no_type': 'names a JSON file without a "type" (not a credentials file)',
    'unreadable': 'names a file that cannot be read (permission denied)',
  }[case]
  [error] = storage.path_errors('gs://a-bucket/run', '--workdir')
  assert error.startswith(
    f'{google_credentials.CREDENTIALS_ENV}={key} {problem}, and --workdir=gs://a-bucket/run '
    'is reached'
  )
  assert storage.path_errors('s3://a-bucket/run', '--workdir') == []  # AWS's own chain.
  assert storage.path_errors(str(tmp_path), '--workdir') == []


def test_train_py_with_bad_google_credentials_ends_with_one_message(tmp_path):
  key = tmp_path / 'missing.json'
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/tiny.py', '--workdir=gs://a-bucket/run'],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', google_credentials.CREDENTIALS_ENV: str(key)},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert _one_error(result) == 'train.py: error: Invalid paths:'
  assert _last_lines(result, 1) == [
    f'  {google_credentials.CREDENTIALS_ENV}={key} names a file that does not exist, and '
    '--workdir=gs://a-bucket/run is reached with the credentials it names. Point '
    f'{google_credentials.CREDENTIALS_ENV} at a service-account key file (JSON), or unset it '
    'to use those of gcloud auth application-default login.'
  ]
  assert 'storage.googleapis.com' not in result.stderr  # No request was tried.


def test_lr_scale_set_over_a_peak_learning_rate_is_refused_naming_both(tmp_path):
  literature = multi30k_literature.get_config()  # A peak, and recipe_study's lr_scale: fine.
  assert literature.peak_learning_rate == 0.005 and literature.lr_scale == 1.6
  assert config_lib.ignored_override_errors(literature, {'warmup_steps'}) == []
  [error] = config_lib.ignored_override_errors(literature, {'lr_scale'})
  assert error.startswith(
    'config.lr_scale=1.6 would be ignored: config.peak_learning_rate=0.005 sets the peak'
  )
  assert config_lib.ignored_override_errors(tiny.get_config(), {'lr_scale'}) == []  # No peak.
  # A sweep's trial that sets lr_scale where a peak is in force, before any trial runs.
  with pytest.raises(errors.InvalidInput, match=r"trial 1 \{'lr_scale': 2.0\} gives an inv"):
    sweeps.make_trials(literature, [{'warmup_steps': 10}, {'lr_scale': 2.0}])
  # The shipped sweeps that set a peak (on recipe_study's lr_scale) still make their trials.
  recipe_hour = sweeps.load_overrides(str(REPO / 'configs' / 'sweeps' / 'recipe_hour.py'))
  assert sweeps.make_trials(recipe_study.get_config(), recipe_hour)
  result = _run(
    'train.py', '--config=configs/multi30k_literature.py', '--dry_run', '--config.lr_scale=2'
  )
  _one_error(result)
  assert _last_lines(result, 1)[0].startswith('  config.lr_scale=2 would be ignored: config.peak')


def test_more_steps_for_a_run_that_stopped_early_is_refused_naming_the_patience(
  small_run, copied_run
):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  _as_if_trained_with(workdir, early_stopping_patience=1, eval_bleu_sentences=2)
  with open(workdir / 'metrics.jsonl', 'a') as f:  # BLEU fell at step 2: stopped (patience 1).
    f.write('{"step": 1, "eval_bleu": 5.0}\n{"step": 2, "eval_bleu": 4.0}\n')
  before = _snapshot(workdir)
  fields = {'early_stopping_patience': 1, 'eval_bleu_sentences': 2}
  with pytest.raises(errors.InvalidInput) as error:
    training.train_and_evaluate(
      _small_config(corpus, data_dir, num_train_steps=4, **fields), str(workdir)
    )
  message = str(error.value)
  assert message.startswith(
    f'config.num_train_steps=4 (was 2) would train nothing: the run in {workdir} stopped early '
    'at step 2, its validation BLEU (eval_bleu) not improved on 5.00 (step 1) for 1 evaluations'
  )
  assert 'config.early_stopping_patience=1 keeps it stopped. Nothing was changed.' in message
  assert '(--config.early_stopping_patience=2), or set it to 0' in message
  assert _snapshot(workdir) == before
  # The same command again goes on as before; a larger patience lets it train on.
  runs.check_resume(_small_config(corpus, data_dir, num_train_steps=2, **fields), str(workdir))
  fields['early_stopping_patience'] = 2
  runs.check_resume(_small_config(corpus, data_dir, num_train_steps=4, **fields), str(workdir))


def test_a_signal_inside_a_gc_callback_stops_the_start_with_nothing_printed():
  script = """
import gc, os, signal, sys, time
from transformer import preemption
fired = [1]  # Until the watcher is installed.
def callback(phase, info):  # As JAX's _xla_gc_callback: the signal lands inside it.
  if phase == 'start' and not fired:
    fired.append(1)
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(10000):
      pass
gc.callbacks.append(callback)
with preemption.PreemptionWatcher():
  try:
    fired.clear()
    gc.collect()
    time.sleep(20)
  except preemption.Interrupted as e:
    print('stopped:', e.signal_name)
"""
  result = _run('-c', script, timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout == 'stopped: SIGTERM\n'
  assert result.stderr == ''  # No "Exception ignored in: <function callback ...>".


# Commands given bad flags, values or paths that ended with a Python traceback (issue 52): each now
# ends with one message. {tmp}: the test's folder; {run}: a folder holding a run's config.json.
_TRACEBACK_CASES = {
  'train_config_missing': (
    ['train.py', '--config=configs/nope.py', '--workdir={tmp}/w'],
    '--config=configs/nope.py: configs/nope.py does not exist',
  ),
  'train_config_a_directory': (
    ['train.py', '--config=configs', '--workdir={tmp}/w'],
    '--config=configs: configs is a directory',
  ),
  'train_config_not_python': (
    ['train.py', '--config=README.md', '--workdir={tmp}/w'],
    '--config=README.md is not a Python config file',
  ),
  'bench_config_missing': (
    ['bench/train_throughput.py', '--config=configs/nope.py'],
    '--config=configs/nope.py: configs/nope.py does not exist',
  ),
  'eval_input_file_missing': (
    ['eval.py', '--workdir={run}', '--input_file={tmp}/nope.txt'],
    '--input_file={tmp}/nope.txt: no such file',
  ),
  'eval_input_file_a_directory': (
    ['eval.py', '--workdir={run}', '--input_file={tmp}'],
    '--input_file={tmp} is a directory',
  ),
  'sweep_file_not_python': (
    ['sweep.py', '--config=configs/tiny.py', '--sweep=README.md', '--workdir={tmp}/sweep'],
    'README.md is not a Python sweep file',
  ),
  'peer_model_missing': (
    ['bench/peer_flax_wmt.py', '--flax_wmt_dir={tmp}/flax'],
    '--flax_wmt_dir={tmp}/flax has no models.py',
  ),
  'accelerator_check_no_configs': (
    ['bench/accelerator_check.py', '--configs=', '--smoke', '--root={tmp}/root'],
    "--configs is empty: name one or more of ['base', 'big']",
  ),
  'offline_download': (
    ['train.py', '--config=configs/tiny.py', '--workdir={tmp}/w', '--config.data.data_dir={tmp}/d'],
    'Cannot download multi30k:',
  ),
}


@pytest.mark.parametrize('case', sorted(_TRACEBACK_CASES))
def test_bad_flags_and_paths_end_with_one_message_and_no_traceback(tmp_path, case):
  run = tmp_path / 'run'
  run.mkdir()
  shutil.copy(REPO / 'results' / 'recipe' / 'best' / 'seed=0' / 'config.json', run)
  command, expected = _TRACEBACK_CASES[case]
  command = [arg.format(tmp=tmp_path, run=run) for arg in command]
  with socket.socket() as s:  # A proxy nothing listens on: every download is refused at once.
    s.bind(('127.0.0.1', 0))
    proxy = f'http://127.0.0.1:{s.getsockname()[1]}'
  env = {'JAX_PLATFORMS': 'cpu', 'no_proxy': '', 'NO_PROXY': ''}
  env |= {name: proxy for name in ('http_proxy', 'https_proxy', 'HTTP_PROXY', 'HTTPS_PROXY')}
  result = subprocess.run(
    [sys.executable, *command],
    cwd=REPO,
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert expected.format(tmp=tmp_path) in _one_error(result)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['run']  # Nothing made.
