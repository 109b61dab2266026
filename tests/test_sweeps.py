"""Sweeps: the sweep-building helpers and trial names; sweep.py end to end on configs/tiny.py."""

import concurrent.futures
import csv
import dataclasses
import importlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import conftest
import jax
import numpy as np
import pytest
from conftest import synthetic_pairs, write_lines

from configs import tiny
from transformer import config as config_lib
from transformer import provenance, ranking, scoring, workdir_lock
from transformer.tools import (
  significance,
  sweep_plots,
  sweep_results,
  sweep_runner,
  sweep_summary,
  sweep_tests,
  sweeps,
)

REPO = Path(__file__).resolve().parents[1]

# Trials of 6 steps with one validation pass: a trial is a train.py process of a few seconds.
TINY_TRIAL_FLAGS = (
  '--config.num_train_steps=6',
  '--config.eval_every_steps=6',
  '--config.log_every_steps=3',
  '--config.checkpoint_every_steps=3',
  '--config.eval_bleu_sentences=0',
)


# --- Helpers, names and checks (no training) ------------------------------------------------------

SHIPPED_SWEEPS = sorted(
  p.name for p in (REPO / 'configs' / 'sweeps').glob('*.py') if p.stem != '__init__'
)


@pytest.mark.parametrize('sweep_file', SHIPPED_SWEEPS)
def test_every_shipped_sweep_gives_valid_trials_of_the_config_its_command_names(sweep_file):
  """The command in each sweep file's docstring runs: every trial of it is a valid config."""
  text = (REPO / 'configs' / 'sweeps' / sweep_file).read_text()
  [config_name] = set(re.findall(r'--config=configs/(\w+)\.py', text))
  config = importlib.import_module(f'configs.{config_name}').get_config()
  # The command's --config.KEY=VALUE flags set KEY for every trial; a trial may not set it too.
  fixed = {
    key: value
    for key, value in re.findall(r'--config\.([\w.]+)=(\S+)', text)
    if key != 'data.manual_dir'
  }
  trials = sweeps.make_trials(
    config, sweeps.load_overrides(str(REPO / 'configs' / 'sweeps' / sweep_file)), fixed=fixed
  )
  assert trials and len({trial.name for trial in trials}) == len(trials)


def test_grid_is_every_combination_first_axis_slowest():
  assert sweeps.grid({'a': [1, 2], 'b': ['x', 'y']}) == [
    {'a': 1, 'b': 'x'},
    {'a': 1, 'b': 'y'},
    {'a': 2, 'b': 'x'},
    {'a': 2, 'b': 'y'},
  ]


def test_zipped_pairs_values_and_rejects_unequal_lengths():
  assert sweeps.zipped({'a': [1, 2], 'b': [3, 4]}) == [{'a': 1, 'b': 3}, {'a': 2, 'b': 4}]
  with pytest.raises(ValueError, match=r"differ in length: \{'a': 2, 'b': 1\}"):
    sweeps.zipped({'a': [1, 2], 'b': [3]})
  with pytest.raises(ValueError, match="'a' must be a non-empty list"):
    sweeps.grid({'a': 'abc'})


def test_one_at_a_time_and_product():
  assert sweeps.one_at_a_time({'a': [1, 2], 'b': [3]}) == [{}, {'a': 1}, {'a': 2}, {'b': 3}]
  assert sweeps.product(sweeps.zipped({'a': [1, 2]}), [{'b': 0}, {'c': 0}]) == [
    {'a': 1, 'b': 0},
    {'a': 1, 'c': 0},
    {'a': 2, 'b': 0},
    {'a': 2, 'c': 0},
  ]
  with pytest.raises(ValueError, match=r"both set \['a'\]"):
    sweeps.product([{'a': 1}], [{'a': 2}])


def test_random_search_is_seeded_distinct_rounded_and_in_range():
  space = {
    'lr_scale': sweeps.log_uniform(0.1, 10.0),
    'dropout': sweeps.uniform(0.0, 0.3),
    'layers': sweeps.int_uniform(1, 3),
    'norm': sweeps.choice(['pre_ln', 'post_ln']),
  }
  draws = sweeps.random_search(space, num_trials=20, seed=3)
  assert draws == sweeps.random_search(space, num_trials=20, seed=3)
  assert draws != sweeps.random_search(space, num_trials=20, seed=4)
  assert len({tuple(sorted(d.items())) for d in draws}) == 20
  for draw in draws:
    assert 0.1 <= draw['lr_scale'] <= 10.0 and 0.0 <= draw['dropout'] <= 0.3
    assert draw['layers'] in (1, 2, 3) and draw['norm'] in ('pre_ln', 'post_ln')
    assert draw['lr_scale'] == float(f'{draw["lr_scale"]:.3g}')
  with pytest.raises(ValueError, match='only 2 distinct trials'):
    sweeps.random_search({'norm': sweeps.choice(['a', 'b'])}, num_trials=3, seed=0)


def test_trial_names_are_readable_safe_stable_and_unique():
  config = tiny.get_config()
  trials = sweeps.make_trials(
    config,
    [
      {'model.num_layers': 2, 'lr_scale': 2},  # An int for a float field: named as the float.
      {'data.max_len': 16, 'model.max_len': 64},  # Same last component: full keys.
      {'data.manual_dir': '/data/my corpus'},
      {},
    ],
  )
  assert [t.name for t in trials] == [
    'lr_scale=2.0,num_layers=2',
    'data.max_len=16,model.max_len=64',
    'manual_dir=_data_my_corpus',
    'base',
  ]
  assert trials[0].overrides == {'model.num_layers': 2, 'lr_scale': 2.0}
  assert trials[0].config.model.num_layers == 2 and config.model.num_layers == 1
  with pytest.raises(ValueError, match='trials 0 and 1 are the same run'):
    sweeps.make_trials(config, [{'lr_scale': 2.0}, {'lr_scale': 2}])
  long_name = sweeps.make_trials(config, [{'data.manual_dir': 'x' * 300}])[0].name
  assert len(long_name) == 120


