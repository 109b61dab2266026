"""A sweep's results: ROOT/summary.csv, ROOT/summary.md and ROOT/summary.png.

Read from what each trial left in its workdir (trial.json, metrics.jsonl,
eval/*.json), so the summary can be rebuilt at any time, also while trials run.
One row per trial of the sweep, ranked by `config.target_metric`; trials
without that metric (failed, pending) follow in sweep order.

A sweep run with seeds (`sweep.py --seeds=N`) is summarized per configuration:
the mean, standard deviation, minimum and maximum over its seeds, ranked by the
mean, error bars in the plot (ROOT/trials.csv keeps one row per trial). With
eval.py results, summary.md adds sacreBLEU's paired bootstrap test of the best
configuration (or `sweep.py --compare_to=NAME`) against each other one, on the
translations of all seeds pooled (see `paired_tests`).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import io
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from transformer import atomic
from transformer.tools import significance, sweeps

COLUMNS = (
  'rank',
  'trial',
  'status',
  'steps',
  'train_loss',
  'eval_loss',
  'best_eval_bleu',
  'tokens_per_sec',
  'decode_bleu',
  'decode_bleu_lc',
  'decode_result',
  'error',
  'workdir',
)


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
  decode_bleu_lc: float | None = None  # eval.py's BLEU on lowercased text (Multi30k papers').
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
  result = TrialResult(
    name=trial.name, overrides=trial.overrides, workdir=workdir, status=sweeps.trial_status(workdir)
  )
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
      scores = json.load(f)
    result.decode_bleu, result.decode_bleu_lc = scores.get('bleu'), scores.get('bleu_lc')
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
    writer.writerow(
      [
        _cell(result.rank),
        'yes' if result.rank == 1 else '',
        result.name,
        *(_override_cell(result, key) for key in swept_keys),
        *(_cell(getattr(result, column)) for column in COLUMNS[2:]),
      ]
    )
  return out.getvalue()


def _fixed(value: float | None, digits: int) -> str:
  return '' if value is None else f'{value:.{digits}f}'


def to_markdown(
  results: Sequence[TrialResult], swept_keys: Sequence[str], target_metric: str, title: str
) -> str:
  """A table ranked by the target metric, the best trial in bold, failures with their error."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  how = 'highest best' if higher_is_better else 'lowest final'
  lines = [
    f'# {title}',
    '',
    f'Ranked by `{target_metric}` ({how} `{column}`); plots in summary.png.',
    '',
    *_trials_table(results, swept_keys),
  ]
  return '\n'.join(lines) + '\n'


def _trials_table(results: Sequence[TrialResult], swept_keys: Sequence[str]) -> list[str]:
  """The per-trial markdown table, then the failed trials with their errors."""
  has_decode = any(r.decode_bleu is not None for r in results)
  has_decode_lc = any(r.decode_bleu_lc is not None for r in results)  # Results before it: none.
  header = [
    'rank',
    'trial',
    *swept_keys,
    'status',
    'steps',
    'train loss',
    'val loss',
    'best val BLEU',
    'tokens/s',
    *(['eval.py BLEU'] if has_decode else []),
    *(['eval.py BLEU (lc)'] if has_decode_lc else []),
  ]
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  for result in results:
    cells = [
      'best' if result.rank == 1 else _cell(result.rank),
      f'`{result.name}`',
      *(_override_cell(result, key) for key in swept_keys),
      result.status,
      _cell(result.steps),
      _fixed(result.train_loss, 4),
      _fixed(result.eval_loss, 4),
      _fixed(result.best_eval_bleu, 2),
      _fixed(result.tokens_per_sec, 0),
      *([_fixed(result.decode_bleu, 2)] if has_decode else []),
      *([_fixed(result.decode_bleu_lc, 2)] if has_decode_lc else []),
    ]
    if result.rank == 1:
      cells = [f'**{cell}**' if cell else cell for cell in cells]
    lines.append('| ' + ' | '.join(cells) + ' |')
  failures = [r for r in results if r.status == 'failed']
  if failures:
    lines += ['', 'Failed trials (their output is in the log file named):', '']
    lines += [
      f'* `{r.name}`: {r.error or "see the log"} ({os.path.join(r.name, "train.log")})'
      for r in failures
    ]
  return lines


