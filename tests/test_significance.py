"""Confidence intervals and paired tests: compare.py against sacreBLEU's own command line."""

import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import scipy.stats
from conftest import synthetic_pairs, write_lines

from transformer import scoring
from transformer.tools import significance

REPO = Path(__file__).resolve().parents[1]
# sacreBLEU's command line, through this interpreter: no `sacrebleu` on PATH (no activated
# environment) is needed, and a missing package fails these tests, not the collection.
SACREBLEU = [sys.executable, '-m', 'sacrebleu']
# Word-drop rates of the systems: the baseline, one close to it, one far better.
DROP_RATES = {'base': 0.30, 'close': 0.29, 'better': 0.15}


def _hypotheses(references, drop_rate, seed):
  rng = random.Random(seed)
  return [' '.join(w for w in r.split() if rng.random() > drop_rate) for r in references]


def _write_result(workdir, references, hypotheses, split='validation', **results):
  """An eval.py result as eval.py lays it out: .json, .txt and the references beside them."""
  out = workdir / 'eval'
  write_lines(out / f'references-{split}.txt', references)
  write_lines(out / f'step_10-{split}.txt', hypotheses)
  scored = [h for i, h in enumerate(hypotheses, 1) if i not in results.get('unscored_lines', [])]
  scores = scoring.corpus_scores(scored, references) | {'split': split} | results
  (out / f'step_10-{split}.json').write_text(json.dumps(scores))
  return out / f'step_10-{split}.json'


@pytest.fixture
def systems(tmp_path):
  """{name: result .json} of three systems on one synthetic validation set of 200 sentences."""
  references = [de for _, de in synthetic_pairs(200, seed=5)]
  return {
    name: _write_result(tmp_path / name, references, _hypotheses(references, rate, i))
    for i, (name, rate) in enumerate(DROP_RATES.items())
  }


