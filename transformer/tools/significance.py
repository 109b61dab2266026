"""Is system B really better than A? sacreBLEU's paired tests on eval.py's result files.

A system is one eval.py translation result: WORKDIR/eval/<label>-<split>[-tag].json,
its translations (the .txt beside it) and the references it was scored against
(WORKDIR/eval/references-<split>.txt). `compare` runs sacreBLEU's paired test
(`sacrebleu.significance.PairedTest`): paired bootstrap resampling (Koehn 2004,
as `sacrebleu REF -i A B --paired-bs`) or approximate randomization (Riezler and
Maxwell 2005, `--paired-ar`) of every system against the first, the baseline,
each score with its bootstrap 95% confidence interval. The random number
generator is sacreBLEU's, seeded by the environment variable SACREBLEU_SEED
(12345 unless set), so sacreBLEU's command line reproduces every p-value.

`seed_test` is the other half when each system was trained with several seeds:
Welch's t-test on the per-seed scores, which sees how much training runs differ,
where the paired tests resample sentences of fixed translations only.

Importing this module imports no JAX: comparing result files takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import sacrebleu
from sacrebleu.significance import PairedTest

from transformer import scoring, storage
from transformer.errors import InvalidInput, MissingInput

ALPHA = 0.05  # Significance level of the verdicts.
# What `compare` can test (sacreBLEU's defaults of each; bleu_lc: BLEU lowercased, `-lc`) and
# what it tests unless told.
METRICS = ('bleu', 'chrf', 'bleu_lc')
DEFAULT_METRICS = ('bleu', 'chrf')
# Names of the scores in `compare`'s results: sacreBLEU's ('BLEU', 'chrF2'), but sacreBLEU names
# the lowercased BLEU 'BLEU' too.
_RENAMED = {'bleu_lc': 'BLEU-lc'}
TESTS = {'bs': 'paired bootstrap resampling', 'ar': 'approximate randomization'}
_RESULT_SUFFIXES = ('-perplexity.json', '-extrapolation.json')  # Language-model results.


@dataclasses.dataclass(frozen=True)
class System:
  """One eval.py translation result, ready to be tested."""

  name: str  # As the user named it (a file or a workdir).
  result_path: str  # The eval.py .json.
  hypotheses_path: str  # Its .txt: one line per line of the split.
  references_path: str  # WORKDIR/eval/references-<split>.txt.
  split: str
  hypotheses: list[str]  # The scored lines (eval.py's `unscored_lines` left out).
  references: list[str]
  results: dict[str, Any]  # The .json's contents.


def smallest_p_value(n_samples: int) -> float:
  """The smallest p-value sacreBLEU's paired tests can give with `n_samples`: 1 / (n + 1).

  Both tests count the resamples (or trials) at least as extreme as the real difference,
  plus one, over n + 1; below 1 / ALPHA - 1 samples no difference can be significant.
  """
  return 1.0 / (n_samples + 1)


def case_folded(system: System) -> bool:
  """Whether every translation is lowercase while the references are not (a case-folding
  vocabulary, `config.data.spm_normalization='nmt_nfkc_cf'`): cased BLEU then counts every
  capital as an error, and only the lowercased BLEU compares the translations."""
  return not any(c.isupper() for line in system.hypotheses for c in line) and any(
    c.isupper() for line in system.references for c in line
  )


def _read_lines(path: str) -> list[str]:
  text = storage.read_text(path)
  return text.split('\n')[:-1] if text.endswith('\n') else text.split('\n') if text else []


_REWRITE = 'Score its checkpoint again with eval.py (the same command writes it anew).'
# What a result is, for the errors of a file that is none.
_RESULTS = (
  "compare.py reads eval.py's translation results: the .json it writes for each checkpoint "
  'and split, WORKDIR/eval/LABEL-SPLIT[-TAG].json (its translations in the .txt of the same '
  'name beside it), or a workdir holding one'
)


def _read_result(path: str) -> Any:
  """The JSON value of result file `path`; a file that cannot be one is refused, saying what to
  name: eval.py's translations (.txt: the .json beside it), an empty file, text that is no JSON."""
  if path.endswith('.txt'):
    beside = path[: -len('.txt')] + '.json'
    if storage.isfile(beside):
      raise InvalidInput(
        f"{path} holds eval.py's translations, not its results: {_RESULTS}. Name {beside}, "
        'the results beside it.'
      )
    raise InvalidInput(f'{path} is a text file, not an eval.py result: {_RESULTS}.')
  data = storage.read_bytes(path)
  if not data.strip():
    again = f' If eval.py wrote it: {_REWRITE}' if path.endswith('.json') else ''
    raise InvalidInput(f'{path} is empty, not an eval.py result: {_RESULTS}.{again}')
  try:
    return json.loads(data.decode('utf-8'))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    where = f'line {e.lineno}: {e.msg}' if isinstance(e, json.JSONDecodeError) else e.reason
    if path.endswith('.json'):
      raise InvalidInput(f'{path} is damaged: not JSON ({where}). {_REWRITE}') from None
    raise InvalidInput(
      f'{path} is not JSON ({where}), so not an eval.py result: {_RESULTS}.'
    ) from None


