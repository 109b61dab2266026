"""What a run measures and where it goes: metrics.jsonl and TensorBoard, throughput, profiles.

`MetricsWriter` writes WORKDIR/metrics.jsonl (one JSON object per row) and
TensorBoard event files, also to a bucket (`storage`); the training loop measures its throughput
(`Progress`), the time it waits for batches (`InputWait`) and traces chosen
steps (`StepProfiler`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from transformer import storage
from transformer.errors import InvalidInput, Refusal

if TYPE_CHECKING:
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.proto.summary_pb2 import Summary

FILENAME = 'metrics.jsonl'  # In the workdir: one JSON object per line, each with its step.
WALL_SECONDS = 'wall_seconds'  # Key of a row's time since the run began (`MetricsWriter`).


def read_rows(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics.jsonl at `path` (none if it does not exist), in file order.

  A last line without its newline is a row cut short by a crash mid-write (or being
  written now): it is left out. A line before it that is not a JSON row with a step was
  damaged otherwise: an error names the file and the line, before anything is written.
  """
  if not storage.exists(path):
    return []
  return [row for _, row in _parse_rows(storage.read_text(path), path)]


def _parse_rows(text: str, path: str) -> list[tuple[str, dict[str, Any]]]:
  """(line, row) of each complete row of `text`, the content of `path` (see `read_rows`)."""
  *lines, tail = text.split('\n')
  rows = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      row = e.msg
    if not isinstance(row, dict) or not isinstance(row.get('step'), int):
      why = row if isinstance(row, str) else 'not an object with a step'
      raise InvalidInput(
        f'{path}, line {number}, is damaged ({why}): {line[:80]!r}. A crash cuts only the last '
        'line short; this one was changed otherwise. Repair or delete that line (the rows are '
        'also in the TensorBoard events), then run the same command.'
      )
    rows.append((line + '\n', row))
  if tail.strip():
    logging.info('%s: leaving out its last line, cut short (%d characters).', path, len(tail))
  return rows


class MetricsWriteError(Refusal, OSError):
  """metrics.jsonl could not take some rows by the end of a run; the message says where."""


