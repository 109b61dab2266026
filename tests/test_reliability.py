"""Reliability end to end: crashes at named points, preemption, divergence, damaged checkpoints,
bad input and a full disk, each checked against one uninterrupted reference run.

Crashes and signals need real processes: train.py runs as a subprocess on
configs/tiny.py for 6 steps (checkpoints at 2, 4, 6). The subprocesses share one
JAX compilation cache, so only the first compiles (about 25 s); most others take
about 9 s each on 2 otherwise idle CPU cores.
"""

import errno
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import conftest
import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import synthetic_pairs, write_lines
from orbax.checkpoint._src.path import step as orbax_step

from configs import tiny
from transformer import (
  checkpoints,
  datasets,
  errors,
  evaluation,
  inference,
  path_checks,
  preemption,
  provenance,
  runs,
  storage,
  tasks,
  training,
  workdir_lock,
)
from transformer import config as config_lib
from transformer import tokenizer as tokenizer_lib
from transformer.datasets import wmt14
from transformer.tasks import translation
from transformer.tools import sweep_flags, sweep_runner, sweeps

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

# The run every test compares with: 6 steps, checkpoints at 2, 4 and 6, a train row per step.
OVERRIDES = {
  'num_train_steps': 6,
  'checkpoint_every_steps': 2,
  'eval_every_steps': 6,
  'log_every_steps': 1,
  'eval_bleu_sentences': 0,
}
_TIMING = ('steps_per_sec', 'tokens_per_sec', 'input_wait_ms', 'wall_seconds')

# A failed TensorStore read of a damaged checkpoint can finish after Orbax closed its event loop;
# Python reports that from a finalizer (an unraisable exception), harmlessly.
_IGNORE_FAILED_READ_FINALIZERS = pytest.mark.filterwarnings(
  'ignore::pytest.PytestUnraisableExceptionWarning'
)


@pytest.fixture(scope='module')
def train(synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """Returns `train(workdir, *flags, fault=None, **overrides) -> CompletedProcess` of train.py.

  With `fault` ('<point>:<step>'), tests/fault_driver.py runs instead: train.py with a hook that
  SIGKILLs the process at that point. The processes share the session's compilation cache
  (conftest): the tiny run compiles once in the whole suite.
  """
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}

  def command(workdir, *flags, fault=None, **overrides):
    settings = {
      'data.manual_dir': synthetic_multi30k_dir,
      'data.data_dir': synthetic_multi30k_data_dir,
      **OVERRIDES,
      **overrides,
    }
    script = ['tests/fault_driver.py', f'--fault={fault}'] if fault else ['train.py']
    return [
      sys.executable,
      *script,
      '--config=configs/tiny.py',
      f'--workdir={workdir}',
      *(f'--config.{key}={value}' for key, value in settings.items()),
      *flags,
    ]

  def run(workdir, *flags, fault=None, **overrides):
    return subprocess.run(
      command(workdir, *flags, fault=fault, **overrides),
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
    )

  run.command, run.env = command, env
  return run


@pytest.fixture(scope='module')
def reference(train, tmp_path_factory):
  """The workdir of the uninterrupted run."""
  workdir = tmp_path_factory.mktemp('reference')
  result = train(workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


def _config(manual_dir, data_dir, **overrides):
  """configs/tiny.py with OVERRIDES, for runs inside this process."""
  config = tiny.get_config()
  config.data.manual_dir, config.data.data_dir = str(manual_dir), str(data_dir)
  for key, value in {**OVERRIDES, **overrides}.items():
    *parents, leaf = key.split('.')
    target = config
    for parent in parents:
      target = target[parent]
    target[leaf] = value
  return config


def _entries(workdir) -> list[str]:
  return sorted(os.listdir(Path(workdir) / 'checkpoints'))


def _state(workdir, step):
  path = storage.join(storage.resolve(str(workdir)), 'checkpoints', str(step), 'state')
  return ocp.StandardCheckpointer().restore(path)  # A local folder or a bucket's.


def _assert_same_state(workdir_a, workdir_b, step):
  leaves_a, leaves_b = (
    jax.tree.leaves(_state(workdir_a, step)),
    jax.tree.leaves(_state(workdir_b, step)),
  )
  assert len(leaves_a) == len(leaves_b)
  for a, b in zip(leaves_a, leaves_b, strict=True):
    np.testing.assert_array_equal(a, b)


def _rows(workdir):
  with open(Path(workdir) / 'metrics.jsonl') as f:
    return [{k: v for k, v in json.loads(line).items() if k not in _TIMING} for line in f]


def _assert_tensorboard_shows_the_rows_once(workdir):
  """TensorBoard shows each row of metrics.jsonl once, whatever the crashes and resumes."""
  expected = {}
  with open(Path(workdir) / 'metrics.jsonl') as f:
    for row in map(json.loads, f):
      for tag, value in row.items():
        if tag not in ('step', 'wall_seconds'):
          expected.setdefault(tag, []).append((row['step'], value))
  shown = conftest.tensorboard_scalars(Path(workdir) / 'tensorboard')
  assert sorted(shown) == sorted(expected)
  for tag, points in shown.items():
    assert [step for step, _ in points] == [step for step, _ in expected[tag]], tag
    np.testing.assert_allclose([v for _, v in points], [v for _, v in expected[tag]], rtol=1e-6)


def _snapshot(workdir) -> dict[str, bytes | None]:
  """Every path under `workdir` with a digest of its bytes (None for folders)."""
  root = Path(workdir)
  return {
    str(p.relative_to(root)): None if p.is_dir() else hashlib.sha256(p.read_bytes()).digest()
    for p in sorted(root.rglob('*'))
  }


def test_killed_at_named_points_resumes_to_the_uninterrupted_result(train, reference, tmp_path):
  workdir = tmp_path / 'run'
  restored = re.compile(r'Restored checkpoint \S+/checkpoints/(\d+)\.')

  # 1. Before the first checkpoint: the next start begins again from scratch.
  result = train(workdir, fault='after_step:1')
  assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
  assert _entries(workdir) == []
  assert [r['step'] for r in _rows(workdir)] == [1]

  # 2. During the save of checkpoint 4: all written, not committed.
  result = train(workdir, fault='during_save:4')
  assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
  assert not restored.search(result.stderr)
  entries = _entries(workdir)
  assert [e for e in entries if e.isdigit()] == ['2']
  assert len(entries) == 2 and '.orbax-checkpoint-tmp' in entries[1], entries

  # 3. Between saves (4 committed, 6 not begun). The uncommitted 4 was removed, never read.
  result = train(workdir, fault='after_step:5')
  assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
  assert restored.findall(result.stderr) == ['2']
  assert f'Removing {workdir}/checkpoints/{entries[1]}' in result.stderr
  assert _entries(workdir) == ['2', '4']
  # Each step in TensorBoard once, although steps 1, 3 and 4 were logged twice (runs 1-3).
  assert [r['step'] for r in _rows(workdir)] == [1, 2, 3, 4, 5]
  _assert_tensorboard_shows_the_rows_once(workdir)

  # 4. To the end.
  result = train(workdir)
  assert result.returncode == 0, result.stderr[-3000:]
  assert restored.findall(result.stderr) == ['4']
  assert _entries(workdir) == ['2', '4', '6']
  _assert_same_state(reference, workdir, 6)
  assert _rows(workdir) == _rows(reference)
  assert len(os.listdir(workdir / 'tensorboard')) == 4  # One event file per start.
  _assert_tensorboard_shows_the_rows_once(workdir)


def sigterm_when(train, command, marker: str) -> tuple[subprocess.Popen, str]:
  """Runs `command` (train.py), sends it SIGTERM once a stderr line holds `marker`; its log."""
  process = subprocess.Popen(command, cwd=REPO, env=train.env, stderr=subprocess.PIPE, text=True)
  log = []
  for line in process.stderr:
    log.append(line)
    if marker in line:
      process.send_signal(signal.SIGTERM)
      break
  log.append(process.communicate(timeout=120)[1])
  return process, ''.join(log)


def test_sigterm_checkpoints_the_last_completed_step_and_exits_0(train, tmp_path):
  workdir = tmp_path / 'run'
  # Long enough that the signal always arrives mid-run.
  command = train.command(workdir, num_train_steps=1000)
  process, log = sigterm_when(train, command, 'step 2/1000')

  assert process.returncode == 0, log[-3000:]
  last_step = max(r['step'] for r in _rows(workdir) if 'train_loss' in r)
  assert 2 <= last_step < 1000
  assert max(int(e) for e in _entries(workdir)) == last_step
  assert all(e.isdigit() for e in _entries(workdir))  # Committed, nothing half-written.
  assert int(_state(workdir, last_step)['step']) == last_step
  assert (
    f'Stopped by SIGTERM after step {last_step}; checkpoint {workdir}/checkpoints/'
    f'{last_step} is committed'
  ) in log


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(train, tmp_path):
  """JAX's preemption notifier (jax.distributed) carries the notice to the other process."""
  workdir = tmp_path / 'run'
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  command = train.command(
    workdir,
    f'--coordinator_address=localhost:{port}',
    '--num_processes=2',
    num_train_steps=1000,
    eval_every_steps=1000,
    checkpoint_every_steps=1000,
  )
  with open(tmp_path / 'process_1.log', 'w') as log_1:
    processes = [
      subprocess.Popen(
        [*command, '--process_id=0'],
        cwd=REPO,
        env=train.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      ),
      subprocess.Popen(
        [*command, '--process_id=1'],
        cwd=REPO,
        env=train.env,
        stdout=log_1,
        stderr=subprocess.STDOUT,
      ),
    ]
    log = []
    for line in processes[0].stdout:  # Only process 0 logs steps.
      log.append(line)
      if 'step 2/1000' in line:
        processes[1].send_signal(signal.SIGTERM)
        break
    log = ''.join(log) + processes[0].communicate(timeout=300)[0]
    processes[1].wait(timeout=300)

  assert processes[0].returncode == 0, log[-3000:]
  assert processes[1].returncode == 0, (tmp_path / 'process_1.log').read_text()[-3000:]
  last_step = max(r['step'] for r in _rows(workdir) if 'train_loss' in r)
  assert 2 <= last_step < 1000
  assert _entries(workdir) == [str(last_step)]  # One checkpoint, written by both processes.
  assert f'Stopped by preemption notice after step {last_step};' in log


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT, signal.SIGUSR2])
def test_one_process_stops_at_the_step_after_a_signal(signum):
  previous = signal.getsignal(signum)
  with preemption.PreemptionWatcher() as watcher:
    # Before training starts (nothing to checkpoint) a signal stops at once.
    with pytest.raises(preemption.Interrupted, match=f'Stopped by {signum.name} before training'):
      os.kill(os.getpid(), signum)
    # Had a library swallowed that exception (JAX's garbage-collection callback would), the run
    # would still stop before its first step.
    with pytest.raises(preemption.Interrupted):
      watcher.arm()
  with preemption.PreemptionWatcher() as watcher:
    watcher.arm()
    assert not watcher.reached(1)
    os.kill(os.getpid(), signum)  # Python runs the handler before the next statement.
    assert watcher.reached(2)
    assert watcher.signal_name == signum.name
    if signum == signal.SIGINT:
      with pytest.raises(KeyboardInterrupt):  # A second Ctrl-C stops at once.
        os.kill(os.getpid(), signum)
  assert signal.getsignal(signum) is previous


