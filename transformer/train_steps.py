"""The sharded training state and the jitted steps that update it (train) and score it (eval).

`abstract_state_and_shardings` gives the state's shapes and shardings without
allocating it; `create_train_state` initialises it in place on the mesh;
`jit_train_step` and `jit_eval_step` jit `train_step` and `eval_step` as a run
uses them, and `evaluate` sums the eval step over a split. `training` runs them
in its loop; evaluation, the memory report and the benchmarks use them alone.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from transformer import config_fields, distributed, divergence, losses, sharding, tasks
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.model import Transformer

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepConfig(config_fields.Part):
  """The fields of a config that the jitted steps read besides the model and the optimizer."""

  label_smoothing: float  # Section 5.4's epsilon_ls, in the loss of both steps.
  grad_accum_steps: int  # Micro-batches per update.
  skip_nonfinite_steps: bool  # A non-finite step leaves the state as it was.


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
  config: StepConfig,
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
  params, batch: Batch, *, model: Transformer, task: tasks.Task, config: StepConfig
) -> dict[str, jax.Array]:
  """Summed loss metrics of a batch (`losses.loss_and_metrics`)."""
  logits = model.apply({'params': params}, **task.model_inputs(batch))
  _, sums = losses.loss_and_metrics(logits, batch['tgt_tokens'], config.label_smoothing)
  return sums


def jit_train_step(
  config: StepConfig,
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
  config: StepConfig,
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
