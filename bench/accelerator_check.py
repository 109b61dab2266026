"""One command for a GPU or TPU machine: the paper's base and big models, measured in minutes.

  python bench/accelerator_check.py --out=accelerator_check.json     # on the accelerator
  python bench/accelerator_check.py --smoke --out=/tmp/smoke.json     # CPU smoke test (CI)

Writes a made-up parallel corpus (40,000-word lexicons, enough for the configs' 37,000
SentencePiece pieces) and prepares it the project's way (TFDS builder, vocabulary, ids),
then, for configs/wmt14_ende_base.py and configs/wmt14_ende_big.py in bfloat16 with
`attention_impl='auto'` (cuDNN's fused attention on GPUs, Pallas splash attention on TPUs) and
data parallelism over every device, each in its own process:

  1. trains `--train_steps` steps with `training.train_and_evaluate`, the real loop: Grain
     packing in `--num_workers` processes, batches placed ahead, validation, a checkpoint;
  2. restores the checkpoint and decodes the test split twice with eval.py's beam search
     (beam 4, alpha 0.6; the second pass is compiled);
  3. (the first config) compares the fused attention with XLA's on one batch (loss and
     gradients) and says whether the fused kernel (cuDNN's; on TPUs, Pallas') is in the
     compiled step.

Reports target tokens/s (median of the log windows after the first, which compiles),
MFU (model FLOPs of `summary.flops_per_token` against the published bfloat16 peak),
peak device memory beside `train.py --dry_run`'s estimate, the time waiting for input
per step, beam-4 sentences/s, in one JSON (`--out`) and one table. Expected to take 5-8
minutes on one H200 (not yet measured: docs/devices.md), less with the corpus prepared
ahead on any machine (`--prepare_only --root=DIR`, then `--root=DIR` on the accelerator).
`--smoke` shrinks everything (configs/tiny.py's model, a small corpus, a few steps) so
that the same code runs on a CPU in CI.
"""

import bisect
import datetime
import gzip
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# First: on a CPU-only host it keeps JAX from loading libtpu and the CUDA plugin
# (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags, logging  # noqa: E402

from configs import tiny, wmt14_ende_base, wmt14_ende_big  # noqa: E402
from transformer import (  # noqa: E402
  datasets,
  errors,
  evaluation,
  inference,
  losses,
  memory,
  outputs,
  path_checks,
  summary,
  tokenizer,
  training,
)
from transformer.config import ModelConfig  # noqa: E402
from transformer.model import Transformer  # noqa: E402
from transformer.tasks import translation  # noqa: E402

_OUT = flags.DEFINE_string('out', 'accelerator_check.json', 'Where to write the JSON report.')
_ROOT = flags.DEFINE_string(
  'root', None, 'Folder for the corpus, prepared data and runs (default: a new temporary one).'
)
_SMOKE = flags.DEFINE_bool('smoke', False, "Tiny model, corpus and runs: the CPU's smoke test.")
_TRAIN_STEPS = flags.DEFINE_integer('train_steps', 30, 'Train steps per config.', lower_bound=3)
_NUM_WORKERS = flags.DEFINE_integer(
  'num_workers', 4, 'Grain worker processes packing batches (config.data.num_workers).'
)
_CONFIGS = flags.DEFINE_list('configs', ['base', 'big'], 'Which configs to run.')
_TOKENS_PER_BATCH = flags.DEFINE_integer(
  'tokens_per_batch',
  0,
  "Tokens per batch a side (config.data.tokens_per_batch), e.g. less for a smaller device's "
  "memory; 0: the config's (24,576).",
  lower_bound=0,
)
_TIMEOUT = flags.DEFINE_integer('timeout', 420, 'Seconds each config may take.')
_PREPARE_ONLY = flags.DEFINE_bool(
  'prepare_only',
  False,
  'Write and prepare the corpus under --root, then stop: on any machine, ahead of the '
  "accelerator's time (then pass the same --root there).",
)
_RUN = flags.DEFINE_string('run', None, 'Internal: run this one config in this process.')
_CHECK_ATTENTION = flags.DEFINE_bool(
  'check_attention', True, 'Internal: compare the fused attention with XLA (the first config).'
)

