"""transformer.errors: a refusal ends a command with one message; a bug keeps its traceback."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMAND = """
import sys
from transformer import errors
from transformer.config import ConfigError

def main(argv):
  raise {error}

errors.run(main)
"""


def _run(error: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-c', _COMMAND.format(error=error)],
    cwd=REPO,
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.parametrize(
  'error',
  [
    "ConfigError('config.vocab_size=0 must be > 0.')",
    "errors.InvalidInput('config.vocab_size=0 must be > 0.')",
  ],
)
def test_a_refusal_is_one_message_and_exit_1(error):
  result = _run(error)
  assert result.returncode == 1
  assert result.stderr.splitlines() == [
    '-c: error: config.vocab_size=0 must be > 0.',
    '(set TRANSFORMER_TRACEBACK=1 to see where it was raised)',
  ]


def test_the_traceback_is_there_when_asked_for():
  result = _run("errors.InvalidInput('no.')", TRANSFORMER_TRACEBACK='1')
  assert result.returncode == 1
  assert 'Traceback' in result.stderr and 'InvalidInput: no.' in result.stderr


def test_an_unexpected_error_keeps_its_traceback():
  result = _run("KeyError('a bug')")
  assert result.returncode == 1
  assert 'Traceback' in result.stderr and "KeyError: 'a bug'" in result.stderr