def test_with_several_processes_the_notice_becomes_a_sigterm_for_jax():
  """SIGUSR2 (Slurm's notice before a time limit) reaches JAX's preemption notifier, which
  catches SIGTERM (here a stand-in handler), as a SIGTERM."""
  received = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
  try:
    watcher = preemption.PreemptionWatcher()
    watcher._multi_process = True  # As after jax.distributed.initialize with 2 processes.
    with watcher:
      watcher.arm()
      os.kill(os.getpid(), signal.SIGUSR2)
      assert received == [signal.SIGTERM] and watcher.signal_name is None
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_divergence_stops_with_the_step_and_writes_no_bad_checkpoint(train, tmp_path):
  # Adam moves each weight by about the learning rate: ~1e12 at step 1, so step 2 overflows.
  result = train(tmp_path, lr_scale=1e15, checkpoint_every_steps=1)
  assert result.returncode == 1, result.stderr[-3000:]
  expected = (
    f'train.py: error: Training diverged at step 2: train loss = nan and gradient norm '
    f'= nan. No checkpoint was written from this state; the last good checkpoint is '
    f'step 1 ({tmp_path}/checkpoints/1), and a rerun resumes from it.'
  )
  assert expected in result.stderr, result.stderr[-3000:]
  assert _entries(tmp_path) == ['1']
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(_state(tmp_path, 1)))
  assert [r['step'] for r in _rows(tmp_path)] == [1]  # Nothing logged from the bad step.


def test_skip_nonfinite_steps_skips_and_counts(train, tmp_path):
  result = train(
    tmp_path, lr_scale=1e15, checkpoint_every_steps=1, keep_checkpoints=6, skip_nonfinite_steps=True
  )
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [r for r in _rows(tmp_path) if 'train_loss' in r]
  assert [r['train_skipped_steps'] for r in rows] == [0, 1, 1, 1, 1, 1]
  assert math.isfinite(rows[0]['train_loss'])
  assert all(math.isnan(r['train_loss']) for r in rows[1:])  # A mean over no tokens.
  after_1, after_6 = _state(tmp_path, 1), _state(tmp_path, 6)
  assert int(after_6['step']) == 6  # The data position and dropout keys still advance...
  for a, b in zip(
    jax.tree.leaves((after_1['params'], after_1['opt_state'])),
    jax.tree.leaves((after_6['params'], after_6['opt_state'])),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)  # ...but no update was applied after step 1.


def _flip_middle_byte(path):
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


