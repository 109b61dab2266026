"""Scaled dot-product and multi-head attention (section 3.2), masks, key/value cache.

Shape vocabulary (used across the package):
  B batch, L query length, S key/value length, H heads, K head dim (d_k = d_v),
  D model dim (d_model), F feed-forward dim (d_ff), V vocabulary.

Masks are boolean, `True` where attention is allowed, shaped [B, 1, L, S] so they
broadcast over heads.

Relative-position variants (`config.model.position`) act here, in self-attention
only: 'rope' rotates queries and keys by their positions (RoFormer), 'alibi' adds
a distance bias to the logits (Press et al. 2022). Both read the tokens' explicit
positions, so packed examples and cached steps see the distances they would see
alone. Cross-attention gets neither: source and target positions index different
sentences, so their difference is no distance (the paper's encoder-decoder
attention likewise has no position information of its own).

Three ways to compute eq. 1 (`config.model.attention_impl`, `implementation`):
this module's einsum, which materialises the [B, H, L, S] weights (attention
maps read them; attention dropout drops them; cached decoding steps read the
[B, H, K, S] cache in place); `jax.nn.dot_product_attention`, which takes
the masks as they are (`mask`, `is_causal`) and on NVIDIA GPUs runs cuDNN's
fused flash-attention kernel; and on TPUs JAX's Pallas kernel, splash attention
(`tpu_attention.py`), which takes the segment ids the masks are built from and
the causal mask. The fused kernels never store the weights. 'auto' picks them
where they apply, by the devices the program is compiled for (on TPUs, the
mesh's: `train.py --dry_run --topology` compiles for TPUs from a CPU):

  call                                  auto: GPU, bfloat16   TPU      elsewhere
  training, validation, the decoder's   cuDNN                 Pallas   einsum
    encoder: padding, packed segments,
    causal, cross-attention, RoPE, GQA
  ALiBi (a dense [B, H, L, S] bias)     einsum                einsum   einsum
  attention maps, attention dropout,    einsum                einsum   einsum
    cached decoding steps

cuDNN also needs a head dim that is a multiple of 8, at most 128, and even
lengths (its backward pass with a mask); Pallas, under 'auto', lengths that are
multiples of 128 (its blocks; the einsum takes the others). 'xla' sends the
calls of the first two rows through `jax.nn.dot_product_attention`'s XLA
implementation (the same function as cuDNN's but for the kernel;
tests/test_attention.py checks it equals the einsum), 'cudnn' sends them to
cuDNN: bfloat16 on GPUs only (train.py refuses it elsewhere; eval.py of such a
run on other devices takes the XLA implementation). 'pallas' sends the first
row to the TPU kernel at any length (padded up to a multiple of 128;
tests/test_tpu_attention.py checks it equals the XLA implementation); it takes
no bias, so config validation refuses it with ALiBi, and with attention dropout
(no training call could take it). train.py refuses it off TPUs; elsewhere (eval.py
of a TPU run on a CPU) the calls take the XLA implementation. The kernel gives
padding queries other outputs than the einsum does: nothing reads them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer import layers, tpu_attention
from transformer.config import ModelConfig

# A large negative number instead of -inf: a fully masked row (a padding query)
# then softmaxes to a uniform distribution instead of NaN.
_MASK_VALUE = -1e10


def segment_mask(q_segments_BL: jax.Array, kv_segments_BS: jax.Array) -> jax.Array:
  """Allows attention within a segment; segment 0 is padding and is never attended.

  With one sequence per row the segment ids are `tokens != 0`, and this is the
  paper's padding mask; with packed rows it also keeps packed examples apart.
  """
  same = q_segments_BL[:, :, None] == kv_segments_BS[:, None, :]
  return (same & (kv_segments_BS[:, None, :] != 0))[:, None, :, :]


def causal_mask(length: int) -> jax.Array:
  """[1, 1, L, L] mask letting position i attend to positions <= i (section 3.2.3)."""
  return jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None, None]


def dot_product_attention(
  query_BLHK: jax.Array,
  key_BSHK: jax.Array,
  value_BSHK: jax.Array,
  mask_B1LS: jax.Array | None,
  *,
  bias_BHLS: jax.Array | None = None,
  dropout_rng: jax.Array | None = None,
  dropout_rate: float = 0.0,
  kv_heads_first: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Eq. 1: softmax(Q K^T / sqrt(d_k) + bias) V, per head; the softmax runs in float32.

  `bias_BHLS` (float32, e.g. ALiBi's) is added to the scaled logits before masking.
  With `kv_heads_first`, keys and values come as [B, H, K, S] (the decoding cache's
  layout: the one the two products read, so that no step transposes the cache).
  Keys and values may have fewer heads G than the queries' H (grouped-query attention,
  `num_kv_heads`): query head h reads key/value head h // (H / G), as
  `jax.nn.dot_product_attention` groups them.
  Returns the attended values [B, L, H, K] and the weights [B, H, L, S].
  """
  batch, length, heads, depth = query_BLHK.shape
  query_BLHK = query_BLHK / jnp.sqrt(depth).astype(query_BLHK.dtype)
  key_spec, value_spec = ('bhks', 'bhks') if kv_heads_first else ('bshk', 'bshk')
  kv_heads = key_BSHK.shape[1 if kv_heads_first else 2]
  if kv_heads == heads:
    logits_BHLS = jnp.einsum(f'blhk,{key_spec}->bhls', query_BLHK, key_BSHK)
  else:  # Each key/value head g serves the query heads g * R ... g * R + R - 1.
    query_BLGRK = query_BLHK.reshape(batch, length, kv_heads, heads // kv_heads, depth)
    grouped = key_spec.replace('h', 'g')
    logits_BGRLS = jnp.einsum(f'blgrk,{grouped}->bgrls', query_BLGRK, key_BSHK)
    logits_BHLS = logits_BGRLS.reshape(batch, heads, length, -1)
  logits_BHLS = logits_BHLS.astype(jnp.float32)
  if bias_BHLS is not None:
    logits_BHLS = logits_BHLS + bias_BHLS
  if mask_B1LS is not None:
    logits_BHLS = jnp.where(mask_B1LS, logits_BHLS, _MASK_VALUE)
  weights_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
  if dropout_rng is not None and dropout_rate > 0.0:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights_BHLS.shape)
    weights_BHLS = jnp.where(keep, weights_BHLS / (1.0 - dropout_rate), 0.0)
  if kv_heads == heads:
    out_BLHK = jnp.einsum(
      f'bhls,{value_spec}->blhk', weights_BHLS.astype(value_BSHK.dtype), value_BSHK
    )
  else:
    weights_BGRLS = weights_BHLS.reshape(batch, kv_heads, heads // kv_heads, length, -1)
    grouped = value_spec.replace('h', 'g')
    out_BLGRK = jnp.einsum(
      f'bgrls,{grouped}->blgrk', weights_BGRLS.astype(value_BSHK.dtype), value_BSHK
    )
    out_BLHK = out_BLGRK.reshape(batch, length, heads, depth)
  return out_BLHK, weights_BHLS


def fused_attention(
  query_BLHK: jax.Array,
  key_BSHK: jax.Array,
  value_BSHK: jax.Array,
  mask_B1LS: jax.Array | None,
  *,
  causal: bool = False,
  bias_BHLS: jax.Array | None = None,
  implementation: str = 'xla',
  segments: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Eq. 1 through a fused kernel, never storing the weights: the attended values [B, L, H, K].

  `mask_B1LS` (padding, packed segments; `True` where allowed) must be [B, 1, L, S]
  (cuDNN takes it whole); `causal` adds the causal mask, which the kernels apply by
  skipping the masked blocks. `implementation`: 'xla' or 'cudnn' (bfloat16, GPUs), through
  `jax.nn.dot_product_attention`; or 'pallas', TPUs' splash attention
  (`tpu_attention.attention`), which reads `segments`, the (query [B, L], key/value [B, S])
  segment ids the mask was built from (`segment_mask`), instead of the mask, and no bias.
  """
  if implementation == 'pallas':
    if segments is None or bias_BHLS is not None:
      raise ValueError("implementation='pallas' takes the segment ids and no bias.")
    return tpu_attention.attention(query_BLHK, key_BSHK, value_BSHK, *segments, causal=causal)
  if bias_BHLS is not None and implementation == 'cudnn':
    bias_BHLS = bias_BHLS.astype(query_BLHK.dtype)  # cuDNN's backward gives NaNs for float32.
  return jax.nn.dot_product_attention(
    query_BLHK,
    key_BSHK,
    value_BSHK,
    bias=bias_BHLS,
    mask=mask_B1LS,
    is_causal=causal,
    implementation=implementation,
  )


def cudnn_applies(config: ModelConfig, length: int, kv_length: int) -> bool:
  """Whether cuDNN's fused kernel takes attention of `config` at these lengths on this host."""
  head_dim = config.d_model // config.num_heads
  return (
    jax.default_backend() == 'gpu'
    and config.dtype == jnp.bfloat16
    and head_dim % 8 == 0
    and head_dim <= 128
    and length % 2 == 0
    and kv_length % 2 == 0
  )


def implementation(
  config: ModelConfig,
  length: int,
  kv_length: int,
  *,
  einsum_only: bool,
  bias: bool,
  segments: bool = True,
) -> str | None:
  """'cudnn', 'pallas' or 'xla' (`fused_attention`), or None for the einsum
  (`dot_product_attention`).

  `einsum_only`: the call needs the weights or reads a cache (see the module docstring);
  `bias`: it adds a dense bias (ALiBi); `segments`: it has the segment ids that the TPU
  kernel reads. The TPU kernel is chosen by the devices the program is compiled for
  (`tpu_attention.platform`), not by this host's.
  """
  if einsum_only:
    return None
  on_tpu = tpu_attention.platform() == 'tpu'
  if config.attention_impl == 'auto':
    if bias:
      return None
    if cudnn_applies(config, length, kv_length):
      return 'cudnn'
    return 'pallas' if on_tpu and segments and tpu_attention.tiles(length, kv_length) else None
  if config.attention_impl == 'cudnn' and jax.default_backend() != 'gpu':
    return 'xla'  # A run trained with cuDNN, evaluated elsewhere: the same function.
  if config.attention_impl == 'pallas':
    if not on_tpu or bias:
      # A TPU run evaluated elsewhere, or ALiBi (which config validation refuses with
      # 'pallas'): the same function through XLA.
      return 'xla'
    if not segments:
      raise ValueError("attention_impl='pallas' needs the segment ids (`segments`).")
    return 'pallas'
  return config.attention_impl


def _heads_first(x_BSHK: jax.Array) -> jax.Array:
  """[B, S, H, K] -> [B, H, K, S], the layout of the decoding cache."""
  return jnp.transpose(x_BSHK, (0, 2, 3, 1))


class _Projection(nn.Module):
  """x @ W + b contracting the last `in_dims` axes of x; W and b carry logical axis names.

  Like `nn.DenseGeneral`, but the kernel is initialised in its final shape
  (Glorot uniform over fan_in = prod(contracted), fan_out = prod(features)):
  DenseGeneral initialises a flattened kernel and unboxes it, which applies the
  logical sharding constraint to the wrong rank as soon as a mesh is active.
  """

  config: ModelConfig
  features: tuple[int, ...]
  in_dims: int
  names: tuple[str, ...]

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    in_shape = x.shape[-self.in_dims :]
    rank = self.in_dims + len(self.features)
    kernel_init = nn.initializers.variance_scaling(
      1.0,
      'fan_avg',
      'uniform',
      in_axis=tuple(range(self.in_dims)),
      out_axis=tuple(range(self.in_dims, rank)),
    )
    kernel = self.param(
      'kernel',
      nn.with_logical_partitioning(kernel_init, self.names),
      in_shape + self.features,
      jnp.float32,
    )
    y = layers.matmul(x.astype(cfg.dtype), kernel.astype(cfg.dtype), self.in_dims)
    if cfg.use_bias:
      bias_names = self.names[self.in_dims :]
      bias = self.param(
        'bias',
        nn.with_logical_partitioning(nn.initializers.zeros, bias_names),
        self.features,
        jnp.float32,
      )
      y = y + bias.astype(cfg.dtype)
    return y


class MultiHeadAttention(nn.Module):
  """Multi-head attention (section 3.2.2): h parallel heads of eq. 1, then W^O.

  Self-attention when `inputs_kv` is `inputs_q`; encoder-decoder (cross)
  attention when `inputs_kv` is the encoder output. With `decode`, a
  self-attention layer keeps a key/value cache of `config.max_decode_len`
  positions and a cross-attention layer projects the encoder output into keys
  and values once, when the cache is created, and reuses them at every step.

  `segments` are the (query [B, L], key/value [B, S]) segment ids that `mask_B1LS` was
  built from (`segment_mask`; the causal mask is `causal`'s): the TPU kernel reads them
  instead of the mask; without them a call takes another path ('auto').
  `positions_BL` are the query tokens' positions (self-attention: also the keys'),
  read by RoPE and ALiBi only. In a cached step the single query is at the step's
  position; the cache holds keys already rotated at their own positions, and
  cache slot j holds step j, whose position is j (the decoder numbers its steps).
  """

  config: ModelConfig
  is_cross_attention: bool = False
  decode: bool = False  # Decoder attention under `config.decode` (the encoder never caches).
  causal: bool = False  # The decoder's self-attention: position i attends to <= i (not cached).

  @nn.compact
  def __call__(
    self,
    inputs_q_BLD: jax.Array,
    inputs_kv_BSD: jax.Array,
    mask_B1LS: jax.Array | None,
    *,
    positions_BL: jax.Array | None = None,
    segments: tuple[jax.Array, jax.Array] | None = None,
    deterministic: bool,
  ) -> jax.Array:
    cfg = self.config
    heads, head_dim = cfg.num_heads, cfg.d_model // cfg.num_heads
    relative = cfg.position in ('rope', 'alibi') and not self.is_cross_attention
    if relative and positions_BL is None:
      raise ValueError(f'position={cfg.position!r} self-attention needs positions_BL.')

    def projection(name: str) -> _Projection:
      """W^Q (h heads) or W^K, W^V (`num_kv_heads`: grouped-query attention) of eq. 1."""
      count = heads if name == 'query' else cfg.num_kv_heads
      return _Projection(cfg, (count, head_dim), 1, ('embed', 'heads', 'kv'), name=name)

    def queries_or_keys(name: str, x_BLD: jax.Array) -> jax.Array:
      """Projected to [B, L, H, K]; with `qk_norm`, each head's vector normalised (its own
      scale over K, the configured norm): QK-norm (Dehghani et al. 2023), which bounds the
      logits q.k / sqrt(d_k) of eq. 1 by the two scales."""
      x_BLHK = projection(name)(x_BLD)
      if not cfg.qk_norm:
        return x_BLHK
      return layers.norm(cfg, f'{name}_norm', axis='kv')(x_BLHK).astype(x_BLHK.dtype)

    query_BLHK = queries_or_keys('query', inputs_q_BLD)

    if self.decode and self.is_cross_attention:
      # Keys and values of the encoder output, projected once per source sentence and
      # kept as [B, H, K, S].
      key_BSHK = self.variable(
        'cache', 'cross_key', lambda: _heads_first(queries_or_keys('key', inputs_kv_BSD))
      )
      value_BSHK = self.variable(
        'cache', 'cross_value', lambda: _heads_first(projection('value')(inputs_kv_BSD))
      )
      key_BSHK, value_BSHK = key_BSHK.value, value_BSHK.value
    else:
      key_BSHK = queries_or_keys('key', inputs_kv_BSD)
      value_BSHK = projection('value')(inputs_kv_BSD)

    if relative and cfg.position == 'rope':
      # Keys are rotated before they are cached: each at its own absolute position.
      query_BLHK = layers.apply_rope(query_BLHK, positions_BL)
      key_BSHK = layers.apply_rope(key_BSHK, positions_BL)

    kv_positions_BS = positions_BL
    if self.decode and not self.is_cross_attention:
      key_BSHK, value_BSHK, mask_B1LS, kv_positions_BS = self._update_cache(
        key_BSHK, value_BSHK, mask_B1LS, positions_BL
      )

    bias_BHLS = None
    if relative and cfg.position == 'alibi':
      bias_BHLS = layers.alibi_bias(positions_BL, kv_positions_BS, layers.alibi_slopes(heads))

    causal = self.causal and not self.decode  # A cache applies causality itself.
    dropout = not deterministic and cfg.attention_dropout_rate > 0.0
    # eval.py's attention maps read the weights through `mutable=['intermediates']`.
    maps = self.is_mutable_collection('intermediates')
    kv_length = key_BSHK.shape[-1] if self.decode else key_BSHK.shape[1]  # A cache: [B, H, K, S].
    impl = implementation(
      cfg,
      query_BLHK.shape[1],
      kv_length,
      einsum_only=maps or dropout or self.decode,
      bias=bias_BHLS is not None,
      segments=segments is not None,
    )
    if impl is not None:
      out_BLHK = fused_attention(
        query_BLHK,
        key_BSHK,
        value_BSHK,
        mask_B1LS,
        causal=causal,
        bias_BHLS=bias_BHLS,
        implementation=impl,
        segments=segments,
      )
    else:
      if causal:
        causal_11LL = causal_mask(query_BLHK.shape[1])
        mask_B1LS = causal_11LL if mask_B1LS is None else mask_B1LS & causal_11LL
      out_BLHK, weights_BHLS = dot_product_attention(
        query_BLHK,
        key_BSHK,
        value_BSHK,
        mask_B1LS,
        bias_BHLS=bias_BHLS,
        dropout_rng=self.make_rng('dropout') if dropout else None,
        dropout_rate=cfg.attention_dropout_rate,
        kv_heads_first=self.decode,
      )
      self.sow('intermediates', 'attention_weights', weights_BHLS)
    return _Projection(cfg, (cfg.d_model,), 2, ('heads', 'kv', 'embed'), name='out')(out_BLHK)

  def _update_cache(self, key_B1HK, value_B1HK, mask_B11S, positions_B1):
    """Writes one step's key/value at the cache index; masks positions not yet written.

    Returns the keys and values to attend over, as [B, H, K, S], the mask and the key
    positions. The cache is kept in that layout, [B, H, K, max_decode_len], so that a
    step writes one column in place and reads the cache as the products want it. The
    call that creates the cache (no cache passed in) writes nothing: it only allocates
    the buffers, sets the index to 0 and attends to itself.
    """
    cfg = self.config
    is_initialized = self.has_variable('cache', 'cached_key')
    batch, _, heads, head_dim = key_B1HK.shape
    shape = (batch, heads, head_dim, cfg.max_decode_len)
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, shape, key_B1HK.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros, shape, value_B1HK.dtype)
    cache_index = self.variable('cache', 'cache_index', lambda: jnp.array(0, jnp.int32))
    if not is_initialized:
      return _heads_first(key_B1HK), _heads_first(value_B1HK), mask_B11S, positions_B1
    if key_B1HK.shape[1] != 1:
      raise ValueError(f'Cached decoding takes one token per step, got {key_B1HK.shape[1]}.')
    index = cache_index.value
    cached_key.value = jax.lax.dynamic_update_slice(
      cached_key.value, _heads_first(key_B1HK), (0, 0, 0, index)
    )
    cached_value.value = jax.lax.dynamic_update_slice(
      cached_value.value, _heads_first(value_B1HK), (0, 0, 0, index)
    )
    cache_index.value = index + 1
    # Causality: step `index` sees cache positions 0..index.
    written_11S = (jnp.arange(cfg.max_decode_len) <= index)[None, None, None, :]
    mask = written_11S if mask_B11S is None else (mask_B11S & written_11S)
    # Slot j holds the key of step j, whose position is j (the decoder numbers its steps).
    positions_1S = jnp.arange(cfg.max_decode_len)[None, :]
    return cached_key.value, cached_value.value, mask, positions_1S
