"""Modern variant switches: their blocks on hand-computed cases, then every switch value
(one at a time from the paper's model) through the model's properties and a short training run.

`decoder_only` (the language model: the decoder stack without cross-attention) is one more
value here: it has no source, so `_apply` drops the source arguments for it.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import default, tiny
from transformer import attention, layers, runs, summary
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.model import Transformer

VOCAB = 40

# Each switch value changed alone from the paper's model (post_ln, sinusoidal, relu, biases).
VARIANTS = {
  'rmsnorm': dict(norm='rmsnorm'),
  'pre_ln': dict(norm='pre_ln'),
  'learned': dict(position='learned'),
  'rope': dict(position='rope'),
  'alibi': dict(position='alibi'),
  'gelu': dict(ffn_activation='gelu'),
  'swiglu': dict(ffn_activation='swiglu'),
  'swish': dict(ffn_activation='swish'),
  'logits_bias': dict(logits_bias=True),
  'no_bias': dict(use_bias=False),
  'qk_norm': dict(qk_norm=True),
  'decoder_only': dict(architecture='decoder_only'),
  # Grouped-query attention: 4 query heads over 2 key/value heads.
  'grouped_query': dict(num_heads=4, num_kv_heads=2),
}


def _config(**overrides) -> ModelConfig:
  base = dict(
    vocab_size=VOCAB,
    num_layers=2,
    d_model=16,
    num_heads=2,
    d_ff=32,
    dropout_rate=0.1,
    max_len=32,
    deterministic=True,
  )
  return ModelConfig(**{**base, **overrides})


@functools.cache
def _model_and_boxed_params(variant: str):
  model = Transformer(_config(**VARIANTS.get(variant, {})))
  src, tgt = jnp.ones((1, 8), jnp.int32), jnp.ones((1, 6), jnp.int32)  # Shapes used below.
  return model, model.init(jax.random.key(0), _source(model, src), tgt)['params']


def _source(model, src_BS):
  return src_BS if model.config.has_encoder else None


def _apply(model, params, src_BS, tgt_BL, **kwargs):
  """Logits of (src, tgt); a decoder-only model sees the target side only."""
  if not model.config.has_encoder:
    kwargs = {k: v for k, v in kwargs.items() if not k.startswith('src_')}
  return model.apply({'params': params}, _source(model, src_BS), tgt_BL, **kwargs)


def _model_and_params(variant: str):
  model, boxed = _model_and_boxed_params(variant)
  return model, nn.meta.unbox(boxed)


def _random_tokens(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, size=shape), jnp.int32)


# --- RoPE (Su et al., RoFormer) ---------------------------------------------------------------


def _rope_scores(q_positions, k_positions):
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32) for _ in range(2))
  q = layers.apply_rope(q, jnp.asarray([q_positions]))
  k = layers.apply_rope(k, jnp.asarray([k_positions]))
  return np.asarray(jnp.einsum('blhk,bshk->bhls', q, k))


def test_rope_scores_depend_only_on_relative_position():
  scores = _rope_scores([0, 1, 2, 3], [0, 1, 2, 3])
  np.testing.assert_allclose(_rope_scores([7, 8, 9, 10], [7, 8, 9, 10]), scores, atol=1e-4)
  np.testing.assert_allclose(
    _rope_scores([3, 1, 0, 2], [3, 1, 0, 2]),
    _rope_scores([53, 51, 50, 52], [53, 51, 50, 52]),
    atol=1e-4,
  )
  assert not np.allclose(_rope_scores([0, 1, 2, 3], [1, 2, 3, 4]), scores, atol=1e-2)


def test_rope_rotates_pairs_of_dimensions_by_position_times_frequency():
  x = jnp.asarray([[[[1.0, 0.0, 1.0, 0.0]]]])  # [B=1, L=1, H=1, K=4].
  out = np.asarray(layers.apply_rope(x, jnp.asarray([[2]])))[0, 0, 0]
  # Pair i is rotated by 2 * 10000^(-2i/4): angles 2 and 0.02.
  np.testing.assert_allclose(
    out, [math.cos(2), math.sin(2), math.cos(0.02), math.sin(0.02)], rtol=1e-5
  )


def _attention_weights(cfg, params, x, positions, mask=None):
  _, state = attention.MultiHeadAttention(cfg).apply(
    {'params': params},
    x,
    x,
    mask,
    positions_BL=jnp.asarray(positions),
    deterministic=True,
    mutable=['intermediates'],
  )
  return np.asarray(state['intermediates']['attention_weights'][0])


def test_rope_attention_is_invariant_to_shifting_all_positions():
  cfg = _config(position='rope')
  x = jax.random.normal(jax.random.key(1), (1, 5, cfg.d_model))
  params = attention.MultiHeadAttention(cfg).init(
    jax.random.key(0), x, x, None, positions_BL=jnp.arange(5)[None], deterministic=True
  )['params']
  weights = _attention_weights(cfg, params, x, [[0, 1, 2, 3, 4]])
  np.testing.assert_allclose(
    _attention_weights(cfg, params, x, [[9, 10, 11, 12, 13]]), weights, atol=1e-5
  )
  assert not np.allclose(_attention_weights(cfg, params, x, [[0, 2, 4, 6, 8]]), weights, atol=1e-3)


# --- ALiBi (Press et al. 2022) ----------------------------------------------------------------


def test_alibi_slopes_follow_the_paper():
  np.testing.assert_allclose(layers.alibi_slopes(8), [2.0**-i for i in range(1, 9)])
  np.testing.assert_allclose(layers.alibi_slopes(2), [2.0**-4, 2.0**-8])
  # Not a power of 2: the 4-head slopes, then every other 8-head slope (1/2, 1/8).
  np.testing.assert_allclose(layers.alibi_slopes(6), [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])


def test_alibi_bias_is_minus_slope_times_position_distance():
  positions = jnp.asarray([[0, 1, 2, 0, 1]])  # Two packed examples.
  bias = np.asarray(layers.alibi_bias(positions, positions, layers.alibi_slopes(8)))
  assert bias.shape == (1, 8, 5, 5)
  distance = np.array(
    [
      [0, 1, 2, 0, 1],
      [1, 0, 1, 1, 0],
      [2, 1, 0, 2, 1],
      [0, 1, 2, 0, 1],
      [1, 0, 1, 1, 0],
    ]
  )  # |q_pos - k_pos| (q_pos - k_pos where causal): by positions, not array indices.
  for head in range(8):
    np.testing.assert_allclose(bias[0, head], -distance * 2.0 ** -(head + 1))


def test_alibi_attention_adds_the_bias_to_the_logits():
  cfg = _config(position='alibi', num_heads=2)
  x = jax.random.normal(jax.random.key(1), (1, 5, cfg.d_model))
  positions = jnp.asarray([[0, 1, 2, 0, 1]])
  params = attention.MultiHeadAttention(cfg).init(
    jax.random.key(0), x, x, None, positions_BL=positions, deterministic=True
  )['params']
  params = jax.tree.map(jnp.zeros_like, nn.meta.unbox(params))  # Q K^T = 0: only the bias is left.
  segments = jnp.asarray([[1, 1, 1, 2, 2]])
  mask = attention.segment_mask(segments, segments) & attention.causal_mask(5)
  weights = _attention_weights(cfg, params, x, positions, mask)
  # Third token of the first example: softmax(-slope * [2, 1, 0]) over its own keys.
  for head, slope in enumerate([1 / 16, 1 / 256]):
    logits = -slope * np.array([2.0, 1.0, 0.0])
    np.testing.assert_allclose(
      weights[0, head, 2, :3], np.exp(logits) / np.exp(logits).sum(), rtol=1e-5
    )
    np.testing.assert_allclose(
      weights[0, head, 4, 3:], [1 / (1 + math.exp(slope)), 1 / (1 + math.exp(-slope))], rtol=1e-5
    )


# --- SwiGLU (Shazeer 2020) and RMSNorm (Zhang & Sennrich 2019) ----------------------------------


def test_swiglu_is_swish_gate_times_linear_then_output_projection():
  cfg = _config(d_model=2, num_heads=1, d_ff=2, ffn_activation='swiglu', use_bias=False)
  params = {
    'wi': {'kernel': jnp.asarray([[1.0, 0.0], [0.0, 1.0]])},  # W (through Swish).
    'wv': {'kernel': jnp.asarray([[2.0, 0.0], [0.0, 3.0]])},  # V (linear).
    'wo': {'kernel': jnp.asarray([[1.0, 1.0], [0.0, 1.0]])},  # W2.
  }
  out = layers.FeedForward(cfg).apply(
    {'params': params}, jnp.asarray([[[1.0, -1.0]]]), deterministic=True
  )
  # x W = [1, -1] -> Swish: [sigmoid(1), -sigmoid(-1)] = [0.7310586, -0.2689414];
  # x V = [2, -3]; product [1.4621172, 0.8068243]; times W2: [1.4621172, 2.2689414].
  np.testing.assert_allclose(out[0, 0], [1.4621172, 2.2689414], rtol=1e-6)


def test_swish_ffn_is_x_sigmoid_x_between_the_two_projections():
  cfg = _config(d_model=2, num_heads=1, d_ff=2, ffn_activation='swish')
  params = {
    'wi': {'kernel': jnp.asarray([[1.0, 0.0], [0.0, 1.0]]), 'bias': jnp.asarray([0.0, 1.0])},
    'wo': {'kernel': jnp.asarray([[1.0, 1.0], [0.0, 1.0]]), 'bias': jnp.asarray([0.5, 0.0])},
  }
  out = layers.FeedForward(cfg).apply(
    {'params': params}, jnp.asarray([[[1.0, -1.0]]]), deterministic=True
  )
  # x W1 + b1 = [1, 0] -> Swish: [sigmoid(1), 0] = [0.7310586, 0]; times W2 plus b2:
  # [0.7310586 + 0.5, 0.7310586].
  np.testing.assert_allclose(out[0, 0], [1.2310586, 0.7310586], rtol=1e-6)


def test_norm_epsilon_is_added_to_the_variance():
  for norm, expected in (('post_ln', [-1 / math.sqrt(2), 1 / math.sqrt(2)]), ('rmsnorm', None)):
    module = layers.norm(_config(norm=norm, norm_epsilon=0.1), 'norm')
    x = jnp.asarray([[1.0, 2.0]])
    params = module.init(jax.random.key(0), x)
    out = module.apply(params, x)
    if norm == 'post_ln':  # mean 1.5, variance 0.25: (x - 1.5) / sqrt(0.35).
      expected = [-0.5 / math.sqrt(0.35), 0.5 / math.sqrt(0.35)]
    else:  # mean(x^2) = 2.5: x / sqrt(2.6).
      expected = [1 / math.sqrt(2.6), 2 / math.sqrt(2.6)]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def test_logits_bias_is_added_to_every_positions_logits():
  model, params = _model_and_params('logits_bias')
  plain, _ = _model_and_params('paper')
  src, tgt = _random_tokens(1, (1, 8)), _random_tokens(2, (1, 6))
  bias = np.random.default_rng(0).normal(size=VOCAB).astype(np.float32)
  with_bias = {**params, 'decoder': {**params['decoder'], 'logits_bias': jnp.asarray(bias)}}
  same = {k: v for k, v in with_bias['decoder'].items() if k != 'logits_bias'}
  without = _apply(plain, {**with_bias, 'decoder': same}, src, tgt)
  np.testing.assert_allclose(_apply(model, with_bias, src, tgt), without + bias, atol=1e-5)


def _scaled_query_and_key_kernels(params, factor):
  """`params` with every attention's query and key projections multiplied by `factor`."""

  def scale(tree):
    if not isinstance(tree, dict):
      return tree
    return {
      k: jax.tree.map(lambda x: x * factor, v) if k in ('query', 'key') else scale(v)
      for k, v in tree.items()
    }

  return scale(params)