def _identity(path: str) -> Any:
  """What is the same for every name of the file at `path`: its device and inode locally
  (other spellings, symbolic and hard links), its canonical URL on a bucket."""
  if storage.is_url(path):
    return storage.resolve(path)
  try:
    found = os.stat(path)
  except OSError:
    return os.path.realpath(path)
  return (found.st_dev, found.st_ino)


def check_distinct(systems: Sequence[System]) -> None:
  """Refuses a result named twice (the same file, however spelled, or a workdir and its result):
  it would count twice, as two seeds of a system or as two systems."""
  seen: dict[Any, System] = {}
  for system in systems:
    first = seen.setdefault(_identity(system.result_path), system)
    if first is not system:
      named = (
        f'twice as {system.name!r}'
        if first.name == system.name
        else f'as {first.name!r} and as {system.name!r}'
      )
      raise InvalidInput(
        f'{first.result_path} is named {named}: each result is one seed of one system, and '
        'one named twice would count twice (as two seeds, or as two systems). Name each result '
        'once.'
      )


def _result_in_workdir(workdir: str, split: str | None) -> str:
  """The one translation result of `split` (any split if None) in WORKDIR/eval/."""
  paths = sorted(
    p
    for p in storage.glob(storage.join(workdir, 'eval'), '*.json')
    if not p.endswith(_RESULT_SUFFIXES)
  )
  candidates = []
  for path in paths:
    results = storage.read_json(path, _REWRITE)
    if (
      isinstance(results, dict)
      and 'bleu' in results
      and (split is None or results.get('split') == split)
    ):
      candidates.append(path)
  if len(candidates) != 1:
    what = f' of split {split!r}' if split else ''
    found = ': ' + ', '.join(storage.basename(p) for p in candidates) if candidates else ''
    raise InvalidInput(
      f'{workdir} holds {len(candidates)} eval.py translation results{what} '
      f'(in {storage.join(workdir, "eval")}{found}); name the .json file to '
      'compare' + (' or pass --split.' if not split else '.')
    )
  return candidates[0]


def load_system(path: str, split: str | None = None) -> System:
  """The eval.py result at `path`: a result .json, or a workdir holding exactly one of `split`."""
  name = path
  if errors := storage.path_errors(path, 'a result'):
    raise InvalidInput(errors[0])
  path = os.path.expanduser(path)
  if storage.isdir(path):
    path = _result_in_workdir(path, split)
  if not storage.isfile(path):
    raise MissingInput(f'No eval.py result at {path}.')
  results = _read_result(path)
  if not isinstance(results, dict) or 'bleu' not in results or 'split' not in results:
    raise InvalidInput(f'{path} is not an eval.py translation result (no bleu and split).')
  if split is not None and results['split'] != split:
    raise InvalidInput(f'{path} scores split {results["split"]!r}, not {split!r}.')
  hypotheses_path = path[: -len('.json')] + '.txt'
  references_path = storage.join(storage.dirname(path), f'references-{results["split"]}.txt')
  for needed in (hypotheses_path, references_path):
    if not storage.isfile(needed):
      raise MissingInput(
        f'{needed} is missing: {path} cannot be compared (eval.py writes '
        'both next to its results; run it again).'
      )
  lines = _read_lines(hypotheses_path)
  unscored = set(results.get('unscored_lines', []))
  hypotheses = [line for number, line in enumerate(lines, start=1) if number not in unscored]
  references = _read_lines(references_path)
  if len(hypotheses) != len(references):
    raise InvalidInput(
      f'{hypotheses_path} has {len(hypotheses)} scored lines, but '
      f'{references_path} has {len(references)} references.'
    )
  digest = scoring.references_digest(references)
  if results.get('references_sha256', digest) != digest:
    raise InvalidInput(
      f'{references_path} is not what {path} was scored against (it changed '
      'since; run eval.py again).'
    )
  return System(
    name=name,
    result_path=path,
    hypotheses_path=hypotheses_path,
    references_path=references_path,
    split=results['split'],
    hypotheses=hypotheses,
    references=references,
    results=results,
  )


