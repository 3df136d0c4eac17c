"""Wire format and topology of the internal channel topics.

Every cross-stage edge is one Kafka topic of ``U x D`` partitions; upstream subtask ``u`` writes to
downstream subtask ``d`` on partition ``u*D + d``, so each partition (channel) has exactly one
producer and is FIFO and replayable (docs/engine.md, "From ``Dataflow`` to processes").

Records:
    * Every record of a channel, data and control, has as its Kafka key the writer's
      *incarnation*, encoded by :func:`channel_key` (1 to 4 bytes, big-endian, no leading zero
      byte). See "Fencing" below.
    * Data records carry no ``eosflow-ctl`` header. Their value is one record, the JSON array
      ``[key, value, ts]`` (``[key, value, ts, tag]`` with a record ID or a loop iteration), or
      a *bundle* (issue 38): the byte :data:`BUNDLE` followed by the JSON array of the records
      one writer sent to one channel in one batch, in order (:func:`encode_bundles`,
      :func:`bundle_records`). A bundle is one Kafka message: one produce, one delivery, one
      offset, one record in the broker for up to :data:`BUNDLE_RECORDS` records, which is what
      a shuffle costs per record otherwise (bench/RESULTS.md). JSON never starts with that
      byte, so one look at the first byte tells a bundle from a record. A bundle sits wholly
      before or after any control record (a batch is written between two of them), so
      barriers, positions and replays work per message as before; a bundle's records share
      its offset (a dead letter's origin names the bundle).
    * Telling data records from control records is the hot path:
      :func:`decode_control` costs a ``headers is None`` test when the record has no headers
      (the common case) and one short scan otherwise.
    * Control records have an empty value and one header ``eosflow-ctl`` whose value is
      ``[version u8][kind u8][fields]``, big-endian, fixed size per kind. Nothing is unpickled:
      anyone who can write to a topic must not get code execution.

    ======= ================ =========================================================
    kind    class            fields
    ======= ================ =========================================================
    1       Barrier          checkpoint_id u64, generation u32, flags u8 (bit 0 unaligned)
    2       Watermark        ts_ms i64 (epoch milliseconds, may be negative)
    3       EndOfStream      (none)
    4       GenerationStart  generation u32, incarnation u32
    ======= ================ =========================================================

    Encoding refuses values outside these ranges with :class:`~processor.errors.ConfigError`
    (a ``ValueError``). Decoding refuses an unknown version, an unknown kind, a wrong length or
    unknown flag bits with :class:`~processor.errors.DeserializationError`. A new field or kind
    means a new :data:`FORMAT_VERSION`. Version 2 added the incarnation (to ``GenerationStart``
    and as the record key); version 1 control records are still decoded (their
    ``GenerationStart`` has the generation as its incarnation) because a new release reads the
    tail an older one left in the channels (replayed in-flight records, dropped stale ones).

GenerationStart (docs/checkpointing.md, "Generation start markers instead of per-record
generation headers"):
    After a global recovery to checkpoint ``n`` the job runs as generation ``g`` (one more than
    before). Every upstream subtask, sources included, writes ``GenerationStart(g)`` into each of
    its output partitions before any data of generation ``g``. A partition has one producer and is
    FIFO, so every record after that marker belongs to generation ``g`` and every record between
    the restored barrier ``n`` and the marker belongs to an older generation: the downstream task
    drops those (they will be regenerated) until it reads ``GenerationStart(g)``. In unaligned mode
    it first replays the records between the recorded channel offset and barrier ``n`` (the
    channel state), then drops. Barriers carry their generation too, so barriers of checkpoints
    that never completed in an older generation are ignored.

Fencing (issue 35): the marker alone assumes that an old producer can no longer write once the
new generation starts. A frozen process (SIGSTOP, a long GC pause, a Spark executor the runner
cannot reach) breaks that: librdkafka sends its queued records the moment it runs again, after
the new marker. So every record names its writer's *incarnation*: the job's generation, or,
for a worker restarted alone (local recovery), the fresh number it was started with. Both come
from one counter per job (``SnapshotStore.next_generation``), so a later start always has a
higher incarnation. A writer's ``GenerationStart(g, incarnation)`` precedes its other records.
Per channel, a reader keeps a *floor*: the highest incarnation it has read there (a marker or a
record). A record below the floor is a zombie's, written after a newer incarnation announced
itself: it is dropped and counted, whatever its kind. The floor is part of the task's snapshot,
so a restored reader fences from the restored position on. The key costs one byte on the wire
for incarnations below 256 and one ``Message.key()`` call and a bytes comparison per record
(bench/RESULTS.md, "Zombie fencing").

Invariants:
    * A channel writer writes ``GenerationStart(g, i)`` into every output partition before
      any other record, and keys every record with :func:`channel_key` of ``i``; ``i`` is
      higher than every incarnation that wrote to the job's channels before.
    * A reader processes a channel record only if its incarnation is at least the highest one
      it has read on that channel; in the replay and drop phases of a restored channel the
      older release's untagged records are let through to those phases' own rules.
    * :func:`key_to_downstream` is identical in every process and across restarts; changing it
      moves keys between subtasks and breaks restored keyed state.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import orjson

from processor.errors import ConfigError, DeserializationError

__all__ = [
    "BUNDLE",
    "BUNDLE_BYTES",
    "BUNDLE_RECORDS",
    "CONTROL_HEADER",
    "FORMAT_VERSION",
    "MAX_CHECKPOINT_ID",
    "MAX_GENERATION",
    "MAX_TOPIC_NAME_LENGTH",
    "MAX_TS_MS",
    "MIN_TS_MS",
    "Barrier",
    "Control",
    "EndOfStream",
    "GenerationStart",
    "Watermark",
    "bundle_records",
    "channel_key",
    "channel_partition",
    "channel_partitions_for",
    "channel_topic_name",
    "decode_control",
    "default_key_groups",
    "encode_bundles",
    "encode_control",
    "job_topic_prefix",
    "key_group",
    "key_group_range",
    "key_incarnation",
    "key_owner",
    "key_to_downstream",
    "owner_of",
    "route_table",
    "shared_keys",
    "source_partitions_for",
    "upstream_of",
]

CONTROL_HEADER = "eosflow-ctl"
FORMAT_VERSION = 2
MAX_CHECKPOINT_ID = 2**64 - 1
MAX_GENERATION = 2**32 - 1
MIN_TS_MS = -(2**63)
MAX_TS_MS = 2**63 - 1
MAX_TOPIC_NAME_LENGTH = 249  # Kafka's own limit

Headers: TypeAlias = Sequence[tuple[str, bytes | None]] | None


@dataclass(frozen=True, slots=True)
class Barrier:
    """ABS barrier of checkpoint ``checkpoint_id``, injected by the sources of ``generation``."""

    checkpoint_id: int
    generation: int
    unaligned: bool = False


@dataclass(frozen=True, slots=True)
class Watermark:
    """Event time has reached ``ts_ms`` on this channel."""

    ts_ms: int


@dataclass(frozen=True, slots=True)
class EndOfStream:
    """The upstream subtask will write nothing more to this channel."""


@dataclass(frozen=True, slots=True)
class GenerationStart:
    """Everything after this record on this channel belongs to ``generation``, written by the
    writer ``incarnation`` (``0``: the generation itself, as after a global recovery; a worker
    restarted alone has a higher one)."""

    generation: int
    incarnation: int = 0

    def __post_init__(self) -> None:
        if self.incarnation == 0:
            object.__setattr__(self, "incarnation", self.generation)


Control: TypeAlias = Barrier | Watermark | EndOfStream | GenerationStart

_BARRIER, _WATERMARK, _END, _GENERATION = 1, 2, 3, 4
_UNALIGNED = 0x01
_S_BARRIER = struct.Struct(">BBQIB")
_S_WATERMARK = struct.Struct(">BBq")
_S_END = struct.Struct(">BB")
_S_GENERATION = struct.Struct(">BBII")
_S_GENERATION_V1 = struct.Struct(">BBI")
_SIZES = {
    _BARRIER: _S_BARRIER.size,
    _WATERMARK: _S_WATERMARK.size,
    _END: _S_END.size,
    _GENERATION: _S_GENERATION.size,
}
#: what version 1 (before the incarnation) wrote: still read, never written
_SIZES_V1 = {**_SIZES, _GENERATION: _S_GENERATION_V1.size}
_VERSION_SIZES = {FORMAT_VERSION: _SIZES, 1: _SIZES_V1}
_EMPTY = b""


def _check(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(
            f"control field {name} must be an int in [{low}, {high}], got {value!r}; "
            "the channel wire format cannot carry it"
        )
    return value


def encode_control(ctl: Control) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Encode a control record.

    Args:
        ctl: the control message.

    Returns:
        ``(value, headers)`` to pass to ``Producer.produce`` with the writer's
        :func:`channel_key`.

    Raises:
        ConfigError: a field is outside its wire range (see the module docstring).
        TypeError: ``ctl`` is not a control message.
    """
    if isinstance(ctl, Barrier):
        payload = _S_BARRIER.pack(
            FORMAT_VERSION,
            _BARRIER,
            _check("checkpoint_id", ctl.checkpoint_id, 0, MAX_CHECKPOINT_ID),
            _check("generation", ctl.generation, 0, MAX_GENERATION),
            _UNALIGNED if ctl.unaligned else 0,
        )
    elif isinstance(ctl, Watermark):
        ts_ms = _check("ts_ms", ctl.ts_ms, MIN_TS_MS, MAX_TS_MS)
        payload = _S_WATERMARK.pack(FORMAT_VERSION, _WATERMARK, ts_ms)
    elif isinstance(ctl, EndOfStream):
        payload = _S_END.pack(FORMAT_VERSION, _END)
    elif isinstance(ctl, GenerationStart):
        generation = _check("generation", ctl.generation, 0, MAX_GENERATION)
        incarnation = _check("incarnation", ctl.incarnation, 0, MAX_GENERATION)
        payload = _S_GENERATION.pack(FORMAT_VERSION, _GENERATION, generation, incarnation)
    else:
        raise TypeError(f"not a control message: {ctl!r}")
    return _EMPTY, [(CONTROL_HEADER, payload)]


