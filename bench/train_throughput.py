"""Train-step throughput of a config, measured against this machine's matmul peak.

  python bench/train_throughput.py --config=configs/default.py \
      --config.data.manual_dir=../shared/data/multi30k [--steps=20]

Any model dimension is a config override, and `--batch_rows`/`--batch_len` replace
the pipeline's batches by a fixed-length unpacked batch (every row one example of
that many real tokens, random ids; no data needed), e.g. the shape the peers were
compared at (issue 14):

  python bench/train_throughput.py --config=configs/default.py --config.vocab_size=8000 \
      --config.model.d_model=256 --config.model.num_layers=3 --config.model.num_heads=4 \
      --config.model.d_ff=1024 --batch_rows=128 --batch_len=32

Reports, from one run on one machine (figures are only comparable side by side):
  * target tokens per second of the jitted train step (real tokens, padding excluded; for a
    language-model config, e.g. configs/lm_default.py, every token is a target token);
  * the share of real (non-padding) tokens in the batches the input pipeline produces;
  * model FLOPs per second (matmul FLOPs of `transformer.summary.flops_per_token`)
    as a fraction of the matmul peak: on GPUs and TPUs the device's published dense
    bfloat16 peak (`summary.PEAK_BF16_FLOPS`, by device kind) and the measured one; on CPUs
    the measured matmul peak of the same devices in the config's dtype.
Compile time is measured separately and excluded from the rates. `--profile_dir`
writes a profiler trace of the timed steps (`tensorboard --logdir DIR`, Profile tab).
`--breakdown` also reads that trace back: the time of the step's compiled ops (XLA
thunks) by what they compute (matrix products, dropout, normalisation, attention's
softmax and transposes, ...; each op attributed through its HLO `op_name`), and the
share of the measured peak the step would reach if everything but its matrix
products took no time.
"""

import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# First: on a CPU-only host it keeps JAX from loading libtpu and the CUDA plugin
# (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer import (  # noqa: E402
  errors,
  optim,
  path_checks,
  sharding,
  summary,
  tasks,
  tokenizer,
  train_steps,
)
from transformer.config import ModelConfig  # noqa: E402
from transformer.tasks import translation  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to measure.')
_STEPS = flags.DEFINE_integer(
  'steps', 20, 'Timed train steps (after one compile step).', lower_bound=1
)
_PIPELINE_BATCHES = flags.DEFINE_integer('pipeline_batches', 50, 'Batches for the padding share.')
_BATCH_ROWS = flags.DEFINE_integer(
  'batch_rows',
  0,
  'With --batch_len: a fixed-length unpacked batch of this many rows instead '
  "of the pipeline's (0: the pipeline's batches).",
)
_BATCH_LEN = flags.DEFINE_integer('batch_len', 0, 'Real tokens per row of that batch.')
_PROFILE_DIR = flags.DEFINE_string('profile_dir', None, 'Write a trace of the timed steps here.')
_BREAKDOWN = flags.DEFINE_bool(
  'breakdown', False, "Trace the timed steps and print their ops' time by category."
)

# What a non-matmul op computes, from its HLO op_name (first match wins).
_CATEGORIES = (
  ('dropout', ('Dropout', 'bernoulli', 'dropout')),
  ('normalisation', ('norm',)),
  ('attention: softmax, masks, transposes', ('attention',)),
  ('feed-forward: activation, bias', ('ffn',)),
  ('optimizer update', ('scale_by', 'adam', 'optax', 'apply_updates')),
  ('embeddings, positions, residual sums', ('Transformer',)),
)


