"""Files written whole or not at all: written beside their place under a temporary name, then moved.

A reader (another process, a run resumed after a crash) sees the old file or
the new one, never half of one. Every file the project writes this way goes
through `replacing` (or `write_text`, `write_bytes`, `write_json`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def replacing(path: str, *, overwrite: bool = True) -> Iterator[str]:
  """Yields a temporary path beside `path` to write; when the block ends, it becomes `path`.

  The temporary name is unique to this host, process and thread (Slurm tasks on
  several hosts may write one file at once) and keeps `path`'s extension (for
  writers that choose a format by it). It is removed if the block raises.

  Args:
    path: The file to write.
    overwrite: False keeps an existing `path`: `FileExistsError` is raised and
      the new content dropped (two processes that trained the same vocabulary
      keep the first).
  """
  directory, name = os.path.split(os.path.abspath(path))
  tmp = os.path.join(
    directory, f'.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}-{name}'
  )
  try:
    yield tmp
    if overwrite:
      os.replace(tmp, path)
    else:
      os.link(tmp, path)  # Atomic too, and fails rather than replace `path`.
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)


def write_bytes(path: str, data: bytes, *, overwrite: bool = True) -> None:
  """Writes `data` to `path` (`replacing`)."""
  with replacing(path, overwrite=overwrite) as tmp, open(tmp, 'wb') as f:
    f.write(data)


def write_text(path: str, text: str) -> None:
  """Writes `text` to `path` in UTF-8 (`replacing`)."""
  write_bytes(path, text.encode('utf-8'))


def write_json(path: str, value: Any, **dump_options: Any) -> None:
  """Writes `json.dumps(value, **dump_options)` to `path` (`replacing`)."""
  write_text(path, json.dumps(value, **dump_options))