def _numeric(values: Sequence[Any]) -> bool:
  return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _figure(num_panels: int) -> tuple[Figure, list]:
  """A figure of `num_panels` panels, three to a row."""
  num_cols = min(num_panels, 3)
  num_rows = math.ceil(num_panels / num_cols)
  fig = Figure(figsize=(4.6 * num_cols, 3.6 * num_rows), layout='constrained')
  FigureCanvasAgg(fig)
  axes = list(fig.subplots(num_rows, num_cols, squeeze=False).ravel())
  for ax in axes[num_panels:]:
    ax.set_visible(False)
  return fig, axes


def _key_axis(ax, key: str, values: Sequence[Any]) -> Callable[[Any], Any]:
  """Sets up the x axis of a swept key's `values`; returns value -> x position."""
  numeric = _numeric(values)
  to_x = (lambda v: v) if numeric else (lambda v: values.index(v))
  if numeric and values and min(values) > 0 and max(values) >= 8 * min(values):
    ax.set_xscale('log')
    ax.minorticks_off()
  if not numeric or len(values) <= 8:  # Ticks at the values tried.
    ax.set_xticks(
      [to_x(v) for v in values],
      [sweeps.flag_value(v) for v in values],
      rotation=0 if numeric else 20,
    )
  ax.set_xlabel(key)
  ax.grid(alpha=0.3)
  return to_x


def _learning_curves(
  ax, runs: Sequence[tuple[str, bool, Sequence[TrialResult]]], title: str
) -> None:
  """Train (solid) and validation (dashed) loss of each `(name, is_best, trials)`, a colour each."""
  colors = colormaps['tab10']
  for index, (name, is_best, trials) in enumerate(runs):
    color = colors(index % 10)
    width = 2.5 if is_best else 1.0
    for number, trial in enumerate(trials):
      if trial.train_curve:
        steps, losses = zip(*trial.train_curve, strict=True)
        ax.plot(
          steps,
          losses,
          color=color,
          linewidth=width,
          alpha=0.8,
          label=name if number == 0 else None,
        )
      if trial.eval_curve:
        steps, losses = zip(*trial.eval_curve, strict=True)
        ax.plot(
          steps, losses, color=color, linewidth=width, linestyle='--', marker='o', markersize=3
        )
  ax.set_xlabel('step')
  ax.set_ylabel('loss (solid: train, dashed: validation)')
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if 0 < len(runs) <= 12:
    ax.legend(fontsize='x-small')


def plot(
  results: Sequence[TrialResult], swept_keys: Sequence[str], target_metric: str, path: str
) -> None:
  """The target metric against each swept key, then every trial's learning curves."""
  column, _ = sweeps.TARGET_METRICS[target_metric]
  fig, axes = _figure(len(swept_keys) + 1)
  scored = [r for r in results if getattr(r, column) is not None]
  for ax, key in zip(axes, swept_keys, strict=False):
    points = [
      (r.overrides[key], getattr(r, column), r.rank == 1) for r in scored if key in r.overrides
    ]
    to_x = _key_axis(ax, key, sorted({p[0] for p in points}, key=str))
    ax.scatter([to_x(p[0]) for p in points], [p[1] for p in points], color='tab:blue')
    best = [p for p in points if p[2]]
    ax.scatter(
      [to_x(p[0]) for p in best],
      [p[1] for p in best],
      s=160,
      marker='*',
      color='tab:red',
      label='best',
      zorder=3,
    )
    ax.set_ylabel(column)
    if best:
      ax.legend(fontsize='small')
  _learning_curves(
    axes[len(swept_keys)], [(r.name, r.rank == 1, [r]) for r in results], 'learning curves'
  )
  fig.savefig(path, dpi=90)


# --- Seeds: one row per configuration ---------------------------------------------------------

# Trial columns summarized over seeds: (column, markdown header, digits).
GROUP_METRICS = (
  ('eval_loss', 'val loss', 4),
  ('best_eval_bleu', 'best val BLEU', 2),
  ('decode_bleu', 'eval.py BLEU', 2),
  ('decode_bleu_lc', 'eval.py BLEU (lc)', 2),
  ('train_loss', 'train loss', 4),
)
STATISTICS = ('mean', 'std', 'min', 'max')


