"""Positional encoding, embeddings and the FFN against their formulas."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer import layers
from transformer.config import ModelConfig


def test_sinusoidal_encoding_matches_formula():
  d_model, positions = 6, np.array([[0, 1, 5, 50]])
  pe = np.asarray(layers.sinusoidal_encoding(jnp.asarray(positions), d_model))
  assert pe.shape == (1, 4, d_model)
  for j, pos in enumerate(positions[0]):
    for i in range(d_model // 2):
      angle = pos / 10000 ** (2 * i / d_model)
      assert math.isclose(pe[0, j, 2 * i], math.sin(angle), abs_tol=1e-5)
      assert math.isclose(pe[0, j, 2 * i + 1], math.cos(angle), abs_tol=1e-5)


def test_embedding_is_scaled_by_sqrt_d_model_and_shared_with_softmax():
  cfg = ModelConfig(vocab_size=10, d_model=16, num_heads=2)
  embed = layers.Embed(cfg)
  tokens = jnp.array([[3, 7]])
  variables = embed.init(jax.random.key(0), tokens)
  table = np.asarray(variables['params']['embedding'].unbox())
  np.testing.assert_allclose(embed.apply(variables, tokens)[0], table[[3, 7]] * 4.0, rtol=1e-6)
  x = jnp.ones((1, 1, 16))
  logits = embed.apply(variables, x, method=layers.Embed.attend)
  np.testing.assert_allclose(logits[0, 0], table.sum(axis=1), rtol=1e-5)


def test_feed_forward_is_relu_mlp():
  cfg = ModelConfig(vocab_size=10, d_model=4, d_ff=8, num_heads=2)
  ffn = layers.FeedForward(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, 4))
  variables = ffn.init(jax.random.key(0), x, deterministic=True)
  p = jax.tree.map(np.asarray, variables['params'])
  p = {k: {n: getattr(v, 'value', v) for n, v in d.items()} for k, d in p.items()}
  hidden = np.maximum(0, np.asarray(x) @ p['wi']['kernel'] + p['wi']['bias'])
  expected = hidden @ p['wo']['kernel'] + p['wo']['bias']
  np.testing.assert_allclose(ffn.apply(variables, x, deterministic=True), expected, rtol=1e-5)


def test_ffn_dropout_drops_units_of_the_activation():
  cfg = ModelConfig(vocab_size=10, d_model=8, d_ff=8, num_heads=2, ffn_dropout_rate=0.5)
  ffn = layers.FeedForward(cfg)
  x = jax.random.normal(jax.random.key(1), (2, 3, 8))
  variables = ffn.init(jax.random.key(0), x, deterministic=True)
  # W2 = I, b2 = 0: the output is the (dropped-out) activation itself.
  params = nn.meta.unbox(variables['params'])
  params['wo'] = {'kernel': jnp.eye(8), 'bias': jnp.zeros(8)}
  hidden = np.maximum(0, np.asarray(x) @ params['wi']['kernel'] + params['wi']['bias'])
  apply = lambda key, **kw: ffn.apply({'params': params}, x, rngs={'dropout': key}, **kw)
  np.testing.assert_allclose(apply(jax.random.key(2), deterministic=True), hidden, rtol=1e-5)
  dropped = np.asarray(apply(jax.random.key(2), deterministic=False))
  kept = dropped != 0
  # Each active unit is either dropped or scaled by 1 / (1 - rate); units ReLU zeroed stay 0.
  np.testing.assert_allclose(dropped[kept], 2 * hidden[kept], rtol=1e-5)
  assert 0.3 < kept[hidden > 0].mean() < 0.7 and not kept[hidden == 0].any()
  # Rate 0 (the default) is no dropout, and draws no key.
  plain = layers.FeedForward(cfg.replace(ffn_dropout_rate=0.0))
  np.testing.assert_allclose(
    plain.apply({'params': params}, x, deterministic=False), hidden, rtol=1e-5
  )
