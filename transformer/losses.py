"""Label-smoothed cross-entropy over non-padding tokens (section 5.4) and token metrics."""

import jax
import jax.numpy as jnp


def _token_terms(
  logits_BLV: jax.Array, targets_BL: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Smoothed loss, NLL and whether the target is a top logit, [B, L] each (see token_losses)."""
  logits_BLV = logits_BLV.astype(jnp.float32)
  max_BL = jax.lax.stop_gradient(jnp.max(logits_BLV, axis=-1))
  lse_BL = max_BL + jnp.log(jnp.sum(jnp.exp(logits_BLV - max_BL[..., None]), axis=-1))
  target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
  nll = lse_BL - target_logit_BL
  smoothed = nll
  if label_smoothing:
    smoothed = (
      lse_BL
      - (1.0 - label_smoothing) * target_logit_BL
      - label_smoothing * jnp.mean(logits_BLV, axis=-1)
    )
  return smoothed, nll, target_logit_BL >= max_BL


def token_losses(
  logits_BLV: jax.Array, targets_BL: jax.Array, label_smoothing: float
) -> tuple[jax.Array, jax.Array]:
  """Per-token label-smoothed cross-entropy and plain negative log-likelihood, [B, L] each.

  Label smoothing spreads `label_smoothing` of the target mass uniformly over the
  vocabulary (as Optax's `smooth_labels`): q = (1 - eps) * onehot + eps / V, so
  -sum_v q_v log p_v = lse - (1 - eps) * z_t - eps * mean_v(z_v), z being the logits
  and lse their log-sum-exp. Computed that way, from reductions over the vocabulary,
  no [B, L, V] one-hot or log-probability array is materialised.
  """
  smoothed, nll, _ = _token_terms(logits_BLV, targets_BL, label_smoothing)
  return smoothed, nll


def loss_and_metrics(
  logits_BLV: jax.Array, targets_BL: jax.Array, label_smoothing: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean smoothed loss over real (non-zero) target tokens, and summed metrics.

  The metrics are sums (not means) so that they add up exactly across
  micro-batches, steps and evaluation batches; `summarize` turns them into means.
  A token is correct when its target has the largest logit (from the same maximum
  the log-sum-exp uses; an exact tie for the largest logit counts as correct).
  """
  weights_BL = (targets_BL != 0).astype(jnp.float32)
  smoothed, nll, correct = _token_terms(logits_BLV, targets_BL, label_smoothing)
  sums = {
    'loss_sum': jnp.sum(smoothed * weights_BL),
    'nll_sum': jnp.sum(nll * weights_BL),
    'correct_sum': jnp.sum(correct.astype(jnp.float32) * weights_BL),
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
