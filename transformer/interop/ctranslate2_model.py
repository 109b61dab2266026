"""A CTranslate2 model built from this project's arrays, through CTranslate2's spec API.

`ctranslate2.specs.TransformerSpec` is the same encoder-decoder with the switches this
project has (`pre_norm`, the norm's epsilon, the activation, the logits bias, a given
position table), so the model is built from the parameters directly: no Hugging Face
directory, no torch, no hand-written binary format. Pre-LN models serve here although no
Hugging Face class holds them exactly (`marian.export_refusals`).

Layouts: CTranslate2's linear layers are PyTorch's ([out, in]); the self-attention's query,
key and value projections are one fused matrix, the cross-attention's key and value another.
The position table is this project's own (section 3.5, sin and cos interleaved), given
whole, so the hidden axis keeps this project's order (no permutation, unlike Marian). The
decoder starts from `<s>` (this project's bos, a real embedding row); the source gets `</s>`
appended by CTranslate2 itself (`add_source_eos`), as this project's input pipeline does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from transformer import config_fields, layers, tokenizer
from transformer.config import ModelConfig
from transformer.interop import marian

TARGET_SENTENCEPIECE = 'target_sentencepiece.model'  # Beside, where the target has its own.
QUANTIZATIONS = (
  'float32',
  'int8',
  'int8_float32',
  'int8_float16',
  'int8_bfloat16',
  'int16',
  'float16',
  'bfloat16',
)


# The model fields this conversion expresses: Marian's, and grouped-query attention (the
# specs' `num_heads_kv`).
MAPPED_FIELDS = (*marian.MAPPED_FIELDS, 'model.num_kv_heads')


def refusals(cfg: ModelConfig) -> list[str]:
  """Why `cfg` has no exact CTranslate2 TransformerSpec: one line per field; [] if it has one."""
  found = []
  if cfg.architecture != 'encoder_decoder':
    found.append(
      f'config.model.architecture={cfg.architecture!r}: only the encoder-decoder is converted '
      '(a TransformerSpec).'
    )
  if cfg.position not in ('sinusoidal', 'learned'):
    found.append(
      f'config.model.position={cfg.position!r}: CTranslate2 rotates keys or biases attention '
      'in the decoder-only specs only; the encoder-decoder spec takes additive positions.'
    )
  if cfg.ffn_activation == 'swiglu':
    found.append(
      "config.model.ffn_activation='swiglu': not converted (CTranslate2's gated FFN is "
      'unchecked against this one).'
    )
  found += [
    f"{switch}: CTranslate2's TransformerSpec has no such part (a switch this conversion "
    'does not express).'
    for switch in config_fields.unmapped_switches(MAPPED_FIELDS, cfg)
  ]
  return found


def _activation(name: str):
  from ctranslate2.specs import common_spec  # pylint: disable=g-import-not-at-top

  return {
    'relu': common_spec.Activation.RELU,
    'gelu': common_spec.Activation.GELU,
    'swish': common_spec.Activation.SWISH,
  }[name]


def build_spec(params: Mapping[str, Any], cfg: ModelConfig, pieces: list[str]):
  """The `TransformerSpec` of `params` with vocabulary `pieces` (in id order)."""
  from ctranslate2.specs import transformer_spec  # pylint: disable=g-import-not-at-top

  d = cfg.d_model
  # Grouped-query attention: the key/value heads of every attention (None: as many as heads).
  kv_heads = {'num_heads_kv': cfg.num_kv_heads} if cfg.num_kv_heads != cfg.num_heads else {}
  common = dict(
    pre_norm=cfg.pre_norm,
    activation=_activation(cfg.ffn_activation),
    rms_norm=cfg.norm == 'rmsnorm',
    **kv_heads,
  )
  spec = transformer_spec.TransformerSpec(
    transformer_spec.TransformerEncoderSpec(cfg.num_layers, cfg.num_heads, **common),
    transformer_spec.TransformerDecoderSpec(cfg.num_layers, cfg.num_heads, **common),
  )

  def f32(x):  # A writable copy: the spec quantizes its arrays in place.
    return np.array(x, np.float32, order='C')

  def linear(target, kernel_in_out, bias=None):
    target.weight = f32(np.asarray(kernel_in_out).T)
    if bias is not None:
      target.bias = f32(bias)

  def projection(tree, name):  # [D, H, K] -> [D, H * K] and its bias (fewer K/V heads: GQA).
    kernel, bias = np.asarray(tree[name]['kernel']), tree[name].get('bias')
    width = kernel.shape[1] * kernel.shape[2]
    return (
      np.reshape(kernel, (d, width)),
      None if bias is None else np.reshape(bias, (width,)),
    )

  def fused(target, tree, names):
    kernels, biases = zip(*(projection(tree, n) for n in names), strict=True)
    target.weight = f32(np.concatenate([k.T for k in kernels], axis=0))
    if biases[0] is not None:
      target.bias = f32(np.concatenate(biases))

  def norm(target, tree):
    target.gamma = f32(tree['scale'])
    if cfg.norm != 'rmsnorm':
      target.beta = f32(tree['bias']) if 'bias' in tree else np.zeros(d, np.float32)

  def attention(target, tree, *, cross):
    if cross:
      fused(target.linear[0], tree, ('query',))
      fused(target.linear[1], tree, ('key', 'value'))
    else:
      fused(target.linear[0], tree, ('query', 'key', 'value'))
    out = tree['out']
    linear(target.linear[-1], np.reshape(out['kernel'], (d, d)), out.get('bias'))

  def ffn(target, tree, norm_tree):
    linear(target.linear_0, tree['wi']['kernel'], tree['wi'].get('bias'))
    linear(target.linear_1, tree['wo']['kernel'], tree['wo'].get('bias'))
    norm(target.layer_norm, norm_tree)

  if cfg.share_embeddings:
    source_table = target_table = params['shared_embedding']['embedding']
  else:
    source_table = params['src_embedding']['embedding']
    target_table = params['tgt_embedding']['embedding']
  if cfg.position == 'learned':
    encoder_positions = params['encoder']['position_embedding']['embedding']
    decoder_positions = params['decoder']['position_embedding']['embedding']
  else:
    table = layers.sinusoidal_encoding(np.arange(cfg.max_len)[None], d)[0]
    encoder_positions = decoder_positions = np.asarray(table)

  for stack, tree, embeddings, positions in (
    (spec.encoder, params['encoder'], source_table, encoder_positions),
    (spec.decoder, params['decoder'], target_table, decoder_positions),
  ):
    embedding_spec = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
    embedding_spec.weight = f32(embeddings)
    stack.scale_embeddings = math.sqrt(d)  # Section 3.4.
    stack.position_encodings.encodings = f32(positions)
    if cfg.pre_norm:
      norm(stack.layer_norm, tree['final_norm'])
    for i, layer_spec in enumerate(stack.layer):
      layer = tree[f'layer_{i}']
      attention(layer_spec.self_attention, layer['self_attention'], cross=False)
      norm(layer_spec.self_attention.layer_norm, layer['self_attention_norm'])
      if stack is spec.decoder:
        attention(layer_spec.attention, layer['cross_attention'], cross=True)
        norm(layer_spec.attention.layer_norm, layer['cross_attention_norm'])
      ffn(layer_spec.ffn, layer['ffn'], layer['ffn_norm'])

  if cfg.share_embeddings:
    spec.decoder.projection.weight = f32(target_table)
  else:
    spec.decoder.projection.weight = f32(np.asarray(params['decoder']['logits']['kernel']).T)
  if cfg.logits_bias:
    spec.decoder.projection.bias = f32(params['decoder']['logits_bias'])

  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  spec.config.layer_norm_epsilon = cfg.norm_epsilon
  spec.config.unk_token = pieces[tokenizer.UNK_ID]
  spec.config.bos_token = pieces[tokenizer.BOS_ID]
  spec.config.eos_token = pieces[tokenizer.EOS_ID]
  spec.config.decoder_start_token = pieces[tokenizer.BOS_ID]
  spec.config.add_source_eos = True
  return spec


def write(
  directory: str,
  params: Mapping[str, Any],
  cfg: ModelConfig,
  vocabulary: bytes,
  *,
  quantization: str = 'float32',
  target_vocabulary: bytes | None = None,
) -> None:
  """Saves the CTranslate2 model of `params` in `directory`, with `sentencepiece.model` beside
  (and `target_sentencepiece.model`, the target side's own, where `target_vocabulary` is one)."""
  vocab = tokenizer.Tokenizer(vocabulary)
  pieces = [vocab.id_to_piece(i) for i in range(vocab.vocab_size)]
  spec = build_spec(params, cfg, pieces)
  spec.validate()
  spec.optimize(quantization=quantization)
  os.makedirs(directory, exist_ok=True)
  spec.save(directory)
  with open(f'{directory}/sentencepiece.model', 'wb') as f:
    f.write(vocabulary)
  if target_vocabulary is not None:
    with open(f'{directory}/{TARGET_SENTENCEPIECE}', 'wb') as f:
      f.write(target_vocabulary)
