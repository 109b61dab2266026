"""End-to-end: configs/tiny.py trains on a made-up corpus in Multi30k's layout, resumes exactly,
rejects bad input."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import conftest
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from transformer import best_checkpoints, metrics, optim, runs, train_steps, training
from transformer.config import ModelConfig
from transformer.tools import sweeps

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture
def data_dirs(synthetic_multi30k_dir, synthetic_multi30k_data_dir):
  """(manual_dir, data_dir): a made-up corpus in Multi30k's layout, prepared once per session."""
  return str(synthetic_multi30k_dir), str(synthetic_multi30k_data_dir)


def _tiny_config(data_dirs, **overrides):
  config = tiny.get_config()
  config.data.manual_dir, config.data.data_dir = data_dirs
  return sweeps.apply_overrides(config, overrides)


def _metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _final_params(workdir):
  checkpoints = os.path.join(workdir, 'checkpoints')
  step = max(int(name) for name in os.listdir(checkpoints) if name.isdigit())
  restored = ocp.StandardCheckpointer().restore(os.path.join(checkpoints, str(step), 'state'))
  return step, restored['params'], restored['opt_state']


_TIMING = (
  'steps_per_sec',
  'tokens_per_sec',
  'input_wait_ms',
  'eval_decode_sentences_per_sec',
  'wall_seconds',
)


def test_tiny_trains_and_loss_falls(data_dirs, tmp_path):
  config = _tiny_config(data_dirs)
  final = training.train_and_evaluate(config, str(tmp_path))
  rows = _metrics(tmp_path)
  train_losses = [r['train_loss'] for r in rows if 'train_loss' in r]
  eval_rows = [r for r in rows if 'eval_loss' in r]
  assert len(train_losses) == 6
  # The logged learning rate is the optimizer's schedule at each logged update.
  schedule = optim.learning_rate_schedule(optim.OptimizerConfig.from_config(config))
  assert [r['learning_rate'] for r in rows if 'train_loss' in r] == pytest.approx(
    [float(schedule(r['step'] - 1)) for r in rows if 'train_loss' in r], rel=1e-6
  )
  assert train_losses[-1] < train_losses[0] - 0.5, train_losses
  assert [r['step'] for r in eval_rows] == [30, 60]
  assert eval_rows[-1]['eval_loss'] < eval_rows[0]['eval_loss']
  assert all(0.0 <= r['eval_bleu'] <= 100.0 for r in eval_rows)
  # Lowercasing can only merge n-grams, so it never lowers a match count.
  assert all(r['eval_bleu'] <= r['eval_bleu_lc'] <= 100.0 for r in eval_rows)
  assert np.isfinite(final['eval_perplexity'])
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['30', '60']
  assert json.loads((tmp_path / 'config.json').read_text())['model']['d_model'] == 32
  assert list((tmp_path / 'tensorboard').iterdir())


