"""Training: a run set up (or resumed), the loop of its steps, evaluations and checkpoints.

`train_and_evaluate` checks the config and locks the workdir; `_train_and_evaluate`
then reads as the run's parts in order: `_set_up` (checks, data, the restored
checkpoint), `_open_outputs`, `_train` (the step loop: `_log_training`,
`_evaluate`, `_track_best`, `_log_stop`) and `_shut_down`. The state and the
jitted steps are `train_steps`'; its batches and validation `training_data`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from transformer import (
  best_checkpoints,
  checkpoints,
  config_fields,
  config_rules,
  divergence,
  initialization,
  input_pipeline,
  losses,
  metrics,
  optim,
  path_checks,
  preemption,
  provenance,
  ranking,
  runs,
  sharding,
  shutdown,
  storage,
  tasks,
  train_steps,
  training_data,
  wandb_run,
)
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput


@dataclasses.dataclass(frozen=True)
class Hooks:
  """Callbacks into a training run at exact points; tests install them (tests/fault_driver.py).

  Attributes:
    after_step: `after_step(step, wait_for_saves)` at the end of loop iteration
      `step` (the step done, its metrics written); `wait_for_saves()` lets every
      save started so far commit.
    during_save: `during_save(step)` inside the save of checkpoint `step`, in
      Orbax's background thread, once every file is written and before the
      save commits (`checkpoints.Checkpointer`).
  """

  after_step: Callable[[int, Callable[[], None]], None] | None = None
  during_save: Callable[[int], None] | None = None


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  devices=None,
  *,
  restore_fallback: bool = False,
  profile_steps: int = 0,
  hooks: Hooks = Hooks(),
  overridden: Collection[str] = (),
) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics.

  Every config value and the paths the run writes (`path_checks.workdir_errors`) are
  checked first, then the workdir is locked for this run (`runs.owned_workdir`;
  another run holding it is an error naming its host and pid). A resume that
  would read the checkpoints as something else (another model, fewer steps,
  other input files) is an error (`runs.check_resume`). Any error before training
  starts leaves the workdir as it was. On SIGTERM/SIGINT before the first step,
  `preemption.Interrupted` is raised at once (nothing to save); afterwards the
  current step is finished, checkpointed and committed, and this returns
  normally. A run already at `config.num_train_steps` changes nothing and returns
  the final metrics of its metrics.jsonl.

  Args:
    config: The training config (validated here).
    workdir: The run's folder: new, or a run to resume.
    devices: The devices laid out as `config.mesh` (default: every device of
      every process).
    restore_fallback: If the latest checkpoint fails to restore, use the newest
      one that does (it is moved aside); without it that is an error that
      changes nothing.
    profile_steps: > 0 traces that many train steps, from the second one this
      process runs, into WORKDIR/profile/ (TensorBoard's Profile tab).
    hooks: Called at their points of the run (`Hooks`; tests install them).
    overridden: The config keys set on the command line (a refusal of `config.init_from`
      says where each differing value came from).

  Returns:
    The metrics of the last evaluation (loss, perplexity, accuracy, BLEU, ...).
  """
  started = time.time()  # The run's clock (metrics.jsonl's wall_seconds).
  if profile_steps < 0:
    raise InvalidInput(f'profile_steps={profile_steps} must be >= 0.')
  devices = jax.devices() if devices is None else devices
  config_lib.validate(config, len(devices))
  config_lib.raise_if(config_lib.launch_errors(config, jax.process_count()))
  config_lib.raise_if(path_checks.workdir_errors(config, workdir), 'paths')
  config_lib.raise_if(config_rules.platform_errors(config, devices[0].platform))
  workdir = storage.resolve(workdir)
  # From a stop signal or the end of training, the process has `shutdown.deadline_seconds()` to
  # end: a commit, metrics flush or lock release that storage holds is named, and the process
  # exits (`shutdown.EXIT_CODE`) instead of hanging.
  with (
    shutdown.Deadline(
      os.path.basename(sys.argv[0]) or 'train.py',
      advice='Run the same command to resume from the last committed checkpoint.',
    ),
    runs.owned_workdir(workdir),
    preemption.PreemptionWatcher(on_stop=shutdown.arm) as watcher,
    contextlib.ExitStack() as cleanup,
  ):
    try:
      return _train_and_evaluate(
        config,
        workdir,
        devices,
        watcher,
        cleanup,
        restore_fallback,
        profile_steps,
        hooks,
        started,
        overridden,
      )
    finally:
      shutdown.arm(shutdown.ending(sys.exc_info()[1], 'the end of training'))


