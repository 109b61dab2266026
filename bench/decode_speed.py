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
    (`inference.TwoPass`, how eval.py decodes with every decoder).
With --concurrency=N, N batches decode at once in threads (`inference.decode_in_order`),
as eval.py decodes on one CPU device with its default --batch_size (32 hypotheses).
With --one_pass (default) each two-pass decoder is also timed in one
pass of every step, the decoding before the two passes, side by side.

With --profile, beam search's first pass (where nearly every sentence is decoded) is
decoded once more under JAX's profiler, with XLA:CPU's trace of each operation
(`--xla_cpu_enable_xprof_traceme`, set here), and its time is split by part, each
operation named by its source (the model's module path, or the beam loop's named
scopes `choose`, `finished`, `reorder`): decoder layers, cache writes, output
projection, choosing candidates (log-softmax sums and top-k), the finished set, the
cache reorder, the rest of the loop; beside the wall time of the traced decode (the
rest: the loop's own work between operations, copies in and out). Also the share of
the loop's row-steps spent on sentences already done (`decoding.Decoded.steps`).
"""

import collections
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if any(arg in ('--profile', '--profile=true', '--profile=True') for arg in sys.argv[1:]):
  # Read by XLA when the CPU client starts: a trace event for every operation executed.
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_xprof_traceme=true'
  ).strip()

# First: on a CPU-only host it keeps JAX from loading libtpu and the CUDA plugin
# (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001

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
_CONCURRENCY = flags.DEFINE_integer(
  'concurrency',
  1,
  'Batches decoded at once, in threads (eval.py: two per core on one CPU device, '
  '`inference.concurrent_batches`).',
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
_PROFILE = flags.DEFINE_bool(
  'profile', False, "Also split the beam decoder's first pass by part (XLA:CPU's operation trace)."
)
_DECODERS = flags.DEFINE_list('decoders', ['greedy', 'beam'], 'Which decoders to time.')
_BEAM_SIZE = flags.DEFINE_integer('beam_size', 0, "Beams (0: the paper's 4).")
_ALPHA = flags.DEFINE_float(
  'alpha', None, "Beam search's length penalty (default: the paper's 0.6)."
)

MAX_EXTRA_LEN = paper.MAX_EXTRA_LEN


def decoders() -> dict[str, inference.DecodeOptions]:
  """The decoders timed (--decoders): greedy, and beam search at --beam_size and --alpha."""
  beam_size = _BEAM_SIZE.value or paper.BEAM_SIZE
  alpha = paper.LENGTH_PENALTY_ALPHA if _ALPHA.value is None else _ALPHA.value
  known = {
    'greedy': ('greedy', inference.DecodeOptions(decoder='greedy', max_extra_len=MAX_EXTRA_LEN)),
    'beam': (
      f'beam-{beam_size}',
      inference.DecodeOptions(
        decoder='beam', beam_size=beam_size, alpha=alpha, max_extra_len=MAX_EXTRA_LEN
      ),
    ),
  }
  unknown = sorted(set(_DECODERS.value) - set(known))
  if unknown:
    raise errors.InvalidInput(f'--decoders={unknown}: each must be one of {sorted(known)}.')
  return dict(known[name] for name in _DECODERS.value)


# Parts of a beam step, by the source of each XLA operation (its `op_name`: the model's module
# path or the beam loop's named scopes); the first pattern found names the part.
PARTS = (
  ('cache writes', ('_update_cache',)),
  ('output projection', ('.attend/', '/logits/')),
  ('choose: log-softmax sums, top-k', ('/choose/',)),
  ('finished set', ('/finished/',)),
  ('cache reorder', ('/reorder/',)),
  ('decoder layers', ('/decoder/',)),
  ('encoder and cache set-up (once a batch)', ('/encoder/', 'Transformer.encode')),
  ('rest of the loop (tokens, scores, stopping)', ('/while/',)),
)
# Events of the trace that hold others (the executable, the loop) or mark ends.
_CONTAINERS = re.compile(r'^(ThunkExecutor|while|end: |SlinkyThreadPool|call|conditional)')


def _op_names(hlo_text: str) -> dict[str, str]:
  """{instruction name: its op_name} of an optimized HLO module's text."""
  pattern = r'^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name="([^"]+)"'
  return {m.group(1): m.group(2) for m in re.finditer(pattern, hlo_text, re.M)}


def _part(name: str, op_names: dict[str, str]) -> str:
  op_name = op_names.get(name)
  if op_name is None:  # XLA's own operations (layout copies, dots split from an einsum).
    kind = re.sub(r'[.\d]+$', '', name)
    return f'unnamed {kind} (XLA-made)'
  for part, patterns in PARTS:
    if any(p in op_name for p in patterns):
      return part
  return 'other'


def profile(translate: inference.TwoPass, params, batches) -> None:
  """Prints where the first pass of beam search spends its time (see the module doc)."""
  key = jax.random.key(0)
  by_shape = collections.defaultdict(list)
  for b in batches:
    by_shape[b['src_tokens'].shape].append(b)
  seconds, wall = collections.Counter(), 0.0
  row_steps = done_row_steps = 0
  for _, group in sorted(by_shape.items()):
    # Compiled here, so that the operations traced are those whose names are read.
    compiled = translate.first_fn.lower(params, jnp.asarray(group[0]['src_tokens']), key).compile()
    op_names = _op_names(compiled.as_text())
    trace_dir = tempfile.mkdtemp(prefix='decode_profile_')
    with jax.profiler.trace(trace_dir):
      start = time.perf_counter()
      for b in group:
        decoded = compiled(params, jnp.asarray(b['src_tokens']), key)
        steps = np.asarray(decoded.steps)  # Waits for the decode; copies the steps out.
        np.asarray(decoded.tokens)
        rows_per_sentence = decoded.tokens.shape[1] if decoded.tokens.ndim == 3 else 1
        row_steps += steps.size * rows_per_sentence * int(steps.max())
        done_row_steps += rows_per_sentence * int((steps.max() - steps).sum())
      wall += time.perf_counter() - start
    [path] = glob.glob(os.path.join(trace_dir, '**', '*.xplane.pb'), recursive=True)
    for plane in jax.profiler.ProfileData.from_file(path).planes:
      for line in plane.lines:
        if not line.name.startswith('tf_XLA'):
          continue
        for event in line.events:
          if not _CONTAINERS.match(event.name):
            seconds[_part(event.name, op_names)] += event.duration_ns / 1e9
  total = sum(seconds.values())
  print(f'\nprofile: beam search, first pass, {len(batches)} batches, {wall:.2f} s wall')
  print(f'{"part":<46} {"s":>7} {"share":>6}')
  for part, value in seconds.most_common():
    print(f'{part:<46} {value:>7.2f} {value / total:>6.1%}')
  print(f'{"operations in all (both cores; may overlap)":<46} {total:>7.2f}')
  print(
    f'row-steps of sentences already done (and padding rows): {done_row_steps / row_steps:.1%} '
    f'of {row_steps:,}'
  )


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
    decoded = inference.decode_in_order(
      translate, params, batches, key, 'src_tokens', _CONCURRENCY.value
    )
    outputs = [tokens for _, tokens in decoded]
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

  results, profiled, chosen = {}, None, decoders()
  for name, options in chosen.items():
    translate = translation.decode.make_translate_fn(model_config, options)
    if _ONE_PASS.value and isinstance(translate, inference.TwoPass):
      # Its second pass alone: every step in one pass, the decoding before issue 14.
      one_pass = lambda params, src, key, full=translate.full_fn: full(params, src, key).tokens  # noqa: E731
      results[f'{name} one pass'] = measure(one_pass, params, batches)
    results[name] = measure(translate, params, batches)
    if isinstance(translate, inference.TwoPass):
      profiled = translate

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
  beam = [o for o in chosen.values() if o.decoder == 'beam']
  alpha = f'; beam alpha {beam[0].alpha}' if beam else ''
  print(
    f'options: output limit source length + {MAX_EXTRA_LEN}{alpha}; '
    f'{_CONCURRENCY.value} batch(es) at once'
  )
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
  if _PROFILE.value and profiled is not None:
    profile(profiled, params, batches)


if __name__ == '__main__':
  errors.run(main)
