"""The metrics a run is ranked by, with their directions: one registry every ranking reads.

Who ranks what by which `Metric`:
- a sweep ranks its trials (summary tables, plots, TensorBoard's hparams, an Optuna study's
  direction) by `config.target_metric`, any of `METRICS`, in its summary column;
- within one run, the best checkpoints (`best_checkpoints.BestCheckpoints`, eval.py's
  `best` and `avg_best:N`) and early stopping (`runs.EarlyStopping`) rank evaluations by a
  validation BLEU, `selection_metric(config.target_metric)`: the lowercased one where the
  run targets it, else the cased one (also in a run whose sweep ranks by loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Metric:
  """A row key of metrics.jsonl that ranks runs or checkpoints."""

  name: str  # Its key in WORKDIR/metrics.jsonl's evaluation rows.
  higher_is_better: bool
  summary_column: str  # The sweep summary's column that ranks trials by it (`sweep_results`).
  source: str  # What computes it.

  @property
  def direction(self) -> str:
    """Optuna's word for it: 'maximize' or 'minimize'."""
    return 'maximize' if self.higher_is_better else 'minimize'

  @property
  def summary_how(self) -> str:
    """How a trial's summary value is taken from its evaluations."""
    return 'highest best' if self.higher_is_better else 'lowest final'

  def improves(self, value: float, best: float | None) -> bool:
    """Whether `value` beats `best` (None: nothing yet); a tie does not."""
    if best is None:
      return True
    return value > best if self.higher_is_better else value < best

  def best_first(self, scores: Mapping[int, float]) -> dict[int, float]:
    """{step: value} ordered best first; ties: the earlier step first."""
    sign = -1 if self.higher_is_better else 1
    return dict(sorted(scores.items(), key=lambda item: (sign * item[1], item[0])))


METRICS: dict[str, Metric] = {
  m.name: m
  for m in (
    Metric(
      'eval_bleu',
      True,
      'best_eval_bleu',
      'sacreBLEU of config.eval_bleu_sentences validation sentences, at each evaluation',
    ),
    Metric(
      'eval_bleu_lc',
      True,
      'best_eval_bleu_lc',
      "the same BLEU on lowercased text (the Multi30k papers' score)",
    ),
    Metric(
      'eval_loss', False, 'eval_loss', 'the validation loss (label-smoothed), every evaluation'
    ),
  )
}
# What `config.target_metric` may be.
TARGET_METRICS = tuple(METRICS)
# What best checkpoints and early stopping rank by (`selection_metric`); both are stored with
# each best checkpoint (runs before eval_bleu_lc stored eval_bleu alone).
SELECTION_METRICS = ('eval_bleu', 'eval_bleu_lc')  # The validation BLEUs.


def selection_metric(target_metric: str) -> str:
  """The validation BLEU that keeps the best checkpoints and stops early, by `target_metric`.

  `eval_bleu_lc` (BLEU on lowercased text) where the run targets it, else the cased
  `eval_bleu`: selection ranks by a BLEU, also in a run whose sweep ranks by loss.
  """
  return 'eval_bleu_lc' if target_metric == 'eval_bleu_lc' else 'eval_bleu'
