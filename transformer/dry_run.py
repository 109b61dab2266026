"""`train.py --dry_run`: validate a config and describe its model without training anything."""

from collections.abc import Collection

import jax
import ml_collections

from transformer import config as config_lib
from transformer import (
  config_rules,
  initialization,
  memory,
  summary,
  tpu_compile,
  tpu_topology,
  train_steps,
)
from transformer.config import ModelConfig


def run(
  config: ml_collections.ConfigDict,
  num_devices: int | None = None,
  overridden: Collection[str] = (),
  topology: str | None = None,
) -> int:
  """Prints the parameter table, FLOPs per token, the train step's memory per device (with
  the mesh over `num_devices`, default this host's devices; `transformer/memory.py`) and a
  last line `params: N`; returns N. With `config.init_from`, first checks that source
  against the config (`initialization.resolve`, which reads no parameters; `overridden`: the
  keys the command line set) and names it. With `topology` (`--topology`, a TPU slice or
  NVIDIA GPUs), the mesh is laid over its chips and, before the last line, the run's jitted
  functions are compiled for it by the TPU or GPU compiler (`tpu_compile.preflight`)."""
  slice_ = None
  if topology is not None:  # Checked before anything else; libtpu told to stay off the network.
    slice_ = tpu_topology.parse(topology)
    tpu_topology.require_extra(slice_)
    tpu_topology.prepare_environment(slice_)
    num_devices = slice_.chips
  platform = jax.devices()[0].platform
  if num_devices is None:  # This host's devices: what train.py would refuse here, refused.
    config_lib.validate(config, jax.device_count())
    config_lib.raise_if(config_rules.platform_errors(config, platform))
  elif slice_ is not None:  # Compiled for TPUs (GPUs): what a run there would refuse, refused.
    config_lib.validate(config, num_devices)
    config_lib.raise_if(config_rules.platform_errors(config, slice_.platform))
  else:  # Planned for other devices: this host's kind is not theirs, but say what it lacks.
    config_lib.validate(config, num_devices)
    for error in config_rules.platform_errors(config, platform):
      print(f'Note: not on this host: {error}')
  if source := initialization.resolve(config, overridden=overridden):
    print(f'parameters from: {source.describe()}')
  model_config = ModelConfig.from_config(config)
  model, _ = train_steps.create_models(model_config)
  params = summary.abstract_params(model)
  rows, total = summary.parameter_table(params)
  print(summary.format_table(rows, total))
  flops = summary.flops_per_token(model_config, config.data.max_len)
  print(
    f'model FLOPs per target token at length {config.data.max_len}: '
    f'forward {flops["forward"] / 1e6:,.1f}M, training step {flops["train"] / 1e6:,.1f}M'
  )
  if slice_ is None:
    print(memory.format_memory(memory.step_memory(config, num_devices or jax.device_count())))
  else:  # The compiler's figures decide what fits; the estimate is printed beside them.
    tpu_compile.preflight(config, topology)
  millions = f'{total / 1e6:.1f}M' if total >= 1e6 else f'{total / 1e6:.3f}M'
  print(f'params: {millions} ({total})')
  return total