class MetricsWriter:
  """Writes scalar rows from process 0 only; other processes write nothing.

  With `started` (the `time.time()` at which the run began), every row also
  carries `wall_seconds`: the wall-clock seconds of the run up to that row,
  compile, evaluations and checkpoints included. A resumed run goes on from the
  `wall_seconds` of the last row it keeps (`truncate_after`): the time between a
  stop and the resume is not counted, the steps trained again from the checkpoint
  are. A run whose earlier rows lack it (written before this key existed) omits it.

  Locally each row is appended. An object on a bucket cannot be appended to: the
  writer keeps the file's text and writes the object anew with each row (one PUT per
  row, of the whole file), so that a row is in the bucket when `write` returns and a
  preempted run loses none it wrote. Rows come every `log_every_steps` and
  `eval_every_steps`: a few requests a minute, of a file of ~200 bytes a row.

  The same rows go to TensorBoard, one event file per start in WORKDIR/tensorboard/
  (`EventFile`): locally a row is in it when `write` returns, as in metrics.jsonl; and to
  `mirror` where there is one (`wandb_run.WandbRun`: its `log(step, metrics)`).
  """

  def __init__(self, workdir: str, started: float | None = None, mirror: Any = None):
    self.path = storage.join(workdir, FILENAME)
    self._enabled = jax.process_index() == 0
    self._started = started
    self._offset = 0.0  # Seconds the kept rows of earlier processes had reached.
    self._text: str | None = None  # On a bucket: the object's content, rewritten per row.
    self._tensorboard_dir = storage.join(workdir, 'tensorboard')
    self._tensorboard: EventFile | None = None  # Opened by `truncate_after` or the first row.
    self._pending: list[str] = []  # Rows not yet in the file (`_append_pending`).
    self._pending_steps: list[int] = []  # Their steps.
    self.written_step: int | None = None  # The step of the last row in the file.
    self._failure = ''
    self._mirror = mirror

  def truncate_after(self, step: int) -> None:
    """Drops rows written after `step` by a run that stopped before checkpointing them.

    A resumed run starts again from its last checkpoint; rows past it belong to a
    timeline that no longer exists and would otherwise appear twice. TensorBoard
    hides them too: this start's event file purges steps after `step` of the earlier
    files (`EventFile`'s `purge_step`).
    """
    if not self._enabled:
      return
    self.close()
    self._tensorboard = EventFile(self._tensorboard_dir, purge_step=step + 1)
    if not storage.exists(self.path):
      return
    text = storage.read_text(self.path)
    rows = _parse_rows(text, self.path)  # Without a last line cut short by a crash.
    kept = [row for _, row in rows if row['step'] <= step]
    kept_text = ''.join(line for line, row in rows if row['step'] <= step)
    if storage.is_url(self.path):
      self._text = kept_text
    if kept_text != text:
      logging.info('metrics.jsonl: dropping %d rows after step %d.', len(rows) - len(kept), step)
      storage.write_text(self.path, kept_text)
    if kept:
      earlier = kept[-1].get(WALL_SECONDS)
      if earlier is None:
        self._started = None  # The run's time so far is unknown: no row claims one.
      else:
        self._offset = earlier

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    row = {'step': int(step), **{k: float(v) for k, v in metrics.items()}}
    if self._started is not None:
      row[WALL_SECONDS] = round(self._offset + time.time() - self._started, 3)
    self._pending.append(json.dumps(row) + '\n')
    self._pending_steps.append(int(step))
    self._append_pending()
    try:
      if self._tensorboard is None:
        self._tensorboard = EventFile(self._tensorboard_dir)
      self._tensorboard.write_scalars(int(step), metrics)
    except OSError as e:  # metrics.jsonl is the record; TensorBoard shows it.
      logging.warning('TensorBoard events of step %d not written: %s', step, e)
    if self._mirror is not None:
      self._mirror.log(int(step), metrics)

  def _append_pending(self) -> None:
    """Appends the rows not yet in the file; a failure keeps them for the next try.

    A full disk or a file that cannot be written must not stop the run (its steps since
    the last checkpoint would be lost): the rows wait in memory, in order, and `close`
    keeps any still waiting at the end. A local append cut short is undone first, so the
    file never holds half a row before a whole one.
    """
    text = ''.join(self._pending)
    if not text:
      return
    size = None
    try:
      if storage.is_url(self.path):
        if self._text is None:  # No `truncate_after`: read what is there once.
          self._text = storage.read_text(self.path) if storage.exists(self.path) else ''
        storage.write_text(self.path, self._text + text)
        self._text += text
      else:
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        with open(self.path, 'a') as f:
          f.write(text)
    except OSError as e:
      if size is not None:
        with contextlib.suppress(OSError):
          os.truncate(self.path, size)
      self._failure = e.strerror or str(e)
      waiting = len(self._pending)
      if waiting & (waiting - 1) == 0:  # At 1, 2, 4, ... rows waiting.
        logging.warning(
          'Could not append to %s (%s): %d rows wait in memory and are tried again with each '
          'row; training goes on. Free space or fix the file.',
          self.path,
          self._failure,
          waiting,
        )
      return
    self._pending.clear()
    self.written_step = self._pending_steps[-1]
    self._pending_steps.clear()

  def saved(self) -> tuple[list[str], list[str]]:
    """What of the rows is in the file and what is not, in words (memory only, no request)."""
    if not self._enabled:
      return [], []
    saved = [f'{self.path} to step {self.written_step}'] if self.written_step is not None else []
    if not self._pending_steps:
      return saved, []
    steps = self._pending_steps
    return saved, [f'the rows of steps {steps[0]}-{steps[-1]} in {self.path}']

  def flush(self) -> None:
    self._append_pending()
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self) -> None:
    """Closes the TensorBoard writer; rows that never reached the file are kept and named.

    Raises:
      MetricsWriteError: some rows could not be appended by the end; they are in a file
        in the temporary folder, to append once the file can be written.
    """
    if self._tensorboard is not None:
      try:
        self._tensorboard.close()
      except OSError as e:
        logging.warning('TensorBoard events not written at close: %s', e)
    self._append_pending()
    if self._pending:
      descriptor, kept = tempfile.mkstemp(prefix='metrics.kept-', suffix='.jsonl')
      with os.fdopen(descriptor, 'w', encoding='utf-8') as f:
        f.write(''.join(self._pending))
      raise MetricsWriteError(
        f'{len(self._pending)} rows could not be appended to {self.path} ({self._failure}); '
        f'they are kept in {kept}. The checkpoints are complete: once the file can be '
        f'written, append them (cat {kept} >> {self.path}).'
      )


