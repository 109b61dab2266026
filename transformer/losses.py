"""Label-smoothed cross-entropy over non-padding tokens (section 5.4) and token metrics."""

import jax
import jax.numpy as jnp
import optax


def token_losses(
  logits_BLV: jax.Array, targets_BL: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array]:
  """Per-token label-smoothed cross-entropy and plain negative log-likelihood, [B, L] each.

  Label smoothing spreads `label_smoothing` of the target mass uniformly over the
  vocabulary (Optax's `smooth_labels`): q = (1 - eps) * onehot + eps / V.
  """
  logits_BLV = logits_BLV.astype(jnp.float32)
  onehot_BLV = jax.nn.one_hot(targets_BL, logits_BLV.shape[-1], dtype=jnp.float32)
  smoothed = optax.losses.softmax_cross_entropy(
    logits_BLV, optax.smooth_labels(onehot_BLV, label_smoothing))
  nll = optax.losses.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
  return smoothed, nll


def loss_and_metrics(
  logits_BLV: jax.Array, targets_BL: jax.Array, label_smoothing: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean smoothed loss over real (non-zero) target tokens, and summed metrics.

  The metrics are sums (not means) so that they add up exactly across
  micro-batches, steps and evaluation batches; `summarize` turns them into means.
  """
  weights_BL = (targets_BL != 0).astype(jnp.float32)
  smoothed, nll = token_losses(logits_BLV, targets_BL, label_smoothing)
  correct = (jnp.argmax(logits_BLV, axis=-1) == targets_BL).astype(jnp.float32)
  sums = {
    'loss_sum': jnp.sum(smoothed * weights_BL),
    'nll_sum': jnp.sum(nll * weights_BL),
    'correct_sum': jnp.sum(correct * weights_BL),
    'num_tokens': jnp.sum(weights_BL),
  }
  return sums['loss_sum'] / jnp.maximum(sums['num_tokens'], 1.0), sums


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
  """Means from summed metrics: `{prefix}_loss`, `_perplexity`, `_accuracy`.

  Over zero tokens (e.g. every step of a log window skipped as non-finite) the
  means are undefined: NaN.
  """
  tokens = float(sums['num_tokens']) or float('nan')
  nll = float(sums['nll_sum']) / tokens
  return {
    f'{prefix}_loss': float(sums['loss_sum']) / tokens,
    f'{prefix}_perplexity': float(jnp.exp(jnp.minimum(nll, 50.0))),
    f'{prefix}_accuracy': float(sums['correct_sum']) / tokens,
  }