def _hlo_ops(hlo_text: str) -> dict[str, tuple[bool, str]]:
  """{instruction name: (is a matrix product, op_name)} of a compiled HLO module.

  An instruction is a matrix product when it is a `dot` or a fusion (or call) whose
  computation holds one: XLA:CPU's library matmuls run as such fusions.
  """
  computations: dict[str, str] = {}
  for match in re.finditer(r'^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}', hlo_text, re.M | re.S):
    computations[match.group(1)] = match.group(2)
  ops = {}
  line_re = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = [^ ]+ (\w[\w-]*)\(')
  for line in hlo_text.splitlines():
    match = line_re.match(line)
    if not match:
      continue
    name, opcode = match.groups()
    called = re.search(r'calls=%([\w.\-]+)', line)
    is_dot = opcode == 'dot' or bool(
      called and re.search(r' dot\(', computations.get(called.group(1), ''))
    )
    op_name = re.search(r'op_name="([^"]*)"', line)
    ops.setdefault(name, (is_dot, op_name.group(1) if op_name else ''))
  return ops


def breakdown(trace_dir: str, hlo_text: str, steps: int) -> dict[str, float]:
  """Seconds per step of the traced ops, by category ('matmul: ...' for products)."""
  traces = sorted(glob.glob(f'{trace_dir}/plugins/profile/*/perfetto_trace.json.gz'))
  with gzip.open(traces[-1]) as f:
    events = json.load(f)['traceEvents']
  ops = _hlo_ops(hlo_text)
  seconds: collections.Counter[str] = collections.Counter()
  for event in events:
    name = event.get('args', {}).get('hlo_op')
    if event.get('ph') != 'X' or name is None:
      continue
    is_dot, op_name = ops.get(name, (False, ''))
    if is_dot:
      kind = 'attention' if re.search(r'attention/[^/]*,', op_name) else 'projections, FFN, logits'
      category = f'matmul: {kind}'
    elif not op_name:
      category = 'ops without an op_name (layout copies XLA added, ...)'
    else:
      category = next(
        (label for label, keys in _CATEGORIES if any(k in op_name for k in keys)),
        'loss, gradients, metrics, other',
      )
    seconds[category] += event['dur'] * 1e-6 / steps
  return dict(seconds)


def fixed_length_batches(rows: int, length: int, vocab_size: int, count: int = 4):
  """Unpacked batches: each row one example of `length` real tokens (random ids >= 3)."""
  rng = np.random.default_rng(0)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy()
  ones = np.ones((rows, length), np.int32)
  batches = []
  for _ in range(count):
    src, tgt = rng.integers(3, vocab_size, size=(2, rows, length), dtype=np.int32)
    tgt_input = np.concatenate([np.ones((rows, 1), np.int32), tgt[:, :-1]], axis=1)  # BOS 1.
    batches.append(
      {
        'src_tokens': src,
        'src_segments': ones,
        'src_positions': positions,
        'tgt_tokens': tgt,
        'tgt_input_tokens': tgt_input,
        'tgt_segments': ones,
        'tgt_positions': positions,
      }
    )
  return batches


def matmul_peak_flops(size: int = 2048, repeats: int = 10, dtype=jnp.float32) -> float:
  """Measured matmul FLOP/s of a square matmul in `dtype` (the machine's practical peak)."""
  a = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    out = matmul(a)
  out.block_until_ready()
  return 2 * size**3 * repeats / (time.perf_counter() - start)


def main(argv):
  del argv
  config = _CONFIG.value
  config_lib.validate(config, jax.device_count())
  if _PROFILE_DIR.value and (
    problems := path_checks.output_dir_errors(_PROFILE_DIR.value, '--profile_dir')
  ):
    raise app.UsageError(problems[0])
  task = tasks.get_task(config.model.architecture)
  fixed = _BATCH_ROWS.value > 0 or _BATCH_LEN.value > 0
  if fixed:
    if _BATCH_ROWS.value < 1 or _BATCH_LEN.value < 2:
      raise app.UsageError('--batch_rows >= 1 and --batch_len >= 2 go together.')
    if set(task.batch_keys) != set(translation.data.BATCH_KEYS):
      raise app.UsageError(
        '--batch_rows/--batch_len make translation batches; '
        f'{config.model.architecture!r} is a {task.name} model.'
      )
    batches = fixed_length_batches(_BATCH_ROWS.value, _BATCH_LEN.value, config.vocab_size)
  else:
    vocab = tokenizer.get_tokenizer(config.data, vocab_size=config.vocab_size, seed=config.seed)
    train_iter = task.train_iterator(config.data, vocab, seed=config.seed)
    # Padding share over the pipeline's own batches.
    start = time.perf_counter()
    batches = [next(train_iter) for _ in range(_PIPELINE_BATCHES.value)]
    pipeline_seconds = time.perf_counter() - start
  real = sum(int((b['tgt_tokens'] != 0).sum()) for b in batches)
  slots = sum(b['tgt_tokens'].size for b in batches)

  mesh = sharding.create_mesh(config.mesh)
  rules = sharding.axis_rules(config.mesh)
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  optimizer = optim.create_optimizer(optim.OptimizerConfig.from_config(config))
  _, state_shardings = train_steps.abstract_state_and_shardings(model, optimizer, task, mesh, rules)
  state = train_steps.create_train_state(
    model, optimizer, task, state_shardings, mesh, jax.random.key(0)
  )
  step_fn = train_steps.jit_train_step(
    train_steps.StepConfig.from_config(config),
    model=model,
    optimizer=optimizer,
    task=task,
    state_shardings=state_shardings,
    mesh=mesh,
    rules=rules,
  )

  with sharding.activated(mesh, rules):
    start = time.perf_counter()
    state, sums = step_fn(state, sharding.global_batch(batches[0], mesh, rules))
    jax.block_until_ready(sums)
    compile_seconds = time.perf_counter() - start

    trace_dir = _PROFILE_DIR.value
    if _BREAKDOWN.value and not trace_dir:
      trace_dir = tempfile.mkdtemp(prefix='train_throughput_trace_')
    if trace_dir:
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=_BREAKDOWN.value)
    tokens = 0.0
    step_seconds = []
    for i in range(_STEPS.value):
      start = time.perf_counter()
      batch = sharding.global_batch(batches[(i + 1) % len(batches)], mesh, rules)
      state, sums = step_fn(state, batch)
      tokens += float(sums['num_tokens'])  # Waits for the step.
      step_seconds.append(time.perf_counter() - start)
    if trace_dir:
      jax.profiler.stop_trace()
    if _BREAKDOWN.value:
      hlo_text = step_fn.lower(state, batch).compile().as_text()
  elapsed = sum(step_seconds)

  device = jax.devices()[0]
  dtype = ModelConfig.from_config(config).dtype
  measured_peak = matmul_peak_flops(dtype=dtype) * jax.device_count()
  published = summary.published_peak_flops(device)
  length = _BATCH_LEN.value if fixed else config.data.max_len
  flops = summary.flops_per_token(ModelConfig.from_config(config), length)['train']
  tokens_per_sec = tokens / elapsed
  model_flops = flops * tokens_per_sec
  print(
    f'devices: {jax.device_count()} x {device.device_kind} ({device.platform}); '
    f'dtype {config.dtype}'
  )
  print(f'compile (first step): {compile_seconds:.1f} s')
  print(
    f'train steps/s: {_STEPS.value / elapsed:.2f} (median step {np.median(step_seconds):.3f} s)'
  )
  print(f'target tokens/s: {tokens_per_sec:,.0f}')
  if fixed:
    print(f'batch: fixed length, {_BATCH_ROWS.value} rows x {_BATCH_LEN.value} tokens, unpacked')
  else:
    print(
      f'real-token share of batches: {real / slots:.3f} '
      f'({_PIPELINE_BATCHES.value} batches, {pipeline_seconds / len(batches) * 1e3:.1f} '
      f'ms per batch to produce)'
    )
  print(f'matmul peak ({jnp.dtype(dtype).name}, measured): {measured_peak / 1e9:,.1f} GFLOP/s')
  print(
    f'model FLOPs/s: {model_flops / 1e9:,.1f} GFLOP/s '
    f'= {model_flops / measured_peak:.1%} of the measured peak'
  )
  if published:
    total = published * jax.device_count()
    print(
      f'MFU: {model_flops / total:.1%} of the published bfloat16 peak ({total / 1e12:,.0f} TFLOP/s)'
    )
  if _BREAKDOWN.value:
    seconds = breakdown(trace_dir, hlo_text, _STEPS.value)
    total = sum(seconds.values())
    print(f'ops of one step ({total:.3f} s summed over the ops; they may overlap):')
    for category, value in sorted(seconds.items(), key=lambda item: -item[1]):
      print(f'  {value / total:6.1%} {value * 1e3:8.1f} ms  {category}')
    matmul = sum(v for k, v in seconds.items() if k.startswith('matmul'))
    flops_per_step = model_flops * elapsed / _STEPS.value
    print(
      f'matrix products alone: {flops_per_step / matmul / 1e9:,.1f} GFLOP/s = '
      f'{flops_per_step / matmul / measured_peak:.1%} of the measured peak (the step, '
      'if nothing else took time)'
    )
  if trace_dir:
    print(f'trace: {trace_dir} (tensorboard --logdir {trace_dir})')


if __name__ == '__main__':
  errors.run(main)
