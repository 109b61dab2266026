"""Commands misused (issue 62): a study's storage that cannot be written, eval.py input with old
Mac line ends, a gcsfs token that names no file, and compare.py given what is no result or one
result twice. Each is refused before any work, as one message naming what to do."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import synthetic_pairs
from test_significance import _write_result

from configs import tiny
from transformer import evaluation, google_credentials, path_checks, storage
from transformer.errors import InvalidInput
from transformer.tools import significance, sweep_flags, sweep_optuna

REPO = Path(__file__).resolve().parents[1]
HINT = '(set TRANSFORMER_TRACEBACK=1 to see where it was raised)'


def _refusal(result: subprocess.CompletedProcess, command: str) -> str:
  """The one message of a refused command (its hint line after it), checked for no traceback."""
  assert result.returncode == 1, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert lines[-1] == HINT, result.stderr[-3000:]
  [message] = [line for line in lines if line.startswith(f'{command}: error: ')]
  return message.removeprefix(f'{command}: error: ')


# --- 12: a study's storage that could not be written, or lies in a run's files -----------------


def _study(tmp_path, storage_spec):
  sweep_file = tmp_path / 'study.py'
  sweep_file.write_text("def sweep():\n  return [{'lr_scale': 1.0}]\n")
  return sweep_optuna.create(
    'configs/tiny.py',
    tiny.get_config(),
    str(sweep_file),
    str(tmp_path / 'root'),
    storage_spec=storage_spec,
  )


def _a_run(workdir: Path) -> Path:
  """A training run's workdir as path_checks recognises one (config.json and checkpoints/)."""
  (workdir / 'checkpoints').mkdir(parents=True)
  (workdir / 'config.json').write_text('{}')
  assert path_checks.is_run(str(workdir))
  return workdir


@pytest.mark.parametrize('kind', ['sqlite', 'journal'])
def test_a_storage_under_a_regular_file_is_refused_before_any_work(tmp_path, kind):
  a_file = tmp_path / 'notes.txt'
  a_file.write_text('not a folder\n')
  path = a_file / 'x' / 'study.db'
  spec = f'sqlite:///{path}' if kind == 'sqlite' else str(path)
  with pytest.raises(InvalidInput) as refusal:
    sweep_optuna.check_storage(spec, f'--storage={spec}')
  assert str(refusal.value) == (
    f'--storage={spec}: {a_file} is a file, so {a_file / "x"} cannot be a folder.'
  )
  with pytest.raises(InvalidInput, match='is a file, so'):  # The same through the sweep's start.
    _study(tmp_path, spec)
  assert sorted(os.listdir(tmp_path)) == ['notes.txt', 'study.py']  # No root, no lock file.
  # A folder still to be made is fine: created with the study.
  new = tmp_path / 'new' / 'deeper' / 'study.db'
  assert sweep_optuna.check_storage(f'sqlite:///{new}', '--storage') == f'sqlite:///{new}'
  assert not (tmp_path / 'new').exists()


def test_a_storage_in_a_folder_that_is_not_writable_is_refused(tmp_path, monkeypatch):
  folder = tmp_path / 'shared'
  folder.mkdir()
  real_access = os.access
  monkeypatch.setattr(  # Root may write anywhere: the refusal of a folder, as a user gets it.
    os, 'access', lambda p, mode: False if str(p) == str(folder) else real_access(p, mode)
  )
  spec = f'sqlite:///{folder}/study.db'
  with pytest.raises(InvalidInput) as refusal:
    sweep_optuna.check_storage(spec, f'--storage={spec}')
  assert str(refusal.value) == (
    f'--storage={spec}: {folder} is not writable, so nothing can be written to {folder}.'
  )