@_IGNORE_FAILED_READ_FINALIZERS
def test_every_damaged_array_file_is_detected_or_harmless(reference, tmp_path):
  """A flipped byte in any data file of a checkpoint is reported, or the arrays come out intact."""
  config = tiny.get_config()
  abstract = evaluation.setup(config).abstract_state
  saved = _state(reference, 6)
  original, original_params = jax.tree.leaves(saved), jax.tree.leaves(saved['params'])
  intact = checkpoints.Checkpointer(str(reference), read_only=True)
  try:
    restored = jax.tree.leaves(intact.restore_params(6, abstract))
    for a, b in zip(original_params, restored, strict=True):
      np.testing.assert_array_equal(a, b)
  finally:
    intact.close()
  data_files = sorted((reference / 'checkpoints' / '6' / 'state').rglob('d/*'))
  assert len(data_files) > 3
  by_checksum = 0
  for data_file in data_files:
    workdir = tmp_path / data_file.name
    shutil.copytree(reference, workdir)
    _flip_middle_byte(workdir / data_file.relative_to(reference))
    checkpointer = checkpoints.Checkpointer(str(workdir), read_only=True)
    reads = {  # The whole state; the parameters alone (eval.py's read), leaves as in _state.
      'state': lambda c=checkpointer: jax.tree.leaves(
        flax.serialization.to_state_dict(c.restore(6, abstract, None))
      ),
      'params': lambda c=checkpointer: jax.tree.leaves(c.restore_params(6, abstract)),
    }
    try:
      for read, expected in zip(reads.values(), (original, original_params), strict=True):
        try:
          restored = read()
        except checkpoints.CorruptCheckpointError as e:
          assert str(e).startswith(f'Checkpoint 6 ({workdir}/checkpoints/6) cannot be restored: ')
          by_checksum += 'differ from the checksums written with them' in str(e)
        else:
          for a, b in zip(expected, restored, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
      checkpointer.close()
  # Orbax's compressed chunks carry no checksum: a flip there decodes to wrong values, which
  # only the checksums written with the checkpoint reveal.
  assert by_checksum >= 1


@_IGNORE_FAILED_READ_FINALIZERS
def test_reading_the_parameters_alone_names_another_model_and_a_removed_checkpoint(reference):
  # restore_params compares the shapes only when its read fails (a metadata pass costs 0.4 s a
  # checkpoint): a checkpoint of another model is still named as such, every differing array.
  config = tiny.get_config()
  config.model.d_ff = 2 * config.model.d_ff
  abstract = evaluation.setup(config).abstract_state
  checkpointer = checkpoints.Checkpointer(str(reference), read_only=True)
  try:
    with pytest.raises(errors.InvalidInput, match='written by an incompatible model') as e:
      checkpointer.restore_params(6, abstract)
    assert 'ffn/wi/kernel' in str(e.value) and 'cannot be restored' not in str(e.value)
    # A model lacking one of the checkpoint's parameters: the read of the others succeeds,
    # and is refused all the same.
    abstract = evaluation.setup(tiny.get_config()).abstract_state
    params = flax.traverse_util.flatten_dict(abstract.params, sep='/')
    lacking = next(key for key in params if key.endswith('/bias'))
    fewer = {key: value for key, value in params.items() if key != lacking}
    with pytest.raises(errors.InvalidInput, match='written by an incompatible model') as e:
      checkpointer.restore_params(
        6, abstract.replace(params=flax.traverse_util.unflatten_dict(fewer, sep='/'))
      )
    assert f'params/{lacking}' in str(e.value) and 'absent in this model' in str(e.value)
    # A step that is not there (as one the run rotated out): gone, not corrupt.
    with pytest.raises(checkpoints.CheckpointGoneError):
      checkpointer.restore_params(7, evaluation.setup(tiny.get_config()).abstract_state)
  finally:
    checkpointer.close()


def _truncate_largest_file(directory):
  largest = max((p for p in directory.rglob('*') if p.is_file()), key=lambda p: p.stat().st_size)
  os.truncate(largest, largest.stat().st_size // 2)


@_IGNORE_FAILED_READ_FINALIZERS
def test_unreadable_checkpoint_stops_unless_fallback(
  train, reference, synthetic_multi30k_dir, synthetic_multi30k_data_dir, tmp_path
):
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  _truncate_largest_file(workdir / 'checkpoints' / '6' / 'state')
  before = _snapshot(workdir)
  config = _config(synthetic_multi30k_dir, synthetic_multi30k_data_dir, num_train_steps=8)
  with pytest.raises(
    checkpoints.CorruptCheckpointError,
    match=r'(?s)Checkpoint 6 \(\S+/checkpoints/6\) cannot be restored: .*'
    r'Nothing was changed.*--restore_fallback',
  ):
    training.train_and_evaluate(config, str(workdir))
  assert _snapshot(workdir) == before

  result = train(workdir, '--restore_fallback')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Restored checkpoint' in result.stderr and '/checkpoints/4.' in result.stderr
  assert _entries(workdir) == ['2', '4', '6']
  assert os.listdir(workdir / 'corrupt_checkpoints') == ['6']
  _assert_same_state(reference, workdir, 6)  # Steps 5-6 again, exactly as the first time.


def test_bad_inputs_are_named_and_leave_no_workdir(
  synthetic_multi30k_dir, synthetic_multi30k_data_dir, write_parallel_corpus, tmp_path
):
  # A new run: resuming one with other data or another vocabulary is refused before either is
  # read (test_resume_checks_the_content_of_the_vocabulary_and_data_not_their_paths).
  workdir = tmp_path / 'run'

  corpus = write_parallel_corpus(tmp_path / 'raw', {'train': 20, 'val': 5})
  write_lines(corpus / 'train.de', b'gut\nauch gut\nkaputt \xff\xfe\n' + b'gut\n' * 17)
  config = _config(
    synthetic_multi30k_dir,
    synthetic_multi30k_data_dir,
    **{
      'data.dataset': 'parallel_text',
      'data.manual_dir': str(corpus),
      'data.data_dir': str(tmp_path / 'tfds'),
    },
  )
  with pytest.raises(ValueError, match=re.escape(f'{corpus / "train.de"}: line 3 is not valid')):
    training.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()

  vocab = tmp_path / 'spm300.model'
  vocab.write_bytes(
    tokenizer_lib.train_tokenizer(
      [s for pair in synthetic_pairs(400) for s in pair], 300
    ).serialized_model()
  )
  config = _config(
    synthetic_multi30k_dir, synthetic_multi30k_data_dir, **{'data.vocab_path': str(vocab)}
  )
  with pytest.raises(ValueError, match=f'{vocab} has vocab size 300 but config.vocab_size is 512'):
    training.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_config_override_of_the_wrong_type_is_named(train, reference, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  before = _snapshot(workdir)
  result = train(workdir, num_train_steps='ten')
  assert result.returncode != 0
  assert "flag --config.num_train_steps=ten: invalid literal for int() with base 10: 'ten'" in (
    result.stderr
  )
  assert _snapshot(workdir) == before


def _kib_on_disk(directory) -> int:
  return sum(math.ceil(p.stat().st_size / 4096) * 4 for p in directory.rglob('*') if p.is_file())


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(train, reference, tmp_path):
  """The workdir lies on a tmpfs with room for one checkpoint: saving the second fails."""
  mount_point, copy = tmp_path / 'mnt', tmp_path / 'after'
  mount_point.mkdir()
  # A mount namespace of our own (root, or an unprivileged user namespace) so nothing leaks.
  wrapper = ['unshare', '--user', '--map-root-user', '--mount', '--']
  probe = subprocess.run(
    [*wrapper, 'mount', '-t', 'tmpfs', 'tmpfs', str(mount_point)], capture_output=True, text=True
  )
  if probe.returncode:
    pytest.skip(f'Cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}')
  size_kib = _kib_on_disk(reference / 'checkpoints' / '2') * 3 // 2 + 100
  command = shlex.join(train.command(mount_point / 'w'))
  script = (
    f'mount -t tmpfs -o size={size_kib}k tmpfs {mount_point} || exit 99; {command}; '
    f'status=$?; cp -a {mount_point / "w"} {copy}; exit $status'
  )
  result = subprocess.run(
    [*wrapper, 'sh', '-c', script],
    cwd=REPO,
    env=train.env,
    capture_output=True,
    text=True,
    timeout=300,
  )

  assert result.returncode not in (0, 99), result.stderr[-3000:]
  message = (
    f'train.py: error: Saving checkpoint 4 to {mount_point}/w/checkpoints failed '
    r'\(.*No space left on device.*\); the last committed checkpoint, '
    f'{mount_point}/w/checkpoints/2, is intact'
  )
  assert re.search(message, result.stderr), result.stderr[-3000:]
  assert [e for e in _entries(copy) if e.isdigit()] == ['2']
  _assert_same_state(reference, copy, 2)  # Restores, bit for bit as written.


# --- Misuse: every case an error naming the problem, the workdir unchanged ------------------------
# These fail before anything compiles, except the one small training run they share.

# Two steps, a checkpoint at step 2, no BLEU: the run that the misuse tests try to disturb.
SMALL = {
  'num_train_steps': 2,
  'checkpoint_every_steps': 2,
  'eval_every_steps': 2,
  'log_every_steps': 1,
  'eval_bleu_sentences': 0,
  'vocab_size': 300,
  'data.dataset': 'parallel_text',
}


def _small_config(corpus, data_dir, **overrides):
  config = tiny.get_config()
  settings = {**SMALL, 'data.manual_dir': str(corpus), 'data.data_dir': str(data_dir), **overrides}
  return sweeps.apply_overrides(config, settings)


@pytest.fixture(scope='module')
def small_run(write_parallel_corpus, tmp_path_factory):
  """(workdir, corpus, data_dir) of a finished 2-step run of configs/tiny.py on synthetic data."""
  root = tmp_path_factory.mktemp('small')
  corpus = write_parallel_corpus(root / 'raw', {'train': 200, 'val': 10, 'test': 10})
  workdir = root / 'run'
  training.train_and_evaluate(_small_config(corpus, root / 'tfds'), str(workdir))
  assert _entries(workdir) == ['2']
  return workdir, corpus, root / 'tfds'


@pytest.fixture
def copied_run(small_run, tmp_path):
  """A copy of `small_run`'s workdir to misuse, and its snapshot before."""
  workdir = tmp_path / 'run'
  shutil.copytree(small_run[0], workdir)
  return workdir, _snapshot(workdir)


def test_a_second_run_on_a_locked_workdir_is_refused(small_run, copied_run):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  # The first run: a live process holding the lock, as train.py does for its whole run.
  holder = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import sys, time; from transformer import workdir_lock; '
      f'workdir_lock.WorkdirLock({str(workdir)!r}).acquire(); print(1, flush=True); time.sleep(60)',
    ],
    cwd=REPO,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline() == '1\n'
    locked = _snapshot(workdir)
    expected = (
      f'The workdir {workdir} is in use by another training run: pid {holder.pid} on '
      f'host {socket.gethostname()} (started '
    )
    with pytest.raises(workdir_lock.WorkdirLockedError, match=re.escape(expected)):
      training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=4), str(workdir))
    assert _snapshot(workdir) == locked  # The first run's files, lock included, untouched.
    # sweep.py leaves such a trial alone rather than start a train.py that would be refused.
    assert workdir_lock.holder_alive(workdir_lock.read_holder(str(workdir))) is True
  finally:
    holder.kill()
    holder.wait()
  # Its holder is now dead (kill -9 left the lock behind): the next run takes the lock over.
  assert workdir_lock.holder_alive(workdir_lock.read_holder(str(workdir))) is False
  with workdir_lock.WorkdirLock(str(workdir)):
    pass
  assert _snapshot(workdir) == before


