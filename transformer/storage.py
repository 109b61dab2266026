"""Where a run's files live: local paths and object-store URLs (gs://, s3://), one path type.

Every path a run reads or writes (its workdir, a vocabulary, raw data, eval
outputs, sweep roots) may be a local path or a `gs://bucket/...` or
`s3://bucket/...` URL. URLs go through `etils.epath` and its fsspec backends
(`gcsfs`, `s3fs`: the buckets extra, without which `path_errors` refuses a URL), the path
type Orbax and TFDS use; local paths keep `os`'s behaviour, so that a local run writes
exactly what it wrote before URLs existed.

Object stores differ from a file system in three ways this module absorbs:
- No rename: a file is written whole with one PUT (atomic: a reader sees the
  old object or the new one), not a temporary file moved into place.
- No append: `append_text` rewrites the object (one GET and one PUT); writers that
  append often keep the content and call `write_text` (`metrics.MetricsWriter`).
- No folders: a "folder" exists while an object lies under its prefix;
  `makedirs` is a no-op there.
- Objects replaced while read: `read_bytes` is one GET of the whole object, so a
  reader gets one version (a size look-up followed by ranged reads could mix two).

Every request has a bounded wait and a bounded number of tries (`configure_clients`).

Credentials and endpoints are the clients' own: Application Default Credentials
(or `STORAGE_EMULATOR_HOST` for a local emulator) for gs://, the AWS chain (or
`AWS_ENDPOINT_URL`) for s3://. A `GOOGLE_APPLICATION_CREDENTIALS` that names no usable file
is refused with the path of every gs:// URL, before any request; so is a gcsfs token from the
environment (`FSSPEC_GS_TOKEN`) that names no usable file
(`google_credentials.credential_errors`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging as py_logging
import os
import posixpath
import re
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec.config
from etils import epath

from transformer import domains, extras, google_credentials
from transformer.errors import InvalidInput

# No listings cache for buckets: another process (the training run, a resumed one, eval.py)
# changes the objects, and fsspec would answer sizes and listings from what it saw before (a
# read of metrics.jsonl cut at its old size). Every look goes to the store.
for _protocol in ('gs', 'gcs', 's3', 's3a'):
  fsspec.config.conf.setdefault(_protocol, {}).setdefault('use_listings_cache', False)

# A storage request that gets no answer: how long each client waits for one before it gives up
# on the connection and retries (a bounded number of times), in seconds. gcsfs sets no timeout at
# all (aiohttp's `timeout=None`: a server that accepts and never answers holds the call, and the
# run, forever); s3fs and TensorStore have their own. TRANSFORMER_STORAGE_TIMEOUT_SECONDS sets it.
TIMEOUT_ENV = 'TRANSFORMER_STORAGE_TIMEOUT_SECONDS'
DEFAULT_TIMEOUT_SECONDS = 60.0
# The attempts of one call are the clients' own: gcsfs's `GCSFileSystem.retries` (6) and s3fs's
# `S3FileSystem.retries` (5), each of those a single botocore attempt (set here). gcsfs retries
# a server's error (HTTP 5xx) itself; s3fs only a timeout or a "SlowDown", so a 5xx from S3
# (InternalError, ServiceUnavailable: "retry the request", in AWS's own words) is added to what
# it retries (`_s3_retries_server_errors`).


def timeout_seconds() -> float:
  """TRANSFORMER_STORAGE_TIMEOUT_SECONDS, or DEFAULT_TIMEOUT_SECONDS; a bad value is refused."""
  return domains.seconds_from_env(
    TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS, 0.1, 3600, "a storage request's timeout"
  )


def configure_clients(seconds: float | None = None) -> None:
  """Gives every storage client a bounded wait per request (`seconds`, or `timeout_seconds()`).

  - gcsfs: aiohttp's connect and read timeouts (`requests_timeout`); a request that times out is
    an aiohttp `ClientError`, retried by gcsfs at most `GCSFileSystem.retries` times in all.
  - s3fs: botocore's connect and read timeouts, one botocore attempt per s3fs attempt.
  - TensorStore (Orbax's arrays on gs://): curl gives up on a transfer that moves nothing for
    that long (`TENSORSTORE_CURL_LOW_SPEED_*`, read when its first request is made) and the
    driver retries it; set only where the user has not.
  Called when this module is imported; again by tests that change the setting.
  """
  seconds = timeout_seconds() if seconds is None else seconds
  try:
    import aiohttp  # pylint: disable=g-import-not-at-top  (gcsfs's client, installed with it)
  except ImportError:  # Without the buckets extra: gs:// paths are refused (`path_errors`).
    aiohttp = None
  if aiohttp is not None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)
    for protocol in ('gs', 'gcs'):
      fsspec.config.conf[protocol]['requests_timeout'] = timeout
  for protocol in ('s3', 's3a'):
    conf = fsspec.config.conf[protocol]
    conf['config_kwargs'] = {
      **conf.get('config_kwargs', {}),
      'connect_timeout': seconds,
      'read_timeout': seconds,
      'retries': {'total_max_attempts': 1},
    }
  os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS', str(max(1, round(seconds))))
  os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')


# URL schemes a path may have; anything else with '://' (hdfs://, file://, http://) is refused.
URL_SCHEMES = ('gs', 's3')
# The fsspec backend of each, from the buckets extra (requirements/buckets.txt), and what needs it.
BACKENDS = {'gs': ('gcsfs', 'a gs:// path'), 's3': ('s3fs', 'an s3:// path')}
_URL = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$')
# 'gs:/bucket' or 'gs:bucket': a URL with a slash missing, which os would read as a local path.
_MALFORMED = re.compile(r'^(gs|s3):/?(?!/)', re.IGNORECASE)
# Bucket names, as both stores allow them: 3-63 of lowercase letters, digits, '-', '_' and '.'.
_BUCKET = re.compile(r'^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$')


# Schemes Orbax can write checkpoints to: orbax-checkpoint 0.12.8 builds its TensorStore specs for
# gs:// (the `gcs` driver) and local paths only; an s3:// path is normalized to 's3:/BUCKET/...'
# and refused as not absolute (orbax/checkpoint/_src/serialization/tensorstore_utils.py,
# `_normalize_path` and `_build_ocdbt_kvstore_tspec`), although TensorStore has an s3 driver.
CHECKPOINT_SCHEMES = ('gs',)


def checkpoint_errors(workdir: str, name: str) -> list[str]:
  """Errors of a workdir URL whose scheme Orbax cannot write or read checkpoints at."""
  match = _URL.match(os.fspath(workdir))
  if match is None or match.group(1) not in URL_SCHEMES or match.group(1) in CHECKPOINT_SCHEMES:
    return []
  return [
    f'{name}={workdir}: checkpoints cannot live on {match.group(1)}:// yet. Orbax (the '
    'checkpoint library) writes arrays through TensorStore only to local paths and gs://; it '
    f'reads {match.group(1)}://BUCKET as the local folder {match.group(1)}:/BUCKET. Train to '
    'gs://, a local path or a shared file system (s3:// serves vocabularies, eval outputs, '
    'sweep roots and compare.py inputs).'
  ]


def is_url(path: str | os.PathLike) -> bool:
  """Whether `path` is a URL (any scheme): `path_errors` refuses those not in `URL_SCHEMES`."""
  return _URL.match(os.fspath(path)) is not None


def path_errors(path: str | None, name: str) -> list[str]:
  """Errors of a path given as `name` (a flag or config key): scheme, bucket and form.

  A local path is always well formed here (whether it exists is its caller's question).
  """
  if not path:
    return []
  path = os.fspath(path)
  if _MALFORMED.match(path):
    scheme, rest = path.split(':', 1)
    return [
      f'{name}={path} is not a URL: {scheme}:// takes two slashes '
      f'(did you mean {scheme.lower()}://{rest.lstrip("/")}?).'
    ]
  match = _URL.match(path)
  if match is None:
    return []
  scheme, rest = match.groups()
  if scheme not in URL_SCHEMES:
    return [
      f'{name}={path}: the scheme {scheme}:// is not handled; use a local path, '
      + ' or '.join(f'{s}://BUCKET/...' for s in URL_SCHEMES)
      + '.'
    ]
  bucket = rest.split('/', 1)[0]
  if not _BUCKET.match(bucket):
    return [
      f'{name}={path}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '
      f"'-', '_' or '.'): write {scheme}://BUCKET/PATH."
    ]
  if '//' in rest or rest.endswith('/.') or '/../' in f'{rest}/':
    return [f"{name}={path}: a URL's path may not hold empty, '.' or '..' parts."]
  backend, use = BACKENDS[scheme]
  if problem := extras.missing(backend, 'buckets', use):
    return [f'{name}={path}: {problem}']
  return google_credentials.credential_errors(path, name)


def resolve(path: str | os.PathLike) -> str:
  """`path` canonical: a URL without a trailing '/'; a local path absolute, `~` expanded."""
  path = os.fspath(path)
  if is_url(path):
    return path.rstrip('/')
  return os.path.abspath(os.path.expanduser(path))


def join(path: str, *parts: str) -> str:
  """`os.path.join` for local paths, '/'-joined for URLs."""
  return posixpath.join(path, *parts) if is_url(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
  return posixpath.dirname(path) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
  return posixpath.basename(path) if is_url(path) else os.path.basename(path)


def bucket(path: str) -> str:
  """'gs://bucket' of 'gs://bucket/a/b'."""
  scheme, rest = _URL.match(path).groups()
  return f'{scheme}://{rest.split("/", 1)[0]}'


def epath_of(path: str | os.PathLike) -> epath.Path:
  """The `epath.Path` of `path` (what Orbax, Grain and TFDS take)."""
  path = os.fspath(path)
  if path.startswith('s3://'):
    _s3_retries_server_errors()
  return epath.Path(path)


def exists(path: str) -> bool:
  return epath_of(path).exists() if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  """Locally a folder; on a bucket, a prefix that some object lies under."""
  return epath_of(path).is_dir() if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
  """Locally a file; on a bucket, an object named `path`, asked in one request.

  Not epath's `is_file`: that is `exists() and not is_dir()`, two requests, and a folder
  whose only object (another process's write probe) goes away between them reads as a file.
  """
  if not is_url(path):
    return os.path.isfile(path)
  filesystem, key = _filesystem(path)
  return filesystem.isfile(key)


def listdir(path: str) -> list[str]:
  """The names in folder `path` (FileNotFoundError if there is none)."""
  if not is_url(path):
    return os.listdir(path)
  directory = epath_of(path)
  if not directory.is_dir():
    raise FileNotFoundError(f'No folder at {path}.')
  return [child.name for child in directory.iterdir()]


def makedirs(path: str) -> None:
  """Creates folder `path` and its parents; on a bucket folders need no creating."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
  """Removes file `path` (FileNotFoundError if there is none)."""
  if is_url(path):
    if not isfile(path):
      raise FileNotFoundError(f'No file at {path}.')
    epath_of(path).unlink()
  else:
    os.remove(path)


def rmtree(path: str) -> None:
  epath_of(path).rmtree()


def sizes(root: str) -> dict[str, int]:
  """{path relative to `root`, '/'-separated: bytes} of every file under folder `root`.

  On a bucket one listing (pages of 1,000 objects), not a request per file; {} if absent.
  """
  if not is_url(root):
    found = {}
    for folder, _, names in os.walk(root):
      for name in names:
        path = os.path.join(folder, name)
        found[os.path.relpath(path, root).replace(os.sep, '/')] = os.path.getsize(path)
    return found
  filesystem, key = _filesystem(root)
  prefix = key.rstrip('/') + '/'
  listed = filesystem.find(prefix, detail=True)
  return {
    name[len(prefix) :]: int(info['size'])
    for name, info in listed.items()
    if name.startswith(prefix) and info.get('type') != 'directory'
  }


def copy_files(source: str, target: str, names: Iterable[str]) -> None:
  """Copies the files `names` ('/'-separated, relative) of folder `source` to `target`."""
  for name in names:
    destination = join(target, *name.split('/'))
    makedirs(dirname(destination))
    write_bytes(destination, read_bytes(join(source, *name.split('/'))))


def copytree(source: str, target: str) -> None:
  """Copies every file under folder `source` to the same place under `target` (any of them URLs)."""
  copy_files(source, target, sizes(source))


def glob(directory: str, pattern: str) -> list[str]:
  """The paths in `directory` whose names match `pattern`, sorted."""
  if not is_url(directory):
    import glob as glob_lib  # pylint: disable=g-import-not-at-top

    return sorted(glob_lib.glob(os.path.join(directory, pattern)))
  return sorted(os.fspath(p) for p in epath_of(directory).glob(pattern))


def mtime(path: str) -> float:
  """When file `path` was last written, in seconds since the epoch (on a bucket, the store's)."""
  if not is_url(path):
    return os.path.getmtime(path)
  filesystem, key = _filesystem(path)
  info = filesystem.info(key)
  written = info.get('mtime') or info.get('LastModified') or info.get('updated')
  if isinstance(written, str):
    import datetime  # pylint: disable=g-import-not-at-top

    written = datetime.datetime.fromisoformat(written.replace('Z', '+00:00'))
  return written.timestamp()


def read_bytes(path: str) -> bytes:
  """The bytes of `path`; on a bucket, one whole version of the object, even while it is replaced.

  One GET of the whole object (`cat_file`), not a file opened through epath: that looks the size
  up first and then reads ranges, so a replacement in between gave gcsfs a torn read (the new
  content cut to the old size) and s3fs an error (its ranges are bound to the first ETag).
  """
  if not is_url(path):
    with open(path, 'rb') as f:
      return f.read()
  filesystem, key = _filesystem(path)
  if path.startswith('s3://'):
    # s3fs (2026.9) reads an object over its block size (50 MB) in concurrent ranges unless
    # told not to; each range could come from another version.
    return filesystem.cat_file(key, max_concurrency=1)
  return filesystem.cat_file(key)


def read_text(path: str, errors: str = 'strict') -> str:
  """The UTF-8 text of `path` (FileNotFoundError if there is none)."""
  return read_bytes(path).decode('utf-8', errors)


def read_json(path: str, what_to_do: str) -> Any:
  """The JSON value in `path`; a damaged file (cut short, edited) is an error naming it.

  `what_to_do`: the end of the message, e.g. how to write the file again.
  """
  try:
    return json.loads(read_text(path))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    where = f'line {e.lineno}: {e.msg}' if isinstance(e, json.JSONDecodeError) else e.reason
    raise InvalidInput(f'{path} is damaged: not JSON ({where}). {what_to_do}') from None


@contextlib.contextmanager
def replacing(path: str, *, overwrite: bool = True) -> Iterator[str]:
  """Yields a temporary local path to write; when the block ends, it becomes `path`.

  Locally `atomic.replacing`. For a URL the file is written to a local temporary
  folder and uploaded with one PUT: whole or not at all, like the rename. For
  writers that want a file name (SentencePiece, matplotlib).
  """
  from transformer import atomic  # pylint: disable=g-import-not-at-top

  if not is_url(path):
    with atomic.replacing(path, overwrite=overwrite) as tmp:
      yield tmp
    return
  import tempfile  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory(prefix='transformer-upload-') as folder:
    tmp = os.path.join(folder, basename(path))
    yield tmp
    with open(tmp, 'rb') as f:
      write_bytes(path, f.read(), overwrite=overwrite)


def write_bytes(path: str, data: bytes, *, overwrite: bool = True) -> None:
  """Writes `data` to `path` whole or not at all (locally `atomic.write_bytes`; one PUT to a URL).

  `overwrite=False` keeps an existing `path`: FileExistsError, and the new content is
  dropped (a create-if-absent object on a bucket).
  """
  from transformer import atomic  # pylint: disable=g-import-not-at-top

  if not is_url(path):
    atomic.write_bytes(path, data, overwrite=overwrite)
    return
  if not overwrite:
    create_exclusive(path, data)
    return
  epath_of(path).write_bytes(data)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode('utf-8'))


def write_json(path: str, value: Any, **dump_options: Any) -> None:
  write_text(path, json.dumps(value, **dump_options))


def append_text(path: str, text: str) -> None:
  """Appends `text` to `path` (created if absent).

  Locally one `write` in append mode. An object cannot be appended to: it is read
  and written again whole (one GET and one PUT), so a reader never sees a torn line.
  One writer per file.
  """
  if not is_url(path):
    with open(path, 'a', encoding='utf-8') as f:
      f.write(text)
    return
  try:
    before = read_text(path)
  except FileNotFoundError:
    before = ''
  write_text(path, before + text)


def _filesystem(path: str):
  import fsspec  # pylint: disable=g-import-not-at-top

  scheme = _URL.match(path).group(1)
  if scheme == 's3':
    _s3_retries_server_errors()
  return fsspec.filesystem(scheme), path.split('://', 1)[1]


def is_server_error(error: BaseException) -> bool:
  """Whether `error` is an S3 answer of HTTP 5xx (botocore's `ClientError`): worth a retry."""
  response = getattr(error, 'response', None)
  if not isinstance(response, dict):
    return False
  return response.get('ResponseMetadata', {}).get('HTTPStatusCode', 0) >= 500


@functools.cache
def _s3_retries_server_errors() -> None:
  """s3fs retries an S3 5xx as it retries a timeout (its tries, its backoff), once per process.

  s3fs's public hook (`set_custom_error_handler`) takes one function for the process; one the
  user set before is kept and asked first. Installed when the first s3:// path is used, so a
  run that never uses one does not import s3fs (a quarter of a second).
  """
  from s3fs import core as s3fs_core  # pylint: disable=g-import-not-at-top

  previous = s3fs_core.CUSTOM_ERROR_HANDLER
  s3fs_core.set_custom_error_handler(lambda error: previous(error) or is_server_error(error))


def create_exclusive(path: str, data: bytes) -> None:
  """Creates file `path` holding `data` if nothing is there; else FileExistsError, no change.

  Locally `O_CREAT | O_EXCL`; on a bucket a conditional PUT: GCS `ifGenerationMatch=0`, S3
  `If-None-Match: *` (fsspec's `mode='create'`). Two processes on any hosts: one wins.
  On a bucket, the clients retry a request answered with a 5xx even where its first try landed,
  and the retry finds the object: an object that holds exactly `data` is taken as this call's.
  Callers that must know they won a race (locks) put a token of their own in `data`.
  """
  if not is_url(path):
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    return
  filesystem, key = _filesystem(path)
  try:
    filesystem.pipe_file(key, data, mode='create')
  except FileExistsError:
    try:
      if read_bytes(path) == data:
        return
    except FileNotFoundError:
      pass
    raise
  finally:
    filesystem.invalidate_cache(key)


def bucket_errors(path: str, name: str) -> list[str]:
  """For a URL `path` to be written: that its bucket exists and takes writes (before any work).

  Looks the bucket up, then writes and removes one empty object under `path`
  (`.write-probe-*`); local paths: []. Credentials that are missing or refused, and a
  bucket that refuses writes, are named as such.
  """
  if not is_url(path) or path_errors(path, name):
    return []
  import uuid  # pylint: disable=g-import-not-at-top

  root = bucket(path)
  filesystem, key = _filesystem(join(path, f'.write-probe-{uuid.uuid4().hex}'))
  looking = 'looked up'
  try:
    filesystem.info(key.split('/', 1)[0])  # The bucket: FileNotFoundError if there is none.
    looking = 'written'
    filesystem.pipe_file(key, b'')
    filesystem.rm_file(key)
  except FileNotFoundError:
    return [f'{name}={path}: the bucket {root} does not exist. Create it, or name another.']
  except PermissionError as e:
    return [
      f'{name}={path}: {root} refuses to be {looking} with these credentials ({e}). Check '
      'them (gcloud auth application-default login; AWS_PROFILE or AWS_ACCESS_KEY_ID) and '
      "the bucket's permissions."
    ]
  except Exception as e:  # Endpoints, the network: the client's own words.
    first = str(e).splitlines()[0][:300] if str(e) else ''
    return [
      f'{name}={path}: {root} cannot be {looking} ({type(e).__name__}: {first}). Check the '
      'credentials (gcloud auth application-default login; AWS_PROFILE or AWS_ACCESS_KEY_ID) '
      'and the endpoint (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL).'
    ]
  return []


class _WithoutTraceback(py_logging.Filter):
  """Keeps a client's log line and drops its traceback: the caller says what failed, once."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    record.exc_info, record.exc_text = None, None
    return True


# gcsfs logs each request that ran out of tries with `logger.exception` (a traceback on stderr)
# before it raises the same error to its caller.
py_logging.getLogger('gcsfs').addFilter(_WithoutTraceback())

try:
  configure_clients()
except InvalidInput:  # Refused before any work (`path_checks.setting_errors`); meanwhile, defaults.
  configure_clients(DEFAULT_TIMEOUT_SECONDS)
