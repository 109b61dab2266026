"""Curves of several runs in one figure: a metric of metrics.jsonl against steps or wall time.

  python -m transformer.tools.curves --run=pre-LN=workdirs/a --run=post-LN=workdirs/b \
      --x=wall_seconds --y=eval_bleu --output=curves.png

Each --run is LABEL=WORKDIR (a directory written by train.py). --x is `step` or
`wall_seconds` (drawn in minutes: the run's wall-clock time, compile and evaluations
included, that train.py writes into every row); --y is any key of the rows, e.g.
`eval_bleu` (greedy validation BLEU during training), `eval_loss` or `train_loss`.

With --eval_split=SPLIT the points are eval.py's results of that split instead
(WORKDIR/eval/<checkpoint>-SPLIT[-<decoding>].json), each at the last step of its
checkpoint (`step_2800`, or `avg10_1900-2800` from `--checkpoint=avg:10@2800`: under the
inverse square root, the score of a 2,800-step run), and --y names a score of them
(`bleu`, `bleu_lc`, `chrf`); its wall time is the run's at that step. One line per run and
way of scoring (checkpoints averaged, decoding); results of 'best' checkpoints are not at a
step budget and are left out, saying so.
--hline=LABEL=VALUE draws a level across the figure as a dashed line, e.g. a published score
(`--hline='Wu et al. (2021)=41.02'`); --vline=LABEL=VALUE a dashed line up it at VALUE on the
drawn horizontal axis (minutes for wall_seconds, else steps), e.g. a budget
(`--vline='the hour=60'`).
--output names the figure's file and, by its extension, its format (.png, .svg, .pdf, any
that matplotlib writes; none: a PNG); another extension (.txt) is refused.
A run without the keys, or two lines given one label, is an error that names them, before
anything is drawn.
"""

from __future__ import annotations

import glob
import io
import itertools
import json
import math
import os
from collections.abc import Sequence

from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer import checkpoint_spec, errors, metrics, outputs, path_checks, storage
from transformer.errors import InvalidInput

X_KEYS = ('step', metrics.WALL_SECONDS)
_LINE_STYLES = ('--', ':', '-.')  # Of the --hline and --vline lines, in turn.

_RUN = flags.DEFINE_multi_string('run', [], 'LABEL=WORKDIR of a train.py run (repeatable).')
_X = flags.DEFINE_enum('x', 'step', list(X_KEYS), 'Horizontal axis: steps or wall-clock time.')
_Y = flags.DEFINE_string('y', 'eval_bleu', 'Row key drawn: eval_bleu, eval_loss, train_loss, ...')
_OUTPUT = flags.DEFINE_string(
  'output', None, 'The figure written, in the format its extension names (.png, .svg, .pdf, ...).'
)
_TITLE = flags.DEFINE_string('title', '', 'Figure title.')
_HLINE = flags.DEFINE_multi_string(
  'hline', [], 'LABEL=VALUE: a level drawn as a dashed horizontal line, e.g. a published score.'
)
_VLINE = flags.DEFINE_multi_string(
  'vline',
  [],
  'LABEL=VALUE: a dashed vertical line at VALUE >= 0 on the drawn axis (minutes for '
  'wall_seconds, else steps), e.g. a time budget.',
)
_EVAL_SPLIT = flags.DEFINE_string(
  'eval_split',
  None,
  "Draw eval.py's results of this split (WORKDIR/eval/*-SPLIT*.json) at their checkpoints' "
  'last steps instead of metrics.jsonl rows; --y then names a score of them (bleu, bleu_lc, chrf).',
)


def parse_run(spec: str) -> tuple[str, str]:
  """(label, workdir) of 'LABEL=WORKDIR'."""
  label, sep, workdir = spec.partition('=')
  if not sep or not label or not workdir:
    raise InvalidInput(f'--run={spec!r}: expected LABEL=WORKDIR.')
  return label, workdir


def parse_hline(spec: str) -> tuple[str, float]:
  """(label, value) of 'LABEL=VALUE'; the label may hold '=', the value is a finite number."""
  return _parse_line(spec, '--hline', minimum=-math.inf)


def parse_vline(spec: str) -> tuple[str, float]:
  """(label, value) of 'LABEL=VALUE' with VALUE a finite number >= 0 (minutes or steps)."""
  return _parse_line(spec, '--vline', minimum=0.0)


def _parse_line(spec: str, flag: str, minimum: float) -> tuple[str, float]:
  label, sep, value = spec.rpartition('=')
  domain = 'a finite number' + (f' >= {minimum:g}' if math.isfinite(minimum) else '')
  try:
    at = float(value)
  except ValueError:
    at = math.nan
  if not sep or not label or not math.isfinite(at) or at < minimum:
    raise InvalidInput(f'{flag}={spec!r}: expected LABEL=VALUE with VALUE {domain}.')
  return label, at


