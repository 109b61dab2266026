"""The decoder-only language model: its data (text_lines, lm1b, packed windows), generation
through the translation decoders, config checks, and lm_tiny trained and evaluated end to end.

The model's causality, padding, packing and cached-decoding properties are tested with every
other variant in test_variants.py (`decoder_only`).
"""

import collections
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import synthetic_captions, synthetic_pairs, write_lines

from configs import lm_default, lm_tiny
from transformer import config as config_lib
from transformer import (
  datasets,
  dry_run,
  evaluation,
  inference,
  input_pipeline,
  training,
)
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.datasets import lm1b
from transformer.model import Transformer
from transformer.tasks import language_model
from transformer.tokenizer import BOS_ID, EOS_ID, PAD_ID

REPO = Path(__file__).resolve().parents[1]


def _lm_config(data_dir, manual_dir, dataset='text_lines', **data):
  config = lm_default.get_config()
  config.vocab_size = data.pop('vocab_size', 300)
  config.data.dataset = dataset
  config.data.data_dir = str(data_dir)
  config.data.manual_dir = str(manual_dir) if manual_dir else None
  config.data.max_len, config.data.max_eval_len, config.data.tokens_per_batch = 16, 32, 128
  for key, value in data.items():
    config.data[key] = value
  return config


@pytest.fixture(scope='module')
def small(tmp_path_factory):
  """(config, tokenizer, {split: lines}) of English text: train 200 lines, val 30 (one blank)."""
  root = tmp_path_factory.mktemp('lm')
  lines = {
    'train': [en for en, _ in synthetic_pairs(200, seed=5, max_words=30)],
    'val': [en for en, _ in synthetic_pairs(30, seed=6, max_words=30)],
  }
  lines['val'][7] = '   '  # Dropped when preparing.
  for split, split_lines in lines.items():
    write_lines(root / 'raw' / f'{split}.en', split_lines)
  write_lines(root / 'raw' / 'train.de', ['nur deutsch'])  # Another language: ignored.
  config = _lm_config(root / 'tfds', root / 'raw')
  return (
    config,
    tokenizer_lib.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed),
    lines,
  )


# --- Data ---------------------------------------------------------------------------------------


def test_text_lines_reads_one_language_in_file_order(small):
  config, _, lines = small
  validation = datasets.get_data_source(config.data, 'validation')
  kept = [(i, line) for i, line in enumerate(lines['val']) if line.strip()]
  assert [(int(ex['index']), datasets.document_text(ex)) for ex in validation] == kept
  assert len(datasets.get_data_source(config.data, 'train')) == 200
  assert datasets.dataset_dir(config.data).split('/')[-1].startswith('text_lines-')
  assert tokenizer_lib.vocab_path(config.data, config.vocab_size).endswith(
    'spm_en_300_1000000.model'
  )


def test_text_lines_names_missing_files(tmp_path):
  write_lines(tmp_path / 'raw' / 'train.en', ['a line'])
  write_lines(tmp_path / 'raw' / 'val.de', ['eine Zeile'])
  with pytest.raises(ValueError, match=r'lacks required files: val\.en'):
    datasets.prepare(_lm_config(tmp_path / 'tfds', tmp_path / 'raw').data)
  assert not (tmp_path / 'tfds').exists()


def _windows(tokenizer, texts, length):
  """Expected (input, target) windows of documents, as tuples."""
  out = []
  for text in texts:
    ids = tokenizer.encode(text)
    tgt_in, tgt = [BOS_ID] + ids, ids + [EOS_ID]
    out += [
      (tuple(tgt_in[i : i + length]), tuple(tgt[i : i + length]))
      for i in range(0, len(tgt), length)
    ]
  return out


def _packed_windows(batch):
  """(input, target) of every segment of every row; checks positions and the shift."""
  got = []
  for row in range(batch['tgt_tokens'].shape[0]):
    segments = batch['tgt_segments'][row]
    for s in np.unique(segments[segments > 0]):
      where = np.flatnonzero(segments == s)
      assert np.all(np.diff(where) == 1)
      np.testing.assert_array_equal(batch['tgt_positions'][row, where], np.arange(len(where)))
      tgt_in, tgt = batch['tgt_input_tokens'][row, where], batch['tgt_tokens'][row, where]
      np.testing.assert_array_equal(tgt_in[1:], tgt[:-1])  # Input = target shifted right.
      got.append((tuple(tgt_in), tuple(tgt)))
    assert not batch['tgt_tokens'][row][segments == 0].any()
  return got


