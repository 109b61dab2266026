"""One training run per workdir: WORKDIR/train.lock, taken before anything there is written.

The lock is a file created with O_CREAT | O_EXCL (atomic on local filesystems
and on NFS v3+ and other shared ones), holding the holder's host, pid, process
start time, boot id and command line as JSON. A second `train.py` on the same
workdir, on this host or another, is refused with an error naming the
holder. The lock is removed when the run ends, however it ends (an exception,
SIGTERM, Ctrl-C); only `kill -9`, a crash of the machine or a lost host leave
it behind. Such a stale lock is removed by the next run only when its holder
is provably dead: on this host, and its pid no longer runs (or runs another
process, started at another time or before a reboot). A lock held by a
process on another host is never broken: the error says how to check that
host and remove the file by hand.

Evaluation (`eval.py`, also `--watch`) reads checkpoints while training runs
and never takes the lock; `--watch` reads it to know whether the run it
follows is still running.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from typing import Any

from absl import logging

LOCK_FILE = 'train.lock'
# How long a lock that names no holder may be in the middle of being written.
_WRITE_GRACE_SECONDS = 0.5


class WorkdirLockedError(RuntimeError):
  """Another run holds the workdir."""


def _boot_id() -> str | None:
  try:
    with open('/proc/sys/kernel/random/boot_id') as f:
      return f.read().strip()
  except OSError:
    return None


def _start_ticks(pid: int) -> int | None:
  """The start time of process `pid` in clock ticks since boot (Linux), or None if unknown."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return None
  # The command name (field 2) may hold spaces and parentheses: fields after the last ')'.
  return int(stat[stat.rindex(')') + 2 :].split()[19])


def _this_process() -> dict[str, Any]:
  return {
    'host': socket.gethostname(),
    'pid': os.getpid(),
    'boot_id': _boot_id(),
    'start_ticks': _start_ticks(os.getpid()),
    'started': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'command': ' '.join(sys.argv),
  }


def lock_path(workdir: str) -> str:
  return os.path.join(os.path.abspath(os.path.expanduser(workdir)), LOCK_FILE)


def read_holder(workdir: str) -> dict[str, Any] | None:
  """The holder recorded in WORKDIR/train.lock, or None if there is no lock.

  A lock file that is not a holder record (empty or partial JSON while it is being
  written, or damaged) reads as a holder with unknown fields and its content under
  'unreadable': alive as far as anyone can tell.
  """
  try:
    with open(lock_path(workdir), 'rb') as f:
      text = f.read()
  except FileNotFoundError:
    return None
  try:
    holder = json.loads(text)
  except (json.JSONDecodeError, UnicodeDecodeError):
    holder = None
  if isinstance(holder, dict):
    return holder
  return {'host': None, 'pid': None, 'unreadable': text[:80].decode('utf-8', 'replace')}


def holder_alive(holder: dict[str, Any]) -> bool | None:
  """True if the holder runs, False if it is provably dead, None if this host cannot tell.

  Only a process on this host can be looked at: one of another host is None.
  """
  if holder.get('host') != socket.gethostname() or not isinstance(holder.get('pid'), int):
    return None
  if holder.get('boot_id') and _boot_id() and holder['boot_id'] != _boot_id():
    return False  # This machine rebooted since.
  try:
    os.kill(holder['pid'], 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # Another user's process: it exists.
  ticks = _start_ticks(holder['pid'])
  if holder.get('start_ticks') is not None and ticks is not None:
    return ticks == holder['start_ticks']  # Else the pid was reused by a later process.
  return True


def describe(holder: dict[str, Any]) -> str:
  """'pid 123 on host h (started 2026-..., `python train.py ...`)'."""
  if 'unreadable' in holder:
    return f'an unknown run (the lock holds {holder["unreadable"]!r}, not a holder record)'
  parts = [f'pid {holder.get("pid")} on host {holder.get("host")}']
  if holder.get('started'):
    parts.append(f'started {holder["started"]}')
  if holder.get('command'):
    parts.append(f'`{holder["command"]}`')
  return parts[0] + (f' ({", ".join(parts[1:])})' if len(parts) > 1 else '')


class WorkdirLock:
  """Context manager holding WORKDIR/train.lock for this process (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = lock_path(workdir)
    self._record: str | None = None

  def acquire(self) -> None:
    """Takes the lock, removing a stale one of a dead process on this host first.

    Raises:
      WorkdirLockedError: naming the holder, if another live (or unknowable) run holds it.
    """
    record = json.dumps(_this_process(), sort_keys=True)
    for _ in range(3):  # A stale lock removed, then retried; a racing taker wins fairly.
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        holder = read_holder(os.path.dirname(self.path))
        if holder is not None and 'unreadable' in holder:
          time.sleep(_WRITE_GRACE_SECONDS)  # A lock being written: its record follows at once.
          holder = read_holder(os.path.dirname(self.path))
        if holder is None:
          continue  # Released meanwhile.
        alive = holder_alive(holder)
        if alive is False:
          self._remove_stale(holder)
          continue
        raise WorkdirLockedError(self._refusal(holder, alive)) from None
      with os.fdopen(fd, 'w') as f:
        f.write(record)
        f.flush()
        os.fsync(f.fileno())
      self._record = record
      return
    raise WorkdirLockedError(f'Could not take {self.path}: other processes keep taking it.')

  def _remove_stale(self, holder: dict[str, Any]) -> None:
    # Renamed first, so that of two runs removing the same stale lock only one succeeds, and
    # neither can remove a lock that a third process took in between.
    aside = f'{self.path}.stale.{os.getpid()}'
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:
      return
    with open(aside) as f:
      taken = f.read()
    try:
      moved = json.loads(taken)
    except json.JSONDecodeError:
      moved = None
    if moved != holder:  # A live run's fresh lock: put it back.
      os.rename(aside, self.path)
      return
    os.remove(aside)
    logging.warning(
      'Removed the stale lock %s of %s, which no longer runs.', self.path, describe(holder)
    )

  def _refusal(self, holder: dict[str, Any], alive: bool | None) -> str:
    workdir = os.path.dirname(self.path)
    if 'unreadable' in holder:
      return (
        f'The workdir {workdir} holds a lock, {self.path}, that names no run: its content, '
        f'{holder["unreadable"]!r}, is not the record train.py writes (damaged, or written by '
        'something else). Nothing was changed. If no train.py runs on this workdir (check '
        f'`ps aux | grep {workdir}` on every host that sees it), remove the file (rm '
        f'{self.path}) and run again.'
      )
    if alive is None and holder.get('host') is not None:
      how = (
        f'This host cannot see processes of host {holder.get("host")}: if that run is '
        f'over (check `ps -p {holder.get("pid")}` there), remove {self.path} and run again.'
      )
    else:
      how = (
        'Wait for it to finish or stop it (SIGTERM checkpoints it), or give this run '
        'another --workdir.'
      )
    return (
      f'The workdir {workdir} is in use by another training run: {describe(holder)}, '
      f'which holds {self.path}. Nothing was changed. {how}'
    )

  def release(self) -> None:
    """Removes the lock if it is still this process's."""
    if self._record is None:
      return
    try:
      with open(self.path) as f:
        still_ours = f.read() == self._record
      if still_ours:
        os.remove(self.path)
    except FileNotFoundError:
      pass
    self._record = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()
