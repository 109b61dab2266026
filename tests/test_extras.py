"""Dependencies: the pinned files and pyproject.toml name the same sets, and each optional set
(an extra) that is missing is refused, before any work, by one message naming it.

A package is made missing as Python sees it: `sys.modules[name] = None`, so that `import name`
raises ImportError and `importlib.util.find_spec(name)` finds nothing. No test here installs,
uninstalls or connects to anything.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from configs import tiny
from transformer import config as config_lib
from transformer import extras, google_credentials, path_checks, storage, wandb_run
from transformer.errors import InvalidInput
from transformer.interop import hf_files, workdirs
from transformer.tools import sweep_optuna, sweep_slurm

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / 'pyproject.toml').read_text(encoding='utf-8'))['project']


def _refusal(module: str, extra: str, what: str) -> str:
  return (
    f'{what} needs {module}, which is not installed: pip install -r requirements/{extra}.txt '
    f"(or pip install '.[{extra}]')."
  )


def _without(monkeypatch, *modules: str) -> None:
  for module in modules:
    monkeypatch.setitem(sys.modules, module, None)


# --- The refusals, through the calls a command makes ---------------------------------------------


@pytest.mark.parametrize(
  ('scheme', 'backend', 'use'), [('gs', 'gcsfs', 'a gs:// path'), ('s3', 's3fs', 'an s3:// path')]
)
def test_a_bucket_path_without_its_backend_is_refused_naming_buckets(
  scheme, backend, use, monkeypatch, tmp_path
):
  monkeypatch.delenv(google_credentials.CREDENTIALS_ENV, raising=False)
  url = f'{scheme}://a-bucket/run'
  assert storage.path_errors(url, '--workdir') == []  # Installed: nothing to say.
  _without(monkeypatch, backend)
  refusal = f'--workdir={url}: ' + _refusal(backend, 'buckets', use)
  assert storage.path_errors(url, '--workdir') == [refusal]
  # train.py's check of its paths, before any request (the test's network guard allows none).
  config = tiny.get_config()
  config.data.data_dir = str(tmp_path / 'data')
  assert path_checks.workdir_errors(config, url) == [refusal]
  assert storage.path_errors(str(tmp_path / 'local'), '--workdir') == []  # Local paths need none.


def test_an_optuna_study_without_optuna_is_refused_naming_sweeps(monkeypatch, tmp_path):
  _without(monkeypatch, 'optuna')
  refusal = _refusal('optuna', 'sweeps', 'An Optuna study (sweep.py --search=optuna)')
  root = tmp_path / 'study'
  with pytest.raises(InvalidInput) as raised:
    sweep_optuna.create(
      str(REPO / 'configs' / 'tiny.py'),
      tiny.get_config(),
      str(REPO / 'configs' / 'sweeps' / 'tiny_study.py'),
      str(root),
    )
  assert str(raised.value) == refusal
  assert not root.exists()
  with pytest.raises(InvalidInput) as raised:  # The loader the study's driver calls.
    sweep_optuna.import_optuna()
  assert str(raised.value) == refusal


def test_sweep_slurm_imports_without_submitit_and_refuses_the_launcher(monkeypatch):
  _without(monkeypatch, 'submitit')
  spec = importlib.util.spec_from_file_location('sweep_slurm_alone', sweep_slurm.__file__)
  module = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, module)
  spec.loader.exec_module(module)  # sweep.py imports it for local sweeps too.
  assert module.submitit is None
  with pytest.raises(InvalidInput) as raised:
    module.require_submitit()
  assert str(raised.value) == _refusal('submitit', 'sweeps', '--launcher=slurm')


def test_sweep_py_refuses_the_slurm_launcher_without_submitit_in_one_line(tmp_path):
  root = tmp_path / 'sweep'
  argv = [
    'sweep.py',
    '--config=configs/tiny.py',
    '--sweep=configs/sweeps/seeds.py',
    f'--workdir={root}',
    '--launcher=slurm',
  ]
  script = (
    "import runpy, sys; sys.modules['submitit'] = None; "
    f"sys.argv = {argv!r}; runpy.run_path('sweep.py', run_name='__main__')"
  )
  result = subprocess.run(
    [sys.executable, '-c', script],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 1, result.stderr
  refusal = _refusal('submitit', 'sweeps', '--launcher=slurm')
  assert f'sweep.py: error: {refusal}\n' in result.stderr, result.stderr
  assert 'Traceback' not in result.stderr, result.stderr
  assert not root.exists()


def test_weights_and_biases_without_wandb_is_refused_naming_tracking(monkeypatch, tmp_path):
  _without(monkeypatch, 'wandb')
  config = tiny.get_config()
  config.wandb.project, config.wandb.mode = 'transformer-tests', 'offline'
  what = "config.wandb.project='transformer-tests' (logging to Weights & Biases)"
  refusal = _refusal('wandb', 'tracking', what)
  advice = " Or set config.wandb.project='' to train without W&B."
  assert config_lib.machine_errors(config) == [refusal + advice]  # train.py's, before any work.
  assert wandb_run.login_errors(config) == [refusal + advice]  # sweep.py's, before any trial.
  workdir = tmp_path / 'run'
  with pytest.raises(InvalidInput) as raised:
    wandb_run.WandbRun.start(config, str(workdir))
  assert str(raised.value) == refusal
  assert not workdir.exists()
  config.wandb.project = ''  # Off: wandb is not needed.
  assert config_lib.machine_errors(config) == wandb_run.login_errors(config) == []
  assert wandb_run.WandbRun.start(config, str(workdir)) is None


def test_a_ctranslate2_export_without_ctranslate2_is_refused_naming_interop(monkeypatch, tmp_path):
  _without(monkeypatch, 'ctranslate2')
  output = tmp_path / 'ct2'
  with pytest.raises(InvalidInput) as raised:  # convert.py --to_ctranslate2, before the run.
    workdirs.export_ctranslate2(str(tmp_path / 'run'), str(output), None)
  assert str(raised.value) == _refusal('ctranslate2', 'interop', '--to_ctranslate2')
  assert not output.exists()


def test_pytorch_weights_without_torch_are_refused_naming_interop(monkeypatch, tmp_path):
  _without(monkeypatch, 'torch')
  (tmp_path / hf_files.TORCH_WEIGHTS).write_bytes(b'')
  path = tmp_path / hf_files.TORCH_WEIGHTS
  with pytest.raises(InvalidInput) as raised:  # convert.py --from_hf, config.init_from=hf:DIR.
    hf_files.read_weights(str(tmp_path))
  assert str(raised.value) == (
    _refusal('torch', 'interop', f'{path}: reading PyTorch weights')
    + ' Or convert the directory to safetensors first.'
  )


def test_a_package_that_fails_to_import_is_named_with_its_error(monkeypatch, tmp_path):
  """Installed, but what it imports is missing: the message says so, not 'not installed'."""
  (tmp_path / 'half_installed.py').write_text('import a_dependency_it_lacks\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(InvalidInput) as raised:
    extras.require('half_installed', 'buckets', 'a gs:// path')
  assert str(raised.value) == (
    'a gs:// path needs half_installed, which cannot be imported (No module named '
    "'a_dependency_it_lacks'): pip install -r requirements/buckets.txt (or pip install "
    "'.[buckets]')."
  )
  assert extras.missing('half_installed', 'buckets', 'a gs:// path') is None  # It is there.


# --- The pinned files and pyproject.toml --------------------------------------------------------


def _pins(path: pathlib.Path) -> dict[str, Requirement]:
  """{name: requirement} of a pinned file's packages (its -r includes left out)."""
  pins = {}
  for line in path.read_text(encoding='utf-8').splitlines():
    line = line.split('#', 1)[0].strip()
    if line and not line.startswith('-'):
      requirement = Requirement(line)
      assert canonicalize_name(requirement.name) not in pins, f'{path}: {line} twice'
      pins[canonicalize_name(requirement.name)] = requirement
  return pins