@pytest.mark.parametrize(
  ('overrides', 'message'),
  [
    (
      {'model.num_layer': 3},
      r"trial 1 .*'model.num_layer' is not a key of the config\. "
      r"Did you mean 'model.num_layers'",
    ),
    (
      {'model.num_layers': 2.5},
      r'model.num_layers=2.5 has type float, but config.model.num_layers '
      r'has type int',
    ),
    ({'model.use_bias': 0}, 'has type int, but config.model.use_bias has type bool'),
    ({'model.num_layers': True}, 'has type bool, but config.model.num_layers has type int'),
    ({'model': 3}, "'model' is a group of config keys"),
    ({'data.vocab_path': None}, 'only str, int, float and bool values'),
  ],
)
def test_bad_overrides_are_errors_naming_trial_and_key(overrides, message):
  with pytest.raises(ValueError, match=message):
    sweeps.make_trials(tiny.get_config(), [{'lr_scale': 1.0}, overrides])


def test_command_line_overrides_may_not_be_swept_too():
  with pytest.raises(ValueError, match=r"trial 0 sets \['lr_scale'\], which the command line"):
    sweeps.make_trials(tiny.get_config(), [{'lr_scale': 1.0}], fixed={'lr_scale': 2.0})


def test_trial_status_tells_a_running_trial_from_an_interrupted_one(tmp_path):
  workdir = tmp_path / 'trial'
  assert sweep_runner.trial_status(str(workdir)) == 'pending'
  workdir.mkdir()
  # A live process whose command line names the workdir, as train.py's does.
  process = subprocess.Popen(
    [
      sys.executable,
      '-c',
      'import time; print("up", flush=True); time.sleep(60)',
      f'--workdir={workdir}',
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert process.stdout.readline() == 'up\n'  # Started: its command line is readable.
    for pid, host, expected in [
      (process.pid, socket.gethostname(), 'running'),
      (os.getpid(), socket.gethostname(), 'interrupted'),  # Alive, but not the trial's.
      (None, socket.gethostname(), 'interrupted'),  # No process: stopped between stages.
      (process.pid, 'another-host', 'running'),  # Cannot be looked at: trust the record.
    ]:
      state = {'status': 'running', 'pid': pid, 'host': host, 'stages': {}}
      (workdir / sweep_runner.STATE_FILE).write_text(json.dumps(state))
      assert sweep_runner.trial_status(str(workdir)) == expected, (pid, host)
  finally:
    process.kill()
    process.wait()
    process.stdout.close()
  state['host'] = socket.gethostname()
  (workdir / sweep_runner.STATE_FILE).write_text(json.dumps(state | {'pid': process.pid}))
  assert sweep_runner.trial_status(str(workdir)) == 'interrupted'  # The process is gone.


class _StandInSweep(sweeps.Sweep):
  """A sweep whose train stage is a stand-in for train.py: it commits a checkpoint at step
  `config.seed`, then exits 0 on SIGTERM as train.py does once it has checkpointed, or, where
  that step ends the run, after `end_seconds` (its final evaluation)."""

  end_seconds = 0

  def commands(self, trial):
    step = trial.config.seed
    last = step >= trial.config.num_train_steps
    script = (
      'import os, signal, sys, time\n'
      f'os.makedirs(os.path.join(sys.argv[1], "checkpoints", "{step}"))\n'
      'signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n'
      'print("up", flush=True)\n'
      f'time.sleep({self.end_seconds if last else 60})\n'
    )
    return [('train', [sys.executable, '-c', script, self.workdir(trial)])]


class _EvaluatingStandInSweep(_StandInSweep):
  end_seconds = 60  # Still in its final evaluation when the sweep stops it.


def _run_stand_in(
  root: Path, step: int, stop, sweep_class: type[_StandInSweep] = _StandInSweep
) -> tuple[str, dict]:
  """Runs the stand-in trial to `step` of configs/tiny.py's 60, calling `stop(runner)` once it
  is up; returns the trial's outcome and its recorded state."""
  config = tiny.get_config()
  config.seed = step
  trial = sweeps.Trial(name='base', overrides={}, config=config)
  sweep = sweep_class(
    config_file='tiny.py',
    config=config,
    shared_overrides={},
    sweep_file='sweep.py',
    root=str(root),
    trials=(trial,),
  )
  runner = sweep_runner._Runner(sweep)
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    outcome = pool.submit(runner.run_trial, trial)
    log = root / 'base' / 'train.log'
    # The log's first line is the command, which contains the script: wait for its output line.
    while '\nup\n' not in (log.read_text() if log.exists() else ''):
      assert not outcome.done(), outcome.result()
      time.sleep(0.05)
    stop(runner)
    result = outcome.result(timeout=30)
  state = sweep_runner.read_state(str(root / 'base'))
  assert state['stages']['train']['returncode'] == 0  # train.py's exit after a SIGTERM.
  assert state['stages']['train']['status'] == result
  assert sweep_runner.trial_status(str(root / 'base')) == result
  return result, state


def test_a_stopped_trial_is_interrupted_although_train_py_exits_0(tmp_path):
  result, _ = _run_stand_in(tmp_path, 40, lambda runner: runner.stop())
  assert result == 'interrupted'  # Runs again next time.


def test_a_trial_stopped_after_its_last_step_is_finished_not_interrupted(tmp_path):
  """A notice that comes once the last checkpoint is committed leaves nothing to resume."""
  result, state = _run_stand_in(tmp_path, 60, lambda runner: runner.stop(), _EvaluatingStandInSweep)
  assert result == 'finished'
  assert state['status'] == 'finished'


def _kill_from_outside(runner):
  """SIGTERM from someone else (a preemption, a kill by hand): the runner is not stopping."""
  for process in list(runner._processes.values()):
    process.send_signal(signal.SIGTERM)


def test_train_py_stopped_from_outside_the_sweep_is_interrupted_not_finished(tmp_path):
  """The trial is finished only where its newest checkpoint is at config.num_train_steps."""
  result, _ = _run_stand_in(tmp_path / 'killed', 40, _kill_from_outside)
  assert result == 'interrupted'
  result, _ = _run_stand_in(tmp_path / 'ended', 60, lambda runner: None)  # Exits 0 at step 60.
  assert result == 'finished'


def _write_sweep(path: Path, body: str) -> Path:
  path.write_text(f'from transformer.tools import sweeps\n\n\ndef sweep():\n  return {body}\n')
  return path


def test_a_trial_whose_workdir_another_run_holds_is_left_alone(tmp_path):
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  sweep = sweeps.create(
    'configs/tiny.py', tiny.get_config(), str(sweep_file), str(tmp_path / 'root')
  )
  workdir = Path(sweep.workdir(sweep.trials[0]))
  workdir.mkdir(parents=True)
  with workdir_lock.WorkdirLock(str(workdir)):  # A train.py started by hand, say.
    assert sweep_runner.run(sweep) == {'seed=1': 'running'}
    assert os.listdir(workdir) == [workdir_lock.LOCK_FILE]  # No train.py was started.


def test_dry_run_prints_train_commands_and_writes_nothing(tmp_path):
  sweep_file = _write_sweep(tmp_path / 's.py', "sweeps.grid({'lr_scale': [1.0, 2.0]})")
  config = tiny.get_config()
  config.data.manual_dir = '/corpus'
  sweep = sweeps.create(
    'configs/tiny.py',
    config,
    str(sweep_file),
    str(tmp_path / 'root'),
    shared_overrides={'data.manual_dir': '/corpus'},
    eval_flags=['--split=validation'],
  )
  lines = sweep_runner.dry_run(sweep)
  assert lines[1].startswith('# lr_scale=1.0 [train, new]\n')
  train_command = lines[1].splitlines()[1]
  assert f'train.py --config={REPO}/configs/tiny.py --workdir={tmp_path}/root/lr_scale=1.0' in (
    train_command
  )
  assert train_command.endswith(' --config.data.manual_dir=/corpus --config.lr_scale=1.0')
  assert (
    lines[2]
    .splitlines()[1]
    .endswith(f'eval.py --workdir={tmp_path}/root/lr_scale=1.0 --split=validation')
  )
  assert len(lines) == 5
  assert not (tmp_path / 'root').exists()


def test_seeds_repeat_every_trial_seed_slowest_and_group_them(tmp_path):
  sweep_file = _write_sweep(tmp_path / 's.py', "[{}, {'lr_scale': 2.0}]")
  config = tiny.get_config()
  config.seed = 5
  sweep = sweeps.create('configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'), seeds=2)
  assert [(t.name, t.group) for t in sweep.trials] == [
    ('seed=5', 'base'),
    ('lr_scale=2.0,seed=5', 'lr_scale=2.0'),
    ('seed=6', 'base'),
    ('lr_scale=2.0,seed=6', 'lr_scale=2.0'),
  ]
  assert sweep.trials[3].config.seed == 6 and sweep.trials[3].config.lr_scale == 2.0
  assert sweep_runner.sweep_command(sweep)[-1] == '--seeds=2'
  with pytest.raises(ValueError, match='seeds=0 must be an integer >= 1'):
    sweeps.create('configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'), seeds=0)
  seeded = _write_sweep(tmp_path / 'seeded.py', "[{'seed': 1}]")
  with pytest.raises(ValueError, match=r"trial 0 \{'seed': 1\} sets seed, which --seeds=3"):
    sweeps.create('configs/tiny.py', config, str(seeded), str(tmp_path / 'root'), seeds=3)
  with pytest.raises(ValueError, match='the command line may not set it too'):
    sweeps.create(
      'configs/tiny.py',
      config,
      str(sweep_file),
      str(tmp_path / 'root'),
      shared_overrides={'seed': 1},
      seeds=3,
    )
  with pytest.raises(
    ValueError,
    match=r'--compare_to=lr_scale=3.0 is not a configuration of '
    r".*\['base', 'lr_scale=2.0'\]\. Did you mean 'lr_sca",
  ):
    sweeps.create(
      'configs/tiny.py',
      config,
      str(sweep_file),
      str(tmp_path / 'root'),
      seeds=2,
      compare_to='lr_scale=3.0',
    )
  with pytest.raises(ValueError, match='add --seeds'):
    sweeps.create(
      'configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'), compare_to='base'
    )
  sweep = sweeps.create(
    'configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'), seeds=2, compare_to='base'
  )
  assert sweep_runner.sweep_command(sweep)[-2:] == ['--seeds=2', '--compare_to=base']


