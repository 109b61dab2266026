"""A Hugging Face Marian directory is imported only if it is the model it states (issue 62).

Each damaged copy of test_interop's random OPUS-MT-like model is refused by `load_hf` (what
convert.py --from_hf and train.py's config.init_from=hf:DIR read) with one message naming the
file and the tensor or key, before anything is written: a config.json that disagrees with the
weights, NaN or inf weights, a damaged file of any kind, a bucket URL. An export's
generation_config.json lets `generate(max_new_tokens=...)` run without a warning.
"""

import json
import logging
import re
import shutil
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_interop import _command, opus_like

from configs import tiny
from transformer import training
from transformer.config import ModelConfig
from transformer.errors import InvalidInput
from transformer.interop import hf_files, marian, workdirs

torch = pytest.importorskip('torch', reason='pip install -r requirements/interop.txt')
transformers = pytest.importorskip('transformers', reason='pip install -r requirements/interop.txt')
__all__ = ['opus_like']  # test_interop's fixture: a random OPUS-MT-like Marian directory.

WEIGHTS = hf_files.WEIGHTS
D_MODEL, FFN = 32, 64  # opus_like's.


def _copy(opus_like, tmp_path, name='copy'):
  directory, _ = opus_like
  copy = tmp_path / name
  shutil.copytree(directory, copy)
  return copy


def _edit_config(directory, **changes):
  """Sets (or, with None, deletes) config.json keys."""
  path = directory / 'config.json'
  config = json.loads(path.read_text())
  for key, value in changes.items():
    if value is None:
      del config[key]
    else:
      config[key] = value
  path.write_text(json.dumps(config))
  return config


def _edit_weights(directory, change):
  """Rewrites model.safetensors with `change(state)` applied."""
  state = load_file(directory / WEIGHTS)
  change(state)
  save_file(state, directory / WEIGHTS, metadata={'format': 'pt'})


def _size(directory):
  return json.loads((directory / 'config.json').read_text())['vocab_size']


def _refusal(directory):
  with pytest.raises(InvalidInput) as raised:
    workdirs.load_hf(str(directory))
  return str(raised.value)


# --- Item 4: config.json disagrees with the weights: the tensor, its shape and the key ----------


@pytest.mark.parametrize(
  'changes,expected',
  [
    (
      dict(encoder_ffn_dim=128, decoder_ffn_dim=128),
      'model.encoder.layers.0.fc1.weight: shape (64, 32), where config.json '
      'encoder_ffn_dim=128, d_model=32 make it (128, 32).',
    ),
    (
      dict(encoder_layers=1, decoder_layers=1),
      'In the weights, but no tensor of this config: model.decoder.layers.1.* (config.json '
      'decoder_layers=1) [26 tensors], model.encoder.layers.1.* (config.json encoder_layers=1) '
      '[16 tensors].',
    ),
    (
      dict(encoder_layers=3, decoder_layers=3),
      'Not in the weights: model.encoder.layers.2.* (config.json encoder_layers=3) [16 tensors], '
      'model.decoder.layers.2.* (config.json decoder_layers=3) [26 tensors].',
    ),
    (
      dict(d_model=64),  # Wider than the weights: today an IndexError.
      'model.encoder.layers.0.self_attn.q_proj.weight: shape (32, 32), where config.json '
      'd_model=64 make it (64, 64).',
    ),
  ],
  ids=['ffn_dim', 'fewer_layers', 'more_layers', 'd_model'],
)
def test_a_config_that_disagrees_with_the_weights_is_refused_naming_tensor_and_key(
  opus_like,
  tmp_path,
  changes,
  expected,
):
  copy = _copy(opus_like, tmp_path)
  _edit_config(copy, **changes)
  message = _refusal(copy)
  assert message.startswith(
    f'{copy / WEIGHTS} does not hold the model that {copy}/config.json states'
  ), message
  assert f'  {expected}' in message.splitlines(), message


def test_a_vocab_size_below_the_embedding_rows_is_refused_not_cut(opus_like, tmp_path):
  copy = _copy(opus_like, tmp_path)
  size = _size(copy)
  _edit_config(copy, vocab_size=size - 12, decoder_vocab_size=size - 12)
  message = _refusal(copy)
  assert (
    f'  model.shared.weight: shape ({size}, {D_MODEL}), where config.json '
    f'vocab_size={size - 12}, d_model={D_MODEL} make it ({size - 12}, {D_MODEL}).'
  ) in message.splitlines()
  assert (
    f'  final_logits_bias: shape (1, {size}), where config.json vocab_size={size - 12} make it '
    f'(1, {size - 12}).'
  ) in message.splitlines()