@pytest.mark.parametrize(
  ('spec', 'shown', 'entry'),
  [
    ('sqlite:///{run}/checkpoints/study.db', '{run}/checkpoints/study.db', 'lies in checkpoints'),
    ('sqlite:///{run}/checkpoints/new/study.db', '{run}/checkpoints/new/study.db', 'lies in'),
    ('{run}/eval/study.journal', '{run}/eval/study.journal', 'lies in eval'),
    # The lock file beside the database (sqlite) or the journal: the run's own train.lock.
    ('sqlite:///{run}/train', '{run}/train.lock', 'is train.lock'),
    ('{run}/train', '{run}/train.lock', 'is train.lock'),
  ],
  ids=['sqlite_in_checkpoints', 'sqlite_folder_to_make', 'journal_in_eval', 'sqlite_lock', 'lock'],
)
def test_a_storage_among_another_runs_files_is_refused(tmp_path, spec, shown, entry):
  run = _a_run(tmp_path / 'run')
  (run / 'eval').mkdir()
  spec, shown = spec.format(run=run), shown.format(run=run)
  before = sorted(p.name for p in run.rglob('*'))
  with pytest.raises(InvalidInput) as refusal:
    sweep_optuna.check_storage(spec, f'--storage={spec}')
  assert str(refusal.value).startswith(f'--storage={shown} {entry}'), refusal.value
  assert f'of the training run in {run}, which only that run writes' in str(refusal.value)
  assert sorted(p.name for p in run.rglob('*')) == before


def test_a_storage_that_is_an_input_of_the_sweep_is_refused(tmp_path):
  data = tmp_path / 'raw'
  data.mkdir()
  spec = f'sqlite:///{data}/study.db'
  inputs = {'the raw data (config.data.manual_dir)': str(data)}
  with pytest.raises(InvalidInput, match=r'lies in the raw data \(config.data.manual_dir\)'):
    sweep_optuna.check_storage(spec, f'--storage={spec}', inputs)
  assert sweep_optuna.check_storage(spec, '--storage') == spec  # Not an input: fine.