def _declared(requirements: list[str]) -> dict[str, Requirement]:
  return {canonicalize_name(r.name): r for r in map(Requirement, requirements)}


SETS = {
  'core': _declared(PYPROJECT['dependencies']),
  **{
    extra: _declared(requirements)
    for extra, requirements in PYPROJECT['optional-dependencies'].items()
    if extra != 'all'
  },
}


def test_every_set_is_one_pinned_file_and_requirements_txt_includes_them_all():
  files = sorted(p.name for p in (REPO / 'requirements').glob('*.txt'))
  assert files == sorted(f'{name}.txt' for name in SETS)
  assert set(extras.EXTRAS) == set(SETS) - {'core'}
  includes = re.findall(r'^-r (\S+)$', (REPO / 'requirements.txt').read_text(), re.MULTILINE)
  assert sorted(includes) == sorted(f'requirements/{name}.txt' for name in SETS)
  assert _pins(REPO / 'requirements.txt') == {}  # Every pin lives in one set's file.
  (everything,) = PYPROJECT['optional-dependencies']['all']
  assert Requirement(everything).name == PYPROJECT['name']
  assert Requirement(everything).extras == set(extras.EXTRAS)


@pytest.mark.parametrize('name', list(SETS))
def test_each_pinned_file_names_the_packages_of_its_set_each_pin_in_its_range(name):
  pins, declared = _pins(REPO / 'requirements' / f'{name}.txt'), SETS[name]
  assert sorted(pins) == sorted(declared), f'requirements/{name}.txt and pyproject.toml differ'
  for key, pin in pins.items():
    (exact,) = pin.specifier
    assert exact.operator == '==', f'requirements/{name}.txt: {pin} is not an exact pin'
    assert declared[key].specifier.contains(exact.version, prereleases=True), (
      f'{pin} (requirements/{name}.txt) is outside pyproject.toml range {declared[key]}'
    )
    assert pin.extras == declared[key].extras, (pin, declared[key])


def test_no_package_is_in_two_sets():
  seen = {}
  for name, declared in SETS.items():
    for key in declared:
      assert key not in seen, f'{key} is in both {seen[key]} and {name}'
      seen[key] = name
