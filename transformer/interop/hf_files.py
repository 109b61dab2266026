"""A Hugging Face Marian directory: written from this project's arrays, read back into them.

What `MarianMTModel.from_pretrained(DIR)` and `MarianTokenizer.from_pretrained(DIR)` read:
`config.json`, `model.safetensors` (or `pytorch_model.bin`, read with torch where installed),
`generation_config.json`, `source.spm` and `target.spm` (SentencePiece models), `vocab.json`
(piece -> id, one vocabulary for both sides) and `tokenizer_config.json`. Writing needs
numpy and safetensors only.

Vocabularies. Export writes this project's one SentencePiece model as both `.spm` files and
its pieces, in id order, as `vocab.json`: MarianTokenizer then maps text to the ids this
project's tokenizer gives. Import rebuilds each `.spm` with the pieces of `vocab.json` in this
project's id order (`marian.vocabulary_order`): a piece of the other side's vocabulary is
kept, marked UNUSED (SentencePiece never segments into it, but decodes it), so the ids of
source and target are the joint vocabulary's, as in Marian. A piece of an `.spm` that
`vocab.json` lacks is dropped (MarianTokenizer maps it to `<unk>`; SentencePiece then
segments that text into other pieces), and counted in the import's log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import sentencepiece
from absl import logging
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from transformer import extras, storage, tokenizer
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.interop import marian

WEIGHTS = 'model.safetensors'
TORCH_WEIGHTS = 'pytorch_model.bin'
SAFETENSORS_INDEX = 'model.safetensors.index.json'
# GNMT's length penalty ((5 + L) / 6)^alpha (this project's beam search) against transformers'
# and CTranslate2's L^p: p = alpha * L0 / (5 + L0) has the same slope d log(penalty) / dL at a
# target of L0 tokens, where rankings between close lengths are decided.
TYPICAL_TARGET_LENGTH = 25
_SPECIAL_PIECES = ('<pad>', '</s>', '<s>', '<unk>')  # tokenizer.PAD_ID, EOS_ID, BOS_ID, UNK_ID.
_Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
_SHOWN = 12  # Lines of a refusal of the weights shown; the others are counted.


def length_penalty_exponent(alpha: float) -> float:
  """The exponent p of L^p whose slope matches GNMT's penalty with `alpha` at L0 tokens."""
  return alpha * TYPICAL_TARGET_LENGTH / (5 + TYPICAL_TARGET_LENGTH)


