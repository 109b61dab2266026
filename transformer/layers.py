"""Building blocks shared by the encoder and the decoder: embeddings, positions, FFN, norms.

Besides the paper's blocks, each "modern variant" switch of `ModelConfig` is a
branch of the block it changes, never a copied module: `norm` (LayerNorm or
RMSNorm, post- or pre-norm placement), `position` (sinusoidal or learned
additive positions here; RoPE and ALiBi helpers here, applied in
`attention.py`), `ffn_activation` (ReLU, GELU, SwiGLU) and `use_bias`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer.config import ModelConfig


def matmul(x: jax.Array, kernel: jax.Array, in_dims: int = 1) -> jax.Array:
  """x @ kernel over x's last `in_dims` axes and kernel's first `in_dims`, as one 2-D product.

  The leading axes of x, the contracted axes and the kernel's output axes are each
  flattened first (free reshapes of row-major arrays), so that XLA sees a plain
  [N, K] x [K, F] matmul. As a dot_general over several axes, XLA:CPU copies whole
  activations into another layout before its matmul library, in the forward pass and
  again for every weight gradient (the gain is measured in docs/benchmarks.md). Same sums
  of products.
  """
  lead_shape = x.shape[: x.ndim - in_dims]
  contracted = math.prod(x.shape[x.ndim - in_dims :])
  y = x.reshape(-1, contracted) @ kernel.reshape(contracted, -1)
  return y.reshape(*lead_shape, *kernel.shape[in_dims:])


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


class LearnedPositions(nn.Module):
  """A learned table of `max_len` position embeddings, added like the sinusoids (3.5).

  The paper's "learned positional embeddings" alternative (Gehring et al. 2017).
  Rows are indexed by the explicit positions, so packed rows and cached decoding
  steps read the row of each token's own position. Positions past `max_len - 1`
  (only decoding beyond `config.model.max_len` can produce them) reuse the last row.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, positions_BL: jax.Array) -> jax.Array:
    cfg = self.config
    # The rows run along the `length` axis; like activations' `length`, never sharded.
    table_LD = self.param(
      'embedding',
      nn.with_logical_partitioning(nn.initializers.normal(0.02), ('length', 'embed')),
      (cfg.max_len, cfg.d_model),
      jnp.float32,
    )
    return jnp.take(jnp.asarray(table_LD, cfg.dtype), positions_BL, axis=0, mode='clip')


