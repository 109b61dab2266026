"""The optimiser: Adam (section 5.3), or AdamW, under one learning-rate schedule.

`learning_rate_schedule(optimizer_config)` is the one definition of the learning rate: the
optimizer follows it, and training logs it (`learning_rate`). Both read `OptimizerConfig`, the
config's optimiser and schedule fields, built once from a checked config.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from transformer import config_fields


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(config_fields.Part):
  """The fields of a config that set the optimiser and its schedule (`from_config(config)`)."""

  adam_b1: float
  adam_b2: float
  adam_eps: float
  weight_decay: float
  grad_clip_norm: float
  schedule: str
  peak_learning_rate: float | None
  lr_scale: float
  warmup_steps: int
  final_lr_fraction: float
  num_train_steps: int
  d_model: int = config_fields.from_key('model.d_model')  # Eq. 3's d_model^-0.5.


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), times `scale`.

  `step` counts from 1 at the first update (Optax passes the 0-based update count).
  """

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

  return schedule


def peak_learning_rate(config: OptimizerConfig) -> float:
  """`config.peak_learning_rate`, or if None eq. 3's: lr_scale * (d_model * warmup_steps)^-0.5."""
  if config.peak_learning_rate is not None:
    return config.peak_learning_rate
  return config.lr_scale * (config.d_model * config.warmup_steps) ** -0.5


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
  """The learning rate of each update (Optax's 0-based count; step = count + 1).

  Every schedule rises linearly to the peak (`peak_learning_rate`) at step
  `config.warmup_steps`, as eq. 3 does (peak * step / warmup_steps), then
  decays by `config.schedule`:

  - 'inverse_sqrt': peak * sqrt(warmup_steps / step), eq. 3's decay (fairseq's
    `--lr-scheduler=inverse_sqrt` with `--lr` the peak and `--warmup-updates`,
    which reaches it one update later). With `config.peak_learning_rate` None
    this is eq. 3 itself, `paper_schedule`.
  - 'linear', 'cosine': to `config.final_lr_fraction` * peak at step
    `config.num_train_steps`, on a line or a half cosine (Optax's schedules).
  """
  warmup = config.warmup_steps
  if config.schedule == 'inverse_sqrt' and config.peak_learning_rate is None:
    return paper_schedule(config.d_model, warmup, config.lr_scale)
  peak = peak_learning_rate(config)
  decay_steps = config.num_train_steps - warmup  # Validation: > 0 for linear and cosine.
  if config.schedule == 'linear':
    decay = optax.linear_schedule(peak, config.final_lr_fraction * peak, decay_steps)
  elif config.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.final_lr_fraction)
  else:
    decay = lambda steps_after_peak: peak * jnp.sqrt(warmup / (warmup + steps_after_peak))
  # Steps 1 .. warmup - 1 (counts 0 .. warmup - 2): peak * step / warmup (by hand: Optax's
  # linear_schedule from peak / warmup loses its low digits to cancellation in float32); from
  # the peak on, the decay, given the steps since the peak.
  rise = lambda count: peak * (jnp.asarray(count, jnp.float32) + 1.0) / warmup
  return optax.join_schedules([rise, decay], [warmup - 1])


# Parameters that AdamW's weight decay leaves alone, by name: biases (attention's are 2-D) and the
# scales of LayerNorm and RMSNorm. Kernels and embeddings are decayed.
NOT_DECAYED = ('bias', 'scale')


def decay_mask(params) -> object:
  """The pytree of `params` with True where AdamW decays the weight (not `NOT_DECAYED`)."""

  def decayed(path, _) -> bool:
    name = next(e.key for e in reversed(path) if isinstance(e, jax.tree_util.DictKey))
    return name not in NOT_DECAYED

  return jax.tree_util.tree_map_with_path(decayed, params)


def create_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  """Adam(b1, b2, eps), or with `config.weight_decay` > 0 AdamW, at `learning_rate_schedule`.

  AdamW's decay is decoupled (Loshchilov & Hutter): each update also subtracts
  learning_rate * weight_decay * weight, of kernels and embeddings only (`decay_mask`).
  With `config.grad_clip_norm` > 0 the gradients are first clipped to that
  global L2 norm (the paper does not clip). Clipping and weight decay each add an
  (empty) entry to the optimizer state, so checkpoints written with either on
  and off are not interchangeable.
  """
  schedule = learning_rate_schedule(config)
  if config.weight_decay > 0:
    adam = optax.adamw(
      schedule,
      b1=config.adam_b1,
      b2=config.adam_b2,
      eps=config.adam_eps,
      weight_decay=config.weight_decay,
      mask=decay_mask,
    )
  else:
    adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
  return adam