def _train_and_evaluate(
  config,
  workdir: str,
  devices,
  watcher: preemption.PreemptionWatcher,
  cleanup: contextlib.ExitStack,
  restore_fallback: bool,
  profile_steps: int,
  hooks: Hooks,
  started: float,
  overridden: Collection[str],
) -> dict[str, float]:
  """Set-up and resume; then, unless the run is finished, its outputs, the step loop, shut-down."""
  run = _set_up(config, workdir, devices, watcher, cleanup, restore_fallback, hooks, overridden)
  final = _final_metrics_if_done(run)
  if final is not None:
    return final
  _open_outputs(run, cleanup, started)
  shutdown.saved_by(run.checkpointer.saved)
  shutdown.saved_by(run.writer.saved)
  summary = _train(run, profile_steps)
  _shut_down(run)
  return summary


@dataclasses.dataclass(frozen=True)
class LoopConfig(config_fields.Part):
  """The fields of a config that the step loop reads: how long, and what it does on which steps."""

  num_train_steps: int
  log_every_steps: int
  eval_every_steps: int
  checkpoint_every_steps: int
  keep_best_checkpoints: int
  skip_nonfinite_steps: bool  # Counted and logged, not stopped on.
  num_workers: int = config_fields.from_key('data.num_workers')  # For the input-wait report.


@dataclasses.dataclass
class _Run:
  """What the parts of a run share: made by `_set_up`, its outputs added by `_open_outputs`."""

  config: ml_collections.ConfigDict  # Only written (config.json) and mirrored (W&B) whole.
  loop: LoopConfig
  workdir: str
  mesh: Mesh
  rules: sharding.Rules
  state: train_steps.TrainState  # Restored or new; then each step's.
  start_step: int  # The restored checkpoint's step (0: a new run).
  train_iter: input_pipeline.DevicePrefetch
  train_step_fn: Callable  # (state, batch) -> (state, sums): `train_steps.jit_train_step`.
  eval_step_fn: Callable  # (params, batch) -> sums: `train_steps.jit_eval_step`.
  eval_batches: Iterable[dict[str, np.ndarray]]  # The split of config.data.eval_split.
  validation_metrics: Callable[[Any], dict[str, float]]  # params -> the task's (BLEU).
  learning_rate: optax.Schedule  # The optimizer's, for the log.
  divergence_advice: str  # What to change in the config after a non-finite step.
  run_inputs: dict[str, Any]  # The inputs' content, for the provenance record.
  initialized: dict[str, Any] | None  # Where a new run's parameters came from (config.init_from).
  checkpointer: checkpoints.Checkpointer
  selection_metric: str  # Ranks the best checkpoints and stops early.
  stopping: runs.EarlyStopping  # Replayed from metrics.jsonl up to `start_step`.
  watcher: preemption.PreemptionWatcher
  hooks: Hooks
  writer: metrics.MetricsWriter = dataclasses.field(init=False)  # metrics.jsonl.
  # The parameters of the evaluations with the best validation BLEU (config.keep_best_checkpoints).
  best: best_checkpoints.BestCheckpoints | None = dataclasses.field(init=False)


