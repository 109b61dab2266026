"""`sweep.py --parallel=N` gives each trial running at once its own GPUs or TPU chips.

No accelerator here: a stand-in `nvidia-smi` on PATH lists two GPUs, as the real one does,
and stand-in trials (Python processes, no JAX) record the devices they were given.
"""

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from configs import tiny
from transformer.tools import sweep_devices, sweep_runner, sweeps

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
  """This process sees two NVIDIA GPUs: `nvidia-smi -L` lists them, CUDA_VISIBLE_DEVICES=0,1."""
  tool = tmp_path / 'bin' / 'nvidia-smi'
  tool.parent.mkdir()
  tool.write_text(
    '#!/bin/sh\n'
    'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"\n'
    'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-1111-1111-1111-111111111111)"\n'
  )
  tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv('PATH', f'{tool.parent}{os.pathsep}{os.environ["PATH"]}')
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '0,1')
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)


class _RecordingSweep(sweeps.Sweep):
  """Trials that record their CUDA_VISIBLE_DEVICES, then wait until every trial has started
  (so that they provably run at once), and end as finished runs."""

  def commands(self, trial):
    script = (
      'import os, pathlib, sys, time\n'
      'workdir, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n'
      "devices = os.environ.get('CUDA_VISIBLE_DEVICES', '-')\n"
      "(root / (workdir.name + '.devices')).write_text(devices)\n"
      'deadline = time.time() + 60\n'
      "while len(list(root.glob('*.devices'))) < int(sys.argv[3]) and time.time() < deadline:\n"
      '  time.sleep(0.05)\n'
      f"os.makedirs(workdir / 'checkpoints' / '{trial.config.num_train_steps}')\n"
    )
    arguments = [self.workdir(trial), self.root, str(len(self.trials))]
    return [('train', [sys.executable, '-c', script, *arguments])]


def _sweep(root: Path, overrides: list[dict], cls=sweeps.Sweep) -> sweeps.Sweep:
  config = tiny.get_config()
  trials = sweeps.make_trials(config, overrides)
  return cls(
    config_file='tiny.py',
    config=config,
    shared_overrides={},
    sweep_file='sweep.py',
    root=str(root),
    trials=tuple(trials),
  )


def test_two_trials_at_once_each_get_one_of_two_gpus(two_gpus, tmp_path, monkeypatch):
  monkeypatch.setattr(sweep_runner, 'prepare_data', lambda trials: None)  # They read no data.
  assert sweep_devices.find() == sweep_devices.Accelerators(
    'gpu', ('0', '1'), 'CUDA_VISIBLE_DEVICES=0,1 of the 2 that nvidia-smi -L lists'
  )
  sweep = _sweep(tmp_path / 'root', [{'seed': 1}, {'seed': 2}], _RecordingSweep)
  assert sweep_runner.run(sweep, parallel=2) == {'seed=1': 'finished', 'seed=2': 'finished'}
  given = {p.stem: p.read_text() for p in (tmp_path / 'root').glob('*.devices')}
  assert sorted(given.values()) == ['0', '1'], given  # Its own GPU each, at the same time.
  for name, devices in given.items():
    state = json.loads((tmp_path / 'root' / name / 'trial.json').read_text())
    assert state['stages']['train']['environment'] == {'CUDA_VISIBLE_DEVICES': devices}
    log = (tmp_path / 'root' / name / 'train.log').read_text()
    assert f': CUDA_VISIBLE_DEVICES={devices} {sys.executable} -c ' in log

  # One at a time: every trial sees every GPU, as before.
  sweep = _sweep(tmp_path / 'one', [{'seed': 1}], _RecordingSweep)
  assert sweep_runner.run(sweep, parallel=1) == {'seed=1': 'finished'}
  assert (tmp_path / 'one' / 'seed=1.devices').read_text() == '0,1'


def test_a_split_that_does_not_fit_is_refused_before_any_trial_starts(
  two_gpus, tmp_path, monkeypatch
):
  sweep = _sweep(tmp_path / 'root', [{'seed': 1}, {'mesh.data': 2}], _RecordingSweep)
  # A trial whose mesh needs both GPUs cannot have one of them.
  with pytest.raises(ValueError, match='each trial 1 of the 2 GPUs, which trial data=2 does not'):
    sweep_runner.run(sweep, parallel=2)
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '1')
  message = (
    '--parallel=2 runs 2 trials at once, but this machine has 1 GPU (CUDA_VISIBLE_DEVICES=1 '
    'of the 2 that nvidia-smi -L lists): trials do not share a device'
  )
  with pytest.raises(ValueError, match=re.escape(message)) as refusal:
    sweep_runner.run(sweep, parallel=2)
  assert str(refusal.value).endswith('Use --parallel=1 or fewer.')
  assert not (tmp_path / 'root').exists()  # Nothing started.