def write(
  directory: str,
  params: Mapping[str, Any],
  cfg: ModelConfig,
  vocabulary: bytes,
  *,
  target_vocabulary: bytes | None = None,
  source_lang: str,
  target_lang: str,
  beam_size: int,
  alpha: float,
  allow_norm_epsilon: bool = False,
) -> list[str]:
  """Writes the Hugging Face Marian directory of `params`; returns the files written.

  `vocabulary`: the run's serialized SentencePiece model (source.spm; target.spm too unless
  `target_vocabulary`, the target side's own, is given). Nothing is written if the model
  has no exact Marian form (`marian.export_refusals`, raised as one InvalidInput).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  refusals = marian.export_refusals(cfg, allow_norm_epsilon=allow_norm_epsilon)
  if refusals:
    raise InvalidInput(
      'This model has no exact Hugging Face Marian form:\n  ' + '\n  '.join(refusals)
    )
  vocab = tokenizer.Tokenizer(vocabulary)
  if vocab.vocab_size != cfg.vocab_size:
    raise InvalidInput(
      f'The vocabulary has {vocab.vocab_size} pieces, the model {cfg.vocab_size} rows.'
    )
  state = marian.to_marian(params, cfg)
  # One tensor per tied group, as transformers saves it; the others are tied on loading.
  if cfg.share_embeddings:
    for name in ('model.encoder.embed_tokens.weight', 'model.decoder.embed_tokens.weight'):
      del state[name]
    del state['lm_head.weight']
  config = marian.marian_config(
    cfg, pad_id=tokenizer.PAD_ID, eos_id=tokenizer.EOS_ID, bos_id=tokenizer.BOS_ID
  )
  generation = {
    'decoder_start_token_id': tokenizer.BOS_ID,
    'bos_token_id': tokenizer.BOS_ID,
    'eos_token_id': tokenizer.EOS_ID,
    'forced_eos_token_id': tokenizer.EOS_ID,
    'pad_token_id': tokenizer.PAD_ID,
    'num_beams': beam_size,
    'length_penalty': length_penalty_exponent(alpha),
    # Not max_length: transformers (5.x) warns on every generate(max_new_tokens=...) where the
    # model's generation_config sets it. This limit (the model's positions) gives way to a call's.
    'max_new_tokens': cfg.max_len,
    'bad_words_ids': [[tokenizer.PAD_ID], [tokenizer.BOS_ID]],  # Inputs only, as here.
  }
  pieces = {vocab.id_to_piece(i): i for i in range(vocab.vocab_size)}
  tokenizer_config = {
    'tokenizer_class': 'MarianTokenizer',
    'source_lang': source_lang,
    'target_lang': target_lang,
    'unk_token': '<unk>',
    'eos_token': '</s>',
    'pad_token': '<pad>',
    'model_max_length': cfg.max_len,
    'separate_vocabs': False,
  }
  os.makedirs(directory, exist_ok=True)
  files = {
    'config.json': _json(config),
    'generation_config.json': _json(generation),
    'vocab.json': _json(pieces),
    'tokenizer_config.json': _json(tokenizer_config),
    'special_tokens_map.json': _json(
      {'eos_token': '</s>', 'unk_token': '<unk>', 'pad_token': '<pad>'}
    ),
    'source.spm': vocabulary,
    'target.spm': target_vocabulary or vocabulary,
  }
  for name, content in files.items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(content)
  save_file(state, os.path.join(directory, WEIGHTS), metadata={'format': 'pt'})
  return sorted([*files, WEIGHTS])


def _json(value: Any) -> bytes:
  return (json.dumps(value, indent=2, ensure_ascii=False) + '\n').encode('utf-8')


def read_config(directory: str) -> dict[str, Any]:
  """DIR/config.json, refused (naming each key) unless it is a Marian model held exactly."""
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise InvalidInput(f'{directory}: no config.json there (a Hugging Face model directory).')
  config = read_json_object(path)
  refusals = marian.import_refusals(config)
  if refusals:
    raise InvalidInput(f'{path} has no exact form here:\n  ' + '\n  '.join(refusals))
  return config


def read_json_object(path: str) -> dict[str, Any]:
  """The JSON object in `path`, refused naming the file if it holds anything else."""
  try:
    loaded = json.loads(storage.read_text(path))
  except ValueError as e:  # UnicodeDecodeError too.
    raise InvalidInput(f'{path} is not JSON: {e}. Download it again.') from None
  if not isinstance(loaded, dict):
    raise InvalidInput(
      f'{path} holds a JSON {type(loaded).__name__}, not an object {{key: value}}. '
      'Download it again.'
    )
  return loaded


def weights_path(directory: str) -> str:
  """The file `read_weights` reads: model.safetensors, its shards' index or pytorch_model.bin."""
  for name in (WEIGHTS, SAFETENSORS_INDEX, TORCH_WEIGHTS):
    if os.path.isfile(path := os.path.join(directory, name)):
      return path
  raise InvalidInput(
    f'{directory}: no weights there ({WEIGHTS}, {SAFETENSORS_INDEX} or {TORCH_WEIGHTS}).'
  )


def read_weights(directory: str) -> dict[str, np.ndarray]:
  """The state dict of DIR: model.safetensors (or its shards), else pytorch_model.bin.

  A file that cannot be read (cut short, a shard missing) is refused, naming it.
  """
  path = weights_path(directory)
  if path.endswith(WEIGHTS):
    return _safetensors(path)
  if path.endswith(SAFETENSORS_INDEX):
    return _shards(path)
  return _torch_weights(path)


