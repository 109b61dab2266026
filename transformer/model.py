"""The encoder-decoder Transformer of "Attention Is All You Need" (section 3, figure 1).

`architecture='decoder_only'` turns the same modules into a language model: no
encoder, and the decoder stack with its cross-attention sub-layer switched off
(masked self-attention and FFN per layer, the shared embedding as softmax).

Inputs are token ids with explicit segment ids and positions, so one code path
serves padded batches (segments = tokens != 0), packed batches (several
examples per row) and one-token-at-a-time cached decoding. Shapes follow the
vocabulary in `transformer/attention.py`.

Modern variants are switches on the same blocks, the defaults being the paper's:
`norm` (post_ln / pre_ln / rmsnorm), `position` (sinusoidal / learned / rope /
alibi), `ffn_activation` (relu / gelu / swiglu / swish), `use_bias`, `norm_epsilon`
and `logits_bias`.
"""

from __future__ import annotations

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import attention, layers
from transformer.config import ModelConfig


def _positions_or_default(tokens_BL: jax.Array, positions_BL: jax.Array | None) -> jax.Array:
  if positions_BL is not None:
    return positions_BL
  return jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)


def _segments_or_default(tokens_BL: jax.Array, segments_BL: jax.Array | None) -> jax.Array:
  return (tokens_BL != 0).astype(jnp.int32) if segments_BL is None else segments_BL


def _constrain(x_BLD: jax.Array) -> jax.Array:
  return nn.with_logical_constraint(x_BLD, ('batch', 'length', 'embed'))


