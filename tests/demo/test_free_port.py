"""`free_port` hands out ports below the kernel's ephemeral range, so no outgoing connection of any
process can take one between the pick and its owner's bind (the demo picks every service's port
before it starts them, and they connect to each other as they come up)."""

from __future__ import annotations

import socket

from deltamesh.mesh.demo import processes


def test_ports_are_free_and_below_the_ephemeral_range(tmp_path):
    low = processes._ephemeral_low()
    ports = {processes.free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: the pick holds nothing
    # Outgoing connections take their local ports from the range, never one of these.
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as c:
        assert c.getsockname()[1] >= low


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path):
    ranged = tmp_path / "range"
    ranged.write_text("40000\t60999\n")
    assert processes._ephemeral_low(ranged) == 40000
    assert processes._ephemeral_low(tmp_path / "missing") == 32768
    ranged.write_text("garbage")
    assert processes._ephemeral_low(ranged) == 32768
