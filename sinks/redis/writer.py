"""The Redis sink's writer: stages an epoch's operations in Redis and applies them with the
commit script when the checkpoint completes (the package docstring shows the protocol)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from processor.contracts import SinkContext
from processor.errors import (
    ConfigError,
    DefinitionError,
    InfrastructureError,
    SerializationError,
    SnapshotError,
)
from sinks.redis.commands import RedisSinkConfig, _encoder, _mp_array
from sinks.redis.server import _COMMIT_LUA, _TRANSIENT_REPLIES, _redact, _text

__all__ = ["RedisSinkWriter"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisSinkWriter:
    """One subtask's writer of a :class:`RedisSink` (see :mod:`sinks.redis.server` for the keys).

    Invariants:
        Nothing reaches a target key before ``commit``: operations wait in memory or in the
        epoch's staging hash, which readers of the targets never look at.
        An epoch is staged whole before ``prepare`` returns (in Redis, as durable as the server's
        persistence makes it), so a completed checkpoint's committable names data that exists.
        ``commit`` applies an epoch at most once (the guard) and all at once (one script), in
        checkpoint order; ``commit`` and ``recover`` are idempotent.
        ``recover`` deletes only staging hashes of this subtask that no pending committable
        names. ``write`` is all or nothing per call.
    """

    def __init__(
        self, sink: RedisSinkConfig, ctx: SinkContext, url: str, client: redis.Redis
    ) -> None:
        self.ctx = ctx
        self.url = _redact(url)
        self._client = client
        self._retry_s = sink.retry_for.total_seconds()
        self._clock, self._sleep = time.monotonic, time.sleep  # tests pass a manual clock
        self._chunk_ops = sink.chunk_ops
        base = f"{sink.namespace}:{ctx.job}:{ctx.step}:{ctx.subtask}"
        self.guard_key = f"{base}:epoch"
        self.registry_key = f"{base}:staged"
        self._stage_prefix = f"{base}:stage:"
        self._encode, self._upsert = _encoder(sink, self._unencodable)
        self._script = client.register_script(_COMMIT_LUA)
        self._buffer: list[bytes] = []
        self._upserts: dict[bytes, bytes] = {}  # set/hash: target -> last value (last wins)
        self._stage: str | None = None
        self._chunks = 0
        self._written = 0  # operations of this epoch, buffered or staged
        self._staged = 0  # operations in the staged chunks (last writes only, for set/hash)

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"RedisSinkWriter({self.url!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Buffers the operations of ``values``; spills a chunk to the staging hash when full.

        Raises:
            SerializationError: a value cannot become an operation (nothing of this call is kept).
        """
        if not values:
            return
        ops = self._encode(values)
        if self._upsert:
            # Distinct targets commute and the epoch applies at once: only the last write of
            # each target needs to reach Redis.
            self._upserts.update(ops)
            pending = len(self._upserts)
        else:
            self._buffer.extend(ops)
            pending = len(self._buffer)
        self._written += len(ops)
        if pending >= self._chunk_ops:
            self._stage_chunk(read_guard=False)

    def prepare(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Stages what is buffered (one round trip); returns ``{"key": <staging hash>,
        "chunks": <count>, "ops": <count>}``, or ``None`` when the epoch wrote nothing.

        Raises:
            ConfigError: the guard already holds a checkpoint ``>= checkpoint_id`` (the job's
                name was used before with another snapshot store).
        """
        _check_checkpoint_id(checkpoint_id)
        if self._written == 0:
            return None
        guard = self._stage_chunk(read_guard=True)
        if guard is not None and int(guard) >= checkpoint_id:
            raise self._stale(int(guard), checkpoint_id)
        assert self._stage is not None
        committable = {"key": self._stage, "chunks": self._chunks, "ops": self._staged}
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d key=%s chunks=%d ops=%d written=%d",
            checkpoint_id, self.ctx.step, self.ctx.subtask, self._stage, self._chunks,
            self._staged, self._written,
        )  # fmt: skip
        self._stage, self._chunks, self._written, self._staged = None, 0, 0, 0
        return committable

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Applies the staged epoch with the guarded script. Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when the staged epoch is gone although the guard says it
                was not committed (Redis lost data: persistence off, or keys deleted);
                ``corrupt`` when ``committable`` is not one of this subtask's.
            ConfigError: the guard is ahead while the epoch is still staged (job name reused).
            InfrastructureError: Redis refused an operation (the guard keeps the progress: the
                next attempt resumes after the last applied operation), or stayed unreachable
                for ``retry_for``.
        """
        if committable is None:
            return
        key, chunks = self._parse(checkpoint_id, committable)
        keys = [self.guard_key, key, self.registry_key]
        reply: list[Any] = self._retrying(
            f"commit checkpoint_id={checkpoint_id}",
            lambda: self._script(keys=keys, args=[checkpoint_id, chunks]),
        )
        status = _text(reply[0])
        context = f"checkpoint_id={checkpoint_id} step={self.ctx.step!r} subtask={self.ctx.subtask}"
        if status == "committed":
            log.info("committed %s key=%s ops=%d", context, key, reply[1])
        elif status == "done":
            log.info("already committed %s guard=%d", context, reply[1])
        elif status == "stale":
            raise self._stale(int(reply[1]), checkpoint_id)
        elif status == "missing":
            raise SnapshotError(
                f"redis sink {context}: the staged output is missing ({reply[1]} of {chunks} "
                f"chunks in {key} at {self.url}) but the guard {self.guard_key} says it was never "
                "committed. Committing would lose that epoch's records. Redis lost data (a "
                "restart without persistence: enable appendonly) or something deleted the key",
                reason="missing",
                path=key,
            )
        else:
            raise InfrastructureError(
                f"redis sink {context}: Redis refused operation #{reply[1]} of the epoch staged "
                f"in {key}: {_text(reply[2])}. The operations before it are "
                f"applied and recorded in {self.guard_key}; fix the target (e.g. a key of "
                "another type) and restart: the commit resumes at that operation"
            )

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then deletes this subtask's other staging hashes
        (orphans of epochs after the restored checkpoint). Idempotent.

        Raises:
            ConfigError: the guard is ahead of every completed checkpoint of the job (its name
                was used before with another snapshot store).
            SnapshotError, InfrastructureError: as :meth:`commit`.
        """
        self._check_guard_behind_snapshots()
        keep = {self._stage} if self._stage is not None else set()
        for i, (checkpoint_id, committable) in enumerate(pending):
            self.commit(checkpoint_id, committable)
            if committable is not None:
                keep.add(committable["key"])
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        registry = self.registry_key

        def clean() -> list[str]:
            names = [_text(m) for m in self._client.smembers(registry)]
            orphans = sorted(n for n in names if n not in keep and n.startswith(self._stage_prefix))
            if orphans:
                pipe = self._client.pipeline(transaction=True)
                pipe.delete(*orphans)
                pipe.srem(registry, *orphans)
                pipe.execute()
            return orphans

        orphans = self._retrying("recover", clean)
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_deleted=%d",
            self.ctx.step, self.ctx.subtask, self.ctx.generation, len(pending), len(orphans),
        )  # fmt: skip

    def close(self) -> None:
        """Drops the connection and the unstaged buffer (``recover`` deletes staged orphans)."""
        self._buffer, self._upserts = [], {}
        self._client.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _stage_chunk(self, *, read_guard: bool) -> bytes | None:
        """Writes the buffer as the next chunk of the epoch's staging hash (and reads the guard).

        Safe to retry: HSET of the same field with the same bytes, SADD of the same name.
        """
        if self._upsert:
            ops = [target + tail for target, tail in self._upserts.items()]
        else:
            ops = self._buffer
        if self._stage is None:
            token = f"g{self.ctx.generation}-{uuid.uuid4().hex[:16]}"
            self._stage = f"{self._stage_prefix}{token}"
        stage, chunk = self._stage, self._chunks
        blob = _mp_array(len(ops)) + b"".join(ops) if ops else None

        def send() -> list[Any]:
            pipe = self._client.pipeline(transaction=True)
            if blob is not None:
                if chunk == 0:
                    pipe.sadd(self.registry_key, stage)
                pipe.hset(stage, str(chunk), blob)
            if read_guard:
                pipe.hget(self.guard_key, "epoch")
            return pipe.execute()

        replies = self._retrying("stage", send)
        if blob is not None:
            self._chunks += 1
            self._staged += len(ops)
        self._buffer, self._upserts = [], {}
        return replies[-1] if read_guard else None

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried with backoff while Redis is unreachable, loading or busy."""
        deadline = self._clock() + self._retry_s
        delay, attempt = 0.05, 0
        while True:
            attempt += 1
            try:
                return call()
            except redis.RedisError as exc:
                transient = isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or str(
                    exc
                ).startswith(_TRANSIENT_REPLIES)
                if not transient or self._clock() + delay > deadline:
                    why = "stayed unavailable" if transient else "failed"
                    raise InfrastructureError(
                        f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: {what} "
                        f"{why} after {attempt} attempt(s) at {self.url}: "
                        f"{type(exc).__name__}: {exc}. The worker restarts and recovery "
                        "commits the pending epochs; nothing is dropped"
                    ) from exc
                log.warning(
                    "redis unavailable op=%r step=%r subtask=%d attempt=%d retry_in_s=%.2f "
                    "error=%r",
                    what, self.ctx.step, self.ctx.subtask, attempt, delay, str(exc),
                )  # fmt: skip
            self._sleep(delay)
            delay = min(delay * 2, 2.0)

    def _check_guard_behind_snapshots(self) -> None:
        """A guard ahead of every completed checkpoint belongs to an earlier job of the same
        name: left alone, it would turn this job's commits into silent no-ops."""
        url = self.ctx.snapshot_url
        if url is None:
            return
        guard = self._retrying("read guard", lambda: self._client.hget(self.guard_key, "epoch"))
        if guard is None:
            return
        from processor.snapshot.store import SnapshotStore

        try:
            completed = SnapshotStore(url).completed_ids(self.ctx.job)
        except OSError as exc:
            log.warning("could not list checkpoints url=%s error=%r: guard not checked", url, exc)
            return
        newest = completed[-1] if completed else 0
        if int(guard) > newest:
            raise self._stale(int(guard), newest)

    def _stale(self, guard: int, checkpoint_id: int) -> ConfigError:
        return ConfigError(
            f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: {self.guard_key} at "
            f"{self.url} says checkpoint {guard} was committed, but this job is at checkpoint "
            f"{checkpoint_id}: an earlier job named {self.ctx.job!r} wrote there (with another "
            "snapshot store, or its checkpoints were deleted), and its guard would silently drop "
            f"this job's output. Give the job a new name, or delete the keys "
            f"{self.guard_key.rsplit(':', 1)[0]}:* once that job's output is no longer needed"
        )

    def _parse(self, checkpoint_id: int, committable: Any) -> tuple[str, int]:
        key = committable.get("key") if isinstance(committable, dict) else None
        chunks = committable.get("chunks") if isinstance(committable, dict) else None
        if (
            not isinstance(key, str)
            or not key.startswith(self._stage_prefix)
            or not isinstance(chunks, int)
            or chunks < 1
        ):
            raise SnapshotError(
                f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"{committable!r} of checkpoint {checkpoint_id} is not a Redis sink committable "
                f"of this subtask (expected {{'key': '{self._stage_prefix}<token>', 'chunks': "
                "<n >= 1>, 'ops': <n>}); was the step's sink replaced since the snapshot was "
                "taken?",
                reason="corrupt",
            )
        return key, chunks

    def _unencodable(self, value: Any, exc: BaseException) -> SerializationError:
        return SerializationError(
            f"redis sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not turn a "
            f"value of type {type(value).__name__} into a Redis operation: "
            f"{type(exc).__name__}: {exc}. Convert it in a map step before the sink, or fix the "
            "sink's key/field/value/command functions"
        )


def _check_checkpoint_id(checkpoint_id: int) -> None:
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int):
        raise DefinitionError(f"checkpoint id must be an int, got {checkpoint_id!r}")
    if checkpoint_id < 1:
        raise DefinitionError(f"checkpoint id {checkpoint_id} must be >= 1")