def apply_rope(x_BLHK: jax.Array, positions_BL: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (RoFormer, Su et al. 2021, eq. 34) of queries or keys.

  Each pair of dimensions (2i, 2i+1) of every head is rotated by the angle
  pos * base^(-2i/K), so that <rope(q, m), rope(k, n)> depends on m - n only.
  Rotation runs in float32; K must be even.
  """
  head_dim = x_BLHK.shape[-1]
  inv_freq = np.power(base, -np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  angles_BLk = positions_BL[..., None].astype(jnp.float32) * inv_freq.astype(np.float32)
  sin_BL1k, cos_BL1k = jnp.sin(angles_BLk)[:, :, None], jnp.cos(angles_BLk)[:, :, None]
  pairs = x_BLHK.astype(jnp.float32).reshape(*x_BLHK.shape[:-1], head_dim // 2, 2)
  even, odd = pairs[..., 0], pairs[..., 1]
  rotated = jnp.stack([even * cos_BL1k - odd * sin_BL1k, even * sin_BL1k + odd * cos_BL1k], -1)
  return rotated.reshape(x_BLHK.shape).astype(x_BLHK.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """Head slopes of ALiBi (Press et al. 2022, section 3), float32 [H].

  For h a power of 2: the geometric sequence 2^(-8/h), 2^(-16/h), ..., 2^(-8).
  Otherwise the paper's rule: the slopes of the largest power of 2 below h,
  then every other slope of the sequence for twice that power, up to h slopes.
  """
  if num_heads & (num_heads - 1) == 0:
    return 2.0 ** (-8.0 * np.arange(1, num_heads + 1, dtype=np.float32) / num_heads)
  closest = 2 ** math.floor(math.log2(num_heads))
  extra = alibi_slopes(2 * closest)[0::2][: num_heads - closest]
  return np.concatenate([alibi_slopes(closest), extra])


def alibi_bias(
  q_positions_BL: jax.Array, kv_positions_BS: jax.Array, slopes_H: np.ndarray
) -> jax.Array:
  """ALiBi's linear bias -slope * distance added to the attention logits, float32 [B, H, L, S].

  Distances come from the tokens' positions, not array indices, so packed
  examples are biased as if alone. The paper's bias, -slope * (q_pos - k_pos),
  is for causal attention (k_pos <= q_pos); for the bidirectional encoder we
  use its symmetric form -slope * |q_pos - k_pos| (as in MosaicBERT), which is
  the same on every position the causal mask keeps.
  """
  distance_BLS = jnp.abs(q_positions_BL[:, :, None] - kv_positions_BS[:, None, :])
  return -jnp.asarray(slopes_H)[None, :, None, None] * distance_BLS[:, None].astype(jnp.float32)


class Embed(nn.Module):
  """Token embedding; `attend` reuses the matrix as the pre-softmax projection (3.4)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    # Normal(0, d^-0.5): multiplied by sqrt(d_model) below, the embeddings have unit scale.
    init = nn.initializers.normal(stddev=cfg.d_model**-0.5)
    self.embedding = self.param(
      'embedding',
      nn.with_logical_partitioning(init, ('vocab', 'embed')),
      (cfg.vocab_size, cfg.d_model),
      jnp.float32,
    )

  def __call__(self, tokens_BL: jax.Array) -> jax.Array:
    cfg = self.config
    # The lookup gathers rows of a table split over the vocabulary (tensor); gathered whole
    # along `embed` first (as FSDP does for every weight), so that XLA partitions the gather
    # instead of replicating its output.
    table_VD = nn.with_logical_constraint(jnp.asarray(self.embedding, cfg.dtype), ('vocab', None))
    embedded_BLD = jnp.take(table_VD, tokens_BL, axis=0)
    # Section 3.4: "we multiply those weights by sqrt(d_model)".
    return embedded_BLD * jnp.sqrt(cfg.d_model).astype(cfg.dtype)

  def attend(self, x_BLD: jax.Array) -> jax.Array:
    """Logits x E^T [B, L, V]."""
    table_VD = jnp.asarray(self.embedding, self.config.dtype)
    return matmul(x_BLD, table_VD.T)


class FeedForward(nn.Module):
  """Eq. 2: FFN(x) = act(x W1 + b1) W2 + b2, applied to each position.

  `ffn_activation`: 'relu' (the paper's max(0, .)), 'gelu' (Hendrycks & Gimpel
  2016, exact erf form), 'swish' (x * sigmoid(x), Ramachandran et al. 2017; Marian's
  and the OPUS-MT models' FFN) or 'swiglu' (Shazeer 2020, "GLU Variants Improve
  Transformer"): FFN(x) = (Swish(x W) * (x V)) W2 with its own matrix V (`wv`);
  at equal d_ff it has 1.5x the FFN parameters (the paper shrinks d_ff by 2/3).
  `ffn_dropout_rate` drops units of act(...) before W2 (fairseq's --activation-dropout,
  tensor2tensor's relu_dropout; the paper has none).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x_BLD: jax.Array, *, deterministic: bool) -> jax.Array:
    cfg = self.config

    def dense(features, names, name):
      return nn.Dense(
        features,
        use_bias=cfg.use_bias,
        dtype=cfg.dtype,
        name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-1:]),
      )

    # Positions flattened to rows: 2-D products, as in `matmul`.
    batch, length, _ = x_BLD.shape
    x_ND = x_BLD.reshape(batch * length, -1)
    h_NF = dense(cfg.d_ff, ('embed', 'mlp'), 'wi')(x_ND)
    if cfg.ffn_activation == 'swiglu':
      h_NF = nn.swish(h_NF) * dense(cfg.d_ff, ('embed', 'mlp'), 'wv')(x_ND)
    elif cfg.ffn_activation == 'gelu':
      h_NF = nn.gelu(h_NF, approximate=False)
    elif cfg.ffn_activation == 'swish':
      h_NF = nn.swish(h_NF)
    else:
      h_NF = nn.relu(h_NF)
    h_NF = nn.Dropout(cfg.ffn_dropout_rate)(h_NF, deterministic=deterministic)  # Rate 0: h_NF.
    h_BLF = nn.with_logical_constraint(h_NF.reshape(batch, length, -1), ('batch', 'length', 'mlp'))
    out_ND = dense(cfg.d_model, ('mlp', 'embed'), 'wo')(h_BLF.reshape(batch * length, -1))
    return out_ND.reshape(batch, length, -1)


def norm(config: ModelConfig, name: str, axis: str = 'embed') -> nn.Module:
  """The configured normalisation over the last axis, in float32 whatever the activation dtype.

  LayerNorm (Ba et al. 2016), without its bias when `use_bias=False`, or, for
  `norm='rmsnorm'`, RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * g,
  no centring and no bias. eps is `norm_epsilon` (1e-6 here as in tensor2tensor; Marian,
  fairseq and PyTorch use 1e-5). `axis` is the logical name of that axis: 'embed' for the
  residual stream, 'kv' for QK-norm's per-head queries and keys.
  """
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, (axis,))
  if config.norm == 'rmsnorm':
    return nn.RMSNorm(
      epsilon=config.norm_epsilon, dtype=jnp.float32, scale_init=scale_init, name=name
    )
  return nn.LayerNorm(
    epsilon=config.norm_epsilon,
    dtype=jnp.float32,
    use_bias=config.use_bias,
    scale_init=scale_init,
    name=name,
    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axis,)),
  )


def residual(
  config: ModelConfig,
  x_BLD: jax.Array,
  sublayer: Callable[[jax.Array], jax.Array],
  *,
  norm_name: str,
  deterministic: bool,
) -> jax.Array:
  """One residual sub-layer, with dropout on its output (5.4), in either norm placement.

  post_ln (section 3.1): Norm(x + Dropout(Sublayer(x))).
  pre_ln, rmsnorm: x + Dropout(Sublayer(Norm(x))); the stack then ends with a final norm.
  Must be called from inside a compact method: the norm it creates belongs to the caller.
  """
  dropout = nn.Dropout(config.dropout_rate)
  if config.pre_norm:
    y_BLD = sublayer(norm(config, norm_name)(x_BLD).astype(config.dtype))
    return x_BLD + dropout(y_BLD, deterministic=deterministic)
  y_BLD = sublayer(x_BLD)
  out = norm(config, norm_name)(x_BLD + dropout(y_BLD, deterministic=deterministic))
  return out.astype(config.dtype)
