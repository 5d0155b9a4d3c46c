"""A client that hangs up mid-answer (a pool stopped, a relay turned to another source) is routine for a
gateway: one INFO line, no ERROR and no traceback. A real `deltamesh gateway` process, and a raw socket
that reads the start of a 22 MB piece and resets the connection."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import torch

from deltamesh.trainer.publisher import Publisher


def test_a_client_that_hangs_up_mid_piece_is_one_info_line(kit, spawn_gateway):
    gw = spawn_gateway("origin")
    big = {"w": torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)}
    asyncio.run(Publisher(gw.url, kit.key.key, "tiny", piece_bytes=32 << 20).publish(big))
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.socket() as s:
        # A fixed small window: loopback's autotuned one (tens of MB) could take the whole piece first.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        s.connect((host, int(port)))
        s.sendall(b"GET /v1/models/tiny/versions/0/full/pieces/0 HTTP/1.1\r\nHost: gw\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)  # the gateway is now blocked on a full window, mid-piece
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    kit.wait_until(lambda: "the client went away" in gw.log_tail(), 10, "the gateway to notice")
    log = gw.log_tail()
    assert "Traceback" not in log and " E " not in log, log
    assert kit.get_json(f"{gw.url}/healthz") is not None  # and it serves on
