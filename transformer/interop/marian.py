"""Exact maps between this project's encoder-decoder and Hugging Face's `MarianMTModel`.

Marian (and the 1,000+ OPUS-MT models) is the paper's Transformer: post-LN, sinusoidal
positions, embeddings scaled by sqrt(d_model) and (by default) shared with the softmax. Four
layouts differ, and each has an exact equivalence:

- **Positions.** Section 3.5 indexes sin at even and cos at odd dimensions (this project);
  Marian puts the sines in the first half and the cosines in the second, at the same
  frequencies. A permutation of the hidden axis, applied to every weight that reads or
  writes the residual stream (embeddings, projections, LayerNorm scales and biases), is an
  exact equivalence: LayerNorm, residual sums and the position-wise FFN commute with it, and
  dot products over the hidden axis are unchanged. `hidden_permutation` is that map.
- **Special tokens.** This project's ids are pad 0, eos 1, bos 2 (the decoder's first input),
  unk 3; Marian's are named in its config (OPUS-MT: eos 0, unk 1, pad = the last id, and pad
  is also the decoder's start token). Export keeps this project's ids and names them in the
  config (`pad_token_id=0`, `decoder_start_token_id=2`, ...). Import reorders the vocabulary
  to [pad, eos, start, unk, every other id in order] (`vocabulary_order`); where Marian starts
  the decoder with pad, the bos row is a copy of the pad row, one entry more than Marian's.
- **The logits bias.** Marian adds `final_logits_bias` to the logits: `model.logits_bias`;
  a model without one exports zeros, and imports zeros as `logits_bias=False`.
- **LayerNorm's epsilon.** Marian's is PyTorch's 1e-5 and cannot be set; this project's
  default is 1e-6 (`model.norm_epsilon`). Imported models carry 1e-5; a 1e-6 model exports
  exactly only with 1e-5 (`export_refusals` says so; convert.py's --allow_norm_epsilon
  writes it anyway, an approximation it states).

What has no exact Marian form is refused by name (`export_refusals`): pre-norm (Marian is
post-LN only; transformers' M2M100, fairseq's pre-LN Transformer, computes other sinusoid
frequencies and starts positions at padding_idx + 1, so it is no exact home either: serve
those models with CTranslate2), positions other than sinusoidal, SwiGLU, models without
biases, decoder-only models (no Marian class; `MarianForCausalLM` is Marian's decoder with
cross-attention dropped only when used alone, and its positions and heads are not this
project's language model's).

An import is of the model config.json states, or nothing: `state_layout` is every tensor that
config implies (name -> shape, each dimension named by its config key), and `state_refusals`
compares the state dict with it: a shape, NaN or inf, positions other than the sinusoids, tied
copies that differ, a tensor missing or one no Marian model of that config has, each named.

Arrays are numpy in PyTorch's layouts (`Linear.weight` is [out, in]); nothing here imports
torch or transformers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from transformer import config_fields
from transformer.config import ModelConfig

MARIAN_NORM_EPSILON = 1e-5
# This project's `ffn_activation` -> Marian's `activation_function`, and back.
TO_MARIAN_ACTIVATION = {'relu': 'relu', 'gelu': 'gelu', 'swish': 'swish'}
FROM_MARIAN_ACTIVATION = {'relu': 'relu', 'gelu': 'gelu', 'swish': 'swish', 'silu': 'swish'}
# The special ids this project's tokenizer fixes (`tokenizer.PAD_ID`, ...), in id order.
SPECIALS = ('pad', 'eos', 'bos', 'unk')
# The sizes config.json must state: positive integers, the dimensions of the weights.
SIZE_KEYS = (
  'vocab_size', 'd_model', 'encoder_layers', 'decoder_layers', 'encoder_attention_heads',
  'decoder_attention_heads', 'encoder_ffn_dim', 'decoder_ffn_dim',
)  # fmt: skip
MAX_POSITIONS = 1024  # transformers' MarianConfig max_position_embeddings, where it is unset.
# One tied matrix (share_encoder_decoder_embeddings): transformers saves one of these names.
TIED_EMBEDDINGS = (
  'model.shared.weight',
  'model.encoder.embed_tokens.weight',
  'model.decoder.embed_tokens.weight',
  'lm_head.weight',
)
# Tensors a Marian directory may leave out: positions are recomputed sinusoids (transformers
# does not save them), an absent final_logits_bias is zeros.
OPTIONAL_TENSORS = (
  'model.encoder.embed_positions.weight',
  'model.decoder.embed_positions.weight',
  'final_logits_bias',
)

_ATTENTION = {'query': 'q_proj', 'key': 'k_proj', 'value': 'v_proj'}
# This project's sub-layer and norm names -> Marian's, per stack.
_ENCODER_LAYER = {
  'self_attention': 'self_attn',
  'self_attention_norm': 'self_attn_layer_norm',
  'ffn_norm': 'final_layer_norm',
}
_DECODER_LAYER = {
  **_ENCODER_LAYER,
  'cross_attention': 'encoder_attn',
  'cross_attention_norm': 'encoder_attn_layer_norm',
}


# The model fields this format expresses (each checked above or mapped); a switch declared
# later (`config_fields`) is refused by name while it is on, never exported wrongly.
MAPPED_FIELDS = tuple(
  f'model.{name}'
  for name in (
    'architecture', 'num_layers', 'd_model', 'num_heads', 'd_ff', 'norm', 'position',
    'ffn_activation', 'use_bias', 'norm_epsilon', 'logits_bias', 'share_embeddings', 'max_len',
  )
)  # fmt: skip


def export_refusals(cfg: ModelConfig, *, allow_norm_epsilon: bool = False) -> list[str]:
  """Why `cfg` has no exact `MarianMTModel`: one line per field, naming it; [] if it has one."""
  refusals = []
  if cfg.architecture != 'encoder_decoder':
    refusals.append(
      f'config.model.architecture={cfg.architecture!r}: Marian is an encoder-decoder; no '
      'Hugging Face Marian class holds a decoder-only language model.'
    )
  if cfg.norm != 'post_ln':
    refusals.append(
      f"config.model.norm={cfg.norm!r}: Marian is post-LN only, and transformers' pre-LN "
      'M2M100 (fairseq) has other sinusoid frequencies and positions offset by padding_idx + 1, '
      'so neither holds this model exactly. Serve it with --to_ctranslate2 (pre-norm spec).'
    )
  if cfg.position != 'sinusoidal':
    refusals.append(
      f'config.model.position={cfg.position!r}: Marian has sinusoidal positions only.'
    )
  if cfg.ffn_activation not in TO_MARIAN_ACTIVATION:
    refusals.append(
      f'config.model.ffn_activation={cfg.ffn_activation!r}: Marian has one FFN matrix pair '
      f'with one of {tuple(TO_MARIAN_ACTIVATION)} between them.'
    )
  if not cfg.use_bias:
    refusals.append('config.model.use_bias=False: every Marian projection and norm has a bias.')
  if cfg.d_model % 2:
    refusals.append(f'config.model.d_model={cfg.d_model}: Marian needs an even width.')
  if cfg.norm_epsilon != MARIAN_NORM_EPSILON and not allow_norm_epsilon:
    refusals.append(
      f"config.model.norm_epsilon={cfg.norm_epsilon:g}: Marian's LayerNorm adds "
      f'{MARIAN_NORM_EPSILON:g} to the variance and cannot be set, so the exported model would '
      'compute slightly different numbers. Train with --config.model.norm_epsilon=1e-5 for an '
      'exact export, or pass --allow_norm_epsilon to write it anyway (an approximation).'
    )
  refusals += [
    f'{switch}: Marian has no such part (a switch this export does not express).'
    for switch in config_fields.unmapped_switches(MAPPED_FIELDS, cfg)
  ]
  return refusals


def hidden_permutation(d_model: int) -> np.ndarray:
  """`perm` with ours[..., k] = marian[..., perm[k]] on every hidden (d_model) axis.

  This project's dimension 2i holds sin(pos w_i) and 2i+1 cos(pos w_i) (section 3.5);
  Marian's dimension i holds sin(pos w_i) and d/2 + i cos(pos w_i).
  """
  half = (d_model + 1) // 2
  perm = np.empty(d_model, np.int64)
  perm[0::2] = np.arange(half)
  perm[1::2] = half + np.arange(d_model // 2)
  return perm


def marian_positions(max_len: int, d_model: int) -> np.ndarray:
  """Marian's static sinusoid table [max_len, d_model], float32 (its `embed_positions`)."""
  positions = np.arange(max_len, dtype=np.float64)[:, None]
  dims = np.arange(d_model)
  angles = positions / np.power(10000, 2 * (dims // 2) / d_model)
  half = (d_model + 1) // 2
  table = np.empty((max_len, d_model), np.float32)
  table[:, :half] = np.sin(angles[:, 0::2])
  table[:, half:] = np.cos(angles[:, 1::2])
  return table


def vocabulary_order(pad_id: int, eos_id: int, start_id: int, unk_id: int, size: int) -> np.ndarray:
  """Marian's id of each of this project's ids: [pad, eos, start, unk, the others in order].

  Where Marian starts the decoder with its pad token (OPUS-MT), pad appears twice: this
  project's pad (never attended to) and bos (the decoder's first input) read the same row.
  """
  specials = [pad_id, eos_id, start_id, unk_id]
  if len({pad_id, eos_id, unk_id}) < 3 or eos_id == start_id or unk_id == start_id:
    raise ValueError(
      f'pad {pad_id}, eos {eos_id}, decoder start {start_id} and unk {unk_id} must be distinct '
      '(the decoder may start with pad).'
    )
  if not all(0 <= i < size for i in specials):
    raise ValueError(f'Special ids {specials} lie outside the vocabulary of {size}.')
  others = np.setdiff1d(np.arange(size), specials)
  return np.concatenate([np.asarray(specials, np.int64), others])


def to_marian(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Marian's state dict (names and PyTorch layouts, float32) of this project's `params`."""
  to_marian_axis = np.argsort(hidden_permutation(cfg.d_model))  # marian[j] = ours[that[j]]

  def hidden(array, axis):
    return np.take(np.asarray(array, np.float32), to_marian_axis, axis=axis)

  state: dict[str, np.ndarray] = {}

  def attention(prefix, tree):
    d = cfg.d_model
    for ours, theirs in _ATTENTION.items():
      kernel = hidden(np.reshape(tree[ours]['kernel'], (d, d)), 0)  # [D, H*K]
      state[f'{prefix}.{theirs}.weight'] = np.ascontiguousarray(kernel.T)
      state[f'{prefix}.{theirs}.bias'] = np.reshape(tree[ours]['bias'], (d,)).astype(np.float32)
    out = hidden(np.reshape(tree['out']['kernel'], (d, d)), 1)  # [H*K, D]
    state[f'{prefix}.out_proj.weight'] = np.ascontiguousarray(out.T)
    state[f'{prefix}.out_proj.bias'] = hidden(tree['out']['bias'], 0)

  def layer(prefix, tree, names):
    for ours, theirs in names.items():
      if ours.endswith('_norm'):
        state[f'{prefix}.{theirs}.weight'] = hidden(tree[ours]['scale'], 0)
        state[f'{prefix}.{theirs}.bias'] = hidden(tree[ours]['bias'], 0)
      else:
        attention(f'{prefix}.{theirs}', tree[ours])
    ffn = tree['ffn']
    state[f'{prefix}.fc1.weight'] = np.ascontiguousarray(hidden(ffn['wi']['kernel'], 0).T)
    state[f'{prefix}.fc1.bias'] = np.asarray(ffn['wi']['bias'], np.float32)
    state[f'{prefix}.fc2.weight'] = np.ascontiguousarray(hidden(ffn['wo']['kernel'], 1).T)
    state[f'{prefix}.fc2.bias'] = hidden(ffn['wo']['bias'], 0)

  for i in range(cfg.num_layers):
    layer(f'model.encoder.layers.{i}', params['encoder'][f'layer_{i}'], _ENCODER_LAYER)
    layer(f'model.decoder.layers.{i}', params['decoder'][f'layer_{i}'], _DECODER_LAYER)
  if cfg.share_embeddings:
    shared = hidden(params['shared_embedding']['embedding'], 1)
    for name in ('model.shared', 'model.encoder.embed_tokens', 'model.decoder.embed_tokens'):
      state[f'{name}.weight'] = shared
    state['lm_head.weight'] = shared
  else:
    state['model.encoder.embed_tokens.weight'] = hidden(params['src_embedding']['embedding'], 1)
    state['model.decoder.embed_tokens.weight'] = hidden(params['tgt_embedding']['embedding'], 1)
    logits = params['decoder']['logits']['kernel']  # [D, V]
    state['lm_head.weight'] = np.ascontiguousarray(hidden(logits, 0).T)
  table = marian_positions(cfg.max_len, cfg.d_model)
  state['model.encoder.embed_positions.weight'] = table
  state['model.decoder.embed_positions.weight'] = table
  bias = params['decoder'].get('logits_bias')
  bias = np.zeros(cfg.vocab_size, np.float32) if bias is None else np.asarray(bias, np.float32)
  state['final_logits_bias'] = bias[None, :]
  return state


def marian_config(cfg: ModelConfig, *, pad_id: int, eos_id: int, bos_id: int) -> dict[str, Any]:
  """The `config.json` of `MarianMTModel` for `cfg` (this project's special ids kept)."""
  return {
    'architectures': ['MarianMTModel'],
    'model_type': 'marian',
    'vocab_size': cfg.vocab_size,
    'decoder_vocab_size': cfg.vocab_size,
    'd_model': cfg.d_model,
    'encoder_layers': cfg.num_layers,
    'decoder_layers': cfg.num_layers,
    'encoder_attention_heads': cfg.num_heads,
    'decoder_attention_heads': cfg.num_heads,
    'encoder_ffn_dim': cfg.d_ff,
    'decoder_ffn_dim': cfg.d_ff,
    'activation_function': TO_MARIAN_ACTIVATION[cfg.ffn_activation],
    'dropout': cfg.dropout_rate,
    'attention_dropout': cfg.attention_dropout_rate,
    'activation_dropout': cfg.ffn_dropout_rate,
    'max_position_embeddings': cfg.max_len,
    'scale_embedding': True,  # Section 3.4: embeddings times sqrt(d_model).
    'share_encoder_decoder_embeddings': cfg.share_embeddings,
    'tie_word_embeddings': cfg.share_embeddings,
    'pad_token_id': pad_id,
    'eos_token_id': eos_id,
    'forced_eos_token_id': eos_id,
    'decoder_start_token_id': bos_id,
    'bos_token_id': bos_id,
    'is_encoder_decoder': True,
    'encoder_layerdrop': 0.0,
    'decoder_layerdrop': 0.0,
    'init_std': 0.02,
    'use_cache': True,
  }


def import_refusals(marian: Mapping[str, Any]) -> list[str]:
  """Why Marian `config.json` values have no exact form here: one line per key; [] if none."""
  refusals = []

  def refuse(key, why):
    refusals.append(f'config.json {key}={marian.get(key)!r}: {why}')

  if marian.get('model_type') != 'marian':
    refuse('model_type', "only Marian models ('marian', MarianMTModel) are imported.")
  for key in SIZE_KEYS:
    if key not in marian:
      refusals.append(f'config.json has no {key}: it states every size of a Marian model.')
    elif not _positive_int(marian[key]):
      refuse(key, 'must be a positive integer.')
  if 'max_position_embeddings' in marian and not _positive_int(marian['max_position_embeddings']):
    refuse('max_position_embeddings', 'must be a positive integer.')
  for ours, (encoder, decoder) in {
    'num_layers': ('encoder_layers', 'decoder_layers'),
    'num_heads': ('encoder_attention_heads', 'decoder_attention_heads'),
    'd_ff': ('encoder_ffn_dim', 'decoder_ffn_dim'),
  }.items():
    if marian.get(encoder) != marian.get(decoder):
      refuse(decoder, f'differs from {encoder}={marian.get(encoder)!r}; model.{ours} is one.')
  activation = marian.get('activation_function', 'gelu')
  if not isinstance(activation, str) or activation not in FROM_MARIAN_ACTIVATION:
    refuse('activation_function', f'not one of {tuple(FROM_MARIAN_ACTIVATION)}.')
  for key in ('dropout', 'attention_dropout', 'activation_dropout'):
    rate = marian.get(key, 0.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate < 1:
      refuse(key, 'must be a rate in [0, 1).')
  if marian.get('scale_embedding', False) is not True:
    refuse('scale_embedding', 'this model multiplies embeddings by sqrt(d_model) (3.4).')
  # Keys of the BART family that Marian configs carry; any other value changes the model.
  for key, value in {
    'normalize_before': False,
    'normalize_embedding': False,
    'add_final_layer_norm': False,
    'static_position_embeddings': True,
    'add_bias_logits': False,
  }.items():
    if key in marian and marian[key] != value:
      refuse(key, f'only {value} is Marian as transformers runs it and as this project does.')
  shared = marian.get('share_encoder_decoder_embeddings', True)
  if not isinstance(shared, bool):
    refuse('share_encoder_decoder_embeddings', 'must be true or false.')
  elif shared != marian.get('tie_word_embeddings', True):
    refuse(
      'tie_word_embeddings',
      f'differs from share_encoder_decoder_embeddings={shared!r}: model.share_embeddings '
      'ties all three matrices or none.',
    )
  vocab = marian.get('vocab_size')
  if marian.get('decoder_vocab_size', vocab) not in (None, vocab):
    refuse('decoder_vocab_size', f'differs from vocab_size={vocab!r}: one vocabulary here.')
  d_model, heads = marian.get('d_model'), marian.get('encoder_attention_heads')
  if _positive_int(d_model) and _positive_int(heads) and (d_model % heads or d_model % 2):
    refuse('d_model', f'must be even and a multiple of the {heads} heads.')
  for key in ('pad_token_id', 'eos_token_id', 'decoder_start_token_id'):
    if not _int_at_least(marian.get(key), 0):
      refuse(key, 'must be a token id (an integer >= 0).')
  return refusals


def _int_at_least(value: Any, least: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive_int(value: Any) -> bool:
  return _int_at_least(value, 1)


def state_layout(marian: Mapping[str, Any]) -> dict[str, tuple[str | int, ...]]:
  """Every tensor of the state dict of the `MarianMTModel` that `marian` (config.json, passed
  by `import_refusals`) states: name -> its shape, each dimension the config key whose value
  it is (or a number). What may be absent: `TIED_EMBEDDINGS`, `OPTIONAL_TENSORS`."""
  layout: dict[str, tuple[str | int, ...]] = {}
  d = 'd_model'
  for stack, names in (('encoder', _ENCODER_LAYER), ('decoder', _DECODER_LAYER)):
    ffn = f'{stack}_ffn_dim'
    for i in range(marian[f'{stack}_layers']):
      prefix = f'model.{stack}.layers.{i}'
      for ours, theirs in names.items():
        projections = ('',) if ours.endswith('_norm') else (*_ATTENTION.values(), 'out_proj')
        for projection in projections:
          name = f'{prefix}.{theirs}.{projection}'.rstrip('.')
          layout[f'{name}.weight'] = (d,) if ours.endswith('_norm') else (d, d)
          layout[f'{name}.bias'] = (d,)
      layout.update(
        {
          f'{prefix}.fc1.weight': (ffn, d),
          f'{prefix}.fc1.bias': (ffn,),
          f'{prefix}.fc2.weight': (d, ffn),
          f'{prefix}.fc2.bias': (d,),
        }
      )
    layout[f'model.{stack}.embed_positions.weight'] = ('max_position_embeddings', d)
  shared = marian.get('share_encoder_decoder_embeddings', True)
  for name in TIED_EMBEDDINGS[0 if shared else 1 :]:
    layout[name] = ('vocab_size', d)
  layout['final_logits_bias'] = (1, 'vocab_size')  # Marian's [1, V].
  return layout


def _size(marian: Mapping[str, Any], dim: str | int) -> int:
  if isinstance(dim, int):
    return dim
  return marian.get(dim, MAX_POSITIONS) if dim == 'max_position_embeddings' else marian[dim]


def state_refusals(state: Mapping[str, np.ndarray], marian: Mapping[str, Any]) -> list[str]:
  """Why `state` is not the model that config.json `marian` states: one line per tensor (a
  shape, naming the config keys; NaN or inf values; positions other than Marian's), then the
  tensors missing and those no Marian model of that config has. [] if it is that model."""
  layout = state_layout(marian)
  shared = marian.get('share_encoder_decoder_embeddings', True)
  absent_ok = set(OPTIONAL_TENSORS) | (set(TIED_EMBEDDINGS) if shared else set())
  refusals = []
  for name, dims in layout.items():
    if name not in state:
      continue
    array = np.asarray(state[name])
    want = tuple(_size(marian, dim) for dim in dims)
    if array.shape != want:
      keys = ', '.join(
        f'{dim}={marian.get(dim, MAX_POSITIONS)}' for dim in dict.fromkeys(dims) if dim != 1
      )
      refusals.append(f'{name}: shape {array.shape}, where config.json {keys} make it {want}.')
    elif not np.all(np.isfinite(array)):
      bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
      refusals.append(f'{name}: {bad} of its {array.size} values are NaN or infinite.')
    elif name in OPTIONAL_TENSORS[:2] and not np.allclose(
      array, marian_positions(*want), rtol=0, atol=1e-5
    ):
      refusals.append(f"{name}: not Marian's sinusoids, which transformers and this project use.")
  tied = [name for name in TIED_EMBEDDINGS if name in state] if shared else []
  if shared and not tied:
    refusals.append(f'{TIED_EMBEDDINGS[0]} (or a tied copy of it) is not in the weights.')
  for name in tied[1:]:
    if np.shape(state[name]) == np.shape(state[tied[0]]) and not np.array_equal(
      state[name], state[tied[0]]
    ):
      refusals.append(
        f'{name} differs from {tied[0]}, which config.json '
        'share_encoder_decoder_embeddings=true ties it to.'
      )
  missing = [name for name in layout if name not in state and name not in absent_ok]
  if missing:
    refusals.append('Not in the weights: ' + _names(missing, marian))
  unexpected = sorted(name for name in state if name not in layout)
  if unexpected:
    refusals.append('In the weights, but no tensor of this config: ' + _names(unexpected, marian))
  return refusals


_LAYER_NAME = re.compile(r'(model\.(encoder|decoder)\.layers\.(\d+))\.')


def _names(names: list[str], marian: Mapping[str, Any], shown: int = 5) -> str:
  """`names`, a few; a layer's several as one `model.encoder.layers.N.*`, naming the depth's key."""
  groups: dict[str, list[str]] = {}
  for name in names:
    layer = _LAYER_NAME.match(name)
    key = f'{layer[2]}_layers' if layer else ''
    group = f'{layer[1]}.* (config.json {key}={marian.get(key)!r})' if layer else name
    groups.setdefault(group, []).append(name)
  listed = [
    f'{group} [{len(members)} tensors]' if len(members) > 1 else members[0]
    for group, members in groups.items()
  ]
  more = f' and {len(listed) - shown} more' if len(listed) > shown else ''
  return ', '.join(listed[:shown]) + more + '.'


def model_fields(marian: Mapping[str, Any], *, vocab_size: int, logits_bias: bool) -> dict:
  """`config.model` fields (and `vocab_size`) of the imported model."""
  return {
    'vocab_size': vocab_size,
    'model': {
      'architecture': 'encoder_decoder',
      'num_layers': marian['encoder_layers'],
      'd_model': marian['d_model'],
      'num_heads': marian['encoder_attention_heads'],
      'num_kv_heads': marian['encoder_attention_heads'],  # Multi-head: a key/value head each.
      'd_ff': marian['encoder_ffn_dim'],
      'dropout_rate': float(marian.get('dropout', 0.1)),
      'attention_dropout_rate': float(marian.get('attention_dropout', 0.0)),
      'ffn_dropout_rate': float(marian.get('activation_dropout', 0.0)),
      'norm': 'post_ln',
      'position': 'sinusoidal',
      'ffn_activation': FROM_MARIAN_ACTIVATION[marian.get('activation_function', 'gelu')],
      'use_bias': True,
      'norm_epsilon': MARIAN_NORM_EPSILON,
      'logits_bias': logits_bias,
      'share_embeddings': bool(marian.get('share_encoder_decoder_embeddings', True)),
      'max_len': marian.get('max_position_embeddings', MAX_POSITIONS),
    },
  }


def from_marian(
  state: Mapping[str, np.ndarray], cfg: ModelConfig, order: np.ndarray
) -> dict[str, Any]:
  """This project's params (numpy float32) of Marian's state dict; `order` from `vocabulary_order`.

  `cfg` is the imported model's config (`model_fields`); the inverse of `to_marian`.
  """
  perm = hidden_permutation(cfg.d_model)
  d, heads = cfg.d_model, cfg.num_heads

  def get(name):
    if name not in state:
      raise KeyError(f'The weights have no {name!r}.')
    return np.asarray(state[name], np.float32)

  def hidden(array, axis):
    return np.ascontiguousarray(np.take(array, perm, axis=axis))

  def attention(prefix):
    tree = {}
    for ours, theirs in _ATTENTION.items():
      kernel = hidden(get(f'{prefix}.{theirs}.weight').T, 0)  # [D, H*K]
      tree[ours] = {
        'kernel': kernel.reshape(d, heads, d // heads),
        'bias': get(f'{prefix}.{theirs}.bias').reshape(heads, d // heads),
      }
    out = hidden(get(f'{prefix}.out_proj.weight').T, 1)  # [H*K, D]
    tree['out'] = {
      'kernel': out.reshape(heads, d // heads, d),
      'bias': hidden(get(f'{prefix}.out_proj.bias'), 0),
    }
    return tree

  def layer(prefix, names):
    tree = {}
    for ours, theirs in names.items():
      if ours.endswith('_norm'):
        tree[ours] = {
          'scale': hidden(get(f'{prefix}.{theirs}.weight'), 0),
          'bias': hidden(get(f'{prefix}.{theirs}.bias'), 0),
        }
      else:
        tree[ours] = attention(f'{prefix}.{theirs}')
    tree['ffn'] = {
      'wi': {'kernel': hidden(get(f'{prefix}.fc1.weight').T, 0), 'bias': get(f'{prefix}.fc1.bias')},
      'wo': {
        'kernel': hidden(get(f'{prefix}.fc2.weight').T, 1),
        'bias': hidden(get(f'{prefix}.fc2.bias'), 0),
      },
    }
    return tree

  def rows(array):
    return np.ascontiguousarray(hidden(array, 1)[order])

  params: dict[str, Any] = {
    'encoder': {
      f'layer_{i}': layer(f'model.encoder.layers.{i}', _ENCODER_LAYER)
      for i in range(cfg.num_layers)
    },
    'decoder': {
      f'layer_{i}': layer(f'model.decoder.layers.{i}', _DECODER_LAYER)
      for i in range(cfg.num_layers)
    },
  }
  if cfg.share_embeddings:
    # Tied: saved under one of these names (transformers keeps one of a tied group).
    name = next((n for n in TIED_EMBEDDINGS if n in state), TIED_EMBEDDINGS[0])
    params['shared_embedding'] = {'embedding': rows(get(name))}
  else:
    params['src_embedding'] = {'embedding': rows(get('model.encoder.embed_tokens.weight'))}
    params['tgt_embedding'] = {'embedding': rows(get('model.decoder.embed_tokens.weight'))}
    params['decoder']['logits'] = {'kernel': np.ascontiguousarray(rows(get('lm_head.weight')).T)}
  if cfg.logits_bias:
    params['decoder']['logits_bias'] = get('final_logits_bias').reshape(-1)[order]
  return params


def nonzero_logits_bias(state: Mapping[str, np.ndarray]) -> bool:
  """Whether Marian's `final_logits_bias` is anything but zeros (then `logits_bias=True`)."""
  bias = state.get('final_logits_bias')
  return bias is not None and bool(np.any(np.asarray(bias) != 0))