def test_lock_of_another_host_is_never_broken(tmp_path):
  lock = tmp_path / workdir_lock.LOCK_FILE
  lock.write_text(json.dumps({'host': 'node-7', 'pid': 4242, 'started': '2026-01-01T00:00:00'}))
  with pytest.raises(
    workdir_lock.WorkdirLockedError,
    match=r'pid 4242 on host node-7 .*check `ps -p 4242` there\), remove ',
  ):
    workdir_lock.WorkdirLock(str(tmp_path)).acquire()
  assert json.loads(lock.read_text())['host'] == 'node-7'


def test_resume_with_any_model_field_changed_is_refused(small_run, copied_run):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  # Same shapes, other functions: the checkpoint would restore and be read as another model.
  config = _small_config(
    corpus,
    data_dir,
    num_train_steps=4,
    **{'model.ffn_activation': 'gelu', 'model.position': 'rope', 'model.use_bias': False},
  )
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(config, str(workdir))
  message = str(error.value)
  assert f'The checkpoints in {workdir}/checkpoints belong to another model' in message
  for line in (
    "config.model.ffn_activation: 'relu' -> 'gelu'",
    "config.model.position: 'sinusoidal' -> 'rope'",
    'config.model.use_bias: True -> False',
    'a new --workdir',
  ):
    assert line in message
  assert _snapshot(workdir) == before


@pytest.mark.parametrize(
  ('key', 'value', 'messages'),
  [
    # Another vocabulary (unigram -> BPE) reads the saved embeddings as other pieces'.
    (
      'data.spm_model_type',
      'bpe',
      ['belong to another model', "config.data.spm_model_type: 'unigram' -> 'bpe'"],
    ),
    # A case-folding vocabulary: the same pieces' ids would name other pieces.
    (
      'data.spm_normalization',
      'nmt_nfkc_cf',
      ['belong to another model', "config.data.spm_normalization: 'nmt_nfkc' -> 'nmt_nfkc_cf'"],
    ),
    # AdamW's state has an entry Adam's has not: the checkpoints are another optimizer's.
    (
      'weight_decay',
      0.01,
      [
        'hold the optimizer state of another optimizer',
        "config.weight_decay: 0.0 -> 0.01 turns AdamW's weight decay on or off",
      ],
    ),
  ],
)
def test_resume_that_changes_vocabulary_type_or_optimizer_is_refused(
  small_run, copied_run, key, value, messages
):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  config = _small_config(corpus, data_dir, num_train_steps=4, **{key: value})
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(config, str(workdir))
  assert f'The checkpoints in {workdir}/checkpoints ' in str(error.value)
  for message in messages:
    assert message in str(error.value)
  assert _snapshot(workdir) == before


def test_resume_may_change_decoding_selection_schedule_and_regularisation(small_run, copied_run):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  changes = {
    'decode.beam_size': 5,
    'decode.alpha': 1.0,
    'keep_best_checkpoints': 3,
    'early_stopping_patience': 4,
    'schedule': 'cosine',
    'peak_learning_rate': 0.002,
    'model.ffn_dropout_rate': 0.1,
  }
  runs.check_resume(_small_config(corpus, data_dir, num_train_steps=4, **changes), str(workdir))
  assert _snapshot(workdir) == before


def test_config_value_outside_its_domain_is_refused(small_run, copied_run):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  config = _small_config(corpus, data_dir, **{'model.dropout_rate': 1.5, 'adam_b2': 1.0})
  with pytest.raises(ValueError, match=r'(?s)adam_b2=1.0 must be .*dropout_rate=1.5 must be'):
    training.train_and_evaluate(config, str(workdir))
  assert _snapshot(workdir) == before


