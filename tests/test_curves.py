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


def test_levels_are_dashed_lines_across_the_figure(tmp_path):
  fig = curves.plot(
    [('run', [(60.0, 39.0), (120.0, 40.0)])],
    'wall_seconds',
    'bleu_lc',
    str(tmp_path / 'levels.png'),
    hlines=[('Wu et al. (2021)', 41.02), ('aim', 39.5)],
  )
  [ax] = fig.axes
  run, published, aim = ax.get_lines()
  assert run.get_label() == 'run'
  assert list(run.get_xdata()) == [1.0, 2.0]  # Minutes.
  assert (published.get_label(), list(published.get_ydata())) == ('Wu et al. (2021)', [41.02] * 2)
  assert (aim.get_label(), list(aim.get_ydata())) == ('aim', [39.5] * 2)
  assert (published.get_linestyle(), aim.get_linestyle()) == ('--', ':')
  assert ax.get_ylim()[1] > 41.02  # A level above every point is still in view.
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ['run', 'Wu et al. (2021)', 'aim']


@pytest.mark.parametrize('x, drawn_at', [('wall_seconds', 1.5), ('step', 90.0)])
def test_a_budget_is_a_dashed_line_up_the_figure_in_the_drawn_unit(tmp_path, x, drawn_at):
  fig = curves.plot(
    [('run', [(60.0, 39.0), (120.0, 40.0)])],
    x,
    'bleu_lc',
    str(tmp_path / 'budget.png'),
    hlines=[('published', 41.02)],
    vlines=[('the hour', drawn_at)],
  )
  [ax] = fig.axes
  run, published, budget = ax.get_lines()
  assert (budget.get_label(), list(budget.get_xdata())) == ('the hour', [drawn_at] * 2)
  assert list(published.get_ydata()) == [41.02] * 2
  assert budget.get_linestyle() == '--'
  low, high = ax.get_xlim()
  assert low < drawn_at < high  # In view, between or beyond the points.
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ['run', 'published', 'the hour']


@pytest.mark.parametrize(
  'spec, parsed',
  [('Wu et al. (2021)=41.02', ('Wu et al. (2021)', 41.02)), ('a=b=-3', ('a=b', -3.0))],
)
def test_a_level_is_label_and_number(spec, parsed):
  assert curves.parse_hline(spec) == parsed


@pytest.mark.parametrize('spec', ['41.02', '=41', 'target=', 'target=high', 'target=nan', 'x=inf'])
def test_a_level_without_label_or_finite_number_is_named(spec):
  with pytest.raises(ValueError, match=r'--hline=.*: expected LABEL=VALUE with VALUE a finite'):
    curves.parse_hline(spec)


def test_a_budget_is_label_and_number_not_below_zero():
  assert curves.parse_vline('the hour=60') == ('the hour', 60.0)
  assert curves.parse_vline('start=0') == ('start', 0.0)
  assert curves.parse_hline('below=-1') == ('below', -1.0)  # A level may be negative.
  for spec in ['60', 'the hour=', 'the hour=soon', 'x=inf', 'before=-1']:
    with pytest.raises(
      ValueError, match=r'--vline=.*: expected LABEL=VALUE with VALUE a finite number >= 0'
    ):
      curves.parse_vline(spec)


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
  with pytest.raises(ValueError, match=r'metrics.jsonl, line 2, is damaged'):
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
  for flags, named_last in [
    ([f'--run=old={old}'], "rows have no 'wall_seconds'"),
    (['--hline=published=41.0', '--hline=aim=high'], "--hline='aim=high'"),
    (['--vline=the hour=-60'], "--vline='the hour=-60'"),
  ]:
    result = subprocess.run(
      [*command, f'--run=new={good}', *flags, f'--output={bad}'],
      cwd=ROOT,
      capture_output=True,
      text=True,
    )
    assert result.returncode != 0, flags
    assert named_last in result.stderr.strip().splitlines()[-1]
    assert not bad.exists()


def _result(workdir: Path, stem: str, **result) -> Path:
  (workdir / 'eval').mkdir(exist_ok=True)
  path = workdir / 'eval' / f'{stem}.json'
  path.write_text(json.dumps(result))
  return path


def _scored_run(path: Path) -> Path:
  """A run with eval.py results: two budgets and scorings, another split, a best, a renamed one."""
  workdir = Path(
    _run(
      path,
      [
        {'step': 2800, 'train_loss': 2.0, 'wall_seconds': 100.0},
        {'step': 2800, 'eval_bleu': 30.0, 'wall_seconds': 110.0},
        {'step': 3600, 'train_loss': 1.9, 'wall_seconds': 200.0},
      ],
    )
  )
  beam = {'split': 'validation', 'bleu': 39.0}
  _result(
    workdir,
    'avg10_1900-2800-validation-beam5_alpha1',
    checkpoint='avg10_1900-2800',
    bleu_lc=40.0,
    **beam,
  )
  _result(
    workdir,
    'avg10_2700-3600-validation-beam5_alpha1',
    checkpoint='avg10_2700-3600',
    bleu_lc=41.0,
    **beam,
  )
  _result(workdir, 'step_3600-validation-greedy', checkpoint='step_3600', bleu_lc=38.0, **beam)
  _result(
    workdir,
    'avg10_1900-2800-test_2016_flickr-beam5_alpha1',
    checkpoint='avg10_1900-2800',
    split='test_2016_flickr',
    bleu_lc=39.5,
  )
  _result(workdir, 'best_step_3000-validation', checkpoint='best_step_3000', bleu_lc=40.5, **beam)
  # Renamed by hand: its decoding cannot be read from its name.
  _result(workdir, 'final-validation', checkpoint='step_3600', bleu_lc=37.0, **beam)
  (workdir / 'eval' / 'references-validation.txt').write_text('ein Hund\n')
  return workdir