def _fake_trial(workdir, eval_loss, references, hypotheses):
  """What a finished trial with an eval.py stage leaves in its workdir."""
  write_lines(
    workdir / 'metrics.jsonl',
    [
      json.dumps({'step': 6, 'train_loss': eval_loss + 1, 'tokens_per_sec': 100.0}),
      json.dumps({'step': 6, 'eval_loss': eval_loss}),
    ],
  )
  write_lines(workdir / 'eval' / 'references-validation.txt', references)
  write_lines(workdir / 'eval' / 'step_6-validation.txt', hypotheses)
  results = scoring.corpus_scores(hypotheses, references) | {
    'split': 'validation',
    'unscored_lines': [],
    'references_sha256': scoring.references_digest(references),
  }
  (workdir / 'eval' / 'step_6-validation.json').write_text(json.dumps(results))
  stage = {'status': 'finished', 'command': []}
  (workdir / sweep_runner.STATE_FILE).write_text(
    json.dumps(
      {
        'status': 'finished',
        'stages': {'train': stage, 'eval': stage | {'result': 'eval/step_6-validation.json'}},
      }
    )
  )


@pytest.mark.parametrize('target_metric', ['eval_bleu', 'eval_bleu_lc'])
def test_summary_ranks_by_the_targeted_bleu_cased_or_lowercased(tmp_path, target_metric):
  config = tiny.get_config()
  config.target_metric = target_metric
  sweep_file = _write_sweep(tmp_path / 's.py', "sweeps.grid({'lr_scale': [1.0, 2.0, 4.0]})")
  sweep = sweeps.create('configs/tiny.py', config, str(sweep_file), str(tmp_path / 'root'))
  # Per trial: (eval_bleu, eval_bleu_lc) of its evaluations. The best cased BLEU (lr_scale=2.0,
  # 14.0) is not the best lowercased one (lr_scale=1.0, 13.5); lr_scale=4.0 ran before
  # eval_bleu_lc was logged, so it has none and follows the ranked trials when that is the target.
  evaluations = {1.0: [(10.0, 11.0), (12.0, 13.5)], 2.0: [(14.0, 13.0)], 4.0: [(9.0, None)]}
  for trial in sweep.trials:
    rows = [{'step': 5, 'train_loss': 5.0, 'tokens_per_sec': 100.0}] + [
      {'step': 5 * (i + 1), 'eval_loss': 4.0, 'eval_bleu': cased}
      | ({} if lc is None else {'eval_bleu_lc': lc})
      for i, (cased, lc) in enumerate(evaluations[trial.overrides['lr_scale']])
    ]
    write_lines(Path(sweep.workdir(trial)) / 'metrics.jsonl', [json.dumps(r) for r in rows])

  # Each value config.target_metric may take ranks, by a column the summary has.
  for name in ranking.TARGET_METRICS:
    assert not config_lib.CONFIG_RULES['target_metric'].error('target_metric', name)
    assert ranking.METRICS[name].summary_column in sweep_results.TrialResult.__dataclass_fields__
  results = sweep_summary.write(sweep)
  ranked = [(r.overrides['lr_scale'], r.rank) for r in results]
  if target_metric == 'eval_bleu':
    assert ranked == [(2.0, 1), (1.0, 2), (4.0, 3)]
  else:
    assert ranked == [(1.0, 1), (2.0, 2), (4.0, None)]
  rows = list(csv.DictReader((tmp_path / 'root' / 'summary.csv').read_text().splitlines()))
  assert [(r['best_eval_bleu'], r['best_eval_bleu_lc']) for r in rows] == [
    {1.0: ('12', '13.5'), 2.0: ('14', '13'), 4.0: ('9', '')}[scale] for scale, _ in ranked
  ]
  markdown = (tmp_path / 'root' / 'summary.md').read_text()
  assert f'Ranked by `{target_metric}`' in markdown
  assert '| best val BLEU | best val BLEU (lc) |' in markdown


