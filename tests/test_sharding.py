"""Sharding: the mesh from the config, parameter placement, and sharded steps equal to one device.

Runs on 8 CPU devices (tests/conftest.py asks JAX for them). Every test's name
says shard, mesh, host or process, so `pytest -k "shard or mesh or host or
process"` selects them.
"""

import functools
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
from conftest import abstract_run

from configs import tiny
from transformer import (
  checkpoints,
  distributed,
  inference,
  optim,
  sharding,
  storage,
  tasks,
  train_steps,
  training,
  workdir_lock,
)
from transformer import config as config_lib
from transformer.config import ModelConfig
from transformer.tasks import translation

REPO = Path(__file__).resolve().parents[1]
NUM_DEVICES = 8

needs_8_devices = pytest.mark.skipif(
  jax.device_count() < NUM_DEVICES,
  reason=f'needs {NUM_DEVICES} devices (tests/conftest.py sets jax_num_cpu_devices; '
  f'{jax.device_count()} here)',
)

# (data, fsdp, tensor) -> how many of the 8 devices the mesh uses.
MESHES = {
  'data_parallel': (8, 1, 1),
  'fsdp': (1, 8, 1),
  'tensor_parallel': (1, 1, 2),
  'mixed': (2, 2, 2),
}
ROWS, LENGTH = 16, 16


def _config(mesh=(1, 1, 1), **model_overrides) -> ml_collections.ConfigDict:
  config = tiny.get_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.data.max_len = LENGTH
  config.data.tokens_per_batch = ROWS * LENGTH
  for key, value in model_overrides.items():
    config.model[key] = value
  return config


def _devices(config) -> list[jax.Device]:
  """As many of the 8 CPU devices as `config.mesh` has."""
  return jax.devices()[: math.prod(config.mesh[axis] for axis in sharding.MESH_AXES)]


def _mesh(config) -> tuple[jax.sharding.Mesh, sharding.Rules]:
  return sharding.create_mesh(config.mesh, _devices(config)), sharding.axis_rules(config.mesh)


