"""Metrics to WORKDIR/metrics.jsonl (one JSON object per row) and TensorBoard event files."""

from __future__ import annotations

import json
import os

import jax
from absl import logging

from transformer import atomic

FILENAME = 'metrics.jsonl'  # In the workdir: one JSON object per line, each with its step.


class MetricsWriter:
  """Writes scalar rows from process 0 only; other processes write nothing."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, FILENAME)
    self._enabled = jax.process_index() == 0
    self._tensorboard = None
    if self._enabled:
      from tensorboardX import SummaryWriter  # TF-free TensorBoard writer.

      self._tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def truncate_after(self, step: int) -> None:
    """Drops rows written after `step` by a run that stopped before checkpointing them.

    A resumed run starts again from its last checkpoint; rows past it belong to a
    timeline that no longer exists and would otherwise appear twice.
    """
    if not self._enabled or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      rows = [line for line in f if line.strip()]
    kept = [line for line in rows if json.loads(line)['step'] <= step]
    if len(kept) != len(rows):
      logging.info('metrics.jsonl: dropping %d rows after step %d.', len(rows) - len(kept), step)
      atomic.write_text(self.path, ''.join(kept))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    row = {'step': int(step), **{k: float(v) for k, v in metrics.items()}}
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
    for name, value in metrics.items():
      self._tensorboard.add_scalar(name, float(value), int(step))

  def flush(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.close()
