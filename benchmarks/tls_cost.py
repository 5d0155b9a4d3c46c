"""CPU per byte of Python's TLS as asyncio and uvloop use it (a memory BIO), against the cipher alone.

No sockets and no HTTP: one TLS 1.3 connection between two `ssl.SSLObject`s made with deltamesh's own
contexts (`deltamesh.tls`, ECDSA P-256 certificates from `deltamesh.certs`), moving 4 MiB bodies the
way the event loops do. Sending: `SSLObject.write` of the body (encrypted into the outgoing BIO),
then one read of the BIO (the bytes handed to the socket). Receiving: the ciphertext written into the
incoming BIO 256 KiB at a time (a socket read), records read out one `SSLObject.read` at a time and
joined (asyncio's `_do_read__copied`). The cipher alone: AES-256-GCM (what TLS 1.3 negotiates here)
over 16 KiB records with `cryptography`. CPU time (`time.process_time`), so other load on the machine
moves the figures less than it moves wall-clock throughput. `--json` prints {"cipher",
"send_ns_per_byte", "receive_ns_per_byte", "aes_gcm_ns_per_byte", "bytes"}.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from deltamesh.certs import issue, make_ca
from deltamesh.tls import TlsSettings, client_context, server_context

BODY = 4 * 1024 * 1024
SOCKET_READ = 256 * 1024  # asyncio's SSLProtocol.max_size
RECORD = 16 * 1024


def connected_pair(pki: Path) -> tuple[ssl.SSLObject, ssl.SSLObject, list[ssl.MemoryBIO]]:
    """A server and a client SSLObject with their handshake done; BIOs: server in/out, client in/out."""
    ca = make_ca(pki)
    cert = issue(ca, pki, "gateway/bench", hosts=["127.0.0.1"])
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_context(TlsSettings(cert=str(cert.cert), key=str(cert.key))).wrap_bio(
        bios[0], bios[1], server_side=True)
    client = client_context(TlsSettings(ca=str(ca.cert))).wrap_bio(bios[2], bios[3], server_hostname="127.0.0.1")
    for _ in range(10):
        for end in (client, server):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                pass
        for src, dst in ((bios[3], bios[0]), (bios[1], bios[2])):
            dst.write(src.read())
    return server, client, bios


def receive(client: ssl.SSLObject, incoming: ssl.MemoryBIO, wire: bytes) -> int:
    got = 0
    for off in range(0, len(wire), SOCKET_READ):
        incoming.write(wire[off:off + SOCKET_READ])
        parts = []
        while True:
            try:
                chunk = client.read(SOCKET_READ)
            except ssl.SSLWantReadError:
                break
            if not chunk:
                break
            parts.append(chunk)
        got += len(b"".join(parts))
    return got


def measure(rounds: int) -> dict:
    body = os.urandom(BODY)
    with tempfile.TemporaryDirectory(prefix="tls-cost-") as tmp:
        server, client, bios = connected_pair(Path(tmp))
        send, recv = [], []
        for _ in range(rounds):
            t0 = time.process_time()
            server.write(body)
            wire = bios[1].read()
            t1 = time.process_time()
            assert receive(client, bios[2], wire) == BODY
            send.append(t1 - t0)
            recv.append(time.process_time() - t1)
        cipher = client.cipher()[0]
    aes, nonce, gcm, view = AESGCM(os.urandom(32)), os.urandom(12), [], memoryview(body)
    for _ in range(rounds):
        t0 = time.process_time()
        for off in range(0, BODY, RECORD):
            aes.encrypt(nonce, view[off:off + RECORD], None)
        gcm.append(time.process_time() - t0)
    def per_byte(seconds: list[float]) -> float:
        return round(statistics.median(seconds) / BODY * 1e9, 3)

    return {"cipher": cipher, "send_ns_per_byte": per_byte(send), "receive_ns_per_byte": per_byte(recv),
            "aes_gcm_ns_per_byte": per_byte(gcm), "bytes": BODY * rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--rounds", type=int, default=40, help="4 MiB bodies sent and received (median of them)")
    args = ap.parse_args(argv)
    r = measure(args.rounds)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"TLS over a memory BIO ({r['cipher']}), CPU ns per byte, median of {args.rounds} bodies of 4 MiB")
        print(f"  send (encrypt, read the BIO)          {r['send_ns_per_byte']:.3f}")
        print(f"  receive (fill the BIO, read, join)    {r['receive_ns_per_byte']:.3f}")
        print(f"  AES-256-GCM alone, 16 KiB records     {r['aes_gcm_ns_per_byte']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
