"""The checkpoint spec: parsed once, selected and labelled in one module."""

import pytest

from transformer import checkpoint_spec
from transformer.checkpoint_spec import CheckpointSpec


@pytest.mark.parametrize(
  'text,spec',
  [
    ('latest', CheckpointSpec('latest')),
    ('1500', CheckpointSpec('step', step=1500)),
    ('avg:5', CheckpointSpec('avg', 5)),
    ('avg:3@500', CheckpointSpec('avg', 3, 500)),
    ('best', CheckpointSpec('best')),
    ('avg_best:4', CheckpointSpec('avg_best', 4)),
  ],
)
def test_each_form_parses_and_prints_back(text, spec):
  assert checkpoint_spec.parse(text) == spec
  assert str(spec) == text
  assert checkpoint_spec.error(text) is None
  assert checkpoint_spec.RULE.error('config.decode.checkpoint', text) is None
  assert spec.is_best == text.startswith(('best', 'avg_best'))
  assert spec.moves == (text in ('latest', 'avg:5'))
  assert spec.averages_up_to == (500 if text == 'avg:3@500' else None)  # Not a plain step.


@pytest.mark.parametrize('text', ['', 'avg:0', 'avg:x', 'avg:2@', 'avg_best:0', 'last', '-3', 5])
def test_anything_else_is_one_error_naming_it(text):
  message = checkpoint_spec.error(text)
  assert message and message.startswith(f'checkpoint={text!r}')
  with pytest.raises(checkpoint_spec.NoSuchCheckpoint, match='checkpoint='):
    checkpoint_spec.parse(text)
  assert 'config.decode.checkpoint=' in checkpoint_spec.RULE.error('config.decode.checkpoint', text)


def test_the_best_are_chosen_by_score_and_returned_in_step_order():
  scores = {300: 31.0, 100: 30.0, 200: 29.0}  # Best first, as BestCheckpoints.scores() gives.
  assert checkpoint_spec.select_best_steps(scores, 'best') == [300]
  assert checkpoint_spec.select_best_steps(scores, 'avg_best:2') == [100, 300]
  with pytest.raises(checkpoint_spec.NoSuchCheckpoint, match='needs 4 best checkpoints'):
    checkpoint_spec.select_best_steps(scores, 'avg_best:4')
  with pytest.raises(checkpoint_spec.NoSuchCheckpoint, match='no best checkpoints'):
    checkpoint_spec.select_best_steps({}, 'best')


def test_a_selection_pins_the_steps_it_found_and_labels_them():
  steps = checkpoint_spec.select_steps([100, 200, 300, 400], 'avg:2')
  assert steps == [300, 400]
  assert checkpoint_spec.pinned('avg:2', steps) == 'avg:2@400'
  assert checkpoint_spec.select_steps([100, 200, 300, 400, 500], 'avg:2@400') == steps
  assert checkpoint_spec.pinned('latest', [400]) == '400'
  assert checkpoint_spec.pinned('avg_best:2', [100, 300]) == 'avg_best:2'
  assert checkpoint_spec.label('avg:2', steps) == 'avg2_300-400'
  assert checkpoint_spec.label('avg_best:2', [100, 300]) == 'avg_best2_100-300'
  assert checkpoint_spec.step_budget('avg2_300-400') == (400, 2)
  assert checkpoint_spec.step_budget('avg_best2_100-300') is None
