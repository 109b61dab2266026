"""What produced a run: command line, code version, package versions, devices and input files.

Every start of training appends one JSON line to WORKDIR/provenance.jsonl, so a
resumed run keeps the history of each process that wrote to the workdir; a start
under other code (a different git commit or different uncommitted changes) or
other package versions than the previous one is logged as a warning, since the
checkpoints then continue a run that the current code did not begin.
(WORKDIR/config.json, written beside it, holds the resolved config; its changes
on resume are reported by `runs.write_config`.)

Each entry also records, by content, the files the run depends on (`inputs`): the
vocabulary (sha256 of the SentencePiece model) and the training data (the
fingerprint of its source files, which keys the prepared data and ids). A
resume whose inputs differ in content, at whatever path, is refused
(`input_changes`): the checkpoint's token ids and data position would mean
something else. The same content at another path is the same input.

A new run that starts from another run's parameters (`config.init_from`) records, in the
entry of that start, where they came from (`initialization`): the source, the steps read
and the sha256 of the parameters.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any

import jax
from absl import logging

import transformer
from transformer import storage

# Distributions whose versions can change numbers or behaviour of a run.
PACKAGES = (
  'jax',
  'jaxlib',
  'flax',
  'optax',
  'orbax-checkpoint',
  'grain',
  'tensorflow-datasets',
  'ml_collections',
  'numpy',
  'sentencepiece',
  'sacrebleu',
)
# The checkout that holds this package (a git repository when run from source).
CODE_DIR = transformer.CODE_DIR
FILENAME = 'provenance.jsonl'
# The entry of a workdir that convert.py imported (from Hugging Face) names its source here.
IMPORTED_KEY = 'imported_from'


def package_versions() -> dict[str, str | None]:
  """{distribution: installed version, or None when it is not installed}."""
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return versions


def _git(*args: str) -> str | None:
  try:
    result = subprocess.run(
      ['git', '-C', CODE_DIR, *args], capture_output=True, timeout=30, check=True
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return result.stdout.decode('utf-8', errors='replace')


def git_state() -> dict[str, Any]:
  """The code's commit, whether tracked files differ from it, and a hash of that difference.

  `commit` is None when the code is not a git checkout (or git is missing).
  Untracked files (workdirs, data) are not code and do not make the tree dirty.
  """
  commit = _git('rev-parse', 'HEAD')
  if commit is None:
    return {'commit': None, 'dirty': None, 'diff_sha256': None}
  diff = _git('diff', 'HEAD', '--binary') or ''
  return {
    'commit': commit.strip(),
    'dirty': bool(diff),
    'diff_sha256': hashlib.sha256(diff.encode()).hexdigest() if diff else None,
  }


def current() -> dict[str, Any]:
  """This process's provenance entry."""
  devices = jax.devices()
  return {
    'time': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'command': [sys.executable, *sys.argv],
    'cwd': os.getcwd(),
    'host': socket.gethostname(),
    'python': platform.python_version(),
    'git': git_state(),
    'packages': package_versions(),
    'devices': f'{len(devices)} x {devices[0].device_kind} ({jax.process_count()} processes)',
  }


def read(workdir: str) -> list[dict[str, Any]]:
  """Every entry of WORKDIR/provenance.jsonl, oldest first ([] when there is none).

  A line that does not parse (a start killed while appending it) is skipped with a warning.
  """
  path = storage.join(workdir, FILENAME)
  if not storage.exists(path):
    return []
  entries = []
  lines = storage.read_text(path, errors='replace').splitlines(keepends=True)
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      entry = json.loads(line)
    except json.JSONDecodeError:
      entry = None
    if not isinstance(entry, dict):
      logging.warning('%s: line %d is not a provenance entry; skipping it.', path, number)
      continue
    entries.append(entry)
  return entries


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  if storage.is_url(path):
    digest.update(storage.read_bytes(path))
    return digest.hexdigest()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def vocabulary_input(config, vocabulary: bytes | None = None) -> dict[str, str | None]:
  """The vocabulary's path and sha256: of `vocabulary` (the model's bytes) or of its file.

  The hash is None while the file does not exist (it is trained on first use).
  """
  from transformer import tokenizer  # pylint: disable=g-import-not-at-top

  path = storage.resolve(tokenizer.vocab_path(config.data, config.vocab_size))
  if vocabulary is not None:
    digest = hashlib.sha256(vocabulary).hexdigest()
  else:
    digest = file_sha256(path) if storage.isfile(path) else None
  return {'path': path, 'hash': digest}


