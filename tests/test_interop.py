"""Models in and out, checked against the independent implementations.

transformers' `MarianMTModel` and `MarianTokenizer` and CTranslate2's `Translator` run the
other side of every check: a random-weight Marian model (OPUS-MT's special ids, a logits
bias, a SentencePiece model trained here) imported; a tiny run trained here exported to both
formats; export then import bit for bit; every refusal naming its field.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_finetune import STILL  # 2 steps that move no parameter measurably.

from configs import tiny
from tests.conftest import synthetic_captions
from transformer import evaluation, inference, initialization, provenance, tokenizer, training
from transformer.config import ModelConfig
from transformer.errors import InvalidInput, MissingInput
from transformer.interop import ctranslate2_model, hf_files, marian, workdirs
from transformer.model import Transformer
from transformer.tasks.translation import data, decode
from transformer.tools import sweeps

torch = pytest.importorskip('torch', reason='pip install -r requirements/interop.txt')
transformers = pytest.importorskip('transformers', reason='pip install -r requirements/interop.txt')
ctranslate2 = pytest.importorskip('ctranslate2', reason='pip install -r requirements/interop.txt')

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
MAX_EXTRA_LEN = 12
SENTENCES = [en for en, _ in synthetic_captions(30, seed=77)]


def _translate(params, cfg, vocab: tokenizer.Tokenizer, lines, decoder, beam_size=4):
  """This project's decoder (alpha 0: no length penalty) on `lines`, as token-id lists."""
  rows = [vocab.encode(line) + [tokenizer.EOS_ID] for line in lines]
  src = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    src[i, : len(row)] = row
  options = inference.DecodeOptions(
    decoder=decoder, beam_size=beam_size, alpha=0.0, max_extra_len=MAX_EXTRA_LEN
  )
  tokens = decode.translate(
    params, jnp.asarray(src), jax.random.key(0), model_config=cfg, options=options
  ).tokens
  out = []  # (ids, whether it ended with EOS before the limit).
  for src_row, row in zip(rows, np.asarray(tokens).tolist(), strict=True):
    ended = tokenizer.EOS_ID in row[: len(src_row) + MAX_EXTRA_LEN - 1]
    row = row[: row.index(tokenizer.EOS_ID)] if tokenizer.EOS_ID in row else row
    out.append(([t for t in row if t != tokenizer.PAD_ID], ended))
  return rows, out


def _hf_generate(model, rows, *, num_beams, bad_words, to_marian=lambda ids: ids):
  """transformers' generate() per sentence (its length limit is per call), as id lists."""
  outputs = []  # (ids, whether it ended with EOS).
  for row in rows:
    ids = torch.tensor([to_marian(row)])
    generated = model.generate(
      input_ids=ids,
      attention_mask=torch.ones_like(ids),
      num_beams=num_beams,
      do_sample=False,
      length_penalty=0.0,
      early_stopping=False,
      max_new_tokens=len(row) + MAX_EXTRA_LEN,
      bad_words_ids=bad_words,
    )[0].tolist()[1:]  # Without the decoder's start token.
    eos = model.config.eos_token_id
    # Not the EOS forced at the length limit (its last position).
    ended = eos in generated[: len(row) + MAX_EXTRA_LEN - 1]
    generated = generated[: generated.index(eos)] if eos in generated else generated
    outputs.append(([t for t in generated if t != model.config.pad_token_id], ended))
  return outputs


def _assert_same_translations(ours, theirs, *, at_least):
  """Equal where both ended with EOS; the engines' length limits differ by design (transformers
  forces EOS at its limit), so a row cut by a limit is compared on their common prefix."""
  ended = 0
  for (our_ids, our_end), (their_ids, their_end) in zip(ours, theirs, strict=True):
    if our_end and their_end:
      ended += 1
      assert our_ids == their_ids
    else:
      n = min(len(our_ids), len(their_ids)) - 1
      assert our_ids[:n] == their_ids[:n]
  assert ended >= at_least, ended


# --- A random-weight Marian model in OPUS-MT's layout, imported ---------------------------------