def decode_control(headers: Headers) -> Control | None:
    """Return the control message of a channel record, or ``None`` for a data record.

    This runs for every record read from a channel: measured ~45 ns for ``None`` headers (mostly
    the call; an inlined ``headers is not None`` costs ~15 ns) and ~95 ns for one other header.

    Args:
        headers: ``Message.headers()`` as confluent-kafka returns it (``None`` when absent).

    Raises:
        DeserializationError: the record has an ``eosflow-ctl`` header that cannot be decoded.
            It has no location: the caller knows the message and should re-raise with
            ``topic``, ``partition`` and ``offset``.
    """
    if headers is None:
        return None
    for key, value in headers:
        if key == CONTROL_HEADER:
            return _decode_payload(value)
    return None


def _refuse(cause: str, data: bytes | None) -> DeserializationError:
    return DeserializationError(cause, serde=CONTROL_HEADER, data=data)


def _decode_payload(payload: bytes | None) -> Control:
    if payload is None or len(payload) < 2:
        raise _refuse(
            "control header too short: expected at least 2 bytes (version, kind)", payload
        )
    version, kind = payload[0], payload[1]
    sizes = _VERSION_SIZES.get(version)
    if sizes is None:
        raise _refuse(
            f"unknown control format version {version}, this eosflow reads versions "
            f"{sorted(_VERSION_SIZES)}; the writer runs a newer eosflow release: run one "
            "release per job",
            payload,
        )
    size = sizes.get(kind)
    if size is None:
        raise _refuse(f"unknown control kind {kind}, expected one of {sorted(_SIZES)}", payload)
    if len(payload) != size:
        raise _refuse(
            f"control kind {kind} must be {size} bytes, got {len(payload)} (corrupt or truncated)",
            payload,
        )
    if kind == _BARRIER:
        _, _, checkpoint_id, generation, flags = _S_BARRIER.unpack(payload)
        if flags & ~_UNALIGNED:
            raise _refuse(f"unknown barrier flag bits {flags:#04x}", payload)
        return Barrier(checkpoint_id, generation, bool(flags & _UNALIGNED))
    if kind == _WATERMARK:
        return Watermark(_S_WATERMARK.unpack(payload)[2])
    if kind == _GENERATION:
        if version == 1:
            return GenerationStart(_S_GENERATION_V1.unpack(payload)[2])
        _, _, generation, incarnation = _S_GENERATION.unpack(payload)
        return GenerationStart(generation, incarnation)
    return EndOfStream()


