"""Orbax checkpoints of the train state and the Grain iterator position, with resume checks.

Layout (Orbax's default): WORKDIR/checkpoints/<step>/{state,data}/. Writes are
asynchronous and atomic (Orbax renames a finished temporary folder into place),
so an interrupted save never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging


def _entry_name(entry) -> str:
  for attribute in ('key', 'name', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  """{'params/encoder/.../kernel': shape}; dataclass fields, dict keys and tuple indices alike."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'/'.join(_entry_name(e) for e in path): tuple(getattr(leaf, 'shape', ()))
          for path, leaf in flat}


class Checkpointer:
  """Saves and restores {train state, data iterator} under WORKDIR/checkpoints."""

  def __init__(self, workdir: str, *, keep: int | None = None, read_only: bool = False):
    """`keep`: checkpoints kept when saving; `read_only` (evaluation) never writes or deletes."""
    self.directory = os.path.join(os.path.abspath(os.path.expanduser(workdir)), 'checkpoints')
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f'No checkpoints directory at {self.directory}.')
    self._manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, read_only=read_only),
      item_names=('state', 'data'),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state, data_iterator: grain.DatasetIterator, *, force=False) -> bool:
    """Starts an asynchronous save of `state` and the iterator's position at `step`."""
    return self._manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
      ),
      force=force,
    )

  def check_compatible(self, step: int, abstract_state) -> None:
    """Raises, naming every differing array, if checkpoint `step` does not fit the model.

    Runs before any restore or compile; the checkpoint on disk is never touched.
    """
    metadata = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), 'state'))
    saved = _leaf_shapes(metadata.item_metadata)
    expected = _leaf_shapes(abstract_state)
    problems = []
    for key in sorted(set(saved) | set(expected)):
      if key not in saved:
        problems.append(f'{key}: expected {expected[key]}, absent in the checkpoint')
      elif key not in expected:
        problems.append(f'{key}: {saved[key]} in the checkpoint, absent in this model')
      elif saved[key] != expected[key]:
        problems.append(f'{key}: checkpoint {saved[key]} vs model {expected[key]}')
    if problems:
      shown = '\n  '.join(problems[:20])
      more = f'\n  ... and {len(problems) - 20} more' if len(problems) > 20 else ''
      raise ValueError(
        f'The checkpoint at {self.directory}/{step} was written by an incompatible model '
        f'({len(problems)} arrays differ); it is left untouched. Use another --workdir or '
        f'the config that wrote it.\n  {shown}{more}')

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator | None):
    """Restores the state into `abstract_state`'s shapes and shardings, and the iterator."""
    self.check_compatible(step, abstract_state)
    args = {'state': ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      args['data'] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    logging.info('Restored checkpoint %s/%d.', self.directory, step)
    return restored['state']

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def select_steps(available: list[int], checkpoint: str) -> list[int]:
  """Steps named by `checkpoint`: 'latest', a step number, or 'avg:N' (the last N).

  Errors list what exists, so a typo is fixed in one go.
  """
  available = sorted(available)
  if not available:
    raise ValueError('There are no checkpoints.')
  if checkpoint == 'latest':
    return available[-1:]
  if checkpoint.startswith('avg:'):
    count = checkpoint[len('avg:'):]
    if not count.isdigit() or int(count) < 1:
      raise ValueError(f'checkpoint={checkpoint!r}: expected avg:N with N a positive integer.')
    if int(count) > len(available):
      raise ValueError(
        f'checkpoint={checkpoint!r} needs {count} checkpoints, but there are only '
        f'{len(available)}: {available}.')
    return available[-int(count):]
  if checkpoint.isdigit() and int(checkpoint) in available:
    return [int(checkpoint)]
  raise ValueError(
    f'checkpoint={checkpoint!r} does not exist; the checkpoints are at steps {available} '
    f"(or use 'latest' or 'avg:N').")


def load_params(workdir: str, abstract_state, checkpoint: str = 'latest'):
  """Parameters of one checkpoint, or the average of several (`avg:N`, section 6.1).

  Returns the parameters and a label naming them (`step_1500`, `avg5_1100-1500`).
  """
  checkpointer = Checkpointer(workdir, read_only=True)
  try:
    steps = select_steps(checkpointer.all_steps(), checkpoint)
    total = None
    for step in steps:
      params = checkpointer.restore(step, abstract_state, None).params
      total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
  finally:
    checkpointer.close()
  params = jax.tree.map(lambda x: x / len(steps), total) if len(steps) > 1 else total
  label = (f'step_{steps[0]}' if len(steps) == 1
           else f'avg{len(steps)}_{steps[0]}-{steps[-1]}')
  return params, label


def available_steps(workdir: str) -> list[int]:
  """Steps of the committed checkpoints in `workdir` ([] if there are none yet)."""
  try:
    checkpointer = Checkpointer(workdir, read_only=True)
  except FileNotFoundError:
    return []
  try:
    return sorted(checkpointer.all_steps())
  finally:
    checkpointer.close()