def _packed_batch(seed: int, vocab: int) -> dict[str, np.ndarray]:
  """Rows of two packed examples each (segments 1 and 2, then padding), like the pipeline's."""
  rng = np.random.default_rng(seed)
  batch = {}
  for side in ('src', 'tgt'):
    segments = np.zeros((ROWS, LENGTH), np.int32)
    positions = np.zeros((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
      first, second = rng.integers(3, LENGTH // 2, size=2)
      segments[row, :first] = 1
      segments[row, first : first + second] = 2
      positions[row, :first] = np.arange(first)
      positions[row, first : first + second] = np.arange(second)
    tokens = np.where(segments > 0, rng.integers(3, vocab, size=(ROWS, LENGTH)), 0)
    batch[f'{side}_segments'], batch[f'{side}_positions'] = segments, positions
    batch[f'{side}_tokens'] = tokens.astype(np.int32)
  # Decoder input: BOS (2) then the target shifted right, within each segment.
  shifted = np.where(batch['tgt_positions'] == 0, 2, np.roll(batch['tgt_tokens'], 1, axis=1))
  batch['tgt_input_tokens'] = np.where(batch['tgt_segments'] > 0, shifted, 0).astype(np.int32)
  return batch


def _train_two_steps(config):
  """Loss sums of two train steps on `config.mesh`, and the parameters after them (on host)."""
  run = abstract_run(config, _devices(config), ROWS, LENGTH)
  mesh, rules, task = run.mesh, run.rules, run.task
  state = train_steps.create_train_state(
    run.model, run.optimizer, task, run.state_shardings, mesh, jax.random.key(0)
  )
  losses = []
  with sharding.activated(mesh, rules):
    for seed in range(2):
      batch = {
        k: v for k, v in _packed_batch(seed, config.vocab_size).items() if k in task.batch_keys
      }
      batch = sharding.global_batch(batch, mesh, rules)
      state, sums = run.train_step(state, batch)
      losses.append(float(sums['loss_sum']) / float(sums['num_tokens']))
  return losses, jax.device_get(state.params), state.params


@functools.cache
def _single_device_run(**model_overrides):
  losses, params, _ = _train_two_steps(_config((1, 1, 1), **model_overrides))
  return losses, params


def _softmax_ignores(name: str, position: str) -> bool:
  """Whether parameter `name`'s gradient is zero in exact arithmetic: a bias of the keys (the
  key projection's, or the key norm's under qk_norm) adds q.b to every score of a query
  (eq. 1), a shift that softmax ignores, unless RoPE rotates self-attention's keys by their
  positions after it (then the shift differs per key). In float32 such a gradient is rounding
  noise, which Adam (eps = 1e-9) turns into +-lr steps of arbitrary sign: nothing to compare."""
  key_bias = name.endswith(("['key']['bias']", "['key_norm']['bias']"))
  return key_bias and not (position == 'rope' and 'self_attention' in name)


def _assert_params_close(params, reference, rtol=1e-3, position='sinusoidal'):
  flat = jax.tree_util.tree_leaves_with_path(params)
  expected = dict(jax.tree_util.tree_leaves_with_path(reference))
  for path, value in flat:
    name = jax.tree_util.keystr(path)
    if _softmax_ignores(name, position):
      continue
    ref = expected[path]
    error = np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-6)
    assert error <= rtol, f'{name}: relative difference {error:.2e}'


@needs_8_devices
@pytest.mark.parametrize('mesh_name', list(MESHES))
def test_sharded_train_step_matches_single_device(mesh_name, capfd):
  expected_losses, expected_params = _single_device_run()
  capfd.readouterr()
  losses, params, sharded_params = _train_two_steps(_config(MESHES[mesh_name]))
  # XLA partitions every op as annotated, never falling back to replicating a tensor.
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-3)
  _assert_params_close(params, expected_params)
  embedding = sharded_params['shared_embedding']['embedding']
  assert embedding.sharding.spec == jax.sharding.PartitionSpec(
    *nn.logical_to_mesh_axes(('vocab', 'embed'), sharding.axis_rules(_config().mesh))
  )


# The modern switches, several at a time, on the mixed mesh (each alone is covered on one
# device by test_variants.py).
MODERN = {
  'rmsnorm_rope_swiglu_nobias': dict(
    norm='rmsnorm', position='rope', ffn_activation='swiglu', use_bias=False
  ),
  # With QK-norm and grouped-query attention: 2 key/value heads split over the tensor axis.
  'pre_ln_alibi_gelu_qk_norm_grouped_query': dict(
    norm='pre_ln',
    position='alibi',
    ffn_activation='gelu',
    qk_norm=True,
    num_heads=4,
    num_kv_heads=2,
  ),
  'learned_positions': dict(position='learned'),
  'decoder_only_pre_ln_rope': dict(architecture='decoder_only', norm='pre_ln', position='rope'),
}


@needs_8_devices
@pytest.mark.parametrize('variant', list(MODERN))
def test_variant_sharded_on_mixed_mesh_matches_single_device(variant):
  expected_losses, expected_params = _single_device_run(**MODERN[variant])
  losses, params, _ = _train_two_steps(_config(MESHES['mixed'], **MODERN[variant]))
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-3)
  position = MODERN[variant].get('position', 'sinusoidal')
  _assert_params_close(params, expected_params, position=position)


@needs_8_devices
def test_fsdp_mesh_shards_every_large_parameter_and_its_adam_moments():
  config = _config(MESHES['fsdp'])
  mesh, rules = _mesh(config)
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  abstract, _ = train_steps.abstract_state_and_shardings(
    model,
    optim.create_optimizer(optim.OptimizerConfig.from_config(config)),
    tasks.get_task(config.model.architecture),
    mesh,
    rules,
  )
  threshold = 1024  # Elements; biases and norm scales of this model stay below it.
  for tree in (abstract.params, abstract.opt_state):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      if leaf.size > threshold:
        assert not leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path)
        assert 'fsdp' in jax.tree.leaves(tuple(leaf.sharding.spec)), jax.tree_util.keystr(path)