def test_qk_norm_normalises_each_heads_queries_and_keys():
  model, params = _model_and_params('qk_norm')
  plain, plain_params = _model_and_params('paper')
  src, tgt = _random_tokens(1, (2, 8)), _random_tokens(2, (2, 6))
  # Its own scale over the head dimension, for queries and keys of every attention.
  attention = params['decoder']['layer_0']['cross_attention']
  assert attention['query_norm']['scale'].shape == (8,)  # d_model 16 / 2 heads.
  assert attention['key_norm']['scale'].shape == (8,)
  assert 'query_norm' not in plain_params['decoder']['layer_0']['cross_attention']
  # Normalised: queries and keys 10 times larger change no logit (LayerNorm(10 x) = LayerNorm(x)
  # up to its epsilon), while the paper's dot products grow 100-fold.
  logits = _apply(model, params, src, tgt)
  larger = _apply(model, _scaled_query_and_key_kernels(params, 10.0), src, tgt)
  np.testing.assert_allclose(larger, logits, atol=1e-4)
  plain_logits = _apply(plain, plain_params, src, tgt)
  plain_larger = _apply(plain, _scaled_query_and_key_kernels(plain_params, 10.0), src, tgt)
  assert not np.allclose(plain_larger, plain_logits, atol=1e-2)


