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
import os
import statistics
from collections.abc import Sequence
from typing import Any

from transformer import storage
from transformer.tools import significance, sweep_plots, sweep_runner, sweep_tests, sweeps

COLUMNS = (
  'rank',
  'trial',
  'status',
  'steps',
  'train_loss',
  'eval_loss',
  'best_eval_bleu',
  'best_eval_bleu_lc',
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
  best_eval_bleu_lc: float | None = None  # The same on lowercased text (runs before it: None).
  tokens_per_sec: float | None = None  # Median over logging windows but the first (compiles).
  decode_bleu: float | None = None  # eval.py's BLEU, when the sweep ran it.
  decode_bleu_lc: float | None = None  # eval.py's BLEU on lowercased text (Multi30k papers').
  decode_result: str | None = None  # eval.py's result file, relative to the workdir.
  error: str | None = None  # The failed stage's exception line.
  rank: int | None = None  # 1 = best by the target metric.
  train_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  eval_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)


def _read_metrics(workdir: str) -> list[dict[str, float]]:
  path = storage.join(workdir, 'metrics.jsonl')
  if not storage.exists(path):
    return []
  rows = []
  for line in storage.read_text(path).splitlines(keepends=True):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      break  # A line being written by a running trial.
  return rows


def collect(sweep: sweeps.Sweep, trial: sweeps.Trial) -> TrialResult:
  """One trial's status and metrics, from its workdir."""
  workdir = sweep.workdir(trial)
  result = TrialResult(
    name=trial.name,
    overrides=trial.overrides,
    workdir=workdir,
    status=sweep_runner.trial_status(workdir),
  )
  rows = _read_metrics(workdir)
  train_rows = [r for r in rows if 'train_loss' in r]
  eval_rows = [r for r in rows if 'eval_loss' in r]
  bleus = [r['eval_bleu'] for r in eval_rows if 'eval_bleu' in r]
  bleus_lc = [r['eval_bleu_lc'] for r in eval_rows if 'eval_bleu_lc' in r]
  rates = [r['tokens_per_sec'] for r in train_rows[1:] or train_rows if 'tokens_per_sec' in r]
  result.steps = max((r['step'] for r in rows), default=None)
  result.train_loss = train_rows[-1]['train_loss'] if train_rows else None
  result.eval_loss = eval_rows[-1]['eval_loss'] if eval_rows else None
  result.best_eval_bleu = max(bleus) if bleus else None
  result.best_eval_bleu_lc = max(bleus_lc) if bleus_lc else None
  result.tokens_per_sec = statistics.median(rates) if rates else None
  result.train_curve = [(r['step'], r['train_loss']) for r in train_rows]
  result.eval_curve = [(r['step'], r['eval_loss']) for r in eval_rows]
  stages = (sweep_runner.read_state(workdir) or {}).get('stages', {})
  errors = [r['error'] for r in stages.values() if r['status'] == 'failed' and r.get('error')]
  result.error = errors[-1] if errors and result.status == 'failed' else None
  decode_result = stages.get('eval', {}).get('result')
  if decode_result and storage.exists(storage.join(workdir, decode_result)):
    scores = json.loads(storage.read_text(storage.join(workdir, decode_result)))
    result.decode_bleu, result.decode_bleu_lc = scores.get('bleu'), scores.get('bleu_lc')
    result.decode_result = decode_result
  return result


def rank(results: list[TrialResult], target_metric: str) -> list[TrialResult]:
  """Best first by the target metric; trials without it keep their order after the others,
  as do pruned ones (an Optuna study's: stopped early, their numbers are not final)."""
  column, higher_is_better = sweeps.TARGET_METRICS[target_metric]
  scored = [r for r in results if getattr(r, column) is not None and r.status != 'pruned']
  scored.sort(key=lambda r: getattr(r, column), reverse=higher_is_better)
  for position, result in enumerate(scored, start=1):
    result.rank = position
  return scored + [r for r in results if r.rank is None]


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
  has_bleu_lc = any(r.best_eval_bleu_lc is not None for r in results)  # Runs before it: none.
  header = [
    'rank',
    'trial',
    *swept_keys,
    'status',
    'steps',
    'train loss',
    'val loss',
    'best val BLEU',
    *(['best val BLEU (lc)'] if has_bleu_lc else []),
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
      *([_fixed(result.best_eval_bleu_lc, 2)] if has_bleu_lc else []),
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


# --- Seeds: one row per configuration ---------------------------------------------------------

# Trial columns summarized over seeds: (column, markdown header, digits).
GROUP_METRICS = (
  ('eval_loss', 'val loss', 4),
  ('best_eval_bleu', 'best val BLEU', 2),
  ('best_eval_bleu_lc', 'best val BLEU (lc)', 2),
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
  # eval.py's columns and the lowercased BLEU only where some configuration has them.
  metrics = [
    (name, header, digits)
    for name, header, digits in GROUP_METRICS
    if not (name.startswith('decode_') or name.endswith('_lc'))
    or any(g.values(name) for g in groups)
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
  comparison, note = sweep_tests.paired_tests(groups, compare_to)
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
      *sweep_tests.comparison_table(comparison, 'best' if not compare_to else 'reference'),
      '',
      *(f'* {sentence}' for sentence in significance.verdicts(comparison)),
    ]
  if note:
    lines += ['', note]
  reference_group, tests = sweep_tests.seed_tests(groups, compare_to)
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
      *sweep_tests.seed_tests_table(tests, comparison),
    ]
  lines += ['', '## Trials', '', *_trials_table(results, [*swept_keys, 'seed'])]
  return '\n'.join(lines) + '\n'


def write(sweep: sweeps.Sweep) -> list[TrialResult] | list[GroupResult]:
  """Writes ROOT/summary.{csv,md,png}; returns the rows, ranked.

  With seeds (`sweep.seeds` > 1) the rows are configurations (`GroupResult`), and
  ROOT/trials.csv has one row per trial.
  """
  target_metric = sweep.config.target_metric
  swept_keys = sweep.swept_keys()
  results = rank([collect(sweep, trial) for trial in sweep.trials], target_metric)
  storage.makedirs(sweep.root)
  if sweep.seeds > 1:
    return _write_groups(sweep, results, target_metric)
  title = (
    f'Sweep {os.path.basename(sweep.sweep_file)} over '
    f'{os.path.basename(sweep.config_file)}: {len(results)} trials'
  )
  storage.write_text(storage.join(sweep.root, 'summary.csv'), to_csv(results, swept_keys))
  storage.write_text(
    storage.join(sweep.root, 'summary.md'), to_markdown(results, swept_keys, target_metric, title)
  )
  with storage.replacing(storage.join(sweep.root, 'summary.png')) as tmp:
    sweep_plots.plot(results, swept_keys, target_metric, tmp)
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
  storage.write_text(storage.join(sweep.root, 'trials.csv'), to_csv(trials, [*swept_keys, 'seed']))
  storage.write_text(storage.join(sweep.root, 'summary.csv'), groups_to_csv(groups, swept_keys))
  storage.write_text(
    storage.join(sweep.root, 'summary.md'),
    groups_to_markdown(
      groups, trials, swept_keys, target_metric, title, sweep.seeds, sweep.compare_to
    ),
  )
  with storage.replacing(storage.join(sweep.root, 'summary.png')) as tmp:
    sweep_plots.plot_groups(groups, swept_keys, target_metric, tmp, sweep.compare_to)
  return groups
