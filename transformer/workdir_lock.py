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
process on another host is never broken here: the error says how to check that
host and remove the file by hand. A holder inside a Slurm job also records the job
(`slurm_job`), and the sweep's Slurm tasks ask the scheduler whether that job still
runs (`transformer/tools/sweep_slurm.py`, which removes the lock with `remove_stale`).

On a bucket (a gs:// or s3:// workdir) the lock is an object created only if
absent (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`): of two runs on any
hosts, one creates it. No process of another host can be looked at, so its
record carries a lease: the holder rewrites it every `LEASE_SECONDS / 4`
(`renewed`), and a lock not renewed for `LEASE_SECONDS` is stale, whoever holds
it. Breaking a stale lock is itself exclusive: the breaker first creates
`train.lock.break-<token>` (one of several breakers wins), then removes the lock
only if it still holds that token. Hosts' clocks must agree to within a
fraction of the lease (NTP does). A multi-host run's process 0 holds the lock.

Evaluation (`eval.py`, also `--watch`) reads checkpoints while training runs
and never takes the lock; `--watch` reads it to know whether the run it
follows is still running, and holds a lock of its own, WORKDIR/eval/watch.lock
(`WatchLock`, the same kind): one watcher per run.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from absl import logging

from transformer import domains, shutdown, storage
from transformer.errors import Refusal

LOCK_FILE = 'train.lock'
# A bucket lock's lease: a holder that has not renewed it for this long is taken as dead. The
# environment variable TRANSFORMER_LOCK_LEASE_SECONDS sets another (tests cross many renewals in a
# short run with a few seconds; every host of a run and its readers must use one value).
LEASE_ENV = 'TRANSFORMER_LOCK_LEASE_SECONDS'
LEASE_SECONDS = 120.0
# How long a lock that names no holder may be in the middle of being written.
_WRITE_GRACE_SECONDS = 0.5


def lease_seconds() -> float:
  """The lease a new bucket lock takes: LEASE_SECONDS, or TRANSFORMER_LOCK_LEASE_SECONDS."""
  return domains.seconds_from_env(LEASE_ENV, LEASE_SECONDS, 1, 86400, "a bucket lock's lease")


class WorkdirLockedError(Refusal, RuntimeError):
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
  record = {
    'host': socket.gethostname(),
    'pid': os.getpid(),
    'boot_id': _boot_id(),
    'start_ticks': _start_ticks(os.getpid()),
    'started': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'command': ' '.join(sys.argv),
  }
  if os.environ.get('SLURM_JOB_ID'):  # The job, and which start of it (a requeue starts it again).
    record['slurm_job'] = {
      'job_id': os.environ['SLURM_JOB_ID'],
      'restarts': int(os.environ.get('SLURM_RESTART_COUNT') or 0),
    }
  return record


def lock_path(workdir: str) -> str:
  return storage.join(storage.resolve(workdir), LOCK_FILE)


def read_holder(workdir: str) -> dict[str, Any] | None:
  """The holder recorded in WORKDIR/train.lock, or None if there is no lock.

  A lock file that is not a holder record (empty or partial JSON while it is being
  written, or damaged) reads as a holder with unknown fields and its content under
  'unreadable': alive as far as anyone can tell.
  """
  return _read_record(lock_path(workdir))


def _read_record(path: str) -> dict[str, Any] | None:
  """`read_holder` of the lock file at `path`."""
  try:
    text = storage.read_bytes(path)
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

  Only a process on this host can be looked at: one of another host is None, unless it
  holds a bucket lock whose lease ran out (False: it stopped renewing it).
  """
  if lease_expired(holder):
    return False
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


def lease_expired(holder: dict[str, Any]) -> bool:
  """Whether `holder` keeps a lease (a bucket lock) that it has not renewed in time."""
  renewed, lease = holder.get('renewed'), holder.get('lease_seconds')
  if not isinstance(renewed, int | float) or not isinstance(lease, int | float):
    return False
  return time.time() - renewed > lease


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


def remove_stale(workdir: str, holder: dict[str, Any]) -> None:
  """Removes WORKDIR/train.lock if it still holds `holder`, whom the caller knows to be dead."""
  WorkdirLock(workdir)._remove_stale(holder)


class WorkdirLock:
  """Context manager holding WORKDIR/train.lock for this process (see the module docstring)."""

  def __init__(self, workdir: str, name: str = LOCK_FILE):
    """`name`: the lock file's path in the workdir (another lock than the training run's)."""
    self.workdir = storage.resolve(workdir)
    self.path = storage.join(self.workdir, name)
    self._record: str | None = None
    self._on_bucket = storage.is_url(self.path)
    self._renewer: threading.Thread | None = None
    self._stop_renewing = threading.Event()

  def _new_record(self) -> dict[str, Any]:
    record = _this_process()
    if self._on_bucket:
      record.update(token=uuid.uuid4().hex, lease_seconds=lease_seconds(), renewed=time.time())
    return record

  def acquire(self) -> None:
    """Takes the lock, removing a stale one (a dead process on this host, a lapsed lease) first.

    Raises:
      WorkdirLockedError: naming the holder, if another live (or unknowable) run holds it.
    """
    record = self._new_record()
    for _ in range(3):  # A stale lock removed, then retried; a racing taker wins fairly.
      text = json.dumps(record, sort_keys=True)
      try:
        storage.create_exclusive(self.path, text.encode('utf-8'))
      except FileExistsError:
        holder = _read_record(self.path)
        if holder is not None and 'unreadable' in holder:
          time.sleep(_WRITE_GRACE_SECONDS)  # A lock being written: its record follows at once.
          holder = _read_record(self.path)
        if holder is None:
          continue  # Released meanwhile.
        alive = holder_alive(holder)
        if alive is False:
          self._remove_stale(holder)
          continue
        raise WorkdirLockedError(self._refusal(holder, alive)) from None
      self._record = text
      if self._on_bucket:
        self._start_renewing(record)
      return
    raise WorkdirLockedError(f'Could not take {self.path}: other processes keep taking it.')

  def _start_renewing(self, record: dict[str, Any]) -> None:
    """Rewrites the bucket lock's `renewed` every quarter lease while this process holds it."""

    def renew() -> None:
      while not self._stop_renewing.wait(record['lease_seconds'] / 4):
        try:
          if storage.read_bytes(self.path).decode('utf-8') != self._record:
            logging.error("%s is no longer this run's lock; not renewing it.", self.path)
            return
          renewed = json.dumps({**record, 'renewed': time.time()}, sort_keys=True)
          storage.write_bytes(self.path, renewed.encode('utf-8'))
          self._record = renewed
        except Exception as e:  # A failed renewal is retried; the lease allows three.
          logging.warning('Could not renew the lease of %s: %s', self.path, e)

    self._stop_renewing.clear()
    self._renewer = threading.Thread(target=renew, name='workdir-lock-lease', daemon=True)
    self._renewer.start()

  def _remove_stale(self, holder: dict[str, Any]) -> None:
    if self._on_bucket:
      self._break_stale_object(holder)
      return
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

  def _break_stale_object(self, holder: dict[str, Any]) -> None:
    """Removes a bucket lock whose holder is dead, if this process wins the right to."""
    marker = f'{self.path}.break-{holder.get("token") or holder.get("pid")}'
    # A token of its own: `storage.create_exclusive` takes an object holding exactly this as its.
    claim = json.dumps({**_this_process(), 'token': uuid.uuid4().hex}).encode('utf-8')
    try:
      storage.create_exclusive(marker, claim)
    except FileExistsError:
      time.sleep(_WRITE_GRACE_SECONDS)  # Another run breaks it; then both race to create.
      return
    try:
      if _read_record(self.path) == holder:  # Still the dead one's.
        storage.remove(self.path)
        reason = (
          f'its lease of {holder.get("lease_seconds")} s lapsed'
          if lease_expired(holder)
          else 'it no longer runs'
        )
        logging.warning('Removed the stale lock %s of %s: %s.', self.path, describe(holder), reason)
    except FileNotFoundError:
      pass
    finally:
      with contextlib.suppress(FileNotFoundError):
        storage.remove(marker)

  # What the refusal calls the holder ("if that run is over"), who takes a lapsed lease over,
  # and what to do about a live holder (also said of a lease that still runs).
  _HOLDER = 'run'
  _TAKER = 'the next run'
  _LIVE_ADVICE = (
    'Wait for it to finish or stop it (SIGTERM checkpoints it), or give this run another --workdir.'
  )
  _LEASE_ADVICE = ' ' + _LIVE_ADVICE

  def _refusal(self, holder: dict[str, Any], alive: bool | None) -> str:
    """The error for a lock that another holder has (`_unreadable` and `_in_use` say whose)."""
    if 'unreadable' in holder:
      return self._unreadable(holder['unreadable'])
    if alive is None and isinstance(holder.get('renewed'), int | float):
      ago = max(time.time() - holder['renewed'], 0.0)
      how = (
        f'It renewed its lease {ago:.0f} s ago; a holder silent for '
        f'{holder.get("lease_seconds")} s is taken as dead, and {self._TAKER} takes the lock '
        f'over.{self._LEASE_ADVICE}'
      )
    elif alive is None and holder.get('host') is not None:
      how = (
        f'This host cannot see processes of host {holder.get("host")}: if that '
        f'{self._HOLDER} is over (check `ps -p {holder.get("pid")}` there), remove '
        f'{self.path} and run again.'
      )
    else:
      how = self._LIVE_ADVICE
    return f'{self._in_use(holder)} {how}'

  def _unreadable(self, content: str) -> str:
    workdir = self.workdir
    return (
      f'The workdir {workdir} holds a lock, {self.path}, that names no run: its content, '
      f'{content!r}, is not the record train.py writes (damaged, or written by something '
      f'else). Nothing was changed. If no train.py runs on this workdir (check `ps aux | grep '
      f'{workdir}` on every host that sees it), remove the file (rm {self.path}) and run again.'
    )

  def _in_use(self, holder: dict[str, Any]) -> str:
    return (
      f'The workdir {self.workdir} is in use by another training run: {describe(holder)}, '
      f'which holds {self.path}. Nothing was changed.'
    )

  def release(self) -> None:
    """Removes the lock if it is still this process's."""
    if self._renewer is not None:
      self._stop_renewing.set()
      self._renewer.join()
      self._renewer = None
    if self._record is None:
      return
    try:
      if storage.read_bytes(self.path).decode('utf-8', 'replace') == self._record:
        storage.remove(self.path)
    except FileNotFoundError:
      pass
    self._record = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    with shutdown.part(f'releasing {self.path}'):
      self.release()


# One `eval.py --watch` per training run, in the folder it writes.
WATCH_LOCK_FILE = 'eval/watch.lock'


class WatchLock(WorkdirLock):
  """WORKDIR/eval/watch.lock, held by `eval.py --watch` while it follows the run.

  A second watcher of the same run would evaluate every checkpoint again and write each
  step twice to WORKDIR/eval/metrics.jsonl: it is refused, naming the first. Taken,
  released however the watcher ends and found stale (its holder dead, its lease lapsed)
  as WORKDIR/train.lock is; the training run's own lock is only read.
  """

  def __init__(self, workdir: str):
    super().__init__(workdir, WATCH_LOCK_FILE)

  def acquire(self) -> None:
    storage.makedirs(storage.dirname(self.path))  # WORKDIR/eval/, where the watcher writes.
    super().acquire()

  _HOLDER = 'eval.py'
  _TAKER = 'the next eval.py --watch'
  _LIVE_ADVICE = 'Let it follow the run, or stop it (Ctrl-C) before watching with other flags.'
  _LEASE_ADVICE = ''

  def _unreadable(self, content: str) -> str:
    workdir, path = self.workdir, self.path
    return (
      f'{path} holds no record of an eval.py --watch: its content, {content!r}, is not what '
      'eval.py writes (damaged, or written by something else). Nothing was changed. If no '
      f'eval.py --watch follows the run in {workdir} (check `ps aux | grep {workdir}` on every '
      f'host that sees it), remove the file (rm {path}) and run again.'
    )

  def _in_use(self, holder: dict[str, Any]) -> str:
    workdir = self.workdir
    return (
      f'Another eval.py --watch follows the run in {workdir}: {describe(holder)}, which '
      f'holds {self.path}. Nothing was changed: two would evaluate every checkpoint twice and '
      f'write each step twice to {workdir}/eval/metrics.jsonl.'
    )