def _set_up(
  config: ml_collections.ConfigDict,
  workdir: str,
  devices,
  watcher: preemption.PreemptionWatcher,
  cleanup: contextlib.ExitStack,
  restore_fallback: bool,
  hooks: Hooks,
  overridden: Collection[str],
) -> _Run:
  """Checks the config, the checkpoints and the data, then restores the latest checkpoint.

  Every check comes before the workdir changes: the checkpointer, created last,
  makes checkpoints/. Without a checkpoint the state is new: its parameters random, or with
  `config.init_from` that run's (`initialization`).
  """
  runs.check_resume(config, workdir)  # Before anything else: a changed model is refused.
  # A new run from another run's parameters, checked against this config; None for a resume.
  source = initialization.resolve(config, workdir, overridden)
  # The config becomes the model config, mesh, rules and task once; they are passed down.
  model_config = ModelConfig.from_config(config)
  optimizer_config = optim.OptimizerConfig.from_config(config)
  step_config = train_steps.StepConfig.from_config(config)
  mesh, rules = sharding.create_mesh(config.mesh, devices), sharding.axis_rules(config.mesh)
  task = tasks.get_task(model_config.architecture)
  model, eval_model = train_steps.create_models(model_config)
  optimizer = optim.create_optimizer(optimizer_config)
  abstract_state, state_shardings = train_steps.abstract_state_and_shardings(
    model, optimizer, task, mesh, rules
  )
  # Before any data preparation or compile: a foreign checkpoint is an error.
  checkpoints.check_latest_compatible(workdir, abstract_state)
  initialization.write_vocabulary(source, config)  # hf:DIR's, where vocab_path has none yet.
  train_iter, eval_batches, validation_metrics, run_inputs = training_data.load(
    config, workdir, task, eval_model, mesh, rules, cleanup
  )
  params = initialized = None
  if source is not None:  # Read before the workdir changes: an unreadable source leaves no trace.
    target = initialization.Target(model, task, mesh, rules, state_shardings.params)
    params, initialized = initialization.load(source, target)

  # Created only now, after every check on the config and the data: it starts Orbax's background
  # threads and the checkpoints/ folder. Closed however the run ends, so that an error is the
  # last thing printed (not a traceback of threads shut down with the interpreter).
  checkpointer = checkpoints.Checkpointer(
    workdir, keep=config.keep_checkpoints, during_save=hooks.during_save
  )
  cleanup.callback(checkpointer.close)
  latest, state = checkpointer.restore_latest(abstract_state, train_iter, fallback=restore_fallback)
  if latest is None:
    params_key, _ = jax.random.split(jax.random.key(config.seed))  # Named: params, (data).
    state = train_steps.create_train_state(
      model, optimizer, task, state_shardings, mesh, params_key
    )
    if params is not None:  # Fresh optimizer state, step 0 and data position; `source`'s params.
      state = state.replace(params=params)
  start_step = int(state.step)
  selection_metric = ranking.selection_metric(config.target_metric)  # Best, early stopping.
  shardings = dict(state_shardings=state_shardings, mesh=mesh, rules=rules)
  return _Run(
    config=config,
    loop=LoopConfig.from_config(config),
    workdir=workdir,
    mesh=mesh,
    rules=rules,
    state=state,
    start_step=start_step,
    train_iter=train_iter,
    train_step_fn=train_steps.jit_train_step(
      step_config, model=model, optimizer=optimizer, task=task, **shardings
    ),
    eval_step_fn=train_steps.jit_eval_step(
      step_config, eval_model=eval_model, task=task, **shardings
    ),
    eval_batches=eval_batches,
    validation_metrics=validation_metrics,
    learning_rate=optim.learning_rate_schedule(optimizer_config),
    divergence_advice=divergence.advice(optimizer_config),
    run_inputs=run_inputs,
    initialized=initialized,
    checkpointer=checkpointer,
    selection_metric=selection_metric,
    # A run that stopped early (its validation BLEU had not improved for `patience` evaluations)
    # stays stopped; a larger config.early_stopping_patience lets it go on.
    stopping=runs.EarlyStopping(config.early_stopping_patience, selection_metric).replay(
      storage.join(workdir, metrics.FILENAME), start_step
    ),
    watcher=watcher,
    hooks=hooks,
  )


def _final_metrics_if_done(run: _Run) -> dict[str, float] | None:
  """A finished run's final metrics from its metrics.jsonl; None for a run that trains.

  Finished: at config.num_train_steps, or stopped early. Nothing is changed, except
  that a config.json moved aside is written again.
  """
  start_step = run.start_step
  finished = start_step >= run.loop.num_train_steps or run.stopping.stop
  final = runs.final_metrics(run.workdir, start_step) if finished else None
  if final is not None:
    logging.info(
      'Nothing to train: the checkpoint is at step %d, %s; nothing was changed. Its final '
      'metrics are in %s/metrics.jsonl.',
      start_step,
      'where the run stopped early (config.early_stopping_patience; a larger one lets it go on)'
      if run.stopping.stop
      else 'config.num_train_steps',
      run.workdir,
    )
    if jax.process_index() == 0 and runs.saved_config(run.workdir) is None:
      # One that was moved aside (`runs.read_run_config`).
      runs.write_config(run.config, run.workdir)
  return final