def test_mesh_shape_fills_one_axis_and_names_bad_sizes():
  mesh = ml_collections.ConfigDict({'data': -1, 'fsdp': 2, 'tensor': 2})
  assert sharding.mesh_shape(mesh, 8) == (2, 2, 2)
  mesh.data = 2
  assert sharding.mesh_shape(mesh, 8) == (2, 2, 2)
  with pytest.raises(ValueError, match='needs 8 devices, but 4 are available'):
    sharding.mesh_shape(mesh, 4)
  mesh.fsdp = -1
  mesh.data = -1
  with pytest.raises(ValueError, match='at most one -1'):
    sharding.mesh_shape(mesh, 8)
  mesh.update(data=-1, fsdp=3, tensor=1)
  with pytest.raises(ValueError, match='do not divide by the fixed axes'):
    sharding.mesh_shape(mesh, 8)


def test_mesh_rules_from_config_json_and_bad_rules_are_named():
  config = _config()
  as_json = ml_collections.ConfigDict(json.loads(config.to_json()))  # Tuples become lists.
  assert sharding.axis_rules(as_json.mesh) == sharding.axis_rules(config.mesh)
  config.mesh.rules = (('batch', 'model'),)
  with pytest.raises(ValueError, match=r"config.mesh.rules: \('batch', 'model'\)"):
    sharding.axis_rules(config.mesh)
  config.mesh.rules = (('hidden', 'tensor'),)
  with pytest.raises(ValueError, match='config.mesh.rules'):
    sharding.axis_rules(config.mesh)


@needs_8_devices
def test_batch_that_does_not_divide_over_the_mesh_is_an_error_naming_the_keys():
  config = _config((8, 1, 1))
  config.data.tokens_per_batch = 12 * LENGTH
  with pytest.raises(ValueError, match=r'12 rows per batch do not divide over the 8 batch shards'):
    config_lib.validate(config, NUM_DEVICES)


@needs_8_devices
def test_parameter_that_does_not_divide_over_the_tensor_mesh_axis_is_named():
  config = _config((1, 1, 2))
  config.vocab_size = 511  # Odd: the vocabulary cannot be split over tensor=2.
  mesh, rules = _mesh(config)
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  with pytest.raises(ValueError, match=r'shared_embedding.*\(511, 32\).*config.mesh.tensor=2'):
    train_steps.abstract_state_and_shardings(
      model,
      optim.create_optimizer(optim.OptimizerConfig.from_config(config)),
      tasks.get_task(config.model.architecture),
      mesh,
      rules,
    )


@needs_8_devices
def test_sharded_decoding_matches_single_device():
  config = _config(MESHES['mixed'])
  mesh, rules = _mesh(config)
  model_config = ModelConfig.from_config(config).replace(deterministic=True)
  _, _, params = _train_two_steps(config)
  host_params = jax.device_get(params)
  src = _packed_batch(5, config.vocab_size)['src_tokens'][:5]  # 5 rows: padded to 8 shards.
  for options in (
    inference.DecodeOptions(decoder='greedy', max_extra_len=6),
    inference.DecodeOptions(beam_size=2, max_extra_len=6),
    # Each row's key goes with the row to its device (and the padding rows get keys too).
    inference.DecodeOptions(decoder='sample', max_extra_len=6),
  ):
    expected = np.asarray(
      translation.decode.make_translate_fn(model_config, options)(
        host_params, src, jax.random.key(0)
      )
    )
    got = translation.decode.make_translate_fn(model_config, options, mesh, rules)(
      params, src, jax.random.key(0)
    )
    np.testing.assert_array_equal(got, expected)


def test_multi_process_detection_from_flags_and_cluster_environment():
  assert not distributed.is_multi_process(None, None, {})
  assert not distributed.is_multi_process(None, 1, {'SLURM_NTASKS': '4'})
  assert distributed.is_multi_process(None, 2, {})
  assert distributed.is_multi_process('host:1234', None, {})
  assert distributed.is_multi_process(None, None, {'SLURM_NTASKS': '4'})
  assert not distributed.is_multi_process(None, None, {'SLURM_NTASKS': '1'})
  assert distributed.is_multi_process(None, None, {'TPU_WORKER_HOSTNAMES': 'a,b,c,d'})
  assert distributed.is_multi_process(None, None, {'JAX_COORDINATOR_ADDRESS': 'h:1'})


# --- End to end: train_and_evaluate on meshes, resharded resume, two processes --------------


