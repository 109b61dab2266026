"""Dropout of the paper model.

Logical axis names, padding, causality, packing and cached decoding are checked
for the paper model and every variant in tests/test_variants.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig
from transformer.model import Transformer

VOCAB = 40


def _config(**overrides) -> ModelConfig:
  base = dict(
    vocab_size=VOCAB,
    num_layers=2,
    d_model=16,
    num_heads=2,
    d_ff=32,
    dropout_rate=0.1,
    deterministic=True,
  )
  return ModelConfig(**{**base, **overrides})


@functools.cache
def _model_and_params(norm: str):
  model = Transformer(_config(norm=norm))
  tokens = jnp.ones((1, 8), jnp.int32)
  return model, model.init(jax.random.key(0), tokens, tokens)['params']


def _random_tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, size=shape), jnp.int32)


def test_dropout_is_active_in_training_and_keyed():
  model = Transformer(_config(deterministic=False))
  _, params = _model_and_params('post_ln')
  src, tgt = _random_tokens(12, (1, 5)), _random_tokens(13, (1, 5))
  run = lambda seed: model.apply(
    {'params': params}, src, tgt, rngs={'dropout': jax.random.key(seed)}
  )
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.allclose(run(0), run(1))


def test_remat_per_layer_keeps_parameters_and_gradients():
  """remat='layer' recomputes activations in the backward pass: same parameters, same gradients
  (dropout masks included), and only the layers' inputs are kept for the backward pass."""
  src, tgt = _random_tokens(14, (2, 6)), _random_tokens(15, (2, 5))
  segments = jnp.asarray([[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])

  def loss(params, model):
    logits = model.apply(
      {'params': params}, src, tgt, tgt_segments_BL=segments, rngs={'dropout': jax.random.key(4)}
    )
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * segments)

  grads, saved = {}, {}
  for remat in ('none', 'layer'):
    model = Transformer(
      _config(num_layers=1, deterministic=False, attention_dropout_rate=0.1, remat=remat)
    )
    params = jax.jit(model.init)(jax.random.key(0), src, tgt)['params']
    grads[remat] = jax.jit(jax.grad(loss), static_argnums=1)(params, model)
    residuals = jax.eval_shape(
      lambda p, model=model: jax.vjp(lambda q: loss(q, model), p)[1], params
    )
    saved[remat] = sum(x.size for x in jax.tree.leaves(residuals))
  assert jax.tree.structure(grads['layer']) == jax.tree.structure(grads['none'])
  for with_remat, without in zip(
    jax.tree.leaves(grads['layer']), jax.tree.leaves(grads['none']), strict=True
  ):
    np.testing.assert_allclose(with_remat, without, rtol=1e-4, atol=1e-6)
  assert saved['layer'] < saved['none'] / 2, saved
