"""Fine-tuning from a checkpoint (`config.init_from`, transformer/initialization.py).

A new run starts from another run's parameters (one checkpoint, a step, several averaged) with
a fresh optimizer state, schedule and data position, on any mesh; a source whose model or
vocabulary differ is refused in one message before anything is written; a resumed fine-tuning
run goes on from its own checkpoints and never initialises again.

Every test starts from one tiny source run (configs/tiny.py on the made-up Multi30k corpus, 6
steps on 1 device, checkpoints and evaluations at 2, 4 and 6), trained once per module.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import synthetic_captions
from test_reliability import (  # noqa: F401  (the `train` fixture)
  OVERRIDES,
  REPO,
  _assert_same_state,
  _rows,
  sigterm_when,
  train,
)

from configs import tiny
from transformer import config as config_lib
from transformer import (
  errors,
  initialization,
  optim,
  provenance,
  runs,
  sharding,
  tasks,
  train_steps,
  training,
)
from transformer import tokenizer as tokenizer_lib
from transformer.config import ModelConfig
from transformer.tools import sweeps

pytestmark = pytest.mark.slow

# The source: OVERRIDES (test_reliability's runs, which `train` starts) evaluated at every
# checkpoint, so that each checkpoint's validation loss is known.
SOURCE = {**OVERRIDES, 'eval_every_steps': 2}
# The fine-tuning runs in this process: 2 steps at a learning rate too small to move a float32
# parameter, so that their first evaluation reads the parameters they started from.
STILL = {
  'num_train_steps': 2,
  'eval_every_steps': 2,
  'checkpoint_every_steps': 2,
  'warmup_steps': 4,
  'peak_learning_rate': 1e-9,
  'model.dropout_rate': 0.3,
}


@pytest.fixture(scope='module')
def config_of(synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """Returns `config_of(**overrides)`: configs/tiny.py with SOURCE on the made-up corpus."""

  def make(**overrides):
    config = tiny.get_config()
    config.data.manual_dir = str(synthetic_multi30k_dir)
    config.data.data_dir = str(synthetic_multi30k_data_dir)
    return sweeps.apply_overrides(config, {**SOURCE, **overrides})

  return make


@pytest.fixture(scope='module')
def source(config_of, tmp_path_factory):
  """The workdir of the source run, trained on 1 device."""
  workdir = tmp_path_factory.mktemp('source') / 'run'
  training.train_and_evaluate(config_of(), str(workdir), devices=jax.devices()[:1])
  return workdir


def _eval_losses(workdir):
  return {r['step']: r['eval_loss'] for r in _rows(workdir) if 'eval_loss' in r}


def _saved(workdir, step):
  """The train state of checkpoint `step` of the run in `workdir`, as Orbax reads it."""
  return ocp.StandardCheckpointer().restore(
    os.path.join(workdir, 'checkpoints', str(step), 'state')
  )


def _data_position(workdir, step):
  """The data iterator's position saved with checkpoint `step` (Grain's JSON)."""
  return (workdir / 'checkpoints' / str(step) / 'data' / 'process_0-of-1.json').read_text()


@pytest.fixture(scope='module')
def finetuned(config_of, source, tmp_path_factory):
  """(workdir, config, log) of a run fine-tuned from `source` on 2 devices, parameters sharded."""
  workdir = tmp_path_factory.mktemp('finetuned') / 'run'
  config = config_of(
    **STILL, init_from=str(source), **{'mesh.data': 1, 'mesh.fsdp': 2, 'log_every_steps': 1}
  )
  with _logged() as log:
    training.train_and_evaluate(config, str(workdir), devices=jax.devices()[:2])
  return workdir, config, log


@contextlib.contextmanager
def _logged():
  """The messages absl logs at INFO and above inside the block, as a list of strings."""
  messages = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: messages.append(record.getMessage())
  logger = logging.getLogger('absl')
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.INFO)
  try:
    yield messages
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_finetuned_run_starts_at_the_sources_validation_loss_on_another_mesh(source, finetuned):
  workdir, _, log = finetuned
  losses = _eval_losses(source)
  assert sorted(losses) == [2, 4, 6]
  # Its first evaluation (its learning rate moves no parameter measurably) is the source's
  # last, though the source trained on 1 device and this run shards the parameters over 2.
  [(step, loss)] = _eval_losses(workdir).items()
  assert step == 2
  np.testing.assert_allclose(loss, losses[6], rtol=1e-5)
  assert min(abs(loss - losses[2]), abs(loss - losses[4])) > 1e-3, losses  # Not another's.
  # Its first update's loss, on the same first batch, lies far below a fresh model's (the
  # source's first): it did not start from random parameters.
  first = lambda run: next(r['train_loss'] for r in _rows(run) if 'train_loss' in r)
  assert first(workdir) < first(source) - 0.5, (first(workdir), first(source))
  assert any("on mesh {'data': 1, 'fsdp': 2, 'tensor': 1}" in m for m in log)
  # What it started from is logged once and recorded: the source, its step, the parameters'
  # sha256 (that of the source's checkpoint 6, read here by Orbax alone).
  started = [m for m in log if m.startswith('Initialised the parameters from')]
  assert started == [
    f"Initialised the parameters from {source}, checkpoint 'latest' (step 6): sha256 "
    f'{initialization.params_sha256(_saved(source, 6)["params"])}. The optimizer state, the '
    'learning-rate schedule (step 0) and the data position start fresh.'
  ]
  [entry] = provenance.read(str(workdir))
  assert entry['initialization'] == {
    'init_from': str(source),
    'init_checkpoint': 'latest',
    'steps': [6],
    'params_sha256': initialization.params_sha256(_saved(source, 6)['params']),
  }


def test_a_finetuned_runs_optimizer_schedule_and_data_start_fresh(source, finetuned):
  workdir, config, _ = finetuned
  rows = [r for r in _rows(workdir) if 'train_loss' in r]
  # Steps count from 1, and update 1 used the warmup's first rate: peak / warmup_steps.
  assert [r['step'] for r in rows] == [1, 2]
  first_rate = float(optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))(0))
  assert rows[0]['learning_rate'] == pytest.approx(first_rate, rel=1e-6)
  assert first_rate == pytest.approx(1e-9 / 4, rel=1e-6)
  # Its checkpoint is at its own step 2, the optimizer's counts (Adam's and its schedule's)
  # counting its 2 updates only.
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2']
  state = _saved(workdir, 2)
  assert int(state['step']) == 2
  counts = [int(x) for x in jax.tree.leaves(state['opt_state']) if np.ndim(x) == 0]
  assert counts == [2, 2], counts
  # Its data position is a new run's after 2 steps (the source's at its step 2), not the
  # source's at step 6.
  assert _data_position(workdir, 2) == _data_position(source, 2) != _data_position(source, 6)


def _target(config, devices):
  """The run of `config` on `devices`, as the parameters' target (nothing allocated)."""
  mesh, rules = sharding.create_mesh(config.mesh, devices), sharding.axis_rules(config.mesh)
  task = tasks.get_task(config.model.architecture)
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  _, shardings = train_steps.abstract_state_and_shardings(
    model, optim.create_optimizer(optim.OptimizerConfig.from_config(config)), task, mesh, rules
  )
  return initialization.Target(model, task, mesh, rules, shardings.params)