@pytest.mark.parametrize(
  'change,expected',
  [
    (
      lambda s: s.update({'model.encoder.adapter.weight': np.zeros(3, np.float32)}),
      'In the weights, but no tensor of this config: model.encoder.adapter.weight.',
    ),
    (
      lambda s: s.update(
        {f'model.encoder.layers.0.extra_{i}': np.zeros(1, np.float32) for i in range(7)}
      ),
      '[7 tensors].',  # One layer's unknown names as one entry.
    ),
    (
      lambda s: s.pop('model.decoder.layers.1.encoder_attn.k_proj.bias'),
      'Not in the weights: model.decoder.layers.1.encoder_attn.k_proj.bias.',
    ),
    (
      lambda s: s.pop('model.shared.weight'),
      'model.shared.weight (or a tied copy of it) is not in the weights.',
    ),
    (
      lambda s: s.update({'lm_head.weight': s['model.shared.weight'] + 1}),
      'lm_head.weight differs from model.shared.weight, which config.json '
      'share_encoder_decoder_embeddings=true ties it to.',
    ),
    (
      lambda s: s.update(
        {'model.encoder.embed_positions.weight': np.ones((128, D_MODEL), np.float32)}
      ),
      "model.encoder.embed_positions.weight: not Marian's sinusoids, which transformers and "
      'this project use.',
    ),
    (
      lambda s: s.update({'model.decoder.embed_positions.weight': np.ones((64, D_MODEL))}),
      'model.decoder.embed_positions.weight: shape (64, 32), where config.json '
      'max_position_embeddings=128, d_model=32 make it (128, 32).',
    ),
  ],
  ids=[
    'unknown_tensor',
    'unknown_in_a_layer',
    'missing_tensor',
    'no_embedding',
    'tied_copy_differs',
    'positions_not_sinusoids',
    'positions_shape',
  ],
)
def test_weights_missing_unknown_or_unlike_marians_are_refused_by_name(
  opus_like,
  tmp_path,
  change,
  expected,
):
  copy = _copy(opus_like, tmp_path)
  _edit_weights(copy, change)
  message = _refusal(copy)
  assert message.startswith(f'{copy / WEIGHTS} does not hold the model'), message
  assert expected in message, message


# --- Item 5: NaN or inf ------------------------------------------------------------------------


@pytest.mark.parametrize(
  'name,value,count',
  [
    ('model.decoder.layers.1.fc2.weight', np.nan, D_MODEL * FFN),
    ('final_logits_bias', np.inf, None),
    ('model.shared.weight', -np.inf, None),
  ],
  ids=['nan', 'inf_bias', 'negative_inf_embedding'],
)
def test_a_nan_or_inf_weight_is_refused_naming_the_tensor(opus_like, tmp_path, name, value, count):
  copy = _copy(opus_like, tmp_path)

  def poison(state):
    array = state[name].copy()
    array.reshape(-1)[[0, 5]] = value
    state[name] = array

  _edit_weights(copy, poison)
  message = _refusal(copy)
  size = count or np.size(load_file(copy / WEIGHTS)[name])
  assert f'  {name}: 2 of its {size} values are NaN or infinite.' in message.splitlines()


# --- Item 10: a damaged config.json, named with its key ----------------------------------------