#: First byte of a bundle's value: records follow as one JSON array (never a JSON start).
BUNDLE = b"\x00"
#: At most this many records per bundle; a bundle over :data:`BUNDLE_BYTES` is halved.
BUNDLE_RECORDS = 500
#: Bundle size above which it is split: well under Kafka's default ``message.max.bytes``
#: (1 MB), so a bundle always fits where its records would have fitted one by one.
BUNDLE_BYTES = 256 * 1024


def encode_bundles(records: Sequence[Any]) -> list[bytes]:
    """The values carrying ``records`` (JSON-encodable sequences) in order: bundles of at
    most :data:`BUNDLE_RECORDS` records and (unless one record alone is bigger)
    :data:`BUNDLE_BYTES` bytes; a bundle that would hold a single record is that record as
    a plain value."""
    out: list[bytes] = []
    for start in range(0, len(records), BUNDLE_RECORDS):
        _encode_bundle(records[start : start + BUNDLE_RECORDS], out)
    return out


def _encode_bundle(records: Sequence[Any], out: list[bytes]) -> None:
    if len(records) == 1:
        out.append(orjson.dumps(records[0]))
        return
    value = BUNDLE + orjson.dumps(records)
    if len(value) <= BUNDLE_BYTES:
        out.append(value)
        return
    half = len(records) // 2
    _encode_bundle(records[:half], out)
    _encode_bundle(records[half:], out)