def read_curve(workdir: str, x: str, y: str) -> list[tuple[float, float]]:
  """(x, y) of every row of WORKDIR/metrics.jsonl that has `y`, in file order."""
  path = storage.join(workdir, metrics.FILENAME)
  if not storage.isfile(path):
    raise InvalidInput(f'{path}: no such file (is {workdir} a directory written by train.py?).')
  points, with_y = [], 0
  for row in metrics.read_rows(path):
    if y not in row:
      continue
    with_y += 1
    if x in row:
      points.append((float(row[x]), float(row[y])))
  if not with_y:
    raise InvalidInput(f'{path}: no row has {y!r}.')
  if not points:
    raise InvalidInput(
      f'{path}: its {y!r} rows have no {x!r} (runs trained before train.py wrote '
      f'{metrics.WALL_SECONDS!r} have none; use --x=step).'
    )
  return points


def read_eval_curves(
  workdir: str, split: str, x: str, y: str
) -> tuple[dict[str, list[tuple[float, float]]], list[tuple[str, str]]]:
  """eval.py's results of `split` in WORKDIR/eval: ({scoring: [(x, y)]}, [(path, why)] left out).

  `scoring` names how a line's results were made: the checkpoints averaged ('step' or
  'avgN') and the decoding tag of the file name ('' for the paper's beam 4, alpha 0.6).
  A result of 'best' checkpoints names no step budget (`checkpoint_spec.step_budget`), and one
  whose file name is not eval.py's `<checkpoint>-<split>[-<decoding>]` has no decoding
  to read from it: both are returned as left out, with the reason.
  """
  if storage.is_url(workdir):
    paths = storage.glob(storage.join(workdir, 'eval'), '*.json')
  else:
    paths = sorted(glob.glob(os.path.join(glob.escape(os.path.join(workdir, 'eval')), '*.json')))
  wall = {}
  if x == metrics.WALL_SECONDS:
    metrics_path = storage.join(workdir, metrics.FILENAME)
    if not storage.isfile(metrics_path):
      raise InvalidInput(f'{metrics_path}: no such file, so no wall time (use --x=step).')
    for row in metrics.read_rows(metrics_path):
      if 'step' in row and x in row:
        wall[int(row['step'])] = max(float(row[x]), wall.get(int(row['step']), 0.0))
  lines, left_out = {}, []
  for path in paths:
    try:
      result = json.loads(storage.read_text(path))
    except json.JSONDecodeError as e:
      raise InvalidInput(f'{path}: not JSON ({e.msg}).') from None
    if not isinstance(result, dict) or result.get('split') != split:
      continue
    label = str(result.get('checkpoint', ''))
    stem = storage.basename(path)[: -len('.json')]
    prefix = f'{label}-{split}'
    if stem != prefix and not stem.startswith(prefix + '-'):
      left_out.append((path, f"its name is not eval.py's {prefix}[-<decoding>].json"))
      continue
    if (budget := checkpoint_spec.step_budget(label)) is None:
      left_out.append((path, f'its checkpoint {label!r} is not a step budget'))
      continue
    if y not in result:
      raise InvalidInput(f'{path}: no score {y!r} (it has {", ".join(sorted(result))}).')
    step, averaged = budget
    if x == metrics.WALL_SECONDS and step not in wall:
      raise InvalidInput(
        f'{path}: {metrics.FILENAME} of {workdir} has no {x!r} at step {step}, the last '
        'step of its checkpoint (use --x=step).'
      )
    averaging = 'step' if averaged == 1 else f'avg{averaged}'
    scoring = ' '.join(filter(None, [averaging, stem[len(prefix) :].lstrip('-')]))
    at = wall[step] if x == metrics.WALL_SECONDS else float(step)
    lines.setdefault(scoring, []).append((at, float(result[y])))
  if not lines:
    raise InvalidInput(
      f'{workdir}/eval: no eval.py result of split {split!r} at a step budget '
      '(eval.py --checkpoint=STEP, avg:N or avg:N@STEP writes them).'
    )
  return {scoring: sorted(points) for scoring, points in sorted(lines.items())}, left_out