@pytest.mark.parametrize(
  'changes,expected',
  [
    (dict(vocab_size=None), 'config.json has no vocab_size: it states every size'),
    (dict(encoder_layers=None), 'config.json has no encoder_layers: it states every size'),
    (dict(encoder_layers='2'), "config.json encoder_layers='2': must be a positive integer."),
    (
      dict(encoder_attention_heads=-4, decoder_attention_heads=-4),
      'config.json encoder_attention_heads=-4: must be a positive integer.',
    ),
    (dict(d_model=32.0), 'config.json d_model=32.0: must be a positive integer.'),
    (
      dict(encoder_ffn_dim=0, decoder_ffn_dim=0),
      'config.json decoder_ffn_dim=0: must be a positive integer.',
    ),
    (dict(vocab_size=-1), 'config.json vocab_size=-1: must be a positive integer.'),
    (
      dict(max_position_embeddings=True),
      'config.json max_position_embeddings=True: must be a positive integer.',
    ),
    (dict(dropout='high'), "config.json dropout='high': must be a rate in [0, 1)."),
    (dict(pad_token_id=-1), 'config.json pad_token_id=-1: must be a token id'),
    (dict(activation_function=['relu']), "config.json activation_function=['relu']: not one"),
    (
      dict(share_encoder_decoder_embeddings='no'),
      "config.json share_encoder_decoder_embeddings='no': must be true or false.",
    ),
  ],
  ids=[
    'no_vocab_size',
    'no_encoder_layers',
    'layers_str',
    'heads_negative',
    'd_model_float',
    'ffn_zero',
    'vocab_negative',
    'positions_bool',
    'dropout_str',
    'pad_negative',
    'activation_list',
    'share_str',
  ],
)
def test_a_config_value_that_is_no_size_is_refused_by_key(opus_like, tmp_path, changes, expected):
  copy = _copy(opus_like, tmp_path)
  _edit_config(copy, **changes)
  message = _refusal(copy)
  assert message.startswith(f'{copy}/config.json has no exact form here:'), message
  assert expected in message, message


def test_a_config_json_that_is_a_list_is_refused_naming_it(opus_like, tmp_path):
  copy = _copy(opus_like, tmp_path)
  (copy / 'config.json').write_text('[1, 2]')
  assert _refusal(copy) == (
    f'{copy}/config.json holds a JSON list, not an object {{key: value}}. Download it again.'
  )


@pytest.mark.parametrize(
  'changes,expected',
  [
    (dict(pad_token_id=0), 'must be distinct'),  # pad = eos (0).
    (dict(eos_token_id=10**6), 'lie outside the vocabulary'),
  ],
  ids=['pad_is_eos', 'eos_outside'],
)
def test_special_ids_that_cannot_be_this_projects_are_refused_naming_config_json(
  opus_like,
  tmp_path,
  changes,
  expected,
):
  copy = _copy(opus_like, tmp_path)
  config = _edit_config(copy, **changes)
  message = _refusal(copy)
  assert message.startswith(
    f'{copy}/config.json pad_token_id={config["pad_token_id"]}, '
    f'eos_token_id={config["eos_token_id"]}, '
    f'decoder_start_token_id={config["decoder_start_token_id"]} '
    "(vocab.json's <unk>: 1): "
  ), message
  assert expected in message


# --- Item 10: damaged files, each named --------------------------------------------------------


def _cut(path):
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def _drop_safetensors(directory):
  (directory / WEIGHTS).unlink()


def _shard(directory, *, index=None, keep_shards=True):
  """model.safetensors as two shards and their index (`index`: the index's text instead)."""
  state = load_file(directory / WEIGHTS)
  (directory / WEIGHTS).unlink()
  names = sorted(state)
  shards = {
    'model-00001-of-00002.safetensors': names[::2],
    'model-00002-of-00002.safetensors': names[1::2],
  }
  for shard, held in shards.items():
    if keep_shards or shard.startswith('model-00001'):
      save_file({n: state[n] for n in held}, directory / shard, metadata={'format': 'pt'})
  weight_map = {n: shard for shard, held in shards.items() for n in held}
  (directory / hf_files.SAFETENSORS_INDEX).write_text(
    json.dumps({'metadata': {}, 'weight_map': weight_map}) if index is None else index
  )


def _garbage_torch(directory):
  _drop_safetensors(directory)
  (directory / hf_files.TORCH_WEIGHTS).write_bytes(b'this is not a pickle' * 20)


