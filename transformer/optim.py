"""The paper's optimiser (section 5.3): Adam under the inverse-square-root warmup schedule."""

import jax.numpy as jnp
import ml_collections
import optax


def paper_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """Eq. 3: lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5), times `scale`.

  `step` counts from 1 at the first update (Optax passes the 0-based update count).
  """

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

  return schedule


def create_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) at the paper's schedule scaled by `config.lr_scale`.

  With `config.grad_clip_norm` > 0 the gradients are first clipped to that
  global L2 norm (the paper does not clip). Clipping adds an (empty) entry to the
  optimizer state, so checkpoints written with it on and off are not interchangeable.
  """
  schedule = paper_schedule(config.model.d_model, config.warmup_steps, config.lr_scale)
  adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam)
  return adam