@pytest.mark.parametrize('case', ['missing', 'empty', 'only_train', 'corrupt_gzip', 'bad_vocab'])
def test_bad_data_is_named_and_leaves_no_trace(small_run, write_parallel_corpus, tmp_path, case):
  _, corpus, data_dir = small_run
  raw = tmp_path / 'raw'
  overrides = {'data.manual_dir': str(raw)}
  if case == 'empty':
    raw.mkdir()
  elif case == 'only_train':
    write_parallel_corpus(raw, {'train': 20})
  elif case == 'corrupt_gzip':
    write_parallel_corpus(raw, {'train': 400, 'val': 5}, compress=True)
    data = (raw / 'train.de.gz').read_bytes()
    (raw / 'train.de.gz').write_bytes(data[: len(data) // 2])  # Cut short.
    overrides['data.data_dir'] = str(tmp_path / 'tfds')
  elif case == 'bad_vocab':
    (tmp_path / 'vocab.model').write_text('not a model')
    overrides = {'data.vocab_path': str(tmp_path / 'vocab.model')}
  expected = {
    'missing': f"Parallel text directory '{raw}' (config.data.manual_dir) does not exist.",
    'empty': f'{raw} (config.data.manual_dir) lacks required files: train.en, train.de, val.en',
    'only_train': f'{raw} (config.data.manual_dir) lacks required files: val.en, val.de',
    'corrupt_gzip': f'{raw}/train.de.gz: corrupt or truncated gzip data at line ',
    'bad_vocab': f'{tmp_path}/vocab.model (config.data.vocab_path) is not a usable SentencePiece',
  }[case]
  fresh = tmp_path / 'new_workdir'
  with pytest.raises(ValueError, match=re.escape(expected)):
    training.train_and_evaluate(_small_config(corpus, data_dir, **overrides), str(fresh))
  assert not fresh.exists()  # Not even an empty checkpoints/ folder.


def test_the_first_error_is_the_last_thing_printed(small_run, copied_run, tmp_path):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  empty = tmp_path / 'empty'
  empty.mkdir()
  settings = {**SMALL, 'num_train_steps': 4, 'data.manual_dir': empty, 'data.data_dir': data_dir}
  result = subprocess.run(
    [
      sys.executable,
      'train.py',
      '--config=configs/tiny.py',
      f'--workdir={workdir}',
      *(f'--config.{key}={value}' for key, value in settings.items()),
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-2:] == [
    f'train.py: error: {empty} (config.data.manual_dir) lacks required files: train.en, '
    'train.de, val.en, val.de (each may also be gzipped, with a .gz suffix).',
    '(set TRANSFORMER_TRACEBACK=1 to see where it was raised)',
  ], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert _snapshot(workdir) == before


def test_eval_flags_outside_their_domains_are_named_before_any_work(
  small_run, copied_run, tmp_path
):
  workdir, before = copied_run
  (tmp_path / 'in.txt').write_text('A sentence.\n')
  result = subprocess.run(
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      '--alpha=nan',
      '--top_p=1.5',
      '--beam_size=0',
      '--temperature=-1',
      f'--input_file={tmp_path / "in.txt"}',
      f'--output_file={tmp_path / "missing" / "out.txt"}',
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1
  lines = result.stderr.strip().splitlines()[-6:]
  assert lines == [  # Every one at once, after eval.py's usage text.
    'Invalid flags:',
    '  --beam_size=0 must be a positive integer.',
    '  --alpha=nan must be a finite number in [0, inf).',
    '  --temperature=-1.0 must be a finite number in [0, inf).',
    '  --top_p=1.5 must be a finite number in (0, 1].',
    f'  --output_file={tmp_path}/missing/out.txt: the folder {tmp_path}/missing does not exist.',
  ], result.stderr[-3000:]
  assert _snapshot(workdir) == before


def _watch_config(workdir, num_train_steps):
  config = evaluation.load_run_config(str(workdir))
  config.num_train_steps = num_train_steps  # As if the run had been started for more steps.
  return config


def test_watch_says_what_it_waits_for_and_stops_when_the_run_is_gone(
  small_run, copied_run, tmp_path, caplog
):
  workdir, _ = copied_run
  options = inference.DecodeOptions(decoder='greedy')

  def watch(config, workdir, **kwargs):
    run = evaluation.setup(config)
    request = tasks.EvalRequest(
      config, run.model_config, run.mesh, run.rules, 'validation', options, batch_size=16
    )
    return evaluation.watch(run, workdir, request, poll_seconds=0.01, **kwargs)

  caplog.set_level('INFO')
  # A run still training (its lock held by this live process) before its first checkpoint.
  fresh = tmp_path / 'fresh'
  fresh.mkdir()
  shutil.copy(workdir / 'config.json', fresh)
  with workdir_lock.WorkdirLock(str(fresh)):
    assert watch(_watch_config(fresh, 4), str(fresh), timeout_seconds=0) == []
  assert (
    f'Waiting for a checkpoint after none yet (the run ends at step 4; it is trained by '
    f'pid {os.getpid()} on host {socket.gethostname()}'
  ) in caplog.text
  # The run stopped at step 2 of 4 (no lock: it is gone): step 2 is evaluated, then it stops.
  assert watch(_watch_config(workdir, 4), str(workdir)) == [2]
  assert (
    f'Stopped watching: the training run of {workdir} is no longer running (no train.lock '
    'in it), so no new checkpoint can come; its last checkpoint (step 2) is evaluated, '
    'short of the final step 4.'
  ) in caplog.text
  assert (workdir / 'eval' / 'step_2-validation-greedy.json').exists()


def test_over_long_input_lines_are_reported_by_number(small_run, caplog):
  workdir = small_run[0]
  config = evaluation.load_run_config(str(workdir))
  run = evaluation.setup(config)
  params, _ = evaluation.restore_params(run, str(workdir), 'latest')
  lines = ['Bada kelo.', 'bada ' * 200, '', 'Sopi ' * 30 + 'ra ' * 40]
  caplog.set_level('WARNING')
  outputs = translation.decode.translate_lines(
    config,
    run.model_config,
    params,
    lines,
    batch_size=4,
    options=inference.DecodeOptions(decoder='greedy'),
  )
  assert len(outputs) == 4 and outputs[2] == ''
  assert (
    '2 input lines are longer than the model reads (config.data.max_eval_len=64 tokens, EOS '
    'included): each was truncated to fit, so its translation covers only its start. '
    'Lines: 2, 4.'
  ) in caplog.text


# --- Misuse, round two ----------------------------------------------------------------------------
# Outputs that would overwrite a run or an input, inputs changed in content, offline downloads,
# flags a later command receives, unclear states, signals during preparation, warnings.


def _subprocess(*command, env=None, timeout=300):
  return subprocess.run(
    [sys.executable, *command],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', **(env or {})},
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def _last_lines(result, count: int) -> list[str]:
  """The last `count` lines of stderr before a refusal's hint (`errors.run`)."""
  lines = result.stderr.strip().splitlines()
  if lines and lines[-1].startswith(f'(set {errors.TRACEBACK_ENV}=1'):
    lines.pop()
  return lines[-count:]


def test_an_eval_output_that_is_a_file_of_the_run_is_refused(copied_run, tmp_path):
  workdir, before = copied_run
  source = tmp_path / 'in.txt'
  source.write_text('Bada kelo.\n')
  config_json = os.path.realpath(workdir / 'config.json')
  result = _subprocess(
    'eval.py',
    f'--workdir={workdir}',
    f'--input_file={source}',
    f'--output_file={config_json}',
    '--decoder=greedy',
  )
  assert result.returncode == 1
  assert _last_lines(result, 2) == [
    'Invalid flags:',
    f'  --output_file={config_json} is config.json of the training run in '
    f'{os.path.dirname(config_json)}, which only that run writes; write elsewhere.',
  ], result.stderr[-3000:]
  assert _snapshot(workdir) == before


def test_no_output_is_a_file_of_a_run_an_input_or_the_code(small_run, copied_run, tmp_path):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  workdir, corpus, data_dir = (Path(os.path.realpath(p)) for p in (workdir, corpus, data_dir))
  source = tmp_path / 'in.txt'
  source.write_text('Bada kelo.\n')
  inputs = {  # What eval.py passes: its input file, the run's raw and prepared data.
    '--input_file': str(source),
    'the raw data (config.data.manual_dir)': str(corpus),
    'the prepared data (config.data.data_dir)': str(data_dir),
  }
  vocab = next(data_dir.glob('*/spm_*.model'))
  refused = {
    workdir
    / 'checkpoints'
    / '2'
    / 'new.txt': f'lies in checkpoints of the training run in {workdir}',
    workdir / 'eval' / 'step_2-test-greedy.txt': 'lies in eval of the training run',
    workdir / 'metrics.jsonl': 'is metrics.jsonl of the training run',
    source: f'is --input_file, {os.path.realpath(source)}, an input of this command',
    vocab: f'lies in the prepared data (config.data.data_dir), {data_dir}, an input',
    corpus / 'train.en': f'lies in the raw data (config.data.manual_dir), {corpus}, an input',
  }
  if (REPO / '.git').exists():  # The code is known by what git tracks.
    refused[REPO / 'eval.py'] = f'is a file of the code (eval.py in {REPO})'
  for path, expected in refused.items():
    [error] = path_checks.protected_path_errors(str(path), '--output_file', inputs)
    assert error.startswith(f'--output_file={os.path.realpath(path)} ') and expected in error, error
  # New files of the user's own, beside a run or anywhere else, are fine.
  for path in (workdir / 'translations.txt', tmp_path / 'out.txt'):
    assert path_checks.protected_path_errors(str(path), '--output_file', inputs) == []
  # compare.py's --output and the sweep root go through the same check.
  result = workdir / 'eval' / 'step_2-test-greedy.json'
  [error] = path_checks.protected_path_errors(str(result), '--output', {'argument 1': str(result)})
  assert 'lies in eval of the training run' in error
  config = _small_config(corpus, data_dir)
  assert sweep_flags.root_errors(config, str(workdir)) == [
    f'--workdir={workdir} is the workdir of a training run; give the sweep its own folder.'
  ]
  assert 'lies in the raw data' in sweep_flags.root_errors(config, str(corpus / 'sweep'))[0]


@pytest.mark.parametrize('case', ['empty', 'file', 'in_a_run', 'raw_data', 'bad_eval_split'])
def test_train_paths_are_checked_before_anything_is_written(
  small_run, copied_run, tmp_path, monkeypatch, case
):
  run, before = copied_run
  _, corpus, data_dir = small_run
  cwd = tmp_path / 'cwd'  # What an empty --workdir would train into.
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  (tmp_path / 'notes.txt').write_text('mine\n')
  workdir, overrides, watched = {
    'empty': ('', {}, cwd),
    'file': (tmp_path / 'notes.txt', {}, tmp_path / 'notes.txt'),
    'in_a_run': (run / 'eval', {}, run),
    'raw_data': (corpus, {}, corpus),
    'bad_eval_split': (tmp_path / 'new', {'data.eval_split': 'nope'}, tmp_path / 'new'),
  }[case]
  expected = {
    'empty': '--workdir is empty: name the run',
    'file': f'--workdir={tmp_path}/notes.txt is a file, not a folder',
    'in_a_run': f'--workdir={run}/eval is eval of the training run in {run}, which only',
    'raw_data': f'--workdir={corpus} is the raw data (config.data.manual_dir), {corpus}, an input',
    'bad_eval_split': "Split 'nope' is not in dataset 'parallel_text'",
  }[case]
  contents = lambda path: _snapshot(path) if path.is_dir() else path.exists() and path.read_bytes()
  watched_before = contents(Path(watched))
  with pytest.raises(ValueError, match=re.escape(expected)):
    training.train_and_evaluate(_small_config(corpus, data_dir, **overrides), str(workdir))
  assert contents(Path(watched)) == watched_before  # bad_eval_split: no new workdir at all.
  assert _snapshot(run) == before


def _edited_corpus(corpus, target):
  shutil.copytree(corpus, target)
  lines = (target / 'train.de').read_text().splitlines()
  lines[0] = 'Ganz anders.'
  (target / 'train.de').write_text('\n'.join(lines) + '\n')
  return target


def test_resume_checks_the_content_of_the_vocabulary_and_data_not_their_paths(
  small_run, copied_run, tmp_path
):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  config = _small_config(corpus, data_dir, num_train_steps=4)
  vocab_path = tokenizer_lib.vocab_path(config.data, config.vocab_size)
  old = hashlib.sha256(Path(vocab_path).read_bytes()).hexdigest()
  assert provenance.recorded_inputs(str(workdir))['vocabulary'] == {'path': vocab_path, 'hash': old}

  # The same vocabulary at another path is the same input: the resume's checks pass.
  copy = tmp_path / 'copy.model'
  shutil.copy(vocab_path, copy)
  moved = _small_config(corpus, data_dir, num_train_steps=4, **{'data.vocab_path': str(copy)})
  runs.check_resume(moved, str(workdir))
  # Another model of the same size and special ids there: every id would mean another piece.
  other = tokenizer_lib.train_tokenizer([s for p in synthetic_pairs(400, seed=7) for s in p], 300)
  copy.write_bytes(other.serialized_model())
  new = hashlib.sha256(other.serialized_model()).hexdigest()
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(moved, str(workdir))
  assert (
    f'the vocabulary (every token id would mean another piece): {vocab_path} (sha256 '
    f'{old[:16]}) -> {copy} (sha256 {new[:16]})'
  ) in str(error.value)
  assert 'Nothing was changed.' in str(error.value)
  assert _snapshot(workdir) == before

  # eval.py reads the run's vocabulary by the path in its config.json: the same check.
  saved = json.loads((workdir / 'config.json').read_text())
  saved['data']['vocab_path'] = str(copy)
  (workdir / 'config.json').write_text(json.dumps(saved))
  with pytest.raises(ValueError, match=re.escape(f'{vocab_path} (sha256 {old[:16]}) -> {copy}')):
    evaluation.load_run_config(str(workdir))
  shutil.copy(vocab_path, copy)  # The original content again: accepted.
  assert evaluation.load_run_config(str(workdir)).data.vocab_path == str(copy)

  # One line of the training data edited: the data position would point into other examples.
  edited = _edited_corpus(Path(corpus), tmp_path / 'edited')
  with pytest.raises(ValueError, match=r'the training data \(the data position would point'):
    training.train_and_evaluate(_small_config(edited, data_dir, num_train_steps=4), str(workdir))


def _unreachable(*args, **kwargs):
  raise OSError(errno.ENETUNREACH, 'Network is unreachable')


@pytest.mark.parametrize(
  'dataset, count', [('wmt14_translate/de-en', 4), ('multi30k', 12), ('lm1b', 1)]
)
def test_offline_download_fails_within_seconds_listing_every_file(
  monkeypatch, tmp_path, dataset, count
):
  # No connection can be made from this process (nor could one reach the real servers).
  monkeypatch.setattr(socket, 'create_connection', _unreachable)
  monkeypatch.setattr(socket.socket, 'connect', _unreachable)
  config = tiny.get_config()
  config.data.dataset, config.data.data_dir = dataset, str(tmp_path / 'tfds')
  files = datasets.download_files(config.data)
  assert len(files) == count
  started = time.monotonic()
  with pytest.raises(ConnectionError) as error:
    datasets.prepare(config.data)
  assert time.monotonic() - started < 30
  lines = str(error.value).splitlines()
  assert re.match(
    rf'Cannot download {dataset}: http\S+ cannot be reached \(.*unreachable', lines[0]
  )
  assert lines[0].endswith(
    f'put these {count} files in a folder and pass it as --config.data.manual_dir:'
  )
  assert lines[1:] == [f'  {name}  ({url})' for name, url in files.items()]


def test_offline_train_py_exits_within_seconds_and_an_empty_manual_dir_names_every_archive(
  tmp_path,
):
  with socket.socket() as s:  # A port nothing listens on: the proxy refuses every connection.
    s.bind(('127.0.0.1', 0))
    proxy = f'http://127.0.0.1:{s.getsockname()[1]}'
  started = time.monotonic()
  result = _subprocess(
    'train.py',
    '--config=configs/tiny.py',
    f'--workdir={tmp_path / "run"}',
    '--config.data.dataset=wmt14_translate/de-en',
    f'--config.data.data_dir={tmp_path / "tfds"}',
    env={
      'http_proxy': proxy,
      'https_proxy': proxy,
      'HTTP_PROXY': proxy,
      'HTTPS_PROXY': proxy,
      'no_proxy': '',
      'NO_PROXY': '',
    },
    timeout=120,
  )
  assert time.monotonic() - started < 30, result.stderr[-3000:]
  assert result.returncode == 1
  archives = wmt14.archive_urls('de-en')
  assert _last_lines(result, 4) == [f'  {name}  ({url})' for name, url in archives.items()]
  assert not (tmp_path / 'run').exists()

  config = tiny.get_config()
  config.data.dataset, config.data.data_dir = 'wmt14_translate/de-en', str(tmp_path / 'tfds')
  config.data.manual_dir = str(tmp_path / 'empty')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ValueError) as error:
    datasets.prepare(config.data)
  assert str(error.value).splitlines() == [
    f'config.data.manual_dir={tmp_path}/empty lacks 4 of the 4 release archives of '
    'wmt14_translate/de-en; put them there (or unset config.data.manual_dir to download them):',
    *(f'  {name}  ({url})' for name, url in archives.items()),
  ]


def test_flags_for_a_later_command_are_checked_before_the_first_trial(tmp_path):
  root = tmp_path / 'root'
  result = _subprocess(
    'sweep.py',
    '--config=configs/tiny.py',
    '--sweep=configs/sweeps/tiny_schedule.py',
    f'--workdir={root}',
    '--config.data.manual_dir=/nowhere',
    '--eval',
    '--eval_flags=--beam_size=0 --checkpoint=avg:x',
    '--dry_run',
  )
  assert result.returncode == 1
  assert _last_lines(result, 3) == [
    '  Invalid flags:',
    '    --beam_size=0 must be a positive integer.',
    "    --checkpoint='avg:x': expected avg:N or avg:N@STEP with N a positive integer and "
    'STEP a step number.',
  ], result.stderr[-3000:]
  assert 'eval.py refuses them, so no trial was run' in result.stderr
  assert not root.exists()
  # The sweep's own rules on eval.py's flags, --parallel, and resource counts of the config.
  config = tiny.get_config()
  with pytest.raises(ValueError, match=r'--eval_flags: --output_file=out.txt is not for a sweep'):
    sweeps.create(
      'configs/tiny.py',
      config,
      'configs/sweeps/tiny_schedule.py',
      str(root),
      eval_flags=['--output_file=out.txt'],
    )
  with pytest.raises(ValueError, match=r'--parallel=0 must be at least 1'):
    sweep_runner.check_parallel(0)
  cores = os.cpu_count()
  with pytest.raises(ValueError, match=rf'--parallel={cores + 1} exceeds the {cores} CPU cores'):
    sweep_runner.check_parallel(cores + 1)
  sweep_runner.check_parallel(cores + 1, slurm=True)  # A cap on array tasks, on other machines.
  config.data.num_workers = cores + 1
  with pytest.raises(config_lib.ConfigError, match=rf'num_workers={cores + 1} exceeds the {cores}'):
    config_lib.validate(config, num_devices=1)
  config_lib.validate(config)  # A sweep's trial checked elsewhere than where it runs.


def test_an_unreadable_lock_says_what_it_is_and_how_to_clear_it(small_run, copied_run):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  lock = workdir / workdir_lock.LOCK_FILE
  lock.write_text('garbage')
  before = _snapshot(workdir)
  with pytest.raises(workdir_lock.WorkdirLockedError) as error:
    training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=4), str(workdir))
  assert str(error.value) == (
    f"The workdir {workdir} holds a lock, {lock}, that names no run: its content, 'garbage', is "
    'not the record train.py writes (damaged, or written by something else). Nothing was '
    f'changed. If no train.py runs on this workdir (check `ps aux | grep {workdir}` on every '
    f'host that sees it), remove the file (rm {lock}) and run again.'
  )
  assert _snapshot(workdir) == before


def test_a_damaged_config_json_is_named_with_what_to_do(small_run, copied_run):
  workdir, _ = copied_run
  _, corpus, data_dir = small_run
  (workdir / 'config.json').write_text('{"seed": 0, ')
  before = _snapshot(workdir)
  expected = (
    re.escape(f'{workdir}/config.json is not a config written by train.py (JSONDecodeError: ')
    + r'.*'
    + re.escape(f'move it aside (mv {workdir}/config.json {workdir}/config.json.bad)')
  )
  with pytest.raises(config_lib.ConfigError, match=expected):
    evaluation.load_run_config(str(workdir))
  with pytest.raises(config_lib.ConfigError, match=expected):
    training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=4), str(workdir))
  assert _snapshot(workdir) == before


