"""transformer.storage and the workdir lock on local paths and on gs:// and s3:// buckets.

The buckets are real servers on 127.0.0.1 (fake-gcs-server, moto: `object_stores`); the
network guard (tests/netguard) fails any connection elsewhere.
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import boto3
import fsspec
import pytest

from transformer import storage, workdir_lock

SCHEMES = ('local', 'gs', 's3')


@pytest.fixture(params=SCHEMES)
def root(request, tmp_path) -> str:
  """A fresh folder: a local one, or a new bucket's prefix."""
  if request.param == 'local':
    return str(tmp_path)
  return storage.join(request.getfixturevalue('object_stores').bucket(request.param), 'runs')


def test_guard_refuses_connections_outside_loopback():
  with socket.socket() as sock, pytest.raises(ConnectionRefusedError, match='only connect to'):
    sock.connect(('192.0.2.1', 80))  # TEST-NET-1: never routed; the guard raises first.


@pytest.mark.parametrize(
  'path, expected',
  [
    ('gs:/bucket/run', 'gs:// takes two slashes (did you mean gs://bucket/run?)'),
    ('s3:bucket', 's3:// takes two slashes (did you mean s3://bucket?)'),
    ('hdfs://namenode/run', 'the scheme hdfs:// is not handled'),
    ('file:///tmp/run', 'the scheme file:// is not handled'),
    ('gs://', "'' is not a bucket name"),
    ('gs://Bad_Bucket/x', "'Bad_Bucket' is not a bucket name"),
    ('s3://bucket//x', "may not hold empty, '.' or '..' parts"),
    ('gs://bucket/a/../b', "may not hold empty, '.' or '..' parts"),
  ],
)
def test_path_errors_name_the_problem(path, expected):
  (error,) = storage.path_errors(path, '--workdir')
  assert error.startswith(f'--workdir={path}')
  assert expected in error


@pytest.mark.parametrize('path', ['runs/a', '/tmp/x', 'gs://bucket/run', 's3://my.bucket-1/a/b'])
def test_path_errors_accept_local_paths_and_urls(path):
  assert storage.path_errors(path, '--workdir') == []


def test_files_round_trip(root):
  folder = storage.join(root, 'run')
  storage.makedirs(folder)
  path = storage.join(folder, 'config.json')
  assert not storage.exists(path)
  storage.write_json(path, {'a': 1})
  assert json.loads(storage.read_text(path)) == {'a': 1}
  storage.write_text(path, 'replaced')
  assert storage.read_text(path) == 'replaced'
  storage.append_text(storage.join(folder, 'log.jsonl'), 'one\n')
  storage.append_text(storage.join(folder, 'log.jsonl'), 'two\n')
  assert storage.read_text(storage.join(folder, 'log.jsonl')) == 'one\ntwo\n'
  assert sorted(storage.listdir(folder)) == ['config.json', 'log.jsonl']
  assert storage.isdir(folder) and storage.isfile(path) and not storage.isdir(path)
  assert storage.glob(folder, '*.jsonl') == [storage.join(folder, 'log.jsonl')]
  with storage.replacing(storage.join(folder, 'model.bin')) as tmp, open(tmp, 'wb') as f:
    f.write(b'\x00\x01')
  assert storage.read_bytes(storage.join(folder, 'model.bin')) == b'\x00\x01'
  storage.remove(path)
  assert not storage.exists(path)
  with pytest.raises(FileNotFoundError):
    storage.remove(path)
  with pytest.raises(FileNotFoundError):
    storage.read_text(path)
  with pytest.raises(FileNotFoundError):
    storage.listdir(storage.join(root, 'absent'))


def test_create_exclusive_has_one_winner(root):
  storage.makedirs(root)
  path = storage.join(root, 'lock')
  storage.create_exclusive(path, b'first')
  with pytest.raises(FileExistsError):
    storage.create_exclusive(path, b'second')
  with pytest.raises(FileExistsError):
    storage.write_bytes(path, b'third', overwrite=False)
  assert storage.read_bytes(path) == b'first'