@pytest.fixture(scope='module')
def opus_like(tmp_path_factory):
  """A random MarianMTModel with OPUS-MT's conventions, saved with MarianTokenizer's files.

  eos 0, unk 1, the pieces, pad last and the decoder's start token; swish; a nonzero
  final_logits_bias; LayerNorms off their initial values. A SentencePiece model per side,
  trained here on made-up captions (source.spm on the English side, target.spm on the German),
  over one joint vocab.json, as OPUS-MT's.
  """
  directory = tmp_path_factory.mktemp('opus_like')
  pairs = synthetic_captions(400, seed=5)
  source_vocab = tokenizer.train_tokenizer([en for en, _ in pairs], 120)
  target_vocab = tokenizer.train_tokenizer([de for _, de in pairs], 120)
  pieces = list(
    dict.fromkeys(v.id_to_piece(i) for v in (source_vocab, target_vocab) for i in range(4, 120))
  )
  marian_vocab = {'</s>': 0, '<unk>': 1, **{p: i + 2 for i, p in enumerate(pieces)}}
  marian_vocab['<pad>'] = len(marian_vocab)
  size = len(marian_vocab)
  config = transformers.MarianConfig(
    vocab_size=size,
    decoder_vocab_size=size,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    activation_function='swish',
    scale_embedding=True,
    pad_token_id=size - 1,
    decoder_start_token_id=size - 1,
    eos_token_id=0,
    forced_eos_token_id=0,
  )
  torch.manual_seed(0)
  model = transformers.MarianMTModel(config).eval()
  with torch.no_grad():
    model.final_logits_bias.normal_(0.0, 0.5)
    for name, param in model.named_parameters():
      if 'layer_norm' in name:
        param.normal_(1.0 if name.endswith('weight') else 0.0, 0.2)
      elif 'embed_tokens' in name or 'shared' in name:
        param.normal_(0.0, 0.5)
  model.save_pretrained(directory)
  (directory / 'vocab.json').write_text(json.dumps(marian_vocab))
  (directory / 'source.spm').write_bytes(source_vocab.serialized_model())
  (directory / 'target.spm').write_bytes(target_vocab.serialized_model())
  (directory / 'tokenizer_config.json').write_text(json.dumps({'source_lang': 'en'}))
  return directory, model


def test_an_opus_like_model_imports_with_transformers_logits(opus_like):
  directory, model = opus_like
  imported = workdirs.load_hf(str(directory))
  cfg = ModelConfig(
    vocab_size=imported.fields['vocab_size'], deterministic=True, **imported.fields['model']
  )
  assert (cfg.ffn_activation, cfg.norm_epsilon, cfg.logits_bias) == ('swish', 1e-5, True)
  assert cfg.vocab_size == model.config.vocab_size + 1  # bos: a copy of pad, the start token.
  ours = tokenizer.Tokenizer(imported.vocabulary, imported.target_vocabulary)
  assert imported.target_vocabulary is not None  # One model per side, as OPUS-MT's.
  hf_tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
  lines = SENTENCES[:6]
  batch = hf_tokenizer(lines, return_tensors='pt', padding=True)
  size = model.config.vocab_size
  order = marian.vocabulary_order(size - 1, 0, size - 1, 1, size)
  to_ours = {int(m): i for i, m in reversed(list(enumerate(order)))}
  src = np.vectorize(to_ours.get)(batch['input_ids'].numpy())
  src[batch['attention_mask'].numpy() == 0] = 0
  for line, row in zip(lines, src, strict=True):  # Same pieces, in this project's ids.
    assert [t for t in row.tolist() if t] == ours.encode(line) + [tokenizer.EOS_ID]
  # Targets are segmented by target.spm, there and here, and decoded to the same text.
  targets = [de for _, de in synthetic_captions(12, seed=9)]
  for text, marian_ids in zip(targets, hf_tokenizer(text_target=targets)['input_ids'], strict=True):
    our_ids = [to_ours[m] for m in marian_ids]
    assert our_ids == ours.target.encode(text) + [tokenizer.EOS_ID]
    assert ours.decode(our_ids) == hf_tokenizer.decode(marian_ids, skip_special_tokens=True)
  assert ours.target.encode(targets[0]) != ours.encode(targets[0])  # Two segmentations.
  tgt = np.random.default_rng(0).integers(2, size - 1, size=(len(lines), 7))
  tgt[:, 0] = size - 1
  with torch.no_grad():
    theirs = model(
      input_ids=batch['input_ids'],
      attention_mask=batch['attention_mask'],
      decoder_input_ids=torch.tensor(tgt),
    ).logits.numpy()
  our_tgt = np.vectorize(to_ours.get)(tgt)
  our_tgt[:, 0] = tokenizer.BOS_ID
  logits = Transformer(cfg).apply({'params': imported.params}, jnp.asarray(src), our_tgt)
  np.testing.assert_allclose(np.asarray(logits), theirs[..., order], atol=1e-4, rtol=0)


