"""Runs on buckets as long runs meet them: many lease renewals and commits, signals mid-commit,
several processes, and a store that stops answering.

The lease is shortened through its documented setting (TRANSFORMER_LOCK_LEASE_SECONDS=2: a
renewal every 0.5 s), so that a run of seconds crosses dozens of renewals while it commits a
checkpoint every few steps. A store that accepts requests and never answers is the test
servers' front, stalled (`object_stores.Front.stall`); the process must then end within
TRANSFORMER_SHUTDOWN_SECONDS, naming what it was stuck on and what was saved.
"""

import http.server
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import emulator_stall
import numpy as np
import pytest
from object_stores import ENVIRONMENT
from test_reliability import REPO, sigterm_when, train  # noqa: F401  (the `train` fixture)

from transformer import checkpoints, metrics, shutdown, storage, workdir_lock

pytestmark = pytest.mark.slow

LEASE = {'TRANSFORMER_LOCK_LEASE_SECONDS': '2'}


def _rows(workdir: str) -> list[dict]:
  text = storage.read_text(storage.join(workdir, 'metrics.jsonl'))
  return [json.loads(line) for line in text.splitlines()]


class _LeaseWatch:
  """Reads WORKDIR/train.lock every 0.1 s in a thread: the distinct `renewed` times it saw."""

  def __init__(self, workdir: str):
    self.path = workdir_lock.lock_path(workdir)
    self.renewals: set[float] = set()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()

  def _watch(self) -> None:
    while not self._stop.wait(0.1):
      try:
        record = json.loads(storage.read_text(self.path))
      except (OSError, ValueError):  # Absent (before the run takes it, after), or mid-rewrite.
        continue
      self.renewals.add(record['renewed'])

  def stop(self) -> set[float]:
    self._stop.set()
    self._thread.join()
    return self.renewals


def _popen(train, command, **env):  # noqa: F811
  return subprocess.Popen(
    command,
    cwd=REPO,
    env={**train.env, **env},
    stderr=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    text=True,
  )


def test_gs_run_crosses_lease_renewals_and_commits(train, object_stores):  # noqa: F811
  workdir = storage.join(object_stores.bucket('gs'), 'long')
  command = train.command(
    workdir, num_train_steps=40, checkpoint_every_steps=4, log_every_steps=4, eval_every_steps=40
  )
  watch = _LeaseWatch(workdir)
  started = time.monotonic()
  process = _popen(train, command, **LEASE)
  _, log = process.communicate(timeout=300)
  seconds = time.monotonic() - started
  renewals = watch.stop()

  assert process.returncode == 0, log[-3000:]
  # The lease was renewed all along (its first record counts once), and the lock is gone.
  assert len(renewals) >= 6, (len(renewals), seconds)
  assert not storage.exists(workdir_lock.lock_path(workdir))
  directory = storage.join(workdir, 'checkpoints')
  assert checkpoints.committed_steps(directory) == [4 * k for k in range(1, 11)][-3:]
  assert checkpoints.uncommitted(directory) == []
  assert [r['step'] for r in _rows(workdir) if 'train_loss' in r] == list(range(4, 41, 4))
  assert 'Could not renew the lease' not in log


def test_sigterm_during_a_commit_on_gs_is_committed_and_resumes(train, object_stores):  # noqa: F811
  """SIGTERM from inside the save of checkpoint 4: the run finishes its step, commits, ends 0."""
  workdir = storage.join(object_stores.bucket('gs'), 'term')
  settings = dict(num_train_steps=12, checkpoint_every_steps=4, log_every_steps=1)
  process = _popen(train, train.command(workdir, fault='term_during_save:4', **settings), **LEASE)
  _, log = process.communicate(timeout=300)

  assert process.returncode == 0, log[-3000:]
  assert 'sending SIGTERM to this process' in log
  stopped = max(r['step'] for r in _rows(workdir) if 'train_loss' in r)
  assert 4 <= stopped < 12
  directory = storage.join(workdir, 'checkpoints')
  assert checkpoints.committed_steps(directory)[-1] == stopped
  assert checkpoints.uncommitted(directory) == []
  assert f'Stopped by SIGTERM after step {stopped}; checkpoint {directory}/{stopped}' in log
  assert not storage.exists(workdir_lock.lock_path(workdir))

  resumed = _popen(train, train.command(workdir, **settings), **LEASE)
  _, log = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, log[-3000:]
  assert f'Restored checkpoint {directory}/{stopped}' in log or f'step {stopped}' in log
  assert [r['step'] for r in _rows(workdir) if 'train_loss' in r] == list(range(1, 13))


