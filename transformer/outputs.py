"""A command's output file: written whole, or, when the write fails, kept elsewhere and said so.

Every file a command writes as its result (eval.py's translations and scores, compare.py's
and curves' `--output`, the bench reports, a sweep's summary) goes through `write`. Its
location was checked before any work (`path_checks.output_errors`), but a disk can fill or a
bucket refuse during a long job: then what was computed is not lost. It is written to a
file in the temporary folder, and `OutputWriteError` names the file that failed, why, and
where the content is (standard output when even that fails).
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Sequence

from transformer import storage
from transformer.errors import Refusal


class OutputWriteError(Refusal, OSError):
  """An output could not be written; the message says where its content was kept."""


def _is_special(path: str) -> bool:
  """A device or a pipe (`/dev/stdout`, `/dev/full`, a FIFO): written in place, never renamed."""
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return False
  return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _keep(data: bytes, name: str, folder: str) -> str:
  """Writes `data` to `folder/name`; returns the path."""
  path = os.path.join(folder, name)
  with open(path, 'wb') as f:
    f.write(data)
  return path


def _write_one(path: str, data: bytes) -> None:
  if path == '-':
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
  elif not storage.is_url(path) and _is_special(path):
    with open(path, 'wb') as f:
      f.write(data)
  else:
    storage.write_bytes(path, data)


def write(path: str, content: str | bytes, flag: str) -> None:
  """Writes `content` to `path` (`-`: standard output) whole or not at all.

  Regular files and objects are replaced in one step (`storage.write_bytes`); devices and
  pipes are written in place.

  Args:
    path: Where the output goes: a local path, a gs:// or s3:// URL, or `-`.
    content: The output (str is written as UTF-8).
    flag: The flag or config key that named `path`, for the error.

  Raises:
    OutputWriteError: the write failed; the content is kept in a temporary file (named in
      the message) or, failing that, written to standard output.
  """
  write_files([(path, content)], flag)


def write_files(files: Sequence[tuple[str, str | bytes]], flag: str) -> None:
  """`write` for several files of one result: each is tried, and every one that fails is kept.

  Raises:
    OutputWriteError: naming each file that could not be written and where it was kept.
  """
  failed = []
  for path, content in files:
    data = content.encode('utf-8') if isinstance(content, str) else content
    try:
      _write_one(path, data)
    except OSError as e:
      failed.append((path, data, e.strerror or str(e)))
  if not failed:
    return
  what = '; '.join(f'{path} ({why})' for path, _, why in failed)
  failure = f'{flag}: could not write {what}'
  try:
    folder = tempfile.mkdtemp(prefix='transformer-kept-')
    kept = [_keep(data, storage.basename(path) or 'output', folder) for path, data, _ in failed]
  except OSError as e:
    for _, data, _ in failed:
      sys.stdout.buffer.write(data)
    sys.stdout.flush()
    raise OutputWriteError(
      f'{failure}. Nor could it be kept in {tempfile.gettempdir()} ({e.strerror or e}): it '
      'was written to standard output above. Free space or choose another path.'
    ) from None
  raise OutputWriteError(
    f'{failure}. What was computed is kept in {", ".join(kept)}: free space (or choose '
    'another path) and copy it there.'
  ) from None
