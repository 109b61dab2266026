"""Checkpoint save and restore times of a config's train state: local disk against a bucket.

  python bench/checkpoint_storage.py --config=configs/wmt14_ende_base.py [--repeats=3]

The state is the config's own (parameters and Adam's moments, from the shapes `--dry_run`
computes; filled with random values, no training), saved and restored through the project's
`checkpoints.Checkpointer` (Orbax, asynchronous save) into: a local temporary folder, and a
gs:// bucket on a fake-gcs-server started on 127.0.0.1 (tests/object_stores.py; nothing leaves
the machine). The rows alternate (local, gs, local, gs, ...) so that both see the same load.
s3:// is not measured: Orbax cannot write checkpoints there (`storage.CHECKPOINT_SCHEMES`).

With `--train_steps=N` it also trains configs/tiny.py's model N steps with train.py into each
target, a checkpoint every `--checkpoint_every` steps (asynchronous saves, beside the steps),
and compares the median steps/s of the logged windows after the first (compile):

  python bench/checkpoint_storage.py --config=configs/wmt14_ende_base.py --train_steps=300 \
      --manual_dir=../shared/data/multi30k

Reports per target the median seconds of: the blocking part of a save (what the train loop
waits for), the whole save until committed, and a restore (checksums verified); and the
state's size. The emulator keeps objects in memory on this machine: its figures are an upper
bound on the client's own cost (HTTP, JSON, TensorStore's gcs driver), not a cloud bucket's.
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))

# First: on a CPU-only host it keeps JAX from loading libtpu and the CUDA plugin
# (transformer/__init__.py).
import transformer  # noqa: E402, F401, I001

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import (  # noqa: E402
  checkpoints,
  errors,
  optim,
  outputs,
  path_checks,
  sharding,
  storage,
  tasks,
  train_steps,
)
from transformer.config import ModelConfig  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Training config file.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Saves and restores per target (>= 1).')
_OUT = flags.DEFINE_string('out', None, 'Also write the figures to this JSON file.')
_TRAIN_STEPS = flags.DEFINE_integer('train_steps', 0, 'Also train this many steps per target.')
_CHECKPOINT_EVERY = flags.DEFINE_integer('checkpoint_every', 10, 'With --train_steps: steps.')
_MANUAL_DIR = flags.DEFINE_string('manual_dir', None, 'With --train_steps: the Multi30k files.')
REPO = Path(__file__).resolve().parents[1]


def _state(config):
  model_config = ModelConfig.from_config(config)
  devices = jax.devices()
  mesh = sharding.create_mesh(config.mesh, devices)
  rules = sharding.axis_rules(config.mesh)
  model, _ = train_steps.create_models(model_config)
  abstract, shardings = train_steps.abstract_state_and_shardings(
    model,
    optim.create_optimizer(optim.OptimizerConfig.from_config(config)),
    tasks.get_task(config.model.architecture),
    mesh,
    rules,
  )
  rng = np.random.default_rng(0)

  def fill(leaf, leaf_sharding):
    value = (
      rng.standard_normal(leaf.shape).astype(leaf.dtype) if leaf.shape else np.zeros((), leaf.dtype)
    )
    return jax.device_put(value, leaf_sharding)

  return abstract, jax.tree.map(fill, abstract, shardings)


def _measure(workdir: str, step: int, abstract, state) -> dict[str, float]:
  iterator = grain.MapDataset.range(10).to_iter_dataset().__iter__()
  checkpointer = checkpoints.Checkpointer(workdir, keep=2)
  try:
    started = time.perf_counter()
    checkpointer.save(step, state, iterator, force=True)
    blocking = time.perf_counter() - started
    checkpointer.wait_until_finished()
    saved = time.perf_counter() - started
    started = time.perf_counter()
    checkpointer.restore(step, abstract, None)
    restored = time.perf_counter() - started
  finally:
    checkpointer.close()
  return {'save_blocking_s': blocking, 'save_s': saved, 'restore_s': restored}


def _train_rate(workdir: str, data_dir: str) -> float:
  """Median steps/s of train.py's logged windows after the first, training into `workdir`."""
  every = _CHECKPOINT_EVERY.value
  subprocess.run(
    [
      sys.executable,
      'train.py',
      '--config=configs/tiny.py',
      f'--workdir={workdir}',
      f'--config.data.manual_dir={_MANUAL_DIR.value}',
      f'--config.data.data_dir={data_dir}',
      f'--config.num_train_steps={_TRAIN_STEPS.value}',
      f'--config.checkpoint_every_steps={every}',
      f'--config.log_every_steps={every}',
      f'--config.eval_every_steps={_TRAIN_STEPS.value}',
      '--config.eval_bleu_sentences=0',
    ],
    cwd=REPO,
    check=True,
    capture_output=True,
  )
  rows = [json.loads(line) for line in storage.read_text(f'{workdir}/metrics.jsonl').splitlines()]
  return statistics.median([r['steps_per_sec'] for r in rows if 'steps_per_sec' in r][1:])


def main(argv):
  del argv
  if _REPEATS.value < 1:
    raise app.UsageError(f'--repeats={_REPEATS.value} must be >= 1.')
  if _TRAIN_STEPS.value < 0 or _CHECKPOINT_EVERY.value < 1:
    raise app.UsageError('--train_steps must be >= 0 and --checkpoint_every >= 1.')
  if _TRAIN_STEPS.value and not _MANUAL_DIR.value:
    raise app.UsageError('--train_steps needs --manual_dir (the Multi30k files).')
  if _OUT.value and (problems := path_checks.output_errors(_OUT.value, '--out')):
    raise app.UsageError(problems[0])
  import object_stores  # pylint: disable=g-import-not-at-top  (tests/object_stores.py)

  stores = object_stores.start()
  try:
    abstract, state = _state(_CONFIG.value)
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    targets = {'local': tempfile.mkdtemp(prefix='bench-ckpt-'), 'gs': stores.bucket('gs') + '/run'}
    rows = {name: [] for name in targets}
    for repeat in range(_REPEATS.value + 1):  # The first round warms up (compiles checksums).
      for name, workdir in targets.items():
        row = _measure(workdir, repeat + 1, abstract, state)
        if repeat:
          rows[name].append(row)
        print(f'{name} round {repeat}: ' + ', '.join(f'{k} {v:.2f}' for k, v in row.items()))
    report = {
      'config_state_bytes': size,
      'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
      **{
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in rows.items()
      },
    }
    report['gs_over_local'] = {
      key: report['gs'][key] / report['local'][key] for key in report['local']
    }
    if _TRAIN_STEPS.value:
      data_dir = tempfile.mkdtemp(prefix='bench-ckpt-data-')
      rates = {name: [] for name in targets}
      for repeat in range(_REPEATS.value):
        for name, root in targets.items():
          rate = _train_rate(f'{root}/train_{repeat}', data_dir)
          rates[name].append(rate)
          print(f'{name} training {repeat}: {rate:.2f} steps/s')
      report['train_steps_per_sec'] = {name: statistics.median(r) for name, r in rates.items()}
      report['train_steps_per_sec']['gs_over_local'] = (
        report['train_steps_per_sec']['gs'] / report['train_steps_per_sec']['local']
      )
    print(json.dumps(report, indent=2))
    if _OUT.value:
      outputs.write(_OUT.value, json.dumps(report, indent=2), '--out')
  finally:
    stores.stop()


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  errors.run(main)