def _sacrebleu_cli(systems, *args):
  txt = [str(systems[name]).replace('.json', '.txt') for name in DROP_RATES]
  references = systems['base'].parent / 'references-validation.txt'
  result = subprocess.run(
    [*SACREBLEU, str(references), '-i', *txt, *args],
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, 'SACREBLEU_SEED': '12345'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout


def _compare(systems, **kwargs):
  loaded = [significance.load_system(str(systems[name])) for name in DROP_RATES]
  return significance.compare(loaded, **kwargs)


def test_paired_bootstrap_p_values_are_sacrebleus_command_line_ones(systems, monkeypatch):
  monkeypatch.setenv('SACREBLEU_SEED', '12345')
  comparison = _compare(systems, test='bs')
  cli = json.loads(_sacrebleu_cli(systems, '--paired-bs', '-m', 'bleu', '-f', 'json'))
  rows = comparison['systems']
  assert [row['scores']['BLEU']['p_value'] for row in rows] == pytest.approx(
    [system['BLEU']['p_value'] for system in cli], abs=1e-12, nan_ok=False
  )
  for ours, theirs in zip(rows, cli, strict=True):
    assert ours['scores']['BLEU']['ci'] == pytest.approx(theirs['BLEU']['ci'], abs=1e-9)
  # The close system is not significantly different, the better one is.
  assert (
    rows[1]['scores']['BLEU']['p_value'] > 0.05 and not rows[1]['scores']['BLEU']['significant']
  )
  assert rows[2]['scores']['BLEU']['p_value'] < 0.05 and rows[2]['scores']['BLEU']['significant']
  # chrF: sacreBLEU's JSON output cannot write its float32 values; its table has 4 digits.
  table = _sacrebleu_cli(systems, '--paired-bs', '-m', 'chrf', '-f', 'text')
  cli_p = [float(p) for p in re.findall(r'\(p = ([0-9.]+)\)', table)]
  assert cli_p == [round(row['scores']['chrF2']['p_value'], 4) for row in rows[1:]]
  # The baseline's interval is the one eval.py wrote into its result file.
  written = json.loads(systems['base'].read_text())
  baseline = significance.load_system(str(systems['base']))
  ci = scoring.corpus_scores(baseline.hypotheses, baseline.references, 1000)
  assert rows[0]['scores']['BLEU']['ci'] == pytest.approx(ci['bleu_ci'], abs=1e-9)
  assert rows[0]['scores']['BLEU']['score'] == pytest.approx(written['bleu'], abs=1e-9)


def test_lowercased_bleu_is_tested_as_sacrebleus_command_line_lc(systems, monkeypatch):
  monkeypatch.setenv('SACREBLEU_SEED', '12345')
  comparison = _compare(systems, metrics=['bleu', 'bleu_lc'], test='bs')
  cli = json.loads(_sacrebleu_cli(systems, '--paired-bs', '-m', 'bleu', '-lc', '-f', 'json'))
  rows = comparison['systems']
  assert [row['scores']['BLEU-lc']['p_value'] for row in rows] == pytest.approx(
    [system['BLEU']['p_value'] for system in cli], abs=1e-12, nan_ok=False
  )
  for ours, theirs in zip(rows, cli, strict=True):
    assert ours['scores']['BLEU-lc']['score'] == pytest.approx(theirs['BLEU']['score'], abs=1e-9)
    assert ours['scores']['BLEU-lc']['ci'] == pytest.approx(theirs['BLEU']['ci'], abs=1e-9)
  assert '|case:lc|' in comparison['signatures']['BLEU-lc']
  assert '|case:mixed|' in comparison['signatures']['BLEU']
  # Adding a metric leaves the others' results as they were (the same resamples per system).
  assert _compare(systems, metrics=['bleu'], test='bs')['systems'] == [
    {**row, 'scores': {'BLEU': row['scores']['BLEU']}} for row in rows
  ]
  # The lowercased BLEU that eval.py writes is the score tested here.
  written = json.loads(systems['base'].read_text())
  assert rows[0]['scores']['BLEU-lc']['score'] == pytest.approx(written['bleu_lc'], abs=1e-9)
  # The base's translations in lower case (the made-up German is upper case): as good lowercased,
  # far worse cased.
  base = significance.load_system(str(systems['base']))
  lowered = [h.lower() for h in base.hypotheses]
  path = _write_result(systems['base'].parent.parent / 'lower', base.references, lowered)
  [_, lower] = significance.compare(
    [base, significance.load_system(str(path))], metrics=['bleu', 'bleu_lc']
  )['systems']
  assert lower['scores']['BLEU-lc']['score'] == pytest.approx(written['bleu_lc'], abs=1e-9)
  assert lower['scores']['BLEU']['score'] < written['bleu'] / 2


def test_approximate_randomization_p_values_are_sacrebleus(systems, monkeypatch):
  monkeypatch.setenv('SACREBLEU_SEED', '12345')
  comparison = _compare(systems, metrics=['bleu'], test='ar', n_samples=500)
  cli = json.loads(_sacrebleu_cli(systems, '--paired-ar', '--paired-ar-n', '500', '-f', 'json'))
  assert [row['scores']['BLEU']['p_value'] for row in comparison['systems'][1:]] == (
    pytest.approx([system['BLEU']['p_value'] for system in cli[1:]], abs=1e-12)
  )
  assert comparison['n_samples'] == 500 and comparison['test'] == 'ar'


def test_compare_py_reports_intervals_p_values_and_verdicts(systems, tmp_path):
  out = tmp_path / 'comparison.json'
  command = [
    sys.executable,
    'compare.py',
    str(systems['base'].parent.parent),
    str(systems['close']),
    str(systems['better']),
    f'--output={out}',
  ]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0].startswith(
    'Paired bootstrap resampling (1000 samples, seed 12345) on validation (200 sentences)'
  )
  assert re.search(
    r'base \(baseline\) +\d+\.\d\d ± \d+\.\d\d +\d+\.\d\d ± \d+\.\d\d +- +-$', lines[2]
  ), lines[2]
  assert re.search(
    r'BLEU [+-]\d+\.\d\d against the baseline, p = 0\.\d{4}: not significant '
    r'at 0.05\.$',
    lines[6],
  ), lines[6]
  assert re.search(
    r'better/eval/step_10-validation.json: BLEU \+\d+\.\d\d against the '
    r'baseline, p = 0\.\d{4}: significant at 0.05\.$',
    lines[8],
  ), lines[8]
  written = json.loads(out.read_text())
  assert [row['name'] for row in written['systems']] == [
    str(systems['base'].parent.parent),
    str(systems['close']),
    str(systems['better']),
  ]


def test_a_result_whose_path_has_commas_is_one_system(systems, tmp_path):
  """A sweep trial's workdir is named by its overrides, commas included (`a=1,b=2`)."""
  trial = tmp_path / 'sweep' / 'vocab_size=4000,num_train_steps=3200'
  shutil.copytree(systems['better'].parent.parent, trial)
  command = [sys.executable, 'compare.py', str(systems['base']), str(trial), str(systems['close'])]
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert re.search(
    r'/vocab_size=4000,num_train_steps=3200: BLEU \+\d+\.\d\d against the '
    r'baseline, p = 0\.\d{4}: significant at 0.05\.$',
    result.stdout,
    re.MULTILINE,
  ), result.stdout