class EncoderLayer(nn.Module):
  """Self-attention then FFN, each a residual sub-layer (section 3.1)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, self_attention_mask, segments_BL, positions_BL, deterministic: bool):
    cfg = self.config
    x_BLD = layers.residual(
      cfg,
      x_BLD,
      lambda h: attention.MultiHeadAttention(cfg, name='self_attention')(
        h,
        h,
        self_attention_mask,
        positions_BL=positions_BL,
        segments=(segments_BL, segments_BL),
        deterministic=deterministic,
      ),
      norm_name='self_attention_norm',
      deterministic=deterministic,
    )
    x_BLD = layers.residual(
      cfg,
      x_BLD,
      lambda h: layers.FeedForward(cfg, name='ffn')(h, deterministic=deterministic),
      norm_name='ffn_norm',
      deterministic=deterministic,
    )
    return _constrain(x_BLD)


class DecoderLayer(nn.Module):
  """Masked self-attention, encoder-decoder attention, FFN (section 3.1).

  Decoder-only models skip the encoder-decoder attention (there is no encoder output).
  `segments_BL` and `src_segments_BS`, the segment ids the masks were built from, are None
  in cached decoding.
  """

  config: ModelConfig

  @nn.compact
  def __call__(
    self,
    y_BLD,
    encoded_BSD,
    self_attention_mask,
    cross_attention_mask,
    segments_BL,
    src_segments_BS,
    positions_BL,
    deterministic: bool,
  ):
    cfg = self.config
    with_segments = segments_BL is not None
    y_BLD = layers.residual(
      cfg,
      y_BLD,
      lambda h: attention.MultiHeadAttention(
        cfg, decode=cfg.decode, causal=True, name='self_attention'
      )(
        h,
        h,
        self_attention_mask,
        positions_BL=positions_BL,
        segments=(segments_BL, segments_BL) if with_segments else None,
        deterministic=deterministic,
      ),
      norm_name='self_attention_norm',
      deterministic=deterministic,
    )
    if cfg.has_encoder:
      y_BLD = layers.residual(
        cfg,
        y_BLD,
        lambda h: attention.MultiHeadAttention(
          cfg, is_cross_attention=True, decode=cfg.decode, name='cross_attention'
        )(
          h,
          encoded_BSD,
          cross_attention_mask,
          segments=(segments_BL, src_segments_BS) if with_segments else None,
          deterministic=deterministic,
        ),
        norm_name='cross_attention_norm',
        deterministic=deterministic,
      )
    y_BLD = layers.residual(
      cfg,
      y_BLD,
      lambda h: layers.FeedForward(cfg, name='ffn')(h, deterministic=deterministic),
      norm_name='ffn_norm',
      deterministic=deterministic,
    )
    return _constrain(y_BLD)


def _layer(cls: type[nn.Module], cfg: ModelConfig) -> type[nn.Module]:
  """`cls`, or under `remat='layer'` `cls` rematerialised: its activations are recomputed.

  The backward pass then keeps each layer's inputs only and recomputes the rest, layer by
  layer (same parameters, same dropout masks, same gradients). Cached decoding takes no
  gradients and is never rematerialised. `deterministic`, the last argument, is static.
  """
  if cfg.remat == 'layer' and not cfg.decode:
    last = len(inspect.signature(cls.__call__).parameters) - 1  # Counted with self at 0.
    return nn.remat(cls, static_argnums=(last,))
  return cls


def _embed_with_positions(
  cfg: ModelConfig, embed: layers.Embed, tokens_BL, positions_BL, deterministic: bool
):
  """Token embedding * sqrt(d_model) + position encoding, then dropout (3.4, 3.5, 5.4).

  Sinusoidal or learned positions are added here; RoPE and ALiBi add nothing:
  they act inside self-attention. Called from a compact method, which owns the
  learned table (one per stack).
  """
  x_BLD = embed(tokens_BL)
  if cfg.position == 'sinusoidal':
    x_BLD += layers.sinusoidal_encoding(positions_BL, cfg.d_model).astype(cfg.dtype)
  elif cfg.position == 'learned':
    x_BLD += layers.LearnedPositions(cfg, name='position_embedding')(positions_BL)
  return _constrain(nn.Dropout(cfg.dropout_rate)(x_BLD, deterministic=deterministic))


class Encoder(nn.Module):
  """N encoder layers over embedded source tokens."""

  config: ModelConfig
  embed: layers.Embed

  @nn.compact
  def __call__(self, src_tokens_BS, src_segments_BS, src_positions_BS):
    cfg = self.config
    x_BSD = _embed_with_positions(
      cfg, self.embed, src_tokens_BS, src_positions_BS, cfg.deterministic
    )
    mask = attention.segment_mask(src_segments_BS, src_segments_BS)
    for i in range(cfg.num_layers):
      x_BSD = _layer(EncoderLayer, cfg)(cfg, name=f'layer_{i}')(
        x_BSD, mask, src_segments_BS, src_positions_BS, cfg.deterministic
      )
    if cfg.pre_norm:
      x_BSD = layers.norm(cfg, 'final_norm')(x_BSD).astype(cfg.dtype)
    return x_BSD


class Decoder(nn.Module):
  """N decoder layers over shifted target tokens, then the softmax projection.

  Without an encoder (decoder-only) `encoded_BSD` and `src_segments_BS` are None.
  """

  config: ModelConfig
  embed: layers.Embed

  @nn.compact
  def __call__(
    self, encoded_BSD, src_segments_BS, tgt_input_tokens_BL, tgt_segments_BL, tgt_positions_BL
  ):
    cfg = self.config
    if cfg.decode:
      # One token per step: its position is the number of tokens decoded so far.
      is_initialized = self.has_variable('cache', 'position')
      position = self.variable('cache', 'position', lambda: jnp.array(0, jnp.int32))
      tgt_positions_BL = jnp.full_like(tgt_input_tokens_BL, position.value)
      if is_initialized:
        position.value += 1
      self_attention_mask = None  # The key/value cache applies causality itself.
      query_segments_BL = jnp.ones_like(tgt_input_tokens_BL)
      segments_BL = None  # Cached steps take the einsum, which reads the masks only.
    else:
      # Causality is the self-attention's own (`causal`): the fused kernel skips masked blocks.
      self_attention_mask = attention.segment_mask(tgt_segments_BL, tgt_segments_BL)
      query_segments_BL = segments_BL = tgt_segments_BL
    cross_attention_mask = (
      attention.segment_mask(query_segments_BL, src_segments_BS) if cfg.has_encoder else None
    )

    y_BLD = _embed_with_positions(
      cfg, self.embed, tgt_input_tokens_BL, tgt_positions_BL, cfg.deterministic
    )
    for i in range(cfg.num_layers):
      y_BLD = _layer(DecoderLayer, cfg)(cfg, name=f'layer_{i}')(
        y_BLD,
        encoded_BSD,
        self_attention_mask,
        cross_attention_mask,
        segments_BL,
        src_segments_BS,
        tgt_positions_BL,
        cfg.deterministic,
      )
    if cfg.pre_norm:
      y_BLD = layers.norm(cfg, 'final_norm')(y_BLD).astype(cfg.dtype)

    if cfg.share_embeddings:
      logits_BLV = self.embed.attend(y_BLD)
    else:
      logits_BLV = nn.DenseGeneral(
        cfg.vocab_size,
        use_bias=False,
        dtype=cfg.dtype,
        name='logits',
        kernel_init=nn.with_logical_partitioning(
          nn.initializers.xavier_uniform(), ('embed', 'vocab')
        ),
      )(y_BLD.reshape(-1, cfg.d_model)).reshape(*y_BLD.shape[:-1], cfg.vocab_size)
    if cfg.logits_bias:  # Marian's final_logits_bias: one learned offset per vocabulary entry.
      bias_V = self.param(
        'logits_bias',
        nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',)),
        (cfg.vocab_size,),
        jnp.float32,
      )
      logits_BLV = logits_BLV + bias_V.astype(logits_BLV.dtype)
    logits_BLV = nn.with_logical_constraint(logits_BLV, ('batch', 'length', 'vocab'))
    return logits_BLV.astype(jnp.float32)


class Transformer(nn.Module):
  """Encoder-decoder model: `__call__` for training, `encode`/`decode` for inference.

  A decoder-only model has no `encode`; it takes `src_tokens_BS=None` in
  `__call__` and `encoded_BSD=src_segments_BS=None` in `decode`.
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    if cfg.share_embeddings:
      # Section 3.4: one matrix for both embedding layers and the pre-softmax projection
      # (decoder-only: for the input embedding and the softmax).
      self.tgt_embed = layers.Embed(cfg, name='shared_embedding')
      self.src_embed = self.tgt_embed if cfg.has_encoder else None
    else:
      self.src_embed = layers.Embed(cfg, name='src_embedding') if cfg.has_encoder else None
      self.tgt_embed = layers.Embed(cfg, name='tgt_embedding')
    if cfg.has_encoder:
      self.encoder = Encoder(cfg, self.src_embed, name='encoder')
    self.decoder = Decoder(cfg, self.tgt_embed, name='decoder')

  def encode(self, src_tokens_BS, src_segments_BS=None, src_positions_BS=None):
    """Encoder output [B, S, D]."""
    if not self.config.has_encoder:
      raise ValueError("A decoder-only model (architecture='decoder_only') has no encoder.")
    return self.encoder(
      src_tokens_BS,
      _segments_or_default(src_tokens_BS, src_segments_BS),
      _positions_or_default(src_tokens_BS, src_positions_BS),
    )

  def decode(
    self,
    encoded_BSD,
    src_segments_BS,
    tgt_input_tokens_BL,
    tgt_segments_BL=None,
    tgt_positions_BL=None,
  ):
    """Logits [B, L, V] (float32) of the next token at every target position."""
    return self.decoder(
      encoded_BSD,
      src_segments_BS,
      tgt_input_tokens_BL,
      _segments_or_default(tgt_input_tokens_BL, tgt_segments_BL),
      _positions_or_default(tgt_input_tokens_BL, tgt_positions_BL),
    )

  def __call__(
    self,
    src_tokens_BS,
    tgt_input_tokens_BL,
    src_segments_BS=None,
    tgt_segments_BL=None,
    src_positions_BS=None,
    tgt_positions_BL=None,
  ):
    """Logits [B, L, V] (float32); `src_tokens_BS` is None exactly for a decoder-only model."""
    if (src_tokens_BS is None) == self.config.has_encoder:
      raise ValueError(
        f'architecture={self.config.architecture!r} takes '
        f'{"source tokens" if self.config.has_encoder else "no source tokens"}.'
      )
    if not self.config.has_encoder:
      return self.decode(None, None, tgt_input_tokens_BL, tgt_segments_BL, tgt_positions_BL)
    src_segments_BS = _segments_or_default(src_tokens_BS, src_segments_BS)
    encoded_BSD = self.encode(src_tokens_BS, src_segments_BS, src_positions_BS)
    return self.decode(
      encoded_BSD, src_segments_BS, tgt_input_tokens_BL, tgt_segments_BL, tgt_positions_BL
    )
