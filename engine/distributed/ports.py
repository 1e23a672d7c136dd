"""Ports for torch.distributed's rendezvous (`tcp://host:port`): one free one, chosen by the OS."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now ("" binds every interface: a master other nodes reach).

    The socket is closed before the port is used, so another process may take it in between;
    the rendezvous then fails at once with "address in use" rather than hanging.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
