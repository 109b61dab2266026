"""Properties of the encoder-decoder: padding, causality, packing, cached decoding, axes."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_cached_decoding_matches_full_pass

from transformer.model import ModelConfig, Transformer

VOCAB = 40


def _config(**overrides) -> ModelConfig:
  base = dict(vocab_size=VOCAB, num_layers=2, d_model=16, num_heads=2, d_ff=32,
              dropout_rate=0.1, deterministic=True)
  return ModelConfig(**{**base, **overrides})


@functools.cache
def _model_and_params(norm: str):
  model = Transformer(_config(norm=norm))
  tokens = jnp.ones((1, 8), jnp.int32)
  return model, model.init(jax.random.key(0), tokens, tokens)['params']


@pytest.fixture(params=['post_ln', 'pre_ln'])
def model_and_params(request):
  model, params = _model_and_params(request.param)
  return model, nn.meta.unbox(params)


def _random_tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, size=shape), jnp.int32)


def test_every_parameter_has_one_logical_name_per_dimension():
  _, boxed = _model_and_params('post_ln')
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: hasattr(x, 'names'))
  assert leaves
  for leaf in leaves:
    assert len(leaf.names) == leaf.value.ndim, (leaf.names, leaf.value.shape)


def test_padding_does_not_change_encoder_output_of_real_tokens(model_and_params):
  model, params = model_and_params
  src = _random_tokens(0, (1, 5))
  padded = jnp.concatenate([src, jnp.zeros((1, 4), jnp.int32)], axis=1)
  enc = model.apply({'params': params}, src, method=Transformer.encode)
  enc_padded = model.apply({'params': params}, padded, method=Transformer.encode)
  np.testing.assert_allclose(enc_padded[:, :5], enc, atol=1e-5)
  # And the decoder's logits do not move either.
  tgt = _random_tokens(1, (1, 4))
  np.testing.assert_allclose(model.apply({'params': params}, padded, tgt),
                             model.apply({'params': params}, src, tgt), atol=1e-5)


def test_future_target_tokens_do_not_leak(model_and_params):
  model, params = model_and_params
  src, tgt = _random_tokens(2, (1, 6)), _random_tokens(3, (1, 7))
  logits = model.apply({'params': params}, src, tgt)
  for t in range(6):
    changed = tgt.at[0, t + 1].set((tgt[0, t + 1] + 1) % VOCAB + 3 * (tgt[0, t + 1] < 2))
    new_logits = model.apply({'params': params}, src, changed)
    np.testing.assert_allclose(new_logits[:, :t + 1], logits[:, :t + 1], atol=1e-5)
    assert not np.allclose(new_logits[:, t + 1:], logits[:, t + 1:], atol=1e-5)


def test_packed_rows_equal_separate_examples(model_and_params):
  model, params = model_and_params
  src_a, src_b = _random_tokens(6, (1, 3)), _random_tokens(7, (1, 4))
  tgt_a, tgt_b = _random_tokens(8, (1, 4)), _random_tokens(9, (1, 2))
  packed = model.apply(
    {'params': params},
    jnp.concatenate([src_a, src_b, jnp.zeros((1, 1), jnp.int32)], 1),
    jnp.concatenate([tgt_a, tgt_b], 1),
    src_segments_BS=jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
    tgt_segments_BL=jnp.array([[1, 1, 1, 1, 2, 2]]),
    src_positions_BS=jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]]),
    tgt_positions_BL=jnp.array([[0, 1, 2, 3, 0, 1]]))
  alone_a = model.apply({'params': params}, src_a, tgt_a)
  alone_b = model.apply({'params': params}, src_b, tgt_b)
  np.testing.assert_allclose(packed[:, :4], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[:, 4:], alone_b, atol=1e-5)


def test_cached_decoding_equals_full_forward_pass(model_and_params):
  model, params = model_and_params
  assert_cached_decoding_matches_full_pass(model, params)


def test_dropout_is_active_in_training_and_keyed():
  model = Transformer(_config(deterministic=False))
  _, params = _model_and_params('post_ln')
  src, tgt = _random_tokens(12, (1, 5)), _random_tokens(13, (1, 5))
  run = lambda seed: model.apply({'params': params}, src, tgt,
                                 rngs={'dropout': jax.random.key(seed)})
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.allclose(run(0), run(1))