@pytest.mark.parametrize('decoder,beams', [('greedy', 1), ('beam', 4)])
def test_an_opus_like_model_translates_as_generate_does(opus_like, decoder, beams):
  directory, model = opus_like
  imported = workdirs.load_hf(str(directory))
  cfg = ModelConfig(
    vocab_size=imported.fields['vocab_size'], deterministic=True, **imported.fields['model']
  )
  ours = tokenizer.Tokenizer(imported.vocabulary, imported.target_vocabulary)
  size = model.config.vocab_size
  order = marian.vocabulary_order(size - 1, 0, size - 1, 1, size)
  rows, translated = _translate(imported.params, cfg, ours, SENTENCES, decoder, beams)
  generated = _hf_generate(
    model,
    rows,
    num_beams=beams,
    bad_words=[[size - 1]],  # Marian's pad: this project's pad and bos.
    to_marian=lambda ids: [int(order[t]) for t in ids],
  )
  mapped = [([int(order[t]) for t in row], ended) for row, ended in translated]
  # A random model rarely ends a sentence: its rows run to the limit and are compared on
  # their common prefixes (the trained run's exports below check the ends too).
  _assert_same_translations(mapped, generated, at_least=0)
  assert min(len(row) for row, _ in generated) >= 10
  assert len({tuple(row) for row, _ in generated}) > 5  # Not one degenerate output for all.


def test_an_opus_like_import_keeps_a_vocabulary_per_side_for_eval_and_fine_tuning(
  opus_like, tmp_path, synthetic_multi30k_dir, synthetic_multi30k_data_dir
):
  directory, _ = opus_like
  config = tiny.get_config()
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(synthetic_multi30k_data_dir)
  workdir = tmp_path / 'imported'
  workdirs.import_hf(str(directory), str(workdir), config)
  saved = evaluation.load_run_config(str(workdir))
  assert saved.data.target_vocab_path == str(workdir / workdirs.TARGET_VOCABULARY_FILE)
  loaded = tokenizer.get_tokenizer(saved.data, vocab_size=saved.vocab_size, seed=saved.seed)
  imported = workdirs.load_hf(str(directory))
  assert loaded.serialized_model() == imported.vocabulary
  assert loaded.target_model() == imported.target_vocabulary
  [entry] = provenance.read(str(workdir))
  assert set(entry['inputs']) == {'vocabulary', 'target_vocabulary'}
  # hf:DIR needs somewhere for each side's model, and writes both before the run reads them.
  config = sweeps.apply_overrides(
    saved,
    {'init_from': f'hf:{directory}', 'data.vocab_path': str(tmp_path / 'source.model')},
  )
  config.data.target_vocab_path = None
  with pytest.raises(InvalidInput, match='set config.data.target_vocab_path'):
    initialization.resolve(config, str(tmp_path / 'new'))
  config.data.target_vocab_path = str(tmp_path / 'target.model')
  source = initialization.resolve(config, str(tmp_path / 'new'))
  initialization.write_vocabulary(source, config)
  assert (tmp_path / 'source.model').read_bytes() == imported.vocabulary
  assert (tmp_path / 'target.model').read_bytes() == imported.target_vocabulary
  # A fine-tuning run reads each side of its data with that side's model.
  finetuned = tmp_path / 'finetuned'
  training.train_and_evaluate(sweeps.apply_overrides(config, STILL), str(finetuned))
  both = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  pairs = data.translation_texts(config.data, 'validation')
  split = data.encoded_pairs(config.data, both, 'validation')
  ids, starts, lengths = split.read(range(len(pairs)))
  found = {
    tuple(ids[starts[i, 1] : starts[i, 1] + lengths[i, 1]].tolist()) for i in range(len(pairs))
  }
  assert {tuple(both.target.encode(de)) for _, de in pairs} == found
  assert {tuple(both.encode(de)) for _, de in pairs} != found
  [*_, entry] = provenance.read(str(finetuned))
  assert entry['inputs']['target_vocabulary']['path'] == str(tmp_path / 'target.model')
  # Exported again, each side keeps its own model.
  exported = tmp_path / 'exported'
  workdirs.export_hf(str(workdir), str(exported), None)
  assert (exported / 'source.spm').read_bytes() == imported.vocabulary
  assert (exported / 'target.spm').read_bytes() == imported.target_vocabulary


