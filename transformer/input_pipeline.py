"""Grain plumbing shared by the tasks' input pipelines: packed batches, rows, shards.

Each task (`transformer/tasks/`) reads its own examples and packs them into rows
(`packing.pack`); this module turns its packing function into the infinite,
shuffled, checkpointable training iterator (`packed_train_iterator`) and the
finite evaluation batches of a split (`packed_eval_batches`), both split over
processes, and pads decoding batches to few shapes (`bucket_length`).

Every batch is a dict of int32 arrays of shape [rows, length]; token 0 (PAD)
and segment 0 mean padding.
"""

import collections
import dataclasses
import gc
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import logging
from grain._src.python.ipc import shared_memory_array  # The pool that unlinks it (grain 0.2.18).

from transformer import data_position
from transformer.errors import InvalidInput

# Read and pack in the consuming thread (a worker process, or the training process with
# `config.data.num_workers=0`): the packing loop is Python-bound, and reader threads
# would only contend for the GIL.
READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# Rows open for packing per row of a batch (grain's packing bins): more pack tighter.
PACKING_BINS_PER_ROW = 2
# Examples packed together per open row and per 16 positions of a row: rows are full
# but for the last open ones of each chunk, a small share of a chunk this long.
PACK_CHUNK_PER_ROW = 8
READ_CHUNK = 1024  # Examples read at once when scanning a split.

Batch = dict[str, np.ndarray]


class Counter:
  """Thread-safe running count, logged at 1, 2, 4, 8, ... occurrences."""

  def __init__(self, message: str):
    self._message = message
    self._count = 0
    self._lock = threading.Lock()

  def increment(self) -> None:
    with self._lock:
      self._count += 1
      count = self._count
    if count & (count - 1) == 0:
      logging.info(self._message, count)

  @property
  def count(self) -> int:
    return self._count

  def __reduce__(self):
    # A worker process counts on its own, from 0.
    return (Counter, (self._message,))


def chunk_examples(rows: int, length: int) -> int:
  """Examples (or documents) packed at once into batches of `rows` rows of `length`."""
  return PACK_CHUNK_PER_ROW * PACKING_BINS_PER_ROW * rows * max(1, length // 16)


def packed_batches(
  chunks: grain.MapDataset, rows: int, num_workers: int, *, drop_remainder: bool
) -> grain.IterDataset:
  """Packed chunks -> batches of `rows` rows, in `num_workers` processes (0: this one).

  Each worker packs and batches every `num_workers`-th chunk; grain interleaves
  their batches deterministically and checkpoints every worker's position. An
  exception in a worker is re-raised by `next` with the worker's traceback; a
  worker killed from outside (out of memory) makes `next` raise `RuntimeError:
  Worker process was terminated unexpectedly with exit code -9`.
  """
  it = chunks.to_iter_dataset(READ_OPTIONS)
  it = grain.experimental.RebatchIterDataset(it, rows, drop_remainder=drop_remainder)
  if num_workers:
    it = it.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=num_workers), worker_init_fn=_init_worker
    )
  return it


# How often a worker process looks whether the training process that started it still runs.
_PARENT_POLL_SECONDS = 1.0


def _init_worker(worker_index: int, worker_count: int) -> None:
  """Runs first in each grain worker process: it is stopped by the training process only.

  A worker copies each batch into shared memory (/dev/shm) before it queues it; killed by a
  signal in between, it leaves that memory behind. SIGTERM and SIGINT reach the workers too
  (Slurm signals every process of a job, Ctrl-C the terminal's process group), so the workers
  ignore them: the training process stops on them, closes its iterator (`DevicePrefetch.close`)
  and grain stops each worker, which unlinks what it holds. A worker whose training process
  died without stopping it (`kill -9`) exits on its own within `_PARENT_POLL_SECONDS`.
  """
  del worker_index, worker_count
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  parent = os.getppid()

  def exit_when_orphaned() -> None:
    while os.getppid() == parent:
      time.sleep(_PARENT_POLL_SECONDS)
    os._exit(1)

  threading.Thread(target=exit_when_orphaned, name='exit-when-orphaned', daemon=True).start()


