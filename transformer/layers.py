"""Building blocks shared by the encoder and the decoder: embeddings, positions, FFN, norms."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from transformer.model import ModelConfig


def sinusoidal_encoding(positions_BL: jax.Array, d_model: int) -> jax.Array:
  """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

  Computed from explicit positions, so packed rows (positions restart at every
  example) and single decoding steps use the same function. Returns [B, L, D] float32.
  """
  inv_freq = np.power(10000.0, -np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  angles_BLd = positions_BL[..., None].astype(jnp.float32) * inv_freq.astype(np.float32)
  # Interleave sin (even dims) and cos (odd dims), exactly as the formula indexes them.
  pe = jnp.stack([jnp.sin(angles_BLd), jnp.cos(angles_BLd)], axis=-1)
  return pe.reshape(*positions_BL.shape, -1)[..., :d_model]


class Embed(nn.Module):
  """Token embedding; `attend` reuses the matrix as the pre-softmax projection (3.4)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    # Normal(0, d^-0.5): multiplied by sqrt(d_model) below, the embeddings have unit scale.
    init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
    self.embedding = self.param(
      'embedding', nn.with_logical_partitioning(init, ('vocab', 'embed')),
      (cfg.vocab_size, cfg.d_model), jnp.float32)

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    cfg = self.config
    embedded_BLD = jnp.take(jnp.asarray(self.embedding, cfg.dtype), tokens_BL, axis=0)
    # Section 3.4: "we multiply those weights by sqrt(d_model)".
    return embedded_BLD * jnp.sqrt(cfg.d_model).astype(cfg.dtype)

  def attend(self, x_BLD: jax.Array) -> jax.Array:
    """Logits x E^T [B, L, V]."""
    return jnp.einsum('bld,vd->blv', x_BLD, jnp.asarray(self.embedding, self.config.dtype))


class FeedForward(nn.Module):
  """Eq. 2: FFN(x) = max(0, x W1 + b1) W2 + b2, applied to each position."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, *, deterministic: bool) -> jax.Array:
    cfg = self.config
    init = nn.initializers.xavier_uniform()
    h_BLF = nn.Dense(
      cfg.d_ff, dtype=cfg.dtype, name='wi',
      kernel_init=nn.with_logical_partitioning(init, ('embed', 'mlp')),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('mlp',)))(x_BLD)
    h_BLF = nn.relu(h_BLF)
    h_BLF = nn.with_logical_constraint(h_BLF, ('batch', 'length', 'mlp'))
    return nn.Dense(
      cfg.d_model, dtype=cfg.dtype, name='wo',
      kernel_init=nn.with_logical_partitioning(init, ('mlp', 'embed')),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)))(h_BLF)


def layer_norm(config: ModelConfig, name: str) -> nn.Module:
  """Layer normalisation in float32 whatever the activation dtype."""
  return nn.LayerNorm(
    epsilon=1e-6, dtype=jnp.float32, name=name,
    scale_init=nn.with_logical_partitioning(nn.initializers.ones, ('embed',)),
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)))


def residual(
  config: ModelConfig,
  x_BLD: jax.Array,
  sublayer: Callable[[jax.Array], jax.Array],
  *,
  norm_name: str,
  deterministic: bool,
) -> jax.Array:
  """One residual sub-layer, with dropout on its output (5.4), in either norm placement.

  post_ln (section 3.1): LayerNorm(x + Dropout(Sublayer(x))).
  pre_ln: x + Dropout(Sublayer(LayerNorm(x))); the stack then ends with a final norm.
  Must be called from inside a compact method: the norm it creates belongs to the caller.
  """
  dropout = nn.Dropout(config.dropout_rate)
  if config.norm == 'pre_ln':
    y_BLD = sublayer(layer_norm(config, norm_name)(x_BLD).astype(config.dtype))
    return x_BLD + dropout(y_BLD, deterministic=deterministic)
  y_BLD = sublayer(x_BLD)
  out = layer_norm(config, norm_name)(x_BLD + dropout(y_BLD, deterministic=deterministic))
  return out.astype(config.dtype)
