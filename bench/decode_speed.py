"""Decoding speed: greedy and beam search (4 beams, alpha 0.6) over a test split, in one run.

  python bench/decode_speed.py --workdir=workdirs/m30k          # A trained run's weights.
  python bench/decode_speed.py --config=configs/tiny.py \
      --config.data.manual_dir=../shared/data/multi30k --max_sentences=64  # Random weights.

With `--workdir` the model is that run's (WORKDIR/config.json, its latest
checkpoint, or `--checkpoint`); `--config.*` overrides still apply on top (e.g.
`--config.data.manual_dir`). Without it the parameters are random, initialised
from `--config`: the speed is that of the architecture, but a random model
rarely emits EOS, so nearly every output runs to its length limit (source length
+ 50), the slowest case.

Reports, per decoder, from one run on one machine (figures are only comparable
side by side). Sentences are sorted by length in batches of --max_tokens source
token slots, as eval.py decodes them (rows and widths are powers of two, so few
shapes); --max_tokens=0 decodes batches of --batch_size in input order, as before
issue 14. Each decoder decodes all batches twice, with the source batches already
tokenized:
  * "with compiles s": the first time, compiling each new shape on first use, as
    eval.py does;
  * decode time, sentences/s and output tokens/s (EOS included, padding rows of
    the last batch excluded): the second time, every shape compiled; each batch
    timed end to end (copy in, decode, copy out);
  * "2nd pass": sentences decoded again in full after the short first pass
    (`inference.TwoPass`, how eval.py decodes with beam search).
With --one_pass (default) each two-pass decoder (beam search) is also timed in one
pass of every step, the decoding before the two passes, side by side.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import (  # noqa: E402
  errors,
  evaluation,
  inference,
  paper,
  tokenizer,
  train_steps,
)
from transformer.config import ModelConfig  # noqa: E402
from transformer.tasks import translation  # noqa: E402
from transformer.tools import sweeps  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  'config',
  'configs/default.py',
  'Config of the random model (ignored, but for its '
  '--config.* overrides, when --workdir is given).',
)
_WORKDIR = flags.DEFINE_string(
  'workdir', None, "A training run's directory: its config.json and checkpoint are used."
)
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', 'latest', "With --workdir: 'latest', a step number or 'avg:N'."
)
_SPLIT = flags.DEFINE_string('split', None, 'Split to decode (default: config.data.test_split).')
_BATCH_SIZE = flags.DEFINE_integer(
  'batch_size', inference.MAX_DECODE_ROWS, 'Most sentences per decoding batch.'
)
_MAX_TOKENS = flags.DEFINE_integer(
  'max_tokens',
  inference.MAX_DECODE_TOKENS,
  'Source token slots per batch, sentences sorted '
  'by length (as eval.py decodes); 0: batches of --batch_size in input order (before issue 14).',
)
_MAX_SENTENCES = flags.DEFINE_integer('max_sentences', 0, 'Decode at most this many (0: all).')
_ONE_PASS = flags.DEFINE_bool(
  'one_pass', True, 'Also time each two-pass decoder in one pass of every step (before issue 14).'
)

BEAM_SIZE, ALPHA, MAX_EXTRA_LEN = paper.BEAM_SIZE, paper.LENGTH_PENALTY_ALPHA, paper.MAX_EXTRA_LEN
DECODERS = {
  'greedy': inference.DecodeOptions(decoder='greedy', max_extra_len=MAX_EXTRA_LEN),
  f'beam-{BEAM_SIZE}': inference.DecodeOptions(
    decoder='beam', beam_size=BEAM_SIZE, alpha=ALPHA, max_extra_len=MAX_EXTRA_LEN
  ),
}


def load_config() -> tuple[ml_collections.ConfigDict, str]:
  """The run's config (with command-line overrides) or `--config`; and where it came from."""
  if not _WORKDIR.value:
    return _CONFIG.value, config_flags.get_config_filename(flags.FLAGS['config'])
  config = evaluation.load_run_config(_WORKDIR.value)
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  return sweeps.apply_overrides(config, overrides), _WORKDIR.value


def load_params(config: ml_collections.ConfigDict):
  """Checkpointed parameters with --workdir, otherwise random ones; and their label."""
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  if _WORKDIR.value:
    return evaluation.load_params(
      _WORKDIR.value, evaluation.setup(config).abstract_state, _CHECKPOINT.value
    )
  tokens = jnp.ones((1, config.data.max_len), jnp.int32)
  init = jax.jit(lambda key: model.init(key, tokens, tokens)['params'])
  return nn.meta.unbox(init(jax.random.key(config.seed))), 'random'


