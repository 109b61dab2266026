"""`train.py --dry_run`: validate a config and describe its model without training anything."""

import jax
import ml_collections

from transformer import config as config_lib
from transformer import summary, training
from transformer.config import ModelConfig


def run(config: ml_collections.ConfigDict, num_devices: int | None = None) -> int:
  """Prints the parameter table, FLOPs per token and a last line `params: N`; returns N."""
  config_lib.validate(config, jax.device_count() if num_devices is None else num_devices)
  model_config = ModelConfig.from_config(config)
  model, _ = training.create_models(model_config)
  params = summary.abstract_params(model)
  rows, total = summary.parameter_table(params)
  print(summary.format_table(rows, total))
  flops = summary.flops_per_token(model_config, config.data.max_len)
  print(
    f'model FLOPs per target token at length {config.data.max_len}: '
    f'forward {flops["forward"] / 1e6:,.1f}M, training step {flops["train"] / 1e6:,.1f}M'
  )
  millions = f'{total / 1e6:.1f}M' if total >= 1e6 else f'{total / 1e6:.3f}M'
  print(f'params: {millions} ({total})')
  return total