def target_vocabulary_input(config) -> dict[str, str | None] | None:
  """The target side's own vocabulary (`config.data.target_vocab_path`) by path and sha256;
  None where the run has one vocabulary for both sides."""
  from transformer import tokenizer  # pylint: disable=g-import-not-at-top

  path = tokenizer.target_vocab_path(config.data)
  if path is None:
    return None
  path = storage.resolve(path)
  return {'path': path, 'hash': file_sha256(path) if storage.isfile(path) else None}


def inputs(config, vocabulary: bytes | None = None) -> dict[str, dict[str, str | None]]:
  """The files `config` trains on, by content: {what: {'path': ..., 'hash': ...}}.

  'data': the prepared data's folder and the fingerprint of its source files (sha256 of
  their names and bytes; the catalog name for catalog datasets); 'vocabulary':
  `vocabulary_input`; 'target_vocabulary' where the target side has its own
  (`target_vocabulary_input`). Raises what `datasets.fingerprint` raises for missing source
  files.
  """
  from transformer import datasets  # pylint: disable=g-import-not-at-top

  data = {'path': datasets.dataset_dir(config.data), 'hash': datasets.fingerprint(config.data)}
  found = {'data': data, 'vocabulary': vocabulary_input(config, vocabulary)}
  if target := target_vocabulary_input(config):
    found['target_vocabulary'] = target
  return found


# What each input is, and what its hash is, for messages.
_INPUT_NAMES = {
  'vocabulary': ('the vocabulary (every token id would mean another piece)', 'sha256'),
  'target_vocabulary': (
    "the target side's vocabulary (targets would be segmented otherwise)",
    'sha256',
  ),
  'data': ('the training data (the data position would point into other examples)', 'fingerprint'),
}


def recorded_inputs(workdir: str) -> dict[str, dict[str, str | None]]:
  """The inputs recorded by the run's last start that recorded them ({} for older runs)."""
  return next((e['inputs'] for e in reversed(read(workdir)) if e.get('inputs')), {})


def input_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """'what: old path (sha256 ...) -> new path (sha256 ...)' for each input whose content changed.

  Only inputs known on both sides are compared (a vocabulary still to be trained is not).
  """
  changes = []
  if recorded and bool(recorded.get('target_vocabulary')) != bool(
    current.get('target_vocabulary')
  ):  # One vocabulary for both sides against one per side: the targets' ids would change.
    one = 'none (the vocabulary segments both sides)'
    before, now = (
      (entry or {}).get('path', one)
      for entry in (recorded.get('target_vocabulary'), current.get('target_vocabulary'))
    )
    changes.append(f'{_INPUT_NAMES["target_vocabulary"][0]}: {before} -> {now}')
  for key, now in current.items():
    before = recorded.get(key) or {}
    if before.get('hash') and now.get('hash') and before['hash'] != now['hash']:
      what, label = _INPUT_NAMES.get(key, (key, 'hash'))
      changes.append(
        f'{what}: {before.get("path")} ({label} {before["hash"][:16]}) -> {now["path"]} '
        f'({label} {now["hash"][:16]})'
      )
  return changes


def differences(previous: dict[str, Any], entry: dict[str, Any]) -> list[str]:
  """Human-readable changes of code or packages between two entries."""
  changes = []
  old_git, new_git = previous.get('git', {}), entry['git']
  if old_git.get('commit') != new_git['commit']:
    changes.append(f'git commit {old_git.get("commit")} -> {new_git["commit"]}')
  elif old_git.get('diff_sha256') != new_git['diff_sha256']:
    changes.append('uncommitted changes to the code differ (git diff HEAD)')
  old_packages = previous.get('packages', {})
  for name, version in entry['packages'].items():
    if old_packages.get(name) != version:
      changes.append(f'{name} {old_packages.get(name)} -> {version}')
  return changes


def record(
  workdir: str,
  run_inputs: dict[str, Any] | None = None,
  initialization: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Appends this process's entry (with `run_inputs`, see `inputs`) to WORKDIR/provenance.jsonl.

  `initialization`: where a new run's parameters came from (`initialization.load`'s record:
  the source, its checkpoints, the parameters' sha256), on the start that loaded them.
  Warns if the code changed since the previous entry.
  """
  entry = current()
  if run_inputs is not None:
    entry['inputs'] = run_inputs
  if initialization is not None:
    entry['initialization'] = initialization
  history = read(workdir)
  if history:
    changes = differences(history[-1], entry)
    if changes:
      logging.warning(
        'Resuming %s under other code than its previous run (%s): %s.',
        workdir,
        history[-1].get('time'),
        '; '.join(changes),
      )
  storage.append_text(storage.join(workdir, FILENAME), json.dumps(entry, sort_keys=True) + '\n')
  return entry
