"""Preemption: on SIGTERM, SIGINT or a scheduler's notice the loop checkpoints its step and exits.

A scheduler's notice is SIGUSR2, or the signal that `SUBMITIT_PREEMPT_SIGNAL` names (`USR1`, ...):
Slurm sends it before a job's time limit (`sbatch --signal=USR2@90`, as submitit asks) and
`scancel --signal=USR2` sends it by hand; it is handled as SIGTERM is.

Before training starts (start-up, data preparation, restoring a checkpoint) there is no step to
checkpoint: the watcher is installed unarmed, and a signal raises `Interrupted` at once, so
that the run stops within moments and every `finally` cleans up (temporary files of data
being prepared, the workdir's lock, the folders this start created). `arm()`, just before the
first step, switches to the mechanisms below.

Two mechanisms, chosen by the process count:

* One process: Python handlers for SIGTERM, SIGINT and the notice set a flag that the loop
  reads after each step. JAX's preemption sync point never fires without
  `jax.distributed`, so it cannot serve here.
* Several processes: JAX's preemption notifier, installed by
  `jax.distributed.initialize`, catches SIGTERM on any process, and
  `multihost_utils.reached_preemption_sync_point(step)` turns True on every
  process at the same step, so all of them save the same checkpoint. No Python
  handler is installed for SIGTERM: one would replace JAX's notifier; the notice's
  handler sends this process a SIGTERM, for that notifier. SIGINT keeps its
  default (KeyboardInterrupt, no checkpoint), since one process alone cannot
  make the others stop at its step.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import types
from collections.abc import Callable

import jax
from absl import logging
from jax.experimental import multihost_utils


def notice_signals() -> tuple[signal.Signals, ...]:
  """SIGUSR2 and the one `SUBMITIT_PREEMPT_SIGNAL` names (submitit's setting), if another.

  SIGTERM and SIGINT, handled already, are never among them.
  """
  name = os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2').upper().removeprefix('SIG')
  configured = getattr(signal, f'SIG{name}', signal.SIGUSR2)
  candidates = dict.fromkeys((signal.SIGUSR2, configured))
  return tuple(s for s in candidates if s not in (signal.SIGTERM, signal.SIGINT))


class Interrupted(KeyboardInterrupt):
  """SIGTERM or SIGINT before training started: nothing was trained, so the run stops at once.

  A KeyboardInterrupt, so that no `except Exception` swallows it on its way out.
  """

  def __init__(self, signum: int):
    self.signum = signum
    self.signal_name = signal.Signals(signum).name
    super().__init__(
      f'Stopped by {self.signal_name} before training began: nothing was trained or saved, '
      'and data being prepared was discarded (prepared data is complete or absent). Run the '
      'same command to start again.'
    )


def _forward_as_sigterm(signum: int, frame: types.FrameType | None) -> None:
  """A notice to one of several processes: a SIGTERM to itself, which JAX's notifier catches."""
  del frame
  logging.warning('Received %s: passing it on as SIGTERM.', signal.Signals(signum).name)
  os.kill(os.getpid(), signal.SIGTERM)


# Seconds after which a signal that came during a garbage-collection callback is delivered again.
_REDELIVERY_SECONDS = 0.01


def _in_gc_callback(frame: types.FrameType | None) -> bool:
  """Whether `frame` runs inside a garbage-collection callback (JAX registers `_xla_gc_callback`).

  An exception raised there is only printed by Python, never propagated.
  """
  codes = {getattr(callback, '__code__', None) for callback in gc.callbacks}
  codes.discard(None)
  while frame is not None:
    if frame.f_code in codes:
      return True
    frame = frame.f_back
  return False


def _deliver_again(signum: int) -> None:
  """Sends `signum` to this process again in a moment, from a thread (outside the callback)."""
  timer = threading.Timer(_REDELIVERY_SECONDS, os.kill, (os.getpid(), signum))
  timer.daemon = True
  timer.start()


class PreemptionWatcher:
  """Says, after each step, whether the run should checkpoint that step and stop.

  Use as a context manager around the whole run: the signal handlers are
  installed on entry and the previous ones restored on exit. Until
  `arm()` a signal raises `Interrupted` (nothing to checkpoint yet).
  """

  def __init__(self, on_stop: Callable[[str], None] | None = None):
    """`on_stop(why)`: called once training must stop (`shutdown.arm`), from the handler."""
    self.signal_name: str | None = None  # The signal that asked to stop (one process).
    self._on_stop = on_stop
    self._multi_process = jax.process_count() > 1
    self._previous_handlers: dict[int, object] = {}
    self._service_off_logged = False
    self._armed = False
    self._interrupted: int | None = None  # A signal before `arm()`.

  def __enter__(self) -> PreemptionWatcher:
    if self._multi_process:
      handlers = dict.fromkeys(notice_signals(), _forward_as_sigterm)
    else:
      handlers = dict.fromkeys((signal.SIGTERM, signal.SIGINT, *notice_signals()), self._on_signal)
    for signum, handler in handlers.items():
      self._previous_handlers[signum] = signal.signal(signum, handler)
    return self

  def arm(self) -> None:
    """From now on a signal stops the run after the current step, with a checkpoint of it.

    Raises `Interrupted` for a signal that came before, if a library swallowed it (Python
    only prints an exception raised in a garbage-collection callback, such as JAX's).
    """
    if self._interrupted is not None:
      raise Interrupted(self._interrupted)
    self._armed = True

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous_handlers.items():
      signal.signal(signum, handler)
    self._previous_handlers.clear()

  def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
    stops_now = not self._armed or (self.signal_name is not None and signum == signal.SIGINT)
    if stops_now and _in_gc_callback(frame):
      # Raised here, Python would only print it ("Exception ignored in: _xla_gc_callback")
      # and go on: the signal is delivered again once the callback has returned.
      _deliver_again(signum)
      return
    if not self._armed:
      self._interrupted = signum
      raise Interrupted(signum)
    name = signal.Signals(signum).name
    if self.signal_name is not None and signum == signal.SIGINT:
      # A second Ctrl-C means "now": the committed checkpoints are safe, an
      # interrupted save is discarded on the next start.
      raise KeyboardInterrupt
    self.signal_name = name
    if self._on_stop is not None:
      self._on_stop(name)
    logging.warning('Received %s: stopping after the current step with a checkpoint of it.', name)

  def reached(self, step: int) -> bool:
    """True if the run must save `step` and stop; call it after every step, on every process."""
    if not self._multi_process:
      return self.signal_name is not None
    try:
      reached = multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError as e:  # jax_enable_preemption_service is off: nothing is noticed.
      if not self._service_off_logged:
        logging.warning('No preemption checkpoints: %s', e)
        self._service_off_logged = True
      return False
    if reached:
      self.signal_name = 'preemption notice'
      if self._on_stop is not None:
        self._on_stop(self.signal_name)
    return reached
