"""Which checkpoints a spec names: parsed once into `CheckpointSpec`, then selected and labelled.

The grammar (`GRAMMAR`), read by eval.py's and convert.py's `--checkpoint`,
`config.decode.checkpoint` and `config.init_checkpoint`:

  latest         the newest checkpoint
  STEP           the checkpoint of that step
  avg:N          the last N averaged (section 6.1 of the paper)
  avg:N@STEP     the N up to and including STEP averaged: a shorter run's avg:N read off a
                 longer run with the same checkpoint cadence
  best           the best validation BLEU kept (`best_checkpoints.BestCheckpoints`)
  avg_best:N     the N best averaged

`parse` turns a text into a `CheckpointSpec` (or raises `InvalidInput` naming it);
`select_steps` and `select_best_steps` pick the steps of a run; the labels name what was read
(`step_1500`, `avg5_1100-1500`, `best_step_1200`, `avg_best3_900-1200-1500`), and
`step_budget` reads a step budget back from a label.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from transformer.domains import Rule
from transformer.errors import InvalidInput

GRAMMAR = "'latest', a step number, 'avg:N', 'avg:N@STEP', 'best' or 'avg_best:N'"


class NoSuchCheckpoint(InvalidInput):
  """A checkpoint spec names checkpoints the run does not hold; the message lists those it does."""


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
  """A parsed spec: `kind` is 'latest', 'step', 'avg', 'best' or 'avg_best'."""

  kind: str
  count: int = 1  # Checkpoints averaged (avg, avg_best); 1 otherwise.
  step: int | None = None  # STEP of a step or of avg:N@STEP.

  @property
  def is_best(self) -> bool:
    """Whether it reads the best checkpoints (by validation BLEU), not the last ones."""
    return self.kind in ('best', 'avg_best')

  @property
  def averages_up_to(self) -> int | None:
    """STEP of 'avg:N@STEP': the last checkpoint averaged, before a longer run's end."""
    return self.step if self.kind == 'avg' else None

  @property
  def moves(self) -> bool:
    """Whether it follows a running run ('latest', 'avg:N'); a step and avg:N@STEP stay put."""
    return self.kind == 'latest' or (self.kind == 'avg' and self.step is None)

  def __str__(self) -> str:
    if self.kind == 'step':
      return str(self.step)
    if self.kind == 'avg':
      return f'avg:{self.count}' + (f'@{self.step}' if self.step is not None else '')
    if self.kind == 'avg_best':
      return f'avg_best:{self.count}'
    return self.kind


def error(text: Any) -> str | None:
  """Why `text` names no checkpoint in any run ('checkpoint=...: expected ...'), or None."""
  if not isinstance(text, str):
    return f"checkpoint={text!r} must be a string such as 'latest' or 'avg:5'."
  if text in ('latest', 'best') or text.isdigit():
    return None
  if text.startswith('avg:'):
    count, at, step = text[len('avg:') :].partition('@')
    if count.isdigit() and int(count) >= 1 and (not at or step.isdigit()):
      return None
    return (
      f'checkpoint={text!r}: expected avg:N or avg:N@STEP with N a positive integer '
      'and STEP a step number.'
    )
  if text.startswith('avg_best:'):
    count = text[len('avg_best:') :]
    if count.isdigit() and int(count) >= 1:
      return None
    return f'checkpoint={text!r}: expected avg_best:N with N a positive integer.'
  return f'checkpoint={text!r}: expected {GRAMMAR}.'


def parse(text: str | CheckpointSpec) -> CheckpointSpec:
  """The `CheckpointSpec` of `text`; `InvalidInput` (with `error`'s message) if it names none."""
  if isinstance(text, CheckpointSpec):
    return text
  if message := error(text):
    raise NoSuchCheckpoint(message)
  if text.isdigit():
    return CheckpointSpec('step', step=int(text))
  if text.startswith('avg:'):
    count, _, step = text[len('avg:') :].partition('@')
    return CheckpointSpec('avg', int(count), int(step) if step else None)
  if text.startswith('avg_best:'):
    return CheckpointSpec('avg_best', int(text[len('avg_best:') :]))
  return CheckpointSpec(text)


# The domain of the config keys that hold a spec (`config_fields`).
RULE = Rule(f'{GRAMMAR} (N a positive integer)', lambda v: error(v) is None)


