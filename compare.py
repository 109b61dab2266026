"""Tests whether eval.py results differ significantly: `python compare.py BASELINE OTHER...`.

  python compare.py workdirs/base/eval/step_300-validation.json \
      workdirs/rope/eval/step_300-validation.json [--test=ar] [--n_samples=N]

Each argument is an eval.py translation result (the .json eval.py writes per checkpoint and
split, WORKDIR/eval/LABEL-SPLIT[-TAG].json, not the .txt of translations beside it) or a
workdir holding exactly one (of --split), or the results of several seeds of one system,
comma-separated:

  python compare.py A0.json,A1.json,A2.json B0.json,B1.json,B2.json

(an argument that is itself an existing path is one result, commas and all: the workdir of a
sweep trial named `vocab_size=4000,num_train_steps=3200`). Each result is named once: the same
file named twice (however spelled, or as a workdir and its result) is refused.

Then seed k of each system is paired with seed k of the baseline and one paired test
resamples the sentences of all of them (pooled), and Welch's t-test compares the
per-seed scores: how much more the systems differ than training runs do.

Prints every system's BLEU and chrF (--metrics; also bleu_lc, BLEU
on lowercased text) with its bootstrap 95% confidence interval, the p-value of
sacreBLEU's paired test against the first system (the baseline) and, in words,
which differences are significant at 0.05.
The systems must have been scored on the same split against the same references.
SACREBLEU_SEED (default 12345) seeds the test, as it does sacreBLEU's own
`sacrebleu REFERENCES -i A.txt B.txt --paired-bs`, which gives the same p-values.
"""

import json

from absl import app, flags, logging

from transformer import errors, outputs, path_checks, storage
from transformer.errors import InvalidInput
from transformer.tools import significance

_SPLIT = flags.DEFINE_string('split', None, 'Pick the result of this split in a workdir.')
_TEST = flags.DEFINE_enum(
  'test',
  'bs',
  list(significance.TESTS),
  'bs: paired bootstrap resampling; ar: approximate randomization.',
)
_N_SAMPLES = flags.DEFINE_integer(
  'n_samples', 0, "Resamples (bs) or trials (ar); 0: sacreBLEU's defaults, 1000 and 10000."
)
_METRICS = flags.DEFINE_list(
  'metrics',
  list(significance.DEFAULT_METRICS),
  'Metrics to test: bleu, chrf, bleu_lc (BLEU on lowercased text, as Multi30k papers report).',
)
_OUTPUT = flags.DEFINE_string('output', None, 'Also write the comparison to this JSON file.')


def _seed_results(arg: str) -> list[str]:
  """The results one argument names: itself if it exists, else its comma-separated seeds'."""
  return [arg] if storage.exists(arg) else arg.split(',')


def _metrics(systems) -> list[str]:
  """--metrics; by default 'bleu_lc' for 'bleu' when a system's translations are case-folded."""
  folded = [system.name for system in systems if significance.case_folded(system)]
  metrics = list(_METRICS.value)
  if not folded or 'bleu' not in metrics:
    return metrics
  names = ', '.join(folded)
  if flags.FLAGS['metrics'].present:
    logging.warning(
      'The translations of %s are all lowercase (a case-folding vocabulary) and the '
      'references are not: cased BLEU counts every capital against them. Add bleu_lc to '
      '--metrics to compare them.',
      names,
    )
    return metrics
  print(
    f'The translations of {names} are all lowercase (a case-folding vocabulary) and the '
    'references are not: comparing lowercased BLEU (bleu_lc) instead of cased BLEU (pass '
    '--metrics to choose).'
  )
  return ['bleu_lc' if metric == 'bleu' else metric for metric in metrics]


def main(argv):
  paths = argv[1:]
  if len(paths) < 2:
    raise app.UsageError(
      'Name at least two eval.py results (or workdirs); the first is the baseline.'
    )
  if _N_SAMPLES.value < 0:
    raise app.UsageError(f'--n_samples={_N_SAMPLES.value} must be >= 0 (0: sacreBLEU defaults).')
  for index, arg in enumerate(paths, start=1):  # Each form (and its credentials) before a look.
    if problems := [
      e for path in arg.split(',') for e in storage.path_errors(path, f'result {index}')
    ]:
      raise InvalidInput(problems[0])
  groups = [_seed_results(arg) for arg in paths]
  if any(len(group) > 1 for group in groups) and len({len(g) for g in groups}) > 1:
    counts = ', '.join(f'{len(g)} in {arg!r}' for g, arg in zip(groups, paths, strict=True))
    raise app.UsageError(
      f'Every system needs as many seeds as the others ({counts}): seed k of each is paired '
      'with seed k of the baseline.'
    )
  if _OUTPUT.value is not None:  # Never one of the results it reads, nor a file of a run.
    results = [path for group in groups for path in group]
    inputs = {f'result {i}': path for i, path in enumerate(results, start=1)}
    if errors := path_checks.output_errors(_OUTPUT.value, '--output', inputs):
      raise app.UsageError('\n'.join(errors))
  if _N_SAMPLES.value and significance.smallest_p_value(_N_SAMPLES.value) >= significance.ALPHA:
    logging.warning(
      '--n_samples=%d: the smallest p-value %d samples can give is 1/%d = %.3f, not below %g, so '
      "no difference can be significant. Use at least %d (0: sacreBLEU's 1000 or 10000).",
      _N_SAMPLES.value,
      _N_SAMPLES.value,
      _N_SAMPLES.value + 1,
      significance.smallest_p_value(_N_SAMPLES.value),
      significance.ALPHA,
      round(1 / significance.ALPHA),
    )
  seeds = [[significance.load_system(path, _SPLIT.value) for path in g] for g in groups]
  significance.check_distinct([system for results in seeds for system in results])
  systems = [
    significance.pool(arg, results) if len(results) > 1 else results[0]
    for arg, results in zip(paths, seeds, strict=True)
  ]
  comparison = significance.compare(systems, _metrics(systems), _TEST.value, _N_SAMPLES.value)
  text = significance.to_text(comparison)
  if len(seeds[0]) > 1:
    comparison['across_seeds'] = significance.compare_seeds(
      list(zip(paths, seeds, strict=True)), _METRICS.value
    )
    text += '\n' + significance.seeds_to_text(comparison['across_seeds'])
  print(text, end='')
  if _OUTPUT.value:
    outputs.write(_OUTPUT.value, json.dumps(comparison, indent=2), '--output')


if __name__ == '__main__':
  errors.run(main)
