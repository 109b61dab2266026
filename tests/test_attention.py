"""Scaled dot-product attention and masks on hand-computed cases; the fused path equals it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from transformer import attention, config_rules, runs, training
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.tasks import translation


def test_dot_product_attention_matches_hand_computation():
  # One batch, one head, d_k = 4; two queries over three keys.
  q = np.array([[1.0, 0, 0, 0], [0, 2.0, 0, 0]], np.float32)
  k = np.array([[2.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 0, 0]], np.float32)
  v = np.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]], np.float32)
  out, weights = attention.dot_product_attention(
    q[None, :, None], k[None, :, None], v[None, :, None], mask_B1LS=None
  )
  # Eq. 1 by hand: logits = q k^T / sqrt(4).
  logits = np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
  expected_w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(weights[0, 0], expected_w, rtol=1e-6)
  np.testing.assert_allclose(out[0, :, 0], expected_w @ v, rtol=1e-6)


def test_masked_keys_get_zero_weight_and_do_not_change_output():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(1, 2, 2, 4)).astype(np.float32) for _ in range(3))
  mask = jnp.array([True, False])[None, None, None, :]
  out, weights = attention.dot_product_attention(q, k, v, mask)
  np.testing.assert_allclose(weights[..., 1], 0.0, atol=0)
  # Only key 0 is visible: every query returns value 0 exactly.
  np.testing.assert_allclose(out, np.broadcast_to(v[:, :1], out.shape), rtol=1e-6)


def test_segment_mask_is_padding_mask_and_separates_packed_examples():
  segments = jnp.array([[1, 1, 2, 0]])
  mask = np.asarray(attention.segment_mask(segments, segments))[0, 0]
  expected = np.array(
    [
      [1, 1, 0, 0],
      [1, 1, 0, 0],
      [0, 0, 1, 0],
      [0, 0, 0, 0],  # Padding attends nowhere (and is never attended).
    ],
    dtype=bool,
  )
  np.testing.assert_array_equal(mask, expected)


def test_causal_mask_is_lower_triangular():
  mask = np.asarray(attention.causal_mask(3))[0, 0]
  np.testing.assert_array_equal(mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


# --- The fused path (`jax.nn.dot_product_attention`) equals the einsum -------------------------
# On CPU, 'xla' sends attention through jax.nn.dot_product_attention with the arguments cuDNN
# gets on a GPU (mask, is_causal, bias); 'auto' is the einsum there.

D_MODEL, HEADS = 16, 2
# Two packed rows: segments 1, 2, ... with padding (0) at the end; positions restart per segment.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 2, 2]], np.int32)
POSITIONS = np.array([[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]], np.int32)
PADDED = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int32)  # One sequence per row.
SOURCE_SEGMENTS = np.array([[1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 2, 0, 0, 0, 0]], np.int32)

# name -> (config overrides, MultiHeadAttention fields, query segments, key/value segments).
CASES = {
  'padding': ({}, {}, PADDED, PADDED),
  'packed segments': ({}, {}, SEGMENTS, SEGMENTS),
  'causal': ({}, {'causal': True}, SEGMENTS, SEGMENTS),
  'cross': ({}, {'is_cross_attention': True}, SEGMENTS, SOURCE_SEGMENTS),
  'alibi': ({'position': 'alibi'}, {'causal': True}, SEGMENTS, SEGMENTS),
  'rope': ({'position': 'rope'}, {'causal': True}, SEGMENTS, SEGMENTS),
}


def _mha(overrides, fields, impl):
  cfg = ModelConfig(
    vocab_size=16, d_model=D_MODEL, num_heads=HEADS, attention_impl=impl, **overrides
  )
  return attention.MultiHeadAttention(cfg, **fields)


def _outputs_and_grads(name, impl):
  """Outputs of a MultiHeadAttention call and the gradients of a loss on them."""
  overrides, fields, q_segments, kv_segments = CASES[name]
  x_q = jax.random.normal(jax.random.key(1), (*q_segments.shape, D_MODEL))
  x_kv = jax.random.normal(jax.random.key(2), (*kv_segments.shape, D_MODEL))
  if not fields.get('is_cross_attention'):
    x_kv = x_q
  mask = attention.segment_mask(jnp.asarray(q_segments), jnp.asarray(kv_segments))
  positions = jnp.asarray(POSITIONS)
  module = _mha(overrides, fields, impl)
  params = module.init(
    jax.random.key(0), x_q, x_kv, mask, positions_BL=positions, deterministic=True
  )['params']

  def loss(params, x_q, x_kv):
    out = module.apply(
      {'params': params}, x_q, x_kv, mask, positions_BL=positions, deterministic=True
    )
    # Padding queries are left out, as the loss leaves them out.
    return jnp.sum(jnp.where(q_segments[..., None] > 0, jnp.sin(out), 0.0)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
    params, x_q, x_kv
  )
  return out, grads


@pytest.mark.parametrize('name', CASES)
def test_fused_path_equals_einsum(name, monkeypatch):
  calls = []
  fused = attention.fused_attention
  monkeypatch.setattr(
    attention, 'fused_attention', lambda *a, **k: calls.append(k) or fused(*a, **k)
  )
  einsum_out, einsum_grads = _outputs_and_grads(name, 'auto')  # On CPU: the einsum.
  assert not calls
  fused_out, fused_grads = _outputs_and_grads(name, 'xla')
  assert calls and calls[0]['implementation'] == 'xla'
  assert calls[0]['causal'] == CASES[name][1].get('causal', False)
  real = CASES[name][2] > 0
  np.testing.assert_allclose(fused_out[real], einsum_out[real], rtol=1e-5, atol=1e-6)
  # Padding queries attend nowhere: both paths give them the mean of the values.
  np.testing.assert_allclose(fused_out, einsum_out, rtol=1e-5, atol=1e-6)
  for fused_grad, einsum_grad in zip(
    jax.tree.leaves(fused_grads), jax.tree.leaves(einsum_grads), strict=True
  ):
    np.testing.assert_allclose(fused_grad, einsum_grad, rtol=1e-4, atol=1e-6)


def test_attention_maps_take_the_einsum_whatever_the_switch():
  module = _mha({}, {'causal': True}, 'xla')
  x = jax.random.normal(jax.random.key(1), (*SEGMENTS.shape, D_MODEL))
  mask = attention.segment_mask(jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS))
  params = module.init(jax.random.key(0), x, x, mask, deterministic=True)['params']
  fused = module.apply({'params': params}, x, x, mask, deterministic=True)
  out, state = module.apply(
    {'params': params}, x, x, mask, deterministic=True, mutable=['intermediates']
  )
  (weights,) = state['intermediates']['attention_weights']
  assert weights.shape == (2, HEADS, 6, 6)
  np.testing.assert_allclose(np.triu(weights[1, 0], 1), 0.0)  # Causal.
  np.testing.assert_allclose(out, fused, rtol=1e-5, atol=1e-6)


def test_cached_decoding_equals_with_either_path():
  """The fused encoder, then the einsum over the cache, give the einsum's logits at every step."""
  logits = {}
  for impl in ('auto', 'xla'):
    cfg = ModelConfig(
      vocab_size=24,
      num_layers=2,
      d_model=D_MODEL,
      num_heads=HEADS,
      d_ff=32,
      position='rope',
      deterministic=True,
      attention_impl=impl,
    )
    tokens = jnp.ones((1, 4), jnp.int32)
    params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(3), tokens, tokens)['params'])
    src_BS = jnp.asarray(np.where(PADDED > 0, np.arange(4, 10), 0))
    tgt_BL = jnp.asarray(np.arange(5, 9)[None].repeat(2, 0))  # Teacher-forced steps.

    @jax.jit
    def steps(params, src_BS, tgt_BL, cfg=cfg):
      model, state = translation.decode._init_state(params, src_BS, cfg, max_decode_len=4)
      step = translation.decode._logits_fn(model, params)
      _, logits_LBV = jax.lax.scan(lambda s, t_B: step(t_B[:, None], s)[::-1], state, tgt_BL.T)
      return logits_LBV

    logits[impl] = steps(params, src_BS, tgt_BL)
  np.testing.assert_allclose(logits['xla'], logits['auto'], rtol=1e-5, atol=1e-5)