def test_shares_of_gpus_and_tpu_chips():
  gpus = sweep_devices.Accelerators('gpu', tuple('01234567'), 'nvidia-smi -L')
  assert sweep_devices.split(gpus, 4) == [
    {'CUDA_VISIBLE_DEVICES': ids} for ids in ('0,1', '2,3', '4,5', '6,7')
  ]
  with pytest.raises(ValueError, match='use a --parallel that divides 8: 1, 2, 4, 8'):
    sweep_devices.split(gpus, 3)
  chips = sweep_devices.Accelerators('tpu', ('0', '1', '2', '3'), '/dev/')
  slots = sweep_devices.split(chips, 2)
  assert [s['TPU_VISIBLE_CHIPS'] for s in slots] == ['0,1', '2,3']
  assert {s['TPU_CHIPS_PER_PROCESS_BOUNDS'] for s in slots} == {'1,2,1'}
  assert {s['TPU_PROCESS_BOUNDS'] for s in slots} == {'1,1,1'}
  assert len({s['TPU_PROCESS_PORT'] for s in slots}) == 2  # A port each.
  assert [s['TPU_PROCESS_ADDRESSES'] for s in slots] == [
    f'localhost:{s["TPU_PROCESS_PORT"]}' for s in slots
  ]
  six = sweep_devices.Accelerators('tpu', tuple('012345'), 'TPU_VISIBLE_CHIPS=0,1,2,3,4,5')
  with pytest.raises(ValueError, match='a TPU process takes 1, 2, 4, 8 chips: use --parallel='):
    sweep_devices.split(six, 2)
  cpus = sweep_devices.Accelerators('cpu')
  assert sweep_devices.split(cpus, 2) == [{}, {}]  # CPUs: the whole machine each, as before.


def test_accelerators_are_found_without_starting_jax(two_gpus, tmp_path, monkeypatch):
  assert sweep_devices.find({'JAX_PLATFORMS': 'cpu', 'CUDA_VISIBLE_DEVICES': '0,1'}).kind == 'cpu'
  assert sweep_devices.find({'CUDA_VISIBLE_DEVICES': ''}, dev_dir=str(tmp_path)).kind == 'cpu'
  found = sweep_devices.find({'CUDA_VISIBLE_DEVICES': 'GPU-1111,GPU-0000'})
  assert found.ids == ('GPU-1111', 'GPU-0000')  # UUIDs pass through as they are.
  assert sweep_devices.find({}).ids == ('0', '1')  # Unset: every GPU nvidia-smi lists.
  monkeypatch.setenv('PATH', str(tmp_path))  # No nvidia-smi: no GPU.
  dev = tmp_path / 'dev'
  (dev / 'vfio').mkdir(parents=True)
  for name in ('0', '1', '2', '3', 'vfio'):
    (dev / 'vfio' / name).touch()
  assert sweep_devices.find({}, dev_dir=str(dev)) == sweep_devices.Accelerators(
    'tpu', ('0', '1', '2', '3'), f'{dev}/'
  )
  found = sweep_devices.find({'TPU_VISIBLE_CHIPS': '2,3'}, dev_dir=str(dev))
  assert found.ids == ('2', '3')
  assert sweep_devices.find({'JAX_PLATFORMS': 'cuda'}, dev_dir=str(dev)).kind == 'cpu'


@pytest.mark.parametrize(
  ('visible', 'error'),
  [
    ('0,0', "'0' names the same GPU as '0'"),
    ('1,GPU-1111', "'GPU-1111' names the same GPU as '1'"),  # An index and its UUID.
    ('0,7', "'7' is not among the GPUs nvidia-smi -L lists (GPUs 0 to 1, UUIDs GPU-0000"),
    ('GPU-2222,0', "'GPU-2222' is not among the GPUs nvidia-smi -L lists"),
  ],
)
def test_gpus_named_twice_or_not_listed_are_refused(two_gpus, monkeypatch, visible, error):
  """`CUDA_VISIBLE_DEVICES=0,0` gave two trials GPU 0; ids nvidia-smi does not list passed."""
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', visible)
  with pytest.raises(ValueError) as refusal:
    sweep_devices.trial_environments([], 2)
  message = str(refusal.value)
  assert message.startswith(f'CUDA_VISIBLE_DEVICES={visible}: {error}')
  assert message.endswith('list each GPU once, by an index or UUID that nvidia-smi -L shows.')
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', 'GPU-1111,0')  # A UUID's unique start, as CUDA.
  assert sweep_devices.find().ids == ('GPU-1111', '0')


@pytest.mark.parametrize('visible', ['1', '0,0'])
def test_the_dry_run_refuses_the_split_the_run_refuses(two_gpus, tmp_path, visible):
  sweep_file = tmp_path / 's.py'
  sweep_file.write_text(
    "from transformer.tools import sweeps\n\n\ndef sweep():\n  return [{'seed': 1}, {'seed': 2}]\n"
  )
  root = tmp_path / 'root'
  result = subprocess.run(
    [
      sys.executable,
      'sweep.py',
      '--config=configs/tiny.py',
      f'--sweep={sweep_file}',
      f'--workdir={root}',
      '--parallel=2',
      '--dry_run',
      '--config.data.manual_dir=/nowhere',
    ],
    cwd=REPO,
    env={**os.environ, 'CUDA_VISIBLE_DEVICES': visible},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1, result.stderr[-3000:]
  expected = {
    '1': 'sweep.py: error: --parallel=2 runs 2 trials at once, but this machine has 1 GPU',
    '0,0': "sweep.py: error: CUDA_VISIBLE_DEVICES=0,0: '0' names the same GPU as '0'",
  }[visible]
  assert result.stderr.splitlines()[-2].startswith(expected), result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and not root.exists()