def test_an_import_fits_its_lengths_keeps_decoding_overrides_and_moves_with_its_vocabularies(
  opus_like, tmp_path, synthetic_multi30k_dir, synthetic_multi30k_data_dir
):
  """Issue 62, items 7, 8 and 14: the data lengths a config file sets beyond the model's
  positions are lowered to them (one the command line sets is refused, saying where the limit
  comes from); a decoding override is kept; the workdir names its vocabularies relative to
  itself, so that a moved one reads its own."""
  directory, _ = opus_like
  config = tiny.get_config()
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(synthetic_multi30k_data_dir)
  config.data.max_eval_len, config.decode.beam_size = 200, 7  # The model has 128 positions.
  with pytest.raises(InvalidInput) as refusal:
    workdirs.import_hf(str(directory), str(tmp_path / 'refused'), config, {'data.max_eval_len'})
  assert str(refusal.value) == (
    f'--config.data.max_eval_len=200 exceeds {directory}/config.json '
    "max_position_embeddings=128, the model's positions: set at most 128, or leave it out (the "
    "config file's value is then lowered to it)."
  )
  assert not (tmp_path / 'refused').exists()
  workdir = tmp_path / 'imported'
  workdirs.import_hf(str(directory), str(workdir), config, {'decode.beam_size'})
  saved = json.loads((workdir / 'config.json').read_text())
  assert (saved['data']['max_len'], saved['data']['max_eval_len']) == (32, 128)
  assert saved['decode']['beam_size'] == 7
  assert saved['data']['vocab_path'] == '$WORKDIR/vocabulary.model'
  assert saved['data']['target_vocab_path'] == '$WORKDIR/target_vocabulary.model'
  moved = tmp_path / 'elsewhere'
  shutil.move(workdir, moved)
  config = evaluation.load_run_config(str(moved))
  loaded = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  imported = workdirs.load_hf(str(directory))
  assert loaded.serialized_model() == imported.vocabulary
  assert loaded.target_model() == imported.target_vocabulary
  (moved / workdirs.TARGET_VOCABULARY_FILE).unlink()
  with pytest.raises(MissingInput, match='never trains a vocabulary'):
    evaluation.load_run_config(str(moved))
  assert not workdir.exists()


# --- A tiny run trained here, exported to transformers and CTranslate2 --------------------------