@pytest.mark.parametrize('lines_per_document', [1, 4])
def test_eval_batches_predict_every_token_once(small, lines_per_document):
  config, tok, lines = small
  config = config.copy_and_resolve_references()
  config.data.lines_per_document = lines_per_document
  kept = [line for line in lines['val'] if line.strip()]
  docs = [
    ' '.join(kept[i : i + lines_per_document]) for i in range(0, len(kept), lines_per_document)
  ]
  assert list(language_model.data.documents(config.data, 'validation')) == docs
  for length in (config.data.max_eval_len, 64):
    batches = list(language_model.data.eval_batches(config.data, tok, 'validation', length))
    rows = max(1, config.data.tokens_per_batch // length)
    assert all(set(b) == set(language_model.data.BATCH_KEYS) for b in batches)
    assert all(b[k].shape == (rows, length) for b in batches for k in b)
    got = collections.Counter(w for b in batches for w in _packed_windows(b))
    expected = collections.Counter(_windows(tok, docs, length))
    assert got == expected
    if lines_per_document > 1:  # Documents longer than a window: cut, not dropped.
      assert sum(len(w[1]) == length for w in expected) >= 2


def test_train_batches_are_packed_windows_and_resume(small):
  config, tok, lines = small
  rows = input_pipeline.train_rows(config.data)
  it = language_model.data.train_iterator(config.data, tok, seed=config.seed)
  epoch = collections.Counter(_windows(tok, lines['train'], config.data.max_len))
  seen = collections.Counter()
  for _ in range(80):  # Over an epoch: every window of every document, nothing else.
    batch = next(it)
    assert set(batch) == set(language_model.data.BATCH_KEYS)
    assert batch['tgt_tokens'].shape == (rows, config.data.max_len)
    seen.update(_packed_windows(batch))
  assert set(seen) == set(epoch)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  restored = language_model.data.train_iterator(config.data, tok, seed=config.seed)
  restored.set_state(state)
  for want in expected:
    got = next(restored)
    for key in language_model.data.BATCH_KEYS:
      np.testing.assert_array_equal(got[key], want[key])


def test_prompt_batches_keep_order_and_pad_right(small):
  config, tok, _ = small
  prompts = ['Bada kelo', '', 'Sopi ra ve dulo kamo']
  batches = list(language_model.data.prompt_batches(prompts, tok, 2, max_len=16))
  assert [b['index'].tolist() for b in batches] == [[0, 1], [2, -1]]
  assert batches[0]['prompt_tokens'].shape == (2, 8)
  assert tok.decode(batches[0]['prompt_tokens'][0]) == 'Bada kelo'
  assert not batches[0]['prompt_tokens'][1].any() and batches[1]['valid'].tolist() == [True, False]
  with pytest.raises(ValueError, match='Prompt 1 has'):
    list(language_model.data.prompt_batches(['word ' * 40], tok, 2, max_len=16))


def test_lm1b_prepares_a_local_release_without_tensorflow(tmp_path):
  top = tmp_path / 'raw' / lm1b.TOP_LEVEL_DIR
  write_lines(
    top / 'training-monolingual.tokenized.shuffled' / 'news.en-00001-of-00100',
    ['The first sentence .', 'A second one .'],
  )
  write_lines(
    top / 'training-monolingual.tokenized.shuffled' / 'news.en-00002-of-00100', ['And a third .']
  )
  write_lines(
    top / 'heldout-monolingual.tokenized.shuffled' / 'news.en.heldout-00000-of-00050',
    ['A held-out sentence .'],
  )
  config = _lm_config(tmp_path / 'tfds', tmp_path / 'raw', 'lm1b', eval_split='test')
  builder = datasets.prepare(config.data)
  assert builder.data_dir.endswith('lm1b/1.1.0')
  assert {s: builder.info.splits[s].num_examples for s in builder.info.splits} == {
    'train': 3,
    'test': 1,
  }
  train = datasets.get_data_source(config.data, 'train')
  assert sorted(datasets.document_text(ex) for ex in train) == [
    'A second one .',
    'And a third .',
    'The first sentence .',
  ]
  assert config_lib.config_errors(config) == []


# --- Config checks -------------------------------------------------------------------------------


def test_config_errors_name_the_keys():
  config = lm_default.get_config()
  config.data.dataset = 'multi30k'
  config.eval_bleu_sentences = 8
  with pytest.raises(ValueError) as error:
    config_lib.validate(config, num_devices=1)
  message = str(error.value)
  assert "config.model.architecture='decoder_only' does not fit config.data.dataset='multi30k'" in (
    message
  )
  assert 'config.eval_bleu_sentences=8 must be 0' in message
  config = lm_default.get_config()
  config.model.architecture = 'encoder_decoder'
  with pytest.raises(ValueError, match="architecture='encoder_decoder' does not fit"):
    config_lib.validate(config, num_devices=1)
  config.model.architecture = 'decoder'
  with pytest.raises(ValueError, match="config.model.architecture='decoder' is not one of"):
    ModelConfig.from_config(config)


def test_dry_run_counts_the_decoder_only_model(capsys):
  # 4 layers x (4 * 256^2 + 4 * 256 attention, 2 * 256 * 1024 + 1024 + 256 FFN, 2 x 512 norms)
  # + the 4000 x 256 embedding that is also the softmax.
  assert dry_run.run(lm_default.get_config(), num_devices=1) == 4 * 789_760 + 1_024_000
  assert 'cross_attention' not in capsys.readouterr().out


# --- Generation through the translation decoders ------------------------------------------------

VOCAB = 24


@functools.cache
def _tiny_model():
  """A random 2-layer decoder-only model and three prompts (5 tokens, empty, 2 tokens)."""
  cfg = ModelConfig(
    vocab_size=VOCAB,
    architecture='decoder_only',
    num_layers=2,
    d_model=16,
    num_heads=2,
    d_ff=32,
    deterministic=True,
  )
  tokens = jnp.ones((1, 4), jnp.int32)
  init = jax.jit(lambda key: Transformer(cfg).init(key, None, tokens)['params'])
  params = nn.meta.unbox(init(jax.random.key(3)))
  prompts = np.zeros((3, 8), np.int32)
  prompts[0, :5] = [5, 6, 7, 8, 9]
  prompts[2, :2] = [10, 11]
  return cfg, params, jnp.asarray(prompts)


@functools.cache
def _generate_fn(options: inference.DecodeOptions):
  return language_model.generate.make_generate_fn(
    _tiny_model()[0], options
  )  # One compile per options.


def _generate(seed=0, **options):
  _, params, prompts = _tiny_model()
  fn = _generate_fn(inference.DecodeOptions(max_extra_len=6, **options))
  return np.asarray(fn(params, prompts, jax.random.key(seed)))


def test_greedy_continuation_is_the_argmax_of_the_full_forward_pass():
  cfg, params, prompts = _tiny_model()
  out = _generate(decoder='greedy')
  assert out.shape == (3, 8 + 6)
  # The full pass over BOS + the output, all rows at once: causality makes the padding after
  # a row's end irrelevant to its earlier positions.
  inputs = np.concatenate([np.full((3, 1), BOS_ID), out[:, :-1]], axis=1)
  logits = np.array(jax.jit(Transformer(cfg).apply)({'params': params}, None, inputs))
  logits[..., [PAD_ID, BOS_ID]] = -np.inf  # Generation never picks them: no document holds them.
  for row, prompt_length in enumerate([5, 0, 2]):
    tokens = out[row].tolist()
    assert tokens[:prompt_length] == prompts[row, :prompt_length].tolist()  # Prompt kept.
    length = tokens.index(EOS_ID) + 1 if EOS_ID in tokens else prompt_length + 6
    assert length > prompt_length and not any(tokens[length:])
    np.testing.assert_array_equal(
      np.argmax(logits[row], -1)[prompt_length:length], tokens[prompt_length:length]
    )


@pytest.mark.parametrize('decoder', ['greedy', 'sample'])
def test_generation_in_two_passes_gives_the_one_pass_outputs(decoder, monkeypatch):
  # A short first pass (prompts of width 8 + 6 new tokens: 14 steps), then the rows it left
  # unfinished again with every step, each with its own key: one pass's tokens.
  _, params, prompts = _tiny_model()
  options = inference.DecodeOptions(decoder=decoder, max_extra_len=6, temperature=1.5)
  generate = functools.partial(
    language_model.generate.generate, model_config=_tiny_model()[0], options=options
  )
  one_pass = jax.jit(generate)(params, prompts, jax.random.key(4))
  for steps in (4, 9):
    monkeypatch.setattr(inference, 'first_pass_steps', lambda width, limit, k=steps: k)
    first = jax.jit(functools.partial(generate, first_pass=True))
    decoded = first(params, prompts, jax.random.key(4))
    assert not np.asarray(decoded.tokens)[:, steps:].any()
    done = np.asarray(decoded.done)
    assert steps > 4 or not done[0]  # The 5-token prompt's row needs more than 4 steps.
    two_pass = inference.TwoPass(first, jax.jit(generate), second_pass_rows=2)
    np.testing.assert_array_equal(two_pass(params, prompts, jax.random.key(4)), one_pass.tokens)
    assert two_pass.rows_again == 3 - done.sum()
  assert isinstance(_generate_fn(options), inference.TwoPass)


def test_sampling_is_reproducible_with_a_fixed_seed():
  sample = lambda seed, **kw: _generate(seed, decoder='sample', temperature=1.5, top_p=0.95, **kw)
  first = sample(1)
  np.testing.assert_array_equal(sample(1), first)
  assert not np.array_equal(sample(2), first)
  np.testing.assert_array_equal(first[0, :5], [5, 6, 7, 8, 9])  # The prompt, copied.
  # Top-k of 1 leaves one token per step: greedy decoding, whatever the temperature and seed.
  np.testing.assert_array_equal(sample(3, top_k=1), _generate(decoder='greedy'))
  with pytest.raises(ValueError, match="decoder='beam' is for translation"):
    _generate(decoder='beam')


# --- End to end: configs/lm_tiny.py on the English side of a made-up Multi30k ---------------------

# The start of a sentence of the made-up corpus: words the tokenizer knows.
PROMPT = ' '.join(synthetic_captions(1)[0][0].split()[:3])


@pytest.fixture(scope='module')
def lm_run(tmp_path_factory, synthetic_multi30k_dir):
  workdir = tmp_path_factory.mktemp('lm_run')
  config = lm_tiny.get_config()
  config.data.manual_dir = str(synthetic_multi30k_dir)
  config.vocab_size = 256  # The made-up English side has too few distinct words for 512 pieces.
  config.data.data_dir = str(tmp_path_factory.mktemp('lm_tfds'))
  final = training.train_and_evaluate(config, str(workdir))
  return workdir, config, final


@pytest.mark.slow
def test_lm_tiny_trains_and_eval_scores_and_generates(lm_run):
  workdir, config, final = lm_run
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  train_losses = [r['train_loss'] for r in rows if 'train_loss' in r]
  assert len(train_losses) == 4 and train_losses[-1] < train_losses[0] - 0.5, train_losses
  assert 'eval_bleu' not in final

  run = evaluation.setup(config)
  params, _ = evaluation.restore_params(run, str(workdir), 'latest')
  scores = language_model.evaluate.score_split(config, run.model_config, params, 'validation')
  assert scores['perplexity'] == pytest.approx(final['eval_perplexity'], rel=1e-4)
  assert scores['num_tokens'] > 2_000  # Every token of 200 lines of 3 to 14 words.
  learned = config.copy_and_resolve_references()
  learned.model.position = 'learned'
  skipped = language_model.evaluate.length_extrapolation(
    learned, ModelConfig.from_config(learned), params, 'validation', [256]
  )
  assert 'config.model.max_len' in skipped['256']['skipped']

  result = subprocess.run(
    [
      sys.executable,
      'eval.py',
      f'--workdir={workdir}',
      f'--prompt={PROMPT}',
      '--prompt=',
      '--decoder=sample',
      '--top_k=20',
      '--seed=1',
      '--max_extra_len=12',
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.split('\n')
  assert len(lines) == 3 and lines[2] == ''
  assert lines[0].startswith(PROMPT) and len(lines[0]) > len(PROMPT)
  assert lines[1]  # From scratch.