def test_runs_from_before_qk_norm_read_it_as_off():
  config = default.get_config()
  del config.model['qk_norm']  # A WORKDIR/config.json written before the switch existed.
  assert ModelConfig.from_config(runs.upgrade(config)).qk_norm is False


def test_rmsnorm_divides_by_root_mean_square_and_scales():
  rmsnorm = layers.norm(_config(norm='rmsnorm'), 'norm')
  params = {'scale': jnp.asarray([1.0, 2.0])}
  out = rmsnorm.apply({'params': params}, jnp.asarray([[3.0, 4.0]], jnp.bfloat16))
  # mean(x^2) = 12.5, rms = 3.5355339: [3, 4] / rms * [1, 2] = [0.8485281, 2.2627417].
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out[0], [0.8485281, 2.2627417], rtol=1e-5)


# --- Config: validation and the paper's defaults ------------------------------------------------


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('norm', 'batch_norm', "config.model.norm='batch_norm' is not one of"),
    ('position', 'foo', "config.model.position='foo' is not one of"),
    ('ffn_activation', 'tanh', "config.model.ffn_activation='tanh' is not one of"),
  ],
)
def test_from_config_rejects_unknown_switch_values(key, value, message):
  config = default.get_config()
  config.model[key] = value
  with pytest.raises(ValueError, match=message):
    ModelConfig.from_config(config)


