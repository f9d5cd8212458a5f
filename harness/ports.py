"""Ports: a free one to listen on, a free block for the devnet, and what holds a taken one."""

from __future__ import annotations

import socket

from devnet.anvil import describe_holder, port_is_free
from devnet.stack import free_port_base

HOST = "127.0.0.1"

__all__ = ["HOST", "describe_holder", "free_port", "free_port_base", "port_is_free"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])