@pytest.mark.parametrize(
  ('checkpoint', 'steps'), [('4', [4]), ('avg:2', [4, 6]), ('avg:2@4', [2, 4]), ('latest', [6])]
)
def test_a_step_or_the_average_of_the_last_checkpoints_is_read_as_eval_py_reads_it(
  config_of, source, checkpoint, steps
):
  config = config_of(init_from=str(source), init_checkpoint=checkpoint, weight_decay=0.01)
  found = initialization.resolve(config)
  assert found.steps == tuple(steps)
  params, record = initialization.load(found, _target(config, jax.devices()[:2]))
  expected = jax.tree.map(
    lambda *p: sum(p) / np.float32(len(p)) if len(p) > 1 else p[0],
    *[_saved(source, s)['params'] for s in steps],
  )
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, b)
  assert record == {
    'init_from': str(source),
    'init_checkpoint': checkpoint,
    'steps': steps,
    'params_sha256': initialization.params_sha256(expected),
  }


def test_regularisation_schedule_steps_batches_and_data_may_differ(config_of, source, tmp_path):
  vocabulary = provenance.recorded_inputs(str(source))['vocabulary']['path']
  copy = tmp_path / 'copy.model'
  shutil.copy(vocabulary, copy)  # The same vocabulary at another path.
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  config = config_of(
    init_from=str(source),
    label_smoothing=0.2,
    schedule='cosine',
    peak_learning_rate=3e-4,
    warmup_steps=10,
    num_train_steps=100,
    weight_decay=0.01,
    grad_clip_norm=1.0,
    dtype='bfloat16',
    **{
      'model.dropout_rate': 0.3,
      'model.attention_dropout_rate': 0.1,
      'model.ffn_dropout_rate': 0.1,
      'model.attention_impl': 'xla',
      'model.remat': 'layer',
      'data.tokens_per_batch': 1024,
      'data.dataset': 'parallel_text',
      'data.manual_dir': str(corpus),
      'data.vocab_path': str(copy),
    },
  )
  assert initialization.resolve(config).steps == (6,)


