"""A sweep's results: ROOT/summary.csv, ROOT/summary.md and ROOT/summary.png.

Read from what each trial left in its workdir (trial.json, metrics.jsonl,
eval/*.json), so the summary can be rebuilt at any time, also while trials run.
One row per trial of the sweep, ranked by `config.target_metric`; trials
without that metric (failed, pending) follow in sweep order.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import socket
import statistics
from collections.abc import Sequence
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer import sweeps

COLUMNS = ('rank', 'trial', 'status', 'steps', 'train_loss', 'eval_loss', 'best_eval_bleu',
           'tokens_per_sec', 'decode_bleu', 'decode_result', 'error', 'workdir')


@dataclasses.dataclass
class TrialResult:
  """What one trial reached; None where it has no such value (yet)."""

  name: str
  overrides: dict[str, Any]
  workdir: str
  status: str
  steps: int | None = None  # The last step with a metrics row.
  train_loss: float | None = None  # Of the last training row.
  eval_loss: float | None = None  # Of the last validation row.
  best_eval_bleu: float | None = None  # Highest validation BLEU over the evaluations.
  tokens_per_sec: float | None = None  # Median over logging windows but the first (compiles).
  decode_bleu: float | None = None  # eval.py's BLEU, when the sweep ran it.
  decode_result: str | None = None  # eval.py's result file, relative to the workdir.
  error: str | None = None  # The failed stage's exception line.
  rank: int | None = None  # 1 = best by the target metric.
  train_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  eval_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def _read_metrics(workdir: str) -> list[dict[str, float]]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        break  # A line being written by a running trial.
  return rows


def collect(sweep: sweeps.Sweep, trial: sweeps.Trial) -> TrialResult:
  """One trial's status and metrics, from its workdir."""
  workdir = sweep.workdir(trial)
  result = TrialResult(name=trial.name, overrides=trial.overrides, workdir=workdir,
                       status=sweeps.trial_status(workdir))
  rows = _read_metrics(workdir)
  train_rows = [r for r in rows if 'train_loss' in r]
  eval_rows = [r for r in rows if 'eval_loss' in r]
  bleus = [r['eval_bleu'] for r in eval_rows if 'eval_bleu' in r]
  rates = [r['tokens_per_sec'] for r in train_rows[1:] or train_rows if 'tokens_per_sec' in r]
  result.steps = max((r['step'] for r in rows), default=None)
  result.train_loss = train_rows[-1]['train_loss'] if train_rows else None
  result.eval_loss = eval_rows[-1]['eval_loss'] if eval_rows else None
  result.best_eval_bleu = max(bleus) if bleus else None
  result.tokens_per_sec = statistics.median(rates) if rates else None
  result.train_curve = [(r['step'], r['train_loss']) for r in train_rows]
  result.eval_curve = [(r['step'], r['eval_loss']) for r in eval_rows]
  stages = (sweeps.read_state(workdir) or {}).get('stages', {})
  errors = [r['error'] for r in stages.values() if r['status'] == 'failed' and r.get('error')]
  result.error = errors[-1] if errors and result.status == 'failed' else None
  decode_result = stages.get('eval', {}).get('result')
  if decode_result and os.path.exists(os.path.join(workdir, decode_result)):
    with open(os.path.join(workdir, decode_result)) as f:
      result.decode_bleu = json.load(f).get('bleu')
    result.decode_result = decode_result
  return result


def rank(results: list[TrialResult], target_metric: str) -> list[TrialResult]:
  """Best first by the target metric; trials without it keep their order after the others."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  scored = [r for r in results if getattr(r, column) is not None]
  scored.sort(key=lambda r: getattr(r, column), reverse=higher_is_better)
  for position, result in enumerate(scored, start=1):
    result.rank = position
  return scored + [r for r in results if getattr(r, column) is None]


def _cell(value: Any, digits: int = 6) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    return f'{value:.{digits}g}'
  return str(value)


def _override_cell(result: TrialResult, key: str) -> str:
  """The value as in the trial's name and command line; empty where the trial keeps the base."""
  return sweeps.flag_value(result.overrides[key]) if key in result.overrides else ''


