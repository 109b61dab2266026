"""The training iterator's position, carried over to another number of Grain worker processes.

The training batches are packed from chunks of examples (`input_pipeline.packed_batches`):
with `config.data.num_workers` = N > 0 worker w packs chunks w, w + N, w + 2N, ... and Grain
interleaves their batches; with N = 0 the training process packs every chunk in order. A
checkpoint records the position in that layout: per worker, the chunk it is in (`next_index`,
counted in its own share) and the rows of it already used (`batch_idx`). Another N cannot take
up that position as it is (Grain's `set_state` fails on it), so `carry_over` moves it to the
new layout at a chunk boundary: the first chunk (in the order of all chunks) that some worker
has not finished. Every chunk before it was used whole, and so is skipped; the chunks after
it, up to where the fastest worker had got, are read again: at most about N chunks
(`input_pipeline.chunk_examples` examples each) of an epoch, and the run is no longer bit
for bit the one that kept its worker count.
"""

from __future__ import annotations

from typing import Any

import grain
from absl import logging

_INTERLEAVE_KEYS = {
  'next_index_in_cycle',
  'next_index_in_datasets',
  'iterators_in_use_indices',
  'iterators_in_use_states',
  'exhausted',
  'future_states',
}


def _chunk_position(state: Any) -> tuple[int, int] | None:
  """(chunk, rows used of it) of one packing iterator's state (Grain's rebatch), or None."""
  if not isinstance(state, dict) or set(state) != {'parent', 'batch_idx'}:
    return None
  parent = state['parent']
  if not isinstance(parent, dict) or set(parent) != {'next_index'}:
    return None
  return int(parent['next_index']), int(state['batch_idx'])


def workers_of(state: Any) -> int | None:
  """The number of worker processes whose layout `state` records (0: none), or None if unknown."""
  if _chunk_position(state) is not None:
    return 0
  if isinstance(state, dict) and set(state) == _INTERLEAVE_KEYS:
    workers = state['iterators_in_use_states']
    if state['iterators_in_use_indices'] == list(range(len(workers))) and all(
      _chunk_position(worker) is not None for worker in workers
    ):
      return len(workers)
  return None


def first_unfinished_chunk(state: dict[str, Any]) -> int:
  """The first chunk, in the order of all chunks, that `state` has not used whole."""
  if (position := _chunk_position(state)) is not None:
    return position[0]  # A chunk with rows used is read again whole.
  workers = state['iterators_in_use_states']
  count = len(workers)
  return min(w + count * _chunk_position(worker)[0] for w, worker in enumerate(workers))


def layout(first_chunk: int, num_workers: int) -> dict[str, Any]:
  """The position at the start of chunk `first_chunk` for `num_workers` workers."""
  if num_workers == 0:
    return {'parent': {'next_index': first_chunk}, 'batch_idx': 0}
  # Worker v's share holds chunks v, v + N, ...: those before `first_chunk` are done.
  done = [max(0, -(-(first_chunk - v) // num_workers)) for v in range(num_workers)]
  return {
    'next_index_in_cycle': first_chunk % num_workers,  # The worker of the first chunk.
    'next_index_in_datasets': num_workers,
    'iterators_in_use_indices': list(range(num_workers)),
    'iterators_in_use_states': [{'parent': {'next_index': k}, 'batch_idx': 0} for k in done],
    'exhausted': [0] * num_workers,
    'future_states': {},
  }


def carry_over(state: Any, num_workers: int) -> Any:
  """`state` as a position for `num_workers` workers.

  Itself if it already is one, or if it is no layout this module knows (another Grain
  version's): Grain's `set_state` then takes it or says why not.
  """
  saved = workers_of(state)
  if saved is None or saved == num_workers:
    return state
  first_chunk = first_unfinished_chunk(state)
  logging.warning(
    'The checkpoint recorded the data position of %d worker processes; config.data.num_workers '
    'is %d: resuming at chunk %d, the first one not used whole (chunks after it that a faster '
    'worker had used are read again, so this run is not bit for bit one that kept its worker '
    'count).',
    saved,
    num_workers,
    first_chunk,
  )
  return layout(first_chunk, num_workers)


class CarriedOver(grain.DatasetIterator):
  """The training iterator, whose `set_state` takes a position of any worker count."""

  def __init__(self, iterator: grain.DatasetIterator, num_workers: int):
    super().__init__(iterator)
    self._num_workers = num_workers

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(carry_over(state, self._num_workers))
