"""Test-only fault injection: a training process kills itself with SIGKILL at a named point.

Setting the environment variable `TRANSFORMER_FAULT_POINT=<point>:<step>` makes
the process SIGKILL itself, which no handler can intercept, so the crash is as
abrupt as an out-of-memory kill or a lost machine. It exists for the
fault-injection tests (tests/test_reliability.py), which need to crash a run at
an exact point rather than after a guessed delay; nothing else sets it, and
without it every hook is a no-op. Points:

  after_step:N   at the end of loop iteration N: the step done, its metrics
                 written, and every save started so far committed (the hook
                 waits for them, so that the point is exact).
  during_save:N  inside the save of checkpoint N, in Orbax's background
                 thread: every file is written into the temporary
                 `<N>.orbax-checkpoint-tmp*` folder, which is not yet renamed
                 into place (committed).

This module is the one place that reads the variable.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable

from absl import logging

ENV_VAR = 'TRANSFORMER_FAULT_POINT'
POINTS = ('after_step', 'during_save')


@functools.cache
def _fault_point() -> tuple[str, int] | None:
  value = os.environ.get(ENV_VAR)
  if not value:
    return None
  point, _, step = value.partition(':')
  if point not in POINTS or not step.isdigit():
    raise ValueError(f'{ENV_VAR}={value!r}: expected <point>:<step> with point one of {POINTS}.')
  return point, int(step)


def enabled() -> bool:
  """Whether a fault point is set (so that callers install hooks only in tests)."""
  return _fault_point() is not None


def maybe_kill(point: str, step: int, settle: Callable[[], None] | None = None) -> None:
  """SIGKILLs this process if `TRANSFORMER_FAULT_POINT` names `point` at `step`.

  `settle` runs first, only then (e.g. waiting for saves in flight).
  """
  if _fault_point() == (point, step):
    if settle is not None:
      settle()
    logging.warning('%s=%s:%d: killing this process with SIGKILL.', ENV_VAR, point, step)
    logging.flush()
    os.kill(os.getpid(), signal.SIGKILL)
