"""transformer/shutdown.py: the deadline of a process's end, its message and its exit.

A deadline that expires ends its process (`os._exit`), so those cases run in a child process.
The end-to-end cases (a store that stops answering inside a commit, for train.py and
eval.py --watch) are in tests/test_bucket_endurance.py.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from transformer import shutdown

REPO = Path(__file__).resolve().parents[1]


def _child(code: str, **env) -> tuple[subprocess.CompletedProcess, float]:
  started = time.monotonic()
  result = subprocess.run(
    [sys.executable, '-c', textwrap.dedent(code)],
    cwd=REPO,
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=120,
  )
  return result, time.monotonic() - started


def test_message_names_the_part_what_is_saved_and_what_is_not():
  with shutdown.Deadline('train.py', seconds=30, advice='Run it again.') as deadline:
    deadline.saved_by(lambda: (['checkpoint /w/checkpoints/10'], ['checkpoint 20 (...)']))
    deadline.saved_by(lambda: (['/w/metrics.jsonl to step 20'], []))
    deadline.arm('SIGTERM')
    with deadline.part('committing checkpoint 20'):
      message = deadline.message()
  assert message.startswith(
    'train.py: error: the process did not end within 30 s of SIGTERM: it is stuck committing '
    'checkpoint 20 for 0 s, in transformer/'  # The innermost frame of the code, never a test's.
  ), message
  assert 'Saved: checkpoint /w/checkpoints/10; /w/metrics.jsonl to step 20.' in message
  assert 'Not saved: checkpoint 20 (...).' in message


def test_the_earliest_deadline_holds_and_nothing_fires_once_the_block_ends():
  with shutdown.Deadline('x', seconds=100) as deadline:
    assert not deadline.armed
    deadline.arm('first')
    first = deadline._expires
    time.sleep(0.01)
    deadline.arm('second')  # Later: the first clock stands.
    assert deadline._expires == first and deadline._why == 'first'
  shutdown.arm('after the block')  # No active deadline: nothing happens.


def test_a_process_stuck_after_its_deadline_exits_75_with_one_message():
  result, seconds = _child(
    """
    import time
    from transformer import shutdown
    with shutdown.Deadline('prog', advice='Run it again.'):
      shutdown.saved_by(lambda: (['a'], ['b']))
      shutdown.arm('the end of training')
      with shutdown.part('releasing gs://b/run/train.lock'):
        time.sleep(60)
    print('never')
    """,
    TRANSFORMER_SHUTDOWN_SECONDS='1',
  )
  assert result.returncode == shutdown.EXIT_CODE, result.stderr
  assert seconds < 30
  assert 'never' not in result.stdout
  (line,) = result.stderr.splitlines()
  assert line.startswith(
    'prog: error: the process did not end within 1 s of the end of training: it is stuck '
    'releasing gs://b/run/train.lock for 1 s'
  ), line
  assert 'Saved: a. Not saved: b.' in line and line.endswith('Run it again.')
  stacks = line.split('The stacks of every thread are in ', 1)[1].split('.txt')[0] + '.txt'
  assert 'time.sleep' in Path(stacks).read_text() or 'File "<string>"' in Path(stacks).read_text()
  os.remove(stacks)


def test_a_process_that_ends_in_time_is_not_touched():
  result, _ = _child(
    """
    from transformer import shutdown
    with shutdown.Deadline('prog', seconds=1):
      shutdown.arm('SIGTERM')
    print('ended')
    """
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout == 'ended\n'


@pytest.mark.parametrize(
  'name, value',
  [
    ('TRANSFORMER_SHUTDOWN_SECONDS', 'soon'),
    ('TRANSFORMER_SHUTDOWN_SECONDS', '0'),
    ('TRANSFORMER_STORAGE_TIMEOUT_SECONDS', '-1'),
    ('TRANSFORMER_LOCK_LEASE_SECONDS', 'nan'),
  ],
)
def test_bad_settings_are_refused_before_any_work(tmp_path, name, value):
  workdir = tmp_path / 'run'
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/tiny.py', f'--workdir={workdir}'],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', name: value},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  assert f'{name}={value!r}' in result.stderr and 'Traceback' not in result.stderr
  assert not workdir.exists()