def test_unscored_lines_are_left_out(tmp_path, systems, monkeypatch):
  monkeypatch.setenv('SACREBLEU_SEED', '12345')
  base = significance.load_system(str(systems['base']))
  # As eval.py writes an empty line for an empty source line and leaves it out of the scores.
  hypotheses = base.hypotheses[:3] + [''] + base.hypotheses[3:]
  path = _write_result(tmp_path / 'gap', base.references, hypotheses, unscored_lines=[4])
  loaded = significance.load_system(str(path))
  assert loaded.hypotheses == base.hypotheses
  comparison = significance.compare([base, loaded])
  assert comparison['systems'][1]['identical_to_baseline']
  assert comparison['systems'][1]['scores']['BLEU']['p_value'] == 1.0
  assert significance.verdicts(comparison) == [
    f'{path}: the same translations as the baseline (p = 1).'
  ]


@pytest.mark.parametrize('what', ['split', 'line count', 'references'])
def test_incomparable_results_are_refused_naming_both_files(tmp_path, systems, what):
  references = [de for _, de in synthetic_pairs(200, seed=5)]
  hypotheses = _hypotheses(references, 0.2, 7)
  if what == 'split':
    other = _write_result(tmp_path / 'other', references, hypotheses, split='test')
    message = r"score different splits \('validation' and 'test'\)"
  elif what == 'line count':
    other = _write_result(tmp_path / 'other', references[:-1], hypotheses[:-1])
    message = r'differ in line count \(200 and 199 scored lines\)'
  else:
    references[10] = 'SOMETHING ELSE .'
    other = _write_result(tmp_path / 'other', references, hypotheses)
    message = r'differ \(first at line 11\)'
  loaded = [significance.load_system(str(path)) for path in (systems['base'], other)]
  with pytest.raises(ValueError, match=message) as raised:
    significance.compare(loaded)
  base_dir, other_dir = str(systems['base'].parent), str(other.parent)
  assert base_dir in str(raised.value) and other_dir in str(raised.value)


def test_bad_inputs_are_clear_errors(tmp_path, systems, monkeypatch):
  second = systems['base'].parent / 'step_20-validation.json'
  shutil.copy(systems['base'], second)
  with pytest.raises(
    ValueError,
    match=r'holds 2 eval.py translation results.*step_10-validation'
    r'.json, step_20-validation.json\); name the .json',
  ):
    significance.load_system(str(systems['base'].parent.parent))
  (systems['close'].parent / 'references-validation.txt').unlink()
  with pytest.raises(FileNotFoundError, match='references-validation.txt is missing'):
    significance.load_system(str(systems['close']))
  base = significance.load_system(str(systems['base']))
  with pytest.raises(ValueError, match='at least 2 systems'):
    significance.compare([base])
  with pytest.raises(ValueError, match=r"metrics=\['ter'\]"):
    significance.compare([base, base], metrics=['ter'])
  with pytest.raises(ValueError, match='n_samples=-1 must be an integer >= 0'):
    significance.compare([base, base], n_samples=-1)
  monkeypatch.setenv('SACREBLEU_SEED', '0')
  with pytest.raises(ValueError, match='SACREBLEU_SEED=0 leaves sacreBLEU'):
    significance.compare([base, base])
  with pytest.raises(ValueError, match='n_bootstrap=0 must be an integer >= 1'):
    scoring.corpus_scores(['a'], ['a'], n_bootstrap=0)


def test_scores_carry_seeded_intervals():
  references = [de for _, de in synthetic_pairs(100, seed=1)]
  hypotheses = _hypotheses(references, 0.2, 0)
  scores = scoring.corpus_scores(hypotheses, references, n_bootstrap=200)
  assert scores == scoring.corpus_scores(hypotheses, references, n_bootstrap=200)
  assert 0 < scores['bleu_ci'] < 10 and 0 < scores['chrf_ci'] < 10
  assert abs(scores['bleu_bootstrap_mean'] - scores['bleu']) < scores['bleu_ci']
  assert scores['bleu_signature'].startswith('nrefs:1|bs:200|seed:12345|')
  # BLEU on lowercased text, as `sacrebleu -lc` gives it, with its interval.
  lowered = [h.lower() for h in hypotheses]
  assert scores['bleu_lc'] == pytest.approx(scores['bleu'], abs=1e-9)  # The same case as the refs.
  lower = scoring.corpus_scores(lowered, references, n_bootstrap=200)
  assert lower['bleu_lc'] == pytest.approx(scores['bleu_lc'], abs=1e-9)
  assert lower['bleu'] < scores['bleu'] / 2 and 0 < lower['bleu_lc_ci'] < 10
  assert scores['bleu_lc_signature'].startswith('nrefs:1|bs:200|seed:12345|case:lc|')
  assert scoring.format_score(scores, 'bleu') == f'{scores["bleu"]:.2f} ± {scores["bleu_ci"]:.2f}'
  plain = scoring.corpus_scores(hypotheses, references)
  assert plain['bleu'] == scores['bleu'] and 'bleu_ci' not in plain
  assert scoring.format_score(plain, 'bleu') == f'{plain["bleu"]:.2f}'
  split = scoring.tokenized_compound_split_scores(hypotheses, references, 'de', n_bootstrap=200)
  assert split['bleu_tokenized_compound_split_ci'] > 0