def test_bucket_errors(object_stores):
  for scheme in ('gs', 's3'):
    bucket = object_stores.bucket(scheme)
    assert storage.bucket_errors(f'{bucket}/run', '--workdir') == []
    assert not storage.isdir(f'{bucket}/run')  # The probe object was removed.
    (error,) = storage.bucket_errors(f'{scheme}://no-such-bucket-here/run', '--workdir')
    assert 'the bucket' in error and 'does not exist' in error, error


def test_lock_is_exclusive_and_released(root):
  workdir = storage.join(root, 'run')
  storage.makedirs(workdir)
  with workdir_lock.WorkdirLock(workdir) as lock:
    holder = workdir_lock.read_holder(workdir)
    assert holder['pid'] is not None and holder['host'] == socket.gethostname()
    with pytest.raises(workdir_lock.WorkdirLockedError, match='is in use by another training run'):
      workdir_lock.WorkdirLock(workdir).acquire()
    assert lock.path == storage.join(storage.resolve(workdir), workdir_lock.LOCK_FILE)
  assert workdir_lock.read_holder(workdir) is None


def test_watch_lock_is_exclusive_separate_from_the_run_and_released(root):
  """eval.py --watch's WORKDIR/eval/watch.lock, beside the training run's lock, on buckets too."""
  workdir = storage.join(root, 'run')
  storage.makedirs(workdir)
  with workdir_lock.WorkdirLock(workdir), workdir_lock.WatchLock(workdir) as lock:
    assert lock.path == storage.join(storage.resolve(workdir), 'eval', 'watch.lock')
    with pytest.raises(workdir_lock.WorkdirLockedError) as refused:
      workdir_lock.WatchLock(workdir).acquire()
    assert str(refused.value).startswith(
      f'Another eval.py --watch follows the run in {storage.resolve(workdir)}: pid {os.getpid()}'
    )
    assert workdir_lock.read_holder(workdir)['pid'] == os.getpid()  # The run's lock: its own.
  assert not storage.exists(lock.path)
  assert workdir_lock.read_holder(workdir) is None


@pytest.mark.parametrize('scheme', ['gs', 's3'])
def test_bucket_lock_of_another_host(object_stores, scheme, monkeypatch):
  """A live holder on another host is refused by its lease; a lapsed lease is taken over."""
  workdir = storage.join(object_stores.bucket(scheme), 'run')
  other = {
    'host': 'another-host',
    'pid': 4242,
    'command': 'python train.py',
    'token': 'abc',
    'lease_seconds': 60.0,
    'renewed': time.time() - 5,
  }
  path = workdir_lock.lock_path(workdir)
  storage.write_json(path, other)
  with pytest.raises(workdir_lock.WorkdirLockedError) as refused:
    workdir_lock.WorkdirLock(workdir).acquire()
  assert re.search('renewed its lease [56] s ago', str(refused.value))  # 5 s, and the look.
  assert workdir_lock.holder_alive(other) is None
  stale = {**other, 'renewed': time.time() - 61}
  storage.write_json(path, stale)
  assert workdir_lock.holder_alive(stale) is False
  with workdir_lock.WorkdirLock(workdir):
    assert workdir_lock.read_holder(workdir)['host'] == socket.gethostname()
    assert [n for n in storage.listdir(workdir) if 'break' in n] == []  # The marker went.


def test_bucket_lock_renews_its_lease(object_stores, monkeypatch):
  monkeypatch.setattr(workdir_lock, 'LEASE_SECONDS', 0.4)
  workdir = storage.join(object_stores.bucket('gs'), 'run')
  with workdir_lock.WorkdirLock(workdir):
    first = workdir_lock.read_holder(workdir)['renewed']
    time.sleep(1.0)  # Renewed every 0.1 s: never older than the lease while held.
    holder = workdir_lock.read_holder(workdir)
    assert holder['renewed'] > first
    assert workdir_lock.holder_alive(holder) is True
  assert workdir_lock.read_holder(workdir) is None


