"""Orbax checkpoints of the train state and the Grain iterator position, with resume checks.

Layout (Orbax's default): WORKDIR/checkpoints/<step>/{state,data}/, and with
`config.keep_best_checkpoints` the parameters of the evaluations with the best
validation BLEU in WORKDIR/best_checkpoints/<step>/ (`best_checkpoints`). Writes are
asynchronous and atomic (Orbax renames a finished temporary folder
`<step>.orbax-checkpoint-tmp*` into place), so an interrupted save never leaves
a checkpoint that looks complete; such folders are never read, and a training
run removes them when it starts. A checkpoint that fails to restore is reported
by step; only `restore_latest(..., fallback=True)` moves it aside (to
WORKDIR/corrupt_checkpoints/) and resumes from an older one. A reader (eval.py)
racing the training run's rotation (it keeps the last `keep_checkpoints`) gets
`CheckpointGoneError`, never a report of corruption; `evaluation.load_params`
then reads the checkpoints anew.

On a bucket (a gs:// or s3:// workdir) nothing can be renamed: Orbax writes each
step in place and commits it by writing `commit_success.txt` last
(`AtomicityMode.COMMIT_FILE`, its default on gs:// and set here for s3:// too);
a step folder without it is a save in flight or one that died, never read.
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import shutil
import time
from collections.abc import Callable
from typing import TypeVar

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from transformer import storage
from transformer.errors import InvalidInput, MissingInput, Refusal

T = TypeVar('T')
# custom_metadata key of each checkpoint: {array path: checksum} (`array_checksums`).
CHECKSUMS_KEY = 'array_checksums'


class CorruptCheckpointError(Refusal, RuntimeError):
  """A committed checkpoint cannot be read back (truncated or corrupted files)."""


class CheckpointSaveError(Refusal, RuntimeError):
  """Writing a checkpoint failed (e.g. the disk is full); committed ones are untouched."""


class CheckpointGoneError(Refusal, RuntimeError):
  """A checkpoint was removed while it was read: the training run rotated it out."""


# Times a reader lists the checkpoints when the training run removed one while they were
# listed (Orbax lists the step folders, then reads each one's commit time), and the pause
# before each new listing.
_LISTING_ATTEMPTS = 5
_LISTING_PAUSE_SECONDS = 0.2


def _listed_while_rotating(directory: str, list_checkpoints: Callable[[], T]) -> T:
  """`list_checkpoints()`, which lists `directory`; again if a step folder vanished meanwhile.

  A training run removes its oldest checkpoint (`keep_checkpoints`) after committing a new
  one; if that happens between Orbax's listing of the step folders and its reading of one of
  them, the listing raises FileNotFoundError: a new one sees the folders now there.
  """
  for attempt in range(1, _LISTING_ATTEMPTS + 1):
    try:
      return list_checkpoints()
    except FileNotFoundError as e:
      if isinstance(e, MissingInput) or not storage.isdir(directory):
        raise
      gone = e.filename or str(e)
      if attempt == _LISTING_ATTEMPTS:
        raise CheckpointGoneError(
          f'The checkpoints in {directory} changed while they were listed, {attempt} times in '
          f'a row (the last time {gone} was removed): the training run removes checkpoints '
          'faster than they can be listed here. Evaluate once it has ended, or checkpoints '
          'less often (config.checkpoint_every_steps).'
        ) from e
      logging.info(
        '%s was removed while the checkpoints were listed (the training run rotates them); '
        'listing them again.',
        gone,
      )
      time.sleep(_LISTING_PAUSE_SECONDS)
  raise AssertionError('unreachable')


class _ReadOnlyNotice(py_logging.Filter):
  """Drops Orbax's warning that a read-only manager's directory is read-only: it says what was
  asked, every time a read-only manager opens, and would teach users to ignore warnings."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Given directory is read only')


@contextlib.contextmanager
def quiet_read_only_notice():
  logger = logging.get_absl_logger()
  notice = _ReadOnlyNotice()
  logger.addFilter(notice)
  try:
    yield
  finally:
    logger.removeFilter(notice)