def test_rope_needs_an_even_head_dim():
  config = default.get_config()
  config.model.position, config.model.d_model, config.model.num_heads = 'rope', 24, 8
  with pytest.raises(ValueError, match="config.model.position='rope'.*must be even"):
    ModelConfig.from_config(config)
  with pytest.raises(ValueError, match='must be even'):
    _config(position='rope', d_model=6, num_heads=2)


def test_configs_saved_before_the_switches_load_as_the_paper_model():
  config = default.get_config()
  for key in ('architecture', 'position', 'ffn_activation', 'use_bias'):
    del config.model[key]
  for key in ('norm_epsilon', 'logits_bias'):
    del config.model[key]  # As in a WORKDIR/config.json written before they existed.
  del config.grad_clip_norm, config.mesh.rules
  upgraded = runs.upgrade(config)
  assert 'position' not in config.model  # A copy: the config read stays as it was.
  cfg = ModelConfig.from_config(upgraded)
  assert (cfg.architecture, cfg.position, cfg.ffn_activation, cfg.use_bias) == (
    'encoder_decoder',
    'sinusoidal',
    'relu',
    True,
  )
  assert (cfg.norm_epsilon, cfg.logits_bias) == (1e-6, False)
  assert upgraded.grad_clip_norm == 0.0
  assert list(upgraded.mesh.rules) == list(default.get_config().mesh.rules)
  config_lib.validate(upgraded, num_devices=1)


def test_defaults_are_the_papers_base_model():
  cfg = ModelConfig.from_config(default.get_config())
  assert (cfg.norm, cfg.position, cfg.ffn_activation, cfg.use_bias) == (
    'post_ln',
    'sinusoidal',
    'relu',
    True,
  )
  from configs import wmt14_ende_base

  config = wmt14_ende_base.get_config()
  config.vocab_size = 37000
  params = summary.abstract_params(Transformer(ModelConfig.from_config(config)))
  assert summary.parameter_table(params)[1] == 63_082_496


# --- Every switch value through the model's properties ------------------------------------------


