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
  """`absl.app.run(main, ...)`, with refusals ending as one message (the module docstring).

  A config file flag (ml_collections' `--config=FILE`) that names no loadable config is a
  flag error too, naming the flag and the file (`_checking_config_files`).
  """
  from absl import app  # pylint: disable=g-import-not-at-top

  parser = app_run_options.pop('flags_parser', app.parse_flags_with_usage)
  app.run(_ends_cleanly(main), flags_parser=_checking_config_files(parser), **app_run_options)


def _flag_error(message: str) -> None:
  """Ends the command as absl ends it on a bad flag: one line, exit status 1."""
  sys.stderr.write(
    f'FATAL Flags parsing error: {message}\nPass --helpshort or --helpfull to see help on flags.\n'
  )
  sys.exit(1)


def _config_file_flags() -> dict[str, Any]:
  """{name: flag} of the ml_collections config file flags defined (none if it is not loaded)."""
  module = sys.modules.get('ml_collections.config_flags.config_flags')
  if module is None:
    return {}
  from absl import flags  # pylint: disable=g-import-not-at-top

  return {
    name: flags.FLAGS[name]
    for name in list(flags.FLAGS)
    if isinstance(flags.FLAGS[name].parser, module.ConfigFileFlagParser)
  }


def config_file_problem(path: str) -> str | None:
  """Why `path` (a config flag's value: FILE or FILE:ARGUMENT) names no config file, or None."""
  file = path.split(':', 1)[0]
  if not file.strip():
    return 'names no file: name a config file (e.g. configs/default.py).'
  if not os.path.exists(file):
    return f'{file} does not exist: name a config file (e.g. configs/default.py).'
  if os.path.isdir(file):
    return f'{file} is a directory: name a config file in it (e.g. configs/default.py).'
  if not os.access(file, os.R_OK):
    return f'{file} cannot be read (permission denied).'
  return None


def _checking_config_files(parser: Callable[[list[str]], Any]) -> Callable[[list[str]], Any]:
  """`parser`, after which a config file that could not be loaded ends the command at once.

  ml_collections keeps the error of a missing file until the config is first read (two
  chained tracebacks, deep in the command), and lets a file that is no Python (a
  SyntaxError) or a `get_config` that refuses its argument escape as tracebacks.
  """

  def parse(argv: list[str]) -> Any:
    config_flags = _config_file_flags()
    for arg in argv[1:]:
      name, sep, value = arg.removeprefix('--').partition('=')
      flagged = arg.startswith('--') and sep and name in config_flags
      if flagged and (problem := config_file_problem(value)):
        _flag_error(f'--{name}={value}: {problem}')
    try:
      rest = parser(argv)
    except SyntaxError as e:
      flag = next(
        (arg.split('=', 1)[0] for arg in argv[1:] if arg.split('=', 1)[-1] == e.filename),
        'the config file',
      )
      _flag_error(
        f'{flag}={e.filename} is not a Python config file ({e.msg}, line {e.lineno}): name '
        'one with a get_config() (e.g. configs/default.py).'
      )
    for name, flag in _config_file_flags().items():
      if type(flag.value).__name__ == '_ErrorConfig':  # Its error, kept for the first read.
        error = str(object.__getattribute__(flag.value, '_error')).strip().splitlines()
        _flag_error(f'--{name}: the config could not be loaded ({error[-1].strip()}).')
    return rest

  return parse


class InvalidInput(Refusal, ValueError):
  """A value, file or combination the command cannot use: what, why and what to do instead."""


class MissingInput(Refusal, FileNotFoundError):
  """A file or folder the command needs is not there (it names it and how to make it)."""


class Unreachable(Refusal, ConnectionError):
  """A server the command needs cannot be reached (it names what to do offline instead)."""
