"""Attention maps of one sentence pair, read from the model's own forward pass, and their plots.

`collect_attention` runs the full (teacher-forced, deterministic) forward pass
with `mutable=['intermediates']` and gathers the weights every
`MultiHeadAttention` sows there; nothing is recomputed outside the model.
`plot_attention` writes one PNG per attention kind and layer, one panel per head;
`translate_and_plot` does both for a sentence it translates first (eval.py
--attention_plot).

Positions of the decoder: for target pieces `tgt_tokens_L` (e.g. a reference
tokenized with EOS appended, or a decoded translation), the decoder reads
`[BOS] + tgt_tokens_L[:-1]` (teacher forcing, exactly as in training), so
position i reads BOS, y_0 .. y_{i-1} and predicts `tgt_tokens_L[i]`. Rows of
decoder maps are labelled with the piece each position predicts; the columns of
decoder self-attention with the piece each position reads.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from transformer import inference
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.model import Transformer
from transformer.tasks import translation

if TYPE_CHECKING:
  from matplotlib.figure import Figure

ENCODER_SELF_ATTENTION = 'encoder_self_attention'
DECODER_SELF_ATTENTION = 'decoder_self_attention'
CROSS_ATTENTION = 'cross_attention'
KINDS = (ENCODER_SELF_ATTENTION, DECODER_SELF_ATTENTION, CROSS_ATTENTION)

# Where each kind is sown: intermediates/<stack>/layer_<i>/<module>/attention_weights.
_SOWN_AT = {
  ENCODER_SELF_ATTENTION: ('encoder', 'self_attention'),
  DECODER_SELF_ATTENTION: ('decoder', 'self_attention'),
  CROSS_ATTENTION: ('decoder', 'cross_attention'),
}
_TITLES = {
  ENCODER_SELF_ATTENTION: 'Encoder self-attention',
  DECODER_SELF_ATTENTION: 'Decoder self-attention (masked)',
  CROSS_ATTENTION: 'Encoder-decoder attention',
}
_BOS_LABEL = '<s>'  # The tokenizer's BOS piece: what decoder position 0 reads.
_MAX_PANEL_COLUMNS = 4  # Heads per row of panels; more heads wrap to further rows.
_INCHES_PER_TOKEN = 0.22
_MIN_PANEL_INCHES = 2.5


def _strip(tokens, name: str, *, cut_after_eos: bool) -> np.ndarray:
  """One sequence as int32 [N]: padding (0) removed and, optionally, nothing after EOS."""
  tokens = np.asarray(tokens)
  if tokens.ndim == 2 and tokens.shape[0] == 1:
    tokens = tokens[0]
  if tokens.ndim != 1:
    raise InvalidInput(f'{name} must be one sequence [N] (or [1, N]), got shape {tokens.shape}.')
  tokens = tokens[tokens != tokenizer_lib.PAD_ID].astype(np.int32)
  if cut_after_eos:
    eos = np.flatnonzero(tokens == tokenizer_lib.EOS_ID)
    if eos.size:
      tokens = tokens[: eos[0] + 1]
  if tokens.size == 0:
    raise InvalidInput(f'{name} has no tokens besides padding.')
  return tokens


def decoder_inputs(tgt_tokens_L: np.ndarray) -> np.ndarray:
  """The teacher-forced decoder input of a target [L]: `[BOS] + tgt_tokens_L[:-1]`."""
  return np.concatenate([[tokenizer_lib.BOS_ID], np.asarray(tgt_tokens_L)[:-1]]).astype(np.int32)


@functools.cache
def _forward_with_intermediates(model_config: ModelConfig):
  """Jitted full forward pass returning the sown intermediates (cached per config)."""
  model = Transformer(model_config.replace(deterministic=True, decode=False))

  def forward(params, src_tokens_1S, tgt_input_tokens_1L):
    _, variables = model.apply(
      {'params': params}, src_tokens_1S, tgt_input_tokens_1L, mutable=['intermediates']
    )
    return variables['intermediates']

  return jax.jit(forward)


def collect_attention(
  params, model_config: ModelConfig, src_tokens_S, tgt_tokens_L
) -> dict[str, list[np.ndarray]]:
  """Attention weights of every layer for one sentence pair, from one full forward pass.

  Args:
    params: Model parameters (plain or logically boxed).
    model_config: The model's config; run here deterministic and without cache.
    src_tokens_S: Source piece ids as the model reads them (pieces + EOS), [S] or
      [1, S]; padding (0) is removed.
    tgt_tokens_L: Target piece ids the decoder is forced to (pieces + EOS, e.g. a
      reference or a decoded translation), [L] or [1, L]; padding and anything
      after the first EOS are removed. The decoder reads `[BOS] + tgt[:-1]`.

  Returns:
    {kind: [one float32 array per layer]} for kind in `KINDS`, each array
    [H, L_q, L_k]: encoder self-attention [H, S, S], decoder self-attention
    [H, L, L], cross-attention [H, L, S]. Row q is the softmax distribution of
    query position q over the key positions.
  """
  src_S = _strip(src_tokens_S, 'src_tokens_S', cut_after_eos=False)
  tgt_L = _strip(tgt_tokens_L, 'tgt_tokens_L', cut_after_eos=True)
  longest = max(src_S.size, tgt_L.size)
  if longest > model_config.max_len:
    raise InvalidInput(
      f'A sequence of {longest} tokens exceeds the model max_len={model_config.max_len}.'
    )
  sown = _forward_with_intermediates(model_config)(
    nn.meta.unbox(params), jnp.asarray(src_S[None]), jnp.asarray(decoder_inputs(tgt_L)[None])
  )
  weights = {}
  for kind, (stack, module) in _SOWN_AT.items():
    weights[kind] = []
    for i in range(model_config.num_layers):
      (weights_1HQK,) = sown[stack][f'layer_{i}'][module]['attention_weights']
      weights[kind].append(np.asarray(weights_1HQK[0], np.float32))
  return weights


def token_labels(tokenizer: tokenizer_lib.Tokenizer, tokens) -> list[str]:
  """Piece strings of ids (padding dropped), e.g. for `plot_attention`'s labels."""
  return [
    tokenizer.id_to_piece(int(t))
    for t in np.asarray(tokens).reshape(-1)
    if int(t) != tokenizer_lib.PAD_ID
  ]