def _open_outputs(run: _Run, cleanup: contextlib.ExitStack, started: float) -> None:
  """config.json and the provenance record, then metrics.jsonl and the best checkpoints.

  Only once the checkpoint restored: an unreadable one leaves the workdir as it
  was. What a run wrote after the restored step is dropped.
  """
  mirror = None  # The W&B run, on process 0 with config.wandb.project set.
  if jax.process_index() == 0:
    # Started first: W&B that cannot start leaves the workdir as it was.
    if mirror := wandb_run.WandbRun.start(run.config, run.workdir):
      cleanup.push(lambda failed, *_: mirror.finish(failed=failed is not None))
    runs.write_config(run.config, run.workdir)
    # Command line, git commit, package versions (warns on changes), the inputs' content and
    # where a new run's parameters came from.
    provenance.record(run.workdir, run.run_inputs, run.initialized)
  run.writer = metrics.MetricsWriter(run.workdir, started=started, mirror=mirror)
  run.writer.truncate_after(run.start_step)
  run.best = None
  if run.loop.keep_best_checkpoints:
    run.best = best_checkpoints.BestCheckpoints(
      run.workdir, metric=run.selection_metric, keep=run.loop.keep_best_checkpoints
    )
    cleanup.callback(run.best.close)
    run.best.drop_after(run.start_step)


def _train(run: _Run, profile_steps: int) -> dict[str, float]:
  """The step loop: train, then log, evaluate and save on their schedules; the last summary.

  Stops after the last step, after a step that a signal interrupted (its checkpoint
  committed), or early, when validation BLEU has stopped improving.
  """
  loop, start_step = run.loop, run.start_step
  last_step = start_step if run.stopping.stop else loop.num_train_steps
  logging.info(
    'Training from step %d to %d on mesh %s.', start_step, last_step, dict(run.mesh.shape)
  )
  progress = metrics.Progress(start_step, loop.num_train_steps)
  input_wait = metrics.InputWait(run.train_iter, loop.num_workers)
  monitor = divergence.DivergenceMonitor(loop.skip_nonfinite_steps, run.divergence_advice)
  train_sums, summary = None, {}
  profiler = metrics.StepProfiler(
    storage.join(run.workdir, 'profile'), start_step + 2, profile_steps
  )
  run.watcher.arm()  # From here a signal stops the run after a step, with a checkpoint of it.
  for step in range(start_step + 1, last_step + 1):
    batch = next(run.train_iter)
    profiler.before(step)
    with sharding.activated(run.mesh, run.rules):
      run.state, sums = run.train_step_fn(run.state, batch)
    profiler.after(step, sums)
    train_sums = sums if train_sums is None else jax.tree.map(jnp.add, train_sums, sums)
    monitor.record(step, sums)

    is_last = step == loop.num_train_steps
    preempted = run.watcher.reached(step)
    log_now = step % loop.log_every_steps == 0 or is_last
    eval_now = step % loop.eval_every_steps == 0 or is_last
    save_now = step % loop.checkpoint_every_steps == 0 or is_last or preempted
    if log_now or eval_now or save_now:
      # Nothing is logged, evaluated or saved from a state that went non-finite.
      monitor.check(lambda: _last_good_checkpoint(run.checkpointer))
    if log_now:
      summary = _log_training(run, step, jax.device_get(train_sums), progress, input_wait)
      train_sums = None
    stop_early = False
    if eval_now:
      evaluated = _evaluate(run, step)
      summary.update(evaluated)
      # At the last step a stop is just the end.
      stop_early = _track_best(run, step, evaluated) and step < last_step
    if save_now or stop_early:
      with shutdown.part(f'saving checkpoint {step} to {run.checkpointer.directory}'):
        run.checkpointer.save(step, run.state, run.train_iter, force=True)
    if preempted or stop_early:
      _log_stop(run, step, preempted)
      break
    if run.hooks.after_step is not None:
      run.hooks.after_step(step, run.checkpointer.wait_until_finished)

  profiler.stop()  # A run that ended (or was preempted) within the traced steps.
  if start_step >= last_step:
    if run.stopping.stop:
      logging.info(
        'Nothing to train: the run stopped early, at step %d (config.early_stopping_patience).',
        start_step,
      )
    else:  # Its final evaluation is missing from metrics.jsonl.
      logging.info('Nothing to train: the checkpoint is at step %d; evaluating it.', start_step)
    summary = _evaluate(run, start_step)
  return summary


def _last_good_checkpoint(checkpointer: checkpoints.Checkpointer) -> str | None:
  """Describes the newest committed checkpoint, after letting a save in flight commit."""
  checkpointer.wait_until_finished()
  step = checkpointer.latest_step()
  return None if step is None else f'step {step} ({checkpointer.directory}/{step})'