def check_comparable(systems: Sequence[System]) -> None:
  """Raises a ValueError naming both files unless every system scored the same references."""
  if len(systems) < 2:
    raise InvalidInput(f'A comparison needs at least 2 systems, got {len(systems)}.')
  baseline = systems[0]
  for system in systems[1:]:
    pair = f'{baseline.result_path} and {system.result_path}'
    if system.split != baseline.split:
      raise InvalidInput(
        f'{pair} score different splits ({baseline.split!r} and {system.split!r}).'
      )
    if len(system.hypotheses) != len(baseline.hypotheses):
      raise InvalidInput(
        f'{baseline.hypotheses_path} and {system.hypotheses_path} differ in line '
        f'count ({len(baseline.hypotheses)} and {len(system.hypotheses)} scored '
        'lines).'
      )
    if system.references != baseline.references:
      line = next(
        i
        for i, (a, b) in enumerate(
          zip(baseline.references, system.references, strict=True), start=1
        )
        if a != b
      )
      raise InvalidInput(
        f'{baseline.references_path} and {system.references_path} differ '
        f'(first at line {line}): {pair} were not scored against the same '
        'references.'
      )


def pool(name: str, systems: Sequence[System]) -> System:
  """One system of several results' translations one after another (e.g. a run's seeds).

  Two pooled systems are paired line by line: result k of one with result k of
  the other. The results must be distinct (`check_distinct`) and comparable
  (`check_comparable`).
  """
  if len(systems) > 1:
    check_distinct(systems)
    check_comparable(systems)
  first = systems[0]
  return System(
    name=name,
    result_path=', '.join(s.result_path for s in systems),
    hypotheses_path=', '.join(s.hypotheses_path for s in systems),
    references_path=first.references_path,
    split=first.split,
    hypotheses=[line for s in systems for line in s.hypotheses],
    references=[line for s in systems for line in s.references],
    results={'pooled': [s.result_path for s in systems]},
  )


def _sacrebleu_metrics(metrics: Sequence[str]) -> dict:
  unknown = sorted(set(metrics) - set(METRICS))
  if unknown or not metrics:
    raise InvalidInput(f'metrics={list(metrics)}: expected a non-empty subset of {list(METRICS)}.')
  make = {
    'bleu': sacrebleu.metrics.BLEU,
    'chrf': sacrebleu.metrics.CHRF,
    'bleu_lc': lambda: sacrebleu.metrics.BLEU(lowercase=True),
  }
  return {name: make[name]() for name in metrics}


