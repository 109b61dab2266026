"""Where a command may write: never a run's files (what a workdir holds), its inputs or the code.

Every output path of train.py, eval.py and sweep.py is checked here before any
work (`protected_path_errors`, `workdir_errors`, `writable_file_errors`,
`writable_dir_errors`, `run_entry_errors`), so that nothing a user or a run made is
overwritten and a run does not fail halfway through its start.
`RUN_ENTRIES` lists what a training run writes at the top of its workdir;
`is_run` and `run_file` recognise a workdir and a path inside one.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from typing import Any

import ml_collections

import transformer
from transformer import google_credentials, shutdown, storage, workdir_lock
from transformer.errors import InvalidInput

# What train.py, eval.py and sweep.py write at the top of a run's workdir: a path at or under one
# of these entries is a file of the run, never an output of another command.
RUN_ENTRIES = (
  'config.json',
  'provenance.jsonl',
  'metrics.jsonl',
  'train.lock',
  'checkpoints',
  'best_checkpoints',
  'corrupt_checkpoints',
  'tensorboard',
  'eval',
  'profile',
  'trial.json',
  'train.log',
  'eval.log',
  'wandb.json',
  'wandb',
  'vocabulary.model',  # A workdir convert.py imported from Hugging Face: its vocabulary,
  'target_vocabulary.model',  # and its target side's own, where it has one.
)
# The checkout that holds this package: the files git tracks there are the code.
CODE_DIR = transformer.CODE_DIR


def absolute(path: str) -> str:
  """`path` with `~` expanded, absolute and with symbolic links resolved; a URL as it is."""
  if storage.is_url(path):
    return storage.resolve(path)
  return os.path.realpath(os.path.expanduser(path))


def is_run(directory: str) -> bool:
  """Whether `directory` is the workdir of a training run (train.py wrote or is writing it)."""
  has = lambda name: storage.exists(storage.join(directory, name))
  written = has('checkpoints') or has('provenance.jsonl')
  return has('train.lock') or (has('config.json') and written)


def run_file(path: str) -> tuple[str, str] | None:
  """(workdir, entry) when `path` is or lies under a `RUN_ENTRIES` entry of a run's workdir."""
  path = absolute(path)
  parent = storage.dirname(path)
  while True:
    if storage.is_url(parent) and parent.count('/') < 3:
      return None  # 'gs://bucket': the bucket itself is no run.
    if is_run(parent):
      entry = path[len(parent) :].lstrip('/' + os.sep).replace(os.sep, '/').split('/')[0]
      if entry in RUN_ENTRIES:
        return parent, entry
    if storage.dirname(parent) == parent:
      return None
    parent = storage.dirname(parent)


def _code_files(path: str) -> list[str]:
  """The files of the code (tracked by git in `CODE_DIR`) that are `path` or lie under it."""
  if storage.is_url(path) or os.path.commonpath([path, CODE_DIR]) != CODE_DIR:
    return []
  try:
    result = subprocess.run(
      ['git', '-C', CODE_DIR, 'ls-files', '-z', '--', os.path.relpath(path, CODE_DIR)],
      capture_output=True,
      timeout=30,
      check=True,
    )
  except (OSError, subprocess.SubprocessError):
    return []  # Not a git checkout (an installed copy): no file is known as code.
  return [name for name in result.stdout.decode(errors='replace').split('\0') if name]


def _under(path: str, other: str) -> bool:
  """Whether `path` is `other` or lies under it, by name."""
  if storage.is_url(path) or storage.is_url(other):
    return path == other or path.startswith(other.rstrip('/') + '/')
  return os.path.commonpath([path, other]) == other


def _within(path: str, other: str) -> bool:
  """Whether `path` is `other` (the same file, also through a hard link) or lies under it."""
  if _under(path, other):
    return True
  if storage.is_url(path) or storage.is_url(other):
    return False
  try:
    return os.path.samefile(path, other)
  except OSError:
    return False


def protected_path_errors(
  path: str, name: str, inputs: Mapping[str, str | None] | None = None
) -> list[str]:
  """Errors of a path that a command would write (`name`: its flag or config key).

  It must not be a file of a run (`run_file`), be or lie in one of `inputs` ({what: path}, the
  files and folders the command reads), nor be or hold files of the code. Checked before any
  work, so that nothing a user or a run made is overwritten.
  """
  if not path or not path.strip():
    return [f'{name} is empty: name a path.']
  path = absolute(path)
  if (found := run_file(path)) is not None:
    workdir, entry = found
    where = 'is' if path == storage.join(workdir, entry) else 'lies in'
    return [
      f'{name}={path} {where} {entry} of the training run in {workdir}, which only that run '
      'writes; write elsewhere.'
    ]
  for what, other in (inputs or {}).items():
    if other and other != '-' and _within(path, absolute(other)):
      other = absolute(other)
      where = 'lies in' if path != other and _under(path, other) else 'is'
      return [f'{name}={path} {where} {what}, {other}, an input of this command; write elsewhere.']
  code = _code_files(path)
  if code:
    what = 'a file of the code' if code == [os.path.relpath(path, CODE_DIR)] else 'the code'
    shown = ', '.join(code[:3]) + (', ...' if len(code) > 3 else '')
    return [f'{name}={path} is {what} ({shown} in {CODE_DIR}); write elsewhere.']
  return []