def test_eval_results_are_drawn_at_their_checkpoints_last_step(tmp_path):
  workdir = _scored_run(tmp_path / 'run')
  lines, left_out = curves.read_eval_curves(str(workdir), 'validation', 'wall_seconds', 'bleu_lc')
  # The wall time at a step is its last row's: the evaluation at step 2800 included.
  assert lines == {
    'avg10 beam5_alpha1': [(110.0, 40.0), (200.0, 41.0)],
    'step greedy': [(200.0, 38.0)],
  }
  assert left_out == [
    (
      str(workdir / 'eval' / 'best_step_3000-validation.json'),
      "its checkpoint 'best_step_3000' is not a step budget",
    ),
    (
      str(workdir / 'eval' / 'final-validation.json'),
      "its name is not eval.py's step_3600-validation[-<decoding>].json",
    ),
  ]
  lines, _ = curves.read_eval_curves(str(workdir), 'test_2016_flickr', 'step', 'bleu_lc')
  assert lines == {'avg10 beam5_alpha1': [(2800.0, 39.5)]}


@pytest.mark.parametrize(
  'split, x, y, message',
  [
    ('validation', 'step', 'ter', r"no score 'ter' \(it has bleu, bleu_lc, checkpoint, split\)"),
    ('test', 'step', 'bleu_lc', "no eval.py result of split 'test' at a step budget"),
  ],
)
def test_eval_results_without_the_score_or_split_are_named(tmp_path, split, x, y, message):
  workdir = _scored_run(tmp_path / 'run')
  with pytest.raises(ValueError, match=message):
    curves.read_eval_curves(str(workdir), split, x, y)


def test_an_eval_result_past_the_runs_wall_times_is_named(tmp_path):
  workdir = _scored_run(tmp_path / 'run')
  _result(workdir, 'step_4400-validation', checkpoint='step_4400', split='validation', bleu_lc=1.0)
  with pytest.raises(ValueError, match="has no 'wall_seconds' at step 4400"):
    curves.read_eval_curves(str(workdir), 'validation', 'wall_seconds', 'bleu_lc')
  lines, _ = curves.read_eval_curves(str(workdir), 'validation', 'step', 'bleu_lc')
  assert lines['step'] == [(4400.0, 1.0)]


def test_command_line_draws_eval_results_and_says_what_it_left_out(tmp_path):
  workdir = _scored_run(tmp_path / 'run')
  out = tmp_path / 'scores.png'
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'transformer.tools.curves',
      f'--run=paper={workdir}',
      '--eval_split=validation',
      '--y=bleu_lc',
      '--x=wall_seconds',
      f'--output={out}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert result.returncode == 0, result.stderr
  assert out.stat().st_size > 0
  left_out = [line for line in result.stdout.splitlines() if line.startswith('Left out')]
  assert len(left_out) == 2
  assert 'best_step_3000-validation.json' in left_out[0] and 'not a step budget' in left_out[0]
  assert 'final-validation.json' in left_out[1] and 'its name is not' in left_out[1]


@pytest.mark.parametrize(
  ('output', 'starts'), [('fig.svg', b'<?xml'), ('fig.pdf', b'%PDF'), ('fig.PNG', b'\x89PNG')]
)
def test_the_output_is_written_in_the_format_its_extension_names(tmp_path, output, starts):
  out = tmp_path / output
  curves.plot([('run', [(60.0, 39.0), (120.0, 40.0)])], 'step', 'bleu', str(out))
  assert out.read_bytes().startswith(starts)


@pytest.mark.parametrize('case', ['txt_output', 'one_label_twice', 'a_level_named_as_a_run'])
def test_an_output_matplotlib_cannot_write_and_a_label_given_twice_are_refused(tmp_path, case):
  a = _run(tmp_path / 'a', [{'step': 50, 'eval_bleu': 10.0}])
  b = _run(tmp_path / 'b', [{'step': 50, 'eval_bleu': 12.0}])
  out = tmp_path / ('x.txt' if case == 'txt_output' else 'x.png')
  flags, message = {
    'txt_output': ([f'--run=a={a}', f'--run=b={b}'], f'--output={out}: matplotlib writes no .txt'),
    'one_label_twice': (
      [f'--run=base={a}', f'--run=base={b}'],
      f"The label 'base' is given 2 times (--run=base={a}, --run=base={b})",
    ),
    'a_level_named_as_a_run': (
      [f'--run=a={a}', '--hline=a=11'],
      f"The label 'a' is given 2 times (--run=a={a}, --hline=a=11)",
    ),
  }[case]
  result = subprocess.run(
    [sys.executable, '-m', 'transformer.tools.curves', *flags, f'--output={out}'],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
  assert 'Wrote' not in result.stdout and not out.exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a', 'b']