@pytest.fixture
def data_dirs(synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """(manual_dir, data_dir): a made-up corpus in Multi30k's layout, prepared once per session."""
  return str(synthetic_multi30k_dir), str(synthetic_multi30k_data_dir)


def _run(data_dirs, workdir, mesh, steps, devices=None):
  config = tiny.get_config()
  config.data.manual_dir, config.data.data_dir = data_dirs
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.update(
    num_train_steps=steps,
    log_every_steps=3,
    eval_every_steps=6,
    checkpoint_every_steps=3,
    eval_bleu_sentences=0,
  )
  training.train_and_evaluate(config, str(workdir), devices)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return {
    (row['step'], key): row[key]
    for row in rows
    for key in ('train_loss', 'eval_loss')
    if key in row
  }


@needs_8_devices
@pytest.mark.slow
def test_mesh_2x2x2_run_and_resharded_resume_match_the_single_device_run(data_dirs, tmp_path):
  single = _run(data_dirs, tmp_path / 'single', (1, 1, 1), 6, jax.devices()[:1])
  mixed = _run(data_dirs, tmp_path / 'mixed', (2, 2, 2), 6)
  assert set(mixed) == set(single) and (6, 'eval_loss') in single
  for key, value in single.items():
    assert mixed[key] == pytest.approx(value, rel=1e-3), key

  # Saved data-parallel on 8 devices at step 3, resumed tensor-parallel on 2.
  _run(data_dirs, tmp_path / 'resharded', (8, 1, 1), 3)
  resumed = _run(data_dirs, tmp_path / 'resharded', (1, 1, 2), 6, jax.devices()[:2])
  assert set(resumed) == set(single) | {(3, 'eval_loss')}  # The first part ended at step 3.
  for key, value in single.items():
    assert resumed[key] == pytest.approx(value, rel=1e-3), key


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _two_process_train(data_dirs, workdir, steps):
  """Runs train.py as processes 0 and 1 of one run (2 CPU devices each); returns their logs."""
  port = _free_port()
  env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '2', 'JAX_PLATFORMS': 'cpu'}
  flags = [
    '--config=configs/tiny.py',
    f'--workdir={workdir}',
    f'--config.data.manual_dir={data_dirs[0]}',
    f'--config.data.data_dir={data_dirs[1]}',
    f'--config.num_train_steps={steps}',
    '--config.checkpoint_every_steps=2',
    '--config.log_every_steps=2',
    '--config.eval_every_steps=4',
    '--config.eval_bleu_sentences=8',
    '--config.mesh.data=2',
    '--config.mesh.tensor=2',
    f'--coordinator_address=localhost:{port}',
    '--num_processes=2',
  ]
  procs = [
    subprocess.Popen(
      [sys.executable, 'train.py', *flags, f'--process_id={i}'],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  for proc in procs:
    out, _ = proc.communicate(timeout=600)
    logs.append(out)
    assert proc.returncode == 0, out[-3000:]
  return logs


@pytest.mark.slow
def test_two_host_processes_train_and_checkpoint(data_dirs, tmp_path):
  """Two processes of one run on a local disk. Their resume, which reads each process's shards
  back, is test_bucket_endurance's on gs:// (the same Orbax calls on either)."""
  workdir = str(tmp_path / 'two_processes')
  logs = _two_process_train(data_dirs, workdir, 6)
  assert 'Process 0 of 2; 2 local of 4 devices.' in logs[0]
  assert checkpoints.committed_steps(storage.join(workdir, 'checkpoints')) == [2, 4, 6]
  text = storage.read_text(storage.join(workdir, 'metrics.jsonl'))
  rows = [json.loads(line) for line in text.splitlines()]
  train_steps = [row['step'] for row in rows if 'train_loss' in row]
  assert train_steps == [2, 4, 6]  # Process 0 alone writes metrics; no row twice.
  assert all(np.isfinite(row['train_loss']) for row in rows if 'train_loss' in row)
  eval_rows = [row for row in rows if 'eval_loss' in row]
  assert [row['step'] for row in eval_rows] == [4, 6] and 'eval_bleu' in eval_rows[-1]
  assert workdir_lock.read_holder(workdir) is None  # Process 0 held it, and released it.
