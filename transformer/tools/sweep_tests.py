"""Significance between a sweep's configurations, for summary.md: across sentences and seeds.

`paired_tests`: sacreBLEU's paired bootstrap test of the reference configuration
against each other one, on eval.py's translations of all seeds pooled;
`seed_tests`: Welch's t-test on the per-seed BLEU, which sees how much training
runs differ. `sweep_summary` sets their tables side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformer import storage
from transformer.tools import significance
from transformer.tools.sweep_results import GroupResult


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
  pooled difference significant (the variants study in results/variants.md has one).
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
    paths = [storage.join(t.workdir, t.decode_result) for t in result.trials if t.decode_result]
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


def seed_tests_table(
  tests: Sequence[tuple[GroupResult, dict[str, Any]]], comparison: dict[str, Any] | None
) -> list[str]:
  """The markdown table of `seed_tests`, each beside its pooled paired test (`comparison`)."""
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


def comparison_table(comparison: dict[str, Any], role: str) -> list[str]:
  """The markdown table of `paired_tests`' comparison; `role` names its first row's part."""
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
