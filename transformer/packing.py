"""Vectorised first-fit packing of token windows into rows of a fixed length.

An item is a window of a token stream: the stream of a text of `n` ids is
`ids + [EOS]` (its *next* tokens: what is predicted, or a source) and, shifted
right, `[BOS] + ids` (its *input* tokens: the decoder input), `n + 1`
positions. A sentence is one window of its whole stream; a long document of a
language model is cut into several. Items have one window per side (a
translation pair: source and target) and are packed jointly: an item goes to the
first of the last `open_rows` rows where every side fits (first fit over a sliding
window of open rows, in the order given, as grain's `FirstFitPackIterDataset`
with `open_rows` bins), and its segment number is the same on every side. The
window keeps the rows in about the order of the items (an item waits at most
`open_rows` rows), so a shuffled epoch stays an epoch. Only the placement loop is Python;
the rows are written with whole-array numpy operations.
"""

import dataclasses

import numpy as np

from transformer import tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True)
class Windows:
  """The windows of one side of N items.

  Window i is positions `[offsets[i], offsets[i] + lengths[i])` of the stream
  of the text `ids[starts[i]:starts[i] + num_ids[i]]`.
  """

  ids: np.ndarray  # [T] the ids of all texts.
  starts: np.ndarray  # [N] where each item's text starts in `ids`.
  num_ids: np.ndarray  # [N] ids in each item's text.
  offsets: np.ndarray  # [N] first stream position of each window.
  lengths: np.ndarray  # [N] positions in each window (>= 1).
  with_inputs: bool  # Also write the input (shifted right) tokens.

  @classmethod
  def whole(
    cls, ids: np.ndarray, starts: np.ndarray, num_ids: np.ndarray, with_inputs: bool
  ) -> 'Windows':
    """One window per text, its whole stream (`num_ids + 1` positions)."""
    return cls(ids, starts, num_ids, np.zeros_like(num_ids), num_ids + 1, with_inputs)


def first_fit(
  lengths_NS: np.ndarray, capacity: int, open_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Places items of S sides in rows of `capacity` slots per side, first fit.

  Args:
    lengths_NS: int [N, S] slots each item needs on each side (each <= capacity).
    capacity: Slots per row and side.
    open_rows: Rows that may still take items: the last ones opened.

  Returns:
    rows [N] (row of each item, rows numbered in order of opening), offsets
    [N, S] (first slot of each item in its row) and segments [N] (1, 2, ... in
    each row, in placement order).
  """
  num, sides = lengths_NS.shape
  free_SR = np.full((sides, max(num, 1)), capacity, np.int64)
  placed = np.zeros(max(num, 1), np.int64)
  rows = np.empty(num, np.int64)
  offsets = np.empty((num, sides), np.int64)
  segments = np.empty(num, np.int64)
  lengths = lengths_NS.tolist()
  opened = 0
  for i in range(num):
    need = lengths[i]
    first = max(0, opened - open_rows)
    fits = free_SR[0, first:opened] >= need[0]
    for s in range(1, sides):
      fits &= free_SR[s, first:opened] >= need[s]
    row = first + int(fits.argmax()) if opened else 0
    if not opened or not fits[row - first]:
      row = opened
      opened += 1
    offsets[i] = capacity - free_SR[:, row]
    free_SR[:, row] -= need
    placed[row] += 1
    rows[i], segments[i] = row, placed[row]
  return rows, offsets, segments


def pack(sides: dict[str, Windows], length: int, open_rows: int) -> dict[str, np.ndarray]:
  """Packs items (one window per side, same N) into rows of `length` positions.

  `open_rows`: see `first_fit`.

  Returns, per side `s`, int32 [R, length] arrays `{s}_tokens` (next tokens),
  `{s}_segments` (1, 2, ... per item; 0 padding), `{s}_positions` (0, 1, ...
  within each item's window), and for sides with
  inputs `{s}_input_tokens`. R is the number of rows needed.
  """
  names = list(sides)
  lengths_NS = np.stack([sides[name].lengths for name in names], axis=1)
  rows, offsets_NS, segments = first_fit(lengths_NS, length, open_rows)
  num_rows = int(rows.max()) + 1 if len(rows) else 0
  out = {}
  for s, name in enumerate(names):
    w = sides[name]
    total = int(w.lengths.sum())
    item = np.repeat(np.arange(len(w.lengths)), w.lengths)
    within = np.arange(total) - np.repeat(np.cumsum(w.lengths) - w.lengths, w.lengths)
    position = w.offsets[item] + within  # Position in the text's stream.
    dest = rows[item] * length + offsets_NS[item, s] + within
    text = w.starts[item] + position
    has_next = position < w.num_ids[item]
    last = max(len(w.ids) - 1, 0)
    ids = w.ids if len(w.ids) else np.zeros(1, np.int32)
    arrays = {
      f'{name}_tokens': np.where(has_next, ids[np.minimum(text, last)], tokenizer_lib.EOS_ID),
      f'{name}_segments': segments[item],
      f'{name}_positions': within,
    }
    if w.with_inputs:
      arrays[f'{name}_input_tokens'] = np.where(
        position > 0, ids[np.clip(text - 1, 0, last)], tokenizer_lib.BOS_ID
      )
    for key, values in arrays.items():
      flat = np.zeros(num_rows * length, np.int32)
      flat[dest] = values
      out[key] = flat.reshape(num_rows, length)
  return out