def select_steps(available: list[int], spec: str | CheckpointSpec) -> list[int]:
  """Steps of the last checkpoints that `spec` names among `available`: 'latest', a step,
  'avg:N' (the last N) or 'avg:N@STEP' (the last N up to and including STEP).

  'avg:N@STEP' reads a shorter run's 'avg:N' off a longer run with the same checkpoint
  cadence, exactly where the schedule does not depend on `num_train_steps` (inverse_sqrt).
  Errors list what exists, so a typo is fixed in one go.
  """
  text = str(spec)
  spec = parse(spec)
  available = sorted(available)
  if not available:
    raise NoSuchCheckpoint('There are no checkpoints.')
  if spec.kind == 'latest':
    return available[-1:]
  if spec.kind == 'avg':
    if spec.step is not None:
      if spec.step not in available:
        raise NoSuchCheckpoint(
          f'checkpoint={text!r}: there is no checkpoint at step {spec.step}; the '
          f'checkpoints are at steps {available}.'
        )
      available = [step for step in available if step <= spec.step]
    if spec.count > len(available):
      upto = '' if spec.step is None else f' up to step {spec.step}'
      raise NoSuchCheckpoint(
        f'checkpoint={text!r} needs {spec.count} checkpoints, but there are only '
        f'{len(available)}{upto}: {available}.'
      )
    return available[-spec.count :]
  if spec.kind == 'step' and spec.step in available:
    return [spec.step]
  raise NoSuchCheckpoint(
    f'checkpoint={text!r} does not exist; the checkpoints are at steps {available} '
    f"(or use 'latest' or 'avg:N')."
  )


def select_best_steps(scores: dict[int, float], spec: str | CheckpointSpec) -> list[int]:
  """Steps named by 'best' or 'avg_best:N' (the N with the best BLEU), in step order.

  `scores` is `BestCheckpoints.scores()` (best first). Errors list what exists.
  """
  text = str(spec)
  spec = parse(spec)
  if not spec.is_best:
    raise NoSuchCheckpoint(f"checkpoint={text!r}: expected 'best' or 'avg_best:N'.")
  kept = ', '.join(f'{step} (BLEU {bleu:.2f})' for step, bleu in scores.items())
  if not scores:
    raise NoSuchCheckpoint('There are no best checkpoints.')
  if spec.count > len(scores):
    raise NoSuchCheckpoint(
      f'checkpoint={text!r} needs {spec.count} best checkpoints, but the run kept '
      f'{len(scores)} (config.keep_best_checkpoints): {kept}.'
    )
  return sorted(list(scores)[: spec.count])


def pinned(spec: str | CheckpointSpec, steps: list[int]) -> str:
  """A spec that names `steps` (selected by `spec`) also after the run saves newer ones."""
  if parse(spec).is_best:
    return str(spec)
  return str(steps[0]) if len(steps) == 1 else f'avg:{len(steps)}@{steps[-1]}'


def last_checkpoints_label(steps: list[int]) -> str:
  """The label of the parameters of `steps`, the last checkpoints up to the last of them.

  `step_1500` for one, `avg5_1100-1500` for 5 averaged; `step_budget` reads it back.
  """
  return f'step_{steps[0]}' if len(steps) == 1 else f'avg{len(steps)}_{steps[0]}-{steps[-1]}'


def best_checkpoints_label(steps: list[int]) -> str:
  """The label of the parameters of best checkpoints `steps`: `best_step_1200` for one,
  `avg_best3_900-1200-1500` for 3 averaged."""
  if len(steps) == 1:
    return f'best_step_{steps[0]}'
  return f'avg_best{len(steps)}_' + '-'.join(map(str, steps))


def label(spec: str | CheckpointSpec, steps: list[int]) -> str:
  """The label of the parameters that `spec` selected as `steps`."""
  return best_checkpoints_label(steps) if parse(spec).is_best else last_checkpoints_label(steps)


_LAST_CHECKPOINTS_LABEL = re.compile(r'step_(?P<step>\d+)|avg(?P<averaged>\d+)_\d+-(?P<last>\d+)')


def step_budget(label_text: str) -> tuple[int, int] | None:
  """(last step, checkpoints averaged) of a `last_checkpoints_label`; None for any other label.

  Under the inverse square root schedule the last N checkpoints up to step S are what an
  S-step run ends with, so the label names a step budget. A label of the best checkpoints
  (`best_step_1200`, `avg_best3_900-1200-1500`) is chosen by validation BLEU and names none.
  """
  match = _LAST_CHECKPOINTS_LABEL.fullmatch(label_text)
  if match is None:
    return None
  if match['step'] is not None:
    return int(match['step']), 1
  return int(match['last']), int(match['averaged'])
