"""The two tasks, chosen once per run from the config: translation and language modelling.

`get_task(config.model.architecture)` returns the task of `config.model.architecture` (validation
has checked that `config.data.dataset` fits it). Both implement the `Task`
protocol (`tasks.task`); eval.py passes them an `EvalRequest` and writes the
`Evaluation` they return (`evaluation.write`). Both pack their examples with the
shared `input_pipeline.packed_train_iterator` and `packed_eval_batches`, and
decode through `inference.run_decoder`.
"""

from __future__ import annotations

from transformer.tasks.language_model import LanguageModel
from transformer.tasks.task import EvalRequest, Evaluation, Task, ValidationConfig
from transformer.tasks.translation import Translation

__all__ = [
  'EvalRequest',
  'Evaluation',
  'LanguageModel',
  'Task',
  'Translation',
  'ValidationConfig',
  'get_task',
]


def get_task(architecture: str) -> Task:
  """The task of a model's `architecture` (`config.model.architecture`): a decoder-only model
  is a language model, else translation."""
  return LanguageModel() if architecture == 'decoder_only' else Translation()
