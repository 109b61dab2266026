"""TPUs' splash attention (Pallas) equals the XLA path, outputs and gradients, on the CPU.

The kernel runs in Pallas' interpret mode here (`tpu_attention.attention` interprets it where
the program is not compiled for TPUs): the same blocks and arithmetic as on a TPU, as XLA
operations. It is checked against `jax.nn.dot_product_attention`'s XLA implementation
(`attention_impl='xla'`, which tests/test_attention.py checks against the einsum) at the base
model's head shape (8 heads of 64) on rows of 256 tokens, sharded over a mesh of 4 CPU devices
as on a TPU slice: padding, packed segments, causal, cross-attention with L != S,
grouped-query attention and lengths the kernel takes only padded (`TOLERANCE`). Then the
model's own calls (encoder, causal decoder, cross-attention; RoPE, GQA) through the kernel,
what 'auto' and 'pallas' choose, and the configs refused. tests/test_tpu_compile.py compiles
the kernel for TPUs.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from transformer import attention, config_fields, config_rules, sharding, tpu_attention
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.model import Transformer

# Float32 on both paths, which sum the same products in other orders: differences within
# 1e-5 of the largest magnitude of what is compared (measured at most 1.3e-6).
TOLERANCE = 1e-5
HEADS, HEAD_DIM = 8, 64  # The base model's: d_model 512.


def _segments(lengths: list[list[int]], total: int) -> np.ndarray:
  """Rows of packed examples of these lengths (segments 1, 2, ...), then padding (0)."""
  rows = []
  for row in lengths:
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(row)])
    rows.append(np.pad(ids, (0, total - len(ids))))
  return np.asarray(rows, np.int32)


# name -> (query segments, key/value segments, causal, key/value heads). Rows end in padding.
CASES = {
  # The encoder: one sentence per row, and packed sentences.
  'padding, packed': (
    _segments([[200], [70, 150]], 256),
    _segments([[200], [70, 150]], 256),
    False,
    HEADS,
  ),
  # The decoder's self-attention on packed rows.
  'packed causal': (
    _segments([[70, 100, 50], [256]], 256),
    _segments([[70, 100, 50], [256]], 256),
    True,
    HEADS,
  ),
  # Targets of 256 over sources of 128, each example's with its own; 2 key/value heads.
  'cross, grouped-query': (
    _segments([[100, 120], [30, 200]], 256),
    _segments([[60, 50], [20, 100]], 128),
    False,
    2,
  ),
  # 96 tokens: padded to 128 by `tpu_attention.attention`.
  'lengths not of 128': (
    _segments([[40, 50], [96]], 96),
    _segments([[40, 50], [96]], 96),
    True,
    HEADS,
  ),
}
# Rows over 'data', heads over 'tensor' (`sharding.LOGICAL_AXIS_RULES`): the kernel runs in
# `jax.shard_map`, each device on its own rows and heads, as on a TPU slice.
MESH = {'mesh.data': 2, 'mesh.fsdp': 1, 'mesh.tensor': 2}


def _assert_close(actual, expected, scale, what):
  np.testing.assert_allclose(actual, expected, atol=TOLERANCE * scale, rtol=0, err_msg=what)


def _dense_mask(q_segments, kv_segments, causal):
  mask = attention.segment_mask(q_segments, kv_segments)
  return mask & attention.causal_mask(q_segments.shape[1]) if causal else mask


@pytest.mark.parametrize('name', CASES)
def test_kernel_equals_xla_outputs_and_gradients_on_a_mesh(name):
  q_segments, kv_segments, causal, kv_heads = CASES[name]
  q_segments, kv_segments = jnp.asarray(q_segments), jnp.asarray(kv_segments)
  (batch, length), kv_length = q_segments.shape, kv_segments.shape[1]
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, length, HEADS, HEAD_DIM))
  k, v = (jax.random.normal(key, (batch, kv_length, kv_heads, HEAD_DIM)) for key in keys[1:])
  real = (q_segments > 0)[..., None, None]  # The loss leaves padding queries out.

  def loss(impl, q, k, v):
    out = attention.fused_attention(
      q,
      k,
      v,
      _dense_mask(q_segments, kv_segments, causal) if impl == 'xla' else None,
      causal=False if impl == 'xla' else causal,
      implementation=impl,
      segments=(q_segments, kv_segments),
    )
    return jnp.sum(jnp.where(real, jnp.sin(out), 0.0)), out

  config = config_fields.with_values(tiny.get_config(), MESH)
  mesh = sharding.create_mesh(config.mesh, jax.devices()[:4])
  results = {}
  for impl in ('pallas', 'xla'):
    grad_fn = jax.jit(jax.value_and_grad(functools.partial(loss, impl), (0, 1, 2), has_aux=True))
    with sharding.activated(mesh, sharding.axis_rules(config.mesh)):
      results[impl] = grad_fn(q, k, v)
  (_, kernel_out), kernel_grads = results['pallas']
  (_, xla_out), xla_grads = results['xla']
  real = np.asarray(q_segments > 0)
  assert np.isfinite(np.asarray(kernel_out)).all()  # Padding queries too.
  _assert_close(kernel_out[real], xla_out[real], np.abs(xla_out).max(), 'outputs')
  for kernel_grad, xla_grad, what in zip(kernel_grads, xla_grads, 'qkv', strict=True):
    _assert_close(kernel_grad, xla_grad, np.abs(xla_grad).max(), f'gradient of {what}')


def _positions(segments: np.ndarray) -> np.ndarray:
  """Each token's position within its example."""
  index = np.arange(segments.shape[1])
  starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=-1) != 0, index, 0), axis=1)
  return index - starts