def _other_vocabulary(path):
  """A SentencePiece model of the source's size trained on other text, written to `path`."""
  sentences = [s for pair in synthetic_captions(1000, seed=7) for s in pair]
  path.write_bytes(tokenizer_lib.train_tokenizer(sentences, 512).serialized_model())
  return path


def test_another_model_or_vocabulary_is_refused_in_one_message_before_anything_is_written(
  config_of, source, tmp_path
):
  vocabulary = provenance.recorded_inputs(str(source))['vocabulary']
  other = _other_vocabulary(tmp_path / 'other.model')
  other_hash = provenance.file_sha256(str(other))
  cases = [
    ({'vocab_size': 300}, ['config.vocab_size: 512 -> 300', 'which does not exist yet']),
    (  # Every difference at once: a shape, a language (so the vocabulary beside the data).
      {'model.d_ff': 48, 'model.position': 'rope', 'data.target_lang': 'fr'},
      [
        'config.model.d_ff: 64 -> 48',
        "config.model.position: 'sinusoidal' -> 'rope'",
        "config.data.target_lang: 'de' -> 'fr'",
        f'{vocabulary["path"]} (sha256 {vocabulary["hash"][:16]}) -> ',
      ],
    ),
    (
      {'data.vocab_path': str(other)},
      [
        'the vocabulary (every token id would mean another piece): '
        f'{vocabulary["path"]} (sha256 {vocabulary["hash"][:16]}) -> {other} (sha256 '
        f'{other_hash[:16]})'
      ],
    ),
  ]
  for overrides, lines in cases:
    workdir = tmp_path / 'run'
    with pytest.raises(errors.InvalidInput) as error:
      training.train_and_evaluate(config_of(init_from=str(source), **overrides), str(workdir))
    message = str(error.value)
    assert message.startswith(f'config.init_from={source}: its parameters do not fit this run.')
    for line in lines:
      assert line in message, message
    assert 'Nothing was written.' in message
    assert not workdir.exists()


def test_a_difference_says_whether_the_command_line_or_the_config_file_set_it(config_of, source):
  config = config_of(init_from=str(source), **{'model.norm_epsilon': 1e-5, 'model.d_ff': 48})
  with pytest.raises(errors.InvalidInput) as refusal:
    initialization.resolve(config, overridden={'model.d_ff'})
  lines = str(refusal.value).splitlines()
  assert '  config.model.d_ff: 64 -> 48 (--config.model.d_ff on the command line: drop it)' in lines
  assert (
    "  config.model.norm_epsilon: 1e-06 -> 1e-05 (the config file's value: override it, "
    '--config.model.norm_epsilon=1e-06)'
  ) in lines
  assert 'drop these overrides' not in str(refusal.value)