def compare(
  systems: Sequence[System],
  metrics: Sequence[str] = DEFAULT_METRICS,
  test: str = 'bs',
  n_samples: int = 0,
) -> dict[str, Any]:
  """Each system's scores with 95% intervals, and its p-value against the first (the baseline).

  Args:
    systems: What to compare; the first is the baseline. They must be comparable
      (`check_comparable`).
    metrics: A subset of `METRICS` ('bleu', 'chrf', 'bleu_lc').
    test: 'bs' (paired bootstrap resampling) or 'ar' (approximate randomization).
    n_samples: Bootstrap resamples or randomization trials; 0: sacreBLEU's
      defaults (1000 and 10000). An interval always comes from 1000 resamples at
      least.

  Returns:
    A JSON-able dict: the test, samples, seed, split, sentence count, sacreBLEU's
    signatures and, per system, {metric: {score, mean, ci, p_value}} (p_value
    None for the baseline) and whether it differs significantly at `ALPHA`.
    Metrics are named as sacreBLEU names them ('BLEU', 'chrF2'), the lowercased
    BLEU 'BLEU-lc'.
  """
  if test not in TESTS:
    raise InvalidInput(f'test={test!r}: expected one of {sorted(TESTS)}.')
  if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 0:
    raise InvalidInput(f"n_samples={n_samples!r} must be an integer >= 0 (0: sacreBLEU's default).")
  check_comparable(systems)
  named = [(system.name, system.hypotheses) for system in systems]
  # One test per metric, so that the lowercased BLEU keeps a name of its own. Each test draws
  # the same resamples for a system (its generator is seeded anew per system), so the results
  # equal those of one test over all the metrics.
  signatures, table = {}, {}
  for metric, scorer in _sacrebleu_metrics(metrics).items():
    paired = PairedTest(
      named,
      {metric: scorer},
      [systems[0].references],
      test_type=test,
      n_samples=n_samples,
      n_ar_confidence=0,
    )
    if paired._seed == 0:  # sacreBLEU passes `seed or None` to its tests.
      raise InvalidInput(
        "SACREBLEU_SEED=0 leaves sacreBLEU's paired tests unseeded (it reads 0 "
        'as no seed): choose another seed.'
      )
    metric_signatures, metric_table = paired()
    [(name, signature)] = metric_signatures.items()  # sacreBLEU's: 'BLEU', 'chrF2'.
    name = _RENAMED.get(metric, name)
    signatures[name] = signature
    table[name] = metric_table[next(k for k in metric_table if k != 'System')]
  metric_names = list(table)
  rows = []
  for index, system in enumerate(systems):
    # sacreBLEU's bootstrap test gives translations identical to the baseline's its smallest
    # p-value, 1 / (n_samples + 1): no resample differs, and it counts only larger differences.
    identical = index > 0 and system.hypotheses == systems[0].hypotheses
    scores = {}
    for metric in metric_names:
      result = table[metric][index]
      p_value = 1.0 if identical else _float(result.p_value)
      scores[metric] = {
        'score': result.score,
        'mean': _float(result.mean),
        'ci': _float(result.ci),
        'p_value': p_value,
      }
      if index > 0:
        scores[metric]['significant'] = p_value < ALPHA
    rows.append(
      {
        'name': system.name,
        'result': system.result_path,
        'scores': scores,
        'identical_to_baseline': identical,
      }
    )
  return {
    # The seed as sacreBLEU's signatures give it ('none' for SACREBLEU_SEED=none: unseeded).
    'test': test,
    'n_samples': paired.n_samples,
    'seed': str(paired._seed).lower(),
    'alpha': ALPHA,
    'split': systems[0].split,
    'num_sentences': len(systems[0].references),
    'references': systems[0].references_path,
    'signatures': {name: str(sig) for name, sig in signatures.items()},
    'systems': rows,
  }


def _float(value: Any) -> float | None:
  return None if value is None else float(value)


def _with_ci(values: dict[str, Any]) -> str:
  text = f'{values["score"]:.2f}'
  return text + (f' ± {values["ci"]:.2f}' if values['ci'] is not None else '')


def seed_test(
  reference: Sequence[float], other: Sequence[float], alpha: float = 0.05
) -> dict[str, Any]:
  """Welch's t-test of two systems' per-seed scores (e.g. eval.py BLEU of each seed).

  Two-sided, unequal variances: is the difference of the means larger than the
  spread between training runs explains? `p_value` is None with fewer than two
  seeds on a side, or when no seed of either differs from its mean (no spread to
  test against).
  """
  difference = sum(other) / len(other) - sum(reference) / len(reference)
  p_value = None
  spread = (
    len(reference) > 1
    and len(other) > 1
    and (max(reference) > min(reference) or max(other) > min(other))
  )
  if spread:
    import scipy.stats  # pylint: disable=g-import-not-at-top  (a second of every sweep.py start)

    p_value = float(scipy.stats.ttest_ind(other, reference, equal_var=False).pvalue)
  return {
    'difference': difference,
    'p_value': p_value,
    'significant': p_value is not None and p_value < alpha,
    'alpha': alpha,
  }


# eval.py's key of each metric's corpus score in its result .json, and the name `compare` gives it.
_RESULT_KEYS = {'bleu': 'bleu', 'chrf': 'chrf', 'bleu_lc': 'bleu_lc'}
_NAMES = {'bleu': 'BLEU', 'chrf': 'chrF2', 'bleu_lc': _RENAMED['bleu_lc']}


