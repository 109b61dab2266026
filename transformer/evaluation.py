"""Evaluating a trained run: its config loaded, its checkpoints chosen, restored and followed.

`setup(config)` turns the run's config into model config, task, mesh, rules and
restore target once; eval.py passes them down, with its flags, as a
`tasks.EvalRequest`. `load_params` restores the checkpoints a flag names (one,
the last N averaged, the best by validation BLEU). What is evaluated, and how,
is the task's (`Task.evaluator`: BLEU of translations, perplexity of a
language model); what both share is here: `write` puts a task's `Evaluation` in
WORKDIR/eval/, and `watch` evaluates each new checkpoint of a run as training
writes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.sharding import Mesh

from transformer import (
  best_checkpoints,
  checkpoint_spec,
  checkpoints,
  metrics,
  optim,
  outputs,
  provenance,
  ranking,
  runs,
  sharding,
  shutdown,
  storage,
  tasks,
  train_steps,
  workdir_lock,
)
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput, MissingInput


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config that train.py wrote to WORKDIR/config.json, fitted to this machine.

  Keys added to the project after the run was written get the values that run
  had (`runs.upgrade`); then every value is checked (`config.validate`). A
  mesh that needs other devices than this machine has (say, a run trained on 8
  GPUs, evaluated on 1) becomes data-parallel over the devices here: restore
  reshards the checkpoint onto it.
  """
  config = runs.read_run_config(workdir)
  if config is None:
    path = storage.join(os.path.expanduser(workdir), 'config.json')
    raise MissingInput(
      f'No resolved config at {path}: --workdir must be a directory written by train.py.'
    )
  config_lib.validate(config)
  _check_vocabulary(config, workdir)
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except ValueError as e:
    logging.info(
      '%s Evaluating data-parallel over the %d devices here instead.', e, jax.device_count()
    )
    config.mesh.update(data=-1, fsdp=1, tensor=1)
  return config


def read_dry_run_configs(path: str) -> dict[str, ml_collections.ConfigDict]:
  """{name: config} of `eval.py --dry_run_configs` (`sweep_runner.check_eval_flags`), validated."""
  try:
    loaded = json.loads(storage.read_text(path))
    if not isinstance(loaded, dict) or not all(isinstance(c, dict) for c in loaded.values()):
      raise InvalidInput('not a JSON object of configs')
    configs = {name: runs.upgrade(ml_collections.ConfigDict(c)) for name, c in loaded.items()}
  except (ValueError, KeyError, TypeError) as e:
    raise InvalidInput(
      f'--dry_run_configs={path} is not a JSON object {{name: config}} of the configs to '
      f'check the flags against ({type(e).__name__}: {e}).'
    ) from None
  for name, config in configs.items():
    errors = config_lib.config_errors(config)
    if errors:
      config_lib.raise_if(errors, f'config {name} of --dry_run_configs={path}')
  return configs


