"""A sweep's summary: ROOT/summary.csv, ROOT/summary.md and ROOT/summary.png.

Written from the results `sweep_results` reads back from each trial's workdir,
so the summary can be rebuilt at any time, also while trials run. One row per
trial of the sweep, ranked by `config.target_metric`; trials without that
metric (failed, pending) follow in sweep order.

A sweep run with seeds (`sweep.py --seeds=N`) is summarized per configuration:
the mean, standard deviation, minimum and maximum over its seeds, ranked by the
mean, error bars in the plot (ROOT/trials.csv keeps one row per trial). With
eval.py results, summary.md adds sacreBLEU's paired bootstrap test of the best
configuration (or `sweep.py --compare_to=NAME`) against each other one, on the
translations of all seeds pooled (see `sweep_tests.paired_tests`).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

from transformer import outputs, ranking, storage
from transformer.tools import significance, sweep_plots, sweep_results, sweep_tests, sweeps
from transformer.tools.sweep_results import GroupResult, TrialResult

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
  metric = ranking.METRICS[target_metric]
  column, how = metric.summary_column, metric.summary_how
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
      *(f'{column}_{stat}' for column, _, _ in GROUP_METRICS for stat in sweep_results.STATISTICS),
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
          _cell(result.stats(column)[stat])
          for column, _, _ in GROUP_METRICS
          for stat in sweep_results.STATISTICS
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
  metric = ranking.METRICS[target_metric]
  column, how = metric.summary_column, metric.summary_how
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
      'of the other; see `sweep_tests.paired_tests` for why pooled). '
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


_ROOT_FLAG = '--workdir (the sweep root)'


def write(sweep: sweeps.Sweep) -> list[TrialResult] | list[GroupResult]:
  """Writes ROOT/summary.{csv,md,png}; returns the rows, ranked.

  With seeds (`sweep.seeds` > 1) the rows are configurations (`GroupResult`), and
  ROOT/trials.csv has one row per trial.
  """
  target_metric = sweep.config.target_metric
  swept_keys = sweep.swept_keys()
  results = sweep_results.rank(
    [sweep_results.collect(sweep, trial) for trial in sweep.trials], target_metric
  )
  storage.makedirs(sweep.root)
  if sweep.seeds > 1:
    return _write_groups(sweep, results, target_metric)
  title = (
    f'Sweep {os.path.basename(sweep.sweep_file)} over '
    f'{os.path.basename(sweep.config_file)}: {len(results)} trials'
  )
  outputs.write_files(
    [
      (storage.join(sweep.root, 'summary.csv'), to_csv(results, swept_keys)),
      (
        storage.join(sweep.root, 'summary.md'),
        to_markdown(results, swept_keys, target_metric, title),
      ),
    ],
    _ROOT_FLAG,
  )
  with storage.replacing(storage.join(sweep.root, 'summary.png')) as tmp:
    sweep_plots.plot(results, swept_keys, target_metric, tmp)
  return results


def _write_groups(
  sweep: sweeps.Sweep, results: list[TrialResult], target_metric: str
) -> list[GroupResult]:
  """summary.{csv,md,png} per configuration, trials.csv per trial."""
  swept_keys = [key for key in sweep.swept_keys() if key != 'seed']
  groups = sweep_results.rank_groups(sweep_results.group(sweep, results), target_metric)
  title = (
    f'Sweep {os.path.basename(sweep.sweep_file)} over '
    f'{os.path.basename(sweep.config_file)}: {len(groups)} configurations x '
    f'{sweep.seeds} seeds'
  )
  # Trials in the order of their configurations, each ranked as its configuration.
  trials = [dataclasses.replace(t, rank=g.rank) for g in groups for t in g.trials]
  markdown = groups_to_markdown(
    groups, trials, swept_keys, target_metric, title, sweep.seeds, sweep.compare_to
  )
  outputs.write_files(
    [
      (storage.join(sweep.root, 'trials.csv'), to_csv(trials, [*swept_keys, 'seed'])),
      (storage.join(sweep.root, 'summary.csv'), groups_to_csv(groups, swept_keys)),
      (storage.join(sweep.root, 'summary.md'), markdown),
    ],
    _ROOT_FLAG,
  )
  with storage.replacing(storage.join(sweep.root, 'summary.png')) as tmp:
    sweep_plots.plot_groups(groups, swept_keys, target_metric, tmp, sweep.compare_to)
  return groups