def source_batches(config, vocab, split: str) -> tuple[list[dict[str, np.ndarray]], float]:
  """The split's decoding batches, capped at --max_sentences; and the seconds taken."""
  start = time.perf_counter()
  batches, count = [], 0
  for batch in translation.data.translation_batches(config.data, vocab, split, _BATCH_SIZE.value):
    valid = batch['valid'].copy()
    if _MAX_SENTENCES.value:
      keep = max(0, _MAX_SENTENCES.value - count)
      valid[np.flatnonzero(valid)[keep:]] = False
    if not valid.any():
      break
    # Rows left out by the cap are decoded as padding (all zeros), keeping the batch shape.
    batches.append(
      {
        'src_tokens': np.where(valid[:, None], batch['src_tokens'], 0),
        'index': batch['index'],
        'valid': valid,
      }
    )
    count += int(valid.sum())
  if _MAX_TOKENS.value:
    batches = inference.length_sorted_batches(
      batches,
      max_tokens=_MAX_TOKENS.value,
      max_rows=_BATCH_SIZE.value,
      max_len=config.data.max_eval_len,
    )
  return batches, time.perf_counter() - start


def output_lengths(tokens_BL: np.ndarray) -> np.ndarray:
  """Tokens of each output up to and including its EOS (all non-padding if none)."""
  is_eos = tokens_BL == tokenizer.EOS_ID
  return np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, (tokens_BL != 0).sum(axis=1))


def measure(translate, params, batches: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """Decodes all batches twice: compiles included (as eval.py does), then compiled."""
  key = jax.random.key(0)
  seconds = []
  for _ in range(2):
    start = time.perf_counter()
    outputs = [np.asarray(translate(params, jnp.asarray(b['src_tokens']), key)) for b in batches]
    seconds.append(time.perf_counter() - start)
  sentences = sum(int(b['valid'].sum()) for b in batches)
  tokens = sum(
    int(output_lengths(out[b['valid']]).sum()) for out, b in zip(outputs, batches, strict=True)
  )
  # A two-pass decoder counts the rows it decoded again, over both runs.
  rows_again = getattr(translate, 'rows_again', 0) / 2
  return {
    'first_s': seconds[0],
    'decode_s': seconds[1],
    'sentences': sentences,
    'tokens': tokens,
    'sentences_per_s': sentences / seconds[1],
    'tokens_per_s': tokens / seconds[1],
    'again': rows_again,
  }


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config, source = load_config()
  model_config = ModelConfig.from_config(config)
  split = _SPLIT.value or config.data.test_split
  vocab = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  params, label = load_params(config)
  batches, pipeline_seconds = source_batches(config, vocab, split)
  if not batches:
    raise ValueError(f'No sentences to decode in split {split!r}.')
  num_sentences = sum(int(b['valid'].sum()) for b in batches)
  lengths = sorted({b['src_tokens'].shape[1] for b in batches})
  logging.info('Decoding %d sentences of %s.', num_sentences, split)

  results = {}
  for name, options in DECODERS.items():
    translate = translation.decode.make_translate_fn(model_config, options)
    if _ONE_PASS.value and isinstance(translate, inference.TwoPass):
      # Its second pass alone: every step in one pass, the decoding before issue 14.
      one_pass = lambda params, src, key, full=translate.full_fn: full(params, src, key).tokens  # noqa: E731
      results[f'{name} one pass'] = measure(one_pass, params, batches)
    results[name] = measure(translate, params, batches)

  devices = jax.devices()
  print(f'device: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})')
  print(
    f'model: {source}, params: {label}; d_model {model_config.d_model}, '
    f'{model_config.num_layers}+{model_config.num_layers} layers, '
    f'vocab {model_config.vocab_size}'
  )
  rows = sorted({b['src_tokens'].shape[0] for b in batches})
  order = (
    f'sorted by length, {_MAX_TOKENS.value} token slots' if _MAX_TOKENS.value else 'input order'
  )
  print(
    f'data: {split}, {num_sentences} sentences in {len(batches)} batches ({order}; rows '
    f'{rows}, source lengths {lengths}); tokenized in {pipeline_seconds:.1f} s, not timed '
    'below'
  )
  print(f'options: output limit source length + {MAX_EXTRA_LEN}; beam alpha {ALPHA}')
  header = (
    f'{"decoder":<16} {"with compiles s":>15} {"decode s":>9} {"sent/s":>7} '
    f'{"out tok/s":>10} {"tok/sent":>8} {"2nd pass":>8}'
  )
  print(header)
  print('-' * len(header))
  for name, r in results.items():
    print(
      f'{name:<16} {r["first_s"]:>15.1f} {r["decode_s"]:>9.2f} {r["sentences_per_s"]:>7.1f} '
      f'{r["tokens_per_s"]:>10,.0f} {r["tokens"] / r["sentences"]:>8.1f} {r["again"]:>8.0f}'
    )


if __name__ == '__main__':
  errors.run(main)
