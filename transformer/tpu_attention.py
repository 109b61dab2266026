"""Eq. 1 on TPUs through JAX's Pallas kernel, splash attention, sharded over the mesh.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) is a flash-attention
kernel for TPUs written in Pallas (compiled by Mosaic): it never stores the [B, H, L, S]
weights, and it skips the blocks of the weights that its static mask (causal) rules out. It
reads this model's masks as they are built (`attention.segment_mask`, `causal`):

  padding, packed segments   the query and key/value segment ids (`SegmentIds`): a query
                             attends to the keys of its own segment. Padding is segment 0,
                             which no real query has, so no real query attends to padding.
  causal                     its static `CausalMask` (self-attention: L = S).
  cross-attention            lengths L != S, `FullMask` and the segment ids.
  grouped-query attention    G key/value heads for H query heads: query head h reads key/value
                             head h // (H / G), as `attention.dot_product_attention` groups them.
  RoPE                       nothing to take: queries and keys come rotated.

It takes no bias, so ALiBi (a dense [B, H, L, S] bias) is not expressible here; neither are
attention weights (maps), attention dropout or a cached decoding step (`attention.py`'s
module docstring says which path serves those).

The difference from the einsum: a padding query (segment 0) attends to the padding keys of its
row (segment 0 as well), or to every key if there are none, where the einsum gives it the mean
of all values. Nothing reads those outputs: no real query attends to padding, and the loss
leaves padding out, so the real outputs and every gradient are the same.

The kernel tiles lengths by blocks of `LANES` (128) positions. `attention` pads other lengths
up to the next multiple with segment 0 (never attended by a real query) and drops the padded
queries' outputs; `tiles` says whether a call needs no padding, which is where
`attention_impl='auto'` picks the kernel.

Mosaic kernels are not partitioned by XLA: under a mesh (`jax.set_mesh`, as training and
decoding trace their steps) the kernel runs in `jax.shard_map` over it, each device on its own
rows and heads: the batch split as the logical axis rules split `batch` (data x fsdp by
default), the heads as they split `heads` (tensor). Lengths and the head dim are kept whole.

Where the devices the program is compiled for are not TPUs (the CPU tests), the same kernel
runs in Pallas' interpret mode: the same blocks and the same arithmetic, as XLA operations.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from transformer import sharding

# The kernel's lengths are tiled by blocks of 128 positions (the TPU's vector lanes).
LANES = 128
# Block sizes tried, largest first: the largest dividing a (padded) length is its block.
BLOCKS = (512, 256, 128)


def platform() -> str:
  """The platform of the devices the program is compiled for: the active mesh's, else JAX's
  default backend.

  The mesh decides: `train.py --dry_run --topology` compiles for compile-only TPU devices
  while this process's own backend is the CPU.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device.platform
  return jax.default_backend()


def tiles(length: int, kv_length: int) -> bool:
  """Whether the kernel takes queries of `length` over keys of `kv_length` without padding."""
  return length % LANES == 0 and kv_length % LANES == 0


def _block(length: int) -> int:
  return next(block for block in BLOCKS if length % block == 0)


def _kernel(length: int, kv_length: int, heads: int, causal: bool, interpret: bool):
  """The splash kernel of one row: [H, L, K] queries over [G, S, K] keys and values."""
  # Imported here: the Pallas TPU modules load in 0.1 s that a model off TPUs never needs.
  from jax.experimental.pallas.ops.tpu import (  # pylint: disable=g-import-not-at-top
    splash_attention as splash,
  )

  shape = (length, kv_length)
  mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
  block_q, block_kv = _block(length), _block(kv_length)
  sizes = splash.BlockSizes(
    block_q=block_q,
    block_kv=block_kv,
    block_kv_compute=block_kv,
    block_q_dkv=block_q,
    block_kv_dkv=block_kv,
    block_kv_dkv_compute=block_kv,
    block_q_dq=block_q,
    block_kv_dq=block_kv,
  )
  kernel = splash.make_splash_mha(
    splash.MultiHeadMask([mask] * heads),
    block_sizes=sizes,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )
  return kernel, splash.SegmentIds