def _choice(monkeypatch, backend, impl, dtype='bfloat16', d_model=512, heads=8, **kwargs):
  monkeypatch.setattr(jax, 'default_backend', lambda: backend)
  cfg = ModelConfig(
    vocab_size=16,
    d_model=d_model,
    num_heads=heads,
    attention_impl=impl,
    dtype=config_lib.DTYPES[dtype],
  )
  return attention.implementation(cfg, 256, 256, **{'einsum_only': False, 'bias': False, **kwargs})


def test_auto_fuses_on_gpus_in_bfloat16_where_cudnn_takes_the_call(monkeypatch):
  assert _choice(monkeypatch, 'gpu', 'auto') == 'cudnn'
  assert _choice(monkeypatch, 'gpu', 'auto', d_model=1024, heads=16) == 'cudnn'  # Big: K = 64.
  assert _choice(monkeypatch, 'cpu', 'auto') is None
  assert _choice(monkeypatch, 'tpu', 'auto') == 'pallas'  # tests/test_tpu_attention.py.
  assert _choice(monkeypatch, 'gpu', 'auto', dtype='float32') is None
  assert _choice(monkeypatch, 'gpu', 'auto', d_model=36, heads=3) is None  # K = 12.
  assert _choice(monkeypatch, 'gpu', 'auto', d_model=512, heads=2) is None  # K = 256.
  assert _choice(monkeypatch, 'gpu', 'auto', bias=True) is None  # ALiBi.
  assert _choice(monkeypatch, 'gpu', 'auto', einsum_only=True) is None  # Maps, dropout, caches.
  assert _choice(monkeypatch, 'cpu', 'xla') == 'xla'
  assert _choice(monkeypatch, 'gpu', 'cudnn', bias=True) == 'cudnn'
  assert _choice(monkeypatch, 'gpu', 'cudnn', einsum_only=True) is None
  assert _choice(monkeypatch, 'cpu', 'cudnn') == 'xla'  # A cuDNN run's eval.py on a CPU.