def import_tensorboardx() -> None:
  """Imports tensorboardX (its records and protos) without the torch it would import.

  tensorboardX's package imports its SummaryWriter, which imports torch where torch is
  installed (2.5 s of a start on 2 cores) only to accept torch tensors; this project hands it
  protos and bytes. Where torch is not loaded yet, it is hidden for that one import (tensorboardX
  takes it as absent, as without torch) and imports as before afterwards. Called where this
  project first reaches tensorboardX: an event file opened, records encoded, the hparams
  plugin's protos (`sweep_tensorboard`).
  """
  if 'tensorboardX' in sys.modules or 'torch' in sys.modules:
    return
  sys.modules['torch'] = None  # `import torch` raises ImportError while this is here.
  try:
    import tensorboardX  # noqa: F401  # pylint: disable=g-import-not-at-top,unused-import
  finally:
    del sys.modules['torch']


# On a bucket an event file is written whole at each flush (`_BucketEventFile`): at most this often.
BUCKET_FLUSH_SECONDS = 120.0


def encode_events(events: Iterable[Event]) -> bytes:
  """Event protos as the records of an event file (TFRecord: length, CRCs, data)."""
  import_tensorboardx()
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top

  records = []
  for event in events:
    data = event.SerializeToString()
    header = struct.pack('<Q', len(data))
    records += [header, struct.pack('<I', masked_crc32c(header)), data]
    records.append(struct.pack('<I', masked_crc32c(data)))
  return b''.join(records)


class EventFile:
  """A TensorBoard event file, written in the calling thread (tensorboardX's records and protos).

  Locally each `write_scalars` is flushed before it returns, so that a run killed at any
  point has in TensorBoard the rows it has in metrics.jsonl; on a bucket, where a flush
  rewrites the whole object (`_BucketEventFile`), at most every BUCKET_FLUSH_SECONDS and
  at `flush` and `close`.

  `purge_step`: the first step this file writes after a resume. Its first event is a
  SessionLog.START at that step, upon which TensorBoard drops the events of earlier files
  (those sort before this one) at that step and after: the steps a crashed run logged
  past its last checkpoint show once, as this run writes them again (tensorboardX's
  `SummaryWriter(purge_step=...)`, which writes the same event).
  """

  def __init__(self, directory: str, purge_step: int | None = None):
    # tensorboardX is imported where an event file is written, not with this module.
    import_tensorboardx()
    from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto.event_pb2 import Event, SessionLog  # pylint: disable=g-import-not-at-top

    register_bucket_event_writers()
    record_writer.directory_check(directory)
    # Named by the time to the microsecond, so a later start's file sorts (and is read) later.
    now = time.time()
    name = f'events.out.tfevents.{now:017.6f}.{socket.gethostname()}.{os.getpid()}'
    self.path = storage.join(directory, name)
    self._records = record_writer.open_file(self.path)
    self._local = not storage.is_url(directory)
    self._flushed = time.monotonic()
    self._write(Event(wall_time=now, file_version='brain.Event:2'))
    if purge_step is not None:
      self._write(
        Event(wall_time=now, step=purge_step, session_log=SessionLog(status=SessionLog.START))
      )
    self.flush()

  def _write(self, event: Event) -> None:
    self._records.write(encode_events([event]))

  def write_summary(self, step: int, summary: Summary, wall_time: float | None = None) -> None:
    """Writes a Summary proto (scalars, the hparams plugin's data) at `step`."""
    from tensorboardX.proto.event_pb2 import Event  # pylint: disable=g-import-not-at-top

    wall_time = time.time() if wall_time is None else wall_time
    self._write(Event(wall_time=wall_time, step=int(step), summary=summary))

  def write_scalars(self, step: int, values: dict[str, float]) -> None:
    """Writes the scalars of one row at `step`; locally, flushed before returning."""
    from tensorboardX.proto.summary_pb2 import Summary  # pylint: disable=g-import-not-at-top

    values = [Summary.Value(tag=name, simple_value=float(v)) for name, v in values.items()]
    self.write_summary(step, Summary(value=values))
    if self._local or time.monotonic() - self._flushed >= BUCKET_FLUSH_SECONDS:
      self.flush()

  def flush(self) -> None:
    self._records.flush()
    self._flushed = time.monotonic()

  def close(self) -> None:
    self.flush()
    self._records.close()


