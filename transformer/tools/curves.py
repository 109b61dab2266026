"""Curves of several runs in one figure: a metric of metrics.jsonl against steps or wall time.

  python -m transformer.tools.curves --run=pre-LN=workdirs/a --run=post-LN=workdirs/b \
      --x=wall_seconds --y=eval_bleu --output=curves.png

Each --run is LABEL=WORKDIR (a directory written by train.py). --x is `step` or
`wall_seconds` (drawn in minutes: the run's wall-clock time, compile and evaluations
included, that train.py writes into every row); --y is any key of the rows, e.g.
`eval_bleu` (greedy validation BLEU during training), `eval_loss` or `train_loss`.
A run without the keys is an error that names it, before anything is drawn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from absl import app, flags
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer import metrics, path_checks

X_KEYS = ('step', metrics.WALL_SECONDS)

_RUN = flags.DEFINE_multi_string('run', [], 'LABEL=WORKDIR of a train.py run (repeatable).')
_X = flags.DEFINE_enum('x', 'step', list(X_KEYS), 'Horizontal axis: steps or wall-clock time.')
_Y = flags.DEFINE_string('y', 'eval_bleu', 'Row key drawn: eval_bleu, eval_loss, train_loss, ...')
_OUTPUT = flags.DEFINE_string('output', None, 'The PNG written.')
_TITLE = flags.DEFINE_string('title', '', 'Figure title.')


def parse_run(spec: str) -> tuple[str, str]:
  """(label, workdir) of 'LABEL=WORKDIR'."""
  label, sep, workdir = spec.partition('=')
  if not sep or not label or not workdir:
    raise ValueError(f'--run={spec!r}: expected LABEL=WORKDIR.')
  return label, workdir


def read_curve(workdir: str, x: str, y: str) -> list[tuple[float, float]]:
  """(x, y) of every row of WORKDIR/metrics.jsonl that has `y`, in file order."""
  path = os.path.join(workdir, metrics.FILENAME)
  if not os.path.isfile(path):
    raise ValueError(f'{path}: no such file (is {workdir} a directory written by train.py?).')
  points, with_y = [], 0
  with open(path) as f:
    for number, line in enumerate(f, start=1):
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}, line {number}: not JSON ({e.msg}).') from None
      if y not in row:
        continue
      with_y += 1
      if x in row:
        points.append((float(row[x]), float(row[y])))
  if not with_y:
    raise ValueError(f'{path}: no row has {y!r}.')
  if not points:
    raise ValueError(
      f'{path}: its {y!r} rows have no {x!r} (runs trained before train.py wrote '
      f'{metrics.WALL_SECONDS!r} have none; use --x=step).'
    )
  return points


def plot(
  curves: Sequence[tuple[str, list[tuple[float, float]]]],
  x: str,
  y: str,
  path: str,
  title: str = '',
) -> None:
  """One line with markers per (label, points); wall seconds are drawn in minutes."""
  fig = Figure(figsize=(6.4, 4.2), layout='constrained')
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  scale = 60.0 if x == metrics.WALL_SECONDS else 1.0
  for label, points in curves:
    xs, ys = zip(*points, strict=True)
    ax.plot([v / scale for v in xs], ys, marker='o', markersize=3, label=label)
  ax.set_xlabel('wall-clock minutes' if x == metrics.WALL_SECONDS else 'step')
  ax.set_ylabel(y)
  ax.grid(alpha=0.3)
  ax.legend(fontsize='small')
  if title:
    ax.set_title(title)
  fig.savefig(path, dpi=90)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not _RUN.value:
    raise app.UsageError('Name at least one --run=LABEL=WORKDIR.')
  if not _OUTPUT.value:
    raise app.UsageError('--output: the PNG to write is required.')
  try:
    runs = [parse_run(spec) for spec in _RUN.value]
    inputs = {f'--run={label}': workdir for label, workdir in runs}
    errors = path_checks.protected_path_errors(
      _OUTPUT.value, '--output', inputs
    ) or path_checks.writable_file_errors(_OUTPUT.value, '--output')
    if errors:
      raise ValueError('\n'.join(errors))
    curves = [(label, read_curve(workdir, _X.value, _Y.value)) for label, workdir in runs]
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  plot(curves, _X.value, _Y.value, _OUTPUT.value, _TITLE.value)
  print(f'Wrote {_OUTPUT.value}.')


if __name__ == '__main__':
  app.run(main)