@pytest.mark.parametrize('variant', ['paper', *VARIANTS])
def test_every_parameter_has_one_logical_name_per_dimension_for_sharding(variant):
  _, boxed = _model_and_boxed_params(variant)
  leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=lambda x: hasattr(x, 'names'))
  assert leaves
  names = {jax.tree_util.keystr(path): leaf.names for path, leaf in leaves}
  for path, leaf in leaves:
    assert len(leaf.names) == leaf.value.ndim, (path, leaf.names, leaf.value.shape)
  has = lambda part: any(part in path for path in names)
  assert has("'final_norm'") == (variant in ('rmsnorm', 'pre_ln'))
  assert has("'bias'") == (variant != 'no_bias')
  assert has("'position_embedding'") == (variant == 'learned')
  assert has("'encoder'") == has("'cross_attention'") == (variant != 'decoder_only')
  if variant == 'rmsnorm':  # RMSNorm has no bias, but the Dense layers keep theirs.
    assert not any('norm' in path and 'bias' in path for path in names)
    assert has("'ffn']['wi']['bias'")
  if variant == 'learned':
    assert names["['encoder']['position_embedding']['embedding']"] == ('length', 'embed')
  if variant == 'swiglu':
    assert names["['encoder']['layer_0']['ffn']['wv']['kernel']"] == ('embed', 'mlp')
  if variant == 'grouped_query':  # Key/value heads split over the tensor axis as heads are.
    attention_tree = nn.meta.unbox(boxed)['encoder']['layer_0']['self_attention']
    assert attention_tree['query']['kernel'].shape == (16, 4, 4)
    assert attention_tree['key']['kernel'].shape == attention_tree['value']['kernel'].shape
    assert attention_tree['key']['kernel'].shape == (16, 2, 4)
    assert names["['encoder']['layer_0']['self_attention']['key']['kernel']"] == (
      'embed',
      'heads',
      'kv',
    )


@pytest.mark.parametrize('variant', ['paper', *VARIANTS])
def test_future_target_tokens_do_not_leak(variant):
  model, params = _model_and_params(variant)
  src, tgt = jnp.repeat(_random_tokens(2, (1, 8)), 2, axis=0), _random_tokens(3, (6,))
  # Row 0 is the original target; row t + 1 changes token t + 1. Run two rows at a time:
  # the shapes of the cached-decoding test, so that eager ops are compiled once for both.
  rows = jnp.stack(
    [tgt] + [tgt.at[t + 1].set(3 + (tgt[t + 1] - 2) % (VOCAB - 3)) for t in range(5)]
  )
  logits = jnp.concatenate([_apply(model, params, src, rows[i : i + 2]) for i in range(0, 6, 2)])
  for t in range(5):
    np.testing.assert_allclose(logits[t + 1, : t + 1], logits[0, : t + 1], atol=1e-5)
    assert not np.allclose(logits[t + 1, t + 1 :], logits[0, t + 1 :], atol=1e-5)


@pytest.mark.parametrize('variant', ['paper', *VARIANTS])
def test_padding_does_not_change_outputs_of_real_tokens(variant):
  model, params = _model_and_params(variant)
  # Shapes as in the packing test below: eager ops compiled for one are reused.
  src, tgt = _random_tokens(0, (1, 4)), _random_tokens(1, (1, 4))
  padded_src = jnp.concatenate([src, jnp.zeros((1, 4), jnp.int32)], axis=1)
  padded_tgt = jnp.concatenate([tgt, jnp.zeros((1, 2), jnp.int32)], axis=1)
  if model.config.has_encoder:
    np.testing.assert_allclose(
      model.apply({'params': params}, padded_src, method=Transformer.encode)[:, :4],
      model.apply({'params': params}, src, method=Transformer.encode),
      atol=1e-5,
    )
  np.testing.assert_allclose(
    _apply(model, params, padded_src, padded_tgt)[:, :4], _apply(model, params, src, tgt), atol=1e-5
  )


@pytest.mark.parametrize('variant', ['paper', *VARIANTS])
def test_packed_rows_equal_separate_examples(variant):
  model, params = _model_and_params(variant)
  src_a, src_b = _random_tokens(6, (1, 4)), _random_tokens(7, (1, 3))
  tgt_a, tgt_b = _random_tokens(8, (1, 4)), _random_tokens(9, (1, 2))
  packed = _apply(
    model,
    params,
    jnp.concatenate([src_a, src_b, jnp.zeros((1, 1), jnp.int32)], 1),
    jnp.concatenate([tgt_a, tgt_b], 1),
    src_segments_BS=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
    tgt_segments_BL=jnp.array([[1, 1, 1, 1, 2, 2]]),
    src_positions_BS=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
    tgt_positions_BL=jnp.array([[0, 1, 2, 3, 0, 1]]),
  )
  np.testing.assert_allclose(packed[:, :4], _apply(model, params, src_a, tgt_a), atol=1e-5)
  np.testing.assert_allclose(packed[:, 4:], _apply(model, params, src_b, tgt_b), atol=1e-5)