def _two_processes(train, workdir: str, steps: int) -> list[str]:  # noqa: F811
  """Processes 0 and 1 of one run (jax.distributed, 2 CPU devices each: a 2 x 2 mesh of data
  and tensor parallelism, so each process holds half of every split array); their logs."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  command = train.command(
    workdir,
    f'--coordinator_address=localhost:{port}',
    '--num_processes=2',
    num_train_steps=steps,
    checkpoint_every_steps=4,
    log_every_steps=4,
    eval_every_steps=8,
    eval_bleu_sentences=8,
    **{'mesh.data': 2, 'mesh.tensor': 2},
  )
  processes = [
    _popen(train, [*command, f'--process_id={i}'], JAX_NUM_CPU_DEVICES='2', **LEASE)
    for i in range(2)
  ]
  logs = [p.communicate(timeout=300)[1] for p in processes]
  for process, log in zip(processes, logs, strict=True):
    assert process.returncode == 0, '\n\n'.join(log[-3000:] for log in logs)
  return logs


def test_two_processes_train_on_gs_across_renewals_and_resume(train, object_stores):  # noqa: F811
  """jax.distributed with 2 processes: process 0 holds and renews the lock; both save their
  shards of each checkpoint, and both restore them when the run resumes."""
  workdir = storage.join(object_stores.bucket('gs'), 'two')
  directory = storage.join(workdir, 'checkpoints')
  watch = _LeaseWatch(workdir)
  logs = _two_processes(train, workdir, 12)
  renewals = watch.stop()
  assert 'Process 0 of 2; 2 local of 4 devices.' in logs[0]
  assert len(renewals) >= 2
  assert not storage.exists(workdir_lock.lock_path(workdir))
  assert checkpoints.committed_steps(directory) == [4, 8, 12]

  logs = _two_processes(train, workdir, 16)
  assert f'Restored checkpoint {directory}/12' in logs[0]
  assert checkpoints.committed_steps(directory) == [8, 12, 16]
  rows = _rows(workdir)  # Process 0 alone writes metrics: no row twice.
  assert [r['step'] for r in rows if 'train_loss' in r] == [4, 8, 12, 16]
  assert all(np.isfinite(r['train_loss']) for r in rows if 'train_loss' in r)
  evals = [r for r in rows if 'eval_loss' in r]
  # Each leg evaluates at its last step.
  assert [r['step'] for r in evals] == [8, 12, 16] and 'eval_bleu' in evals[-1]
  assert not storage.exists(workdir_lock.lock_path(workdir))  # Process 0 released it.


def test_a_store_that_stops_answering_ends_the_run_within_its_deadline(
  train,  # noqa: F811
  object_stores,
  tmp_path,
):
  """The store stalls inside the commit of checkpoint 2, then SIGTERM: exit 75 in bounded time."""
  workdir = storage.join(object_stores.bucket('gs'), 'stuck')
  pause = tmp_path / 'go'
  command = train.command(
    workdir,
    f'--pause_file={pause}',
    fault='pause_during_save:2',
    num_train_steps=1000,
    checkpoint_every_steps=2,
    log_every_steps=1000,
    eval_every_steps=1000,
  )
  deadline = 6
  process = _popen(
    train,
    command,
    TRANSFORMER_SHUTDOWN_SECONDS=str(deadline),
    TRANSFORMER_STORAGE_TIMEOUT_SECONDS='120',  # Longer than the deadline: the deadline ends it.
  )
  try:
    ready = f'{pause}.ready'
    waited = time.monotonic()
    while not os.path.exists(ready):
      assert process.poll() is None, process.communicate()[1][-3000:]
      assert time.monotonic() - waited < 240, 'the save of checkpoint 2 never began'
      time.sleep(0.05)
    object_stores.stall()
    pause.touch()  # The commit goes on, into a store that no longer answers.
    time.sleep(0.5)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, log = process.communicate(timeout=120)
    seconds = time.monotonic() - signalled
  finally:
    object_stores.resume()
    if process.poll() is None:
      process.kill()

  assert process.returncode == shutdown.EXIT_CODE, log[-3000:]
  assert deadline - 1 <= seconds < deadline + 15, seconds
  errors = [line for line in log.splitlines() if ': error: ' in line]
  assert len(errors) == 1, log[-3000:]
  (message,) = errors
  assert f'did not end within {deadline} s of SIGTERM: it is stuck' in message
  assert 'checkpoint' in message.split('stuck', 1)[1]
  assert 'Not saved: checkpoint 2 (its commit did not finish' in message
  assert 'Run the same command to resume' in message
  assert 'Traceback' not in log
  stacks = message.split('The stacks of every thread are in ', 1)[1].split('.txt', 1)[0] + '.txt'
  text = pathlib.Path(stacks).read_text()
  assert 'Thread 0x' in text and 'checkpoints.py' in text, text[:3000]  # faulthandler's dump.
  os.remove(stacks)


def test_a_storage_request_without_an_answer_times_out_and_is_retried(object_stores):
  """gs:// (gcsfs: no timeout of its own) and s3://: bounded tries, then the client's error."""
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen(64)
  accepted = []

  def accept():
    while True:
      try:
        accepted.append(listener.accept()[0])
      except OSError:
        return

  threading.Thread(target=accept, daemon=True).start()
  url = f'http://127.0.0.1:{listener.getsockname()[1]}'
  # gcsfs waits 1, 2, 4, 8 and 16 s between its tries (gcsfs.retry.retry_request): its own
  # backoff, not what is tested here, so the process below skips those 31 s.
  code = (
    'import asyncio, sys, time, types\n'
    'import gcsfs.retry\n'
    'from transformer import storage\n'
    'gcsfs.retry.asyncio = types.SimpleNamespace(sleep=lambda seconds: asyncio.sleep(0))\n'
    'started = time.monotonic()\n'
    'try:\n'
    '  storage.read_bytes(sys.argv[1])\n'
    'except Exception as e:\n'
    '  print(type(e).__name__, round(time.monotonic() - started, 1))\n'
  )
  env = {
    **os.environ,
    'STORAGE_EMULATOR_HOST': url,
    'AWS_ENDPOINT_URL': url,
    'AWS_ENDPOINT_URL_S3': url,
    'TRANSFORMER_STORAGE_TIMEOUT_SECONDS': '0.5',
  }
  try:
    for path, tries in (('s3://silent-bucket/a', 5), ('gs://silent-bucket/a', 6)):
      before = len(accepted)
      result = subprocess.run(
        [sys.executable, '-c', code, path],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
      )
      name, seconds = result.stdout.split()
      assert 'Timeout' in name or 'ClientError' in name, result.stdout + result.stderr[-2000:]
      assert float(seconds) < 30  # 0.5 s a try, and s3fs's own backoff (about 1 s in all).
      assert len(accepted) - before >= tries  # Each try a new connection; then it gave up.
  finally:
    listener.close()
    for connection in accepted:
      connection.close()