def output_format(path: str) -> str:
  """The format `path` names by its extension ('png' for none); an error if matplotlib has none.

  `--output=curves.svg` is an SVG, `curves.pdf` a PDF, `figure` (no extension) a PNG; an
  extension matplotlib cannot write (`x.txt`) is refused before anything is read or drawn.
  """
  extension = os.path.splitext(storage.basename(path))[1].lstrip('.').lower()
  if not extension:
    return 'png'
  formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
  if extension not in formats:
    raise InvalidInput(
      f'--output={path}: matplotlib writes no .{extension} figure. Name a file of one of its '
      f'formats ({", ".join("." + f for f in sorted(formats))}), e.g. a .png, or one '
      'without an extension for a PNG.'
    )
  return extension


def duplicate_label_errors(flagged: Sequence[tuple[str, str]]) -> list[str]:
  """Labels given twice among (flag, label) (--run, --hline, --vline): one legend entry each."""
  seen: dict[str, list[str]] = {}
  for flag, label in flagged:
    seen.setdefault(label, []).append(flag)
  return [
    f'The label {label!r} is given {len(flags_)} times ({", ".join(flags_)}): the legend could '
    'not tell the lines apart. Give each its own label.'
    for label, flags_ in seen.items()
    if len(flags_) > 1
  ]


def plot(
  curves: Sequence[tuple[str, list[tuple[float, float]]]],
  x: str,
  y: str,
  path: str,
  title: str = '',
  hlines: Sequence[tuple[str, float]] = (),
  vlines: Sequence[tuple[str, float]] = (),
) -> Figure:
  """One line with markers per (label, points), a dashed one per (label, level); returns it.

  Wall seconds are drawn in minutes; `vlines` are at positions in the drawn unit (minutes
  or steps).
  """
  fig = Figure(figsize=(6.4, 4.2), layout='constrained')
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  scale = 60.0 if x == metrics.WALL_SECONDS else 1.0
  for label, points in curves:
    xs, ys = zip(*points, strict=True)
    ax.plot([v / scale for v in xs], ys, marker='o', markersize=3, label=label)
  for (label, level), style in zip(hlines, itertools.cycle(_LINE_STYLES), strict=False):
    ax.axhline(level, color='0.3', linestyle=style, linewidth=1, label=label)
  for (label, at), style in zip(vlines, itertools.cycle(_LINE_STYLES), strict=False):
    ax.axvline(at, color='0.6', linestyle=style, linewidth=1, label=label)
  ax.set_xlabel('wall-clock minutes' if x == metrics.WALL_SECONDS else 'step')
  ax.set_ylabel(y)
  ax.grid(alpha=0.3)
  ax.legend(fontsize='small')
  if title:
    ax.set_title(title)
  figure = io.BytesIO()
  fig.savefig(figure, dpi=90, format=output_format(path))  # Written to exactly `path`.
  outputs.write(path, figure.getvalue(), '--output')
  return fig


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not _RUN.value:
    raise app.UsageError('Name at least one --run=LABEL=WORKDIR.')
  if not _OUTPUT.value:
    raise app.UsageError('--output: the figure to write is required (e.g. curves.png).')
  try:
    runs = [parse_run(spec) for spec in _RUN.value]
    hlines = [parse_hline(spec) for spec in _HLINE.value]
    vlines = [parse_vline(spec) for spec in _VLINE.value]
    labels = [(f'--run={label}={workdir}', label) for label, workdir in runs]
    for flag, specs, parsed in (
      ('--hline', _HLINE.value, hlines),
      ('--vline', _VLINE.value, vlines),
    ):
      labels += [(f'{flag}={spec}', label) for spec, (label, _) in zip(specs, parsed, strict=True)]
    if errors := duplicate_label_errors(labels):
      raise InvalidInput('\n'.join(errors))
    output_format(_OUTPUT.value)
    if problems := [e for label, w in runs for e in storage.path_errors(w, f'--run={label}')]:
      raise InvalidInput('\n'.join(problems))  # A URL's form and credentials, before a look.
    inputs = {f'--run={label}': workdir for label, workdir in runs}
    if errors := path_checks.output_errors(_OUTPUT.value, '--output', inputs):
      raise InvalidInput('\n'.join(errors))
    if _EVAL_SPLIT.value is None:
      curves = [(label, read_curve(workdir, _X.value, _Y.value)) for label, workdir in runs]
    else:
      curves = []
      for label, workdir in runs:
        lines, left_out = read_eval_curves(workdir, _EVAL_SPLIT.value, _X.value, _Y.value)
        for path, why in left_out:
          print(f'Left out {path}: {why}.')
        for scoring, points in lines.items():
          curves.append((label if len(lines) == 1 else f'{label} ({scoring})', points))
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  plot(curves, _X.value, _Y.value, _OUTPUT.value, _TITLE.value, hlines, vlines)
  print(f'Wrote {_OUTPUT.value}.')


if __name__ == '__main__':
  errors.run(main)