def compare_seeds(
  groups: Sequence[tuple[str, Sequence[System]]], metrics: Sequence[str] = DEFAULT_METRICS
) -> dict[str, Any]:
  """Across seeds: each (name, its seeds' results) group's scores; `seed_test` against the first.

  The per-seed scores are the ones eval.py wrote into each result's .json.
  Returns a JSON-able dict: per group {metric: {scores, mean, std, difference,
  p_value, significant}} (no test for the baseline, the first group).
  """
  _sacrebleu_metrics(metrics)  # Checks the names.
  rows = []
  for name, systems in groups:
    scores = {}
    for metric in metrics:
      key = _RESULT_KEYS[metric]
      values = []
      for system in systems:
        if key not in system.results:
          raise InvalidInput(
            f'{system.result_path} has no {key!r} score (written by an eval.py from before it '
            'was reported?): evaluate that checkpoint again.'
          )
        values.append(float(system.results[key]))
      mean = sum(values) / len(values)
      std = (
        math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        if len(values) > 1
        else None
      )
      scores[_NAMES[metric]] = {'scores': values, 'mean': mean, 'std': std}
    rows.append({'name': name, 'seeds': len(systems), 'scores': scores})
  baseline = rows[0]
  for row in rows[1:]:
    for metric, values in row['scores'].items():
      values.update(seed_test(baseline['scores'][metric]['scores'], values['scores'], ALPHA))
      del values['alpha']
  return {'test': "Welch's t-test (two-sided, unequal variances)", 'alpha': ALPHA, 'systems': rows}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  """Lines of left-aligned columns, as wide as their widest cell."""
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  return [
    '  '.join(cell.ljust(width) for cell, width in zip(r, widths, strict=True)).rstrip()
    for r in [header, *rows]
  ]


def seeds_to_text(across: dict[str, Any]) -> str:
  """The across-seeds table (mean ± std, p-value per metric) and its verdicts in words."""
  metrics = list(across['systems'][0]['scores'])
  header = ['system', 'seeds'] + [f'{m} (mean ± std)' for m in metrics]
  header += [f'p ({m})' for m in metrics]
  rows, sentences = [], []
  for index, row in enumerate(across['systems']):
    cells = [row['name'] + (' (baseline)' if index == 0 else ''), str(row['seeds'])]
    for m in metrics:
      values = row['scores'][m]
      std = f' ± {values["std"]:.2f}' if values['std'] is not None else ''
      cells.append(f'{values["mean"]:.2f}{std}')
    for m in metrics:
      values = row['scores'][m]
      if index == 0:
        cells.append('-')
      elif values['p_value'] is None:
        cells.append('n/a')
      else:
        cells.append(f'{values["p_value"]:.4f}' + ('*' if values['significant'] else ''))
      if index > 0:
        if values['p_value'] is None:
          verdict = 'no test (fewer than 2 seeds a side, or no spread)'
        else:
          word = 'significant' if values['significant'] else 'not significant'
          verdict = f'p = {values["p_value"]:.4f}: {word} at {across["alpha"]}'
        sentences.append(
          f'{row["name"]}: {m} {values["difference"]:+.2f} against the baseline across '
          f'{row["seeds"]} seeds, {verdict}.'
        )
    rows.append(cells)
  table = _table(header, rows)
  title = f'Across seeds, {across["test"]}; * significant at {across["alpha"]}:'
  return '\n'.join([title, *table, '', *sentences]) + '\n'


def verdicts(comparison: dict[str, Any]) -> list[str]:
  """One sentence per system and metric: its difference to the baseline and whether significant."""
  baseline = comparison['systems'][0]
  sentences = []
  for row in comparison['systems'][1:]:
    if row['identical_to_baseline']:
      sentences.append(f'{row["name"]}: the same translations as the baseline (p = 1).')
      continue
    for metric, values in row['scores'].items():
      difference = values['score'] - baseline['scores'][metric]['score']
      verdict = 'significant' if values['significant'] else 'not significant'
      sentences.append(
        f'{row["name"]}: {metric} {difference:+.2f} against the baseline, '
        f'p = {values["p_value"]:.4f}: {verdict} at {comparison["alpha"]}.'
      )
  return sentences


def to_text(comparison: dict[str, Any]) -> str:
  """A table (score ± 95% interval, p-value per metric) and the verdicts in words."""
  metrics = list(comparison['systems'][0]['scores'])
  header = ['system'] + [f'{m} (± 95% CI)' for m in metrics] + [f'p ({m})' for m in metrics]
  rows = []
  for index, row in enumerate(comparison['systems']):
    name = row['name'] + (' (baseline)' if index == 0 else '')
    p_values = [
      (
        '-'
        if index == 0
        else f'{row["scores"][m]["p_value"]:.4f}' + ('*' if row['scores'][m]['significant'] else '')
      )
      for m in metrics
    ]
    rows.append([name] + [_with_ci(row['scores'][m]) for m in metrics] + p_values)
  table = _table(header, rows)
  title = (
    f'{TESTS[comparison["test"]].capitalize()} ({comparison["n_samples"]} samples, '
    f'seed {comparison["seed"]}) on {comparison["split"]} '
    f'({comparison["num_sentences"]} sentences); * significant at {comparison["alpha"]}:'
  )
  return '\n'.join([title, *table, '', *verdicts(comparison)]) + '\n'
