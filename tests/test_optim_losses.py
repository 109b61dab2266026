"""The learning-rate schedule (eq. 3) and the label-smoothed loss on hand-computed cases."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from transformer import losses, optim


@pytest.mark.parametrize(('count', 'expected'), [
  (0, 512**-0.5 * 1 * 4000**-1.5),  # Step 1: linear warmup, tiny.
  (1999, 512**-0.5 * 2000 * 4000**-1.5),  # Halfway through warmup.
  (3999, 512**-0.5 * 4000**-0.5),  # The peak, at step = warmup_steps.
  (15999, 512**-0.5 * 16000**-0.5),  # Inverse square root decay afterwards.
])
def test_paper_schedule(count, expected):
  schedule = optim.paper_schedule(d_model=512, warmup_steps=4000)
  assert math.isclose(float(schedule(count)), expected, rel_tol=1e-5)
  assert math.isclose(float(optim.paper_schedule(512, 4000, scale=2.0)(count)), 2 * expected,
                      rel_tol=1e-5)


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