def test_summary_of_seeds_groups_ranks_by_mean_and_tests_against_the_best(tmp_path, monkeypatch):
  monkeypatch.setenv('SACREBLEU_SEED', '12345')
  sweep_file = _write_sweep(tmp_path / 's.py', "sweeps.grid({'lr_scale': [1.0, 2.0, 4.0]})")
  sweep = sweeps.create(
    'configs/tiny.py',
    tiny.get_config(),
    str(sweep_file),
    str(tmp_path / 'root'),
    eval_flags=['--split=validation'],
    seeds=3,
  )
  references = [de for _, de in synthetic_pairs(60, seed=3)]
  # Validation losses per configuration and seed; lr_scale=2.0 has the best mean, not the best
  # single run. Word-drop rates: 4.0 translates far worse than 2.0, 1.0 about as well.
  losses = {'1.0': [4.0, 4.2, 4.4], '2.0': [4.1, 4.15, 4.2], '4.0': [3.9, 5.0, 5.1]}
  drops = {'1.0': 0.3, '2.0': 0.3, '4.0': 0.7}
  for trial in sweep.trials:
    scale, seed = str(trial.overrides['lr_scale']), trial.overrides['seed']
    rng = np.random.default_rng(seed * 10 + list(losses).index(scale))
    hypotheses = [' '.join(w for w in r.split() if rng.random() > drops[scale]) for r in references]
    _fake_trial(Path(sweep.workdir(trial)), losses[scale][seed], references, hypotheses)
    # The made-up translations are cased as the references, so their lowercased BLEU equals the
    # cased one; another value shows which column the summary reads.
    result = Path(sweep.workdir(trial)) / 'eval' / 'step_6-validation.json'
    scores = json.loads(result.read_text())
    result.write_text(json.dumps(scores | {'bleu_lc': scores['bleu'] + 1.0 + seed}))

  groups = sweep_summary.write(sweep)
  assert [(g.name, g.rank) for g in groups] == [
    ('lr_scale=2.0', 1),
    ('lr_scale=1.0', 2),
    ('lr_scale=4.0', 3),
  ]
  rows = _summary_rows(tmp_path / 'root')
  assert [r['configuration'] for r in rows] == ['lr_scale=2.0', 'lr_scale=1.0', 'lr_scale=4.0']
  assert [r['best'] for r in rows] == ['yes', '', ''] and rows[0]['seeds'] == '3'
  for row in rows:
    values = losses[row['lr_scale']]
    assert float(row['eval_loss_mean']) == pytest.approx(np.mean(values))
    assert float(row['eval_loss_std']) == pytest.approx(np.std(values, ddof=1))
    assert (float(row['eval_loss_min']), float(row['eval_loss_max'])) == (min(values), max(values))
  # eval.py's BLEU on lowercased text beside the cased one, from each seed's result file.
  for row, result in zip(rows, groups, strict=True):
    written = [
      json.loads((Path(t.workdir) / t.decode_result).read_text())['bleu_lc'] for t in result.trials
    ]
    assert float(row['decode_bleu_lc_mean']) == pytest.approx(np.mean(written), abs=1e-3)
    assert result.values('decode_bleu_lc') == written
  trials = (tmp_path / 'root' / 'trials.csv').read_text().splitlines()
  assert len(trials) == 10 and trials[0].startswith('rank,best,trial,lr_scale,seed,status,')

  # The paired tests: the best configuration's 3 seeds pooled against each other's.
  markdown = (tmp_path / 'root' / 'summary.md').read_text()
  pooled = [
    significance.pool(
      g.name, [significance.load_system(str(Path(t.workdir) / t.decode_result)) for t in g.trials]
    )
    for g in groups
  ]
  expected = significance.compare(pooled)
  assert expected['num_sentences'] == 180
  assert '## Paired tests against the best configuration' in markdown
  assert 'all seeds pooled (180 sentence pairs' in markdown
  [far, close] = expected['systems'][2], expected['systems'][1]
  assert far['scores']['BLEU']['significant'] and not close['scores']['BLEU']['significant']
  assert f'| `lr_scale=4.0` | {far["scores"]["BLEU"]["score"]:.2f} ± ' in markdown
  assert f'{far["scores"]["BLEU"]["p_value"]:.4f} (significant) |' in markdown
  for sentence in significance.verdicts(expected):
    assert f'* {sentence}' in markdown
  # Across seeds: Welch's t-test of each configuration's per-seed eval.py BLEU against the best's.
  reference, tests = sweep_tests.seed_tests(groups)
  assert reference.name == 'lr_scale=2.0'
  assert [g.name for g, _ in tests] == ['lr_scale=1.0', 'lr_scale=4.0']
  assert '## Across seeds, against the best configuration' in markdown
  for result, test in tests:
    bleus = result.values('decode_bleu')
    assert len(bleus) == 3
    assert test == significance.seed_test(reference.values('decode_bleu'), bleus)
  [(_, close_seeds), (_, far_seeds)] = tests
  assert far_seeds['significant'] and not close_seeds['significant']
  assert (
    f'| `lr_scale=4.0` | {", ".join(f"{v:.2f}" for v in tests[1][0].values("decode_bleu"))} |'
    in markdown
  )
  assert markdown.split('`lr_scale=4.0` | ')[-1].split('\n')[0].endswith('| yes |')
  assert markdown.split('`lr_scale=1.0` | ')[-1].split('\n')[0].endswith('| no |')
  assert '**4.1500 ± 0.0500 [4.1000, 4.2000]**' in markdown  # The best's validation loss.
  assert '| eval.py BLEU | eval.py BLEU (lc) |' in markdown
  trials_table = markdown.split('## Trials')[1]
  assert trials_table.count('| finished |') == 6 and trials_table.count('**finished**') == 3
  assert trials_table.index('`lr_scale=2.0,seed=2`') < trials_table.index('`lr_scale=1.0,seed=0`')

  # Error bars: mean ± std of each configuration, at its lr_scale.
  fig = sweep_plots.plot_groups(groups, ['lr_scale'], 'eval_loss', str(tmp_path / 'p.png'))
  bars = fig.axes[0].containers
  assert len(bars) == 3
  for bar, result in zip(bars, groups, strict=True):
    (x,), (y,) = bar.lines[0].get_data()
    assert x == result.overrides['lr_scale'] and y == pytest.approx(
      result.stats('eval_loss')['mean']
    )
    segment = bar.lines[2][0].get_segments()[0]
    assert segment[1, 1] - segment[0, 1] == pytest.approx(2 * result.stats('eval_loss')['std'])
  assert not fig.axes[0].patches  # The reference is plotted among the panel's own points.
  # A panel that does not plot the reference shows it as a band: mean line, ± std span.
  fig = sweep_plots.plot_groups(
    groups, ['lr_scale', 'warmup'], 'eval_loss', str(tmp_path / 'p.png'), 'lr_scale=4.0'
  )
  reference = groups[2].stats('eval_loss')
  [line] = [ln for ln in fig.axes[1].lines if ln.get_label() == 'lr_scale=4.0 (mean ± std)']
  assert line.get_ydata()[0] == pytest.approx(reference['mean'])
  [band] = fig.axes[1].patches
  y_extent = band.get_path().transformed(band.get_patch_transform()).get_extents()
  assert (y_extent.y0, y_extent.y1) == pytest.approx(
    (reference['mean'] - reference['std'], reference['mean'] + reference['std'])
  )

  # Against a named configuration instead of the best: it comes first, the others by rank.
  named = dataclasses.replace(sweep, compare_to='lr_scale=4.0')
  sweep_summary.write(named)
  markdown = (tmp_path / 'root' / 'summary.md').read_text()
  assert '## Paired tests against `lr_scale=4.0`' in markdown
  tests = markdown.split('## Paired tests')[1].split('## Trials')[0]
  assert (
    tests.index('| `lr_scale=4.0` (reference) |')
    < tests.index('| `lr_scale=2.0` |')
    < (tests.index('| `lr_scale=1.0` |'))
  )

  # A configuration without eval.py results of every seed is left out, saying so.
  (Path(groups[2].trials[1].workdir) / sweep_runner.STATE_FILE).write_text(
    json.dumps({'status': 'finished', 'stages': {}})
  )
  sweep_summary.write(sweep)
  markdown = (tmp_path / 'root' / 'summary.md').read_text()
  assert 'without eval.py translations of every seed: `lr_scale=4.0` (2 of 3 seeds).' in markdown
  assert '`lr_scale=4.0` |' in markdown.split('## Trials')[0]  # Still ranked in the table.


