"""Misuse, round three: the newer tools and fields as safe as train.py (issue 45).

Outputs checked before the work and kept when the disk fills; a resume that changes what the
checkpoint's optimizer state, data position or schedule depend on is refused, naming the field.
The run misused is test_reliability's small one (2 steps, a checkpoint at step 2).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reliability import _last_lines, _small_config, _snapshot, copied_run, small_run

from transformer import errors, metrics, outputs, path_checks, runs, training
from transformer.tools import significance, sweep_runner

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
    (
      {'data.num_workers': 1},
      [
        'hold a data position that another number of worker processes cannot take up',
        'config.data.num_workers: 0 -> 1',
      ],
    ),
  ],
)
def test_resume_that_changes_the_optimizer_or_data_layout_is_refused(
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
