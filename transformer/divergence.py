"""Divergence guard: a non-finite loss or gradient norm stops the run, or is skipped if configured.

Inside the jitted step, `finite_step` decides per step and, under
`config.skip_nonfinite_steps`, `keep_if_finite` keeps the previous parameters
and optimizer state (no host round trip). In the loop, `DivergenceMonitor`
holds each step's metrics (device scalars, not yet fetched) until the next log,
evaluation or checkpoint, and fetches them then: a non-finite step raises
`NonFiniteError` before anything is logged, evaluated or saved from the state
it produced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from transformer.errors import Refusal
from transformer.optim import OptimizerConfig

# The per-step metric counting non-finite steps (0 or 1), summed over log windows.
NONFINITE_KEY = 'nonfinite_steps'


class NonFiniteError(Refusal, FloatingPointError):
  """The loss or the gradient norm of a step was NaN or infinite."""


def finite_step(loss_sum: jax.Array, grad_norm: jax.Array) -> jax.Array:
  """Scalar bool: the step's summed loss and gradient norm are both finite."""
  return jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` if the step was finite, else `old`, leaf by leaf (both trees alike)."""
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def advice(config: OptimizerConfig) -> str:
  """What to change in the config against a divergence: the fields that set the rate in this run."""
  if config.peak_learning_rate is not None:
    rate = f'Lower config.peak_learning_rate (now {config.peak_learning_rate:g})'
  else:  # Eq. 3's peak: lr_scale * (d_model * warmup_steps)^-0.5.
    rate = f'Lower config.lr_scale (now {config.lr_scale:g})'
  rate += f' or lengthen config.warmup_steps (now {config.warmup_steps})'
  if config.grad_clip_norm > 0:
    return f'{rate}, or lower config.grad_clip_norm (now {config.grad_clip_norm:g})'
  return f'{rate}, or set config.grad_clip_norm (e.g. 1.0)'


class DivergenceMonitor:
  """Finds the first non-finite step among those recorded since the last check."""

  def __init__(self, skip_nonfinite_steps: bool, advice: str = 'Lower the learning rate'):
    self._active = not skip_nonfinite_steps  # Skipped steps are counted, not errors.
    self._advice = advice  # What to change before a rerun (`advice`).
    self._pending: list[tuple[int, dict[str, jax.Array]]] = []

  def record(self, step: int, sums: dict[str, jax.Array]) -> None:
    """Keeps a step's metrics; nothing is fetched from the device yet."""
    if self._active:
      self._pending.append((step, sums))

  def check(self, last_good_checkpoint: Callable[[], str | None]) -> None:
    """Raises `NonFiniteError` naming the first non-finite step since the last check.

    `last_good_checkpoint` is called only then, and describes the checkpoint a
    rerun resumes from, or returns None if there is none (it may wait for a
    save in flight to commit).
    """
    pending, self._pending = jax.device_get(self._pending), []
    for step, sums in pending:
      if sums[NONFINITE_KEY] == 0:
        continue
      tokens = max(float(sums['num_tokens']), 1.0)
      values = {
        'train loss': float(sums['loss_sum']) / tokens,
        'gradient norm': float(sums['grad_norm_sum']),
      }
      bad = [f'{name} = {value}' for name, value in values.items() if not math.isfinite(value)]
      good = last_good_checkpoint()
      resume = (
        f'the last good checkpoint is {good}, and a rerun resumes from it'
        if good
        else 'no checkpoint had been written yet'
      )
      raise NonFiniteError(
        f'Training diverged at step {step}: {" and ".join(bad)}. No checkpoint was written from '
        f'this state; {resume}. {self._advice} before rerunning, or set '
        'config.skip_nonfinite_steps=True to skip such updates.'
      )