def test_bucket_lock_whose_create_landed_but_was_retried_is_taken(object_stores, monkeypatch):
  """A 5xx answer to a conditional create that did land, retried by the client (gcsfs, s3fs):
  the retry finds the object and says "exists". `storage.create_exclusive` finds its own bytes
  there (the lock's record and the stale-lock breaker's marker carry a token): created."""
  workdir = storage.join(object_stores.bucket('s3'), 'run')
  filesystem = fsspec.filesystem('s3')
  put = filesystem.pipe_file

  def landed_then_exists(key, data, **kwargs):
    put(key, data, **kwargs)
    raise FileExistsError(key)

  monkeypatch.setattr(filesystem, 'pipe_file', landed_then_exists)
  with workdir_lock.WorkdirLock(workdir):
    assert workdir_lock.read_holder(workdir)['pid'] == os.getpid()
    monkeypatch.setattr(filesystem, 'pipe_file', put)
    with pytest.raises(workdir_lock.WorkdirLockedError, match='in use by another'):
      workdir_lock.WorkdirLock(workdir).acquire()  # Another taker, its own token: refused.
    with pytest.raises(FileExistsError):  # Other bytes there: not this call's.
      storage.create_exclusive(workdir_lock.lock_path(workdir), b'{}')
  assert workdir_lock.read_holder(workdir) is None
  # The same for the marker that claims the breaking of a dead run's lock (a lapsed lease).
  dead = {'host': 'another-host', 'pid': 4242, 'token': 'abc', 'lease_seconds': 60.0}
  storage.write_json(workdir_lock.lock_path(workdir), {**dead, 'renewed': time.time() - 61})
  monkeypatch.setattr(filesystem, 'pipe_file', landed_then_exists)
  with workdir_lock.WorkdirLock(workdir):
    assert workdir_lock.read_holder(workdir)['pid'] == os.getpid()
    assert [n for n in storage.listdir(workdir) if 'break' in n] == []  # The marker went.


def test_bucket_lock_race_has_one_winner(object_stores):
  workdir = storage.join(object_stores.bucket('s3'), 'run')
  results, locks = [], []

  def take():
    lock = workdir_lock.WorkdirLock(workdir)
    try:
      lock.acquire()
      locks.append(lock)
      results.append('won')
    except workdir_lock.WorkdirLockedError:
      results.append('refused')

  threads = [threading.Thread(target=take) for _ in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert sorted(results) == ['refused'] * 3 + ['won']
  locks[0].release()
  assert workdir_lock.read_holder(workdir) is None


def test_refused_credentials_are_named_before_any_work(object_stores, tmp_path):
  """An S3 server that checks credentials (moto with IAM on) refuses the tests' fake keys."""
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
  server = subprocess.Popen(
    [sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p', str(port)],
    env={**os.environ, 'INITIAL_NO_AUTH_ACTION_COUNT': '1'},  # Creating the bucket, then IAM.
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    endpoint = f'http://127.0.0.1:{port}'
    for _ in range(100):
      try:
        boto3.client('s3', endpoint_url=endpoint).create_bucket(Bucket='locked')
        break
      except Exception:  # Not listening yet.
        time.sleep(0.1)
    env = {**os.environ, 'AWS_ENDPOINT_URL': endpoint, 'AWS_ENDPOINT_URL_S3': endpoint}
    results = [str(tmp_path / 'a.json'), str(tmp_path / 'b.json')]
    result = subprocess.run(
      [sys.executable, 'compare.py', *results, '--output=s3://locked/comparison.json'],
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
  finally:
    server.terminate()
    server.wait(timeout=10)
  assert result.returncode != 0
  assert 's3://locked refuses to be looked up with these credentials' in result.stderr