def hugging_face_directory_error(directory: str, hf_config: Mapping[str, Any]) -> str:
  """Why a Hugging Face model directory (its config.json `hf_config`) is not a run's workdir."""
  kind = hf_config.get('model_type') or ', '.join(map(str, hf_config.get('architectures') or []))
  return (
    f'{directory} is a Hugging Face model directory (config.json model_type {kind!r}), not '
    'the workdir of a training run, and nothing is written into it. Import it as a workdir '
    f'with convert.py --from_hf={directory} --workdir=NEW, or fine-tune from it with train.py '
    f'--config.init_from=hf:{directory} --workdir=NEW.'
  )


def _hugging_face_config(directory: str) -> dict[str, Any] | None:
  """DIR/config.json where it is a Hugging Face model's (`model_type`, `architectures`)."""
  try:
    with open(os.path.join(directory, 'config.json'), encoding='utf-8') as f:
      loaded = json.load(f)
  except (OSError, ValueError):
    return None
  return loaded if is_hugging_face_config(loaded) else None


def is_hugging_face_config(loaded: Any) -> bool:
  """Whether a `config.json`'s content is a Hugging Face model's (`model_type`, `architectures`)."""
  return isinstance(loaded, dict) and ('model_type' in loaded or 'architectures' in loaded)


def not_a_run_errors(path: str, flag: str = '--workdir') -> list[str]:
  """A local folder that holds files but no run: refused as a workdir (they are someone
  else's, and a run would write its own config.json and checkpoints among them)."""
  if not os.path.isdir(path) or is_run(path):
    return []
  if (hf_config := _hugging_face_config(path)) is not None:
    return [f'{flag}: {hugging_face_directory_error(path, hf_config)}']
  foreign = sorted(name for name in os.listdir(path) if name not in RUN_ENTRIES)
  if not foreign:
    return []  # What a run writes first (a sweep's trial.json, train.log): a run to be.
  shown = ', '.join(foreign[:5]) + (f' and {len(foreign) - 5} more' if len(foreign) > 5 else '')
  return [
    f"{flag}={path} holds files that are not a training run's ({shown}): name a new or empty "
    'folder, or the workdir of a run to resume. Nothing was written.'
  ]


def setting_errors() -> list[str]:
  """Errors of the environment variables that bound waits on storage and the end of a process.

  TRANSFORMER_STORAGE_TIMEOUT_SECONDS (`storage`), TRANSFORMER_SHUTDOWN_SECONDS (`shutdown`),
  TRANSFORMER_LOCK_LEASE_SECONDS (`workdir_lock`).
  """
  errors = []
  for read in (storage.timeout_seconds, shutdown.deadline_seconds, workdir_lock.lease_seconds):
    try:
      read()
    except InvalidInput as e:
      errors.append(str(e))
  return errors