def _escape(label: str) -> str:
  return label.replace('$', r'\$')  # A '$' would otherwise start mathtext.


def attention_figure(
  weights_HQK: np.ndarray,
  row_labels: Sequence[str],
  column_labels: Sequence[str],
  title: str,
  *,
  row_axis: str = 'query',
  column_axis: str = 'key',
) -> Figure:
  """A figure with one heatmap panel per head (color scale 0..1) and a shared colorbar.

  The figure is not attached to pyplot; its axes are the H panels followed by
  the colorbar.
  """
  # Matplotlib is imported where a figure is drawn: not at every start of eval.py.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  heads, rows, columns = weights_HQK.shape
  if len(row_labels) != rows or len(column_labels) != columns:
    raise InvalidInput(
      f'{title}: weights are [{heads}, {rows}, {columns}] but there are {len(row_labels)} '
      f'row labels and {len(column_labels)} column labels.'
    )
  ncols = min(heads, _MAX_PANEL_COLUMNS)
  nrows = math.ceil(heads / ncols)
  panel_w = max(_MIN_PANEL_INCHES, _INCHES_PER_TOKEN * columns + 1.2)
  panel_h = max(_MIN_PANEL_INCHES, _INCHES_PER_TOKEN * rows + 1.2)
  fig = Figure(figsize=(panel_w * ncols + 1.0, panel_h * nrows + 0.8), layout='constrained')
  FigureCanvasAgg(fig)
  fig.suptitle(title)
  axes = fig.subplots(nrows, ncols, squeeze=False)
  image = None
  for h, ax in enumerate(axes.flat):
    if h >= heads:
      fig.delaxes(ax)  # Empty slots of the last row.
      continue
    image = ax.imshow(
      weights_HQK[h], vmin=0.0, vmax=1.0, cmap='viridis', aspect='auto', interpolation='nearest'
    )
    ax.set_title(f'head {h}', fontsize=9)
    ax.set_xticks(range(columns), [_escape(x) for x in column_labels], rotation=90, fontsize=7)
    ax.set_yticks(range(rows), [_escape(y) for y in row_labels], fontsize=7)
    ax.set_xlabel(column_axis, fontsize=8)
    ax.set_ylabel(row_axis, fontsize=8)
  fig.colorbar(image, ax=axes.ravel().tolist()[:heads], shrink=0.8, label='attention weight')
  return fig