def bundle_records(value: bytes) -> list[Any] | None:
    """The records of a bundle's ``value`` (JSON arrays, as written), or ``None`` when the
    value is one record."""
    if value[:1] != BUNDLE:
        return None
    records: list[Any] = orjson.loads(memoryview(value)[1:])
    return records


def channel_key(incarnation: int) -> bytes:
    """The Kafka key of every record written by channel writer ``incarnation``: big-endian,
    1 to 4 bytes, no leading zero byte (so equal keys are equal incarnations, and the reader's
    fast path compares bytes). See "Fencing" in the module docstring.

    Raises:
        ConfigError: ``incarnation`` is not in ``[0, MAX_GENERATION]``.
    """
    _check("incarnation", incarnation, 0, MAX_GENERATION)
    return incarnation.to_bytes(max(1, (incarnation.bit_length() + 7) // 8), "big")


def key_incarnation(key: bytes | None) -> int | None:
    """The incarnation a channel record's key names, or ``None`` when it names none (no key:
    written by a release before format version 2, or not by eosflow; a malformed key)."""
    if key is None or not 1 <= len(key) <= 4 or (len(key) > 1 and key[0] == 0):
        return None
    return int.from_bytes(key, "big")


# --- topology -------------------------------------------------------------------------------


def _check_index(name: str, index: int, count: int, count_name: str) -> None:
    if count < 1:
        raise ConfigError(f"{count_name} must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ConfigError(f"{name} must be in [0, {count}), got {index} ({count_name}={count})")


def channel_partition(upstream: int, downstream: int, downstream_parallelism: int) -> int:
    """Partition of the channel from subtask ``upstream`` to subtask ``downstream``: ``u*D + d``."""
    _check_index("downstream", downstream, downstream_parallelism, "downstream_parallelism")
    if upstream < 0:
        raise ConfigError(f"upstream subtask must be >= 0, got {upstream}")
    return upstream * downstream_parallelism + downstream


def channel_partitions_for(
    downstream: int, upstream_parallelism: int, downstream_parallelism: int
) -> list[int]:
    """The ``U`` partitions that downstream subtask ``downstream`` assigns, by upstream order."""
    _check_index("downstream", downstream, downstream_parallelism, "downstream_parallelism")
    if upstream_parallelism < 1:
        raise ConfigError(f"upstream_parallelism must be at least 1, got {upstream_parallelism}")
    return [u * downstream_parallelism + downstream for u in range(upstream_parallelism)]


def upstream_of(partition: int, downstream_parallelism: int) -> int:
    """The upstream subtask that is the single producer of channel ``partition``."""
    if downstream_parallelism < 1 or partition < 0:
        raise ConfigError(
            f"need partition >= 0 and downstream_parallelism >= 1, "
            f"got {partition} and {downstream_parallelism}"
        )
    return partition // downstream_parallelism


def source_partitions_for(subtask: int, parallelism: int, partition_count: int) -> list[int]:
    """Input partitions read by source ``subtask``: those with ``p mod parallelism == subtask``.

    Deterministic and rebalance-free: the assignment is a pure function of the parallelism.
    """
    _check_index("subtask", subtask, parallelism, "parallelism")
    if partition_count < 0:
        raise ConfigError(f"partition_count must be >= 0, got {partition_count}")
    return list(range(subtask, partition_count, parallelism))


def key_to_downstream(key: bytes, downstream_parallelism: int) -> int:
    """Downstream subtask of a keyed record: ``crc32(key) mod D``.

    CRC-32 (zlib's, the ISO-HDLC polynomial) rather than ``hash()``, which is salted per process,
    and rather than Kafka's murmur2, which would need a per-byte Python loop (~20x slower here):
    ``zlib.crc32`` is C code, about 120 ns a call, fixed by its standard on every platform and
    Python version, and spreads real keys evenly (measured within 2% for D <= 16). Nothing
    outside eosflow needs to agree with it: the channel partition is ``u*D + d``, never Kafka's
    partitioner. Hot path: ``downstream_parallelism`` is not validated (it must be >= 1).
    """
    return zlib.crc32(key) % downstream_parallelism


# --- key groups (rescaling) -------------------------------------------------------------------

#: The fewest key groups a job gets (Flink's ``DEFAULT_LOWER_BOUND_MAX_PARALLELISM``).
MIN_KEY_GROUPS = 128
#: The most key groups a job may have (and so the highest parallelism of a keyed stage).
MAX_KEY_GROUPS = 32768


def default_key_groups(parallelism: int) -> int:
    """The key-group count of a new job started at ``parallelism``: at least 128, else the
    power of two at or above ``1.5 * parallelism`` (Flink's ``computeDefaultMaxParallelism``)."""
    want = parallelism + parallelism // 2
    return min(max(MIN_KEY_GROUPS, 1 << max(0, want - 1).bit_length()), MAX_KEY_GROUPS)


def key_group(key: bytes, key_groups: int) -> int:
    """The key group of a keyed record's key bytes: ``crc32(key) mod G`` (see
    :func:`key_to_downstream` for why CRC-32). Fixed for the job's life: the unit that moves
    between subtasks when the parallelism changes."""
    return zlib.crc32(key) % key_groups


def owner_of(group: int, parallelism: int, key_groups: int) -> int:
    """The subtask that owns key group ``group``: ``group * P // G``, so that each subtask owns a
    contiguous range of groups (Flink's ``computeOperatorIndexForKeyGroup``)."""
    return group * parallelism // key_groups


def key_group_range(subtask: int, parallelism: int, key_groups: int) -> range:
    """The key groups subtask ``subtask`` owns: ``[ceil(i*G/P), ceil((i+1)*G/P))``."""
    _check_index("subtask", subtask, parallelism, "parallelism")
    first = -(-subtask * key_groups // parallelism)
    end = -(-(subtask + 1) * key_groups // parallelism)
    return range(first, end)


def route_table(parallelism: int, key_groups: int) -> list[int]:
    """Key group -> owning subtask, for the hot path (``table[crc32(key) % G]``).

    Raises:
        ConfigError: ``parallelism`` is above the key-group count.
    """
    if key_groups < 1 or parallelism < 1:
        raise ConfigError(
            f"need key_groups >= 1 and parallelism >= 1, got {key_groups}, {parallelism}"
        )
    if parallelism > key_groups:
        raise ConfigError(
            f"parallelism {parallelism} is above the job's {key_groups} key groups: a key group "
            "is the unit of placement, so no more subtasks than key groups can own keys"
        )
    return [owner_of(g, parallelism, key_groups) for g in range(key_groups)]


def key_owner(key: bytes, parallelism: int, key_groups: int) -> int:
    """The subtask that owns ``key`` (key bytes as the channels hash them)."""
    return owner_of(zlib.crc32(key) % key_groups, parallelism, key_groups)


def shared_keys(
    old_parallelism: int, old_groups: int, new_parallelism: int, new_groups: int
) -> list[set[int]]:
    """For each new subtask, the old subtasks that may hold keys it owns after a change of
    parallelism (and possibly of the key-group count): ``found[i]`` is every old owner of a key
    whose new owner is ``i``. With the key-group count kept these are the old subtasks whose
    ranges overlap ``i``'s; otherwise the CRC residues modulo ``lcm(G_old, G_new)`` decide (all
    old subtasks when that is above a million)."""
    found: list[set[int]] = [set() for _ in range(new_parallelism)]
    period = math.lcm(old_groups, new_groups)
    if period > 1_000_000:
        return [set(range(old_parallelism)) for _ in range(new_parallelism)]
    for r in range(period):
        found[owner_of(r % new_groups, new_parallelism, new_groups)].add(
            owner_of(r % old_groups, old_parallelism, old_groups)
        )
    return found


_CLEAN = re.compile(r"[a-z0-9-]+")
_UNSAFE = re.compile(r"[^a-zA-Z0-9-]+")
_HASH_HEX = 12


def job_topic_prefix(job: str) -> str:
    """The prefix of every internal topic of ``job`` (channels, commit markers).

    Raises:
        ConfigError: the job's name is not kebab-case, so the prefix could also match another
            job's topics (``my_job`` and ``my-job`` share it).
    """
    if not _CLEAN.fullmatch(job):
        raise ConfigError(
            f"job {job!r}: only a kebab-case job name ([a-z0-9-]) has a topic prefix no other "
            "job shares; delete its topics by name (eosflow.<job>.*) with your Kafka tools"
        )
    return f"eosflow.{job}."


def channel_topic_name(job: str, edge_from: str, edge_to: str, epoch: int = 0) -> str:
    """Name of the internal topic of the edge ``edge_from -> edge_to`` of ``job``.

    ``eosflow.<job>.<from>.<to>`` when all three are kebab-case (``[a-z0-9-]``); otherwise the
    unsafe characters become ``-`` and a 12-hex-digit BLAKE2b hash of the exact inputs is
    appended (``.<hash>``), as it is when the name would pass Kafka's 249 characters (the
    readable part is then truncated). So the name is deterministic and distinct inputs give
    distinct names, also under Kafka's rule that ``.`` and ``_`` collide, and under
    case-insensitive broker file systems.

    ``epoch``: the job's shape epoch (one more after each change of parallelism, whose
    channels have another partition count): ``.r<epoch>`` is appended from epoch 1 on, and the
    epoch is hashed with the parts when the name is hashed.

    Raises:
        ConfigError: a part is empty.
    """
    if epoch:
        name = channel_topic_name(job, edge_from, edge_to)
        tail = f".r{epoch}"
        if len(name) + len(tail) <= MAX_TOPIC_NAME_LENGTH and name.count(".") == 3:
            return name + tail
        return channel_topic_name(job, edge_from, f"{edge_to}\x00{epoch}")
    for what, part in (("job", job), ("edge_from", edge_from), ("edge_to", edge_to)):
        if not part:
            raise ConfigError(f"{what} must be a non-empty name to build a channel topic name")
    parts = (job, edge_from, edge_to)
    name = "eosflow." + ".".join(_UNSAFE.sub("-", p) for p in parts)
    if len(name) <= MAX_TOPIC_NAME_LENGTH and all(_CLEAN.fullmatch(p) for p in parts):
        return name
    # Length-prefixed, so that no two distinct triples hash the same bytes.
    exact = b"".join(
        len(b).to_bytes(4, "big") + b for b in (p.encode("utf-8", "surrogatepass") for p in parts)
    )
    digest = hashlib.blake2b(exact, digest_size=_HASH_HEX // 2).hexdigest()
    return f"{name[: MAX_TOPIC_NAME_LENGTH - _HASH_HEX - 1]}.{digest}"
