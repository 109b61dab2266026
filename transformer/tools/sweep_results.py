"""A sweep's results, read back from the trials' workdirs: one row per trial or per configuration.

`collect` reads what a trial left in its workdir (trial.json, metrics.jsonl,
eval/*.json) into a `TrialResult`, so the results can be read at any time, also
while trials run; `rank` orders them by `config.target_metric`. A sweep run
with seeds (`sweep.py --seeds=N`) has one `GroupResult` per configuration
(`group`, `rank_groups`): its trials, one per seed, and their statistics.
`sweep_summary` writes them as tables, `sweep_plots` draws them and
`sweep_tests` tests them against each other.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from transformer import metrics, ranking, storage
from transformer.tools import sweep_runner, sweeps


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
  # A last line cut short (being written by a running trial) is left out.
  return metrics.read_rows(storage.join(workdir, metrics.FILENAME))


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
    scores = storage.read_json(
      storage.join(workdir, decode_result), 'Delete it and run sweep.py again to score it anew.'
    )
    result.decode_bleu, result.decode_bleu_lc = scores.get('bleu'), scores.get('bleu_lc')
    result.decode_result = decode_result
  return result


def rank(results: list[TrialResult], target_metric: str) -> list[TrialResult]:
  """Best first by the target metric; trials without it keep their order after the others,
  as do pruned ones (an Optuna study's: stopped early, their numbers are not final)."""
  metric = ranking.METRICS[target_metric]
  column, higher_is_better = metric.summary_column, metric.higher_is_better
  scored = [r for r in results if getattr(r, column) is not None and r.status != 'pruned']
  scored.sort(key=lambda r: getattr(r, column), reverse=higher_is_better)
  for position, result in enumerate(scored, start=1):
    result.rank = position
  return scored + [r for r in results if r.rank is None]


# --- Seeds: one row per configuration ---------------------------------------------------------

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
  metric = ranking.METRICS[target_metric]
  column, higher_is_better = metric.summary_column, metric.higher_is_better
  scored = [g for g in groups if g.values(column)]
  scored.sort(key=lambda g: g.stats(column)['mean'], reverse=higher_is_better)
  for position, result in enumerate(scored, start=1):
    result.rank = position
  return scored + [g for g in groups if not g.values(column)]