def to_csv(results: Sequence[TrialResult], swept_keys: Sequence[str]) -> str:
  """A header line, then one line per trial; each swept key is a column."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator='\n')
  writer.writerow(['rank', 'best', 'trial', *swept_keys, *COLUMNS[2:]])
  for result in results:
    writer.writerow([
      _cell(result.rank), 'yes' if result.rank == 1 else '', result.name,
      *(_override_cell(result, key) for key in swept_keys),
      *(_cell(getattr(result, column)) for column in COLUMNS[2:])])
  return out.getvalue()


def _fixed(value: float | None, digits: int) -> str:
  return '' if value is None else f'{value:.{digits}f}'


def to_markdown(results: Sequence[TrialResult], swept_keys: Sequence[str], target_metric: str,
                title: str) -> str:
  """A table ranked by the target metric, the best trial in bold, failures with their error."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  how = 'highest best' if higher_is_better else 'lowest final'
  has_decode = any(r.decode_bleu is not None for r in results)
  header = ['rank', 'trial', *swept_keys, 'status', 'steps', 'train loss', 'val loss',
            'best val BLEU', 'tokens/s', *(['eval.py BLEU'] if has_decode else [])]
  lines = [f'# {title}', '',
           f'Ranked by `{target_metric}` ({how} `{column}`); plots in summary.png.', '',
           '| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  for result in results:
    cells = [
      'best' if result.rank == 1 else _cell(result.rank), f'`{result.name}`',
      *(_override_cell(result, key) for key in swept_keys), result.status,
      _cell(result.steps), _fixed(result.train_loss, 4), _fixed(result.eval_loss, 4),
      _fixed(result.best_eval_bleu, 2), _fixed(result.tokens_per_sec, 0),
      *([_fixed(result.decode_bleu, 2)] if has_decode else [])]
    if result.rank == 1:
      cells = [f'**{cell}**' if cell else cell for cell in cells]
    lines.append('| ' + ' | '.join(cells) + ' |')
  failures = [r for r in results if r.status == 'failed']
  if failures:
    lines += ['', 'Failed trials (their output is in the log file named):', '']
    lines += [f'* `{r.name}`: {r.error or "see the log"} '
              f'({os.path.join(r.name, "train.log")})' for r in failures]
  return '\n'.join(lines) + '\n'


def _numeric(values: Sequence[Any]) -> bool:
  return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def plot(results: Sequence[TrialResult], swept_keys: Sequence[str], target_metric: str,
         path: str) -> None:
  """The target metric against each swept key, then every trial's learning curves."""
  column, _ = sweeps.TARGET_METRICS[target_metric]
  num_panels = len(swept_keys) + 1
  num_cols = min(num_panels, 3)
  num_rows = math.ceil(num_panels / num_cols)
  fig = Figure(figsize=(4.6 * num_cols, 3.6 * num_rows), layout='constrained')
  FigureCanvasAgg(fig)
  axes = fig.subplots(num_rows, num_cols, squeeze=False).ravel()
  scored = [r for r in results if getattr(r, column) is not None]
  for ax, key in zip(axes, swept_keys, strict=False):
    points = [(r.overrides[key], getattr(r, column), r.rank == 1)
              for r in scored if key in r.overrides]
    values = sorted({p[0] for p in points}, key=str)
    if _numeric(values):
      to_x = lambda v: v
      if values and min(values) > 0 and max(values) >= 8 * min(values):
        ax.set_xscale('log')
        ax.minorticks_off()
      if len(values) <= 8:  # Ticks at the values tried.
        ax.set_xticks(values, [sweeps.flag_value(v) for v in values])
    else:
      to_x = lambda v, values=values: values.index(v)
      ax.set_xticks(range(len(values)), [str(v) for v in values], rotation=20)
    ax.scatter([to_x(p[0]) for p in points], [p[1] for p in points], color='tab:blue')
    best = [p for p in points if p[2]]
    ax.scatter([to_x(p[0]) for p in best], [p[1] for p in best], s=160, marker='*',
               color='tab:red', label='best', zorder=3)
    ax.set_xlabel(key)
    ax.set_ylabel(column)
    ax.grid(alpha=0.3)
    if best:
      ax.legend(fontsize='small')
  curves = axes[len(swept_keys)]
  colors = colormaps['tab10']
  for index, result in enumerate(results):
    color = colors(index % 10)
    width = 2.5 if result.rank == 1 else 1.0
    if result.train_curve:
      steps, losses = zip(*result.train_curve, strict=True)
      curves.plot(steps, losses, color=color, linewidth=width, alpha=0.8, label=result.name)
    if result.eval_curve:
      steps, losses = zip(*result.eval_curve, strict=True)
      curves.plot(steps, losses, color=color, linewidth=width, linestyle='--', marker='o',
                  markersize=3)
  curves.set_xlabel('step')
  curves.set_ylabel('loss (solid: train, dashed: validation)')
  curves.set_title('learning curves')
  curves.grid(alpha=0.3)
  if 0 < len(results) <= 12:
    curves.legend(fontsize='x-small')
  for ax in axes[num_panels:]:
    ax.set_visible(False)
  fig.savefig(path, dpi=90)


def _replace(path: str, write_tmp) -> None:
  """Writes through `write_tmp(tmp_path)`, then renames: readers never see half a file."""
  # Slurm tasks on several hosts may write at once: the name is unique to this process.
  tmp = f'{path}.tmp-{socket.gethostname()}-{os.getpid()}{os.path.splitext(path)[1]}'
  write_tmp(tmp)
  os.replace(tmp, path)


def _write_text(path: str, text: str) -> None:
  def write_tmp(tmp: str) -> None:
    with open(tmp, 'w') as f:
      f.write(text)

  _replace(path, write_tmp)


def write(sweep: sweeps.Sweep) -> list[TrialResult]:
  """Writes ROOT/summary.{csv,md,png}; returns the rows, ranked."""
  target_metric = sweep.config.target_metric
  swept_keys = sweep.swept_keys()
  results = rank([collect(sweep, trial) for trial in sweep.trials], target_metric)
  os.makedirs(sweep.root, exist_ok=True)
  title = (f'Sweep {os.path.basename(sweep.sweep_file)} over '
           f'{os.path.basename(sweep.config_file)}: {len(results)} trials')
  _write_text(os.path.join(sweep.root, 'summary.csv'), to_csv(results, swept_keys))
  _write_text(os.path.join(sweep.root, 'summary.md'),
              to_markdown(results, swept_keys, target_metric, title))
  _replace(os.path.join(sweep.root, 'summary.png'),
           lambda tmp: plot(results, swept_keys, target_metric, tmp))
  return results
