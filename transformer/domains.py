"""Value domains: what a config value or flag may be, and the error message that says so.

A `Rule` checks a value and words the error ('config.x=5 must be a positive
integer.'); `integer`, `real` and `one_of` build the common ones. The project's
table of every config key's rule is `config.CONFIG_RULES`, from `config_fields.FIELDS`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rule:
  """A domain: `check(value)` is True inside it; `text` says what it is, for error messages.

  `text` may be a function that returns it (a domain that grows while the program runs).
  """

  text: str | Callable[[], str]
  check: Callable[[Any], bool]

  def error(self, name: str, value: Any) -> str | None:
    """None if `value` is in the domain, else '`name`=value must be <text>.'."""
    try:
      ok = self.check(value)
    except TypeError:
      ok = False
    if ok:
      return None
    text = self.text if isinstance(self.text, str) else self.text()
    verb = 'is not' if text.startswith('one of') else 'must be'
    return f'{name}={value!r} {verb} {text}.'


def is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def integer(low: int | None = None, high: int | None = None) -> Rule:
  """An int in [low, high] (either end may be open-ended)."""
  if low is not None and high is not None:
    text = f'an integer in [{low}, {high}]'
  elif low == 1:
    text = 'a positive integer'
  elif low is not None:
    text = f'an integer >= {low}'
  else:
    text = 'an integer'
  return Rule(
    text, lambda v: is_int(v) and (low is None or v >= low) and (high is None or v <= high)
  )


def real(
  low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
) -> Rule:
  """A finite number in the interval, its ends open or closed as given."""
  left, right = '(' if low_open else '[', ')' if high_open or high == math.inf else ']'
  text = f'a finite number in {left}{low:g}, {high:g}{right}'
  if low == 0 and low_open and high == math.inf:
    text = 'a finite positive number'
  return Rule(
    text,
    lambda v: (
      is_real(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    ),
  )


def one_of(choices: Sequence[Any]) -> Rule:
  """One of `choices` (compared with ==)."""
  return Rule(f'one of {tuple(choices)}', lambda v: v in tuple(choices))


BOOLEAN = Rule('True or False', lambda v: isinstance(v, bool))
PROBABILITY = real(0.0, 1.0, high_open=True)  # Dropout, label smoothing, Adam betas.
POSITIVE_INT = integer(1)
POSITIVE_REAL = real(0.0, low_open=True)
NAME = Rule('a non-empty string', lambda v: isinstance(v, str) and bool(v.strip()))
OPTIONAL_POSITIVE_REAL = Rule(
  'None or a finite positive number', lambda v: v is None or POSITIVE_REAL.check(v)
)


OPTIONAL_PATH = Rule(
  'None or a non-empty path', lambda v: v is None or (isinstance(v, str) and bool(v.strip()))
)


def seconds_from_env(name: str, default: float, low: float, high: float, meaning: str) -> float:
  """The environment variable `name` read as seconds in [`low`, `high`]; unset or empty: default.

  Raises `errors.InvalidInput` naming the variable, its value and `meaning` (what the seconds
  are), for a value that is no number or lies outside the range.
  """
  import os  # pylint: disable=g-import-not-at-top

  from transformer.errors import InvalidInput  # pylint: disable=g-import-not-at-top

  text = os.environ.get(name)
  if text is None or text == '':
    return default
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not low <= value <= high:
    raise InvalidInput(f'{name}={text!r}: {meaning} is a number of seconds in [{low:g}, {high:g}].')
  return value
