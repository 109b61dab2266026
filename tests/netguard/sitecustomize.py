"""Loaded by every Python process the tests start (PYTHONPATH): no socket leaves this machine.

`install` wraps `socket.socket.connect` (and `connect_ex`) so that a connection to any address
outside 127.0.0.0/8 and ::1 raises instead of leaving: a client that a test forgot to point at
a local server (a storage emulator) fails that test, naming the address, rather than reaching
the internet or a cloud metadata server.
"""

import ipaddress
import socket

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex


class ForbiddenConnection(ConnectionRefusedError):
  """A test tried to reach an address outside the loopback range."""


def _check(sock: socket.socket, address) -> None:
  if sock.family not in (socket.AF_INET, socket.AF_INET6):
    return  # Unix sockets, netlink: local by nature.
  host = address[0]
  try:
    loopback = ipaddress.ip_address(host.split('%')[0]).is_loopback
  except ValueError:
    loopback = host == 'localhost'  # A name: only localhost resolves to loopback for sure.
  if not loopback:
    raise ForbiddenConnection(f'Tests may only connect to 127.0.0.1 / ::1, not {address!r}.')


def _guarded_connect(self, address):
  _check(self, address)
  return _connect(self, address)


def _guarded_connect_ex(self, address):
  _check(self, address)
  return _connect_ex(self, address)


def install() -> None:
  socket.socket.connect = _guarded_connect
  socket.socket.connect_ex = _guarded_connect_ex


install()
