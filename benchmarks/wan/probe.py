"""Link measurement tools run inside the emulated namespaces, each printing one JSON object:
`serve` (a TCP server that echoes connections opening with `E` and counts the bytes of those
opening with `S` into 10 ms receive bins, reported on SIGTERM), `rtt` (median of one-byte echo
round trips over one TCP_NODELAY connection: the emulated two-way delay with no handshake or
delayed ACK in it) and `send` (K parallel bulk TCP streams for T seconds). Rates are read from
the receiver's bins, since bytes a sender has written may still be in buffers and the delay line.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import statistics
import sys
import threading
import time

BIN_S = 0.01
CHUNK = 1 << 20
REALTIME_PRIORITY = 10


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def realtime() -> None:
    """Best effort: a low SCHED_FIFO priority (the probe then wakes on time on a busy machine)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except OSError:
        pass


def serve(port: int) -> int:
    """Echo or sink connections until SIGTERM; then print the sink's receive bins."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    listener = socket.create_server(("0.0.0.0", port), backlog=128, reuse_port=False)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    bins: list[int] = []
    first_byte_at: float | None = None
    buf = bytearray(CHUNK)
    print(json.dumps({"listening": listener.getsockname()[1]}), flush=True)
    while not stopping.is_set():
        for key, _ in sel.select(timeout=0.2):
            conn = key.fileobj
            if key.data == "accept":
                client, _ = listener.accept()
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sel.register(client, selectors.EVENT_READ, "new")
                continue
            try:
                n = conn.recv_into(buf)
            except ConnectionError:
                n = 0
            if n == 0:
                sel.unregister(conn)
                conn.close()
                continue
            mode = key.data
            payload = memoryview(buf)[:n]
            if mode == "new":
                mode = "echo" if payload[0:1] == b"E" else "sink"
                sel.modify(conn, selectors.EVENT_READ, mode)
                payload = payload[1:]
            if mode == "echo":
                conn.sendall(payload)
            elif payload:
                now = time.monotonic()
                if first_byte_at is None:
                    first_byte_at = now
                index = int((now - first_byte_at) / BIN_S)
                if index >= len(bins):
                    bins.extend([0] * (index + 1 - len(bins)))
                bins[index] += len(payload)
    print(json.dumps({"bins": bins, "bin_s": BIN_S}), flush=True)
    return 0


def rtt(target: str, count: int, timeout: float) -> int:
    """Measure data round trips over one established connection."""
    realtime()
    with socket.create_connection(split_host_port(target), timeout=timeout) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(b"E")
        samples = []
        for i in range(count + 1):
            start = time.perf_counter()
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise ConnectionError("echo server closed the connection")
            if i:  # the first round trip warms up ARP and the connection
                samples.append((time.perf_counter() - start) * 1000.0)
    print(json.dumps({"rtt_ms": statistics.median(samples), "samples_ms": samples}), flush=True)
    return 0


def send(target: str, streams: int, seconds: float, timeout: float) -> int:
    """Push zeros over `streams` connections for `seconds`."""
    deadline = time.monotonic() + seconds
    sent = [0] * streams
    errors: list[str] = []

    def pump(slot: int) -> None:
        data = bytes(CHUNK)
        try:
            with socket.create_connection(split_host_port(target), timeout=timeout) as sock:
                sock.sendall(b"S")
                while time.monotonic() < deadline:
                    sent[slot] += sock.send(data)
        except OSError as exc:
            errors.append(f"stream {slot}: {exc}")

    threads = [threading.Thread(target=pump, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"sent": sum(sent), "errors": errors}), flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure an emulated link: echo/sink server, RTT probe, bulk sender.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--realtime", action="store_true", help="for an echo server only")
    p = sub.add_parser("rtt")
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--timeout", type=float, default=10.0)
    p = sub.add_parser("send")
    p.add_argument("--to", required=True)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.realtime:
            realtime()
        return serve(args.port)
    if args.command == "rtt":
        return rtt(args.to, args.count, args.timeout)
    return send(args.to, args.streams, args.seconds, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