@dataclasses.dataclass
class GroupResult:
  """A configuration run with several seeds: its trials, one per seed, in seed order."""

  name: str  # The trials' names without the seed ('base' for no other override).
  overrides: dict[str, Any]  # Its overrides, the seed left out.
  trials: list[TrialResult]
  rank: int | None = None  # 1 = best by the mean of the target metric.

  def values(self, column: str) -> list[float]:
    """The column's values over the seeds that have one."""
    return [getattr(t, column) for t in self.trials if getattr(t, column) is not None]

  def stats(self, column: str) -> dict[str, float | None]:
    """Mean, sample standard deviation (None for one value), min and max of the column."""
    values = self.values(column)
    if not values:
      return dict.fromkeys(STATISTICS)
    return {
      'mean': statistics.fmean(values),
      'std': statistics.stdev(values) if len(values) > 1 else None,
      'min': min(values),
      'max': max(values),
    }

  def status(self) -> str:
    """'finished' when every seed finished, else the count per status ('finished 1, failed 1')."""
    counts = collections.Counter(t.status for t in self.trials)
    if set(counts) == {'finished'}:
      return 'finished'
    return ', '.join(f'{status} {count}' for status, count in sorted(counts.items()))


def group(sweep: sweeps.Sweep, results: Sequence[TrialResult]) -> list[GroupResult]:
  """The trial results by configuration (`Trial.group`), in sweep order."""
  by_name = {r.name: r for r in results}
  groups: dict[str, GroupResult] = {}
  for trial in sweep.trials:
    name = trial.group or trial.name
    if name not in groups:
      overrides = {k: v for k, v in trial.overrides.items() if k != 'seed'}
      groups[name] = GroupResult(name=name, overrides=overrides, trials=[])
    groups[name].trials.append(by_name[trial.name])
  return list(groups.values())