def test_a_source_or_checkpoint_that_is_not_there_is_named(config_of, source, tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  unsaved = tmp_path / 'unsaved'  # A run stopped before its first checkpoint.
  unsaved.mkdir()
  for name in ('config.json', 'provenance.jsonl', 'metrics.jsonl'):
    shutil.copy(source / name, unsaved / name)
  workdir = tmp_path / 'run'
  steps = "the checkpoints are at steps [2, 4, 6] (or use 'latest' or 'avg:N')"
  cases = [
    ({'init_from': str(tmp_path / 'nowhere')}, f'there is no directory {tmp_path}/nowhere'),
    ({'init_from': str(empty)}, f'{empty} holds no config.json, so it is not the workdir of'),
    ({'init_from': str(unsaved)}, f'the run in {unsaved} holds no committed checkpoint yet'),
    (
      {'init_from': str(source), 'init_checkpoint': '5'},
      f"config.init_checkpoint='5' of config.init_from={source}: checkpoint='5' does not "
      f'exist; {steps}',
    ),
    (
      {'init_from': str(source), 'init_checkpoint': 'avg:4'},
      "config.init_checkpoint='avg:4' of config.init_from=",
    ),
    ({'init_from': str(source), 'init_checkpoint': 'best'}, 'No best checkpoints at'),
    ({'init_from': str(source), 'init_checkpoint': 'avg:0'}, "config.init_checkpoint='avg:0'"),
    ({'init_checkpoint': '4'}, "config.init_checkpoint='4' names a checkpoint of config.init_from"),
    ({'init_from': ' '}, "config.init_from=' ' must be '' (random parameters), the workdir"),
    ({'init_from': 'hf:'}, "config.init_from='hf:' must be '' (random parameters), the workdir"),
    ({'init_from': f'hf:{tmp_path}/none'}, f'{tmp_path}/none is not a local directory'),
    ({'init_from': str(workdir)}, f"config.init_from={workdir} is this run's own --workdir"),
    ({'init_from': 's3://bucket/run'}, 'checkpoints cannot live on s3:// yet'),
    ({'init_from': 'gs:/bucket/run'}, 'config.init_from=gs:/bucket/run is not a URL'),
  ]
  for overrides, message in cases:
    with pytest.raises(errors.Refusal, match=re.escape(message)):
      training.train_and_evaluate(config_of(**overrides), str(workdir))
    assert not workdir.exists()


def test_train_py_refuses_in_one_message_and_dry_run_checks(train, source, tmp_path):  # noqa: F811
  workdir = tmp_path / 'run'
  command = train.command(workdir, init_from=source, **{'model.d_ff': 48})
  result = subprocess.run(
    command, cwd=REPO, env=train.env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 1, result.stderr[-3000:]
  assert f'train.py: error: config.init_from={source}: its parameters do not fit' in result.stderr
  # Set on the command line, and said so (issue 62, item 15).
  assert 'config.model.d_ff: 64 -> 48 (--config.model.d_ff on the command line: drop it)' in (
    result.stderr
  )
  assert 'Traceback' not in result.stderr
  assert not workdir.exists()
  dry_run = train.command(workdir, '--dry_run', init_from=source, init_checkpoint='avg:2')
  result = subprocess.run(
    dry_run, cwd=REPO, env=train.env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert f"parameters from: {source}, checkpoint 'avg:2' (steps 4, 6 averaged)" in lines
  assert lines[-1].startswith('params: ')


def test_a_stopped_finetuning_run_resumes_exactly(train, source, tmp_path):  # noqa: F811
  copy = tmp_path / 'source'
  shutil.copytree(source, copy)
  settings = {
    'init_from': copy,
    'num_train_steps': 8,
    'eval_every_steps': 8,
    'peak_learning_rate': 0.002,
    'model.dropout_rate': 0.2,
  }
  straight = train(tmp_path / 'straight', **settings)
  assert straight.returncode == 0, straight.stderr[-3000:]
  workdir = tmp_path / 'run'
  process, log = sigterm_when(train, train.command(workdir, **settings), 'step 2/8 |')
  assert process.returncode == 0, log[-3000:]
  stopped = int(log.split('Stopped by SIGTERM after step ')[1].split(';')[0])
  assert 2 <= stopped < 8, log[-3000:]
  # The source is gone: the resume needs only its own checkpoints.
  copy.rename(tmp_path / 'moved')
  resumed = train(workdir, **settings)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'Restored checkpoint {workdir}/checkpoints/{stopped}.' in resumed.stderr
  assert 'Initialised the parameters' not in resumed.stderr
  assert _rows(workdir) == _rows(tmp_path / 'straight')
  _assert_same_state(tmp_path / 'straight', workdir, 8)
  assert [bool(e.get('initialization')) for e in provenance.read(str(workdir))] == [True, False]
  # Where it started cannot change on resume, as a model field cannot.
  config = json.loads((workdir / 'config.json').read_text())
  assert config['init_from'] == str(copy)
  result = train(workdir, **{**settings, 'num_train_steps': 10, 'init_checkpoint': '4'})
  assert result.returncode == 1
  assert (
    f'The checkpoints in {workdir}/checkpoints go on from the parameters this run started from'
    in result.stderr
  )
  assert "config.init_checkpoint: 'latest' -> '4'" in result.stderr


def test_runs_from_before_fine_tuning_read_as_started_from_random_parameters():
  config = tiny.get_config().to_dict()
  del config['init_from'], config['init_checkpoint']
  upgraded = runs.upgrade(ml_collections.ConfigDict(config))
  assert (upgraded.init_from, upgraded.init_checkpoint) == ('', 'latest')
  config_lib.validate(upgraded)