def test_cudnn_is_an_error_naming_the_key_without_bfloat16_or_a_gpu(tmp_path):
  config = tiny.get_config()
  config.model.attention_impl = 'cudnn'
  with pytest.raises(config_lib.ConfigError, match=r"attention_impl='cudnn' runs in bfloat16"):
    config_lib.validate(config, num_devices=1)
  config.dtype = 'bfloat16'
  config_lib.validate(config, num_devices=1)
  assert config_rules.platform_errors(config, 'gpu') == []
  workdir = tmp_path / 'run'
  with pytest.raises(config_lib.ConfigError, match=r"attention_impl='cudnn' needs NVIDIA GPUs"):
    training.train_and_evaluate(config, str(workdir))  # Before anything is read or written.
  assert not workdir.exists()
  config.model.attention_impl = 'flash'
  with pytest.raises(config_lib.ConfigError, match=r"attention_impl='flash' is not one of"):
    config_lib.validate(config, num_devices=1)


def test_runs_saved_before_the_switches_load_with_the_einsum_on_cpus_and_no_remat():
  config = tiny.get_config()
  del config.model.attention_impl, config.model.remat  # A config.json written before them.
  cfg = ModelConfig.from_config(runs.upgrade(config))
  assert (cfg.attention_impl, cfg.remat) == ('auto', 'none')
  assert attention.implementation(cfg, 8, 8, einsum_only=False, bias=False) is None  # On CPUs.