# --- sweep.py end to end on made-up corpora ----------------------------------------------------


@pytest.fixture(scope='module')
def sweep_env():
  """Trials share compiled programs through the session's JAX disk cache (conftest): a trial
  that only differs in its seed from an earlier one compiles nothing."""
  return {**os.environ, 'JAX_PLATFORMS': 'cpu'}


def _sweep_py(sweep_file, root, data_dirs, env, *flags):
  manual_dir, data_dir = data_dirs
  command = [
    sys.executable,
    'sweep.py',
    '--config=configs/tiny.py',
    f'--sweep={sweep_file}',
    f'--workdir={root}',
    f'--config.data.manual_dir={manual_dir}',
    f'--config.data.data_dir={data_dir}',
    *TINY_TRIAL_FLAGS,
    *flags,
  ]
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _summary_rows(root):
  with open(root / 'summary.csv') as f:
    return list(csv.DictReader(f))


def _trial_rows(root):
  with open(root / 'trials.csv') as f:
    return list(csv.DictReader(f))


def _snapshot(root, names):
  """Everything a trial's training writes or appends to, per trial."""
  files = ('trial.json', 'metrics.jsonl', 'train.log', 'provenance.jsonl')
  return {name: {f: (root / name / f).read_bytes() for f in files} for name in names}


TWO_BY_TWO = [
  'lr_scale=1.0,seed=0',
  'lr_scale=2.0,seed=0',
  'lr_scale=1.0,seed=1',
  'lr_scale=2.0,seed=1',
]


@pytest.fixture(scope='module')
def synthetic_corpus(tmp_path_factory):
  """(raw files, data_dir) of a made-up parallel corpus: 400 training and 40 validation pairs."""
  directory = tmp_path_factory.mktemp('corpus')
  for split, size, seed in (('train', 400, 0), ('val', 40, 1000)):
    pairs = synthetic_pairs(size, seed=seed)
    write_lines(directory / 'raw' / f'{split}.en', [en for en, _ in pairs])
    write_lines(directory / 'raw' / f'{split}.de', [de for _, de in pairs])
  return directory / 'raw', directory / 'tfds'


@pytest.fixture(scope='module')
def two_by_two(tmp_path_factory, synthetic_corpus, sweep_env):
  """Two learning-rate scales x `--seeds=2` (seed slowest, so the second pair reuses the first
  pair's compiles), each trial evaluated by eval.py (greedy), run once on a made-up corpus."""
  directory = tmp_path_factory.mktemp('two_by_two')
  sweep_file = _write_sweep(directory / 'two_by_two.py', "sweeps.grid({'lr_scale': [1.0, 2.0]})")
  root = directory / 'root'
  run = lambda *flags: _sweep_py(
    sweep_file,
    root,
    synthetic_corpus,
    sweep_env,
    '--config.data.dataset=parallel_text',
    '--seeds=2',
    '--eval',
    '--eval_flags=--split=validation --decoder=greedy --n_bootstrap=100',
    *flags,
  )
  result = run('--parallel=2')
  return root, run, result


