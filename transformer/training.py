"""Training: sharded state set-up, jitted train and eval steps, and the loop that runs them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from transformer import (
  checkpoints,
  distributed,
  divergence,
  input_pipeline,
  losses,
  metrics,
  optim,
  path_checks,
  preemption,
  provenance,
  runs,
  sharding,
  storage,
  tasks,
  tokenizer,
)
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.model import Transformer

Batch = dict[str, jax.Array]
# Training batches are placed on the devices this many steps before the step that uses them.
PREFETCH_BATCHES = 2


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


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data position."""

  step: jax.Array
  params: Any
  opt_state: Any
  dropout_key: jax.Array  # Raw key data (uint32), so that checkpoints hold plain arrays.


def create_models(model_config: ModelConfig) -> tuple[Transformer, Transformer]:
  """The training model (dropout on) and the evaluation model (deterministic)."""
  return Transformer(model_config), Transformer(model_config.replace(deterministic=True))


def _init_state(key: jax.Array, *, model: Transformer, optimizer, task: tasks.Task) -> TrainState:
  """Initial state with logically-annotated (boxed) parameters."""
  params_key, dropout_key = jax.random.split(key)
  dummy_batch = {k: jnp.ones((1, model.config.max_len), jnp.int32) for k in task.batch_keys}
  params = model.init(params_key, **task.model_inputs(dummy_batch))['params']
  return TrainState(
    step=jnp.array(0, jnp.int32),
    params=params,
    opt_state=optimizer.init(params),
    dropout_key=jax.random.key_data(dropout_key),
  )


def abstract_state_and_shardings(
  model: Transformer, optimizer, task: tasks.Task, mesh: Mesh, rules: sharding.Rules
):
  """Shapes of the state (nothing allocated) and the NamedSharding of every array.

  Parameters and Adam's moments get the shardings of their logical axis names
  under `rules` (`config.mesh.rules`); a dimension that does not divide over
  its mesh axes is an error naming the array.
  """
  init = functools.partial(_init_state, model=model, optimizer=optimizer, task=task)
  boxed = jax.eval_shape(init, jax.random.key(0))
  state_shardings = sharding.logical_shardings(nn.get_partition_spec(boxed), mesh, rules)
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    nn.meta.unbox(boxed),
    state_shardings,
  )
  sharding.check_divisible(abstract, mesh)
  return abstract, state_shardings


def create_train_state(
  model: Transformer, optimizer, task: tasks.Task, state_shardings, mesh: Mesh, key: jax.Array
) -> TrainState:
  """Initialises every array directly into its sharding (never whole on one device).

  `state_shardings` come from `abstract_state_and_shardings`.
  """
  init = functools.partial(_init_state, model=model, optimizer=optimizer, task=task)
  init_unboxed = lambda k: nn.meta.unbox(init(jax.random.wrap_key_data(k)))
  # The key goes in as raw data replicated on the mesh, so every process passes the same value.
  key_data = sharding.from_host(jax.random.key_data(key), sharding.replicated(mesh))
  return jax.jit(init_unboxed, out_shardings=state_shardings)(key_data)


