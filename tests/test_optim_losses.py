"""The learning-rate schedules (eq. 3 and its variants), weight decay, gradient clipping and the
label-smoothed loss on hand-computed cases."""

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


def _schedule_config(**overrides):
  config = default.get_config()
  config.update(overrides)
  return config


def test_default_schedule_is_eq3_bit_for_bit():
  config = default.get_config()
  counts = jnp.arange(3 * config.num_train_steps)
  ours = optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))(counts)
  eq3 = optim.paper_schedule(config.model.d_model, config.warmup_steps, config.lr_scale)(counts)
  np.testing.assert_array_equal(ours, eq3)
  # An explicit peak equal to eq. 3's traces the same curve (up to float rounding).
  peak = optim.peak_learning_rate(optim.OptimizerConfig.from_config(config))
  assert math.isclose(peak, 0.5 * 256**-0.5 * 400**-0.5, rel_tol=1e-12)
  explicit = optim.learning_rate_schedule(
    optim.OptimizerConfig.from_config(_schedule_config(peak_learning_rate=peak))
  )(counts)
  np.testing.assert_allclose(explicit, eq3, rtol=2e-6)


@pytest.mark.parametrize(
  ('schedule', 'expected'),
  [
    # fairseq's recipe: --lr 0.005 --warmup-updates 2000, then the inverse square root.
    ('inverse_sqrt', {1: 0.005 / 2000, 1000: 0.0025, 2000: 0.005, 8000: 0.0025, 18000: 0.005 / 3}),
    # Down a line to final_lr_fraction * peak = 0.0005 at num_train_steps = 8000, then stays.
    ('linear', {1000: 0.0025, 2000: 0.005, 5000: 0.00275, 8000: 0.0005, 9000: 0.0005}),
    # Half a cosine: halfway between the peak and the floor at the middle of the decay.
    ('cosine', {1000: 0.0025, 2000: 0.005, 5000: 0.00275, 8000: 0.0005, 9000: 0.0005}),
  ],
)
def test_schedules_with_an_explicit_peak_on_hand_computed_steps(schedule, expected):
  config = _schedule_config(
    schedule=schedule,
    peak_learning_rate=0.005,
    warmup_steps=2000,
    num_train_steps=8000,
    final_lr_fraction=0.1,
  )
  learning_rate = optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))
  for step, value in expected.items():
    assert math.isclose(float(learning_rate(step - 1)), value, rel_tol=1e-5), (step, value)
  if schedule == 'cosine':  # A quarter of the way: 0.0005 + 0.0045 * (1 + cos(pi / 4)) / 2.
    quarter = 0.0005 + 0.0045 * (1 + math.cos(math.pi / 4)) / 2
    assert math.isclose(float(learning_rate(3500 - 1)), quarter, rel_tol=1e-5)
  values = np.asarray(learning_rate(jnp.arange(10_000)))
  assert values.argmax() == 2000 - 1 and np.all(values > 0)


def test_one_step_of_warmup_starts_at_the_peak():
  config = _schedule_config(schedule='linear', peak_learning_rate=1.0, warmup_steps=1)
  learning_rate = optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))
  assert float(learning_rate(0)) == 1.0 and float(learning_rate(config.num_train_steps - 1)) == 0.0


@pytest.mark.parametrize('schedule', ['inverse_sqrt', 'cosine'])
def test_the_optimizer_follows_the_schedule(schedule):
  # Adam's update of a constant gradient is -learning_rate * sign(g) at every step (the bias
  # corrections cancel): the updates read the schedule back.
  config = _schedule_config(
    schedule=schedule, peak_learning_rate=0.01, warmup_steps=3, num_train_steps=6
  )
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  params = {'w': jnp.zeros(2)}
  grads = {'w': jnp.array([0.5, -2.0])}
  state = optimizer.init(params)
  learning_rate = optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))
  for count in range(6):
    updates, state = optimizer.update(grads, state, params)
    np.testing.assert_allclose(
      updates['w'], [-float(learning_rate(count)), float(learning_rate(count))], rtol=1e-5
    )


def test_weight_decay_is_decoupled_and_skips_biases_and_norm_scales():
  params = {
    'dense': {'kernel': jnp.full((2, 3), 2.0), 'bias': jnp.full((3,), 2.0)},
    'attention': {'kernel': jnp.full((2, 2, 2), 2.0), 'bias': jnp.full((2, 2), 2.0)},
    'norm': {'scale': jnp.full((2,), 2.0)},
    'shared_embedding': {'embedding': jnp.full((5, 2), 2.0)},
  }
  zero_grads = jax.tree.map(jnp.zeros_like, params)  # Adam's own step is then 0.
  config = _schedule_config(weight_decay=0.1)
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
  rate = float(optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))(0))
  decayed = -rate * 0.1 * 2.0  # learning_rate * weight_decay * weight, not scaled by Adam.
  expected = {
    'dense': {'kernel': decayed, 'bias': 0.0},
    'attention': {'kernel': decayed, 'bias': 0.0},
    'norm': {'scale': 0.0},
    'shared_embedding': {'embedding': decayed},
  }
  jax.tree.map(
    lambda u, e: np.testing.assert_allclose(u, np.full(u.shape, e), rtol=1e-6), updates, expected
  )
  # Without weight decay the optimizer is Adam itself: the same state, the same update.
  plain = optim.create_optimizer(optim.OptimizerConfig.from_config(default.get_config()))
  adam = optax.adam(
    optim.learning_rate_schedule(optim.OptimizerConfig.from_config(default.get_config())),
    b1=0.9,
    b2=0.98,
    eps=1e-9,
  )
  assert jax.tree.structure(plain.init(params)) == jax.tree.structure(adam.init(params))
  grads = jax.tree.map(lambda p: p * 0.3, params)
  ours, _ = plain.update(grads, plain.init(params), params)
  theirs, _ = adam.update(grads, adam.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


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
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
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
