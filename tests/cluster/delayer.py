"""A userspace link delay for kernels without ``sch_netem``.

Run inside a host's namespace (``python -m tests.cluster.delayer QUEUE MS``):
it binds netfilter queue ``QUEUE`` over raw netlink (no C binding is needed)
and accepts each queued packet ``MS`` milliseconds after it arrived, in
order. The bed queues the host's link traffic to it with ``--queue-bypass``,
so packets pass undelayed rather than dropped once it is gone.
"""

import errno
import socket
import struct
import sys
import time
from collections import deque

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
# Whole GSO packets, not their 1500-byte segments: a tenth of the verdicts.
NFQA_CFG_F_GSO = 1 << 2
# Packets held at once: 200 ms of a busy link is more than the default 1024.
MAXLEN = 65536
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NLM_F_REQUEST = 1
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: bytes) -> bytes:
    # nfgenmsg: family AF_UNSPEC, version 0, the queue number (big-endian).
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return (
        struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, 0, 0)
        + body
    )


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of the NFQNL_MSG_PACKET messages in one datagram."""
    ids: list[int] = []
    at = 0
    while at + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, at)
        if size < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos, end = at + 20, at + size
            while pos + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, pos)
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += max(4, (alen + 3) & ~3)
        at += (size + 3) & ~3
    return ids


def main(queue: int, delay_s: float) -> None:
    """Hold every packet of ``queue`` for ``delay_s``, then accept it."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    for pf in (socket.AF_INET, socket.AF_INET6):
        cmd = struct.pack("=BxH", NFQNL_CFG_CMD_BIND, socket.htons(pf))
        sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, cmd)))
    sock.send(
        _message(
            NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
        )
    )
    sock.send(
        _message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", MAXLEN)))
    )
    gso = struct.pack("!I", NFQA_CFG_F_GSO)
    flags = _attr(NFQA_CFG_FLAGS, gso) + _attr(NFQA_CFG_MASK, gso)
    sock.send(_message(NFQNL_MSG_CONFIG, queue, flags))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    print("ready", flush=True)  # the bed adds its queue rule only after this line
    held: deque[tuple[float, int]] = deque()
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        sock.settimeout(timeout)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            data = b""
        except OSError as exc:
            # ENOBUFS: the kernel dropped packets we could not take in time,
            # which is loss on a busy link, not a reason to stop delaying.
            if exc.errno != errno.ENOBUFS:
                raise
            data = b""
        now = time.monotonic()
        held.extend((now + delay_s, pid) for pid in _packet_ids(data))
        while held and held[0][0] <= time.monotonic():
            verdict = struct.pack("!II", NF_ACCEPT, held.popleft()[1])
            sock.send(_message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, verdict)))


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) / 1000)