def train_step(
  state: TrainState,
  batch: Batch,
  *,
  model: Transformer,
  optimizer,
  task: tasks.Task,
  config: ml_collections.ConfigDict,
):
  """One optimizer update on the global batch, accumulated over `grad_accum_steps` slices.

  The loss is the mean over all real target tokens of the whole batch, so the
  update does not depend on how the batch is split into micro-batches. A step
  with a non-finite loss or gradient norm counts in `nonfinite_steps`; under
  `config.skip_nonfinite_steps` it leaves params and optimizer state as they were
  and adds nothing to the other metrics.
  """
  accum = config.grad_accum_steps
  step_key = jax.random.fold_in(jax.random.wrap_key_data(state.dropout_key), state.step)
  micro_batches = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

  def summed_loss(params, micro_batch, key):
    logits = model.apply(
      {'params': params}, **task.model_inputs(micro_batch), rngs={'dropout': key}
    )
    _, sums = losses.loss_and_metrics(logits, micro_batch['tgt_tokens'], config.label_smoothing)
    return sums['loss_sum'], sums

  grad_fn = jax.grad(summed_loss, has_aux=True)

  def accumulate(carry, inputs):
    index, micro_batch = inputs
    grads, sums = grad_fn(state.params, micro_batch, jax.random.fold_in(step_key, index))
    return jax.tree.map(jnp.add, carry, (grads, sums)), None

  zero_sums = {
    k: jnp.zeros((), jnp.float32) for k in ('loss_sum', 'nll_sum', 'correct_sum', 'num_tokens')
  }
  init = (jax.tree.map(jnp.zeros_like, state.params), zero_sums)
  (grads, sums), _ = jax.lax.scan(accumulate, init, (jnp.arange(accum), micro_batches))
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums['num_tokens'], 1.0), grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  sums['grad_norm_sum'] = optax.tree.norm(grads)
  finite = divergence.finite_step(sums['loss_sum'], sums['grad_norm_sum'])
  if config.skip_nonfinite_steps:
    params, opt_state = divergence.keep_if_finite(
      finite, (params, opt_state), (state.params, state.opt_state)
    )
    sums = divergence.keep_if_finite(finite, sums, jax.tree.map(jnp.zeros_like, sums))
  sums[divergence.NONFINITE_KEY] = 1.0 - finite.astype(jnp.float32)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums


def eval_step(
  params, batch: Batch, *, model: Transformer, task: tasks.Task, config: ml_collections.ConfigDict
) -> dict[str, jax.Array]:
  """Summed loss metrics of a batch (`losses.loss_and_metrics`)."""
  logits = model.apply({'params': params}, **task.model_inputs(batch))
  _, sums = losses.loss_and_metrics(logits, batch['tgt_tokens'], config.label_smoothing)
  return sums


def jit_train_step(
  config: ml_collections.ConfigDict,
  *,
  model: Transformer,
  optimizer,
  task: tasks.Task,
  state_shardings,
  mesh: Mesh,
  rules: sharding.Rules,
):
  """`train_step` jitted as a run uses it: (state, batch) -> (state, metrics).

  The state keeps its shardings and is donated (updated in place); the batch is split over
  the mesh's batch axes; the metrics come back replicated.
  """
  batch_sharding = sharding.batch_sharding(mesh, rules)
  return jax.jit(
    functools.partial(train_step, model=model, optimizer=optimizer, task=task, config=config),
    in_shardings=(state_shardings, {k: batch_sharding for k in task.batch_keys}),
    out_shardings=(state_shardings, sharding.replicated(mesh)),
    donate_argnums=(0,),
  )


def jit_eval_step(
  config: ml_collections.ConfigDict,
  *,
  eval_model: Transformer,
  task: tasks.Task,
  state_shardings,
  mesh: Mesh,
  rules: sharding.Rules,
):
  """`eval_step` jitted as a run uses it: (params, batch) -> replicated loss sums."""
  batch_sharding = sharding.batch_sharding(mesh, rules)
  return jax.jit(
    functools.partial(eval_step, model=eval_model, task=task, config=config),
    in_shardings=(state_shardings.params, {k: batch_sharding for k in task.batch_keys}),
    out_shardings=sharding.replicated(mesh),
  )


def evaluate(eval_fn, params, batches: Iterable[dict[str, np.ndarray]], mesh: Mesh, rules):
  """Summed metrics over a whole split (every example counted once, on every process)."""
  total = None
  for batch in batches:
    sums = distributed.ordered(eval_fn(params, sharding.global_batch(batch, mesh, rules)))
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  if total is None:
    raise InvalidInput('The evaluation split is empty.')
  return jax.device_get(total)