@pytest.mark.parametrize('variant', ['paper', 'decoder_only'])
def test_changing_one_packed_example_leaves_the_others_logits_unchanged(variant):
  model, params = _model_and_params(variant)
  # Three examples (documents, for the language model) packed in one row, then example 2
  # (source and target) replaced: examples 1 and 3 must not notice.
  segments = jnp.array([[1, 1, 1, 2, 2, 2, 3, 3]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 0, 1]])
  src, tgt = _random_tokens(11, (1, 8)), _random_tokens(12, (1, 8))
  changed = lambda tokens: tokens.at[0, 3:6].set(3 + (tokens[0, 3:6] - 2) % (VOCAB - 3))
  run = lambda src, tgt: _apply(
    model,
    params,
    src,
    tgt,
    src_segments_BS=segments,
    tgt_segments_BL=segments,
    src_positions_BS=positions,
    tgt_positions_BL=positions,
  )
  before, after = run(src, tgt), run(changed(src), changed(tgt))
  others = np.array([0, 1, 2, 6, 7])
  np.testing.assert_allclose(after[:, others], before[:, others], atol=1e-5)
  assert not np.allclose(after[:, 3:6], before[:, 3:6], atol=1e-3)


@pytest.mark.parametrize('variant', ['rope', 'alibi'])
def test_relative_positions_ignore_a_shift_of_all_positions(variant):
  model, params = _model_and_params(variant)
  src, tgt = _random_tokens(4, (1, 4)), _random_tokens(5, (1, 4))
  shift = lambda tokens, offset: jnp.arange(tokens.shape[1])[None] + offset
  np.testing.assert_allclose(
    _apply(model, params, src, tgt, src_positions_BS=shift(src, 7), tgt_positions_BL=shift(tgt, 3)),
    _apply(model, params, src, tgt),
    atol=1e-4,
  )


def assert_cached_decoding_matches_full_pass(model, params) -> None:
  """Step-by-step cached decoder logits equal the full forward pass (rows of two lengths)."""
  rng = np.random.default_rng(10)
  vocab = model.config.vocab_size
  src = jnp.asarray(rng.integers(3, vocab, size=(2, 7)), jnp.int32)
  src = src.at[:, 5:].set(0).at[1, 3:].set(0)  # Padding, and rows of different lengths.
  tgt = jnp.asarray(rng.integers(3, vocab, size=(2, 6)), jnp.int32)
  full = _apply(model, params, src, tgt)

  decoder = Transformer(model.config.replace(decode=True, max_decode_len=6))
  src_segments, encoded = None, None  # A decoder-only model has neither.
  if model.config.has_encoder:
    src_segments = (src != 0).astype(jnp.int32)
    encoded = decoder.apply({'params': params}, src, method=Transformer.encode)
  _, cache = decoder.apply(
    {'params': params},
    encoded,
    src_segments,
    tgt[:, :1],
    method=Transformer.decode,
    mutable=['cache'],
  )
  for t in range(6):
    logits, cache = decoder.apply(
      {'params': params, **cache},
      encoded,
      src_segments,
      tgt[:, t : t + 1],
      method=Transformer.decode,
      mutable=['cache'],
    )
    np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('variant', ['paper', *VARIANTS])
def test_cached_decoding_equals_full_forward_pass(variant):
  model, params = _model_and_params(variant)
  assert_cached_decoding_matches_full_pass(model, params)


def _repeated_kv_heads(params, group: int):
  """Grouped-query parameters as multi-head ones: each key/value head repeated for the
  `group` query heads it serves (head h reads key/value head h // group)."""

  def repeat(path, leaf):
    names = [getattr(p, 'key', None) for p in path]
    if 'key' in names[-2:] or 'value' in names[-2:]:
      return jnp.repeat(leaf, group, axis=1 if names[-1] == 'kernel' else 0)
    return leaf

  return jax.tree_util.tree_map_with_path(repeat, params)