def test_a_users_file_given_as_vocabulary_is_named_and_kept(small_run, tmp_path):
  _, corpus, data_dir = small_run
  notes = tmp_path / 'notes.txt'
  notes.write_text('my notes\n')
  config = _small_config(corpus, data_dir, **{'data.vocab_path': str(notes)})
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(config, str(tmp_path / 'run'))
  message = str(error.value)
  assert message.startswith(f'{notes} (config.data.vocab_path) is not a usable SentencePiece model')
  assert 'It was left as it is.' in message and 'remove' not in message
  assert notes.read_text() == 'my notes\n'
  assert not (tmp_path / 'run').exists()


def test_num_train_steps_below_the_checkpoint_is_refused_and_a_finished_run_changes_nothing(
  small_run, copied_run
):
  workdir, before = copied_run
  _, corpus, data_dir = small_run
  with pytest.raises(ValueError) as error:
    training.train_and_evaluate(_small_config(corpus, data_dir, num_train_steps=1), str(workdir))
  assert str(error.value).startswith(
    f'config.num_train_steps=1 lies below the latest checkpoint, step 2 of {workdir}/checkpoints'
  )
  assert f'eval.py --workdir={workdir} --checkpoint=STEP (steps [2])' in str(error.value)
  assert _snapshot(workdir) == before
  # The same command again once the run is complete: its final metrics, and no new row.
  final = training.train_and_evaluate(_small_config(corpus, data_dir), str(workdir))
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  evaluation = {k: v for row in rows if row['step'] == 2 for k, v in row.items()}
  assert final == {k: v for k, v in evaluation.items() if k not in ('step', 'wall_seconds')}
  assert 'eval_loss' in final and 'train_loss' in final
  assert _snapshot(workdir) == before


