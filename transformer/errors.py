"""Refusals: errors the project raises on purpose, which every entry point ends with one message.

A `Refusal` says what is wrong, why and what to do (a bad config value, a workdir another run
holds, a checkpoint that cannot be read, missing data). `run(main)` is `absl.app.run` for
every command (train.py, eval.py, sweep.py, compare.py, curves, the bench scripts): a
Refusal prints `<command>: error: <message>` to stderr and exits 1, with no traceback;
any other exception keeps its traceback, as a bug should. `TRANSFORMER_TRACEBACK=1` shows
the traceback of refusals too.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

TRACEBACK_ENV = 'TRANSFORMER_TRACEBACK'  # Set to 1: refusals end with their traceback too.


class Refusal(Exception):
  """Base of the errors raised on purpose (see the module docstring)."""


def _ends_cleanly(main: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  @functools.wraps(main)
  def wrapped(argv: list[str]) -> Any:
    try:
      return main(argv)
    except Refusal as e:
      if os.environ.get(TRACEBACK_ENV, '') not in ('', '0'):
        raise
      from absl import logging  # pylint: disable=g-import-not-at-top

      logging.flush()
      command = os.path.basename(sys.argv[0]) or 'transformer'
      sys.stderr.write(
        f'{command}: error: {e}\n(set {TRACEBACK_ENV}=1 to see where it was raised)\n'
      )
      sys.stderr.flush()
      sys.exit(1)

  return wrapped


def run(main: Callable[[list[str]], Any], **app_run_options: Any) -> None:
  """`absl.app.run(main, ...)`, with refusals ending as one message (the module docstring)."""
  from absl import app  # pylint: disable=g-import-not-at-top

  app.run(_ends_cleanly(main), **app_run_options)


class InvalidInput(Refusal, ValueError):
  """A value, file or combination the command cannot use: what, why and what to do instead."""


class MissingInput(Refusal, FileNotFoundError):
  """A file or folder the command needs is not there (it names it and how to make it)."""