@pytest.mark.parametrize(
  'damage,expected',
  [
    (
      lambda d: (d / 'generation_config.json').write_text('{"num_beams": 4,'),
      '{d}/generation_config.json is not JSON: ',
    ),
    (
      lambda d: (d / 'generation_config.json').write_text('"beam"'),
      '{d}/generation_config.json holds a JSON str, not an object',
    ),
    (
      lambda d: (d / 'tokenizer_config.json').write_text('[]'),
      '{d}/tokenizer_config.json holds a JSON list, not an object',
    ),
    (
      lambda d: (d / 'tokenizer_config.json').write_text('{"source_lang": 7}'),
      '{d}/tokenizer_config.json source_lang=7: name a language',
    ),
    (lambda d: _cut(d / WEIGHTS), '{d}/model.safetensors cannot be read as safetensors ('),
    (
      lambda d: _shard(d, keep_shards=False),
      '{d}/model.safetensors.index.json names the shard model-00002-of-00002.safetensors, which '
      'is not in {d}: download every shard it names.',
    ),
    (lambda d: _shard(d, index='{"weight_map": '), '{d}/model.safetensors.index.json is not JSON'),
    (
      lambda d: _shard(d, index='{"metadata": {}}'),
      '{d}/model.safetensors.index.json has no weight_map {{tensor: shard file beside it}}.',
    ),
    (
      lambda d: _shard(d, index='{"weight_map": {"a": "../elsewhere.safetensors"}}'),
      '{d}/model.safetensors.index.json has no weight_map',
    ),
    (
      lambda d: (d / 'target.spm').write_bytes(b'not a sentencepiece model'),
      '{d}/target.spm is not a SentencePiece model (DecodeError: ',
    ),
    (
      lambda d: (d / 'source.spm').write_bytes(b''),
      '{d}/source.spm is a SentencePiece model with no pieces.',
    ),
    (_garbage_torch, '{d}/pytorch_model.bin cannot be read by torch.load ('),
  ],
  ids=[
    'generation_not_json',
    'generation_str',
    'tokenizer_config_list',
    'source_lang_int',
    'safetensors_cut',
    'shard_missing',
    'index_not_json',
    'index_no_weight_map',
    'index_shard_outside',
    'target_spm_garbage',
    'source_spm_empty',
    'torch_garbage',
  ],
)
def test_a_damaged_file_is_refused_naming_it(opus_like, tmp_path, damage, expected):
  copy = _copy(opus_like, tmp_path)
  damage(copy)
  message = _refusal(copy)
  assert message.startswith(expected.format(d=copy)), message


def test_shards_and_a_full_pytorch_state_dict_import_the_same_parameters(opus_like, tmp_path):
  """The checks above refuse none of the layouts transformers writes: a sharded checkpoint, and
  torch.save of the whole state dict (positions, every tied copy), import as model.safetensors."""
  directory, model = opus_like
  want = workdirs.load_hf(str(directory)).params
  sharded = _copy(opus_like, tmp_path, 'sharded')
  _shard(sharded)
  full = _copy(opus_like, tmp_path, 'full')
  _drop_safetensors(full)
  state = model.state_dict()
  assert {'model.encoder.embed_positions.weight', 'lm_head.weight'} <= set(state)
  torch.save(state, full / hf_files.TORCH_WEIGHTS)
  for copy in (sharded, full):
    got = workdirs.load_hf(str(copy)).params
    flat = lambda tree: {k: np.asarray(v) for k, v in _flatten(tree)}
    assert flat(got).keys() == flat(want).keys()
    for key, value in flat(want).items():
      np.testing.assert_array_equal(flat(got)[key], value, err_msg=key)


def _flatten(tree, prefix=''):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, f'{prefix}{key}/')
    else:
      yield f'{prefix}{key}', value


def test_the_layout_is_every_tensor_of_transformers_marian(opus_like):
  """`marian.state_layout` names the state dict of transformers' model of that config."""
  directory, model = opus_like
  config = json.loads((directory / 'config.json').read_text())
  layout = marian.state_layout(config)
  state = model.state_dict()
  assert set(layout) == set(state)
  for name, dims in layout.items():
    assert tuple(state[name].shape) == tuple(config[d] if isinstance(d, str) else d for d in dims)
  assert marian.state_refusals({k: v.numpy() for k, v in state.items()}, config) == []


# --- Item 20: a bucket URL ---------------------------------------------------------------------


@pytest.mark.parametrize(
  'url,copy',
  [
    ('gs://bucket/opus-mt-en-de', 'gcloud storage cp -r gs://bucket/opus-mt-en-de DIR'),
    ('s3://bucket/opus-mt-en-de', 'aws s3 sync s3://bucket/opus-mt-en-de DIR'),
  ],
  ids=['gs', 's3'],
)
def test_a_bucket_url_is_refused_saying_to_copy_it_here_first(url, copy):
  with pytest.raises(InvalidInput) as raised:
    workdirs.load_hf(url)
  assert str(raised.value) == (
    f'--from_hf={url}: imports read a local directory. Copy the bucket folder to this host '
    f'first ({copy}), then name the copy: --from_hf=DIR.'
  )