def rank_groups(groups: list[GroupResult], target_metric: str) -> list[GroupResult]:
  """Best first by the mean of the target metric over the seeds; the rest keep their order."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  scored = [g for g in groups if g.values(column)]
  scored.sort(key=lambda g: g.stats(column)['mean'], reverse=higher_is_better)
  for position, result in enumerate(scored, start=1):
    result.rank = position
  return scored + [g for g in groups if not g.values(column)]


def groups_to_csv(groups: Sequence[GroupResult], swept_keys: Sequence[str]) -> str:
  """A header line, then one line per configuration: mean, std, min and max of each metric."""
  out = io.StringIO()
  writer = csv.writer(out, lineterminator='\n')
  writer.writerow(
    [
      'rank',
      'best',
      'configuration',
      *swept_keys,
      'seeds',
      'status',
      *(f'{column}_{stat}' for column, _, _ in GROUP_METRICS for stat in STATISTICS),
      'trials',
    ]
  )
  for result in groups:
    writer.writerow(
      [
        _cell(result.rank),
        'yes' if result.rank == 1 else '',
        result.name,
        *(
          sweeps.flag_value(result.overrides[key]) if key in result.overrides else ''
          for key in swept_keys
        ),
        len(result.trials),
        result.status(),
        *(
          _cell(result.stats(column)[stat]) for column, _, _ in GROUP_METRICS for stat in STATISTICS
        ),
        ' '.join(t.name for t in result.trials),
      ]
    )
  return out.getvalue()


def _spread(stats: dict[str, float | None], digits: int) -> str:
  """'4.8123 ± 0.0123 [4.8000, 4.8246]'; no ± for a single seed; '' without values."""
  if stats['mean'] is None:
    return ''
  text = f'{stats["mean"]:.{digits}f}'
  if stats['std'] is not None:
    text += f' ± {stats["std"]:.{digits}f} [{stats["min"]:.{digits}f}, {stats["max"]:.{digits}f}]'
  return text


def paired_tests(
  groups: Sequence[GroupResult], compare_to: str | None = None
) -> tuple[dict[str, Any] | None, str]:
  """sacreBLEU's paired bootstrap test of the best configuration (or `compare_to`) against the rest.

  On eval.py's translations, all seeds pooled: seed k of the best configuration is
  paired with seed k of the other, and one test resamples all N x S sentence pairs
  (N seeds, S sentences). Pooled rather than per seed: one p-value per comparison
  instead of N that would need a multiple-comparison correction (Clark et al. 2011
  test their optimizer replicas the same way). It resamples sentences only, so it
  does not see how much training runs differ: one lucky seed among three can make a
  pooled difference significant (the variants study in docs/variants.md has one).
  `seed_tests` is the test across seeds that the summary sets beside it.

  Returns (the comparison as `significance.compare` gives it, or None; a note on
  what was left out and why, or '').
  """
  ranked = _reference_first(groups, compare_to)
  if compare_to is not None and (not ranked or ranked[0].name != compare_to):
    return None, f'No paired tests: `{compare_to}` has no results yet.'
  if len(ranked) < 2:
    return None, 'Fewer than two ranked configurations: nothing to test.'
  pooled, missing = [], {}
  for result in ranked:
    paths = [os.path.join(t.workdir, t.decode_result) for t in result.trials if t.decode_result]
    if len(paths) < len(result.trials):
      missing[result.name] = f'`{result.name}` ({len(paths)} of {len(result.trials)} seeds)'
      continue
    try:
      pooled.append(significance.pool(result.name, [significance.load_system(p) for p in paths]))
    except (OSError, ValueError) as e:  # Not a translation result (a language model), or stale.
      missing[result.name] = f'`{result.name}` ({e})'
  if ranked[0].name in missing:
    return None, (
      'No paired tests: they need eval.py translations of every seed of '
      f'`{ranked[0].name}` (run the sweep with --eval); missing: '
      + '; '.join(missing.values())
      + '.'
    )
  note = (
    'Left out of the paired tests, without eval.py translations of every seed: '
    + '; '.join(missing.values())
    + '.'
    if missing
    else ''
  )
  if len(pooled) < 2:
    return None, note
  try:
    return significance.compare(pooled, test='bs'), note
  except ValueError as e:
    return None, f'No paired tests: {e}'


def _reference_first(groups: Sequence[GroupResult], compare_to: str | None) -> list[GroupResult]:
  """The ranked configurations by rank, `compare_to` (when ranked) moved first."""
  ranked = sorted((g for g in groups if g.rank is not None), key=lambda g: g.rank)
  if compare_to is not None:
    ranked.sort(key=lambda g: g.name != compare_to)  # Stable: the others stay by rank.
  return ranked


def seed_tests(
  groups: Sequence[GroupResult], compare_to: str | None = None
) -> tuple[GroupResult | None, list[tuple[GroupResult, dict[str, Any]]]]:
  """Welch's t-test of each configuration's per-seed eval.py BLEU against the reference's.

  Returns (the reference: `compare_to`, else the best configuration; one
  `significance.seed_test` per other configuration, by rank). Configurations
  without eval.py BLEU are left out; (None, []) with fewer than two seeds.
  """
  ranked = [g for g in _reference_first(groups, compare_to) if g.values('decode_bleu')]
  if compare_to is not None and (not ranked or ranked[0].name != compare_to):
    return None, []
  if len(ranked) < 2 or max(len(g.values('decode_bleu')) for g in ranked) < 2:
    return None, []
  reference = ranked[0].values('decode_bleu')
  return ranked[0], [
    (g, significance.seed_test(reference, g.values('decode_bleu'))) for g in ranked[1:]
  ]


def _seed_tests_table(
  tests: Sequence[tuple[GroupResult, dict[str, Any]]], comparison: dict[str, Any] | None
) -> list[str]:
  pooled = {}
  if comparison is not None:
    pooled = {row['name']: row['scores']['BLEU'] for row in comparison['systems'][1:]}
  header = [
    'configuration',
    'eval.py BLEU per seed',
    'difference of means',
    "p (Welch's t, across seeds)",
    'significant over sentences and seeds',
  ]
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  for result, test in tests:
    p = test['p_value']
    both = test['significant'] and pooled.get(result.name, {}).get('significant', False)
    lines.append(
      '| '
      + ' | '.join(
        [
          f'`{result.name}`',
          ', '.join(f'{v:.2f}' for v in result.values('decode_bleu')),
          f'{test["difference"]:+.2f}',
          'n/a' if p is None else f'{p:.4f}' + (' (significant)' if test['significant'] else ''),
          'yes' if both else 'no',
        ]
      )
      + ' |'
    )
  return lines


def groups_to_markdown(
  groups: Sequence[GroupResult],
  results: Sequence[TrialResult],
  swept_keys: Sequence[str],
  target_metric: str,
  title: str,
  seeds: int,
  compare_to: str | None = None,
) -> str:
  """Configurations ranked by the mean over seeds, the paired tests, then every trial."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  how = 'highest best' if higher_is_better else 'lowest final'
  # eval.py's columns only where some configuration has them.
  metrics = [
    m
    for m in GROUP_METRICS
    if not m[0].startswith('decode_') or any(g.values(m[0]) for g in groups)
  ]
  header = ['rank', 'configuration', *swept_keys, 'seeds', 'status', *(m[1] for m in metrics)]
  lines = [
    f'# {title}',
    '',
    f'{seeds} seeds per configuration (config.seed, +1, ...), ranked by the mean of '
    f'`{target_metric}` ({how} `{column}`). Cells: mean ± standard deviation '
    '[min, max] over the seeds; error bars in summary.png; every trial (ranked as its '
    'configuration) in trials.csv and below.',
    '',
    '| ' + ' | '.join(header) + ' |',
    '|' + ' --- |' * len(header),
  ]
  for result in groups:
    cells = [
      'best' if result.rank == 1 else _cell(result.rank),
      f'`{result.name}`',
      *(
        sweeps.flag_value(result.overrides[key]) if key in result.overrides else ''
        for key in swept_keys
      ),
      str(len(result.trials)),
      result.status(),
      *(_spread(result.stats(name), digits) for name, _, digits in metrics),
    ]
    if result.rank == 1:
      cells = [f'**{cell}**' if cell else cell for cell in cells]
    lines.append('| ' + ' | '.join(cells) + ' |')
  comparison, note = paired_tests(groups, compare_to)
  reference = f'`{compare_to}`' if compare_to else 'the best configuration'
  lines += ['', f'## Paired tests against {reference}', '']
  if comparison is not None:
    lines += [
      f"sacreBLEU's paired bootstrap resampling ({comparison['n_samples']} resamples, seed "
      f"{comparison['seed']}) on eval.py's {comparison['split']} translations, all seeds pooled "
      f'({comparison["num_sentences"]} sentence pairs: seed k of {reference} paired with seed k '
      'of the other; see `sweep_summary.paired_tests` for why pooled). '
      f'p < {comparison["alpha"]}: significant.',
      '',
      *_comparison_table(comparison, 'best' if not compare_to else 'reference'),
      '',
      *(f'* {sentence}' for sentence in significance.verdicts(comparison)),
    ]
  if note:
    lines += ['', note]
  reference_group, tests = seed_tests(groups, compare_to)
  if tests:
    reference_values = ', '.join(f'{v:.2f}' for v in reference_group.values('decode_bleu'))
    lines += [
      '',
      f'## Across seeds, against {reference}',
      '',
      'The paired tests above resample sentences of fixed translations: they do not see how '
      "much training runs differ. Welch's t-test on each seed's eval.py BLEU does (two-sided, "
      f'unequal variances; {reference}: {reference_values}). A difference is established when '
      'both tests find it.',
      '',
      *_seed_tests_table(tests, comparison),
    ]
  lines += ['', '## Trials', '', *_trials_table(results, [*swept_keys, 'seed'])]
  return '\n'.join(lines) + '\n'


