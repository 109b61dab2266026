"""The learning-rate schedule (eq. 3), gradient clipping and the label-smoothed loss on
hand-computed cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import default
from transformer import losses, optim


@pytest.mark.parametrize(
  ('count', 'expected'),
  [
    (0, 512**-0.5 * 1 * 4000**-1.5),  # Step 1: linear warmup, tiny.
    (1999, 512**-0.5 * 2000 * 4000**-1.5),  # Halfway through warmup.
    (3999, 512**-0.5 * 4000**-0.5),  # The peak, at step = warmup_steps.
    (15999, 512**-0.5 * 16000**-0.5),  # Inverse square root decay afterwards.
  ],
)
def test_paper_schedule(count, expected):
  schedule = optim.paper_schedule(d_model=512, warmup_steps=4000)
  assert math.isclose(float(schedule(count)), expected, rel_tol=1e-5)
  assert math.isclose(
    float(optim.paper_schedule(512, 4000, scale=2.0)(count)), 2 * expected, rel_tol=1e-5
  )


def test_schedule_peaks_at_warmup():
  schedule = optim.paper_schedule(d_model=256, warmup_steps=100)
  values = np.array([float(schedule(c)) for c in range(300)])
  assert values.argmax() == 99


def test_label_smoothed_loss_hand_case():
  # p = softmax([0, ln 2, 0]) = [1/4, 1/2, 1/4]; target 1; eps = 0.3 over V = 3:
  # q = [0.1, 0.8, 0.1], CE = -(0.1 ln 1/4 + 0.8 ln 1/2 + 0.1 ln 1/4) = 1.2 ln 2.
  logits = jnp.array([[[0.0, math.log(2.0), 0.0], [5.0, -3.0, 1.0]]])
  targets = jnp.array([[1, 0]])  # The second position is padding and must not count.
  loss, sums = losses.loss_and_metrics(logits, targets, label_smoothing=0.3)
  assert math.isclose(float(loss), 1.2 * math.log(2.0), rel_tol=1e-5)
  assert math.isclose(float(sums['nll_sum']), math.log(2.0), rel_tol=1e-5)
  assert float(sums['num_tokens']) == 1.0
  assert float(sums['correct_sum']) == 1.0
  summary = losses.summarize(sums, 'eval')
  assert math.isclose(summary['eval_perplexity'], 2.0, rel_tol=1e-5)


def test_no_smoothing_is_cross_entropy():
  logits = jnp.array([[[1.0, 2.0, 3.0]]])
  loss, _ = losses.loss_and_metrics(logits, jnp.array([[2]]), label_smoothing=0.0)
  expected = -math.log(math.exp(3) / (math.exp(1) + math.exp(2) + math.exp(3)))
  assert math.isclose(float(loss), expected, rel_tol=1e-6)


@pytest.mark.parametrize(
  ('clip_norm', 'first_moment_norm'),
  [
    (0.0, 0.1 * 50.0),  # Off: Adam's first moment after one step is (1 - b1) * g, |g| = 50.
    (2.0, 0.1 * 2.0),  # The gradient is rescaled to norm 2 before Adam sees it.
    (100.0, 0.1 * 50.0),  # Below the threshold nothing changes.
  ],
)
def test_gradient_clipping_by_global_norm(clip_norm, first_moment_norm):
  config = default.get_config()
  config.grad_clip_norm = clip_norm
  optimizer = optim.create_optimizer(config)
  params = {'a': jnp.zeros(3), 'b': jnp.zeros((2, 2))}
  grads = {'a': jnp.array([30.0, 0.0, 0.0]), 'b': jnp.array([[0.0, 40.0], [0.0, 0.0]])}
  _, opt_state = optimizer.update(grads, optimizer.init(params), params)
  adam_state = opt_state[-1][0] if clip_norm else opt_state[0]
  assert math.isclose(float(optax.tree.norm(adam_state.mu)), first_moment_norm, rel_tol=1e-6)


def test_summary_over_zero_tokens_is_nan():
  zero = {'loss_sum': 0.0, 'nll_sum': 0.0, 'correct_sum': 0.0, 'num_tokens': 0.0}
  assert all(math.isnan(v) for v in losses.summarize(zero, 'train').values())


def test_label_smoothed_loss_matches_optax_one_hot_form():
  # The closed form (no one-hot) equals Optax's smoothed-label cross-entropy.
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(2, 5, 11)) * 3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (2, 5)))
  smoothed, nll = losses.token_losses(logits, targets, 0.1)
  onehot = jax.nn.one_hot(targets, 11)
  np.testing.assert_allclose(
    smoothed,
    optax.losses.softmax_cross_entropy(logits, optax.smooth_labels(onehot, 0.1)),
    rtol=1e-5,
    atol=1e-6,
  )
  np.testing.assert_allclose(
    nll,
    optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets),
    rtol=1e-5,
    atol=1e-6,
  )
  _, sums = losses.loss_and_metrics(logits, targets, 0.1)
  correct = (jnp.argmax(logits, -1) == targets) & (targets != 0)
  assert float(sums['correct_sum']) == float(correct.sum())
