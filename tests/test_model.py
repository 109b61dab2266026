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