def _log_training(
  run: _Run,
  step: int,
  train_sums: dict[str, Any],
  progress: metrics.Progress,
  input_wait: metrics.InputWait,
) -> dict[str, float]:
  """Writes and logs the training metrics summed since the last log (`train_sums`, on host)."""
  skipped = int(train_sums[divergence.NONFINITE_KEY])
  steps_logged = step - progress.last_step
  summary = losses.summarize(train_sums, 'train')
  updated_steps = steps_logged - skipped
  summary['train_grad_norm'] = (
    float(train_sums['grad_norm_sum']) / updated_steps if updated_steps else float('nan')
  )
  if run.loop.skip_nonfinite_steps:
    summary['train_skipped_steps'] = skipped
  steps_per_sec, tokens_per_sec, eta = progress.rates(step, float(train_sums['num_tokens']))
  summary.update(
    steps_per_sec=steps_per_sec,
    tokens_per_sec=tokens_per_sec,
    learning_rate=float(run.learning_rate(step - 1)),  # The rate update `step` used.
  )
  summary['input_wait_ms'] = input_wait.per_step_ms(steps_logged, steps_per_sec)
  run.writer.write(step, summary)
  logging.info(
    'step %d/%d | loss %.4f | %.2f steps/s | %.0f tok/s | %s left',
    step,
    run.loop.num_train_steps,
    summary['train_loss'],
    steps_per_sec,
    tokens_per_sec,
    time.strftime('%H:%M:%S', time.gmtime(eta)),
  )
  return summary


def _evaluate(run: _Run, step: int) -> dict[str, float]:
  """Validation loss and the task's metrics (BLEU) of the current parameters, written and logged."""
  with sharding.activated(run.mesh, run.rules):
    sums = train_steps.evaluate(
      run.eval_step_fn, run.state.params, run.eval_batches, run.mesh, run.rules
    )
  summary = losses.summarize(sums, 'eval')
  summary.update(run.validation_metrics(run.state.params))
  run.writer.write(step, summary)
  logging.info(
    'step %d | eval loss %.4f | perplexity %.2f | accuracy %.4f | BLEU %s',
    step,
    summary['eval_loss'],
    summary['eval_perplexity'],
    summary['eval_accuracy'],
    f'{summary["eval_bleu"]:.2f} (lowercased {summary["eval_bleu_lc"]:.2f})'
    if 'eval_bleu' in summary
    else '-',
  )
  return summary


def _track_best(run: _Run, step: int, evaluated: dict[str, float]) -> bool:
  """Keeps the parameters if their BLEU ranks among the best; True: stop early now."""
  if run.selection_metric not in evaluated:
    return False
  if run.best is not None:
    run.best.save(step, run.state.params, evaluated)
  run.stopping.record(step, evaluated[run.selection_metric])
  return run.stopping.stop


def _log_stop(run: _Run, step: int, preempted: bool) -> None:
  """Once the checkpoint of `step` is committed, says why the run stops there and how to go on."""
  with shutdown.part(f'committing checkpoint {step} ({run.checkpointer.directory}/{step})'):
    run.checkpointer.wait_until_finished()
  if preempted:
    logging.info(
      'Stopped by %s after step %d; checkpoint %s/%d is committed. Run the same command to resume.',
      run.watcher.signal_name,
      step,
      run.checkpointer.directory,
      step,
    )
  else:
    logging.info(
      'Stopped early after step %d: validation BLEU (%s) has not improved on %.2f (step %d) '
      'for %d evaluations (config.early_stopping_patience); checkpoint %s/%d is committed.',
      step,
      run.selection_metric,
      run.stopping.best,
      run.stopping.best_step,
      run.stopping.since_best,
      run.checkpointer.directory,
      step,
    )


def _shut_down(run: _Run) -> None:
  """Lets every save commit (best checkpoints, then checkpoints) and closes metrics.jsonl.

  From here the process has `shutdown.deadline_seconds()` to end (a signal may have started
  that clock already).
  """
  shutdown.arm('the end of training')
  if run.best is not None:
    with shutdown.part(f'committing the best checkpoints ({run.best.directory})'):
      run.best.wait_until_finished()
  with shutdown.part(f'committing the last checkpoint ({run.checkpointer.directory})'):
    run.checkpointer.wait_until_finished()
  with shutdown.part(f'writing the last rows of {run.writer.path} and TensorBoard'):
    run.writer.close()