def test_the_models_calls_through_the_kernel_equal_xla(monkeypatch):
  """A translation model with RoPE and 2 key/value heads on packed rows of 128 tokens a side:
  its encoder self-attention, causal decoder self-attention and cross-attention all take the
  kernel under 'auto' when compiled for TPUs, with the segment ids the masks were built from,
  and its logits and gradients are XLA's."""
  cfg = ModelConfig(
    vocab_size=32,
    num_layers=1,
    d_model=64,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    position='rope',
    deterministic=True,
  )
  src_segments = _segments([[50, 70], [120]], 128)
  tgt_segments = _segments([[50, 60], [128]], 128)
  rng = np.random.default_rng(0)
  src = np.where(src_segments > 0, rng.integers(1, 32, src_segments.shape), 0)
  tgt = np.where(tgt_segments > 0, rng.integers(1, 32, tgt_segments.shape), 0)
  batch = (src, tgt, src_segments, tgt_segments, _positions(src_segments), _positions(tgt_segments))
  batch = [jnp.asarray(x) for x in batch]
  params = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), *batch)['params'])
  real = tgt_segments > 0

  @functools.partial(jax.jit, static_argnums=1)
  @functools.partial(jax.value_and_grad, has_aux=True)
  def loss(params, impl):
    logits = Transformer(cfg.replace(attention_impl=impl)).apply({'params': params}, *batch)
    return jnp.sum(jnp.where(real[..., None], jax.nn.log_softmax(logits), 0.0)), logits

  (_, xla_logits), xla_grads = loss(params, 'xla')
  calls = []
  kernel = tpu_attention.attention
  monkeypatch.setattr(tpu_attention, 'platform', lambda: 'tpu')  # As if compiled for TPUs,
  monkeypatch.setattr(  # the kernel interpreted.
    tpu_attention,
    'attention',
    lambda q, k, *a, **kw: (
      calls.append((q.shape[1], k.shape[1], kw['causal'])) or kernel(q, k, *a, **kw, interpret=True)
    ),
  )
  (_, kernel_logits), kernel_grads = loss(params, 'auto')
  assert sorted(calls) == [(128, 128, False), (128, 128, False), (128, 128, True)]
  _assert_close(kernel_logits[real], xla_logits[real], np.abs(xla_logits).max(), 'logits')
  # Against the largest gradient: some are 0 but for rounding (a key's bias shifts every logit
  # of a query alike), and differ in it.
  scale = max(np.abs(g).max() for g in jax.tree.leaves(xla_grads))
  for path, kernel_grad in jax.tree_util.tree_leaves_with_path(kernel_grads):
    xla_grad = functools.reduce(lambda tree, key: tree[key.key], path, xla_grads)
    _assert_close(kernel_grad, xla_grad, scale, jax.tree_util.keystr(path))


