"""transformer/tools/curves.py: runs' metrics against steps or wall time, in one figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import image

from transformer.tools import curves

ROOT = Path(__file__).resolve().parents[1]


def _run(path: Path, rows: list[dict]) -> str:
  path.mkdir(parents=True)
  (path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


def test_reads_the_rows_with_the_metric_and_draws_one_line_per_run(tmp_path):
  a = _run(
    tmp_path / 'a',
    [
      {'step': 25, 'train_loss': 4.0, 'wall_seconds': 30.0},
      {'step': 50, 'eval_bleu': 10.0, 'wall_seconds': 75.5},
      {'step': 100, 'eval_bleu': 20.0, 'wall_seconds': 130.0},
    ],
  )
  b = _run(tmp_path / 'b', [{'step': 50, 'eval_bleu': 12.0, 'wall_seconds': 90.0}])
  assert curves.read_curve(a, 'wall_seconds', 'eval_bleu') == [(75.5, 10.0), (130.0, 20.0)]
  assert curves.read_curve(a, 'step', 'train_loss') == [(25.0, 4.0)]
  out = tmp_path / 'curves.png'
  curves.plot(
    [('a', curves.read_curve(a, 'wall_seconds', 'eval_bleu')), ('b', [(90.0, 12.0)])],
    'wall_seconds',
    'eval_bleu',
    str(out),
  )
  height, width, _ = image.imread(out).shape
  assert (width, height) == (576, 378)  # 6.4 x 4.2 inches at 90 dpi.
  assert curves.read_curve(b, 'step', 'eval_bleu') == [(50.0, 12.0)]


@pytest.mark.parametrize(
  'rows, x, message',
  [
    (None, 'step', 'metrics.jsonl: no such file'),
    ([{'step': 1, 'train_loss': 3.0}], 'step', "no row has 'eval_bleu'"),
    ([{'step': 1, 'eval_bleu': 3.0}], 'wall_seconds', "rows have no 'wall_seconds'"),
  ],
)
def test_a_run_without_the_keys_is_named(tmp_path, rows, x, message):
  workdir = _run(tmp_path / 'run', rows) if rows is not None else str(tmp_path / 'none')
  with pytest.raises(ValueError, match=message):
    curves.read_curve(workdir, x, 'eval_bleu')


def test_a_broken_line_is_named_by_its_number(tmp_path):
  workdir = _run(tmp_path / 'run', [{'step': 1, 'eval_bleu': 3.0}])
  with open(Path(workdir) / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 2, "eval_bl\n')
  with pytest.raises(ValueError, match=r'metrics.jsonl, line 2: not JSON'):
    curves.read_curve(workdir, 'step', 'eval_bleu')


def test_command_line_writes_the_figure_and_names_a_bad_run_last(tmp_path):
  good = _run(tmp_path / 'good', [{'step': 50, 'eval_bleu': 10.0, 'wall_seconds': 60.0}])
  old = _run(tmp_path / 'old', [{'step': 50, 'eval_bleu': 11.0}])
  command = [sys.executable, '-m', 'transformer.tools.curves', '--x=wall_seconds']
  out = tmp_path / 'fig.png'
  result = subprocess.run(
    [*command, f'--run=new={good}', f'--output={out}'], cwd=ROOT, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr
  assert out.stat().st_size > 0
  bad = tmp_path / 'bad.png'
  result = subprocess.run(
    [*command, f'--run=new={good}', f'--run=old={old}', f'--output={bad}'],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert result.returncode != 0
  assert "rows have no 'wall_seconds'" in result.stderr.strip().splitlines()[-1]
  assert not bad.exists()