@pytest.fixture(scope='module')
def run(tmp_path_factory, synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """A tiny run with Marian's LayerNorm epsilon, swish and a logits bias, and its exports."""
  workdir = tmp_path_factory.mktemp('run')
  config = tiny.get_config()
  config.model.update(norm_epsilon=1e-5, ffn_activation='swish', logits_bias=True)
  config.num_train_steps, config.checkpoint_every_steps = 120, 60
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.data.data_dir = str(synthetic_multi30k_data_dir)
  training.train_and_evaluate(config, str(workdir))
  hf_dir, ct2_dir = workdir.parent / f'{workdir.name}-hf', workdir.parent / f'{workdir.name}-ct2'
  workdirs.export_hf(str(workdir), str(hf_dir), None)
  workdirs.export_ctranslate2(str(workdir), str(ct2_dir), None)
  return workdir, hf_dir, ct2_dir, workdirs.read_run(str(workdir), None)


def test_the_export_loads_in_transformers_with_no_missing_or_unexpected_weights(run):
  _, hf_dir, _, params = run
  model, info = transformers.MarianMTModel.from_pretrained(hf_dir, output_loading_info=True)
  assert (info['missing_keys'], info['unexpected_keys'], info['mismatched_keys']) == (
    set(),
    set(),
    set(),
  )
  hf_tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
  vocab = tokenizer.Tokenizer(params.vocabulary)
  for line in SENTENCES[:5]:
    assert hf_tokenizer(line)['input_ids'] == vocab.encode(line) + [tokenizer.EOS_ID]
  generation = json.loads((hf_dir / 'generation_config.json').read_text())
  assert generation['num_beams'] == params.config.decode.beam_size
  assert generation['length_penalty'] == pytest.approx(0.6 * 25 / 30)


def test_the_export_computes_eval_pys_logits(run):
  _, hf_dir, _, params = run
  model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
  hf_tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
  batch = hf_tokenizer(
    SENTENCES[:8], text_target=SENTENCES[8:16], return_tensors='pt', padding=True
  )
  labels = batch['labels'].numpy()
  tgt_in = np.concatenate([np.full((8, 1), tokenizer.BOS_ID), labels[:, :-1]], axis=1)
  with torch.no_grad():
    theirs = model(
      input_ids=batch['input_ids'],
      attention_mask=batch['attention_mask'],
      decoder_input_ids=torch.tensor(tgt_in),
    ).logits.numpy()
  cfg = params.model_config.replace(deterministic=True)
  logits = Transformer(cfg).apply(
    {'params': params.params}, jnp.asarray(batch['input_ids'].numpy()), jnp.asarray(tgt_in)
  )
  keep = tgt_in != 0  # Past a row's end HF reads pad embeddings; this project masks them.
  keep[:, 0] = True
  np.testing.assert_allclose(np.asarray(logits)[keep], theirs[keep], atol=1e-4, rtol=0)


@pytest.mark.parametrize('decoder,beams', [('greedy', 1), ('beam', 4)])
def test_the_export_translates_as_this_project_does_in_both_engines(run, decoder, beams):
  _, hf_dir, ct2_dir, params = run
  vocab = tokenizer.Tokenizer(params.vocabulary)
  cfg = params.model_config.replace(deterministic=True)
  rows, ours = _translate(params.params, cfg, vocab, SENTENCES, decoder, beams)
  model = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
  _assert_same_translations(
    ours, _hf_generate(model, rows, num_beams=beams, bad_words=[[0], [2]]), at_least=20
  )
  translator = ctranslate2.Translator(str(ct2_dir), device='cpu')
  # CTranslate2's length limit is one per batch: each row alone, cut where this project cuts it
  # (the source's tokens with EOS, plus MAX_EXTRA_LEN). Under one longer limit a row that loops
  # is a different search: beam search's best at a later step need not extend its best at this
  # one (on an AVX-512 host the shared prefix of such a row differed at its 32nd token).
  ids = {vocab.id_to_piece(i): i for i in range(vocab.vocab_size)}
  theirs = []
  for row in rows:
    limit = len(row) + MAX_EXTRA_LEN
    [result] = translator.translate_batch(
      [[vocab.id_to_piece(t) for t in row[:-1]]],
      beam_size=beams,
      length_penalty=0.0,
      max_decoding_length=limit,
      suppress_sequences=[['<pad>'], ['<s>']],
    )
    hypothesis = result.hypotheses[0]
    theirs.append(([ids[p] for p in hypothesis], len(hypothesis) < limit - 1))
  _assert_same_translations(ours, theirs, at_least=20)


def test_eval_py_translations_equal_ctranslate2s_text(run):
  workdir, _, ct2_dir, params = run
  config = evaluation.load_run_config(str(workdir))
  options = inference.DecodeOptions(decoder='greedy', beam_size=1, alpha=0.0)
  ours = decode.translate_lines(
    config,
    params.model_config.replace(deterministic=True),
    params.params,
    SENTENCES,
    options=options,
    batch_size=16,
  )
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  processor = spm.SentencePieceProcessor(model_file=str(ct2_dir / 'sentencepiece.model'))
  translator = ctranslate2.Translator(str(ct2_dir), device='cpu')
  # eval.py's limit per row: the source's tokens with EOS, plus max_extra_len. CTranslate2's is
  # one per batch: each row alone, so that a row that never writes EOS (the tiny model loops on
  # some) is cut where eval.py cuts it, within the model's positions.
  theirs = []
  for line in SENTENCES:
    pieces = processor.encode(line, out_type=str)
    [result] = translator.translate_batch(
      [pieces],
      beam_size=1,
      max_decoding_length=len(pieces) + 1 + options.max_extra_len,
      suppress_sequences=[['<pad>'], ['<s>']],
    )
    theirs.append(processor.decode(result.hypotheses[0]))
  assert theirs == ours


@pytest.mark.parametrize('kv_heads', [2, 1])
def test_grouped_query_attention_exports_to_ctranslate2_with_the_same_scores(tmp_path, kv_heads):
  """`num_kv_heads` < `num_heads` (2: grouped-query; 1: multi-query) through the specs'
  `num_heads_kv`: CTranslate2 scores targets as this project's model does (random weights,
  so every log-probability is compared, not a translation)."""
  pairs = synthetic_captions(200, seed=11)
  vocab = tokenizer.train_tokenizer([s for pair in pairs for s in pair], 120)
  cfg = ModelConfig(
    vocab_size=120, num_layers=2, d_model=32, num_heads=4, num_kv_heads=kv_heads, d_ff=64,
    max_len=64, norm_epsilon=1e-5, deterministic=True, dropout_rate=0.0,
  )  # fmt: skip
  assert ctranslate2_model.refusals(cfg) == []
  model = Transformer(cfg)
  ones = jnp.ones((1, 8), jnp.int32)
  params = jax.tree.map(np.asarray, nn.meta.unbox(model.init(jax.random.key(1), ones, ones)))
  ctranslate2_model.write(str(tmp_path / 'ct2'), params['params'], cfg, vocab.serialized_model())
  translator = ctranslate2.Translator(str(tmp_path / 'ct2'), device='cpu')
  piece = vocab.id_to_piece
  apply = jax.jit(model.apply)  # One compile a shape, not one per op of the model.
  for source, target in pairs[:4]:
    src_ids, tgt_ids = vocab.encode(source), vocab.encode(target)
    [scored] = translator.score_batch([[piece(i) for i in src_ids]], [[piece(i) for i in tgt_ids]])
    src = jnp.asarray([src_ids + [tokenizer.EOS_ID]], jnp.int32)
    tgt_in = jnp.asarray([[tokenizer.BOS_ID, *tgt_ids]], jnp.int32)
    log_probs = jax.nn.log_softmax(apply(params, src, tgt_in)[0], axis=-1)
    ours = [float(log_probs[t, i]) for t, i in enumerate([*tgt_ids, tokenizer.EOS_ID])]
    np.testing.assert_allclose(scored.log_probs, ours, atol=2e-4)


@pytest.mark.parametrize('quantization', ['int8', 'int8_float32'])
def test_a_quantized_ctranslate2_export_is_smaller_and_translates(run, tmp_path, quantization):
  workdir, _, ct2_dir, _ = run
  quantized = tmp_path / quantization
  workdirs.export_ctranslate2(str(workdir), str(quantized), None, quantization=quantization)
  float32_bytes = (ct2_dir / 'model.bin').stat().st_size
  # The tiny model's matrices hold most of its bytes: 1 byte a weight instead of 4.
  assert (quantized / 'model.bin').stat().st_size < 0.5 * float32_bytes
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  processor = spm.SentencePieceProcessor(model_file=str(quantized / 'sentencepiece.model'))
  results = ctranslate2.Translator(str(quantized), device='cpu').translate_batch(
    [processor.encode(line, out_type=str) for line in SENTENCES[:8]],
    beam_size=2,
    max_decoding_length=64,  # Within the model's 128 positions, where a row may loop.
  )
  assert all(r.hypotheses[0] for r in results)


def test_export_then_import_gives_the_same_parameters_bit_for_bit(run, tmp_path):
  _, hf_dir, _, params = run
  imported = workdirs.load_hf(str(hf_dir))
  assert imported.vocabulary == params.vocabulary
  assert jax.tree.structure(imported.params) == jax.tree.structure(params.params)
  for got, want in zip(
    jax.tree.leaves(imported.params), jax.tree.leaves(params.params), strict=True
  ):
    assert got.dtype == want.dtype and np.array_equal(got, want)
  assert imported.fields['model']['d_model'] == params.model_config.d_model


def _hf_finetune_config(workdir, hf_dir, **overrides):
  """The exported run's own config, fine-tuned from its Hugging Face export."""
  return sweeps.apply_overrides(
    evaluation.load_run_config(str(workdir)),
    {**STILL, 'init_from': f'hf:{hf_dir}', **overrides},
  )


def test_a_run_fine_tuned_from_hf_dir_starts_from_its_parameters_and_vocabulary(run, tmp_path):
  workdir, hf_dir, _, params = run
  vocabulary = tmp_path / 'vocabulary.model'  # Not there yet: written from hf_dir.
  config = _hf_finetune_config(workdir, hf_dir, **{'data.vocab_path': str(vocabulary)})
  finetuned = tmp_path / 'finetuned'
  training.train_and_evaluate(config, str(finetuned))
  assert vocabulary.read_bytes() == params.vocabulary
  [entry] = provenance.read(str(finetuned))
  assert entry['initialization'] == {
    'init_from': f'hf:{hf_dir}',
    'init_checkpoint': 'latest',
    'steps': [],
    'params_sha256': initialization.params_sha256(params.params),
  }
  # Its first evaluation is the exported checkpoint's (the source's last).
  losses = lambda d: [r['eval_loss'] for r in _metric_rows(d) if 'eval_loss' in r]
  np.testing.assert_allclose(losses(finetuned)[0], losses(workdir)[-1], rtol=1e-5)


def _metric_rows(workdir):
  return [json.loads(line) for line in (Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'model.d_ff': 96}, 'config.model.d_ff: '),
    ({'model.ffn_activation': 'relu'}, "config.model.ffn_activation: 'swish' -> 'relu'"),
    ({'data.vocab_path': None}, 'set config.data.vocab_path'),
    ({'init_checkpoint': 'avg:2'}, 'holds one set of parameters'),
  ],
)
def test_a_fine_tuning_from_hf_dir_that_does_not_fit_is_refused_by_name(
  run, tmp_path, overrides, message
):
  workdir, hf_dir, _, _ = run
  config = _hf_finetune_config(
    workdir, hf_dir, **{'data.vocab_path': str(tmp_path / 'v.model'), **overrides}
  )
  with pytest.raises(InvalidInput, match=re.escape(message)):
    initialization.resolve(config, str(tmp_path / 'new'))
  assert not (tmp_path / 'new').exists() and not (tmp_path / 'v.model').exists()