def test_eval_avg_racing_the_rotation_reads_the_checkpoints_again(reference, tmp_path, caplog):
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  run = evaluation.setup(evaluation.load_run_config(str(workdir)))
  assert run.config.keep_checkpoints == 3 and _entries(workdir) == ['2', '4', '6']
  restore = checkpoints.Checkpointer.restore_params  # eval.py reads the parameters alone.
  calls = []

  def rotate_then_restore(self, step, *args):
    if not calls:  # The run commits step 8 and removes step 2 while eval.py reads step 2.
      shutil.copytree(workdir / 'checkpoints' / '6', workdir / 'checkpoints' / '8')
      shutil.rmtree(workdir / 'checkpoints' / '2')
    calls.append(step)
    return restore(self, step, *args)

  caplog.set_level('INFO')
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoints.Checkpointer, 'restore_params', rotate_then_restore)
    _, label = evaluation.restore_params(run, str(workdir), 'avg:3')
  assert label == 'avg3_4-8' and calls == [2, 4, 6, 8]
  assert (
    f'Checkpoint 2 ({workdir}/checkpoints/2) was removed while it was read: the training run '
    'keeps its last 3 checkpoints (config.keep_checkpoints) and has committed newer ones since'
  ) in caplog.text
  assert 'corrupt' not in caplog.text.lower() and 'cannot be restored' not in caplog.text
  # A step named on the command line that the run removed is said so, not called corrupt.
  with (
    pytest.raises(checkpoints.CheckpointGoneError, match=r'checkpoints now are at steps \[4, 6'),
    pytest.MonkeyPatch.context() as patch,
  ):
    patch.setattr(checkpoints.Checkpointer, 'all_steps', lambda self: [2, 4, 6, 8])
    evaluation.restore_params(run, str(workdir), '2')


