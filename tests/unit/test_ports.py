"""``free_port``: the ports the stack, the benchmark and the conformance run give their
servers. Picked where no outgoing connection can take them before the server binds, and
never twice: a ``vllm serve`` of the benchmark once lost its side channel's port so."""

from __future__ import annotations

import socket

from kvpush.services.launch import natsd
from kvpush.services.launch.natsd import free_port, listen_ports


def test_ports_are_picked_below_the_ephemeral_range_where_connections_take_theirs():
    assert listen_ports("32768\t60999\n") == range(20768, 32768)
    assert listen_ports("2000 60999") == range(1024, 2000)
    ephemeral_low = int(natsd.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    picked = [free_port() for _ in range(50)]
    assert all(port < ephemeral_low for port in picked)
    assert len(set(picked)) == len(picked), "never the same port twice"


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        free = free_port()
        monkeypatch.setattr(natsd, "listen_ports", lambda: range(taken, taken + 1))
        fallback = free_port()  # the only candidate is taken: the kernel picks
        assert fallback != taken and free != taken
