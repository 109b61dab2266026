"""A `config.data.data_dir` in a bucket, mirrored into a local folder on each host.

TFDS prepares, and Grain reads, ArrayRecord files by local path (array_record's C++ reader
opens files, not URLs). So prepared data kept in a bucket is read from a per-host copy:
`local_path(gs://b/tfds/x)` is `<cache>/gs/b/tfds/x`, under `TRANSFORMER_DATA_CACHE`
(default `~/.cache/transformer/data`). `pull` copies what the bucket holds and the copy
lacks (by name and size: one listing when nothing is new); `push` uploads what the copy has
and the bucket lacks, so that the first host to prepare a dataset shares it with the others.
"""

from __future__ import annotations

import os

from absl import logging

from transformer import storage

CACHE_ENV = 'TRANSFORMER_DATA_CACHE'  # The local root of the mirrors.
# TFDS's folders of a preparation in progress: never pushed, never pulled.
_IN_PROGRESS = ('incomplete.', '.tmp', 'tmp-')


def cache_root() -> str:
  return os.path.abspath(os.path.expanduser(os.environ.get(CACHE_ENV, '~/.cache/transformer/data')))


def local_path(url: str) -> str:
  """The local mirror of `url`: '<cache>/<scheme>/<bucket>/<path>'."""
  scheme, rest = url.split('://', 1)
  return os.path.join(cache_root(), scheme, *rest.rstrip('/').split('/'))


def _files(root: str) -> dict[str, int]:
  """{path relative to `root`, '/'-separated: size} of every file under `root` (one listing)."""
  found = storage.sizes(root)
  return {
    name: size
    for name, size in found.items()
    if not any(part.startswith(_IN_PROGRESS) for part in name.split('/'))
  }


def _copy_missing(source: str, target: str, why: str) -> None:
  """Copies to `target` the files of `source` it lacks or holds at another size."""
  have = _files(target)
  missing = sorted(name for name, size in _files(source).items() if have.get(name) != size)
  if not missing:
    return
  logging.info('Copying %d files of %s to %s (%s).', len(missing), source, target, why)
  storage.copy_files(source, target, missing)


def pull(url: str) -> str:
  """Brings `local_path(url)` up to `url`; returns `local_path(url)`."""
  local = local_path(url)
  _copy_missing(url, local, 'this host reads them locally')
  return local


def push(url: str) -> None:
  """Uploads to `url` what `local_path(url)` holds and the bucket lacks."""
  _copy_missing(local_path(url), url, 'for the other hosts')