CONFIGS = {'base': wmt14_ende_base, 'big': wmt14_ende_big}
BEAM = inference.DecodeOptions()  # The paper's: beam 4, alpha 0.6.
# Corpus: training, validation and test pairs, lexicon words per language, words per sentence
# (test sentences: one decoding width, so that beam search compiles for one shape).
CORPUS = {
  'full': (50_000, 128, 128, 40_000, (5, 30), (10, 13)),
  'smoke': (600, 32, 16, 400, (3, 4), (3, 4)),
}
_SYLLABLES = [c + v for c in 'bcdfghjklmnprstvwz' for v in 'aeiou']


def write_corpus(directory: Path, smoke: bool) -> None:
  """`{train,val,test}.{en,de}.gz`: made-up sentences, de a word-by-word mapping of en.

  Words are Zipf-distributed over lexicons of 1-4 syllables.
  """
  train, val, test, words, lengths, test_lengths = CORPUS['smoke' if smoke else 'full']
  rng = random.Random(0)
  lexicon = set()
  while len(lexicon) < 2 * words:
    lexicon.add(''.join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
  lexicon = sorted(lexicon)
  rng.shuffle(lexicon)
  en, de = lexicon[:words], [w.capitalize() for w in lexicon[words:]]
  cumulative = list(np.cumsum([1 / (rank + 1) for rank in range(words)]))
  directory.mkdir(parents=True, exist_ok=True)
  for split, count in (('train', train), ('val', val), ('test', test)):
    lines = {'en': [], 'de': []}
    shortest, longest = test_lengths if split == 'test' else lengths
    for _ in range(count):
      length = rng.randint(shortest, longest)
      ids = [bisect.bisect(cumulative, rng.random() * cumulative[-1]) for _ in range(length)]
      lines['en'].append(' '.join(en[i] for i in ids).capitalize() + '.')
      lines['de'].append(' '.join(de[i] for i in ids) + '.')
    for lang, text in lines.items():
      with gzip.open(directory / f'{split}.{lang}.gz', 'wt', encoding='utf-8') as f:
        f.write('\n'.join(text) + '\n')


def check_config(name: str, root: Path, smoke: bool) -> ml_collections.ConfigDict:
  """`name`'s config in bfloat16 on the made-up corpus, sized for a few dozen steps."""
  config = CONFIGS[name].get_config()
  if smoke:
    tiny.shrink(config)
    config.vocab_size = 256
  steps = _TRAIN_STEPS.value
  config.dtype = 'bfloat16'
  config.num_train_steps = steps
  config.log_every_steps = max(1, steps // 3)
  config.eval_every_steps = config.checkpoint_every_steps = steps
  config.keep_checkpoints = 1
  config.eval_bleu_sentences = 0
  config.data.dataset = 'parallel_text'
  config.data.manual_dir = str(root / 'corpus')
  config.data.data_dir = str(root / 'data')
  config.data.eval_split, config.data.test_split = 'validation', 'test'
  config.data.spm_train_sentences = 2 * CORPUS['smoke' if smoke else 'full'][0]
  config.data.num_workers = 0 if smoke else _NUM_WORKERS.value
  config.data.tokens_per_batch = _TOKENS_PER_BATCH.value or config.data.tokens_per_batch
  return config


def _mean_after_first(rows: list[dict], key: str) -> float | None:
  values = [r[key] for r in rows if key in r][1:]
  return statistics.median(values) if values else None


def fused_attention_check(config: ml_collections.ConfigDict, params, batch) -> dict:
  """Loss and gradients of one batch with attention_impl 'auto' (cuDNN on GPUs, Pallas on
  TPUs) and 'xla'."""
  results = {}
  for impl in ('auto', 'xla'):
    model_config = ModelConfig.from_config(config).replace(attention_impl=impl, deterministic=True)
    model = Transformer(model_config)
    inputs = translation.Translation.model_inputs(batch)

    def loss(params, model=model, inputs=inputs):
      logits = model.apply({'params': params}, **inputs)
      return losses.loss_and_metrics(logits, batch['tgt_tokens'], config.label_smoothing)[0]

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    value, grads = compiled(params)
    text = compiled.as_text()  # cuDNN's fused attention, or a Mosaic kernel (Pallas) on TPUs.
    results[impl] = (float(value), grads, '__cudnn$fmha' in text or 'tpu_custom_call' in text)
  (loss_auto, grads_auto, fused), (loss_xla, grads_xla, _) = results['auto'], results['xla']
  difference = optax.tree.norm(jax.tree.map(jnp.subtract, grads_auto, grads_xla))
  return {
    'fused_kernel_in_step': fused,
    'loss_auto': loss_auto,
    'loss_xla': loss_xla,
    'grad_relative_difference': float(difference / optax.tree.norm(grads_xla)),
  }


def run_one(name: str, root: Path, smoke: bool) -> dict:
  """Trains, decodes and checks one config in this process; returns its figures."""
  config = check_config(name, root, smoke)
  workdir = root / 'runs' / name
  device = jax.devices()[0]
  start = time.perf_counter()
  training.train_and_evaluate(config, str(workdir))
  train_seconds = time.perf_counter() - start
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  train_rows = [r for r in rows if 'train_loss' in r]
  tokens_per_sec = _mean_after_first(train_rows, 'tokens_per_sec')
  steps_per_sec = _mean_after_first(train_rows, 'steps_per_sec')
  input_wait_ms = _mean_after_first(train_rows, 'input_wait_ms')
  model_config = ModelConfig.from_config(config)
  flops = summary.flops_per_token(model_config, config.data.max_len)['train']
  peak = summary.published_peak_flops(device)
  estimate = memory.step_memory(config, jax.device_count())

  run = evaluation.setup(evaluation.load_run_config(str(workdir)))
  params, _ = evaluation.restore_params(run, str(workdir), 'latest')
  vocab = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
  translate_fn = translation.decode.make_translate_fn(run.model_config, BEAM, run.mesh, run.rules)
  decode = {}
  for label in ('with_compiles', 'compiled'):
    _, results, _ = translation.evaluate.evaluate_split(
      config, params, translate_fn, split='test', batch_size=128, tokenizer=vocab, n_bootstrap=1
    )
    decode[label] = results['sentences_per_sec']
  bleu = results['bleu']

  fused = {}
  if _CHECK_ATTENTION.value:
    one_process = config.copy_and_resolve_references()
    one_process.data.num_workers = 0
    batch = next(translation.data.train_iterator(one_process.data, vocab, seed=one_process.seed))
    batch = {k: jnp.asarray(v[:16]) for k, v in batch.items()}
    fused = fused_attention_check(config, jax.device_put(params, device), batch)

  stats = device.memory_stats() or {}
  return {
    'devices': f'{jax.device_count()} x {device.device_kind} ({device.platform})',
    'jax': jax.__version__,
    'config': f'configs/wmt14_ende_{name}.py' + (' (shrunk: --smoke)' if smoke else ''),
    'parameters': sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
    'dtype': config.dtype,
    'train_steps': config.num_train_steps,
    'rows_x_length_per_step': [
      config.data.tokens_per_batch // config.data.max_len,
      config.data.max_len,
    ],
    'train_seconds_with_compiles': train_seconds,
    'steps_per_sec': steps_per_sec,
    'target_tokens_per_sec': tokens_per_sec,
    'model_flops_per_target_token': flops,
    'mfu': tokens_per_sec * flops / (peak * jax.device_count()) if peak else None,
    'input_wait_ms_per_step': input_wait_ms,
    'input_wait_share': input_wait_ms / 1e3 * steps_per_sec,
    'peak_memory_gib': stats['peak_bytes_in_use'] / memory.GIB if stats else None,  # CPU: none.
    'dry_run_memory_estimate_gib': estimate.total / memory.GIB,
    'beam4_sentences_per_sec': decode['compiled'],
    'beam4_sentences_per_sec_with_compiles': decode['with_compiles'],
    'test_bleu_after_these_steps': bleu,
    **fused,
  }


def _table(report: dict) -> str:
  columns = (
    ('target tok/s', 'target_tokens_per_sec', '{:,.0f}'),
    ('MFU', 'mfu', '{:.1%}'),
    ('peak mem GiB', 'peak_memory_gib', '{:.1f}'),
    ('dry-run GiB', 'dry_run_memory_estimate_gib', '{:.1f}'),
    ('input wait ms', 'input_wait_ms_per_step', '{:.1f}'),
    ('beam-4 sent/s', 'beam4_sentences_per_sec', '{:.1f}'),
    ('fused attn', 'fused_kernel_in_step', '{}'),
  )
  lines = [
    ' | '.join(['config', *(c[0] for c in columns)]),
    ' | '.join(['---'] * (len(columns) + 1)),
  ]
  for name, result in report['configs'].items():
    if 'error' in result:
      lines.append(f'{name} | error: {result["error"][-200:]}')
      continue
    cells = ['-' if result.get(key) is None else fmt.format(result[key]) for _, key, fmt in columns]
    lines.append(' | '.join([name, *cells]))
  return '\n'.join(lines)


def main(argv):
  del argv
  smoke = _SMOKE.value
  if not _RUN.value:  # The flags checked before anything is made (the temporary --root).
    if not _CONFIGS.value:
      raise errors.InvalidInput(f'--configs is empty: name one or more of {sorted(CONFIGS)}.')
    unknown = sorted(set(_CONFIGS.value) - set(CONFIGS))
    if unknown:
      raise errors.InvalidInput(f'--configs: {unknown} are not among {sorted(CONFIGS)}.')
    if len(set(_CONFIGS.value)) < len(_CONFIGS.value):
      raise errors.InvalidInput(f'--configs={",".join(_CONFIGS.value)} names a config twice.')
    problems = [] if _PREPARE_ONLY.value else path_checks.output_errors(_OUT.value, '--out')
    if _ROOT.value:
      problems += path_checks.output_dir_errors(_ROOT.value, '--root')
    if problems:
      raise errors.InvalidInput(problems[0])  # Before minutes of paid accelerator time, not after.
  root = Path(_ROOT.value or tempfile.mkdtemp(prefix='accelerator_check_'))
  # Compiles are cached: a second run of the command on the same machine starts faster.
  jax.config.update('jax_compilation_cache_dir', str(root / 'jax_cache'))
  if _RUN.value:
    result = run_one(_RUN.value, root, smoke)
    (root / f'{_RUN.value}.json').write_text(json.dumps(result))
    return
  start = time.perf_counter()
  if not (root / 'corpus' / 'train.en.gz').exists():
    write_corpus(root / 'corpus', smoke)
  config = check_config(_CONFIGS.value[0], root, smoke)
  datasets.prepare(config.data)
  translation.data.prepare_ids(
    config.data,
    tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed),
  )  # Shared by every config.
  prepare_seconds = time.perf_counter() - start
  if _PREPARE_ONLY.value:
    print(f'Prepared {root} in {prepare_seconds:.0f} s; now pass --root={root}.')
    return
  # This process never touches a device: JAX would take 75% of a GPU's memory from the runs.
  report = {
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'devices': None,
    'jax': jax.__version__,
    'smoke': smoke,
    'corpus_and_preparation_seconds': prepare_seconds,
    'configs': {},
  }
  for i, name in enumerate(_CONFIGS.value):
    command = [sys.executable, __file__, f'--run={name}', f'--root={root}']
    command += [f'--train_steps={_TRAIN_STEPS.value}', f'--num_workers={_NUM_WORKERS.value}']
    command += [f'--tokens_per_batch={_TOKENS_PER_BATCH.value}']
    command += ['--smoke'] if smoke else []
    command += [] if i == 0 else ['--nocheck_attention']  # The same attention code in all.
    logging.info('Running %s: %s', name, ' '.join(command))
    started = time.perf_counter()
    try:
      done = subprocess.run(
        command, capture_output=True, text=True, timeout=_TIMEOUT.value, check=False
      )
      failure = None if done.returncode == 0 else done.stderr[-3000:]
    except subprocess.TimeoutExpired:
      failure = f'did not finish within --timeout={_TIMEOUT.value} s'
    result_path = root / f'{name}.json'
    if failure is None and result_path.exists():
      result = json.loads(result_path.read_text())
    else:
      result = {'error': failure or 'no result written'}
    result['seconds'] = time.perf_counter() - started
    report['devices'] = result.pop('devices', report['devices'])
    report['configs'][name] = result
  report['total_seconds'] = time.perf_counter() - start
  print(f'{report["devices"]}, jax {report["jax"]}, {report["total_seconds"]:.0f} s in all')
  print(_table(report))
  outputs.write(_OUT.value, json.dumps(report, indent=2) + '\n', '--out')
  print(f'JSON: {_OUT.value}')
  if any('error' in r for r in report['configs'].values()):
    sys.exit(1)


if __name__ == '__main__':
  errors.run(main)