def test_a_server_error_is_retried_and_a_missing_object_is_not():
  """An object store's HTTP 500 ("InternalError: please try again") is retried by both clients,
  s3fs through `storage.is_server_error`; a 404 is an answer, asked once. The server below
  fails each object's first two GETs, then serves it."""
  requests = []

  class FlakyStore(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802  (http.server's name)
      requests.append(self.path)
      key = self.path.split('?', 1)[0]
      if 'missing' in key:
        status, body = 404, b'<Error><Code>NoSuchKey</Code></Error>'
      elif sum(r.split('?', 1)[0] == key for r in requests) <= 2:
        status, body = 500, b'<Error><Code>InternalError</Code><Message>retry</Message></Error>'
      else:
        status, body = 200, b'whole object'
      self.send_response(status)
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), FlakyStore)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  url = f'http://127.0.0.1:{server.server_address[1]}'
  code = (
    'import asyncio, sys, types\n'
    'import gcsfs.retry\n'
    'from transformer import storage\n'
    'gcsfs.retry.asyncio = types.SimpleNamespace(sleep=lambda seconds: asyncio.sleep(0))\n'
    'print(storage.read_bytes(sys.argv[1]).decode())\n'
    'try:\n'
    '  storage.read_bytes(sys.argv[2])\n'
    'except FileNotFoundError:\n'
    '  print("not found")\n'
  )
  env = {**os.environ, **ENVIRONMENT, 'STORAGE_EMULATOR_HOST': url, 'AWS_ENDPOINT_URL': url}
  env['AWS_ENDPOINT_URL_S3'] = url
  try:
    for scheme in ('s3', 'gs'):
      requests.clear()
      result = subprocess.run(
        [sys.executable, '-c', code, f'{scheme}://flaky/a', f'{scheme}://flaky/missing'],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
      )
      assert result.stdout.split('\n')[:2] == ['whole object', 'not found'], (
        scheme,
        result.stdout + result.stderr[-3000:],
      )
      assert sum('missing' not in r for r in requests) == 3, (scheme, requests)
      assert sum('missing' in r for r in requests) == 1, (scheme, requests)
  finally:
    server.shutdown()


