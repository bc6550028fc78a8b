"""atom_core.net.free_port: a port nothing listens on, which a server can then bind."""

from __future__ import annotations

import socket

from atom_core.net import free_port


def test_free_port_can_be_bound_and_listened_on():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port
        # and while it is taken, the helper hands out another one
        assert free_port() != port
