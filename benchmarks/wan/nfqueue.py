"""A minimal NFQUEUE client over a raw netlink socket: bind a queue, receive packet ids, accept or drop them.

Only what the delayer needs, and none of what makes a general binding costly: the queue copies no
packet bytes (metadata only), takes GSO packets whole instead of having the kernel cut each into
MTU-sized packets first (`NFQA_CFG_F_GSO`), and one batch verdict accepts every packet up to an id,
so a busy link costs a system call per packet received and one per batch released. Message layouts
are those of <linux/netfilter/nfnetlink_queue.h>; numbers on the wire inside nfnetlink are big-endian.
"""

from __future__ import annotations

import errno
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CAP_LEN = 13  # the packet's length, sent when part of it is copied (COPY_PACKET with a range)
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND = 1, 2
NFQNL_COPY_META, NFQNL_COPY_PACKET = 1, 2
SIZED_COPY = 20
"""Bytes of each packet copied when its length is wanted: the kernel then also sends that length."""
NFQA_CFG_F_GSO = 4
NF_DROP, NF_ACCEPT = 0, 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2

_NLMSGHDR = struct.Struct("=IHHII")  # host order: length, type, flags, sequence, port id
_NFGENMSG = struct.Struct("!BBH")  # family, version, queue number
_NLATTR = struct.Struct("=HH")  # host order: length, type
RECV_BYTES = 65536
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


class NfqueueError(OSError):
    """The kernel refused a queue command."""


def _attr(kind: int, payload: bytes) -> bytes:
    body = _NLATTR.pack(_NLATTR.size + len(payload), kind) + payload
    return body + b"\0" * (-len(body) % 4)


class Queue:
    """One bound NFQUEUE: `fileno()` for select, `receive()` for the ids that arrived, `accept_upto`."""

    def __init__(self, number: int, max_len: int, sock_bytes: int, sized: bool = False):
        self.number = number
        self.sized = sized
        """Whether the kernel sends each packet's length (with its first SIZED_COPY bytes, a slightly
        larger notice): `receive_sized` needs it, to count the segments of a GSO packet."""
        self.lost = 0
        """Times the socket overflowed: each time, the kernel dropped the packets it could not report."""
        self._seq = 0
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            # A notice the socket has no room for costs the packet: the kernel drops it. The limit
            # for SO_RCVBUF (net.core.rmem_max, ~200 KiB by default) holds a few hundred notices, so
            # bursts would lose packets; root may force a bigger buffer.
            try:
                self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, sock_bytes)
            except PermissionError:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_bytes)
            self._sock.bind((0, 0))
            self._buf = bytearray(RECV_BYTES)
            self._command(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)))
            copy = (struct.pack("!IB", SIZED_COPY, NFQNL_COPY_PACKET) if sized
                    else struct.pack("!IB", 0xFFFF, NFQNL_COPY_META))
            self._command(_attr(NFQA_CFG_PARAMS, copy)
                          + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", max_len))
                          + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))
                          + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
            self._sock.setblocking(False)
        except BaseException:
            self._sock.close()
            raise

    def fileno(self) -> int:
        return self._sock.fileno()

    def _message(self, kind: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
        self._seq += 1
        body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, self.number) + attrs
        return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, self._seq, 0) + body

    def _command(self, attrs: bytes) -> None:
        """Send a config message and wait for the kernel's acknowledgement (raise on refusal)."""
        self._sock.send(self._message(NFQNL_MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK))
        while True:
            n = self._sock.recv_into(self._buf)
            length, kind, _, seq, _ = _NLMSGHDR.unpack_from(self._buf, 0)
            if kind == NLMSG_ERROR and seq == self._seq and n >= _NLMSGHDR.size + 4:
                code = -struct.unpack_from("=i", self._buf, _NLMSGHDR.size)[0]
                if code:
                    raise NfqueueError(code, f"NFQUEUE {self.number}: {errno.errorcode.get(code, code)}")
                return

    def receive(self) -> list[int]:
        """Ids of the packets queued since the last call (an empty list when none is waiting)."""
        return [packet_id for packet_id, _ in self._receive(False)]

    def receive_sized(self) -> list[tuple[int, int]]:
        """(id, length in bytes) of the packets queued since the last call (GSO packets: their whole length)."""
        return self._receive(True)

    def _receive(self, sized: bool) -> list[tuple[int, int]]:
        ids: list[tuple[int, int]] = []
        recv_into, buf = self._sock.recv_into, self._buf
        while True:
            try:
                n = recv_into(buf)
            except BlockingIOError:
                return ids
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # notices lost (the kernel has dropped their packets)
                    self.lost += 1
                    continue
                raise
            offset = 0
            while offset + _NLMSGHDR.size <= n:
                length, kind, _, _, _ = _NLMSGHDR.unpack_from(buf, offset)
                if length < _NLMSGHDR.size:
                    break
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    ids.append(self._packet(offset + _NLMSGHDR.size + _NFGENMSG.size, offset + length, sized))
                offset += (length + 3) & ~3

    def _packet(self, at: int, end: int, sized: bool) -> tuple[int, int]:
        """(id, length) of one notice; the length only when `sized` (0 otherwise, or if not sent)."""
        buf = self._buf
        packet_id = size = None
        while at + _NLATTR.size <= end:
            length, kind = _NLATTR.unpack_from(buf, at)
            if length < _NLATTR.size:
                break
            kind &= 0x7FFF
            if kind == NFQA_PACKET_HDR:
                packet_id = struct.unpack_from("!I", buf, at + _NLATTR.size)[0]
                if not sized:
                    return packet_id, 0
            elif kind == NFQA_CAP_LEN:
                size = struct.unpack_from("!I", buf, at + _NLATTR.size)[0]
            at += (length + 3) & ~3
        if packet_id is None:
            raise NfqueueError(errno.EPROTO, "packet notice without a packet header")
        return packet_id, size or 0

    def accept_upto(self, packet_id: int) -> None:
        """Accept every packet of the queue with an id up to `packet_id` (one batch verdict)."""
        self._sock.send(self._message(NFQNL_MSG_VERDICT_BATCH,
                                      _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))))

    def drop(self, packet_id: int) -> None:
        """Drop one packet of the queue (a verdict of its own; the packets around it stay queued)."""
        verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_DROP, packet_id))
        self._sock.send(self._message(NFQNL_MSG_VERDICT, verdict))

    def close(self) -> None:
        try:
            self._sock.setblocking(True)
            self._command(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, socket.AF_INET)))
        except OSError:
            pass  # the socket's end unbinds the queue as well
        finally:
            self._sock.close()