class _BucketEventFile:
  """A TensorBoard event file on a bucket, written whole at each flush (as tensorboardX's own).

  Through `storage` (one client and one set of credentials for every file of a run) rather
  than tensorboardX's boto3 and google-cloud-storage writers. `EventFile` flushes at most every
  BUCKET_FLUSH_SECONDS and at `MetricsWriter.flush` and `close`: one PUT each.
  """

  def __init__(self, path: str):
    self.path, self._data, self._flushed = path, bytearray(), 0

  def write(self, data: bytes) -> None:
    self._data += data

  def flush(self) -> None:
    if len(self._data) != self._flushed:
      storage.write_bytes(self.path, bytes(self._data))
      self._flushed = len(self._data)

  def close(self) -> None:
    self.flush()


class _BucketEventFiles:
  """tensorboardX's writer factory for one URL scheme (`record_writer.register_writer_factory`)."""

  def open(self, path: str) -> _BucketEventFile:
    return _BucketEventFile(path)

  def directory_check(self, path: str) -> None:
    del path  # A bucket needs no folders.


def register_bucket_event_writers() -> None:
  """Routes tensorboardX's gs:// and s3:// event files through `storage`."""
  import_tensorboardx()
  from tensorboardX import record_writer  # pylint: disable=g-import-not-at-top

  for scheme in storage.URL_SCHEMES:
    record_writer.register_writer_factory(scheme, _BucketEventFiles())


# A log window whose time went more than this share to getting batches, and at least this many
# milliseconds a step, warns (input-bound); a few milliseconds are the loop's own, not the data's.
INPUT_BOUND_SHARE, INPUT_BOUND_MS = 0.5, 10.0


class Progress:
  """Steps/s, tokens/s and the time left, since the last call (the console line and the log)."""

  def __init__(self, start_step: int, total_steps: int):
    self.total_steps = total_steps
    self.last_step, self.last_time = start_step, time.perf_counter()

  def rates(self, step: int, tokens: float) -> tuple[float, float, float]:
    now = time.perf_counter()
    elapsed = max(now - self.last_time, 1e-9)
    steps_per_sec = (step - self.last_step) / elapsed
    self.last_step, self.last_time = step, now
    eta = (self.total_steps - step) / max(steps_per_sec, 1e-9)
    return steps_per_sec, tokens / elapsed, eta


class InputWait:
  """Milliseconds per step the loop spent getting batches, and a warning when that is most."""

  def __init__(self, iterator: Any, num_workers: int):
    """`iterator`: the loop's batches (`input_pipeline.DevicePrefetch`, its `wait_seconds`)."""
    self.iterator, self.num_workers = iterator, num_workers
    self.last, self.warned = iterator.wait_seconds, False

  def per_step_ms(self, steps: int, steps_per_sec: float) -> float:
    waited, self.last = self.iterator.wait_seconds - self.last, self.iterator.wait_seconds
    ms = waited / max(steps, 1) * 1e3
    share = ms / 1e3 * steps_per_sec
    if share > INPUT_BOUND_SHARE and ms >= INPUT_BOUND_MS and not self.warned:
      self.warned = True
      logging.warning(
        'Input-bound: the training loop spent %.0f%% of its time getting batches '
        '(%.0f ms per step), so the steps wait for data. Raise config.data.num_workers '
        '(now %s) to pack batches in more processes.',
        100 * share,
        ms,
        self.num_workers,
      )
    return ms


class StepProfiler:
  """Traces train steps [first, first + count) with jax.profiler into `directory`.

  A bucket `directory` is traced into a local temporary folder, uploaded when the trace stops.
  """

  def __init__(self, directory: str, first: int, count: int):
    self.directory, self.first, self.last = directory, first, first + count - 1
    self.active = False
    self._local: str | None = None  # The local folder of a trace bound for a bucket.

  def before(self, step: int) -> None:
    if step == self.first and self.last >= self.first:
      target = self.directory
      if storage.is_url(self.directory):
        import tempfile  # pylint: disable=g-import-not-at-top

        self._local = target = tempfile.mkdtemp(prefix='transformer-profile-')
      jax.profiler.start_trace(target)
      self.active = True

  def after(self, step: int, outputs) -> None:
    if self.active and step >= self.last:
      jax.block_until_ready(outputs)
      self.stop()
      logging.info(
        'Wrote a profile of steps %d-%d to %s (tensorboard --logdir %s).',
        self.first,
        step,
        self.directory,
        self.directory,
      )

  def stop(self) -> None:
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
      if self._local is not None:
        import shutil  # pylint: disable=g-import-not-at-top

        storage.copytree(self._local, self.directory)
        shutil.rmtree(self._local, ignore_errors=True)
        self._local = None
