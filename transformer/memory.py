"""Per-device memory of the train step, from shapes alone: what `train.py --dry_run` reports.

  parameters   float32, split over the mesh by `config.mesh.rules` (fsdp: `embed`;
               tensor: heads, d_ff, vocabulary)
  optimizer    Adam's two moments and its step count, split like the parameters
  gradients    float32, one per parameter, split like them (the accumulation's sum)
  activations  what the backward pass keeps of the forward pass: JAX's residuals of
               the loss's VJP, for one micro-batch of the device's rows at
               `config.data.max_len` (under `config.model.remat='layer'`, mostly
               each layer's inputs)
  batch        the device's rows of a training batch (int32 arrays)

Nothing is compiled: the residuals come from `jax.eval_shape` of `jax.vjp`. Their sum
is within 10% of `compiled.memory_analysis()` of the step compiled for the CPU at the
same per-device shapes, in float32 (tests/test_memory.py). Left out: a layer's weights
gathered whole for its matmuls under fsdp, and XLA's workspace. With tensor > 1 the
activations are an upper bound (their heads, d_ff and vocabulary splits are not
subtracted). XLA:CPU computes bfloat16 in float32 (its compiled step holds both) and
gains nothing from rematerialisation (it schedules the recomputation early), so
there the CPU's figure exceeds this one; on GPUs and TPUs it is an estimate.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer import losses, optim, sharding, tasks, train_steps
from transformer.config import ModelConfig

GIB = 2**30
# Memory per device of the accelerators the report names, GiB (as their makers count it).
ACCELERATORS = (('TPU v5e', 16), ('A100', 40), ('A100', 80), ('H100', 80), ('H200', 141))
# JAX takes 75% of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION); a step fits
# a device when it needs at most that share (the rest: XLA's workspace, fragmentation).
USABLE_SHARE = 0.75


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Bytes per device of each part of a train step, and the shapes they were counted at."""

  parameters: int
  optimizer: int
  gradients: int
  activations: int
  batch: int
  rows: int  # Rows of a batch per device.
  micro_rows: int  # Rows per micro-batch (`config.grad_accum_steps`), whose activations count.
  length: int
  mesh: dict[str, int]

  @property
  def total(self) -> int:
    return self.parameters + self.optimizer + self.gradients + self.activations + self.batch


def nbytes(tree) -> int:
  """Bytes of the arrays (or shapes) of `tree`; a PRNG key counts as its raw data."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      total += int(np.prod(leaf.shape)) * 8  # Two uint32 words (the default threefry key).
    else:
      total += int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
  return total


def _shard_bytes(abstract_tree) -> int:
  """Bytes per device of a tree of shapes carrying their NamedShardings."""
  return sum(
    int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(abstract_tree)
  )


def step_memory(config: ml_collections.ConfigDict, num_devices: int) -> StepMemory:
  """Per-device memory of `config`'s train step with its mesh laid over `num_devices`."""
  sizes = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, num_devices), strict=True))
  mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), sharding.MESH_AXES)
  rules = sharding.axis_rules(config.mesh)
  task = tasks.get_task(config.model.architecture)
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  state, _ = train_steps.abstract_state_and_shardings(
    model, optim.create_optimizer(optim.OptimizerConfig.from_config(config)), task, mesh, rules
  )
  rows = config.data.tokens_per_batch // config.data.max_len // sharding.batch_shards(sizes, rules)
  micro_rows = rows // config.grad_accum_steps
  length = config.data.max_len
  micro_batch = {k: jax.ShapeDtypeStruct((micro_rows, length), jnp.int32) for k in task.batch_keys}
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)

  def loss(params, batch):
    logits = model.apply(
      {'params': params}, **task.model_inputs(batch), rngs={'dropout': jax.random.key(0)}
    )
    return losses.loss_and_metrics(logits, batch['tgt_tokens'], config.label_smoothing)[1][
      'loss_sum'
    ]

  # The VJP function holds exactly the forward pass's values that the backward pass reads.
  residuals = jax.eval_shape(
    lambda p, b: jax.vjp(functools.partial(loss, batch=b), p)[1], params, micro_batch
  )
  parameters = _shard_bytes(state.params)
  return StepMemory(
    parameters=parameters,
    optimizer=_shard_bytes(state.opt_state),
    gradients=parameters,
    activations=nbytes(residuals),
    batch=len(task.batch_keys) * rows * length * 4,
    rows=rows,
    micro_rows=micro_rows,
    length=length,
    mesh=sizes,
  )


def format_memory(memory: StepMemory) -> str:
  """The report's lines: each part in GiB, the total, and which accelerators it fits."""
  mesh = ' x '.join(f'{axis} {size}' for axis, size in memory.mesh.items())
  lines = [
    f'train step memory per device, estimated (mesh {mesh}; {memory.rows} rows of '
    f'{memory.length} tokens per device, activations of {memory.micro_rows} rows at a time):'
  ]
  parts = ('parameters', 'optimizer', 'gradients', 'activations', 'batch')
  lines += [f'  {part:<12} {getattr(memory, part) / GIB:10.3f} GiB' for part in parts]
  lines.append(f'  {"total":<12} {memory.total / GIB:10.3f} GiB')
  lines.append(f'fits a device when the total is at most {USABLE_SHARE:.0%} of its memory:')
  for name, gib in ACCELERATORS:
    share = memory.total / (gib * GIB)
    verdict = 'fits' if share <= USABLE_SHARE else 'does not fit'
    lines.append(f'  {f"{name} {gib} GB":<15} {verdict:<12} ({share:.0%} of its memory)')
  return '\n'.join(lines)
