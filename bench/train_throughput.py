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
    bfloat16 peak (`PEAK_BF16_FLOPS`, by device kind) and the measured one; on CPUs
    the measured matmul peak of the same devices in the config's dtype.
Compile time is measured separately and excluded from the rates. `--profile_dir`
writes a profiler trace of the timed steps (`tensorboard --logdir DIR`, Profile tab).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import config as config_lib  # noqa: E402
from transformer import (  # noqa: E402
  optim,
  sharding,
  summary,
  tasks,
  tokenizer,
  training,
)
from transformer.config import ModelConfig  # noqa: E402
from transformer.tasks import translation  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to measure.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed train steps (after one compile step).')
_PIPELINE_BATCHES = flags.DEFINE_integer('pipeline_batches', 50, 'Batches for the padding share.')
_BATCH_ROWS = flags.DEFINE_integer(
  'batch_rows',
  0,
  'With --batch_len: a fixed-length unpacked batch of this many rows instead '
  "of the pipeline's (0: the pipeline's batches).",
)
_BATCH_LEN = flags.DEFINE_integer('batch_len', 0, 'Real tokens per row of that batch.')
_PROFILE_DIR = flags.DEFINE_string('profile_dir', None, 'Write a trace of the timed steps here.')

# Published dense bfloat16 matmul peaks, FLOP/s per device, by `device_kind` prefix.
PEAK_BF16_FLOPS = {
  'NVIDIA H200': 989e12,
  'NVIDIA H100': 989e12,  # SXM; the PCIe card: 756e12.
  'NVIDIA A100': 312e12,
  'NVIDIA L4': 121e12,
  'NVIDIA A10G': 70e12,
  'TPU v6': 918e12,
  'TPU v5p': 459e12,
  'TPU v5 lite': 197e12,
  'TPU v5e': 197e12,
  'TPU v4': 275e12,
  'TPU v3': 123e12,
}


def published_peak_flops(device) -> float | None:
  """The device's published bfloat16 peak from PEAK_BF16_FLOPS; None on CPUs and unknowns."""
  if device.platform == 'cpu':
    return None
  for kind, peak in PEAK_BF16_FLOPS.items():
    if device.device_kind.startswith(kind):
      return peak
  return None


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
  task = tasks.get_task(config)
  fixed = _BATCH_ROWS.value > 0 or _BATCH_LEN.value > 0
  if fixed:
    if _BATCH_ROWS.value < 1 or _BATCH_LEN.value < 2:
      raise app.UsageError('--batch_rows >= 1 and --batch_len >= 2 go together.')
    if set(task.batch_keys) != set(translation.BATCH_KEYS):
      raise app.UsageError(
        '--batch_rows/--batch_len make translation batches; '
        f'{config.model.architecture!r} is a {task.name} model.'
      )
    batches = fixed_length_batches(_BATCH_ROWS.value, _BATCH_LEN.value, config.vocab_size)
  else:
    vocab = tokenizer.get_tokenizer(config)
    train_iter = task.train_iterator(config, vocab)
    # Padding share over the pipeline's own batches.
    start = time.perf_counter()
    batches = [next(train_iter) for _ in range(_PIPELINE_BATCHES.value)]
    pipeline_seconds = time.perf_counter() - start
  real = sum(int((b['tgt_tokens'] != 0).sum()) for b in batches)
  slots = sum(b['tgt_tokens'].size for b in batches)

  mesh = sharding.create_mesh(config.mesh)
  rules = sharding.axis_rules(config.mesh)
  model, _ = training.create_models(ModelConfig.from_config(config))
  optimizer = optim.create_optimizer(config)
  _, state_shardings = training.abstract_state_and_shardings(model, optimizer, task, mesh, rules)
  state = training.create_train_state(
    model, optimizer, task, state_shardings, mesh, jax.random.key(0)
  )
  step_fn = jax.jit(
    lambda s, b: training.train_step(
      s, b, model=model, optimizer=optimizer, task=task, config=config
    ),
    in_shardings=(state_shardings, sharding.batch_sharding(mesh, rules)),
    donate_argnums=(0,),
  )

  with sharding.activated(mesh, rules):
    start = time.perf_counter()
    state, sums = step_fn(state, sharding.global_batch(batches[0], mesh, rules))
    jax.block_until_ready(sums)
    compile_seconds = time.perf_counter() - start

    if _PROFILE_DIR.value:
      jax.profiler.start_trace(_PROFILE_DIR.value)
    tokens = 0.0
    step_seconds = []
    for i in range(_STEPS.value):
      start = time.perf_counter()
      batch = sharding.global_batch(batches[(i + 1) % len(batches)], mesh, rules)
      state, sums = step_fn(state, batch)
      tokens += float(sums['num_tokens'])  # Waits for the step.
      step_seconds.append(time.perf_counter() - start)
    if _PROFILE_DIR.value:
      jax.profiler.stop_trace()
  elapsed = sum(step_seconds)

  device = jax.devices()[0]
  dtype = ModelConfig.from_config(config).dtype
  measured_peak = matmul_peak_flops(dtype=dtype) * jax.device_count()
  published = published_peak_flops(device)
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
  if _PROFILE_DIR.value:
    print(f'trace: {_PROFILE_DIR.value} (tensorboard --logdir {_PROFILE_DIR.value})')


if __name__ == '__main__':
  app.run(main)