def _last_good_checkpoint(checkpointer: checkpoints.Checkpointer) -> str | None:
  """Describes the newest committed checkpoint, after letting a save in flight commit."""
  checkpointer.wait_until_finished()
  step = checkpointer.latest_step()
  return None if step is None else f'step {step} ({checkpointer.directory}/{step})'


def _prepare_data(config: ml_collections.ConfigDict) -> tokenizer.Tokenizer:
  """Prepares the data and vocabulary once, then loads the vocabulary on every process.

  Process 0 goes first, so that processes sharing a filesystem never write the
  same files at once; the others then find them ready (or, on hosts with their
  own disks, prepare their own copy).
  """
  if jax.process_count() == 1:
    return tokenizer.get_tokenizer(config)
  vocab = tokenizer.get_tokenizer(config) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('data prepared')
  return vocab or tokenizer.get_tokenizer(config)


def train_and_evaluate(
  config: ml_collections.ConfigDict,
  workdir: str,
  devices=None,
  *,
  restore_fallback: bool = False,
  profile_steps: int = 0,
  hooks: Hooks = Hooks(),
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

  Returns:
    The metrics of the last evaluation (loss, perplexity, accuracy, BLEU, ...).
  """
  started = time.time()  # The run's clock (metrics.jsonl's wall_seconds).
  if profile_steps < 0:
    raise InvalidInput(f'profile_steps={profile_steps} must be >= 0.')
  devices = jax.devices() if devices is None else devices
  config_lib.validate(config, len(devices))
  config_lib.raise_if(path_checks.workdir_errors(config, workdir), 'paths')
  config_lib.raise_if(config_lib.platform_errors(config, devices[0].platform))
  workdir = storage.resolve(workdir)
  with (
    runs.owned_workdir(workdir),
    preemption.PreemptionWatcher() as watcher,
    contextlib.ExitStack() as cleanup,
  ):
    return _train_and_evaluate(
      config, workdir, devices, watcher, cleanup, restore_fallback, profile_steps, hooks, started
    )


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
) -> dict[str, float]:
  runs.check_resume(config, workdir)  # Before anything else: a changed model is refused.
  # The config becomes the model config, mesh, rules and task once; they are passed down.
  model_config = ModelConfig.from_config(config)
  mesh = sharding.create_mesh(config.mesh, devices)
  rules = sharding.axis_rules(config.mesh)
  task = tasks.get_task(config)
  model, eval_model = create_models(model_config)
  optimizer = optim.create_optimizer(config)
  learning_rate = optim.learning_rate_schedule(config)  # The optimizer's, for the log.
  abstract_state, state_shardings = abstract_state_and_shardings(
    model, optimizer, task, mesh, rules
  )
  # Before any data preparation or compile: a foreign checkpoint is an error.
  checkpoints.check_latest_compatible(workdir, abstract_state)

  vocab = _prepare_data(config)
  # A vocabulary trained just now (none existed at `check_resume`) must be the recorded one too.
  run_inputs = runs.check_inputs(config, workdir, vocab.serialized_model())
  train_iter = input_pipeline.DevicePrefetch(
    task.train_iterator(
      config, vocab, shard_index=jax.process_index(), shard_count=jax.process_count()
    ),
    lambda batch: sharding.global_batch(batch, mesh, rules),
    PREFETCH_BATCHES,
  )
  # However the run ends: its worker processes (config.data.num_workers) stop, and the shared
  # memory of their batches is unlinked (`DevicePrefetch.close`).
  cleanup.callback(train_iter.close)
  # Every split is prepared and checked (e.g. that config.data.eval_split exists) before the
  # workdir changes.
  validation_metrics = task.validation_metrics_fn(config, eval_model.config, vocab, mesh, rules)
  eval_batches = task.eval_batches(
    config,
    vocab,
    config.data.eval_split,
    rows_multiple_of=sharding.batch_shards(dict(mesh.shape), rules),
    shard_index=jax.process_index(),
    shard_count=jax.process_count(),
  )

  # Created only now, after every check on the config and the data: it starts Orbax's background
  # threads and the checkpoints/ folder. Closed however the run ends, so that an error is the
  # last thing printed (not a traceback of threads shut down with the interpreter).
  checkpointer = checkpoints.Checkpointer(
    workdir, keep=config.keep_checkpoints, during_save=hooks.during_save
  )
  cleanup.callback(checkpointer.close)
  params_key, _ = jax.random.split(jax.random.key(config.seed))  # Named: params, (data).
  latest, state = checkpointer.restore_latest(abstract_state, train_iter, fallback=restore_fallback)
  if latest is None:
    state = create_train_state(model, optimizer, task, state_shardings, mesh, params_key)
  start_step = int(state.step)
  # A run that stopped early (its validation BLEU had not improved for `patience` evaluations)
  # stays stopped; a larger config.early_stopping_patience lets it go on.
  selection_metric = config_lib.selection_metric(config.target_metric)  # Best, early stopping.
  stopping = runs.EarlyStopping(config.early_stopping_patience, selection_metric).replay(
    storage.join(workdir, metrics.FILENAME), start_step
  )
  finished = start_step >= config.num_train_steps or stopping.stop
  final = runs.final_metrics(workdir, start_step) if finished else None
  if final is not None:
    logging.info(
      'Nothing to train: the checkpoint is at step %d, %s; nothing was changed. Its final '
      'metrics are in %s/metrics.jsonl.',
      start_step,
      'where the run stopped early' if stopping.stop else 'config.num_train_steps',
      workdir,
    )
    if jax.process_index() == 0 and runs.saved_config(workdir) is None:
      runs.write_config(config, workdir)  # One that was moved aside (`runs.read_run_config`).
    return final
  # Only once the checkpoint restored: an unreadable one leaves the workdir as it was.
  if jax.process_index() == 0:
    runs.write_config(config, workdir)
    # Command line, git commit, package versions (warns on changes), the inputs' content.
    provenance.record(workdir, run_inputs)

  writer = metrics.MetricsWriter(workdir, started=started)
  writer.truncate_after(start_step)
  best = None  # The parameters of the evaluations with the best validation BLEU.
  if config.keep_best_checkpoints:
    best = checkpoints.BestCheckpoints(
      workdir, metric=selection_metric, keep=config.keep_best_checkpoints
    )
    cleanup.callback(best.close)
    best.drop_after(start_step)
  shardings = dict(state_shardings=state_shardings, mesh=mesh, rules=rules)
  train_step_fn = jit_train_step(config, model=model, optimizer=optimizer, task=task, **shardings)
  eval_step_fn = jit_eval_step(config, eval_model=eval_model, task=task, **shardings)

  def run_eval(step: int) -> dict[str, float]:
    with sharding.activated(mesh, rules):
      sums = evaluate(eval_step_fn, state.params, eval_batches, mesh, rules)
    summary = losses.summarize(sums, 'eval')
    summary.update(validation_metrics(state.params))
    writer.write(step, summary)
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

  def track_best(step: int, evaluated: dict[str, float]) -> bool:
    """Keeps the parameters if their BLEU ranks among the best; True: stop early now."""
    if selection_metric not in evaluated:
      return False
    if best is not None:
      best.save(step, state.params, evaluated)
    stopping.record(step, evaluated[selection_metric])
    return stopping.stop

  last_step = start_step if stopping.stop else config.num_train_steps
  logging.info('Training from step %d to %d on mesh %s.', start_step, last_step, dict(mesh.shape))
  progress = metrics.Progress(start_step, config.num_train_steps)
  input_wait = metrics.InputWait(train_iter, config.data.num_workers)
  monitor = divergence.DivergenceMonitor(config.skip_nonfinite_steps)
  train_sums, summary = None, {}
  profiler = metrics.StepProfiler(storage.join(workdir, 'profile'), start_step + 2, profile_steps)
  watcher.arm()  # From here a signal stops the run after a step, with a checkpoint of it.
  for step in range(start_step + 1, last_step + 1):
    batch = next(train_iter)
    profiler.before(step)
    with sharding.activated(mesh, rules):
      state, sums = train_step_fn(state, batch)
    profiler.after(step, sums)
    train_sums = sums if train_sums is None else jax.tree.map(jnp.add, train_sums, sums)
    monitor.record(step, sums)

    is_last = step == config.num_train_steps
    preempted = watcher.reached(step)
    log_now = step % config.log_every_steps == 0 or is_last
    eval_now = step % config.eval_every_steps == 0 or is_last
    save_now = step % config.checkpoint_every_steps == 0 or is_last or preempted
    if log_now or eval_now or save_now:
      # Nothing is logged, evaluated or saved from a state that went non-finite.
      monitor.check(lambda: _last_good_checkpoint(checkpointer))

    if log_now:
      train_sums = jax.device_get(train_sums)
      skipped = int(train_sums[divergence.NONFINITE_KEY])
      steps_logged = step - progress.last_step
      summary = losses.summarize(train_sums, 'train')
      updated_steps = steps_logged - skipped
      summary['train_grad_norm'] = (
        float(train_sums['grad_norm_sum']) / updated_steps if updated_steps else float('nan')
      )
      if config.skip_nonfinite_steps:
        summary['train_skipped_steps'] = skipped
      steps_per_sec, tokens_per_sec, eta = progress.rates(step, float(train_sums['num_tokens']))
      summary.update(
        steps_per_sec=steps_per_sec,
        tokens_per_sec=tokens_per_sec,
        learning_rate=float(learning_rate(step - 1)),  # The rate update `step` used.
      )
      summary['input_wait_ms'] = input_wait.per_step_ms(steps_logged, steps_per_sec)
      writer.write(step, summary)
      logging.info(
        'step %d/%d | loss %.4f | %.2f steps/s | %.0f tok/s | %s left',
        step,
        config.num_train_steps,
        summary['train_loss'],
        steps_per_sec,
        tokens_per_sec,
        time.strftime('%H:%M:%S', time.gmtime(eta)),
      )
      train_sums = None

    stop_early = False
    if eval_now:
      evaluated = run_eval(step)
      summary.update(evaluated)
      stop_early = track_best(step, evaluated) and step < last_step  # At the end: just the end.
    if save_now or stop_early:
      checkpointer.save(step, state, train_iter, force=True)
    if preempted:
      checkpointer.wait_until_finished()
      logging.info(
        'Stopped by %s after step %d; checkpoint %s/%d is committed. Run the same '
        'command to resume.',
        watcher.signal_name,
        step,
        checkpointer.directory,
        step,
      )
      break
    if stop_early:
      checkpointer.wait_until_finished()
      logging.info(
        'Stopped early after step %d: validation BLEU (%s) has not improved on %.2f (step %d) '
        'for %d evaluations (config.early_stopping_patience); checkpoint %s/%d is committed.',
        step,
        selection_metric,
        stopping.best,
        stopping.best_step,
        stopping.since_best,
        checkpointer.directory,
        step,
      )
      break
    if hooks.after_step is not None:
      hooks.after_step(step, checkpointer.wait_until_finished)

  profiler.stop()  # A run that ended (or was preempted) within the traced steps.
  if start_step >= last_step:
    if stopping.stop:
      logging.info('Nothing to train: the run stopped early, at step %d.', start_step)
    else:  # Its final evaluation is missing from metrics.jsonl.
      logging.info('Nothing to train: the checkpoint is at step %d; evaluating it.', start_step)
    summary = run_eval(start_step)
  if best is not None:
    best.wait_until_finished()
  checkpointer.wait_until_finished()
  writer.close()
  return summary