def test_a_vocabulary_file_other_than_hf_dirs_is_refused(run, tmp_path):
  workdir, hf_dir, _, _ = run
  other = tmp_path / 'other.model'
  other.write_bytes(b'not the model vocabulary')
  config = _hf_finetune_config(workdir, hf_dir, **{'data.vocab_path': str(other)})
  with pytest.raises(InvalidInput, match='the vocabulary'):
    initialization.resolve(config, str(tmp_path / 'new'))
  assert other.read_bytes() == b'not the model vocabulary'


def _command(script, *args):
  return subprocess.run(
    [sys.executable, script, *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )


def test_convert_py_imports_a_workdir_that_eval_py_scores_and_train_py_will_not_resume(
  run, tmp_path, synthetic_multi30k_dir, synthetic_multi30k_data_dir
):
  workdir, hf_dir, _, params = run
  imported = tmp_path / 'imported'
  data_flags = [
    f'--config.data.manual_dir={synthetic_multi30k_dir}',
    f'--config.data.data_dir={synthetic_multi30k_data_dir}',
  ]
  done = _command(
    'convert.py',
    f'--from_hf={hf_dir}',
    f'--workdir={imported}',
    '--config=configs/tiny.py',
    *data_flags,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  scored = _command('eval.py', f'--workdir={imported}', '--decoder=greedy')
  assert scored.returncode == 0, scored.stderr[-3000:]
  original = _command('eval.py', f'--workdir={workdir}', '--decoder=greedy')
  assert original.returncode == 0, original.stderr[-3000:]
  result = lambda w: json.loads(next((w / 'eval').glob('*test*greedy*.json')).read_text())['bleu']
  assert result(imported) == result(workdir)  # The same model, the same translations.
  resumed = _command('train.py', '--config=configs/tiny.py', f'--workdir={imported}', *data_flags)
  assert resumed.returncode == 1
  assert f'--config.init_from={imported}' in resumed.stderr
  again = _command('convert.py', f'--from_hf={hf_dir}', f'--workdir={imported}')
  assert again.returncode == 1 and 'is not empty' in again.stderr
  del params


# --- What has no exact form is refused, naming the field ----------------------------------------


@pytest.mark.parametrize(
  'change,field',
  [
    (dict(norm='pre_ln'), 'config.model.norm'),
    (dict(position='rope'), 'config.model.position'),
    (dict(ffn_activation='swiglu'), 'config.model.ffn_activation'),
    (dict(use_bias=False), 'config.model.use_bias'),
    (dict(architecture='decoder_only'), 'config.model.architecture'),
    (dict(norm_epsilon=1e-6), 'config.model.norm_epsilon'),
    (dict(qk_norm=True), 'config.model.qk_norm'),  # Declared after the exporter: by name.
  ],
)
def test_a_variant_without_an_exact_marian_form_is_refused_by_name(change, field):
  cfg = ModelConfig(vocab_size=40, d_model=16, num_heads=2, **{'norm_epsilon': 1e-5, **change})
  refusals = marian.export_refusals(cfg)
  assert len(refusals) == 1 and refusals[0].startswith(field), refusals


def test_pre_ln_is_refused_for_marian_but_served_by_ctranslate2():
  cfg = ModelConfig(vocab_size=40, d_model=16, num_heads=2, norm='pre_ln')
  assert 'ctranslate2' in marian.export_refusals(cfg)[0]
  assert ctranslate2_model.refusals(cfg) == []
  assert ctranslate2_model.refusals(cfg.replace(position='rope'))[0].startswith(
    'config.model.position'
  )
  assert ctranslate2_model.refusals(cfg.replace(qk_norm=True))[0].startswith(
    'config.model.qk_norm=True'
  )


@pytest.mark.parametrize(
  'key,value',
  [
    ('normalize_before', True),
    ('scale_embedding', False),
    ('activation_function', 'tanh'),
    ('decoder_layers', 3),
    ('tie_word_embeddings', False),
  ],
)
def test_a_marian_config_without_an_exact_form_here_is_refused_by_key(
  opus_like, tmp_path, key, value
):
  directory, _ = opus_like
  config = json.loads((directory / 'config.json').read_text())
  config[key] = value
  (tmp_path / 'config.json').write_text(json.dumps(config))
  with pytest.raises(InvalidInput, match=f'config.json {key}={value!r}'):
    hf_files.read_config(str(tmp_path))


def test_a_tokenizer_with_ids_of_its_own_per_side_is_refused(opus_like, tmp_path):
  directory, _ = opus_like
  copy = tmp_path / 'copy'
  shutil.copytree(directory, copy)
  (copy / 'tokenizer_config.json').write_text(json.dumps({'separate_vocabs': True}))
  with pytest.raises(InvalidInput, match='separate_vocabs=true'):
    workdirs.load_hf(str(copy))


def test_an_export_into_a_directory_that_holds_files_changes_nothing(run, tmp_path):
  workdir, _, _, _ = run
  (tmp_path / 'keep.txt').write_text('mine')
  with pytest.raises(InvalidInput, match='is not empty'):
    workdirs.export_hf(str(workdir), str(tmp_path), None)
  assert os.listdir(tmp_path) == ['keep.txt']
