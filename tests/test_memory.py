"""`train.py --dry_run`'s memory report: counted from shapes, checked against the compiled step."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import abstract_run

from configs import tiny, wmt14_ende_base, wmt14_ende_big
from transformer import dry_run, memory, sharding

REPO = Path(__file__).resolve().parents[1]


def _compiled_bytes(config, num_devices: int) -> int:
  """Per-device bytes of the train step compiled for the CPU (as train_and_evaluate jits it)."""
  rows = config.data.tokens_per_batch // config.data.max_len
  run = abstract_run(config, jax.devices()[:num_devices], rows, config.data.max_len)
  with sharding.activated(run.mesh, run.rules):
    stats = run.train_step.lower(run.state, run.batch).compile().memory_analysis()
  # Inputs, plus outputs that are not donated inputs' buffers, plus temporaries.
  return (
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    - stats.alias_size_in_bytes
    + stats.temp_size_in_bytes
  )


@pytest.mark.parametrize(
  ('mesh', 'grad_accum_steps'),
  [((1, 1, 1), 2), ((2, 2, 1), 1)],
  ids=['one_device_two_micro_batches', 'data_2_fsdp_2'],
)
def test_estimate_is_within_10_percent_of_the_compiled_step(mesh, grad_accum_steps):
  config = tiny.get_config()  # float32: XLA:CPU computes bfloat16 in float32.
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.grad_accum_steps = grad_accum_steps
  estimate = memory.step_memory(config, math.prod(mesh))
  compiled = _compiled_bytes(config, math.prod(mesh))
  assert abs(estimate.total / compiled - 1) <= 0.10, (estimate, compiled)
  assert estimate.activations > 0.5 * estimate.total  # At this batch, the largest part.


def test_parts_are_the_state_split_over_the_mesh_and_the_rows_of_a_device():
  config = wmt14_ende_base.get_config()
  config.dtype = 'bfloat16'
  config.mesh.data, config.mesh.fsdp = 1, 4
  params = 63_082_496  # train.py --dry_run's count (tests/test_train.py).
  fsdp = memory.step_memory(config, 4)
  config.mesh.data, config.mesh.fsdp = 4, 1
  data = memory.step_memory(config, 4)
  assert data.parameters == data.gradients == 4 * params  # Replicated, float32.
  assert data.optimizer == 2 * data.parameters + 8  # Adam's two moments and two step counts.
  # Matrices and norms split along `embed`; the biases of heads and d_ff (0.2%) stay whole.
  assert data.parameters / 4 < fsdp.parameters < 1.01 * data.parameters / 4
  assert (data.rows, data.micro_rows, data.length) == (24, 24, 256)  # 24,576 tokens / 256 / 4.
  assert data.batch == 7 * 24 * 256 * 4
  assert data.activations == fsdp.activations
  config.model.remat = 'layer'
  assert memory.step_memory(config, 4).activations < data.activations / 3


def test_dry_run_says_which_accelerators_the_big_model_fits(capsys):
  config = wmt14_ende_big.get_config()
  config.dtype = 'bfloat16'
  dry_run.run(config, num_devices=1)
  out = capsys.readouterr().out
  report = out[out.index('train step memory per device') :].splitlines()
  total = next(float(line.split()[1]) for line in report if line.split()[0] == 'total')
  for name, gib in memory.ACCELERATORS:
    line = next(line for line in report if line.strip().startswith(f'{name} {gib} GB'))
    fits = total <= memory.USABLE_SHARE * gib
    assert (' fits ' in line) == fits and ('does not fit' in line) != fits, line
  assert 'does not fit' in out and ' fits ' in out  # 96 rows of 256 tokens: A100 40 GB no.
  assert report[-1].startswith('params: 214.2M')


def test_dry_run_devices_lays_the_mesh_over_them_and_needs_dry_run(tmp_path):
  def train_py(*args):
    return subprocess.run(
      [sys.executable, 'train.py', '--config=configs/tiny.py', *args],
      cwd=REPO,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
      capture_output=True,
      text=True,
      timeout=300,
    )

  result = train_py('--dry_run', '--dry_run_devices=4')
  assert result.returncode == 0, result.stderr[-2000:]
  # configs/tiny.py: 512 tokens / 32 = 16 rows, 4 on each of the 4 data-parallel devices.
  assert 'mesh data 4 x fsdp 1 x tensor 1; 4 rows of 32 tokens per device' in result.stdout
  result = train_py('--dry_run_devices=4', f'--workdir={tmp_path / "run"}')
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].endswith('add --dry_run.')
  assert not (tmp_path / 'run').exists()