def workdir_errors(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """Errors of train.py's `--workdir` and the paths it writes data to, before anything runs.

  The workdir must be a folder (new, or a run's to resume), not inside another run's files,
  the raw data (`config.data.manual_dir`), the prepared data (`config.data.data_dir`) or the
  code; the prepared data and a vocabulary to be trained must not land in a run's files or
  the raw data. Existing prepared data and vocabularies are only read.
  """
  if not workdir or not workdir.strip():
    return [
      f"--workdir is empty: name the run's folder (e.g. --workdir=workdirs/m30k); an empty "
      f'one would write the run into the current directory, {os.getcwd()}.'
    ]
  if errors := setting_errors():
    return errors
  data = config.data
  url_errors = [
    error
    for value, name in (
      (workdir, '--workdir'),
      (data.manual_dir, 'config.data.manual_dir'),
      (data.data_dir, 'config.data.data_dir'),
      (data.vocab_path, 'config.data.vocab_path'),
      (data.get('target_vocab_path'), 'config.data.target_vocab_path'),
    )
    for error in storage.path_errors(value, name)
  ]
  credentials = [e for e in url_errors if e.startswith(google_credentials.CREDENTIAL_PREFIXES)]
  if credentials:
    return credentials[:1]  # One message, for the first path that needs them.
  url_errors = url_errors or storage.checkpoint_errors(workdir, '--workdir')
  if not url_errors and data.manual_dir and storage.is_url(data.manual_dir):
    url_errors.append(
      f'config.data.manual_dir={data.manual_dir}: the raw files are read by local path (TFDS '
      'builders and their fingerprint read them). Copy them to this host (gcloud storage cp '
      '-r / aws s3 sync) and name that folder; the prepared data (config.data.data_dir) may '
      'be in a bucket.'
    )
  if url_errors:
    return url_errors
  raw = {'the raw data (config.data.manual_dir)': data.manual_dir}
  path = absolute(workdir)
  if errors := storage.bucket_errors(path, '--workdir'):  # First: every look below needs it.
    return errors
  if storage.isfile(path):
    return [f'--workdir={path} is a file, not a folder: name a new folder, or a run to resume.']
  errors = protected_path_errors(
    path, '--workdir', {**raw, 'the prepared data (config.data.data_dir)': data.data_dir}
  )
  errors += protected_path_errors(data.data_dir, 'config.data.data_dir', raw)
  for key in ('vocab_path', 'target_vocab_path'):  # Trained (or hf:DIR's), then written.
    if data.get(key) and not storage.exists(absolute(data[key])):
      errors += protected_path_errors(data[key], f'config.data.{key}', raw)
  if errors or storage.is_url(path):  # A bucket's writes were probed above.
    return errors
  return writable_dir_errors(path, '--workdir') or not_a_run_errors(path) or run_entry_errors(path)


# What train.py writes inside a workdir it resumes: folders it writes files into, and files it
# appends to (config.json is replaced whole: only the workdir need be writable for it).
_RUN_FOLDERS = {
  'checkpoints': 'its checkpoints',
  'tensorboard': 'its TensorBoard event files',
  'best_checkpoints': 'its best checkpoints',
}
_APPENDED_FILES = {'metrics.jsonl': 'its metrics', 'provenance.jsonl': 'its provenance record'}


def run_entry_errors(workdir: str) -> list[str]:
  """Errors of the entries a run writes in local `workdir`, before anything changes there.

  A file where the run writes a folder (`tensorboard/`, `checkpoints/`), a folder where it
  appends to a file (`metrics.jsonl`), or either not writable: named with what to do.
  """
  errors = []
  for name, what in {**_RUN_FOLDERS, **_APPENDED_FILES}.items():
    path = os.path.join(workdir, name)
    folder = name in _RUN_FOLDERS
    if not os.path.lexists(path):
      continue
    if folder and not os.path.isdir(path):
      errors.append(
        f'--workdir={workdir}: {path} is a file, but train.py writes {what} into a folder '
        'there. Move the file elsewhere (or remove it), or name another --workdir.'
      )
    elif not folder and os.path.isdir(path):
      errors.append(
        f'--workdir={workdir}: {path} is a directory, but train.py appends {what} to a file '
        'there. Move the directory elsewhere, or name another --workdir.'
      )
    elif not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
      errors.append(
        f'--workdir={workdir}: {path} is not writable, and train.py writes {what} there. '
        f'Make it writable (chmod u+w{"x" if folder else ""} {path}), or name another --workdir.'
      )
  return errors


def output_errors(
  path: str, flag: str, inputs: Mapping[str, str | None] | None = None
) -> list[str]:
  """Errors of an output file a command writes (`-`: standard output), before any work.

  Not a file of a run, an input of the command or the code (`protected_path_errors`), and
  writable (`writable_file_errors`). Every command's output flag goes through this.
  """
  if path == '-':
    return []
  return protected_path_errors(path, flag, inputs) or writable_file_errors(path, flag)


def output_dir_errors(
  path: str, flag: str, inputs: Mapping[str, str | None] | None = None
) -> list[str]:
  """`output_errors` for a folder a command writes into (a benchmark's --root, a trace)."""
  return protected_path_errors(path, flag, inputs) or writable_dir_errors(path, flag)


def writable_file_errors(path: str, flag: str) -> list[str]:
  """Whether `path` can be written (its folder exists and is writable), checked before any work.

  A URL: its form, and that its bucket exists and takes writes (`storage.bucket_errors`).
  """
  if path == '-':
    return []
  if (errors := storage.path_errors(path, flag)) or storage.is_url(path):
    if errors := errors or storage.bucket_errors(storage.dirname(path), flag):
      return errors
    if storage.isdir(path):
      return [f'{flag}={path} is a directory, not a file.']
    return []
  path = os.path.abspath(os.path.expanduser(path))
  folder = os.path.dirname(path)
  if os.path.isdir(path):
    return [f'{flag}={path} is a directory, not a file.']
  if not os.path.isdir(folder):
    return [f'{flag}={path}: the folder {folder} does not exist.']
  if os.path.exists(path) and not os.access(path, os.W_OK):
    return [f'{flag}={path} is not writable.']
  if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
    return [f'{flag}={path}: the folder {folder} is not writable.']
  return []


def writable_dir_errors(path: str, flag: str) -> list[str]:
  """Whether folder `path` is, or can be created, writable (its nearest existing ancestor).

  A URL: its form, and that its bucket exists and takes writes (`storage.bucket_errors`).
  """
  if (errors := storage.path_errors(path, flag)) or storage.is_url(path):
    return errors or storage.bucket_errors(path, flag)
  path = os.path.abspath(os.path.expanduser(path))
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return [f'{flag}: {existing} is a file, so {path} cannot be a folder.']
  if not os.access(existing, os.W_OK | os.X_OK):
    return [f'{flag}: {existing} is not writable, so nothing can be written to {path}.']
  return []