def release_shared_memory() -> None:
  """Unlinks the shared memory of the batches this process received from grain's workers.

  Each array of such a batch is a shared memory segment, unlinked when the array is garbage
  collected: some only by the cycle collector, and then in grain's background thread. Without
  this, a run's last batches stay in /dev/shm until Python's resource tracker removes them
  after the process exited (warning 'There appear to be N leaked shared_memory objects'), or
  for good where the tracker cannot (killed with the job).
  """
  gc.collect()
  pool = getattr(shared_memory_array.SharedMemoryArray, '_del_thread_pool', None)
  if pool is not None:
    pool.apply(lambda: None)  # Its one thread runs in order: every unlink queued before is done.


class DevicePrefetch(grain.DatasetIterator):
  """The training iterator's batches, placed on the devices `ahead` steps early.

  `next` returns a batch placed by `place` (e.g. `sharding.global_batch`) and leaves
  the next `ahead` batches placed too, so that their host-to-device copies are under
  way while the steps before them run. `get_state()` is the wrapped iterator's
  position before the batch `next` returns next (a checkpoint resumes at the first
  batch no step has used); `set_state()` drops the placed batches. `wait_seconds`
  sums the time `next` took: fetching batches from the wrapped iterator (packing,
  or waiting for its worker processes) and placing them.
  """

  def __init__(
    self, iterator: grain.DatasetIterator, place: Callable[[Batch], Any], ahead: int = 2
  ):
    super().__init__(iterator)
    self._place, self._ahead = place, ahead
    self._placed: collections.deque[tuple[dict[str, Any], Any]] = collections.deque()
    self.wait_seconds = 0.0

  def __next__(self):
    start = time.perf_counter()
    while len(self._placed) <= self._ahead:
      state = self._parent.get_state()
      self._placed.append((state, self._place(next(self._parent))))
    _, batch = self._placed.popleft()
    self.wait_seconds += time.perf_counter() - start
    return batch

  def get_state(self) -> dict[str, Any]:
    return self._placed[0][0] if self._placed else self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._placed.clear()
    self._parent.set_state(state)

  def close(self) -> None:
    """Stops the worker processes (if any) and unlinks every batch's shared memory."""
    self._placed.clear()
    super().close()
    release_shared_memory()


def train_rows(data_config: ml_collections.ConfigDict, shard_count: int = 1) -> int:
  """Rows per training batch on one process.

  `config.data.tokens_per_batch // config.data.max_len // shard_count`.

  Raises:
    ValueError: If that is less than 1 or a division is inexact.
  """
  tokens, max_len = data_config.tokens_per_batch, data_config.max_len
  if max_len < 1 or tokens % max_len:
    raise InvalidInput(
      f'config.data.tokens_per_batch={tokens} must be a positive multiple of '
      f'config.data.max_len={max_len}.'
    )
  global_rows = tokens // max_len
  if global_rows < shard_count or global_rows % shard_count:
    raise InvalidInput(
      f'config.data.tokens_per_batch // config.data.max_len = {global_rows} '
      f'rows must be a positive multiple of the process count {shard_count}.'
    )
  return global_rows // shard_count


