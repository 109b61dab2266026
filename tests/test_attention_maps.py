"""Attention maps come from the model's own forward pass and are plotted one figure per layer."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.image
import numpy as np
import pytest

from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.tools import attention_maps

VOCAB, LAYERS, D_MODEL, HEADS = 24, 2, 16, 2
SRC_LEN, TGT_LEN = 7, 5
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


@functools.cache
def _setup():
  cfg = ModelConfig(
    vocab_size=VOCAB,
    num_layers=LAYERS,
    d_model=D_MODEL,
    num_heads=HEADS,
    d_ff=32,
    deterministic=True,
  )
  tokens = jnp.ones((1, 4), jnp.int32)
  init = jax.jit(lambda key: Transformer(cfg).init(key, tokens, tokens)['params'])
  params = nn.meta.unbox(init(jax.random.key(1)))
  rng = np.random.default_rng(0)
  src = np.append(rng.integers(4, VOCAB, SRC_LEN - 1), tokenizer_lib.EOS_ID).astype(np.int32)
  tgt = np.append(rng.integers(4, VOCAB, TGT_LEN - 1), tokenizer_lib.EOS_ID).astype(np.int32)
  return cfg, params, src, tgt


@functools.cache
def _weights():
  cfg, params, src, tgt = _setup()
  return attention_maps.collect_attention(params, cfg, src, tgt)


def _labels():
  _, _, src, tgt = _setup()
  return [f's{t}' for t in src], [f't{t}' for t in tgt]


def _sinusoids(length: int, d_model: int) -> np.ndarray:
  """PE of section 3.5, written out independently of transformer.layers."""
  pe = np.zeros((length, d_model))
  for pos in range(length):
    for i in range(0, d_model, 2):
      pe[pos, i] = np.sin(pos / 10000 ** (i / d_model))
      pe[pos, i + 1] = np.cos(pos / 10000 ** (i / d_model))
  return pe


def _first_layer_weights(params, attention_params, tokens, causal: bool) -> np.ndarray:
  """softmax(q k^T / sqrt(d_k)) of a first layer, from the embeddings (post-LN), [H, N, N]."""
  embedding = np.asarray(params['shared_embedding']['embedding'], np.float64)
  x = embedding[tokens] * np.sqrt(D_MODEL) + _sinusoids(len(tokens), D_MODEL)

  def project(name):
    p = attention_params[name]
    return np.einsum('nd,dhk->hnk', x, np.asarray(p['kernel'])) + np.asarray(p['bias'])[:, None]

  q, k = project('query'), project('key')
  logits = np.einsum('hqk,hsk->hqs', q, k) / np.sqrt(D_MODEL // HEADS)
  if causal:
    logits = np.where(np.tril(np.ones((len(tokens),) * 2, bool)), logits, -np.inf)
  logits -= logits.max(-1, keepdims=True)
  return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def test_shapes_per_kind_and_layer():
  weights = _weights()
  assert set(weights) == set(attention_maps.KINDS)
  expected = {
    'encoder_self_attention': (HEADS, SRC_LEN, SRC_LEN),
    'decoder_self_attention': (HEADS, TGT_LEN, TGT_LEN),
    'cross_attention': (HEADS, TGT_LEN, SRC_LEN),
  }
  for kind, shape in expected.items():
    assert len(weights[kind]) == LAYERS
    for w in weights[kind]:
      assert w.shape == shape and w.dtype == np.float32


def test_rows_are_distributions_and_decoder_is_causal():
  weights = _weights()
  for kind in attention_maps.KINDS:
    for w in weights[kind]:
      assert (w >= 0).all()
      np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
  for w in weights['decoder_self_attention']:
    assert np.triu(w, k=1).max() < 1e-12  # No weight on future positions.
    assert (np.diagonal(w, axis1=1, axis2=2) > 0).all()


def test_weights_are_the_models_own():
  """Layer 0 recomputed by hand from the parameters equals what the model sowed."""
  cfg, params, src, tgt = _setup()
  weights = _weights()
  np.testing.assert_allclose(
    weights['encoder_self_attention'][0],
    _first_layer_weights(params, params['encoder']['layer_0']['self_attention'], src, False),
    atol=1e-5,
  )
  # The decoder reads [BOS] + target[:-1] (teacher forcing).
  tgt_in = [tokenizer_lib.BOS_ID, *tgt[:-1]]
  np.testing.assert_allclose(
    weights['decoder_self_attention'][0],
    _first_layer_weights(params, params['decoder']['layer_0']['self_attention'], tgt_in, True),
    atol=1e-5,
  )
  # Deeper layers differ from layer 0 (they are separate modules' weights).
  assert not np.allclose(weights['encoder_self_attention'][0], weights['encoder_self_attention'][1])


def test_padding_and_tokens_after_eos_are_excluded():
  cfg, params, src, tgt = _setup()
  padded_src = np.concatenate([src, np.zeros(3, np.int32)])[None]  # [1, S + 3]
  tgt_with_tail = np.concatenate([tgt, [7, 9], np.zeros(2, np.int32)])
  weights = attention_maps.collect_attention(params, cfg, padded_src, tgt_with_tail)
  for kind in attention_maps.KINDS:
    for got, want in zip(weights[kind], _weights()[kind], strict=True):
      np.testing.assert_allclose(got, want, atol=1e-6)


def test_plot_writes_one_png_per_kind_and_layer(tmp_path):
  backend = matplotlib.get_backend()
  src_labels, tgt_labels = _labels()
  paths = attention_maps.plot_attention(_weights(), src_labels, tgt_labels, str(tmp_path))
  expected = {f'{kind}_layer{i}.png' for kind in attention_maps.KINDS for i in range(LAYERS)}
  assert len(paths) == len(expected)
  assert {p.rsplit('/', 1)[-1] for p in paths} == expected
  assert {p.name for p in tmp_path.iterdir()} == expected
  for path in paths:
    with open(path, 'rb') as f:
      assert f.read(8) == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
  assert matplotlib.get_backend() == backend  # Global backend state untouched.


def test_figure_has_a_panel_per_head_with_token_labels():
  src_labels, tgt_labels = _labels()
  cross = _weights()['cross_attention'][0]
  fig = attention_maps.attention_figure(cross, tgt_labels, src_labels, 'cross')
  panels, colorbar = fig.axes[:-1], fig.axes[-1]
  assert len(panels) == HEADS and colorbar.get_label() == '<colorbar>'
  for h, ax in enumerate(panels):
    assert ax.get_title() == f'head {h}'
    assert [t.get_text() for t in ax.get_xticklabels()] == src_labels
    assert [t.get_text() for t in ax.get_yticklabels()] == tgt_labels
    assert ax.images[0].get_clim() == (0.0, 1.0)
  # More heads, more panels: the rendered image is wider.
  widths = []
  for heads in (1, 3):
    fig = attention_maps.attention_figure(
      np.full((heads, 2, 2), 0.5), ['a', 'b'], ['c', 'd'], f'{heads} heads'
    )
    assert len(fig.axes) == heads + 1
    fig.canvas.draw()
    widths.append(fig.canvas.get_width_height()[0])
  assert widths[1] > widths[0]


def test_plot_labels_decoder_columns_with_what_each_position_reads(tmp_path, monkeypatch):
  src_labels, tgt_labels = _labels()
  figures = []
  original = attention_maps.attention_figure
  monkeypatch.setattr(
    attention_maps,
    'attention_figure',
    lambda *a, **k: figures.append(original(*a, **k)) or figures[-1],
  )
  weights = {'decoder_self_attention': _weights()['decoder_self_attention'][:1]}
  attention_maps.plot_attention(weights, src_labels, tgt_labels, str(tmp_path))
  (fig,) = figures
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.get_xticklabels()] == ['<s>'] + tgt_labels[:-1]
  assert [t.get_text() for t in ax.get_yticklabels()] == tgt_labels


def test_label_count_mismatch_is_an_error(tmp_path):
  src_labels, tgt_labels = _labels()
  with pytest.raises(ValueError, match='labels'):
    attention_maps.plot_attention(_weights(), src_labels[:-1], tgt_labels, str(tmp_path))
