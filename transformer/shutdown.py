"""A bound on how long a process takes to end: no storage client can hold it past its deadline.

Once a run has decided to stop (a SIGTERM or a scheduler's notice, or its last step done),
`Deadline.arm` starts a clock of `TRANSFORMER_SHUTDOWN_SECONDS` (DEFAULT_SECONDS). What the
ending waits for (a checkpoint commit, the metrics' last write, the lock's release) runs inside
`deadline.part(name)`. If the clock runs out, a watchdog thread writes one message to stderr:

  train.py: error: the run did not end within 300 s of SIGTERM: it is stuck committing
  checkpoint 20 (gs://b/run/checkpoints/20) for 212 s, in transformer/checkpoints.py:445
  (wait_until_finished). Saved: checkpoint 10 (committed), metrics.jsonl to step 20. Not saved:
  checkpoint 20. The stacks of every thread are in /tmp/train.py-stuck-1234.txt. Run the same
  command to resume from the last committed checkpoint.

and ends the process at once with EXIT_CODE (`os._exit`: no `finally` and no atexit handler runs,
since each of them could wait on the same storage). What is saved is said by the callables the
run registers (`deadline.saved_by`); the stuck place is the part's name, or, outside any part,
the innermost frame of this project's code on the main thread.

Storage requests themselves time out and are retried a bounded number of times
(`storage.configure_clients`); the deadline covers what those bounds do not: a server that
answers too slowly to time out, retries that add up, a library's own thread that never returns.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import transformer
from transformer import domains

SECONDS_ENV = 'TRANSFORMER_SHUTDOWN_SECONDS'
DEFAULT_SECONDS = 300.0
# The exit status of a process ended by its deadline (EX_TEMPFAIL: run it again to resume).
EXIT_CODE = 75


def deadline_seconds() -> float:
  """TRANSFORMER_SHUTDOWN_SECONDS, or DEFAULT_SECONDS; a bad value is refused."""
  return domains.seconds_from_env(
    SECONDS_ENV, DEFAULT_SECONDS, 1, 86400, 'the time a process may take to end'
  )


_ACTIVE: Deadline | None = None  # The innermost `Deadline` entered in this process.


@contextlib.contextmanager
def part(name: str) -> Iterator[None]:
  """`Deadline.part` of the active deadline (none: nothing is named)."""
  deadline = _ACTIVE
  if deadline is None:
    yield
    return
  with deadline.part(name):
    yield


def saved_by(describe: Callable[[], tuple[list[str], list[str]]]) -> None:
  """`Deadline.saved_by` of the active deadline, if any."""
  if _ACTIVE is not None:
    _ACTIVE.saved_by(describe)


def ending(error: BaseException | None, normal: str) -> str:
  """Why a process ends, for `arm`: `normal`, or the interruption or error on its way out."""
  if error is None:
    return normal
  if isinstance(error, KeyboardInterrupt):
    return f'an interruption ({type(error).__name__})'
  return f'an error ({type(error).__name__})'


def arm(why: str) -> None:
  """`Deadline.arm` of the active deadline, if any."""
  if _ACTIVE is not None:
    _ACTIVE.arm(why)


class Deadline:
  """The clock of a process's ending and the watchdog thread that enforces it.

  Use as a context manager around the whole run: the watchdog thread starts idle on entry and
  stops on exit; `arm` starts the clock (again only to shorten it).
  """

  def __init__(self, program: str, *, seconds: float | None = None, advice: str = ''):
    """`program`: the command's name in the message; `advice`: its last sentence."""
    self.program = program
    self.seconds = deadline_seconds() if seconds is None else seconds
    self.advice = advice
    self._expires: float | None = None
    self._why = ''
    self._parts: list[tuple[str, float]] = []  # (name, since), innermost last.
    self._saved_by: list[Callable[[], tuple[list[str], list[str]]]] = []
    self._wake = threading.Event()
    self._done = threading.Event()
    self._thread: threading.Thread | None = None

  def __enter__(self) -> Deadline:
    global _ACTIVE
    self._outer, _ACTIVE = _ACTIVE, self
    self._thread = threading.Thread(target=self._watch, name='shutdown-deadline', daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc_info) -> None:
    global _ACTIVE
    _ACTIVE = self._outer
    self._done.set()
    self._wake.set()
    self._thread.join()

  @property
  def armed(self) -> bool:
    return self._expires is not None

  def arm(self, why: str) -> None:
    """Starts the clock: the process must end within `self.seconds` of now.

    Safe in a signal handler: it takes no lock (the main thread may hold any when a handler runs).
    """
    expires = time.monotonic() + self.seconds
    if self._expires is None or expires < self._expires:
      self._why = why
      self._expires = expires
    self._wake.set()

  def saved_by(self, describe: Callable[[], tuple[list[str], list[str]]]) -> None:
    """Registers `describe() -> (saved, not_saved)`, read for the message (in memory only)."""
    self._saved_by.append(describe)

  @contextlib.contextmanager
  def part(self, name: str) -> Iterator[None]:
    """Names what the process waits for inside the block (`name`: 'committing checkpoint 20')."""
    entry = (name, time.monotonic())
    self._parts.append(entry)  # One thread's list: appends and removes are atomic.
    try:
      yield
    finally:
      self._parts.remove(entry)

  def _watch(self) -> None:
    while not self._done.is_set():
      expires = self._expires
      timeout = None if expires is None else max(0.0, expires - time.monotonic())
      if self._wake.wait(timeout):
        self._wake.clear()
        continue
      if self._done.is_set():
        return
      if self._expires is not None and time.monotonic() >= self._expires:
        self._expire()

  def _stuck_at(self) -> str:
    """Where the main thread waits: the innermost named part, or this project's innermost frame."""
    parts = list(self._parts)
    if parts:
      name, since = parts[-1]
      where = f'it is stuck {name} for {time.monotonic() - since:.0f} s'
    else:
      where = 'it is stuck'
    frame = sys._current_frames().get(threading.main_thread().ident)  # pylint: disable=protected-access
    innermost = None
    while frame is not None:
      path = os.path.abspath(frame.f_code.co_filename)
      if path.startswith(transformer.CODE_DIR + os.sep) and os.sep + 'tests' + os.sep not in path:
        innermost = (
          f'{os.path.relpath(path, transformer.CODE_DIR)}:{frame.f_lineno} ({frame.f_code.co_name})'
        )
        break
      frame = frame.f_back
    return f'{where}, in {innermost}' if innermost else where

  def message(self) -> str:
    """The deadline's message (without the stacks' file): what is stuck, saved and not saved."""
    saved, not_saved = [], []
    for describe in self._saved_by:
      try:
        done, missing = describe()
      except Exception as e:  # pylint: disable=broad-except  (the message must still go out)
        done, missing = [], [f'(unknown: {type(e).__name__}: {e})']
      saved += done
      not_saved += missing
    text = (
      f'{self.program}: error: the process did not end within {self.seconds:g} s of {self._why}: '
      f'{self._stuck_at()}.'
    )
    if saved:
      text += f' Saved: {"; ".join(saved)}.'
    if not_saved:
      text += f' Not saved: {"; ".join(not_saved)}.'
    return text

  def _expire(self) -> None:
    text = self.message()
    stacks = None
    try:
      handle, stacks = tempfile.mkstemp(
        prefix=f'{self.program}-stuck-{os.getpid()}-', suffix='.txt'
      )
      with os.fdopen(handle, 'w') as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    except OSError:
      stacks = None
    if stacks:
      text += f' The stacks of every thread are in {stacks}.'
    if self.advice:
      text += f' {self.advice}'
    try:
      sys.stderr.write(text + '\n')
      sys.stderr.flush()
    finally:
      os._exit(EXIT_CODE)  # pylint: disable=protected-access