def test_s3_lock_renews_across_many_writes(object_stores, monkeypatch):
  """Training runs cannot live on s3:// (Orbax); what can: a lease renewed under many rewrites,
  read all along by another reader (reads that meet a rewrite read again, `storage.read_bytes`)."""
  monkeypatch.setenv('TRANSFORMER_LOCK_LEASE_SECONDS', '1')
  workdir = storage.join(object_stores.bucket('s3'), 'run')
  watch = _LeaseWatch(workdir)
  with workdir_lock.WorkdirLock(workdir):
    writer = metrics.MetricsWriter(workdir)
    started, step = time.monotonic(), 0
    while step < 40 or time.monotonic() - started < 3:  # 12 renewals, a quarter second apart.
      step += 1
      writer.write(step, {'train_loss': 1.0 / step})
      time.sleep(0.02)
    writer.close()
  renewals = watch.stop()

  assert len(renewals) >= 6, renewals
  assert not storage.exists(workdir_lock.lock_path(workdir))
  assert [r['step'] for r in _rows(workdir)] == list(range(1, step + 1))


def test_a_watcher_whose_store_stops_answering_ends_within_its_deadline(
  train,  # noqa: F811
  object_stores,
):
  """eval.py --watch of a gs:// run that another host trains: SIGTERM, stalled store, exit 75."""
  workdir = storage.join(object_stores.bucket('gs'), 'watched')
  stopped, log = sigterm_when(train, train.command(workdir, num_train_steps=1000), 'step 2/1000')
  assert stopped.returncode == 0, log[-3000:]
  # A live run on another host, as far as the watcher can tell: it waits for step 1000.
  holder = {
    'host': 'tpu-host-0',
    'pid': 17,
    'command': 'python train.py',
    'token': 'x',
    'lease_seconds': 120.0,
    'renewed': time.time(),
  }
  storage.write_json(workdir_lock.lock_path(workdir), holder)
  deadline = 5
  process = _popen(
    train,
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      '--watch',
      '--poll_seconds=0.2',
      '--split=validation',
      '--decoder=greedy',
      '--n_bootstrap=1',
    ],
    TRANSFORMER_SHUTDOWN_SECONDS=str(deadline),
    TRANSFORMER_STORAGE_TIMEOUT_SECONDS='120',
  )
  log = []
  try:
    for line in process.stderr:
      log.append(line)
      if 'Waiting for a checkpoint after step' in line:
        break
    object_stores.stall()
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    log.append(process.communicate(timeout=120)[1])
    seconds = time.monotonic() - signalled
  finally:
    object_stores.resume()
    if process.poll() is None:
      process.kill()
  log = ''.join(log)

  assert process.returncode == shutdown.EXIT_CODE, log[-3000:]
  assert deadline - 1 <= seconds < deadline + 15, seconds
  (message,) = [line for line in log.splitlines() if ': error: ' in line]
  assert f'did not end within {deadline} s of' in message
  assert 'stuck' in message and 'The steps evaluated so far are in' in message
  assert 'Traceback' not in log
  os.remove(message.split('The stacks of every thread are in ', 1)[1].split('.txt')[0] + '.txt')