@pytest.mark.slow
def test_two_by_two_sweep_with_seeds_writes_grouped_summaries(two_by_two):
  root, _, result = two_by_two
  assert result.returncode == 0, result.stderr[-3000:]
  lines = (root / 'trials.csv').read_text().splitlines()
  assert len(lines) == 5, lines
  assert lines[0] == (
    'rank,best,trial,lr_scale,seed,status,steps,train_loss,eval_loss,'
    'best_eval_bleu,best_eval_bleu_lc,tokens_per_sec,decode_bleu,decode_bleu_lc,decode_result,'
    'error,workdir'
  )
  trials = {r['trial']: r for r in csv.DictReader(lines)}
  assert sorted(trials) == sorted(TWO_BY_TWO)
  assert all(r['status'] == 'finished' and r['steps'] == '6' for r in trials.values()), trials
  assert all(float(r['tokens_per_sec']) > 0 and float(r['train_loss']) > 0 for r in trials.values())
  assert all(r['decode_result'] == 'eval/step_6-validation-greedy.json' for r in trials.values())
  # One row per configuration: mean, std, min and max over its 2 seeds, ranked by the mean.
  rows = _summary_rows(root)
  assert [r['configuration'] for r in rows] in (
    [['lr_scale=1.0', 'lr_scale=2.0'], ['lr_scale=2.0', 'lr_scale=1.0']]
  )
  means = [float(r['eval_loss_mean']) for r in rows]
  assert means == sorted(means)  # configs/tiny.py ranks by final eval_loss.
  assert [r['rank'] for r in rows] == ['1', '2'] and [r['best'] for r in rows] == ['yes', '']
  for row in rows:
    losses = [float(trials[f'{row["configuration"]},seed={seed}']['eval_loss']) for seed in (0, 1)]
    assert row['seeds'] == '2' and row['status'] == 'finished'
    assert float(row['eval_loss_mean']) == pytest.approx(np.mean(losses), abs=2e-5)
    assert float(row['eval_loss_std']) == pytest.approx(np.std(losses, ddof=1), abs=2e-5)
    assert float(row['eval_loss_std']) > 0  # Another seed, another run.
    assert (float(row['eval_loss_min']), float(row['eval_loss_max'])) == pytest.approx(
      (min(losses), max(losses)), abs=2e-5
    )
  markdown = (root / 'summary.md').read_text()
  assert '2 configurations x 2 seeds' in markdown
  assert f'| **best** | **`{rows[0]["configuration"]}`** |' in markdown
  assert 'all seeds pooled (80 sentence pairs' in markdown
  assert f'* {rows[1]["configuration"]}: BLEU ' in markdown
  png = (root / 'summary.png').read_bytes()
  assert png.startswith(b'\x89PNG') and len(png) > 10_000
  results = json.loads(
    (root / TWO_BY_TWO[0] / 'eval' / 'step_6-validation-greedy.json').read_text()
  )
  assert results['bleu_ci'] >= 0 and 'bs:100|' in results['bleu_signature']

  for name in TWO_BY_TWO:
    trial_dir = root / name
    config = json.loads((trial_dir / 'config.json').read_text())
    assert f'lr_scale={config["lr_scale"]},seed={config["seed"]}' == name
    state = json.loads((trial_dir / 'trial.json').read_text())
    assert state['status'] == 'finished' and state['stages']['train']['attempts'] == 1
    [entry] = provenance.read(str(trial_dir))
    assert entry['command'][1:3] == [
      str(REPO / 'train.py'),
      '--config=' + str(REPO / 'configs/tiny.py'),
    ]
    assert f'--config.lr_scale={config["lr_scale"]}' in entry['command']
    assert entry['packages']['jax'] == jax.__version__
    assert entry['git'] == provenance.git_state()
  if shutil.which('git') and (REPO / '.git').exists():
    head = subprocess.run(
      ['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert entry['git']['commit'] == head


@pytest.mark.slow
def test_tensorboard_shows_the_sweep_as_an_hparams_table(two_by_two):
  """`tensorboard --logdir ROOT`: a session per trial, grouped by configuration."""
  root, _, result = two_by_two
  assert result.returncode == 0, result.stderr[-3000:]
  columns, sessions = conftest.tensorboard_hparams(root)
  assert columns['hparams'] == ['lr_scale']  # The seed tells the sessions of a group apart.
  assert {'eval_loss', 'decode_bleu', 'decode_bleu_lc', 'steps'} <= set(columns['metrics'])
  trials = {r['trial']: r for r in _trial_rows(root)}
  assert sorted(sessions) == sorted(f'{name}/tensorboard/hparams' for name in TWO_BY_TWO)
  for name, row in trials.items():
    session = sessions[f'{name}/tensorboard/hparams']
    assert session['group'] == name.split(',')[0]
    assert session['hparams'] == {'lr_scale': float(row['lr_scale'])}
    assert session['status'] == 'STATUS_SUCCESS'
    assert session['metrics']['eval_loss'] == pytest.approx(float(row['eval_loss']), rel=1e-6)
    assert session['metrics']['steps'] == 6
  # The training curves are the trials' own runs beside them.
  assert 'train_loss' in conftest.tensorboard_scalars(root / TWO_BY_TWO[0] / 'tensorboard')


@pytest.mark.slow
def test_rerunning_the_sweep_starts_no_training(two_by_two):
  root, run, first = two_by_two
  assert first.returncode == 0, first.stderr[-3000:]
  before = _snapshot(root, TWO_BY_TWO)
  result = run('--parallel=2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert _snapshot(root, TWO_BY_TWO) == before
  assert result.stderr.count('finished earlier with the same commands, skipped') == 4
  assert len(_summary_rows(root)) == 2


@pytest.mark.slow
def test_interrupted_trial_resumes_from_its_checkpoint(two_by_two):
  root, run, first = two_by_two
  assert first.returncode == 0, first.stderr[-3000:]
  name, others = TWO_BY_TWO[1], [n for n in TWO_BY_TWO if n != TWO_BY_TWO[1]]
  # As if the sweep was killed after the checkpoint of step 3: the process is gone.
  shutil.rmtree(root / name / 'checkpoints' / '6')
  state = json.loads((root / name / 'trial.json').read_text())
  state['status'] = state['stages']['train']['status'] = 'running'
  (root / name / 'trial.json').write_text(json.dumps(state))
  summarized = run('--summarize')
  assert summarized.returncode == 0, summarized.stderr[-3000:]
  assert {r['trial']: r['status'] for r in _trial_rows(root)}[name] == 'interrupted'
  assert {r['configuration']: r['status'] for r in _summary_rows(root)}['lr_scale=2.0'] == (
    'finished 1, interrupted 1'
  )

  before = _snapshot(root, others)
  result = run()
  assert result.returncode == 0, result.stderr[-3000:]
  assert _snapshot(root, others) == before
  attempts = (root / name / 'train.log').read_text().split('\n=== ')
  assert len(attempts) == 3 and 'attempt 2:' in attempts[2]  # '' before the first header.
  assert 'Training from step 3 to 6' in attempts[2]
  assert len(provenance.read(str(root / name))) == 2
  rows = {r['trial']: r for r in _trial_rows(root)}
  assert rows[name]['status'] == 'finished' and rows[name]['steps'] == '6'


@pytest.mark.slow
def test_failing_trial_is_recorded_and_the_others_finish(
  tmp_path, synthetic_multi30k_dir, synthetic_multi30k_data_dir, sweep_env
):
  # A mesh of 3 data shards needs 3 devices, the trial has 1: train.py fails (a config error that
  # only the machine shows); it runs first, the other one after it.
  sweep_file = _write_sweep(tmp_path / 'failing.py', "[{'mesh.data': 3}, {'seed': 2}]")
  root = tmp_path / 'root'
  result = _sweep_py(
    sweep_file, root, (synthetic_multi30k_dir, synthetic_multi30k_data_dir), sweep_env
  )
  assert result.returncode == 1
  assert '1 of 2 trials failed' in result.stderr
  rows = {r['trial']: r for r in _summary_rows(root)}
  assert len((root / 'summary.csv').read_text().splitlines()) == 3
  assert rows['seed=2']['status'] == 'finished' and rows['seed=2']['steps'] == '6'
  assert rows['seed=2']['rank'] == '1'
  failed = rows['data=3']
  assert failed['status'] == 'failed' and failed['rank'] == '' and failed['steps'] == ''
  message = "config.mesh {'data': 3, 'fsdp': 1, 'tensor': 1} needs 3 devices, but 1 are available"
  assert message in failed['error']
  assert message in (root / 'data=3' / 'train.log').read_text()
  markdown = (root / 'summary.md').read_text()
  [line] = [line for line in markdown.splitlines() if line.startswith('* `data=3`: ')]
  assert 'train.py: error: ' in line and message in line and line.endswith('(data=3/train.log)')


@pytest.mark.parametrize(
  ('trial', 'message'),
  [
    (
      {'model.num_heads': 3},
      'config.model.d_model=32 is not divisible by config.model.num_heads=3',
    ),
    (
      {'model.dropout_rate': 1.5},
      'config.model.dropout_rate=1.5 must be a finite number in [0, 1)',
    ),
    ({'lr_scale': -1}, 'config.lr_scale=-1.0 must be a finite positive number'),
    ({'model.norm': 'batch'}, "config.model.norm='batch' is not one of"),
  ],
)
def test_trial_outside_the_domains_is_rejected_before_any_trial_starts(trial, message):
  with pytest.raises(ValueError, match=re.escape(f'sweep(): trial 1 {trial}')) as error:
    sweeps.make_trials(tiny.get_config(), [{'seed': 1}, trial])
  assert message in str(error.value)


def test_unknown_override_key_is_rejected_before_any_trial_starts(tmp_path):
  sweep_file = _write_sweep(tmp_path / 'typo.py', "[{'lr_scale': 2.0}, {'model.num_layer': 3}]")
  root = tmp_path / 'root'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  result = _sweep_py(sweep_file, root, ('/nonexistent', tmp_path / 'tfds'), env)
  assert result.returncode != 0
  assert "trial 1 {'model.num_layer': 3}: 'model.num_layer' is not a key" in result.stderr
  assert "Did you mean 'model.num_layers'" in result.stderr
  assert not root.exists()


# --- What a trial's eval.py and summary will need, checked before the first trial --------------


def _refusal(result) -> str:
  """The message of a refusal (`errors.run`): stderr from 'sweep.py: error: ' to the hint."""
  stderr = result.stderr
  assert result.returncode == 1, stderr[-3000:]
  start = stderr.rindex('sweep.py: error: ')
  return stderr[start : stderr.index('\n(set TRANSFORMER_TRACEBACK=1', start)]


def test_eval_flags_are_checked_against_each_trials_config_before_any_trial(
  tmp_path, write_parallel_corpus
):
  """A trial that keeps no best checkpoints, or whose dataset lacks the split: its eval.py
  would fail only after it trained. `sweep.py --dry_run` refuses, naming those trials."""
  corpus = write_parallel_corpus(tmp_path / 'raw')  # train and val: no test_2016_flickr.
  data_dirs = (corpus, tmp_path / 'tfds')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  sweep_file = _write_sweep(
    tmp_path / 's.py', "[{'keep_best_checkpoints': 2}, {'seed': 1}, {'data.test_split': 'x'}]"
  )
  root = tmp_path / 'root'
  dry_run = lambda *flags: _sweep_py(
    sweep_file,
    root,
    data_dirs,
    env,
    '--config.data.dataset=parallel_text',
    '--config.eval_bleu_sentences=8',
    '--dry_run',
    *flags,
  )
  message = _refusal(dry_run('--eval', '--eval_flags=--checkpoint=best --split=validation'))
  assert message.splitlines() == [
    'sweep.py: error: --eval_flags=--checkpoint=best --split=validation: eval.py refuses them, '
    'so no trial was run:',
    '  Invalid flags:',
    "    trials seed=1; test_split=x: --checkpoint='best' reads the best checkpoint by "
    'validation BLEU, but config.keep_best_checkpoints=0 keeps none. Train with '
    'config.keep_best_checkpoints=1 (and config.eval_bleu_sentences > 0), or read another '
    "checkpoint ('latest', 'avg:N').",
  ]
  message = _refusal(dry_run('--eval', '--eval_flags=--checkpoint=avg:4 --split=validation'))
  assert message.splitlines()[2:] == [
    "    every trial: --checkpoint='avg:4' averages the last 4 checkpoints, but "
    'config.keep_checkpoints=3 keeps 3. Average at most 3.'
  ]
  message = _refusal(dry_run('--eval', '--eval_flags=--split=foo'))
  assert (
    f"    every trial: --split='foo' is not a split of dataset 'parallel_text' in {corpus} "
    "(config.data.manual_dir); its splits are ['train', 'validation']."
  ) in message.splitlines()
  # The split each trial's eval.py reads by default: its config.data.test_split.
  message = _refusal(dry_run('--eval', '--eval_flags=--n_bootstrap=100'))
  assert message.splitlines()[2:] == [
    "    trials keep_best_checkpoints=2; seed=1: config.data.test_split='test_2016_flickr' (the "
    "default --split) is not a split of dataset 'parallel_text' in "
    f"{corpus} (config.data.manual_dir); its splits are ['train', 'validation'].",
    "    trials test_split=x: config.data.test_split='x' (the default --split) is not a split "
    f"of dataset 'parallel_text' in {corpus} (config.data.manual_dir); its splits are "
    "['train', 'validation'].",
  ]
  assert not root.exists()
  # Without --dry_run the same, before the first trial trains.
  result = _sweep_py(
    sweep_file,
    root,
    data_dirs,
    env,
    '--config.data.dataset=parallel_text',
    '--config.eval_bleu_sentences=8',
    '--eval',
    '--eval_flags=--split=foo',
  )
  assert "every trial: --split='foo' is not a split" in _refusal(result)
  assert not root.exists()
  # What every trial accepts passes.
  result = dry_run('--eval', '--eval_flags=--split=validation --checkpoint=avg:2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert not root.exists()


def test_eval_flags_that_cannot_be_read_or_would_be_ignored_are_refused(tmp_path):
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  root = tmp_path / 'root'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  result = _sweep_py(
    sweep_file,
    root,
    ('/nowhere', tmp_path),
    env,
    '--eval',
    "--eval_flags=--split='val",
    '--dry_run',
  )
  assert _refusal(result) == (
    "sweep.py: error: --eval_flags=--split='val: No closing quotation (a quote without its "
    'closing one), so it cannot be split into eval.py flags as a shell would. Close the quote '
    'or drop it; e.g. --eval_flags="--split=validation --checkpoint=avg:5".'
  )
  assert 'Traceback' not in result.stderr
  result = _sweep_py(
    sweep_file, root, ('/nowhere', tmp_path), env, '--eval_flags=--split=validation', '--dry_run'
  )
  assert _refusal(result) == (
    'sweep.py: error: --eval_flags=--split=validation is given without --eval, so no eval.py '
    'would run to take them. Add --eval (eval.py evaluates each trial after it trains), or drop '
    '--eval_flags.'
  )
  assert not root.exists()


@pytest.mark.parametrize('target_metric', ['eval_bleu', 'eval_bleu_lc'])
def test_a_target_metric_that_no_trial_would_produce_is_refused(tmp_path, target_metric):
  config = tiny.get_config()
  config.target_metric = target_metric
  expected = (
    f"config.target_metric='{target_metric}' ranks the trials by their validation BLEU, but "
    'config.eval_bleu_sentences=0 computes none, so no trial could be ranked: set '
    'config.eval_bleu_sentences > 0 (validation sentences decoded for BLEU at each '
    "evaluation), or config.target_metric='eval_loss'."
  )
  # A trial's own override: that trial is named.
  with pytest.raises(ValueError) as error:
    sweeps.make_trials(config, [{'seed': 1}, {'eval_bleu_sentences': 0}])
  assert str(error.value) == (
    f"sweep(): trial 1 {{'eval_bleu_sentences': 0}} gives an invalid config:\n  {expected}"
  )
  # The command line's, for every trial: sweep.py --dry_run refuses it at once.
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  result = _sweep_py(
    sweep_file,
    tmp_path / 'root',
    ('/nowhere', tmp_path),
    {**os.environ, 'JAX_PLATFORMS': 'cpu'},  # TINY_TRIAL_FLAGS set eval_bleu_sentences=0.
    f'--config.target_metric={target_metric}',
    '--dry_run',
  )
  assert _refusal(result) == f'sweep.py: error: Invalid config:\n  {expected}'
  assert not (tmp_path / 'root').exists()
  # A train.py run alone may do without: the target metric only ranks a sweep's trials.
  config.eval_bleu_sentences = 0
  config_lib.validate(config)


def test_wandb_online_without_a_login_is_refused_before_the_first_trial(tmp_path):
  """It passed the dry run, then every trial failed at its start."""
  pytest.importorskip('wandb')
  sweep_file = _write_sweep(tmp_path / 's.py', "[{'seed': 1}]")
  root = tmp_path / 'root'
  env = {key: value for key, value in os.environ.items() if not key.startswith('WANDB_')} | {
    'JAX_PLATFORMS': 'cpu',
    'HOME': str(tmp_path / 'home'),  # No ~/.netrc.
    'WANDB_CONFIG_DIR': str(tmp_path / 'wandb_config'),
  }
  sweep = lambda env, *flags: _sweep_py(
    sweep_file, root, ('/nowhere', tmp_path / 'tfds'), env, '--config.wandb.project=p', *flags
  )
  for flags in [('--dry_run',), ()]:
    message = _refusal(sweep(env, *flags))
    assert message.startswith(
      "sweep.py: error: config.wandb.project='p' logs to Weights & Biases online, but no W&B "
      'login is found here for '
    )
    assert "set config.wandb.mode='offline'" in message
    assert not root.exists()
  # A login (a key of the right form: it is not sent anywhere by the check), or offline: passes.
  result = sweep({**env, 'WANDB_API_KEY': 'a' * 40}, '--dry_run')
  assert result.returncode == 0, result.stderr[-3000:]
  result = sweep(env, '--config.wandb.mode=offline', '--dry_run')
  assert result.returncode == 0, result.stderr[-3000:]
  assert not root.exists()