def _comparison_table(comparison: dict[str, Any], role: str) -> list[str]:
  metrics = list(comparison['systems'][0]['scores'])
  header = [
    'configuration',
    *(f'{m} (pooled, ± 95% CI)' for m in metrics),
    *(f'p ({m})' for m in metrics),
  ]
  lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
  for index, row in enumerate(comparison['systems']):
    scores = row['scores']
    cells = [
      f'`{row["name"]}`' + (f' ({role})' if index == 0 else ''),
      *(f'{scores[m]["score"]:.2f} ± {scores[m]["ci"]:.2f}' for m in metrics),
      *(
        ''
        if index == 0
        else f'{scores[m]["p_value"]:.4f}' + (' (significant)' if scores[m]['significant'] else '')
        for m in metrics
      ),
    ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def plot_groups(
  groups: Sequence[GroupResult],
  swept_keys: Sequence[str],
  target_metric: str,
  path: str,
  compare_to: str | None = None,
) -> Figure:
  """Per swept key: the mean of the target metric with ± std error bars and each seed's value;
  then every trial's learning curves, one colour per configuration. Returns the figure.

  The reference (`compare_to`, else a configuration without overrides, such as a
  one-at-a-time sweep's baseline) is a grey band, mean ± std, on every panel that
  does not plot it, so each switch is seen against it.
  """
  column, _ = sweeps.TARGET_METRICS[target_metric]
  fig, axes = _figure(len(swept_keys) + 1)
  scored = [g for g in groups if g.values(column)]
  reference = next(
    (g for g in scored if (g.name == compare_to if compare_to else not g.overrides)), None
  )
  for ax, key in zip(axes, swept_keys, strict=False):
    members = [g for g in scored if key in g.overrides]
    if reference is not None and reference not in members:
      stats = reference.stats(column)
      spread = stats['std'] or 0.0
      ax.axhspan(stats['mean'] - spread, stats['mean'] + spread, color='gray', alpha=0.15)
      ax.axhline(
        stats['mean'], color='gray', linestyle='--', label=f'{reference.name} (mean ± std)'
      )
    to_x = _key_axis(ax, key, sorted({g.overrides[key] for g in members}, key=str))
    for g in members:
      stats = g.stats(column)
      best = g.rank == 1
      ax.errorbar(
        [to_x(g.overrides[key])],
        [stats['mean']],
        yerr=[stats['std'] or 0.0],
        fmt='*' if best else 'o',
        markersize=12 if best else 6,
        capsize=4,
        color='tab:red' if best else 'tab:blue',
        zorder=3,
        label='best (mean ± std)' if best else None,
      )
      ax.scatter(
        [to_x(g.overrides[key])] * len(g.values(column)),
        g.values(column),
        s=10,
        color='gray',
        alpha=0.7,
        zorder=2,
      )
    ax.set_ylabel(f'{column} (mean ± std; dots: seeds)')
    if ax.get_legend_handles_labels()[1]:
      ax.legend(fontsize='small')
  _learning_curves(
    axes[len(swept_keys)],
    [(g.name, g.rank == 1, g.trials) for g in groups],
    'learning curves (one colour per configuration)',
  )
  fig.savefig(path, dpi=90)
  return fig


def write(sweep: sweeps.Sweep) -> list[TrialResult] | list[GroupResult]:
  """Writes ROOT/summary.{csv,md,png}; returns the rows, ranked.

  With seeds (`sweep.seeds` > 1) the rows are configurations (`GroupResult`), and
  ROOT/trials.csv has one row per trial.
  """
  target_metric = sweep.config.target_metric
  swept_keys = sweep.swept_keys()
  results = rank([collect(sweep, trial) for trial in sweep.trials], target_metric)
  os.makedirs(sweep.root, exist_ok=True)
  if sweep.seeds > 1:
    return _write_groups(sweep, results, target_metric)
  title = (
    f'Sweep {os.path.basename(sweep.sweep_file)} over '
    f'{os.path.basename(sweep.config_file)}: {len(results)} trials'
  )
  atomic.write_text(os.path.join(sweep.root, 'summary.csv'), to_csv(results, swept_keys))
  atomic.write_text(
    os.path.join(sweep.root, 'summary.md'), to_markdown(results, swept_keys, target_metric, title)
  )
  with atomic.replacing(os.path.join(sweep.root, 'summary.png')) as tmp:
    plot(results, swept_keys, target_metric, tmp)
  return results


def _write_groups(
  sweep: sweeps.Sweep, results: list[TrialResult], target_metric: str
) -> list[GroupResult]:
  """summary.{csv,md,png} per configuration, trials.csv per trial."""
  swept_keys = [key for key in sweep.swept_keys() if key != 'seed']
  groups = rank_groups(group(sweep, results), target_metric)
  title = (
    f'Sweep {os.path.basename(sweep.sweep_file)} over '
    f'{os.path.basename(sweep.config_file)}: {len(groups)} configurations x '
    f'{sweep.seeds} seeds'
  )
  # Trials in the order of their configurations, each ranked as its configuration.
  trials = [dataclasses.replace(t, rank=g.rank) for g in groups for t in g.trials]
  atomic.write_text(os.path.join(sweep.root, 'trials.csv'), to_csv(trials, [*swept_keys, 'seed']))
  atomic.write_text(os.path.join(sweep.root, 'summary.csv'), groups_to_csv(groups, swept_keys))
  atomic.write_text(
    os.path.join(sweep.root, 'summary.md'),
    groups_to_markdown(
      groups, trials, swept_keys, target_metric, title, sweep.seeds, sweep.compare_to
    ),
  )
  with atomic.replacing(os.path.join(sweep.root, 'summary.png')) as tmp:
    plot_groups(groups, swept_keys, target_metric, tmp, sweep.compare_to)
  return groups
