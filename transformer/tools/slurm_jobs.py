"""What Slurm says of a job: does a start of it still run? (`scontrol show job`)

Asked by the sweep runner (is a trial's recorded process alive?) and by `sweep_slurm`
(submitting, and removing the lock of a trial whose job ended); it imports nothing of the
sweep, so that both can.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Mapping
from typing import Any

# Job states (`scontrol show job`) in which a start of a job runs.
RUNNING = frozenset(
  {'RUNNING', 'COMPLETING', 'CONFIGURING', 'SUSPENDED', 'STOPPED', 'SIGNALING', 'STAGE_OUT'}
)
# Job states in which a job waits to run (again).
QUEUED = frozenset({'PENDING', 'REQUEUED', 'REQUEUE_HOLD', 'REQUEUE_FED', 'RESV_DEL_HOLD'})


@dataclasses.dataclass(frozen=True)
class JobState:
  state: str  # Slurm's JobState ('RUNNING', 'PENDING', 'COMPLETED', ...); 'GONE': forgotten.
  restarts: int  # How often the job was requeued.


def job_state(job_id: str) -> JobState | None:
  """What `scontrol show job` says of `job_id` ('12' or array task '12_3'); None: no answer.

  A job that Slurm no longer knows (it forgets ended jobs after `MinJobAge`, 300 s by
  default) is 'GONE'. None where there is no scontrol or no controller answers.
  """
  try:
    result = subprocess.run(
      ['scontrol', '--oneliner', 'show', 'job', str(job_id)],
      capture_output=True,
      text=True,
      timeout=30,
    )
  except (OSError, subprocess.TimeoutExpired):
    return None
  if result.returncode != 0:
    return JobState('GONE', 0) if 'Invalid job id' in result.stderr else None
  fields = dict(re.findall(r'(\w+)=(\S*)', result.stdout))
  if 'JobState' not in fields:
    return None
  return JobState(fields['JobState'], int(fields.get('Restarts') or 0))


def job_alive(record: Mapping[str, Any]) -> bool | None:
  """Whether the start of a job that `record` names ({'job_id', 'restarts'}) still runs.

  False once the job ended, was forgotten, or was requeued since (a later start, or one that
  waits); None where the scheduler cannot be asked.
  """
  state = job_state(record['job_id'])
  if state is None:
    return None
  return state.state in RUNNING and state.restarts == int(record.get('restarts') or 0)