def plot_attention(
  weights: Mapping[str, Sequence[np.ndarray]],
  src_labels: Sequence[str],
  tgt_labels: Sequence[str],
  out_dir: str,
) -> list[str]:
  """Writes `<out_dir>/<kind>_layer<i>.png` for every kind and layer of `weights`.

  Args:
    weights: `collect_attention`'s output (or a subset of its kinds).
    src_labels: One label per source position (e.g. `token_labels(tok, src)`).
    tgt_labels: One label per decoder position: the target piece it predicts
      (`token_labels(tok, tgt)` of the `tgt_tokens_L` given to
      `collect_attention`). Decoder self-attention columns are what each
      position reads: `<s>` then `tgt_labels[:-1]`.
    out_dir: Created if absent.

  Returns:
    The written paths, kinds in `KINDS` order, layers ascending.

  Encoder self-attention is source x source, decoder self-attention target x
  target (rows predict, columns read), cross-attention target rows x source
  columns. Every panel uses the same 0..1 color scale.
  """
  unknown = set(weights) - set(KINDS)
  if unknown:
    raise InvalidInput(f'Unknown attention kinds {sorted(unknown)}; expected some of {KINDS}.')
  tgt_labels = list(tgt_labels)
  axes_of = {
    ENCODER_SELF_ATTENTION: (list(src_labels), list(src_labels), 'source', 'source'),
    DECODER_SELF_ATTENTION: (
      tgt_labels,
      [_BOS_LABEL] + tgt_labels[:-1],
      'target (predicting)',
      'target (reading)',
    ),
    CROSS_ATTENTION: (tgt_labels, list(src_labels), 'target (predicting)', 'source'),
  }
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for kind in KINDS:
    if kind not in weights:
      continue
    rows, columns, row_axis, column_axis = axes_of[kind]
    for layer, weights_HQK in enumerate(weights[kind]):
      fig = attention_figure(
        np.asarray(weights_HQK),
        rows,
        columns,
        f'{_TITLES[kind]}, layer {layer}',
        row_axis=row_axis,
        column_axis=column_axis,
      )
      path = os.path.join(out_dir, f'{kind}_layer{layer}.png')
      fig.savefig(path, dpi=100)
      paths.append(path)
  logging.info('Wrote %d attention maps to %s.', len(paths), out_dir)
  return paths


def translate_and_plot(
  config: ml_collections.ConfigDict,
  model_config: ModelConfig,
  params,
  text: str,
  options: inference.DecodeOptions,
  out_dir: str,
) -> list[str]:
  """Translates `text`, then draws the model's attention over source and translation.

  One PNG per kind (encoder self, decoder self, cross) and layer, a panel per
  head, subword pieces on the axes. Returns the written paths.
  """
  tokenizer = tokenizer_lib.get_tokenizer(
    config.data, vocab_size=config.vocab_size, seed=config.seed
  )
  src_tokens = np.asarray(tokenizer.encode(text) + [tokenizer_lib.EOS_ID], np.int32)[None]
  translate_fn = translation.decode.make_translate_fn(model_config, options)
  output = np.asarray(translate_fn(params, src_tokens, jax.random.key(0)))[0]
  output = (
    output[: np.flatnonzero(output == tokenizer_lib.EOS_ID)[0] + 1]
    if (output == tokenizer_lib.EOS_ID).any()
    else output[output != 0]
  )
  logging.info('Translation: %s', tokenizer.decode(output.tolist()))
  weights = collect_attention(params, model_config, src_tokens[0], output)
  os.makedirs(out_dir, exist_ok=True)
  return plot_attention(
    weights, token_labels(tokenizer, src_tokens[0]), token_labels(tokenizer, output), out_dir
  )
