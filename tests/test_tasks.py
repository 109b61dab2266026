"""Both tasks implement the `Task` protocol, member by member, signatures included."""

import inspect

import pytest

from transformer import tasks
from transformer.tasks import task as task_lib

# The protocol's methods and attributes, read from the protocol itself (a member added to it is
# checked here without a change to this test).
_METHODS = sorted(
  name
  for name, member in vars(task_lib.Task).items()
  if inspect.isfunction(member) and not name.startswith('_')
)
_ATTRIBUTES = sorted(task_lib.Task.__annotations__)


def _parameters(function, drop_self: bool) -> list[inspect.Parameter]:
  parameters = list(inspect.signature(function).parameters.values())
  return parameters[1:] if drop_self else parameters


def _signature_errors(name: str, implementation) -> list[str]:
  """How `implementation` fails to accept every call the protocol's `name` allows."""
  wanted = _parameters(getattr(task_lib.Task, name), drop_self=True)
  given = {p.name: p for p in _parameters(implementation, drop_self=False)}
  errors = []
  for i, parameter in enumerate(wanted):
    have = given.pop(parameter.name, None)
    if have is None:
      errors.append(f'{name}: no parameter {parameter.name}')
    elif have.kind != parameter.kind:
      errors.append(f'{name}: {parameter.name} is {have.kind}, not {parameter.kind}')
    elif parameter.default is not inspect.Parameter.empty and have.default != parameter.default:
      errors.append(f'{name}: {parameter.name} defaults to {have.default!r}')
    elif parameter.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
      position = list(inspect.signature(implementation).parameters).index(parameter.name)
      if position != i:
        errors.append(f'{name}: {parameter.name} is at position {position}, not {i}')
  # Parameters beyond the protocol's must have defaults: a caller of the protocol never passes them.
  errors += [
    f'{name}: extra parameter {p.name} without a default'
    for p in given.values()
    if p.default is inspect.Parameter.empty
    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
  ]
  return errors


def test_the_protocol_names_the_members_training_and_eval_call():
  assert _METHODS == [
    'decode_lines',
    'decode_option_errors',
    'eval_batches',
    'evaluator',
    'make_decode_fn',
    'model_inputs',
    'train_iterator',
    'validation_metrics_fn',
  ]
  assert _ATTRIBUTES == ['batch_keys', 'default_decoder', 'name', 'unsupported_eval_flags']


@pytest.mark.parametrize(
  'task', [tasks.Translation(), tasks.LanguageModel()], ids=lambda task: type(task).__name__
)
def test_each_task_implements_the_protocol(task):
  errors = []
  for name in _METHODS:
    member = getattr(task, name, None)
    if not callable(member):
      errors.append(f'{name}: missing')
      continue
    errors += _signature_errors(name, member)
  for name in _ATTRIBUTES:
    if not hasattr(task, name):
      errors.append(f'{name}: missing')
  assert isinstance(task.name, str) and isinstance(task.default_decoder, str)
  assert all(isinstance(key, str) for key in task.batch_keys)
  assert not errors, errors


def test_the_signature_check_finds_a_task_that_breaks_the_protocol():
  class Broken(tasks.Translation):
    @staticmethod
    def decode_lines(request, lines):  # Lost `params`.
      return list(lines)

    @staticmethod
    def eval_batches(data_config, tokenizer, split, *, rows_multiple_of=2, shard_index=0, count=1):
      return []

  broken = Broken()
  assert _signature_errors('decode_lines', broken.decode_lines) == [
    'decode_lines: no parameter params',
    'decode_lines: lines is at position 1, not 2',
  ]
  assert _signature_errors('eval_batches', broken.eval_batches) == [
    'eval_batches: rows_multiple_of defaults to 2',
    'eval_batches: no parameter shard_count',
  ]


def test_get_task_follows_the_architecture():
  from configs import default, lm_default

  assert isinstance(tasks.get_task(default.get_config().model.architecture), tasks.Translation)
  assert isinstance(tasks.get_task(lm_default.get_config().model.architecture), tasks.LanguageModel)
