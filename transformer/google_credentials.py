"""Google credentials from the environment, checked before any request to a gs:// bucket.

`GOOGLE_APPLICATION_CREDENTIALS` and gcsfs's token variables (`FSSPEC_GS_TOKEN`,
`FSSPEC_GCS_TOKEN`) are read by the clients only when a request is made, and a value that names
no usable file sends them to their other ways in turn (the metadata server's token endpoint
among them: minutes of retries off Google Cloud), or to Google as an access token.
`credential_errors` names such a value with the path that would use it; `storage.path_errors`
calls it for every gs:// path a command is given.
"""

from __future__ import annotations

import json
import os
from typing import Any

# The service-account key (or other credentials file) Google's clients read, when set.
CREDENTIALS_ENV = 'GOOGLE_APPLICATION_CREDENTIALS'


# gcsfs's `token` argument, from the environment: fsspec's configuration reads
# FSSPEC_<PROTOCOL>_<ARGUMENT> (its value parsed as JSON where it is JSON) for either of gcsfs's
# protocols, gs and gcs (the latter wins where both are set).
TOKEN_ENVS = ('FSSPEC_GS_TOKEN', 'FSSPEC_GCS_TOKEN')
# The `token` values that name one of gcsfs's ways of finding credentials, not credentials.
TOKEN_METHODS = ('google_default', 'cache', 'cloud', 'anon', 'browser')
# What a credentials error of `credential_errors` begins with: one is enough for every path.
CREDENTIAL_PREFIXES = tuple(f'{env}=' for env in (CREDENTIALS_ENV, *TOKEN_ENVS))


def credential_errors(path: str, name: str) -> list[str]:
  """For a gs:// `path`: a `GOOGLE_APPLICATION_CREDENTIALS` that names no usable file, or a
  gcsfs token from the environment (`TOKEN_ENVS`) that names none.

  Checked here, before any request: gcsfs, finding the file missing or damaged, would try
  its other ways in turn (the metadata server's token endpoint among them: minutes of
  retries off Google Cloud), and TensorStore (Orbax's checkpoints) fails on it later.
  Unset, the clients' other credentials apply (`gcloud auth application-default login`).
  """
  if not os.fspath(path).startswith('gs://'):
    return []
  value = os.environ.get(CREDENTIALS_ENV)
  if value is None:
    return _token_errors(path, name)
  problem = None
  if not value.strip():
    problem = 'is empty'
  elif not os.path.exists(value):
    problem = 'names a file that does not exist'
  elif os.path.isdir(value):
    problem = 'names a directory, not a credentials file'
  else:
    content, problem = _json_file(value)
    if problem is None and (
      not isinstance(content, dict) or not isinstance(content.get('type'), str)
    ):
      problem = 'names a JSON file without a "type" (not a credentials file)'
  if problem is None:
    return _token_errors(path, name)
  return [
    f'{CREDENTIALS_ENV}={value} {problem}, and {name}={path} is reached with the '
    f'credentials it names. Point {CREDENTIALS_ENV} at a service-account key file (JSON), or '
    'unset it to use those of gcloud auth application-default login.'
  ]


def _json_file(path: str) -> tuple[Any, str | None]:
  """(the JSON content of the credentials file `path`, None), or (None, why it cannot be)."""
  try:
    with open(path, 'rb') as f:
      return json.loads(f.read().decode('utf-8')), None
  except PermissionError:
    return None, 'names a file that cannot be read (permission denied)'
  except OSError as e:
    return None, f'names a file that cannot be read ({e.strerror or e})'
  except (UnicodeDecodeError, json.JSONDecodeError):
    return None, 'names a file that is not JSON (not a credentials file)'


def _token_problem(token: Any) -> str | None:
  """Why gcsfs's `token` (a file's JSON, or the variable's) is no credentials, or None."""
  if not isinstance(token, dict):
    return f'is JSON ({type(token).__name__}), not an object of credentials'
  if token.get('type') == 'service_account':
    return None
  missing = [key for key in ('refresh_token', 'client_id', 'client_secret') if key not in token]
  if missing:
    return (
      f'is JSON that is neither a service-account key nor a user token (no {", ".join(missing)})'
    )
  return None


def _token_errors(path: str, name: str) -> list[str]:
  """`credential_errors` of the gcsfs token in the environment (`TOKEN_ENVS`), as gcsfs reads it.

  A method name (`TOKEN_METHODS`) or JSON null is one of gcsfs's ways of finding credentials;
  an existing file must hold credentials (a service-account key or an authorized user's token,
  JSON); a value that looks like a path (holds a '/' or ends in .json) and names nothing is
  refused, since gcsfs would send it to Google's token endpoint as an access token. Any other
  value is taken for an access token, as gcsfs takes it.
  """
  for env in TOKEN_ENVS:
    value = os.environ.get(env)
    if value is None:
      continue
    try:
      token = json.loads(value)  # As fsspec's configuration reads it.
    except json.JSONDecodeError:
      token = value
    problem = None
    if token is None or token in TOKEN_METHODS:
      continue
    if not isinstance(token, str):
      problem = _token_problem(token)
    elif not token.strip():
      problem = 'is empty'
    elif os.path.isdir(token):
      problem = 'names a directory, not a credentials file'
    elif os.path.exists(token):  # As gcsfs looks: no ~ expanded, relative to this folder.
      content, problem = _json_file(token)
      if problem is None and (found := _token_problem(content)):
        problem = f'names a file that {found}'
    elif '/' in token or os.sep in token or token.lower().endswith('.json'):
      problem = (
        'names a file that does not exist (gcsfs would send the value to Google as an access token)'
      )
    if problem is not None:
      return [
        f"{env}={value} {problem}, and {name}={path} is reached with it (gcsfs's token). Point "
        f'{env} at a credentials file (JSON: a service-account key), set it to one of '
        f'{", ".join(TOKEN_METHODS)}, or unset it to use the credentials of gcloud auth '
        'application-default login.'
      ]
  return []
