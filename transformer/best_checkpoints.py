"""The parameters of the evaluations with the best validation BLEU: WORKDIR/best_checkpoints.

With `config.keep_best_checkpoints` > 0 the training loop saves each evaluation's parameters
here; Orbax keeps the best by `ranking.selection_metric(config.target_metric)`. eval.py's
`--checkpoint=best` and `avg_best:N` (`checkpoint_spec`) read them. Written and committed as
the run's checkpoints are (`checkpoints`: atomic locally, a commit file on a bucket).
"""

from __future__ import annotations

import orbax.checkpoint as ocp
from absl import logging

from transformer import checkpoints, ranking, storage
from transformer.errors import InvalidInput, MissingInput

# Where `BestCheckpoints` keeps parameters (in the workdir), and the validation BLEUs stored
# with them.
DIRECTORY = 'best_checkpoints'
METRICS = ranking.SELECTION_METRICS  # Stored with each best checkpoint.


class BestCheckpoints:
  """The parameters of the evaluations with the best validation BLEU: WORKDIR/best_checkpoints.

  Each evaluation's parameters are saved under its step with its validation BLEUs
  (`METRICS`, Orbax's metrics) and array checksums; Orbax's CheckpointManager keeps
  the `keep` with the highest `metric` (`best_fn`, `max_to_keep`) and deletes the others.
  `metric` is `ranking.selection_metric(target_metric)`; runs before `eval_bleu_lc`
  stored `eval_bleu` alone. Parameters only: they are for evaluation (`eval.py
  --checkpoint=best`, `avg_best:N`); a run resumes from WORKDIR/checkpoints, which keeps the
  latest.
  """

  def __init__(
    self,
    workdir: str,
    *,
    metric: str = 'eval_bleu',
    keep: int | None = None,
    read_only: bool = False,
  ):
    if metric not in METRICS:
      raise InvalidInput(f'metric={metric!r} is not one of {METRICS}.')
    self.directory = storage.join(storage.resolve(workdir), DIRECTORY)
    self.metric = metric
    if read_only and not storage.isdir(self.directory):
      raise MissingInput(
        f'No best checkpoints at {self.directory}: the run kept none '
        "(config.keep_best_checkpoints=0). Use 'latest', a step or 'avg:N'."
      )
    with checkpoints.quiet_read_only_notice():  # Orbax's warning of a reader: no news here.
      self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
          max_to_keep=keep,
          best_fn=lambda metrics: metrics[metric],
          best_mode='max' if ranking.METRICS[metric].higher_is_better else 'min',
          keep_checkpoints_without_metrics=False,
          create=not read_only,
          read_only=read_only,
          cleanup_tmp_directories=not read_only,
          atomicity_options=checkpoints.atomicity(self.directory),
        ),
      )
    unscored = [s for s in self._manager.all_steps() if metric not in self._metrics(s)]
    if unscored:
      self._manager.close()
      raise InvalidInput(
        f'Best checkpoints {unscored} in {self.directory} carry no {metric} (they store '
        f'{sorted(self._metrics(unscored[0]))}): they were selected by another metric, so they '
        f"cannot be ranked by {metric}. Nothing was changed. Keep the run's "
        'config.target_metric, or train in a new --workdir.'
      )

  def _metrics(self, step: int) -> dict[str, float]:
    return self._manager.metrics(step) or {}

  def save(self, step: int, params, bleus: dict[str, float]) -> None:
    """Starts an asynchronous save of `params` with their validation BLEUs (`METRICS`);
    the worst by `metric` beyond `keep` go."""
    self._manager.save(
      step,
      args=ocp.args.StandardSave(params),
      metrics={name: float(bleus[name]) for name in METRICS},
      custom_metadata={checkpoints.CHECKSUMS_KEY: checkpoints.array_checksums(params)},
      force=True,
    )

  def drop_after(self, step: int) -> None:
    """Deletes the parameters of evaluations after `step`, which a resumed run does again.

    They belong to a timeline that no longer exists (as `metrics.MetricsWriter.truncate_after`'s
    rows); the resumed run evaluates the same steps again, exactly.
    """
    for later in [s for s in self._manager.all_steps() if s > step]:
      logging.info(
        'Deleting best checkpoint %s/%d: the run resumes from step %d.', self.directory, later, step
      )
      self._manager.delete(later)

  def scores(self) -> dict[int, float]:
    """{step: its validation BLEU (`metric`)}, best first (ties: the earlier step first)."""
    scores = {s: float(self._metrics(s)[self.metric]) for s in self._manager.all_steps()}
    return ranking.METRICS[self.metric].best_first(scores)

  def restore(self, step: int, abstract_params):
    """The parameters of `step`, in `abstract_params`' shapes and shardings, checksums verified."""
    try:
      params = self._manager.restore(step, args=ocp.args.StandardRestore(abstract_params))
      saved = self._manager.metadata(step).custom_metadata.get(checkpoints.CHECKSUMS_KEY)
    except Exception as e:
      raise checkpoints.CorruptCheckpointError(
        f'Best checkpoint {step} ({self.directory}/{step}) cannot be restored: '
        f'{type(e).__name__}: {str(e).splitlines()[0][:400]}'
      ) from e
    restored = checkpoints.array_checksums(params)
    damaged = sorted(k for k, v in restored.items() if saved is not None and saved.get(k) != v)
    if damaged:
      raise checkpoints.CorruptCheckpointError(
        f'Best checkpoint {step} ({self.directory}/{step}) cannot be restored: '
        f'{len(damaged)} arrays differ from the checksums written with them ({damaged[0]}, ...).'
      )
    logging.info('Restored best checkpoint %s/%d.', self.directory, step)
    return params

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
