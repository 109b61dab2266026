"""What produced a run: command line, code version, package versions and devices.

Every start of training appends one JSON line to WORKDIR/provenance.jsonl, so a
resumed run keeps the history of each process that wrote to the workdir; a start
under other code (a different git commit or different uncommitted changes) or
other package versions than the previous one is logged as a warning, since the
checkpoints then continue a run that the current code did not begin.
(WORKDIR/config.json, written beside it, holds the resolved config; its changes
on resume are reported by `training.write_config`.)
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
CODE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILENAME = 'provenance.jsonl'


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
  """Every entry of WORKDIR/provenance.jsonl, oldest first ([] when there is none)."""
  path = os.path.join(workdir, FILENAME)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


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


def record(workdir: str) -> dict[str, Any]:
  """Appends this process's entry to WORKDIR/provenance.jsonl; warns if the code changed."""
  entry = current()
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
  with open(os.path.join(workdir, FILENAME), 'a') as f:
    f.write(json.dumps(entry, sort_keys=True) + '\n')
  return entry
