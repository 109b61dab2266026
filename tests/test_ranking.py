"""The metric registry every ranking reads: names, directions, summary columns."""

import dataclasses

from transformer import ranking
from transformer.tools import sweep_results


def test_each_metric_ranks_in_its_direction():
  bleu, loss = ranking.METRICS['eval_bleu'], ranking.METRICS['eval_loss']
  assert bleu.improves(30.1, 30.0) and not bleu.improves(30.0, 30.0)
  assert loss.improves(2.0, 2.1) and not loss.improves(2.1, 2.0)
  assert bleu.improves(0.0, None) and loss.improves(9.0, None)
  scores = {10: 2.0, 20: 1.5, 30: 1.5, 40: 3.0}
  assert list(bleu.best_first(scores)) == [40, 10, 20, 30]  # Ties: the earlier step first.
  assert list(loss.best_first(scores)) == [20, 30, 10, 40]
  assert (bleu.direction, loss.direction) == ('maximize', 'minimize')


def test_every_target_metric_has_a_summary_column_and_selection_reads_a_bleu():
  columns = {f.name for f in dataclasses.fields(sweep_results.TrialResult)}
  for name in ranking.TARGET_METRICS:
    assert ranking.METRICS[name].summary_column in columns
    assert ranking.selection_metric(name) in ranking.SELECTION_METRICS
  assert ranking.selection_metric('eval_bleu_lc') == 'eval_bleu_lc'
  assert ranking.selection_metric('eval_loss') == 'eval_bleu'