def read_checked_weights(directory: str, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """`read_weights`, refused unless they are the model config.json (`config`) states: every
  tensor's shape, values finite, none missing, none unknown (`marian.state_refusals`)."""
  state = read_weights(directory)
  refusals = marian.state_refusals(state, config)
  if refusals:
    shown = refusals[:_SHOWN] + (
      [f'... and {len(refusals) - _SHOWN} more'] if refusals[_SHOWN:] else []
    )
    raise InvalidInput(
      f'{weights_path(directory)} does not hold the model that {directory}/config.json '
      'states; fix or download again whichever is wrong:\n  ' + '\n  '.join(shown)
    )
  return state


def _safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

  try:
    return load_file(path)
  except (SafetensorError, OSError, ValueError, TypeError) as e:
    raise InvalidInput(
      f'{path} cannot be read as safetensors ({e}): it may be cut short. Download it again.'
    ) from None


def _shards(index_path: str) -> dict[str, np.ndarray]:
  """The tensors of the shards that `index_path` (model.safetensors.index.json) names."""
  weight_map = read_json_object(index_path).get('weight_map')
  if not isinstance(weight_map, dict) or not all(
    isinstance(v, str) and v and os.path.basename(v) == v for v in weight_map.values()
  ):
    raise InvalidInput(
      f'{index_path} has no weight_map {{tensor: shard file beside it}}. Download it again.'
    )
  state = {}
  directory = os.path.dirname(index_path)
  for shard in sorted(set(weight_map.values())):
    if not os.path.isfile(path := os.path.join(directory, shard)):
      raise InvalidInput(
        f'{index_path} names the shard {shard}, which is not in {directory}: download every '
        'shard it names.'
      )
    state.update(_safetensors(path))
  if missing := sorted(set(weight_map) - set(state)):
    raise InvalidInput(
      f'{index_path} names {len(missing)} tensors that its shards do not hold '
      f'({", ".join(missing[:3])}, ...). Download the shards again.'
    )
  return state


def _torch_weights(path: str) -> dict[str, np.ndarray]:
  try:
    torch = extras.require('torch', 'interop', f'{path}: reading PyTorch weights')
  except InvalidInput as e:
    raise InvalidInput(f'{e} Or convert the directory to safetensors first.') from None
  try:
    loaded = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except; a damaged pickle raises any of many.
    raise InvalidInput(
      f'{path} cannot be read by torch.load ({type(e).__name__}: {e}). Download it again.'
    ) from None
  if not isinstance(loaded, Mapping) or not all(
    isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
  ):
    raise InvalidInput(f'{path} holds no state dict {{name: tensor}}. Download it again.')
  return {name: value.float().numpy() for name, value in loaded.items()}


def read_vocabularies(directory: str) -> tuple[dict[str, int], bytes, bytes]:
  """(vocab.json, source.spm, target.spm) of DIR; every one must be there, the .spm files
  SentencePiece models."""
  found = {}
  for name in ('vocab.json', 'source.spm', 'target.spm'):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      raise InvalidInput(
        f'{directory}: no {name} there; a Marian model directory holds vocab.json, '
        'source.spm and target.spm (MarianTokenizer).'
      )
    found[name] = storage.read_bytes(path)
  try:
    vocab = json.loads(found['vocab.json'])
  except ValueError as e:
    raise InvalidInput(f'{directory}/vocab.json is not JSON: {e}') from None
  if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
    raise InvalidInput(f'{directory}/vocab.json is not an object {{piece: id}}.')
  for name in ('source.spm', 'target.spm'):
    _check_sentencepiece(os.path.join(directory, name), found[name])
  return vocab, found['source.spm'], found['target.spm']


def read_tokenizer(
  directory: str, marian_config: Mapping[str, Any]
) -> tuple[np.ndarray, bytes, bytes]:
  """(`marian.vocabulary_order`, source and target SentencePiece models in this project's
  id order) of DIR's vocab.json, source.spm and target.spm."""
  vocab, source_spm, target_spm = read_vocabularies(directory)
  if '<unk>' not in vocab:
    raise InvalidInput(f'{directory}/vocab.json has no <unk> piece.')
  size = marian_config['vocab_size']
  if len(vocab) != size or sorted(vocab.values()) != list(range(size)):
    raise InvalidInput(
      f'{directory}/vocab.json holds {len(vocab)} pieces for ids other than 0..{size - 1} '
      f'(config.json vocab_size={size}).'
    )
  ids = [marian_config[key] for key in ('pad_token_id', 'eos_token_id', 'decoder_start_token_id')]
  try:
    order = marian.vocabulary_order(*ids, vocab['<unk>'], size)
  except ValueError as e:
    raise InvalidInput(
      f'{directory}/config.json pad_token_id={ids[0]}, eos_token_id={ids[1]}, '
      f"decoder_start_token_id={ids[2]} (vocab.json's <unk>: {vocab['<unk>']}): {e}"
    ) from None
  source, source_dropped = rebuild_vocabulary(source_spm, vocab, order)
  target, target_dropped = rebuild_vocabulary(target_spm, vocab, order)
  for name, dropped in (('source.spm', source_dropped), ('target.spm', target_dropped)):
    if dropped:
      logging.warning(
        '%d pieces of %s/%s are not in vocab.json: MarianTokenizer maps them to <unk>; '
        'here text is segmented around them.',
        dropped,
        directory,
        name,
      )
  return order, source, target


def _check_sentencepiece(path: str, model: bytes) -> None:
  """Refuses `model` (the bytes of `path`) unless SentencePiece loads it and it has pieces."""
  try:
    pieces = len(sentencepiece_model_pb2.ModelProto.FromString(model).pieces)
    sentencepiece.SentencePieceProcessor(model_proto=model)
  except (DecodeError, RuntimeError, OSError) as e:
    raise InvalidInput(
      f'{path} is not a SentencePiece model ({type(e).__name__}: {e}). Download it again.'
    ) from None
  if not pieces:
    raise InvalidInput(f'{path} is a SentencePiece model with no pieces. Download it again.')


def rebuild_vocabulary(
  spm_model: bytes, vocab: Mapping[str, int], order: np.ndarray
) -> tuple[bytes, int]:
  """`spm_model` with the pieces of `vocab` in this project's id order (`order`).

  Returns the serialized model and how many of its pieces `vocab` lacks (dropped). Our
  ids 0-3 are pad, eos, bos, unk; a piece of `vocab` that `spm_model` lacks is UNUSED
  (never produced by segmentation, still decoded); scores and types of the others are kept.
  """
  proto = sentencepiece_model_pb2.ModelProto.FromString(spm_model)
  original = [(p.piece, p.score, p.type) for p in proto.pieces]
  by_id = {marian_id: piece for piece, marian_id in vocab.items()}
  old = {p.piece: p for p in proto.pieces}
  kept = 0
  del proto.pieces[:]
  for our_id, marian_id in enumerate(order.tolist()):
    if our_id < len(_SPECIAL_PIECES):
      kind = _Piece.UNKNOWN if our_id == tokenizer.UNK_ID else _Piece.CONTROL
      proto.pieces.add(piece=_SPECIAL_PIECES[our_id], score=0.0, type=kind)
      continue
    name = by_id.get(marian_id)
    if name is None:
      raise InvalidInput(f'vocab.json names no piece for id {marian_id}.')
    if name in old and old[name].type in (_Piece.NORMAL, _Piece.USER_DEFINED, _Piece.BYTE):
      kept += 1
      proto.pieces.add(piece=name, score=old[name].score, type=old[name].type)
    else:
      proto.pieces.add(piece=name, score=0.0, type=_Piece.UNUSED)
  spec = proto.trainer_spec
  spec.vocab_size = len(order)
  spec.pad_id, spec.eos_id, spec.bos_id, spec.unk_id = (
    tokenizer.PAD_ID,
    tokenizer.EOS_ID,
    tokenizer.BOS_ID,
    tokenizer.UNK_ID,
  )
  spec.pad_piece, spec.eos_piece, spec.bos_piece, spec.unk_piece = _SPECIAL_PIECES
  segmenting = sum(
    1 for p in old.values() if p.type in (_Piece.NORMAL, _Piece.USER_DEFINED, _Piece.BYTE)
  )
  if [(p.piece, p.score, p.type) for p in proto.pieces] == original:
    return spm_model, 0  # Already in this project's order (an export of this project's): as is.
  return proto.SerializeToString(), segmenting - kept
