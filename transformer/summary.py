"""Model inspection for `train.py --dry_run`: parameter table, FLOPs per token, device peaks."""

from __future__ import annotations

import collections
import re

import flax
import jax
import numpy as np

from transformer.config import ModelConfig


def parameter_table(params) -> tuple[list[tuple[str, str, int]], int]:
  """Rows (module, shape summary, count) with layer indices folded, and the total count.

  `encoder/layer_3/ffn/wi/kernel` is counted under `encoder/layer_*/ffn`.
  """
  groups: dict[str, list] = collections.defaultdict(lambda: [0, set()])
  for path, leaf in flax.traverse_util.flatten_dict(params).items():
    # encoder/layer_3/ffn/wi/kernel -> encoder/layer_3/ffn; shared_embedding/embedding as is.
    module = '/'.join(path[:3] if len(path) > 3 else path[:-1])
    match = re.search(r'layer_(\d+)', module)
    folded = re.sub(r'layer_\d+', 'layer_*', module)
    groups[folded][0] += int(np.prod(leaf.shape))
    if match:
      groups[folded][1].add(match.group(1))
  rows = []
  for module, (count, layer_ids) in groups.items():
    copies = max(len(layer_ids), 1)
    detail = f'{copies} x {count // copies:,}' if 'layer_*' in module else ''
    rows.append((module, detail, count))
  total = sum(count for _, _, count in rows)
  return rows, total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
  """Model FLOPs per target token of a training step (forward + backward = 3 x forward).

  Derived from the model's own parameter shapes: every kernel (a projection of eq. 1, the
  FFN's matrices of eq. 2, an untied softmax) multiplies each token's vector once, 2 FLOPs
  per weight; a tied softmax reads the embedding the same way; and each attention adds its
  two products Q K^T and weights x V, 2 x 2 x `seq_len` x h x d_k per query. So a variant
  that changes a shape (SwiGLU's third matrix, fewer key/value heads) is counted as it is
  built. Matmuls only, for a source of the same length as the target, one source token per
  target token: the encoder's work on the source is charged to the target token it pairs
  with. A decoder-only model has neither the encoder nor the cross-attention.
  """
  from transformer.model import Transformer  # pylint: disable=g-import-not-at-top

  params = flax.traverse_util.flatten_dict(abstract_params(Transformer(cfg)))
  weights = sum(int(np.prod(leaf.shape)) for path, leaf in params.items() if path[-1] == 'kernel')
  if cfg.share_embeddings:  # The softmax of section 3.4 reads the shared embedding.
    weights += cfg.d_model * cfg.vocab_size
  attentions = (3 if cfg.has_encoder else 1) * cfg.num_layers  # Self (2 stacks) and cross.
  scores = attentions * 2 * 2 * seq_len * cfg.d_model  # h x d_k = d_model per query.
  forward = 2 * weights + scores
  return {'forward': float(forward), 'train': 3.0 * forward}


# Published dense bfloat16 matmul peaks, FLOP/s per device, by `device_kind` prefix.
PEAK_BF16_FLOPS = {
  'NVIDIA H200': 989e12,
  'NVIDIA H100': 989e12,  # SXM; the PCIe card: 756e12.
  'NVIDIA A100': 312e12,
  'NVIDIA L4': 121e12,
  'NVIDIA A10G': 70e12,
  'TPU v6': 918e12,
  'TPU v5p': 459e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v4': 275e12,
  'TPU v3': 123e12,
}


def published_peak_flops(device) -> float | None:
  """The device's published bfloat16 peak from PEAK_BF16_FLOPS; None on CPUs and unknowns."""
  if device.platform == 'cpu':
    return None
  for kind, peak in PEAK_BF16_FLOPS.items():
    if device.device_kind.startswith(kind):
      return peak
  return None


def format_table(rows: list[tuple[str, str, int]], total: int) -> str:
  width = max(len(module) for module, _, _ in rows)
  lines = [f'{"module":<{width}}  {"layers x per layer":>22}  {"params":>13}']
  lines += [f'{module:<{width}}  {detail:>22}  {count:>13,}' for module, detail, count in rows]
  lines.append(f'{"total":<{width}}  {"":>22}  {total:>13,}')
  return '\n'.join(lines)


def abstract_params(model, seq_len: int = 8):
  """Parameter shapes of `model` via `jax.eval_shape` (nothing allocated or computed)."""
  tokens = jax.ShapeDtypeStruct((1, seq_len), np.int32)
  src = tokens if model.config.has_encoder else None
  shapes = jax.eval_shape(lambda s, t: model.init(jax.random.key(0), s, t), src, tokens)
  return flax.linen.meta.unbox(shapes['params'])