def _attend(query_BLHK, key_BSHK, value_BSHK, q_segments_BL, kv_segments_BS, *, causal, interpret):
  """The kernel over the rows and heads it is given (one device's under a mesh)."""
  _, length, heads, depth = query_BLHK.shape
  kernel, segment_ids = _kernel(length, key_BSHK.shape[1], heads, causal, interpret)
  query_BLHK = query_BLHK / jnp.sqrt(depth).astype(query_BLHK.dtype)  # As the einsum scales.

  def one_row(q_HLK, k_GSK, v_GSK, q_segments_L, kv_segments_S):
    return kernel(q_HLK, k_GSK, v_GSK, segment_ids=segment_ids(q_segments_L, kv_segments_S))

  heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, L, H, K] <-> [B, H, L, K]
  out_BHLK = jax.vmap(one_row)(
    heads_first(query_BLHK),
    heads_first(key_BSHK),
    heads_first(value_BSHK),
    q_segments_BL,
    kv_segments_BS,
  )
  return heads_first(out_BHLK)


def _mesh_axes(logical: str, size: int, mesh, taken: tuple[str, ...]) -> tuple[str, ...] | None:
  """The mesh axes the logical axis rules put `logical` on, if they divide `size` (else None:
  the dimension stays whole on every device), leaving out axes already `taken`."""
  axes = tuple(a for a in sharding.mesh_axes(logical) if a in mesh.shape and a not in taken)
  if not axes or size % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes


def attention(
  query_BLHK: jax.Array,
  key_BSHK: jax.Array,
  value_BSHK: jax.Array,
  q_segments_BL: jax.Array,
  kv_segments_BS: jax.Array,
  *,
  causal: bool = False,
  interpret: bool | None = None,
) -> jax.Array:
  """softmax(Q K^T / sqrt(d_k)) V within segments (0: padding), through splash attention.

  Keys and values may have fewer heads than the queries (grouped-query attention). `causal`
  (self-attention only) adds the causal mask. Returns the attended values [B, L, H, K].
  `interpret`: run the kernel as XLA operations; default: unless compiling for TPUs.
  """
  batch, length, heads, _ = query_BLHK.shape
  kv_length = key_BSHK.shape[1]
  if causal and length != kv_length:
    raise ValueError(f'Causal attention is self-attention, got lengths {length} != {kv_length}.')
  if interpret is None:
    interpret = platform() != 'tpu'
  pad_q, pad_kv = -length % LANES, -kv_length % LANES
  if pad_q or pad_kv:  # Padded positions are segment 0: no real query attends to them.

    def padded(x, pad):
      return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    query_BLHK, q_segments_BL = padded(query_BLHK, pad_q), padded(q_segments_BL, pad_q)
    key_BSHK, value_BSHK = padded(key_BSHK, pad_kv), padded(value_BSHK, pad_kv)
    kv_segments_BS = padded(kv_segments_BS, pad_kv)
  attend = functools.partial(_attend, causal=causal, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    P = jax.sharding.PartitionSpec  # noqa: N806  (JAX's own short name)
    rows = _mesh_axes('batch', batch, mesh, ())
    kv_heads = key_BSHK.shape[2]
    head_axes = _mesh_axes('heads', math.gcd(heads, kv_heads), mesh, rows or ())
    per_head, per_row = P(rows, None, head_axes, None), P(rows, None)
    attend = jax.shard_map(
      attend,
      mesh=mesh,
      in_specs=(per_head, per_head, per_head, per_row, per_row),
      out_specs=per_head,
      check_vma=False,
    )
  out_BLHK = attend(query_BLHK, key_BSHK, value_BSHK, q_segments_BL, kv_segments_BS)
  return out_BLHK[:, :length]