# --- convert.py --from_hf: one line, no traceback, no workdir ----------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
  'damage,expected',
  [
    (lambda d: _cut(d / WEIGHTS), 'model.safetensors cannot be read as safetensors'),
    (
      lambda d: _edit_config(d, encoder_ffn_dim=128, decoder_ffn_dim=128),
      'model.safetensors does not hold the model that',
    ),
  ],
  ids=['safetensors_cut', 'ffn_dim'],
)
def test_convert_py_refuses_a_damaged_directory_in_one_line_and_writes_nothing(
  opus_like,
  tmp_path,
  damage,
  expected,
):
  copy = _copy(opus_like, tmp_path)
  damage(copy)
  new = tmp_path / 'new'
  done = _command('convert.py', f'--from_hf={copy}', f'--workdir={new}')
  assert done.returncode == 1, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr, done.stderr[-3000:]
  lines = done.stderr.rstrip('\n').splitlines()
  assert lines[-1].startswith('(set TRANSFORMER_TRACEBACK=1'), lines[-3:]
  error = next(line for line in reversed(lines[:-1]) if line.startswith('convert.py: error: '))
  assert error.startswith(f'convert.py: error: {copy}/') and expected in error, lines[-5:]
  assert not new.exists()


# --- Item 11: train.py's init_from=hf:DIR refuses before the workdir changes ---------------------


def test_init_from_a_damaged_hf_dir_is_refused_before_the_workdir_is_written(
  opus_like,
  tmp_path,
  synthetic_multi30k_dir,
):
  """train.py's whole set-up, in process (`training.train_and_evaluate`): the refusal comes from
  `load_hf`, before the run's config.json, vocabulary or checkpoints are written."""
  copy = _copy(opus_like, tmp_path)
  _edit_config(copy, encoder_ffn_dim=128, decoder_ffn_dim=128)
  config = tiny.get_config()
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(tmp_path / 'data')
  config.init_from = f'hf:{copy}'
  config.data.vocab_path = str(tmp_path / 'source.model')
  config.data.target_vocab_path = str(tmp_path / 'target.model')
  workdir = tmp_path / 'finetuned'
  with pytest.raises(InvalidInput) as raised:
    training.train_and_evaluate(config, str(workdir))
  message = str(raised.value)
  assert message.startswith(f'config.init_from=hf:{copy}: {copy / WEIGHTS} does not hold'), message
  assert 'encoder_ffn_dim=128, d_model=32 make it (128, 32).' in message
  assert not (workdir / 'config.json').exists()
  assert not (workdir / 'checkpoints').exists()
  assert not (tmp_path / 'source.model').exists() and not (tmp_path / 'target.model').exists()


# --- Item 16: the export's generation_config.json --------------------------------------------


class _Records(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def test_generate_on_an_export_gives_no_length_warning_and_stops_within_the_positions(
  opus_like,
  tmp_path,
):
  directory, _ = opus_like
  imported = workdirs.load_hf(str(directory))
  cfg = ModelConfig(vocab_size=imported.fields['vocab_size'], **imported.fields['model'])
  export = tmp_path / 'export'
  hf_files.write(
    str(export),
    imported.params,
    cfg,
    imported.vocabulary,
    target_vocabulary=imported.target_vocabulary,
    source_lang='en',
    target_lang='de',
    beam_size=4,
    alpha=0.6,
  )
  generation = json.loads((export / 'generation_config.json').read_text())
  assert 'max_length' not in generation
  model = transformers.MarianMTModel.from_pretrained(export).eval()
  inputs = torch.tensor([[5, 6, 7, 1]])
  records = _Records()
  hf_logger = logging.getLogger('transformers')
  hf_logger.addHandler(records)
  try:
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
      warnings.simplefilter('always')
      short = model.generate(input_ids=inputs, max_new_tokens=5, num_beams=1)
      # Pad, eos and bos banned: a random model writes until its limit, the positions'.
      unlimited = model.generate(
        input_ids=inputs, num_beams=1, bad_words_ids=[[0], [1], [2]], forced_eos_token_id=None
      )
  finally:
    hf_logger.removeHandler(records)
  said = records.messages + [str(w.message) for w in caught]
  assert not [m for m in said if re.search('max_length|max_new_tokens', m)], said
  assert short.shape[1] == 1 + 5
  assert unlimited.shape[1] == 1 + cfg.max_len  # The start token, then one per position.
  assert json.loads((export / 'tokenizer_config.json').read_text())['model_max_length'] == 128