def test_seed_test_is_welchs_t_test():
  # R: t.test(c(4, 5, 6), c(1, 2, 3)) gives t = 3.6742, df = 4, p-value = 0.02131.
  test = significance.seed_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
  assert test['difference'] == 3.0
  assert test['p_value'] == pytest.approx(0.02131, abs=5e-6) and test['significant']
  # Unequal variances: the Welch-Satterthwaite degrees of freedom, by hand.
  reference, other = [8.69, 8.70, 8.75], [8.68, 12.22, 8.61]
  v_ref, v_other = (sum((x - sum(v) / 3) ** 2 for x in v) / 2 / 3 for v in (reference, other))
  t = (sum(other) - sum(reference)) / 3 / math.sqrt(v_ref + v_other)
  df = (v_ref + v_other) ** 2 / (v_ref**2 / 2 + v_other**2 / 2)
  test = significance.seed_test(reference, other)
  assert test['p_value'] == pytest.approx(2 * scipy.stats.t.sf(abs(t), df), rel=1e-9)
  assert 0.4 < test['p_value'] < 0.5 and not test['significant']  # One lucky seed.
  # Nothing to test: one seed a side, or no spread at all.
  assert significance.seed_test([1.0], [2.0, 3.0])['p_value'] is None
  assert significance.seed_test([1.0, 1.0], [2.0, 2.0])['p_value'] is None
  assert not significance.seed_test([1.0, 1.0], [2.0, 2.0])['significant']


def test_compare_py_with_seeds_pools_the_pairs_and_tests_across_seeds(tmp_path):
  """Comma-separated results are one system's seeds: pooled paired test, then Welch's test."""
  references = [de for _, de in synthetic_pairs(120, seed=7)]
  rates = {'base': (0.30, 0.32, 0.31), 'better': (0.10, 0.12, 0.11)}
  results = {
    name: [
      _write_result(tmp_path / f'{name}{seed}', references, _hypotheses(references, rate, seed))
      for seed, rate in enumerate(seed_rates)
    ]
    for name, seed_rates in rates.items()
  }
  args = [','.join(map(str, results[name])) for name in rates]
  out = tmp_path / 'comparison.json'
  command = [sys.executable, 'compare.py', *args, '--metrics=bleu,bleu_lc', f'--output={out}']
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  written = json.loads(out.read_text())
  # The paired test saw the three seeds' sentences one after another.
  assert written['num_sentences'] == 3 * 120
  pooled = significance.compare(
    [
      significance.pool(args[0], [significance.load_system(str(p)) for p in results['base']]),
      significance.pool(args[1], [significance.load_system(str(p)) for p in results['better']]),
    ],
    ['bleu', 'bleu_lc'],
  )
  assert written['systems'] == pooled['systems']
  # Across seeds: each seed's own .json score, and Welch's test of them.
  per_seed = {
    name: [json.loads(p.read_text())['bleu'] for p in paths] for name, paths in results.items()
  }
  across = written['across_seeds']['systems']
  assert [row['seeds'] for row in across] == [3, 3]
  assert across[0]['scores']['BLEU']['scores'] == per_seed['base']
  better = across[1]['scores']['BLEU']
  assert better['scores'] == per_seed['better']
  assert better['std'] == pytest.approx(statistics.stdev(per_seed['better']))
  expected = significance.seed_test(per_seed['base'], per_seed['better'])
  assert (better['difference'], better['p_value']) == (expected['difference'], expected['p_value'])
  assert better['significant'] and better['p_value'] < 0.05
  assert 'BLEU-lc' in across[1]['scores']
  lines = result.stdout.splitlines()
  assert "Across seeds, Welch's t-test (two-sided, unequal variances)" in result.stdout
  assert re.search(
    r'BLEU \+\d+\.\d\d against the baseline across 3 seeds, p = 0\.\d{4}: '
    r'significant at 0\.05\.$',
    lines[-2] if 'BLEU-lc' in lines[-1] else lines[-1],
  )

  # Unequal seed counts cannot be paired: the error names both, last, before any work.
  bad = subprocess.run(
    [sys.executable, 'compare.py', args[0], ','.join(map(str, results['better'][:2]))],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert bad.returncode != 0
  assert 'needs as many seeds as the others (3 in' in bad.stderr.strip().splitlines()[-1]