def test_sweep_py_refuses_a_storage_under_a_file_in_one_message(tmp_path):
  a_file = tmp_path / 'notes.txt'
  a_file.write_text('not a folder\n')
  sweep_file = tmp_path / 'study.py'
  sweep_file.write_text(
    'from transformer.tools import sweeps\n\n\n'
    "def space():\n  return {'lr_scale': sweeps.log_uniform(0.5, 2.0)}\n"
  )
  spec = f'sqlite:///{a_file}/x/study.db'
  result = subprocess.run(
    [
      sys.executable,
      'sweep.py',
      '--config=configs/tiny.py',
      f'--sweep={sweep_file}',
      f'--workdir={tmp_path / "root"}',
      '--num_trials=2',
      '--config.data.manual_dir=/nowhere',
      f'--storage={spec}',
    ],
    cwd=REPO,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert _refusal(result, 'sweep.py') == (
    f'--storage={spec}: {a_file} is a file, so {a_file}/x cannot be a folder.'
  )
  assert sorted(os.listdir(tmp_path)) == ['notes.txt', 'study.py']


def test_a_sweep_root_under_a_file_is_named_as_the_workdir_not_the_default_storage(tmp_path):
  a_file = tmp_path / 'notes.txt'
  a_file.write_text('not a folder\n')
  root = a_file / 'root'
  assert sweep_flags.root_errors(tiny.get_config(), str(root)) == [
    f'--workdir: {a_file} is a file, so {root} cannot be a folder.'
  ]


# --- 18: eval.py --input_file with \r, \r\n or \n line ends --------------------------------------


OTHER_BREAKS = 'x\x0by\x0cz\x1c\x1d\x1e\x85w\u2028v\u2029u'


@pytest.mark.parametrize(
  ('data', 'lines'),
  [
    (b'a\rb\rc\r', ['a', 'b', 'c']),  # Old Mac: three lines, not one.
    (b'a\rb\rc', ['a', 'b', 'c']),
    (b'a\r\nb\n', ['a', 'b']),
    (b'a\r\nb\rc\nd', ['a', 'b', 'c', 'd']),  # Mixed.
    (b'a\r\rb\n\nc\r\n\r\n', ['a', '', 'b', '', 'c', '']),  # Empty lines kept, in each kind.
    (b'a\r\r\n', ['a', '']),  # A lone \r, then \r\n (universal newlines).
    (f'{OTHER_BREAKS}\n'.encode(), [OTHER_BREAKS]),  # What str.splitlines would also split at.
    ('\ufeffHallo.\rWelt.\r'.encode(), ['Hallo.', 'Welt.']),  # The byte order mark dropped.
    (b'', []),
  ],
  ids=[
    'cr',
    'cr_unended',
    'crlf_lf',
    'mixed',
    'empty_lines',
    'cr_crlf',
    'other_breaks',
    'bom',
    'none',
  ],
)
def test_input_lines_end_at_crlf_lf_or_a_lone_cr_only(tmp_path, data, lines):
  path = tmp_path / 'in.txt'
  path.write_bytes(data)
  assert evaluation.read_input_lines(str(path)) == lines


def test_standard_input_lines_end_alike_and_errors_count_cr_lines(tmp_path, monkeypatch):
  class Stdin:
    buffer = io.BytesIO(b'Ein Hund.\rZwei Hunde.\rDrei.\r')

  monkeypatch.setattr(sys, 'stdin', Stdin)
  assert evaluation.read_input_lines('-') == ['Ein Hund.', 'Zwei Hunde.', 'Drei.']
  path = tmp_path / 'in.txt'
  path.write_bytes(b'gut\r\xff schlecht\r')  # Line 2 by its \r end, not line 1.
  with pytest.raises(InvalidInput, match=r'in.txt: line 2 is not valid UTF-8'):
    evaluation.read_input_lines(str(path))


# --- 19: a gcsfs token from the environment that names no file -----------------------------------


@pytest.fixture
def no_google_credentials(monkeypatch):
  for env in (google_credentials.CREDENTIALS_ENV, *google_credentials.TOKEN_ENVS):
    monkeypatch.delenv(env, raising=False)
  return monkeypatch


def _write(path: Path, text: str) -> Path:
  path.write_text(text)
  return path


@pytest.mark.parametrize('env', google_credentials.TOKEN_ENVS)
@pytest.mark.parametrize(
  ('case', 'problem'),
  [
    ('missing', 'names a file that does not exist (gcsfs would send the value to Google'),
    ('missing_relative', 'names a file that does not exist (gcsfs would send'),
    ('home', 'names a file that does not exist'),  # gcsfs expands no ~.
    ('directory', 'names a directory, not a credentials file'),
    ('not_json', 'names a file that is not JSON (not a credentials file)'),
    ('no_credentials', 'names a file that is JSON that is neither a service-account key nor'),
    ('a_list', 'names a file that is JSON (list), not an object of credentials'),
    ('empty', 'is empty'),
    ('json_number', 'is JSON (int), not an object of credentials'),
  ],
)
def test_a_gcsfs_token_naming_no_credentials_file_is_refused_before_any_request(
  tmp_path, no_google_credentials, env, case, problem
):
  no_google_credentials.chdir(tmp_path)
  value = {
    'missing': str(tmp_path / 'gone' / 'key.json'),
    'missing_relative': 'key.json',
    'home': '~/no-such-key.json',
    'directory': str(tmp_path),
    'not_json': str(_write(tmp_path / 'key.pem', '-----BEGIN PRIVATE KEY-----\n')),
    'no_credentials': str(_write(tmp_path / 'k.json', '{"project_id": "p"}')),
    'a_list': str(_write(tmp_path / 'list.json', '[1, 2]')),
    'empty': '',
    'json_number': '123',
  }[case]
  no_google_credentials.setenv(env, value)
  [error] = storage.path_errors('gs://a-bucket/run', '--workdir')
  assert error.startswith(f'{env}={value} {problem}'), error
  assert ', and --workdir=gs://a-bucket/run is reached with it' in error
  assert error.startswith(google_credentials.CREDENTIAL_PREFIXES)
  assert storage.path_errors('s3://a-bucket/run', '--workdir') == []  # Not gcsfs's.
  assert storage.path_errors(str(tmp_path), '--workdir') == []
  # train.py's check of its paths: the same one message, before any request.
  config = tiny.get_config()
  assert path_checks.workdir_errors(config, 'gs://a-bucket/run') == [error]


USER = {'refresh_token': 'r', 'client_id': 'i', 'client_secret': 's'}  # gcloud's own kind.


@pytest.mark.parametrize(
  'case',
  [
    'anon',
    'google_default',
    'cloud',
    'cache',
    'browser',
    'quoted_method',
    'null',
    'raw_token',
    'service_account',
    'user_token',
    'inline_json',
  ],
)
def test_a_gcsfs_token_that_gcsfs_can_take_passes(tmp_path, no_google_credentials, case):
  value = {
    'quoted_method': '"anon"',  # fsspec reads the variable as JSON where it is.
    'null': 'null',
    'raw_token': 'ya29.an-access-token',
    'service_account': str(_write(tmp_path / 'sa.json', '{"type": "service_account"}')),
    'user_token': str(
      _write(tmp_path / 'adc.json', json.dumps({'type': 'authorized_user', **USER}))
    ),
    'inline_json': json.dumps(USER),
  }.get(case, case)
  no_google_credentials.setenv('FSSPEC_GS_TOKEN', value)
  assert storage.path_errors('gs://a-bucket/run', '--workdir') == []


def test_train_py_with_a_gcsfs_token_naming_no_file_ends_with_one_message(tmp_path):
  key = tmp_path / 'gone' / 'key.json'
  env = {k: v for k, v in os.environ.items() if k != google_credentials.CREDENTIALS_ENV}
  result = subprocess.run(
    [sys.executable, 'train.py', '--config=configs/tiny.py', '--workdir=gs://a-bucket/run'],
    cwd=REPO,
    env={**env, 'JAX_PLATFORMS': 'cpu', 'FSSPEC_GS_TOKEN': str(key)},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert _refusal(result, 'train.py') == 'Invalid paths:'
  assert result.stderr.strip().splitlines()[-2] == (
    f'  FSSPEC_GS_TOKEN={key} names a file that does not exist (gcsfs would send the value to '
    "Google as an access token), and --workdir=gs://a-bucket/run is reached with it (gcsfs's "
    'token). Point FSSPEC_GS_TOKEN at a credentials file (JSON: a service-account key), set it '
    'to one of google_default, cache, cloud, anon, browser, or unset it to use the credentials '
    'of gcloud auth application-default login.'
  )
  assert 'googleapis.com' not in result.stderr  # No request was tried.


def test_google_application_credentials_is_checked_first(tmp_path, no_google_credentials):
  no_google_credentials.setenv(google_credentials.CREDENTIALS_ENV, str(tmp_path / 'gone.json'))
  no_google_credentials.setenv('FSSPEC_GS_TOKEN', str(tmp_path / 'also_gone.json'))
  [error] = storage.path_errors('gs://a-bucket/run', '--workdir')
  assert error.startswith(
    f'{google_credentials.CREDENTIALS_ENV}={tmp_path / "gone.json"} names a file'
  )
  key = _write(tmp_path / 'key.json', '{"type": "service_account"}')
  no_google_credentials.setenv(
    google_credentials.CREDENTIALS_ENV, str(key)
  )  # Good: the token's turn.
  [error] = storage.path_errors('gs://a-bucket/run', '--workdir')
  assert error.startswith(f'FSSPEC_GS_TOKEN={tmp_path / "also_gone.json"} names a file')


# --- 21: compare.py given what is no eval.py result, or one result twice -------------------------


@pytest.fixture
def results(tmp_path):
  """{name: result .json} of two systems scored on one made-up validation set of 30 sentences."""
  references = [de for _, de in synthetic_pairs(30, seed=3)]
  return {
    name: _write_result(tmp_path / name, references, [r[: len(r) // (i + 1)] for r in references])
    for i, name in enumerate(['base', 'other'])
  }


def test_the_translations_txt_is_refused_naming_the_json_beside_it(results):
  txt = results['base'].with_suffix('.txt')
  with pytest.raises(InvalidInput) as refusal:
    significance.load_system(str(txt))
  message = str(refusal.value)
  assert message.startswith(f"{txt} holds eval.py's translations, not its results: compare.py ")
  assert message.endswith(f'Name {results["base"]}, the results beside it.')
  assert 'damaged' not in message
  references = results['base'].parent / 'references-validation.txt'  # No .json beside it.
  with pytest.raises(InvalidInput, match='is a text file, not an eval.py result: compare.py'):
    significance.load_system(str(references))


@pytest.mark.parametrize(
  ('name', 'content', 'message'),
  [
    ('empty.json', '', "is empty, not an eval.py result: compare.py reads eval.py's"),
    ('blank.out', ' \n', 'is empty, not an eval.py result'),
    ('notes.md', '# Notes\n', r'is not JSON \(line 1: Expecting value\), so not an eval.py'),
    ('cut.json', '{"bleu": 3', r'is damaged: not JSON \(line 1: .*\)\. Score its checkpoint again'),
  ],
)
def test_a_file_that_is_no_result_says_what_compare_reads(tmp_path, name, content, message):
  path = _write(tmp_path / name, content)
  with pytest.raises(InvalidInput, match=f'^{path} {message}') as refusal:
    significance.load_system(str(path))
  if name == 'empty.json':
    assert str(refusal.value).endswith(f'If eval.py wrote it: {significance._REWRITE}')
  else:
    assert 'If eval.py wrote it' not in str(refusal.value)


def test_one_result_named_twice_is_refused_naming_it(results, tmp_path):
  base = results['base']
  workdir = base.parent.parent
  (tmp_path / 'link').symlink_to(workdir)
  spellings = {
    'the same': str(base),
    'dots': f'{base.parent}/../eval/{base.name}',
    'a link': str(tmp_path / 'link' / 'eval' / base.name),
    'its workdir': str(workdir),
  }
  for how, other in spellings.items():
    loaded = [significance.load_system(path) for path in (str(base), other)]
    with pytest.raises(InvalidInput) as refusal:
      significance.check_distinct(loaded)
    named = f"twice as '{base}'" if how == 'the same' else f"as '{base}' and as '{other}'"
    assert str(refusal.value).startswith(f'{base} is named {named}: each result is one seed'), how
    with pytest.raises(InvalidInput, match='would count twice'):
      significance.pool('a,a', loaded)
  distinct = [significance.load_system(str(path)) for path in results.values()]
  significance.check_distinct(distinct)  # Two results: fine.
  assert significance.pool('a,b', distinct).results == {
    'pooled': [str(p) for p in results.values()]
  }


def test_compare_py_refuses_a_result_given_twice_and_a_txt_in_one_message(results):
  base, other = map(str, results.values())
  workdir = str(results['base'].parent.parent)
  run = lambda *args: subprocess.run(
    [sys.executable, 'compare.py', *args], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  message = _refusal(run(f'{base},{workdir}', f'{other},{other}'), 'compare.py')
  assert message.startswith(f"{base} is named as '{base}' and as '{workdir}': each result is ")
  txt = base.removesuffix('.json') + '.txt'
  message = _refusal(run(txt, other), 'compare.py')
  assert message.startswith(f"{txt} holds eval.py's translations, not its results")
  assert message.endswith(f'Name {base}, the results beside it.')
