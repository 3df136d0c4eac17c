"""Which Kafka the broker is: its release and its finalized feature levels.

librdkafka asks every broker for its API versions (ApiVersions) but keeps the answer to itself,
and Kafka has no "version" request. The release is read from what the cluster says of itself:

* a KRaft cluster (Kafka 3.3 and newer) finalizes ``metadata.version``, whose level names the
  release it speaks (level 30 is ``4.3-IV0``), and ``transaction.version`` (KIP-890: level 2
  hardens transactions on the broker's side); both come in the ApiVersions v3 answer;
* a ZooKeeper cluster reports ``inter.broker.protocol.version`` (``2.3-IV1``) in its broker
  configs.

Both are the levels the cluster *runs*, which may be lower than its binaries during an upgrade:
exactly what decides how the brokers behave. A broker that answers neither (Tansu) is reported
as such.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

__all__ = ["BrokerVersion", "api_versions", "metadata_release"]

_API_VERSIONS = 18
_UNSUPPORTED_VERSION = 35

#: ``metadata.version`` feature levels and the release they belong to (Kafka's MetadataVersion:
#: IBP_3_3_IV3 is level 7, IBP_4_3_IV0 level 30).
_RELEASE_OF_LEVEL = (
    (7, "3.3"), (8, "3.4"), (9, "3.5"), (12, "3.6"), (15, "3.7"), (20, "3.8"), (21, "3.9"),
    (22, "4.0"), (26, "4.1"), (28, "4.2"), (30, "4.3"), (31, "4.4"),
)  # fmt: skip


def metadata_release(level: int) -> str | None:
    """The Kafka release whose ``metadata.version`` range holds ``level`` (None below 3.3)."""
    release = None
    for first, name in _RELEASE_OF_LEVEL:
        if level >= first:
            release = name
    return release


@dataclass(frozen=True)
class BrokerVersion:
    """What one broker said of itself.

    Attributes:
        max_versions: the highest version of each API key it serves.
        finalized: the cluster's finalized feature levels (``metadata.version``,
            ``transaction.version``, ...); empty before Kafka 2.7 and on brokers without them.
    """

    max_versions: dict[int, int] = field(default_factory=dict)
    finalized: dict[str, int] = field(default_factory=dict)

    @property
    def kraft_release(self) -> str | None:
        level = self.finalized.get("metadata.version")
        return metadata_release(level) if level else None

    @property
    def transaction_version(self) -> int:
        """0 when the cluster has not finalized ``transaction.version`` (before Kafka 4.0)."""
        return self.finalized.get("transaction.version", 0)


def api_versions(host: str, port: int, *, timeout: float = 5.0) -> BrokerVersion:
    """Ask one broker for ApiVersions over a plain-text connection (v3, or v0 when the broker
    is older than Kafka 2.4 and says v3 is unsupported).

    Raises:
        OSError: the broker could not be reached or closed the connection.
        ValueError: the answer was not an ApiVersions response.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        error, body = _ask(sock, 3, 1)
        if error == _UNSUPPORTED_VERSION:
            error, body = _ask(sock, 0, 2)
            return BrokerVersion(_keys(body, flexible=False)[0])
        if error:
            raise ValueError(f"ApiVersions answered error code {error}")
        keys, pos = _keys(body, flexible=True)
        return BrokerVersion(keys, _finalized(body, pos + 4))  # after throttle_time_ms


def _ask(sock: socket.socket, version: int, correlation: int) -> tuple[int, bytes]:
    client = b"eosflow-probe"
    header = struct.pack(">hhih", _API_VERSIONS, version, correlation, len(client)) + client
    if version >= 3:  # flexible: header tagged fields; software name and version
        name, release = b"eosflow", b"0"
        body = b"\x00" + bytes([len(name) + 1]) + name + bytes([len(release) + 1]) + release
        body += b"\x00"
    else:
        body = b""
    frame = header + body
    sock.sendall(struct.pack(">i", len(frame)) + frame)
    size = struct.unpack(">i", _read(sock, 4))[0]
    answer = _read(sock, size)
    if struct.unpack_from(">i", answer)[0] != correlation:
        raise ValueError("the broker's answer is not for the ApiVersions request")
    return struct.unpack_from(">h", answer, 4)[0], answer[6:]  # response header v0 always


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise OSError("the broker closed the connection")
        out += chunk
    return bytes(out)


class _Cursor:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, fmt: str) -> int:
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return int(value)

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()


def _keys(body: bytes, *, flexible: bool) -> tuple[dict[int, int], int]:
    cur = _Cursor(body)
    count = cur.uvarint() - 1 if flexible else cur.take(">i")
    keys: dict[int, int] = {}
    for _ in range(max(count, 0)):
        key, _min, top = cur.take(">h"), cur.take(">h"), cur.take(">h")
        keys[key] = top
        if flexible:
            cur.skip_tags()
    return keys, cur.pos


def _finalized(body: bytes, pos: int) -> dict[str, int]:
    """Tag 2 of the response's tagged fields: FinalizedFeatures (name, max level, min level)."""
    cur = _Cursor(body, pos)
    finalized: dict[str, int] = {}
    for _ in range(cur.uvarint()):
        tag, size = cur.uvarint(), cur.uvarint()
        end = cur.pos + size
        if tag == 2:
            for _ in range(cur.uvarint() - 1):
                n = cur.uvarint() - 1
                name = body[cur.pos : cur.pos + n].decode()
                cur.pos += n
                finalized[name] = cur.take(">h")
                cur.take(">h")
                cur.skip_tags()
        cur.pos = end
    return finalized