def eval_rows(
  data_config: ml_collections.ConfigDict, multiple_of: int = 1, length: int | None = None
) -> int:
  """Global rows per eval batch.

  `tokens_per_batch // length` (default `config.data.max_eval_len`), at least
  1, rounded up to a multiple of `multiple_of` (the batch shards of the mesh).
  """
  rows = max(1, data_config.tokens_per_batch // (length or data_config.max_eval_len))
  return -(-rows // multiple_of) * multiple_of


@dataclasses.dataclass(frozen=True)
class ProcessRows:
  """This process's contiguous block of the rows of a global batch."""

  shard_index: int
  shard_count: int

  def __call__(self, batch: Batch) -> Batch:
    rows = next(iter(batch.values())).shape[0] // self.shard_count
    return {k: v[self.shard_index * rows : (self.shard_index + 1) * rows] for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class PadRows:
  """Pads a batch with all-zero rows up to `rows` rows."""

  rows: int

  def __call__(self, batch: Batch) -> Batch:
    return {
      k: np.pad(v, [(0, self.rows - v.shape[0])] + [(0, 0)] * (v.ndim - 1))
      for k, v in batch.items()
    }


def bucket_length(length: int, max_length: int) -> int:
  """Smallest power of two >= `length` (at least 8).

  Capped at `max_length` rounded up to a multiple of 8.
  """
  cap = -(-max_length // 8) * 8
  bucket = 8
  while bucket < length:
    bucket *= 2
  return min(bucket, cap)


def check_shard(shard_index: int, shard_count: int) -> None:
  if not 0 <= shard_index < shard_count:
    raise InvalidInput(f'shard_index={shard_index} not in [0, {shard_count}).')


# A task's packing: (row length, rows open for packing) -> a function from a chunk of example
# indices to a batch of packed rows (a picklable object: worker processes run it).
Packer = Callable[[int, int], Callable[[np.ndarray], dict[str, np.ndarray]]]


def packed_train_iterator(
  data_config: ml_collections.ConfigDict,
  num_examples: int,
  packer: Packer,
  *,
  seed: int,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.DatasetIterator:
  """The infinite iterator of packed training batches of one process.

  Takes examples `shard_index::shard_count` of the `num_examples` of the
  training split, shuffles them with `config.seed` (differently each epoch),
  packs chunks of them into rows of `config.data.max_len` with
  `packer(max_len, open_rows)` and batches `train_rows(config, shard_count)`
  rows, in `config.data.num_workers` worker processes. `get_state()` /
  `set_state()` of the iterator checkpoint its position; `set_state()` takes
  one saved with another worker count too (`data_position.carry_over`).
  """
  rows = train_rows(data_config, shard_count)
  check_shard(shard_index, shard_count)
  length = data_config.max_len
  ds = grain.MapDataset.range(num_examples)[shard_index::shard_count]
  ds = ds.shuffle(seed=seed).repeat(None).batch(chunk_examples(rows, length))
  ds = ds.map(packer(length, rows * PACKING_BINS_PER_ROW))
  batches = iter(packed_batches(ds, rows, data_config.num_workers, drop_remainder=True))
  # A checkpoint's position is taken up with any worker count (`data_position`).
  return data_position.CarriedOver(batches, data_config.num_workers)


def packed_eval_batches(
  data_config: ml_collections.ConfigDict,
  num_examples: int,
  packer: Packer,
  length: int,
  *,
  rows_multiple_of: int = 1,
  shard_index: int = 0,
  shard_count: int = 1,
) -> grain.IterDataset:
  """The packed batches of a whole split, for evaluation.

  Finite and deterministic: the `num_examples` examples in order, packed into
  rows of `length` with `packer(length, open_rows)`; every global batch has
  `eval_rows(config, lcm(rows_multiple_of, shard_count), length)` rows, the
  last one padded with all-zero rows. With several processes, each packs the
  same global batches (so all of them run the same number of steps) and keeps
  its own block of rows: `shard_index` of `shard_count` equal blocks.
  Iterate it once per evaluation.
  """
  rows = eval_rows(data_config, math.lcm(rows_multiple_of, shard_count), length)
  check_shard(shard_index, shard_count)
  ds = grain.MapDataset.range(num_examples).batch(chunk_examples(rows, length))
  ds = ds.map(packer(length, rows * PACKING_BINS_PER_ROW))
  it = packed_batches(ds, rows, 0, drop_remainder=False).map(PadRows(rows))
  return it.map(ProcessRows(shard_index, shard_count)) if shard_count > 1 else it