def test_the_front_answers_while_an_upload_waits(object_stores):
  """fake-gcs-server alone stalls behind an upload's unfinished body; through the front it does
  not (tests/emulator_stall.py)."""
  emulator = object_stores.front.upstream
  for url in (emulator, object_stores.gcs_url):
    for bucket in ('stall-a', 'stall-b'):
      emulator_stall.make_bucket(url, f'{bucket}-{url.rsplit(":", 1)[1]}')
  waits = {}
  for url in (emulator, object_stores.gcs_url):
    port = url.rsplit(':', 1)[1]
    upload = emulator_stall.open_partial_upload(url, f'stall-a-{port}')
    try:
      waits[url] = emulator_stall.listing_seconds(url, f'stall-b-{port}', timeout=2)
    finally:
      upload.close()
  assert waits[emulator] is None  # The emulator's own defect: no answer while the body waits.
  assert waits[object_stores.gcs_url] is not None  # The front holds the body, the store answers.


@pytest.mark.parametrize('scheme', ['s3', 'gs'])
def test_a_read_while_the_object_is_replaced_gets_one_whole_version(object_stores, scheme):
  path = storage.join(object_stores.bucket(scheme), 'lock.json')
  versions = [b'a' * 3000, b'b' * 5000]
  storage.write_bytes(path, versions[0])
  stop = threading.Event()

  def replace():
    count = 0
    while not stop.is_set():
      count += 1
      storage.write_bytes(path, versions[count % 2])

  writer = threading.Thread(target=replace, daemon=True)
  writer.start()
  try:
    reads = [storage.read_bytes(path) for _ in range(150)]
  finally:
    stop.set()
    writer.join()
  assert set(reads) <= set(versions)


@pytest.mark.parametrize('scheme', ['s3', 'gs'])
def test_a_folder_whose_only_object_comes_and_goes_is_never_a_file(object_stores, scheme):
  """Another process's write probe under a new workdir: `isfile` must never say "file".

  epath's `is_file` is `exists() and not is_dir()`, two requests: the probe there for the
  first and gone for the second made a new gs:// workdir "a file" to process 1 of a run.
  """
  folder = storage.join(object_stores.bucket(scheme), 'new-run')
  probe = storage.join(folder, '.write-probe')
  stop = threading.Event()

  def come_and_go():
    while not stop.is_set():
      storage.write_bytes(probe, b'')
      storage.remove(probe)

  writer = threading.Thread(target=come_and_go, daemon=True)
  writer.start()
  try:
    answers = {storage.isfile(folder) for _ in range(150)}
  finally:
    stop.set()
    writer.join()
  assert answers == {False}