@pytest.mark.full_data  # Quality smoke run: what configs/tiny.py's docstring promises.
def test_tiny_on_the_real_multi30k_reaches_the_loss_its_docstring_states(
  multi30k_dir, multi30k_data_dir, tmp_path
):
  """As a user runs it: train.py at XLA's default optimisation level, not the tests' level 0
  (conftest), which rounds differently in the last bits."""
  flags = [f for f in os.environ['XLA_FLAGS'].split() if f != conftest.TESTS_XLA_FLAG]
  result = subprocess.run(
    [
      sys.executable,
      'train.py',
      '--config=configs/tiny.py',
      f'--workdir={tmp_path}',
      f'--config.data.manual_dir={multi30k_dir}',
      f'--config.data.data_dir={multi30k_data_dir}',
      '--config.eval_bleu_sentences=0',
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': ' '.join(flags)},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  train_losses = [r['train_loss'] for r in _metrics(tmp_path) if 'train_loss' in r]
  assert train_losses[0] > 5.5 and train_losses[-1] < 5.0, train_losses


def test_tiny_trains_in_bfloat16_with_float32_parameters(data_dirs, tmp_path):
  config = _tiny_config(
    data_dirs,
    dtype='bfloat16',
    num_train_steps=40,
    eval_every_steps=40,
    checkpoint_every_steps=40,
    eval_bleu_sentences=0,
  )
  training.train_and_evaluate(config, str(tmp_path), profile_steps=2)
  # Steps 2 and 3 were traced for TensorBoard's profile plugin.
  assert list((tmp_path / 'profile').glob('plugins/profile/*/*.xplane.pb'))
  train_losses = [r['train_loss'] for r in _metrics(tmp_path) if 'train_loss' in r]
  assert all(np.isfinite(train_losses)) and train_losses[-1] < train_losses[0] - 0.3, train_losses
  _, params, opt_state = _final_params(tmp_path)
  assert {str(x.dtype) for x in jax.tree.leaves((params, opt_state))} <= {'float32', 'int32'}
  # Activations and matmuls run in bfloat16: the logits, handed to the loss as float32, hold
  # only bfloat16 values (a float32 computation would almost never round to them exactly).
  model, _ = train_steps.create_models(ModelConfig.from_config(config))
  tokens = np.arange(3, 11, dtype=np.int32)[None]
  logits = model.apply({'params': params}, tokens, tokens, rngs={'dropout': jax.random.key(0)})
  assert logits.dtype == np.float32
  np.testing.assert_array_equal(logits, logits.astype(jax.numpy.bfloat16).astype(np.float32))


def test_stopped_and_resumed_run_equals_uninterrupted(data_dirs, tmp_path):
  overrides = dict(
    num_train_steps=20, checkpoint_every_steps=10, eval_every_steps=10, log_every_steps=5
  )
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  training.train_and_evaluate(_tiny_config(data_dirs, **overrides), str(straight))
  # Stop after 10 steps; a later invocation with the full step count resumes.
  training.train_and_evaluate(
    _tiny_config(data_dirs, **{**overrides, 'num_train_steps': 10}), str(resumed)
  )
  training.train_and_evaluate(_tiny_config(data_dirs, **overrides), str(resumed))

  step_a, params_a, opt_a = _final_params(straight)
  step_b, params_b, opt_b = _final_params(resumed)
  assert step_a == step_b == 20
  for a, b in zip(
    jax.tree.leaves((params_a, opt_a)), jax.tree.leaves((params_b, opt_b)), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  strip = lambda rows: [{k: v for k, v in r.items() if k not in _TIMING} for r in rows]
  # The resumed run re-logs step 10's evaluation; compare the rows step by step.
  rows_a = {(r['step'], tuple(sorted(r))): r for r in strip(_metrics(straight))}
  rows_b = {(r['step'], tuple(sorted(r))): r for r in strip(_metrics(resumed))}
  assert rows_a == rows_b
  # The resumed run's clock goes on from the rows it kept: never backwards.
  clock = [r['wall_seconds'] for r in _metrics(resumed)]
  assert len(clock) == len(_metrics(resumed)) and clock == sorted(clock) and clock[0] > 0


def test_wall_seconds_go_on_from_the_kept_rows_and_stay_out_of_older_runs(tmp_path):
  """A resume adds its own time to the last kept row's; a run without the key gets none."""
  run = tmp_path / 'run'
  run.mkdir()
  first = metrics.MetricsWriter(str(run), started=time.time() - 100.0)
  first.write(10, {'train_loss': 2.0})
  first.write(20, {'train_loss': 1.5})  # After the checkpoint at 10: dropped on resume.
  first.close()
  resumed = metrics.MetricsWriter(str(run), started=time.time() - 5.0)
  resumed.truncate_after(10)
  resumed.write(20, {'train_loss': 1.4})
  resumed.close()
  rows = _metrics(run)
  assert [r['step'] for r in rows] == [10, 20]
  assert 100.0 <= rows[0]['wall_seconds'] < 160.0
  assert 5.0 <= rows[1]['wall_seconds'] - rows[0]['wall_seconds'] < 65.0

  older = tmp_path / 'older'
  older.mkdir()
  (older / metrics.FILENAME).write_text(json.dumps({'step': 10, 'train_loss': 2.0}) + '\n')
  resumed = metrics.MetricsWriter(str(older), started=time.time())
  resumed.truncate_after(10)
  resumed.write(20, {'train_loss': 1.4})
  resumed.close()
  assert [sorted(r) for r in _metrics(older)] == [['step', 'train_loss']] * 2


def test_tensorboard_shows_each_step_once_after_a_resume_from_an_earlier_checkpoint(tmp_path):
  """The steps a crashed run logged past its checkpoint are hidden once the resume logs them."""
  first = metrics.MetricsWriter(str(tmp_path))
  first.truncate_after(0)
  for step in range(1, 6):  # Crashed after step 5; its last checkpoint is at step 3.
    first.write(step, {'train_loss': 10.0 - step})
  # No close: written row by row, like metrics.jsonl, as a process killed there leaves them.
  before = conftest.tensorboard_scalars(tmp_path / 'tensorboard')
  assert before == {'train_loss': [(s, 10.0 - s) for s in range(1, 6)]}
  resumed = metrics.MetricsWriter(str(tmp_path))
  resumed.truncate_after(3)
  for step in range(4, 8):
    resumed.write(step, {'train_loss': 20.0 - step})
  resumed.close()
  assert len(os.listdir(tmp_path / 'tensorboard')) == 2  # One file per start.
  assert conftest.tensorboard_scalars(tmp_path / 'tensorboard') == {
    'train_loss': [(1, 9.0), (2, 8.0), (3, 7.0), (4, 16.0), (5, 15.0), (6, 14.0), (7, 13.0)]
  }
  assert [r['step'] for r in _metrics(tmp_path)] == list(range(1, 8))
  first.close()


def _best_params(workdir):
  """{step: params} of WORKDIR/best_checkpoints."""
  best = os.path.join(workdir, 'best_checkpoints')
  steps = sorted(int(name) for name in os.listdir(best) if name.isdigit())
  restore = ocp.StandardCheckpointer().restore
  return {step: restore(os.path.join(best, str(step), 'default')) for step in steps}


def test_best_checkpoints_resume_exactly_and_early_stopping_stays_stopped(data_dirs, tmp_path):
  overrides = dict(
    num_train_steps=20,
    eval_every_steps=5,
    checkpoint_every_steps=10,
    log_every_steps=5,
    keep_best_checkpoints=2,
  )
  straight, resumed, stopped = tmp_path / 'straight', tmp_path / 'resumed', tmp_path / 'stopped'
  training.train_and_evaluate(_tiny_config(data_dirs, **overrides), str(straight))
  bleus = {r['step']: r['eval_bleu'] for r in _metrics(straight) if 'eval_bleu' in r}
  assert sorted(bleus) == [5, 10, 15, 20]
  # The parameters of the 2 evaluations with the highest validation BLEU are kept.
  kept = _best_params(straight)
  assert len(kept) == 2
  assert sorted((bleus[s] for s in kept), reverse=True) == sorted(bleus.values(), reverse=True)[:2]
  # Each is stored with both validation BLEUs, the cased one ranking them
  # (configs/tiny.py targets eval_loss: selection reads eval_bleu).
  lowercased = {r['step']: r['eval_bleu_lc'] for r in _metrics(straight) if 'eval_bleu_lc' in r}
  stored = best_checkpoints.BestCheckpoints(str(straight), read_only=True)
  assert stored.scores() == {s: bleus[s] for s in sorted(kept, key=lambda s: (-bleus[s], s))}
  stored.close()
  by_lc = best_checkpoints.BestCheckpoints(str(straight), metric='eval_bleu_lc', read_only=True)
  assert by_lc.scores() == {s: lowercased[s] for s in sorted(kept, key=lambda s: -lowercased[s])}
  by_lc.close()
  # They were kept by eval_bleu: a resume that would rank them by eval_bleu_lc is refused.
  for target, keep, refused in (
    ('eval_bleu', 2, False),
    ('eval_bleu_lc', 2, True),
    ('eval_bleu_lc', 0, True),  # They stay, and eval.py --checkpoint=best would read them.
    ('eval_loss', 0, False),
  ):
    resume = _tiny_config(
      data_dirs, **{**overrides, 'target_metric': target, 'keep_best_checkpoints': keep}
    )
    if refused:
      with pytest.raises(ValueError, match=r'were kept by eval_bleu .* rank them by eval_bleu_lc'):
        runs.check_resume(resume, str(straight))
    else:
      runs.check_resume(resume, str(straight))
  final_step, final_params, _ = _final_params(straight)
  if final_step in kept:  # Then they are the final checkpoint's parameters.
    jax.tree.map(np.testing.assert_array_equal, kept[final_step], final_params)

  # A run that dies after evaluating step 15 but before checkpointing it: its best checkpoint of
  # step 15 (if kept) belongs to a lost timeline; the resumed run evaluates step 15 again.
  training.train_and_evaluate(
    _tiny_config(data_dirs, **{**overrides, 'num_train_steps': 15}), str(resumed)
  )
  shutil.rmtree(resumed / 'checkpoints' / '15')
  training.train_and_evaluate(_tiny_config(data_dirs, **overrides), str(resumed))
  again = _best_params(resumed)
  assert sorted(again) == sorted(kept)
  jax.tree.map(np.testing.assert_array_equal, again, kept)

  # Early stopping after 1 evaluation without a higher BLEU, at the step the straight run's
  # BLEUs say (by hand: the first evaluation not above every earlier one).
  expected = next(
    (s for s in sorted(bleus) if any(bleus[s] <= bleus[p] for p in bleus if p < s)), None
  )
  assert expected is not None, f'no evaluation without improvement to stop at: {bleus}'
  config = _tiny_config(data_dirs, **overrides, early_stopping_patience=1)
  training.train_and_evaluate(config, str(stopped))
  rows = _metrics(stopped)
  assert max(r['step'] for r in rows) == expected
  assert max(int(n) for n in os.listdir(stopped / 'checkpoints') if n.isdigit()) == expected
  # The same command again trains nothing: the run stays stopped.
  training.train_and_evaluate(config, str(stopped))
  assert max(r['step'] for r in _metrics(stopped)) == expected
  assert [r for r in _metrics(stopped) if 'train_loss' in r] == [
    r for r in rows if 'train_loss' in r
  ]


def test_best_checkpoints_keep_the_best_by_their_metric_and_refuse_an_unstored_one(tmp_path):
  params = {'w': np.arange(3, dtype=np.float32)}
  # Step: (cased, lowercased) validation BLEU. The 2 best cased: 10, 15; lowercased: 15, 5.
  bleus = {5: (3.0, 4.0), 10: (5.0, 3.5), 15: (4.0, 6.0)}
  for metric, expected in (('eval_bleu', {10: 5.0, 15: 4.0}), ('eval_bleu_lc', {15: 6.0, 5: 4.0})):
    workdir = str(tmp_path / metric)
    best = best_checkpoints.BestCheckpoints(workdir, metric=metric, keep=2)
    for step, (cased, lowercased) in bleus.items():
      best.save(step, params, {'eval_bleu': cased, 'eval_bleu_lc': lowercased, 'eval_loss': 2.0})
    best.close()
    kept = best_checkpoints.BestCheckpoints(workdir, metric=metric, read_only=True)
    assert kept.scores() == expected and list(kept.scores()) == list(expected)  # Best first.
    kept.close()
  # Best checkpoints of a run from before eval_bleu_lc store eval_bleu alone.
  older = tmp_path / 'older' / best_checkpoints.DIRECTORY
  manager = ocp.CheckpointManager(
    str(older), options=ocp.CheckpointManagerOptions(best_fn=lambda m: m['eval_bleu'])
  )
  manager.save(5, args=ocp.args.StandardSave(params), metrics={'eval_bleu': 3.0})
  manager.close()
  assert best_checkpoints.BestCheckpoints(str(older.parent), read_only=True).scores() == {5: 3.0}
  with pytest.raises(ValueError, match=r'Best checkpoints \[5\] .* carry no eval_bleu_lc'):
    best_checkpoints.BestCheckpoints(str(older.parent), metric='eval_bleu_lc', keep=2)
  with pytest.raises(ValueError, match="metric='eval_loss' is not one of"):
    best_checkpoints.BestCheckpoints(str(older.parent), metric='eval_loss')
  assert sorted(os.listdir(older)) == ['5']


def test_early_stopping_counts_evaluations_since_the_best_bleu(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  rows = [
    {'step': 5, 'train_loss': 5.0},
    {'step': 5, 'eval_loss': 4.0, 'eval_bleu': 1.0},
    {'step': 10, 'eval_loss': 3.9, 'eval_bleu': 2.0},
    {'step': 15, 'eval_loss': 3.8, 'eval_bleu': 2.0},  # A tie does not improve.
    {'step': 15, 'eval_loss': 3.8, 'eval_bleu': 2.0},  # Step 15 evaluated again by a resume.
    {'step': 20, 'eval_loss': 3.7, 'eval_bleu': 1.5},
    {'step': 25, 'eval_loss': 3.6, 'eval_bleu': 9.0},  # After the checkpoint: not counted.
  ]
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 30, "eval_b')
  stopping = runs.EarlyStopping(patience=2).replay(str(path), last_step=20)
  assert (stopping.best, stopping.best_step, stopping.since_best) == (2.0, 10, 2)
  assert stopping.stop
  assert not runs.EarlyStopping(patience=3).replay(str(path), last_step=20).stop
  assert not runs.EarlyStopping(patience=0).replay(str(path), last_step=20).stop  # Off.
  stopping.record(30, 2.5)
  assert (stopping.best_step, stopping.since_best, stopping.stop) == (30, 0, False)
  fresh = runs.EarlyStopping(patience=1).replay(str(tmp_path / 'none.jsonl'), last_step=0)
  assert fresh.best_step is None and not fresh.stop
  # By the lowercased BLEU (config.target_metric='eval_bleu_lc'): rows without it do not count.
  lowercased = [
    {'step': 5, 'eval_bleu': 1.0, 'eval_bleu_lc': 1.5},
    {'step': 10, 'eval_bleu': 2.0},
    {'step': 15, 'eval_bleu': 2.0, 'eval_bleu_lc': 1.2},
    {'step': 20, 'eval_bleu': 1.5, 'eval_bleu_lc': 1.8},
  ]
  path.write_text(''.join(json.dumps(r) + '\n' for r in lowercased))
  stopping = runs.EarlyStopping(patience=1, metric='eval_bleu_lc').replay(str(path), 20)
  assert (stopping.best, stopping.best_step, stopping.since_best) == (1.8, 20, 0)
  cased = runs.EarlyStopping(patience=1).replay(str(path), 20)
  assert (cased.best, cased.best_step, cased.since_best) == (2.0, 10, 2)


def test_incompatible_checkpoint_is_reported_and_kept(data_dirs, tmp_path):
  config = _tiny_config(
    data_dirs, num_train_steps=2, checkpoint_every_steps=2, eval_every_steps=2, log_every_steps=1
  )
  training.train_and_evaluate(config, str(tmp_path))
  before = sorted(p.relative_to(tmp_path) for p in (tmp_path / 'checkpoints').rglob('*'))
  wider = _tiny_config(data_dirs, **{'num_train_steps': 4, 'model.d_ff': 48})
  with pytest.raises(ValueError, match=r'(?s)belong to another model.*config.model.d_ff: 64 -> 48'):
    training.train_and_evaluate(wider, str(tmp_path))
  assert json.loads((tmp_path / 'config.json').read_text())['model']['d_ff'] == 64
  # Without the config that wrote them, the checkpoints' arrays themselves are compared.
  (tmp_path / 'config.json').unlink()
  expected = r'(?s)incompatible model.*ffn.*\(32, 64\) vs model \(32, 48\)'
  with pytest.raises(ValueError, match=expected):
    training.train_and_evaluate(wider, str(tmp_path))
  after = sorted(p.relative_to(tmp_path) for p in (tmp_path / 'checkpoints').rglob('*'))
  assert before == after


def _train_py(*args, cwd=REPO):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  return subprocess.run(
    [sys.executable, 'train.py', *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.parametrize(
  ('config', 'expected'),
  [
    ('configs/wmt14_ende_base.py', '63.1M'),
    ('configs/wmt14_ende_big.py', '214.2M'),
  ],
)
def test_dry_run_reports_paper_parameter_counts(config, expected):
  result = _train_py(f'--config={config}', '--config.vocab_size=37000', '--dry_run')
  assert result.returncode == 0, result.stderr
  last = result.stdout.strip().splitlines()[-1]
  assert last.startswith(f'params: {expected}'), last
  assert 'FLOPs per target token' in result.stdout


def test_unknown_config_key_is_an_error_before_anything_runs(tmp_path):
  result = _train_py(
    '--config=configs/tiny.py', '--config.model.num_layer=3', f'--workdir={tmp_path}'
  )
  assert result.returncode == 1
  # A flag error naming the flag and the nearest key, as absl reports others; no traceback.
  assert result.stderr.strip().splitlines()[-2:] == [
    'FATAL Flags parsing error: --config.model.num_layer: the config has no key '
    'model.num_layer. Did you mean "num_layers" instead of "num_layer"?',
    'Pass --helpshort or --helpfull to see help on flags.',
  ], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not list(tmp_path.iterdir())


def test_heads_must_divide_d_model(tmp_path):
  result = _train_py('--config=configs/tiny.py', '--config.model.num_heads=3', '--dry_run')
  assert result.returncode != 0
  assert 'config.model.d_model=32 is not divisible by config.model.num_heads=3' in result.stderr


def test_dry_run_needs_no_workdir_or_data():
  result = _train_py(
    '--config=configs/tiny.py', '--dry_run', '--config.data.manual_dir=/nonexistent'
  )
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().splitlines()[-1] == 'params: 0.038M (37760)'


def test_input_wait_is_reported_per_step_and_warns_once_when_input_bound(caplog):
  class Prefetch:  # Stands for input_pipeline.DevicePrefetch: seconds spent in `next`.
    wait_seconds = 0.0

  prefetch = Prefetch()
  wait = metrics.InputWait(prefetch, num_workers=0)
  prefetch.wait_seconds = 0.016  # 8 steps at 300 steps/s: 60% of the time, but 2 ms a step.
  assert wait.per_step_ms(8, 300.0) == pytest.approx(2.0)
  prefetch.wait_seconds += 0.5  # 10 steps at 4 steps/s (2.5 s): 20% of the time on input.
  assert wait.per_step_ms(10, 4.0) == pytest.approx(50.0)
  assert 'Input-bound' not in caplog.text
  prefetch.wait_seconds += 2.0  # Then 80%: the steps wait for data.
  assert wait.per_step_ms(10, 4.0) == pytest.approx(200.0)
  assert 'Input-bound: the training loop spent 80% of its time getting batches' in caplog.text
  assert 'config.data.num_workers' in caplog.text
  prefetch.wait_seconds += 2.0
  wait.per_step_ms(10, 4.0)
  assert caplog.text.count('Input-bound') == 1  # Once per run.