def test_grouped_query_attention_is_multi_head_attention_with_repeated_kv_heads():
  from transformer import inference
  from transformer.tasks.translation import decode

  model, params = _model_and_params('grouped_query')
  multi_head = Transformer(model.config.replace(num_kv_heads=4))
  repeated = _repeated_kv_heads(params, 2)
  tokens = jnp.ones((1, 8), jnp.int32)
  shapes = jax.eval_shape(lambda: multi_head.init(jax.random.key(0), tokens, tokens)['params'])
  assert jax.tree.map(jnp.shape, repeated) == jax.tree.map(jnp.shape, nn.meta.unbox(shapes))
  src, tgt = _random_tokens(4, (2, 8)), _random_tokens(5, (2, 6))
  np.testing.assert_allclose(
    _apply(model, params, src, tgt), _apply(multi_head, repeated, src, tgt), atol=1e-5
  )
  src = src.at[1, 6:].set(0)  # A padded row too.
  for decoder, beam_size in (('greedy', 1), ('beam', 3)):
    options = inference.DecodeOptions(
      decoder=decoder, beam_size=beam_size, alpha=0.6, max_extra_len=5
    )
    tokens = [
      np.asarray(
        decode.translate(p, src, jax.random.key(0), model_config=c, options=options).tokens
      )
      for p, c in ((params, model.config), (repeated, multi_head.config))
    ]
    np.testing.assert_array_equal(*tokens)


def test_grouped_query_attention_caches_fewer_heads():
  model, params = _model_and_params('grouped_query')
  decoder = Transformer(model.config.replace(decode=True, max_decode_len=8))
  src = _random_tokens(6, (1, 8))
  encoded = decoder.apply({'params': params}, src, method=Transformer.encode)
  _, cache = decoder.apply(
    {'params': params},
    encoded,
    (src != 0).astype(jnp.int32),
    jnp.ones((1, 1), jnp.int32),
    method=Transformer.decode,
    mutable=['cache'],
  )
  layer = cache['cache']['decoder']['layer_0']
  # [B, G, K, S]: 2 key/value heads where multi-head attention caches 4.
  assert layer['self_attention']['cached_key'].shape == (1, 2, 4, 8)
  assert layer['self_attention']['cached_value'].shape == (1, 2, 4, 8)
  assert layer['cross_attention']['cross_key'].shape == (1, 2, 4, 8)


def test_num_kv_heads_follows_num_heads_and_must_divide_it():
  config = tiny.get_config()
  assert config.model.num_kv_heads == config.model.num_heads
  config.model.num_heads = 8  # An override of num_heads moves it along ...
  assert config.model.num_kv_heads == 8
  config.model.num_kv_heads = 2  # ... until it is set itself.
  config.model.num_heads = 4
  assert (config.model.num_heads, config.model.num_kv_heads) == (4, 2)
  assert ModelConfig.from_config(config).num_kv_heads == 2
  # A sweep's trial setting num_heads moves it along too (its copy keeps the reference).
  from transformer.tools import sweeps

  trial = sweeps.apply_overrides(tiny.get_config(), {'model.num_heads': 8})
  assert (trial.model.num_heads, trial.model.num_kv_heads) == (8, 8)
  config.model.num_kv_heads = 3
  assert config_lib.config_errors(config) == [
    'config.model.num_kv_heads=3 must divide config.model.num_heads=4: each key/value head '
    'serves a group of query heads.'
  ]
  config.model.num_kv_heads, config.mesh.tensor = 1, 2
  assert (
    'config.model.num_kv_heads=1 does not divide over config.mesh.tensor=2, which splits the '
    'key/value heads: choose a multiple of it, or a smaller config.mesh.tensor.'
  ) in config_lib.config_errors(config)
  saved = runs.flatten(config)  # A run written before the field: as many as its heads.
  del saved['model.num_kv_heads']
  older = runs.upgrade(ml_collections.ConfigDict(_unflatten(saved)))
  assert older.model.num_kv_heads == older.model.num_heads == 4


def _unflatten(flat: dict) -> dict:
  nested: dict = {}
  for key, value in flat.items():
    *groups, leaf = key.split('.')
    target = nested
    for group in groups:
      target = target.setdefault(group, {})
    target[leaf] = value
  return nested


