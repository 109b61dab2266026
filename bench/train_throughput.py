"""Train-step throughput of a config, measured against this machine's matmul peak.

  python bench/train_throughput.py --config=configs/default.py \
      --config.data.manual_dir=../shared/data/multi30k [--steps=20]

Reports, from one run on one machine (figures are only comparable side by side):
  * target tokens per second of the jitted train step (real tokens, padding excluded; for a
    language-model config, e.g. configs/lm_default.py, every token is a target token);
  * the share of real (non-padding) tokens in the batches the input pipeline produces;
  * model FLOPs per second (matmul FLOPs of `transformer.summary.flops_per_token`)
    as a fraction of the measured float32 matmul peak of the same devices.
Compile time is measured separately and excluded from the rates.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import (  # noqa: E402
  optim,
  sharding,
  summary,
  tokenizer,
  training,
)
from transformer.model import ModelConfig  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to measure.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed train steps (after one compile step).')
_PIPELINE_BATCHES = flags.DEFINE_integer('pipeline_batches', 50, 'Batches for the padding share.')


def matmul_peak_flops(size: int = 2048, repeats: int = 10) -> float:
  """Measured float32 matmul FLOP/s of a square matmul (the machine's practical peak)."""
  a = jnp.ones((size, size), jnp.float32)
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
  training.validate_config(config)
  vocab = tokenizer.get_tokenizer(config)
  train_iter = training.data_pipeline(config).train_iterator(config, vocab)

  # Padding share over the pipeline's own batches.
  start = time.perf_counter()
  batches = [next(train_iter) for _ in range(_PIPELINE_BATCHES.value)]
  pipeline_seconds = time.perf_counter() - start
  real = sum(int((b['tgt_tokens'] != 0).sum()) for b in batches)
  slots = sum(b['tgt_tokens'].size for b in batches)

  mesh = sharding.create_mesh(config.mesh)
  rules = sharding.axis_rules(config.mesh)
  model, _ = training.create_models(config)
  optimizer = optim.create_optimizer(config)
  _, state_shardings = training.abstract_state_and_shardings(config, model, optimizer, mesh)
  state = training.create_train_state(config, model, optimizer, mesh, jax.random.key(0))
  step_fn = jax.jit(
    lambda s, b: training.train_step(s, b, model=model, optimizer=optimizer, config=config),
    in_shardings=(state_shardings, sharding.batch_sharding(mesh, rules)), donate_argnums=(0,))

  with sharding.activated(mesh, rules):
    start = time.perf_counter()
    state, sums = step_fn(state, sharding.global_batch(batches[0], mesh, rules))
    jax.block_until_ready(sums)
    compile_seconds = time.perf_counter() - start

    tokens = 0.0
    start = time.perf_counter()
    for i in range(_STEPS.value):
      batch = sharding.global_batch(batches[(i + 1) % len(batches)], mesh, rules)
      state, sums = step_fn(state, batch)
      tokens += float(sums['num_tokens'])
    elapsed = time.perf_counter() - start

  peak = matmul_peak_flops() * jax.device_count()
  flops = summary.flops_per_token(ModelConfig.from_config(config), config.data.max_len)['train']
  tokens_per_sec = tokens / elapsed
  print(f'devices: {jax.device_count()} x {jax.devices()[0].device_kind}')
  print(f'compile (first step): {compile_seconds:.1f} s')
  print(f'train steps/s: {_STEPS.value / elapsed:.2f}')
  print(f'target tokens/s: {tokens_per_sec:,.0f}')
  print(f'real-token share of batches: {real / slots:.3f} '
        f'({_PIPELINE_BATCHES.value} batches, {pipeline_seconds / len(batches) * 1e3:.1f} '
        f'ms per batch to produce)')
  print(f'matmul peak (float32, measured): {peak / 1e9:,.1f} GFLOP/s')
  print(f'model FLOPs/s: {flops * tokens_per_sec / 1e9:,.1f} GFLOP/s '
        f'= {flops * tokens_per_sec / peak:.1%} of peak')


if __name__ == '__main__':
  app.run(main)