# What marks a step committed on a bucket (Orbax's CommitFileTemporaryPath).
COMMIT_FILE = 'commit_success.txt'


def atomicity(directory: str) -> ocp.options.AtomicityOptions | None:
  """Orbax's commit protocol for `directory`: a commit file on buckets, its default locally."""
  if storage.is_url(directory):
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)
  return None


def _entry_name(entry) -> str:
  for attribute in ('key', 'name', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def _leaves(tree) -> dict[str, object]:
  """{'params/encoder/.../kernel': leaf}; dataclass fields, dict keys and tuple indices alike."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'/'.join(_entry_name(e) for e in path): leaf for path, leaf in flat}


def _leaf_shapes(tree) -> dict[str, tuple[int, ...]]:
  return {key: tuple(getattr(leaf, 'shape', ())) for key, leaf in _leaves(tree).items()}


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@jax.jit
def _checksum_arrays(tree):
  """Per array, the sum of its bit patterns as uint32 words, wrapping: any changed word shows.

  Exact integer sums are independent of the summation order, so the value does
  not depend on sharding or device count.
  """

  def checksum(x):
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

  return jax.tree.map(checksum, tree)


def array_checksums(state) -> dict[str, int]:
  """{'params/.../kernel': checksum} of a (possibly sharded) state; stored with each checkpoint.

  Orbax's array files carry no checksums, so a flipped byte would otherwise
  restore silently as a wrong (often NaN) value.
  """
  checksums = jax.device_get(_checksum_arrays(state))
  return {key: int(value) for key, value in _leaves(checksums).items()}


class Checkpointer:
  """Saves and restores {train state, data iterator} under WORKDIR/checkpoints."""

  def __init__(
    self,
    workdir: str,
    *,
    keep: int | None = None,
    read_only: bool = False,
    during_save: Callable[[int], None] | None = None,
  ):
    """Opens WORKDIR/checkpoints.

    Args:
      workdir: The run's directory.
      keep: Checkpoints kept when saving (None: all); with `read_only`, those the
        training run keeps (`config.keep_checkpoints`), to tell a checkpoint it
        rotated out from a damaged one.
      read_only: For evaluation: never writes or deletes.
      during_save: Called with the step inside each save, in Orbax's background
        thread, once every file is written into the temporary
        `<step>.orbax-checkpoint-tmp*` folder and before it is renamed into
        place (committed). Tests crash the process there (tests/fault_driver.py).
    """
    workdir = storage.resolve(workdir)
    self.directory = storage.join(workdir, 'checkpoints')
    self.corrupt_directory = storage.join(workdir, 'corrupt_checkpoints')
    if read_only and not storage.isdir(self.directory):
      raise MissingInput(f'No checkpoints directory at {self.directory}.')
    if not read_only and jax.process_index() == 0:  # Orbax removes them on process 0.
      for path in uncommitted(self.directory):
        logging.warning(
          'Removing %s: a save that never committed (the process died during it).', path
        )
    self._saving_step = None  # The step of the save in flight, if any.
    self.committed_step: int | None = None  # The newest step this process saw committed.
    self._keep = keep
    self._read_only = read_only
    async_options = None
    if during_save is not None:
      async_options = ocp.AsyncOptions(
        post_finalization_callback=lambda: during_save(self._saving_step)
      )

    def open_manager() -> ocp.CheckpointManager:  # It lists the checkpoints.
      with quiet_read_only_notice():
        return ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            async_options=async_options,
            atomicity_options=atomicity(self.directory),
          ),
          # Both items' handlers, so that restoring the state alone (eval.py) is not a warning.
          item_handlers={
            'state': ocp.StandardCheckpointHandler(),
            'data': grain.checkpoint.CheckpointHandler(),
          },
        )

    if read_only:  # A reader lists the checkpoints of a run that may be rotating them.
      self._manager = _listed_while_rotating(self.directory, open_manager)
    else:
      self._manager = open_manager()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def reload(self) -> None:
    """Reads the list of checkpoints anew (another process saves and rotates them)."""
    _listed_while_rotating(self.directory, self._manager.reload)

  def save(self, step: int, state, data_iterator: grain.DatasetIterator, *, force=False) -> bool:
    """Starts an asynchronous save of `state` and the iterator's position at `step`.

    Raises `CheckpointSaveError` if this save, or the previous one still in
    flight, fails.
    """
    with self._reporting_save_errors():
      self._manager.wait_until_finished()  # A failed earlier save is reported as such.
      self._committed(self._saving_step)
      self._saving_step = step
      return self._manager.save(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=grain.checkpoint.CheckpointSave(data_iterator),
        ),
        force=force,
        custom_metadata={CHECKSUMS_KEY: array_checksums(state)},
      )

  @contextlib.contextmanager
  def _reporting_save_errors(self):
    try:
      yield
    except Exception as e:
      step, self._saving_step = self._saving_step, None
      self._manager.reload()  # The failed save's temporary folder is not a checkpoint.
      committed = self._manager.latest_step()
      previous = (
        f'the last committed checkpoint, {self.directory}/{committed}, is intact'
        if committed is not None
        else 'no checkpoint had been committed yet'
      )
      raise CheckpointSaveError(
        f'Saving checkpoint {step} to {self.directory} failed ({type(e).__name__}: {e}); '
        f'{previous}. Free space (or fix the error) and run the same command to resume.'
      ) from e

  def check_compatible(self, step: int, abstract_state) -> None:
    """Raises, naming every differing array, if checkpoint `step` does not fit the model.

    Runs before any restore or compile; the checkpoint on disk is never touched.
    """
    handler = ocp.StandardCheckpointHandler()
    try:  # The item's own handler: a StandardCheckpointer would look for a step's metadata.
      saved = _leaf_shapes(handler.metadata(epath.Path(self.directory, str(step), 'state')))
    except Exception as e:
      raise self._read_error(step, e) from e
    finally:
      handler.close()
    if not saved:  # Orbax only warns when the array metadata cannot be read.
      raise self._read_error(step, 'its array metadata is missing or unreadable')
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
      raise InvalidInput(
        f'The checkpoint at {self.directory}/{step} was written by an incompatible model '
        f'({len(problems)} arrays differ); it is left untouched. Use another --workdir or '
        f'the config that wrote it.\n  {shown}{more}'
      )

  def check_latest_compatible(self, abstract_state) -> None:
    """`check_compatible` for the latest checkpoint, if any, before any data or compile.

    An unreadable one is not an error here: `restore_latest` reports it (or
    falls back).
    """
    latest = self.latest_step()
    if latest is not None:
      with contextlib.suppress(CorruptCheckpointError):
        self.check_compatible(latest, abstract_state)

  def restore(self, step: int, abstract_state, data_iterator: grain.DatasetIterator | None):
    """Restores the state into `abstract_state`'s shapes and shardings, and the iterator."""
    self.check_compatible(step, abstract_state)
    args = {'state': ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      args['data'] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
      saved_checksums = self._saved_checksums(step)
    except Exception as e:
      raise self._read_error(step, e) from e
    self._check_checksums(step, restored['state'], saved_checksums)
    logging.info('Restored checkpoint %s/%d.', self.directory, step)
    return restored['state']

  def restore_params(self, step: int, abstract_state):
    """The parameters of checkpoint `step` alone, in `abstract_state.params`' shapes and shardings.

    The rest of the state (the optimizer's moments: twice the parameters' bytes with Adam)
    is not read: averaging 10 checkpoints for eval.py took 3.0 s against 14.6 s on a CPU
    (docs/benchmarks.md). Checked as `restore` checks: the checksums of the arrays read
    after, and the model against the checkpoint, every array's shape (`check_compatible`,
    0.4 s a checkpoint), only where the read fails or the checkpoint holds parameters the
    model lacks (which a partial read leaves out silently; the saved checksums name every
    array), so that a checkpoint of another model is named as such.
    """
    item = {'params': abstract_state.params}
    # The state item's own handler, on its folder: the manager's handler for it restores
    # whole trees only.
    handler = ocp.PyTreeCheckpointHandler()
    try:
      restored = handler.restore(
        epath.Path(self.directory, str(step), 'state'),
        args=ocp.args.PyTreeRestore(
          item=item,
          restore_args=ocp.checkpoint_utils.construct_restore_args(item),
          partial_restore=True,
        ),
      )
      saved_checksums = self._saved_checksums(step)
    except Exception as e:
      self.check_compatible(step, abstract_state)  # Raises if the shapes differ.
      raise self._read_error(step, e) from e
    finally:
      handler.close()
    saved_params = {key for key in saved_checksums or {} if key.startswith('params/')}
    if saved_checksums is None or saved_params != set(_leaves(restored)):
      self.check_compatible(step, abstract_state)  # Raises, naming the arrays that differ.
    self._check_checksums(step, restored, saved_checksums)
    logging.info('Restored checkpoint %s/%d: its parameters.', self.directory, step)
    return restored['params']

  def _saved_checksums(self, step: int) -> dict | None:
    """The checksums written with checkpoint `step` (None before checksums were written).

    From the step's own metadata file: the manager's `metadata(step)` also reads every
    item's array metadata (0.47 s a checkpoint on a CPU, against 1 ms).
    """
    step_metadata = ocp.metadata.get_step_metadata(epath.Path(self.directory, str(step)))
    return (step_metadata.custom_metadata or {}).get(CHECKSUMS_KEY)

  def _check_checksums(self, step: int, restored, saved_checksums: dict | None) -> None:
    """Raises `CorruptCheckpointError` if an array read differs from its checksum at saving."""
    if saved_checksums is None:  # Checkpoints written before checksums have none.
      return
    restored_checksums = array_checksums(restored)
    damaged = sorted(
      key for key, value in restored_checksums.items() if saved_checksums.get(key) != value
    )
    if damaged:
      shown = ', '.join(damaged[:5]) + (f' and {len(damaged) - 5} more' if len(damaged) > 5 else '')
      raise self._corrupt(
        step,
        f'{len(damaged)} arrays differ from the checksums written '
        f'with them ({shown}): the files were changed after the save',
      )

  def _read_error(self, step: int, error: Exception | str) -> Exception:
    """For a reader, `CheckpointGoneError` if the training run rotated `step` out; else `_corrupt`.

    Rotated out: its folder is gone, or at least `keep` newer checkpoints are committed
    (the run deletes it right after committing the newest).
    """
    newer = [s for s in committed_steps(self.directory) if s > step]
    rotated = self._keep is not None and len(newer) >= self._keep
    exists = storage.isdir(storage.join(self.directory, str(step)))
    if not self._read_only or (exists and not rotated):
      return self._corrupt(step, error)
    return CheckpointGoneError(
      f'Checkpoint {step} ({self.directory}/{step}) was removed while it was read: the '
      f'training run keeps its last {self._keep} checkpoints (config.keep_checkpoints) and '
      f'has committed newer ones since; the checkpoints now are at steps '
      f'{committed_steps(self.directory)}.'
    )

  def _corrupt(self, step: int, error: Exception | str) -> CorruptCheckpointError:
    if isinstance(error, Exception):
      # Orbax wraps the TensorStore error that says what is wrong (e.g. "ZSTD_decompressStream()
      # failed: Data corruption detected") in one that runs to pages: report the innermost.
      while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
      error = f'{type(error).__name__}: {str(error).splitlines()[0][:400]}'
    return CorruptCheckpointError(
      f'Checkpoint {step} ({self.directory}/{step}) cannot be restored: {error}'
    )

  def restore_latest(
    self, abstract_state, data_iterator: grain.DatasetIterator, *, fallback: bool = False
  ):
    """Restores the newest checkpoint; returns (step, state), or (None, None) if there is none.

    A checkpoint that fails to restore raises `CorruptCheckpointError` naming
    its step, and nothing on disk changes. With `fallback`, the newest one
    that restores is used instead, and only then are the newer, unreadable
    ones moved to `corrupt_directory` (kept for inspection, out of Orbax's way
    so that their steps can be saved again). A checkpoint of another model
    (`check_compatible`) is always an error.
    """
    unreadable = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        state = self.restore(step, abstract_state, data_iterator)
      except CorruptCheckpointError as e:
        if not fallback:
          raise CorruptCheckpointError(
            f'{e}\nNothing was changed. To resume from the newest checkpoint that restores '
            f'instead, pass --restore_fallback (checkpoint {step} is then moved to '
            f'{self.corrupt_directory}).'
          ) from e.__cause__
        logging.warning('%s; trying the previous checkpoint.', e)
        unreadable.append(step)
        continue
      if unreadable:
        if jax.process_index() == 0:
          for bad_step in unreadable:
            self._move_aside(bad_step)
        if jax.process_count() > 1:
          multihost_utils.sync_global_devices('Checkpointer.restore_latest: moved aside')
        self._manager.reload()
      self._committed(step)
      return step, state
    if unreadable:
      raise CorruptCheckpointError(
        f'No checkpoint in {self.directory} restores (steps {unreadable}); nothing was changed.'
      )
    return None, None

  def _move_aside(self, step: int) -> None:
    storage.makedirs(self.corrupt_directory)
    target = storage.join(self.corrupt_directory, str(step))
    suffix = 1
    while storage.exists(target):
      target = storage.join(self.corrupt_directory, f'{step}-{suffix}')
      suffix += 1
    source = storage.join(self.directory, str(step))
    if storage.is_url(source):  # A copy of every object, then the originals removed.
      storage.copytree(source, target)
      storage.rmtree(source)
    else:
      shutil.move(source, target)
    logging.warning('Moved unreadable checkpoint %d to %s.', step, target)

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight is committed; raises `CheckpointSaveError` if it failed."""
    with self._reporting_save_errors():
      self._manager.wait_until_finished()
    self._committed(self._saving_step)
    self._saving_step = None

  def _committed(self, step: int | None) -> None:
    if step is not None and (self.committed_step is None or step > self.committed_step):
      self.committed_step = step

  def saved(self) -> tuple[list[str], list[str]]:
    """What of the checkpoints is committed and what is not, in words (no request is made)."""
    committed, saving = self.committed_step, self._saving_step
    saved = [f'checkpoint {self.directory}/{committed}'] if committed is not None else []
    if saving is None or saving == committed:
      return saved, []
    return saved, [f'checkpoint {saving} (its commit did not finish; discarded at the next start)']

  def close(self) -> None:
    self._manager.close()


def _step_folders(directory: str) -> tuple[list[int], list[int]]:
  """(committed, uncommitted) steps of the `<step>` folders in `directory` (one listing).

  Locally a `<step>` folder is committed (Orbax renames it into place); on a bucket only
  with its `COMMIT_FILE` (written in place, committed last).
  """
  try:
    names = storage.listdir(directory)
  except FileNotFoundError:
    return [], []
  steps = sorted(int(name) for name in names if name.isdigit())
  if not storage.is_url(directory):
    return steps, []
  done = [s for s in steps if storage.exists(storage.join(directory, str(s), COMMIT_FILE))]
  return done, [s for s in steps if s not in done]


def committed_steps(directory: str) -> list[int]:
  """Steps of the committed checkpoints in `directory` (WORKDIR/checkpoints), by folder name.

  Reads the folder only (no checkpoint manager): temporary folders of saves in flight are
  not committed steps, nor, on a bucket, step folders without their `COMMIT_FILE`.
  """
  return _step_folders(directory)[0]


def uncommitted(directory: str) -> list[str]:
  """The folders of saves that never committed in `directory` (Orbax removes them on open).

  Locally `<step>.orbax-checkpoint-tmp*` folders; on a bucket, step folders without
  their `COMMIT_FILE`.
  """
  if not storage.is_url(directory):
    return storage.glob(directory, '*.orbax-checkpoint-tmp*')
  return [storage.join(directory, str(s)) for s in _step_folders(directory)[1]]


def check_latest_compatible(workdir: str, abstract_state) -> None:
  """`Checkpointer.check_latest_compatible` of `workdir`, read-only: nothing is created."""
  try:
    checkpointer = Checkpointer(workdir, read_only=True)
  except FileNotFoundError:
    return  # No checkpoints yet.
  try:
    checkpointer.check_latest_compatible(abstract_state)
  finally:
    checkpointer.close()