def _choice(monkeypatch, platform, impl, length=256, kv_length=256, **kwargs):
  monkeypatch.setattr(tpu_attention, 'platform', lambda: platform)
  cfg = ModelConfig(vocab_size=16, d_model=512, num_heads=8, attention_impl=impl)
  kwargs = {'einsum_only': False, 'bias': False, 'segments': True, **kwargs}
  return attention.implementation(cfg, length, kv_length, **kwargs)


def test_auto_takes_the_kernel_on_tpus_where_it_tiles_and_pallas_says_where_it_cannot(
  monkeypatch,
):
  assert _choice(monkeypatch, 'tpu', 'auto') == 'pallas'
  assert _choice(monkeypatch, 'tpu', 'auto', 256, 128) == 'pallas'  # Cross-attention.
  assert _choice(monkeypatch, 'tpu', 'auto', 96, 96) is None  # Not of 128: the einsum.
  assert _choice(monkeypatch, 'tpu', 'auto', bias=True) is None  # ALiBi.
  assert _choice(monkeypatch, 'tpu', 'auto', einsum_only=True) is None  # Maps, dropout, caches.
  assert _choice(monkeypatch, 'tpu', 'auto', segments=False) is None
  assert _choice(monkeypatch, 'cpu', 'auto') is None
  assert _choice(monkeypatch, 'tpu', 'xla') == 'xla'
  assert _choice(monkeypatch, 'tpu', 'pallas', 96, 96) == 'pallas'  # Padded to 128.
  assert _choice(monkeypatch, 'tpu', 'pallas', einsum_only=True) is None
  assert _choice(monkeypatch, 'tpu', 'pallas', bias=True) == 'xla'  # Refused by the config.
  assert _choice(monkeypatch, 'cpu', 'pallas') == 'xla'  # A TPU run's eval.py on a CPU.
  with pytest.raises(ValueError, match='segment ids'):
    _choice(monkeypatch, 'tpu', 'pallas', segments=False)


def test_the_platform_is_the_meshs_devices():
  assert tpu_attention.platform() == jax.default_backend() == 'cpu'  # No mesh.
  mesh = jax.sharding.Mesh(
    np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ('data', 'fsdp', 'tensor')
  )
  with jax.set_mesh(mesh):
    assert tpu_attention.platform() == 'cpu'


def test_pallas_is_refused_naming_the_key_where_the_kernel_cannot_serve_training():
  config = tiny.get_config()
  config.model.attention_impl = 'pallas'
  config_lib.validate(config, num_devices=1)
  assert config_rules.platform_errors(config, 'tpu') == []
  (error,) = config_rules.platform_errors(config, 'cpu')
  assert error.startswith("config.model.attention_impl='pallas' needs TPUs")
  config.model.position = 'alibi'
  config.model.attention_dropout_rate = 0.1
  with pytest.raises(config_lib.ConfigError) as raised:
    config_lib.validate(config, num_devices=1)
  message = str(raised.value)
  assert (
    "config.model.attention_impl='pallas' cannot take config.model.position='alibi': the TPU "
    'kernel (splash attention) adds no bias to the logits' in message
  )
  assert 'cannot take config.model.attention_dropout_rate=0.1' in message