@pytest.mark.parametrize('variant', ['paper', *VARIANTS, 'untied'])
def test_flops_per_token_agrees_with_xlas_count_of_the_compiled_model(variant):
  """`summary.flops_per_token` (from the model's shapes) against XLA's cost analysis of the
  compiled forward pass and gradient, at a width where matmuls dominate. XLA also counts the
  elementwise ops (norms, softmax, activations: GELU's tanh approximation most, +8% here),
  which the model count leaves out; 10% holds for every variant, and a miscounted matrix
  (say, key/value projections counted at full width under grouped-query attention) is off
  by more."""
  switches = {'untied': dict(share_embeddings=False)}.get(variant, VARIANTS.get(variant, {}))
  base = dict(vocab_size=512, num_layers=2, d_model=128, num_heads=4, d_ff=512, max_len=64)
  cfg = ModelConfig(**{**base, 'deterministic': True, 'dropout_rate': 0.0, **switches})
  model, (batch, length) = Transformer(cfg), (4, 32)
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  src = tokens if cfg.has_encoder else None
  ones = jnp.ones((batch, length), jnp.int32)
  init = lambda: nn.meta.unbox(model.init(jax.random.key(0), ones if src else None, ones))
  params = jax.eval_shape(init)
  forward = lambda p, s, t: model.apply(p, s, t).astype(jnp.float32).mean()
  expected = summary.flops_per_token(cfg, length)
  for fn, kind in ((forward, 'forward'), (jax.grad(forward), 'train')):
    lowered = jax.jit(fn).lower(params, src, tokens)  # Unoptimised: compiles 2x faster,
    analysis = lowered.compile({'xla_backend_optimization_level': 0}).cost_analysis()  # same.
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    ratio = analysis['flops'] / (batch * length * expected[kind])
    assert 0.9 < ratio < 1.1, (variant, kind, ratio)


# --- Every switch value trains: configs/tiny.py's model on a synthetic copy task ----------------

COPY_TOKENS = 16  # Tokens 3..18 of the vocabulary; the target repeats the source.


@functools.cache
def _train_losses(variant: str, steps: int = 25) -> list[float]:
  """Adam on fresh random copy batches; dropout off, so the losses measure learning only.

  The decoder-only model has no source to copy: its sequences count up from a random
  start (mod COPY_TOKENS), so every token after the first follows from the one before.
  """
  config = tiny.get_config()
  for key, value in VARIANTS[variant].items():
    config.model[key] = value
  model = Transformer(ModelConfig.from_config(config).replace(deterministic=True))
  tokens = jnp.ones((1, 10), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.key(0), _source(model, tokens), tokens)['params'])
  optimizer = optax.adam(3e-3)

  def step(params, opt_state, src_BL):
    tgt_in_BL = jnp.concatenate([jnp.ones_like(src_BL[:, :1]), src_BL[:, :-1]], axis=1)  # BOS 1.

    def loss_fn(params):
      logits = _apply(model, params, src_BL, tgt_in_BL)
      return optax.softmax_cross_entropy_with_integer_labels(logits, src_BL).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(0)
  if model.config.has_encoder:
    batches = [
      jnp.asarray(rng.integers(3, 3 + COPY_TOKENS, (32, 10)), jnp.int32) for _ in range(steps)
    ]
  else:
    batches = [
      jnp.asarray(
        3 + (rng.integers(0, COPY_TOKENS, (32, 1)) + np.arange(10)) % COPY_TOKENS, jnp.int32
      )
      for _ in range(steps)
    ]
  opt_state, losses = optimizer.init(params), []
  # Unoptimised CPU code compiles 2-3x faster, and 25 tiny steps need no speed.
  step = (
    jax.jit(step)
    .lower(params, opt_state, batches[0])
    .compile({'xla_backend_optimization_level': 0})
  )
  for src_BL in batches:
    params, opt_state, loss = step(params, opt_state, src_BL)
    losses.append(float(loss))
  return losses


@pytest.mark.parametrize('variant', VARIANTS)
def test_tiny_model_trains_with_falling_loss(variant):
  losses = _train_losses(variant)
  assert all(math.isfinite(loss) for loss in losses), losses
  first, last = np.mean(losses[:3]), np.mean(losses[-3:])
  assert last < 0.6 * first, (variant, losses)