@pytest.mark.parametrize(
  'signal_at, signum',
  [('tfds:100', signal.SIGTERM), ('encoding:0', signal.SIGINT)],
)
def test_a_signal_during_data_preparation_stops_at_once_leaving_nothing_half_made(
  train, synthetic_multi30k_dir, tmp_path, signal_at, signum
):
  data_dir, workdir = tmp_path / 'tfds', tmp_path / 'run'
  command = train.command(workdir, **{'data.data_dir': data_dir})
  command[1:2] = ['tests/fault_driver.py', f'--signal={signum.name}:{signal_at}']
  result = subprocess.run(
    command, cwd=REPO, env=train.env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 128 + signum, result.stderr[-3000:]
  assert f'--signal: sending {signum.name} to this process.' in result.stderr
  assert _last_lines(result, 1)[0].endswith(
    f'Stopped by {signum.name} before training began: nothing was trained or saved, and data '
    'being prepared was discarded (prepared data is complete or absent). Run the same command '
    'to start again.'
  ), result.stderr[-3000:]
  assert not workdir.exists()
  leftovers = [
    p for p in data_dir.rglob('*') if 'incomplete' in p.name or p.name.startswith('.tmp')
  ]
  assert leftovers == []
  prepared = sorted(p.relative_to(data_dir).parts[-1] for p in data_dir.rglob('*.json'))
  if signal_at.startswith('tfds'):  # TFDS wrote nothing in place: no dataset, no vocabulary.
    assert prepared == [] and not list(data_dir.rglob('*.model'))
  else:  # Encoding the first split: the dataset and vocabulary are complete, no ids yet.
    assert 'dataset_info.json' in prepared and list(data_dir.rglob('spm_*.model'))
    assert not list(data_dir.rglob('ids-*/*/*.array_record'))
  # What is there is whole: preparing again completes it.
  config = _config(synthetic_multi30k_dir, data_dir)
  vocab = tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  translation.data.prepare_ids(config.data, vocab)


def test_ctrl_c_while_the_libraries_import_ends_train_py_at_once(train, tmp_path):
  process = subprocess.Popen(
    train.command(tmp_path / 'run'), cwd=REPO, env=train.env, stderr=subprocess.PIPE, text=True
  )
  time.sleep(0.5)  # JAX, TFDS and Orbax take seconds to import.
  started = time.monotonic()
  process.send_signal(signal.SIGINT)
  stderr = process.communicate(timeout=120)[1]
  # Killed by the signal while importing (never a KeyboardInterrupt that a library's garbage
  # collection callback would swallow), or stopped at once if the run had begun.
  assert process.returncode in (-signal.SIGINT, 128 + signal.SIGINT), stderr[-3000:]
  assert time.monotonic() - started < 10
  assert not (tmp_path / 'run').exists()


def _warnings(stderr: str) -> list[str]:
  """absl's (W1201 ...) and Python logging's (WARNING:...) warning lines."""
  return [line for line in stderr.splitlines() if re.match(r'W\d{4} |WARNING:', line)]


def test_a_healthy_resume_and_eval_print_no_warning(train, reference, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  result = train(workdir, num_train_steps=8)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Restored checkpoint' in result.stderr
  assert _warnings(result.stderr) == []
  (tmp_path / 'in.txt').write_text('Bada kelo.\n')  # One sentence: one decoder to compile.
  result = _subprocess(
    'eval.py',
    f'--workdir={workdir}',
    '--decoder=greedy',
    '--checkpoint=avg:2',
    f'--input_file={tmp_path / "in.txt"}',
    f'--output_file={tmp_path / "out.txt"}',
    env=train.env,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert len((tmp_path / 'out.txt').read_text().splitlines()) == 1
  assert _warnings(result.stderr) == []


# --- Misuse, round three --------------------------------------------------------------------------

# train.py run through `python -c` with every SharedMemory that its processes create or open
# recorded (one name a line) in the file given as the first argument: the training process's
# and, through a wrapped `worker_init_fn`, its grain workers'.
_RECORDING_SHARED_MEMORY = r"""
import runpy, sys
import grain
record = sys.argv.pop(1)

def record_shared_memory():
  from multiprocessing import shared_memory
  opened = shared_memory.SharedMemory.__init__
  def recording(self, *args, **kwargs):
    opened(self, *args, **kwargs)
    with open(record, 'a') as f:
      f.write(self.name + '\n')
  shared_memory.SharedMemory.__init__ = recording

mp_prefetch = grain.IterDataset.mp_prefetch
def recording_mp_prefetch(self, options=None, worker_init_fn=None, **kwargs):
  def init(*args):
    record_shared_memory()
    if worker_init_fn is not None:
      worker_init_fn(*args)
  return mp_prefetch(self, options, worker_init_fn=init, **kwargs)

record_shared_memory()
grain.IterDataset.mp_prefetch = recording_mp_prefetch
sys.argv[0] = 'train.py'
runpy.run_path('train.py', run_name='__main__')
"""


@pytest.mark.parametrize('stop', ['end', 'sigterm'])
def test_grain_workers_leave_no_shared_memory(train, tmp_path, stop):
  """Batches cross from grain's workers in /dev/shm segments: none outlives the run, whether it
  ends or SIGTERM reaches all its processes (as Slurm and Ctrl-C do)."""
  record = tmp_path / 'shared_memory.txt'
  steps = 6 if stop == 'end' else 1000
  command = train.command(tmp_path / 'run', num_train_steps=steps, **{'data.num_workers': 2})
  command[1:2] = ['-c', _RECORDING_SHARED_MEMORY, str(record)]
  process = subprocess.Popen(
    command, cwd=REPO, env=train.env, stderr=subprocess.PIPE, text=True, start_new_session=True
  )
  log = []
  if stop == 'sigterm':
    for line in process.stderr:
      log.append(line)
      if 'step 2/1000' in line:
        os.killpg(process.pid, signal.SIGTERM)  # The training process and its workers.
        break
  log = ''.join(log) + process.communicate(timeout=300)[1]
  assert process.returncode == 0, log[-3000:]
  if stop == 'sigterm':
    assert 'Stopped by SIGTERM after step' in log
  names = set(record.read_text().split())
  assert len(names) > 10, names  # The batches did cross in shared memory.
  # Each was unlinked by the run itself: not left for Python's resource tracker to remove after
  # the exit (with a warning), nor in /dev/shm.
  assert 'leaked shared_memory' not in log, log[-3000:]
  assert sorted(names & set(os.listdir('/dev/shm'))) == []


def test_eval_input_with_nul_bytes_is_refused_by_line_before_any_restore(copied_run, tmp_path):
  workdir, before = copied_run
  source = tmp_path / 'in.txt'
  source.write_bytes('Bada kelo.\nSopi ra.\n'.encode('utf-16-le'))  # No byte order mark.
  result = _subprocess(
    'eval.py',
    f'--workdir={workdir}',
    f'--input_file={source}',
    f'--output_file={tmp_path / "out.txt"}',
    '--decoder=greedy',
  )
  assert result.returncode == 1
  assert _last_lines(result, 1) == [
    f'eval.py: error: --input_file={source}: line 1 holds a NUL byte (byte 2 of the line), '
    'which no text holds: UTF-16 text without a byte order mark, or not text; eval.py reads '
    f'UTF-8: convert it (iconv -f UTF-16LE -t UTF-8 < {source} > {source}.utf8).'
  ], result.stderr[-3000:]
  assert 'Restored checkpoint' not in result.stderr
  assert not (tmp_path / 'out.txt').exists()
  assert _snapshot(workdir) == before


def test_eval_avg_racing_the_rotation_twice_selects_again_each_time(reference, tmp_path, caplog):
  """The run rotates a checkpoint out while eval.py reads it, then another while eval.py lists
  the checkpoints to select again (Orbax lists the step folders, then reads each one's time)."""
  workdir = tmp_path / 'run'
  shutil.copytree(reference, workdir)
  folder = workdir / 'checkpoints'
  run = evaluation.setup(evaluation.load_run_config(str(workdir)))
  assert run.config.keep_checkpoints == 3 and _steps(workdir) == [2, 4, 6]
  restore, commit_time = (  # eval.py reads the parameters alone.
    checkpoints.Checkpointer.restore_params,
    orbax_step.Metadata.commit_timestamp,
  )
  calls, listing_rotations, lock = [], [], threading.Lock()

  def rotate() -> None:
    """The run commits its next checkpoint and removes its oldest."""
    steps = _steps(workdir)
    shutil.copytree(folder / str(steps[-1]), folder / str(steps[-1] + 2))
    shutil.rmtree(folder / str(steps[0]))

  def rotating_restore(every_time):
    def restore_while_rotating(self, step, *args):
      if (every_time or not calls) and step == _steps(workdir)[0]:
        rotate()  # While eval.py reads its oldest checkpoint.
        if not every_time:
          listing_rotations.append('once more')  # In the next listing.
      calls.append(step)
      return restore(self, step, *args)

    return restore_while_rotating

  @property
  def commit_time_while_rotating(step_folder):
    with lock:  # Orbax reads the step folders' times in threads.
      if listing_rotations and step_folder.step == _steps(workdir)[0]:
        listing_rotations.pop()
        rotate()  # Between the listing of the step folders and the reading of this one's time.
    return commit_time.fget(step_folder)

  caplog.set_level('INFO')
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoints.Checkpointer, 'restore_params', rotating_restore(False))
    patch.setattr(orbax_step.Metadata, 'commit_timestamp', commit_time_while_rotating)
    _, label = evaluation.restore_params(run, str(workdir), 'avg:3')
  # Read 2 (gone: 8 came); listed 4 (gone: 10 came) and listed again; then read 6, 8 and 10.
  assert label == 'avg3_6-10' and calls == [2, 6, 8, 10], calls
  assert 'Checkpoint 2 ' in caplog.text and 'was removed while it was read' in caplog.text
  assert f'{folder}/4 was removed while the checkpoints were listed' in caplog.text
  assert 'corrupt' not in caplog.text.lower() and 'cannot be restored' not in caplog.text

  # A run that rotates on every read: a bounded number of selections, then one clear refusal.
  calls.clear()
  with (
    pytest.MonkeyPatch.context() as patch,
    pytest.raises(errors.Refusal) as error,
  ):
    patch.setattr(checkpoints.Checkpointer, 'restore_params', rotating_restore(True))
    evaluation.restore_params(run, str(workdir), 'avg:3')
  attempts = evaluation.ROTATION_RETRIES + 1
  assert str(error.value).startswith(
    f"--checkpoint='avg:3': the training run removed a checkpoint while it was read, "
    f'{attempts} times in a row'
  ), error.value
  assert len(calls) == attempts


def _steps(workdir) -> list[int]:
  return sorted(int(e) for e in os.listdir(Path(workdir) / 'checkpoints') if e.isdigit())


def _watch_until_it_waits(workdir) -> tuple[subprocess.Popen, str]:
  """Starts `eval.py --watch`; returns once it waits for a checkpoint (or ends), with its log."""
  process = subprocess.Popen(
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      '--watch',
      '--decoder=greedy',
      '--split=validation',
      '--poll_seconds=0.1',
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    stderr=subprocess.PIPE,
    text=True,
  )
  log = []
  for line in process.stderr:
    log.append(line)
    if 'Waiting for a checkpoint after' in line:
      break
  return process, ''.join(log)


def test_a_second_eval_watch_of_a_run_is_refused_and_the_watch_lock_released_however_it_ends(
  copied_run, caplog
):
  workdir, _ = copied_run
  lock, metrics_file = workdir / 'eval' / 'watch.lock', workdir / 'eval' / 'metrics.jsonl'
  steps_written = lambda: [json.loads(row)['step'] for row in metrics_file.read_text().splitlines()]
  saved = json.loads((workdir / 'config.json').read_text())
  (workdir / 'config.json').write_text(json.dumps({**saved, 'num_train_steps': 4}))
  started = []  # Every eval.py, stopped at the end whatever happens.

  def watch_until_it_waits():
    process, log = _watch_until_it_waits(workdir)
    started.append(process)
    return process, log

  try:
    with workdir_lock.WorkdirLock(str(workdir)):  # The run trains on (this process holds it).
      first, log = watch_until_it_waits()  # It evaluated step 2 and waits for step 4.
      assert steps_written() == [2], log[-3000:]
      second, log = watch_until_it_waits()
      if second.poll() is None:  # It waits for step 4 too.
        second.kill()
      log += second.communicate(timeout=120)[1]
      assert second.returncode == 1, log[-3000:]
      [message] = _last_lines(subprocess.CompletedProcess([], 1, '', log), 1)
      assert message.startswith(
        f'eval.py: error: Another eval.py --watch follows the run in {workdir}: pid '
        f'{first.pid} on host {socket.gethostname()} (started '
      ), log[-3000:]
      assert message.endswith(
        f'which holds {lock}. Nothing was changed: two would evaluate every checkpoint twice '
        f'and write each step twice to {workdir}/eval/metrics.jsonl. Let it follow the run, or '
        'stop it (Ctrl-C) before watching with other flags.'
      ), message
      assert steps_written() == [2]
      # SIGTERM stops the first one as Ctrl-C does, and it releases its lock.
      first.send_signal(signal.SIGTERM)
      log = first.communicate(timeout=120)[1]
      assert first.returncode == 130, log[-3000:]
      assert f'Stopped watching {workdir}: interrupted.' in log
      assert not lock.exists()
      # kill -9 leaves it behind: stale, the next watcher removes it.
      killed, log = watch_until_it_waits()
      assert lock.exists(), log[-3000:]
      killed.kill()
      killed.wait()
  finally:
    for process in started:
      if process.poll() is None:
        process.kill()
        process.wait()

  # The run is gone (no train.lock): the next watcher evaluates what it left and stops.
  config = evaluation.load_run_config(str(workdir))
  run = evaluation.setup(config)
  request = tasks.EvalRequest(
    config,
    run.model_config,
    run.mesh,
    run.rules,
    'validation',
    inference.DecodeOptions(decoder='greedy'),
    batch_size=16,
  )
  caplog.set_level('INFO')
  assert evaluation.watch(run, str(workdir), request, poll_seconds=0.01) == [2]
  assert f'Removed the stale lock {lock} of pid {killed.pid}' in caplog.text
  assert not lock.exists()

  # Released when the watch fails, too.
  def disk_full(workdir):
    raise OSError('disk full')

  with pytest.MonkeyPatch.context() as patch, pytest.raises(OSError, match='disk full'):
    patch.setattr(evaluation, 'available_steps', disk_full)
    evaluation.watch(run, str(workdir), request, poll_seconds=0.01)
  assert not lock.exists()