def _check_vocabulary(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses a vocabulary that is not the one the run trained with: another content, or no
  file (evaluation never trains one: a new vocabulary gives every id another piece)."""
  recorded = provenance.recorded_inputs(workdir)
  current = {'vocabulary': provenance.vocabulary_input(config)}
  if target := provenance.target_vocabulary_input(config):
    current['target_vocabulary'] = target
  known = {key: recorded[key] for key in ('vocabulary', 'target_vocabulary') if key in recorded}
  if not known:
    return  # A run from before inputs were recorded.
  put_back = (
    'Put the original vocabulary back at that path (or point config.data.vocab_path, or '
    'config.data.target_vocab_path for the target side, in its config.json at a copy of it).'
  )
  for key, entry in known.items():
    now = current.get(key)
    if entry.get('hash') and now and now['hash'] is None:
      raise MissingInput(
        f'The run in {workdir} trained with the vocabulary {entry["path"]} (sha256 '
        f'{entry["hash"][:16]}, recorded in {workdir}/{provenance.FILENAME}), and its config '
        f'names {now["path"]}, which does not exist. Evaluation never trains a vocabulary: '
        f'a new one would give every id another piece. {put_back}'
      )
  changes = provenance.input_changes(known, current)
  if changes:
    raise InvalidInput(
      f'The run in {workdir} trained with another vocabulary than the one its config names '
      f'now (recorded in {workdir}/{provenance.FILENAME} -> now):\n  {changes[0]}\nIts '
      f'checkpoints would translate into other pieces. {put_back}'
    )


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a run's config becomes for evaluation, built once (`setup`) and passed down."""

  config: ml_collections.ConfigDict
  model_config: ModelConfig
  task: tasks.Task
  mesh: Mesh  # The config's mesh over every device.
  rules: sharding.Rules  # Its logical axis rules.
  abstract_state: Any  # Shapes and shardings of the train state (the restore target).


def setup(config: ml_collections.ConfigDict) -> Setup:
  """The model config, task, mesh, rules and restore target of `config` (nothing allocated)."""
  model_config = ModelConfig.from_config(config)
  task = tasks.get_task(config.model.architecture)
  mesh, rules = sharding.create_mesh(config.mesh), sharding.axis_rules(config.mesh)
  model, _ = train_steps.create_models(model_config)
  abstract_state, _ = train_steps.abstract_state_and_shardings(
    model, optim.create_optimizer(optim.OptimizerConfig.from_config(config)), task, mesh, rules
  )
  return Setup(config, model_config, task, mesh, rules, abstract_state)


def restore_params(run: Setup, workdir: str, checkpoint: str):
  """(params, label) of `checkpoint` ('latest', a step, 'avg:N[@STEP]', 'best', 'avg_best:N')."""
  decays_to_end = run.config.schedule in config_lib.DECAYING_TO_LAST_STEP
  if checkpoint_spec.parse(checkpoint).averages_up_to is not None and decays_to_end:
    logging.warning(
      'checkpoint=%r reads checkpoints before the end of a run whose learning rate '
      'decays to config.num_train_steps=%d (config.schedule=%r): they are not what a run of '
      'that many steps would have saved.',
      checkpoint,
      run.config.num_train_steps,
      run.config.schedule,
    )
  return load_params(
    workdir,
    run.abstract_state,
    checkpoint,
    keep=run.config.keep_checkpoints,
    best_metric=ranking.selection_metric(run.config.target_metric),
  )


# --- Which checkpoints: one, the last N averaged, the best by validation BLEU --------------------


# Times `load_params` selects and reads the checkpoints anew after the run rotated one out under
# it (each time a new listing: the checkpoints there now).
ROTATION_RETRIES = 3


def load_params(
  workdir: str,
  abstract_state,
  checkpoint: str = 'latest',
  keep: int | None = None,
  best_metric: str = 'eval_bleu',
):
  """Parameters of one checkpoint, or the average of several (`avg:N`, section 6.1).

  `checkpoint`: 'latest', a step, 'avg:N' (the last N), 'avg:N@STEP' (the last N up to
  STEP), 'best' (the best validation BLEU of `BestCheckpoints`) or 'avg_best:N' (the N best
  averaged).
  `keep`: the checkpoints the training run keeps (`config.keep_checkpoints`). If the run
  rotates out a checkpoint while it is read, 'latest' and 'avg:N' are selected again
  among the checkpoints now there, up to `ROTATION_RETRIES` times; then, or for a step
  number, `checkpoints.CheckpointGoneError`.
  `best_metric`: the BLEU that ranks the best checkpoints
  (`ranking.selection_metric(config.target_metric)`).
  Returns the parameters and a label naming them (`step_1500`, `avg5_1100-1500`,
  `best_step_1200`, `avg_best3_900-1200-1500`).
  """
  spec = checkpoint_spec.parse(checkpoint)
  if spec.is_best:
    return _load_best_params(workdir, abstract_state, checkpoint, best_metric)
  moves = spec.moves  # 'latest' and 'avg:N' move with the run; a step and 'avg:N@STEP' do not.
  checkpointer = checkpoints.Checkpointer(workdir, read_only=True, keep=keep)
  try:
    for attempt in range(ROTATION_RETRIES + 1):
      if attempt:
        checkpointer.reload()  # Listed anew, also if the run removes one meanwhile.
      steps = checkpoint_spec.select_steps(checkpointer.all_steps(), checkpoint)
      try:
        total = None
        for step in steps:
          params = checkpointer.restore_params(step, abstract_state)
          total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
        break
      except checkpoints.CheckpointGoneError as e:
        if not moves:
          raise
        if attempt == ROTATION_RETRIES:
          raise checkpoints.CheckpointGoneError(
            f'--checkpoint={checkpoint!r}: the training run removed a checkpoint while it was '
            f'read, {attempt + 1} times in a row: it rotates its checkpoints (it keeps the '
            f'last {keep}, config.keep_checkpoints) faster than they are read here. Evaluate '
            'once it has ended, or checkpoints less often (config.checkpoint_every_steps). '
            f'The last time: {e}'
          ) from None
        logging.info('%s Selecting --checkpoint=%s among them again.', e, checkpoint)
  finally:
    checkpointer.close()
  params = jax.tree.map(lambda x: x / len(steps), total) if len(steps) > 1 else total
  return params, checkpoint_spec.last_checkpoints_label(steps)


def _load_best_params(workdir: str, abstract_state, checkpoint: str, metric: str):
  best = best_checkpoints.BestCheckpoints(workdir, metric=metric, read_only=True)
  try:
    steps = checkpoint_spec.select_best_steps(best.scores(), checkpoint)
    total = None
    for step in steps:
      params = best.restore(step, abstract_state.params)
      total = params if total is None else jax.tree.map(lambda a, b: a + b, total, params)
  finally:
    best.close()
  if len(steps) > 1:
    total = jax.tree.map(lambda x: x / len(steps), total)
  return total, checkpoint_spec.best_checkpoints_label(steps)


def available_steps(workdir: str) -> list[int]:
  """Steps of the committed checkpoints in `workdir` ([] if there are none yet)."""
  try:
    checkpointer = checkpoints.Checkpointer(workdir, read_only=True)
  except FileNotFoundError:
    return []
  try:
    return sorted(checkpointer.all_steps())
  finally:
    checkpointer.close()


_UTF8_BOM = b'\xef\xbb\xbf'
_UTF16_BOMS = (b'\xff\xfe', b'\xfe\xff')  # Little-, big-endian (UTF-32 LE starts the same).


_UTF8_BOM = b'\xef\xbb\xbf'
_UTF16_BOMS = (b'\xff\xfe', b'\xfe\xff')  # Little- and big-endian (UTF-32 LE starts so too).


def read_input_lines(path: str) -> list[str]:
  """Lines of a UTF-8 file ('-' for stdin), or an error naming the file and the line.

  A line ends at `\\r\\n`, `\\n` or a lone `\\r` (old Mac files), whichever the file uses,
  mixed or not (Python's universal newlines: `a\\r\\r\\n` is a line and an empty one); a last
  line without an end is a line. No other character ends a line (`str.splitlines` would also
  split at \\x0b, \\x0c, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029, which may sit inside a
  sentence), so that each line's translation is one output line, aligned with its input line.
  A UTF-8 byte order mark is dropped. Text in another encoding is refused, never translated
  as what it decodes to: invalid UTF-8 (Latin-1, say) by line, UTF-16 by its byte order mark,
  and a NUL byte (UTF-16 without one, binary data) by line.
  """
  name = f'--input_file={path}' + (' (standard input)' if path == '-' else '')
  try:
    raw = sys.stdin.buffer.read() if path == '-' else storage.read_bytes(path)
  except IsADirectoryError:
    raise InvalidInput(f'{name} is a directory: name the text file to translate.') from None
  except FileNotFoundError:
    raise InvalidInput(f'{name}: no such file. Name the text file to translate.') from None
  except PermissionError:
    raise InvalidInput(f'{name} cannot be read (permission denied).') from None

  def convert(encoding: str) -> str:
    source = '' if path == '-' else f' < {path} > {path}.utf8'
    return f'eval.py reads UTF-8: convert it (iconv -f {encoding} -t UTF-8{source})'

  if raw.startswith(_UTF16_BOMS):
    raise InvalidInput(
      f'{name} starts with a UTF-16 byte order mark: it is UTF-16 text; {convert("UTF-16")}.'
    )
  # \r and \n never occur inside a UTF-8 multi-byte character: splitting the bytes is safe.
  lines = raw.removeprefix(_UTF8_BOM).replace(b'\r\n', b'\n').replace(b'\r', b'\n').split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()
  decoded = []
  for number, line in enumerate(lines, start=1):
    nul = line.find(b'\0')
    if nul >= 0:
      raise InvalidInput(
        f'{name}: line {number} holds a NUL byte (byte {nul + 1} of the line), which no text '
        f'holds: UTF-16 text without a byte order mark, or not text; {convert("UTF-16LE")}.'
      )
    try:
      decoded.append(line.decode('utf-8'))
    except UnicodeDecodeError as e:
      raise InvalidInput(
        f'{name}: line {number} is not valid UTF-8 ({e.reason} at byte {e.start + 1} of the '
        f'line); {convert("ENCODING")}, with ENCODING the one it was written in, e.g. LATIN1.'
      ) from None
  return decoded


def write(workdir: str, label: str, split: str, evaluation: tasks.Evaluation) -> str:
  """Writes `evaluation` to WORKDIR/eval/; returns the path of its .json.

  `<label>-<split>[-<tag>].json` holds the results and `.txt` beside it the
  output lines, if any (the tag keeps, say, a greedy evaluation from
  overwriting the beam-search one of the same checkpoint). With references,
  `references-<split>.txt` (`references_path`) holds them: with them a result
  file is self-contained, for `compare.py` and sacreBLEU's own command line
  (`sacrebleu REFERENCES -i A.txt B.txt --paired-bs`).
  """
  out_dir = storage.join(workdir, 'eval')
  storage.makedirs(out_dir)
  tag = f'-{evaluation.tag}' if evaluation.tag else ''
  stem = storage.join(out_dir, f'{label}-{split}{tag}')
  files = [(stem + '.json', json.dumps(evaluation.results, indent=2, sort_keys=True))]
  if evaluation.lines is not None:
    files.insert(0, (stem + '.txt', ''.join(line + '\n' for line in evaluation.lines)))
  if evaluation.references is not None:
    references = ''.join(line + '\n' for line in evaluation.references)
    files.append((references_path(workdir, split), references))
  outputs.write_files(files, '--workdir')
  return stem + '.json'


def references_path(workdir: str, split: str) -> str:
  """WORKDIR/eval/references-<split>.txt: the references eval.py scored `split` against."""
  return storage.join(workdir, 'eval', f'references-{split}.txt')


def watch(
  run: Setup,
  workdir: str,
  request: tasks.EvalRequest,
  *,
  poll_seconds: float = 30.0,
  timeout_seconds: float | None = None,
) -> list[int]:
  """Evaluates each new checkpoint as it appears, until the run's final step is done.

  A side-car next to a training job: each checkpoint's `Evaluation` goes to
  WORKDIR/eval/ (`write`), its metrics (`{split}_bleu`, ...) to
  WORKDIR/eval/metrics.jsonl and TensorBoard. It never takes the workdir's
  lock; it reads it (`workdir_lock`) to know whether the run is still
  training, logs what it waits for, and stops with a warning once the run is
  no longer running and every checkpoint it left has been evaluated (no new one
  can come). It holds WORKDIR/eval/watch.lock (`workdir_lock.WatchLock`) from
  before its first compile to its end: a second watcher of the run is refused.

  Args:
    run: The run's set-up (`setup`), its task and restore target.
    workdir: The training run's workdir.
    request: What to evaluate on each checkpoint (split, decoding, ...).
    poll_seconds: Seconds between looks for a new checkpoint.
    timeout_seconds: Stop after this long (None: only when the run is done).

  Returns:
    The steps evaluated, in order.

  Raises:
    workdir_lock.WorkdirLockedError: Another watcher follows the run.
  """
  # From an interruption (SIGTERM, Ctrl-C) or the watch's end, the process has
  # `shutdown.deadline_seconds()` to end: a metrics write or lock release that storage holds is
  # named and the process exits (`shutdown.EXIT_CODE`) instead of hanging.
  with (
    shutdown.Deadline(
      os.path.basename(sys.argv[0]) or 'eval.py',
      advice=f'The steps evaluated so far are in {storage.join(workdir, "eval")}.',
    ),
    workdir_lock.WatchLock(workdir),
  ):
    try:
      return _watch(run, workdir, request, poll_seconds, timeout_seconds)
    finally:
      shutdown.arm(shutdown.ending(sys.exc_info()[1], 'the end of the watch'))


def _watch(
  run: Setup,
  workdir: str,
  request: tasks.EvalRequest,
  poll_seconds: float,
  timeout_seconds: float | None,
) -> list[int]:
  """`watch`, holding its lock."""
  config = request.config
  evaluate = run.task.evaluator(request)  # Compiled once, for every checkpoint.
  writer = metrics.MetricsWriter(storage.join(workdir, 'eval'))
  evaluated: list[int] = []
  rotated_out: set[int] = set()  # Removed by the run's rotation before they could be read.
  started = time.monotonic()
  waiting_for = None
  try:
    while True:
      # The lock first: a run that ends after this look left its last checkpoint in the listing.
      holder = workdir_lock.read_holder(workdir)
      steps = available_steps(workdir)
      for step in sorted(set(steps) - set(evaluated) - rotated_out):
        try:
          params, label = load_params(
            workdir, run.abstract_state, str(step), keep=config.keep_checkpoints
          )
        except checkpoints.CheckpointGoneError as e:
          logging.info('Skipping step %d: %s', step, e)
          rotated_out.add(step)
          continue
        evaluation = evaluate(params, label)
        write(workdir, label, request.split, evaluation)
        writer.write(step, evaluation.metrics)
        writer.flush()
        logging.info('step %d: %s', step, evaluation.summary.splitlines()[0])
        evaluated.append(step)
      if evaluated and max(evaluated) >= config.num_train_steps:
        return evaluated
      last = f'step {max(steps)}' if steps else 'none yet'
      alive = None if holder is None else workdir_lock.holder_alive(holder)
      if holder is None or alive is False:
        why = (
          f'no {workdir_lock.LOCK_FILE} in it'
          if holder is None
          else f'{workdir_lock.describe(holder)} is dead'
        )
        logging.warning(
          'Stopped watching: the training run of %s is no longer running (%s), so no new '
          'checkpoint can come; its last checkpoint (%s) is evaluated, short of the final step '
          '%d. Run the same train.py command to resume it, then eval.py --watch again.',
          workdir,
          why,
          last,
          config.num_train_steps,
        )
        return evaluated
      message = (
        f'Waiting for a checkpoint after {last} (the run ends at step '
        f'{config.num_train_steps}; it is trained by {workdir_lock.describe(holder)}'
        + ('' if alive else ', on another host: not checked')
        + f'); looking every {poll_seconds:g} s.'
      )
      if message != waiting_for:
        logging.info('%s', message)
        waiting_for = message
      if timeout_seconds is not None and time.monotonic() - started > timeout_seconds:
        logging.warning('Stopped watching after %.0f s.', timeout_seconds)
        return evaluated
      time.sleep(poll_seconds)
  finally:
    shutdown.arm(shutdown.ending(sys.exc_info()[1], 'the end of the watch'))
    with shutdown.part(f'writing the last rows of {writer.path} and TensorBoard'):
      writer.close()
