"""The two-phase commit of a lakehouse sink, shared by Iceberg and Delta (docs/sink-lakehouse.md).

Per epoch each subtask buffers its rows (Arrow); at the barrier, ``prepare`` writes them as
Parquet data files into the table's location (no table snapshot references them yet: readers do
not see them) and a staging manifest naming them (:mod:`sinks.lake.staging`), and returns a
small committable. When the checkpoint completes, subtask 0 (the *committer*) commits the data
files of every subtask in one table commit that records the checkpoint id in the table itself
(Iceberg: a table property and the snapshot summary; Delta: an application transaction
``txn(appId, version)``). The other subtasks' ``commit`` does nothing.

Invariants:
    One table commit per checkpoint per sink step (none when no subtask wrote a row).
    The table's own record of the last committed checkpoint decides whether an epoch landed:
    checking it and committing happen against one table version (optimistic concurrency), so a
    re-commit after a crash, or a second committer racing the first, never appends twice.
    ``prepare`` always returns a committable (also for an empty epoch): the newest pending
    checkpoint of a restored snapshot is then the restored checkpoint itself, which tells a
    recovering writer which of its manifests are orphans.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from processor.contracts import SinkContext
from processor.errors import ConfigError, EosflowError, RecordsRejected, SnapshotError
from processor.snapshot.store import SnapshotStore
from sinks.lake.records import infer_schema, to_table
from sinks.lake.staging import Manifest, Staging

__all__ = [
    "LOCAL_RECOVERY_UNSUPPORTED",
    "CommitConflict",
    "LakeWriter",
    "TableOps",
    "forget_commits",
    "recorded_commits",
]

log = logging.getLogger(__name__)

_RETRIES = 20

#: Why ``--recovery local`` is refused at start-up (processor.runtime.supervision.preflight).
LOCAL_RECOVERY_UNSUPPORTED = (
    "one subtask (the committer, subtask 0) commits every subtask's staged epoch in one table "
    "commit, so a worker restarted alone would delete, as orphans of its own restored "
    "checkpoint, staged epochs that the committer commits for checkpoints the survivors "
    "completed, and its restarted writers' manifests (of another sink generation than the "
    "checkpoint's) would never land"
)


class CommitConflict(Exception):
    """Another writer committed to the table first (optimistic concurrency): reload, retry."""


class TableOps(Protocol):
    """What the protocol needs of a table format (one object per writer)."""

    describe: str
    ctx: SinkContext
    #: how to make the table forget a job's commits (the error of a run without snapshots)
    forget_hint: str

    def table_schema(self) -> pa.Schema | None:
        """The table's schema as Arrow, or ``None`` when the table does not exist yet."""

    def create(self, schema: pa.Schema) -> pa.Schema:
        """Creates the table unless it exists (a race with another writer is fine); returns
        the table's schema."""

    def write_files(self, data: pa.Table, prefix: str) -> list[Any]:
        """Writes ``data`` as data files (not committed); returns their JSON-able descriptions."""

    def last_committed(self) -> int:
        """The newest checkpoint of this (job, step) the table has committed (0: none)."""

    def forget(self) -> None:
        """One table commit that drops the table's record of this (job, step)'s commits (no
        row changes): ``eosflow reset``, after which the job's checkpoint ids start again."""

    def commit(self, files: list[Any], checkpoint_id: int) -> None:
        """One table commit adding ``files`` and recording ``checkpoint_id``, against the table
        version whose :meth:`last_committed` was read last. Raises :class:`CommitConflict`."""

    def delete_files(self, files: list[Any]) -> None:
        """Deletes uncommitted data files (orphans)."""


class LakeWriter:
    """One subtask's writer of an Iceberg or Delta sink (the format is ``ops``)."""

    def __init__(
        self,
        ops: TableOps,
        ctx: SinkContext,
        *,
        schema: pa.Schema | None,
        to_record: Callable[[Any], Any] | None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ops = ops
        self.ctx = ctx
        self.staging = Staging(ctx)
        self._to_record = to_record
        self._sleep = sleep
        self._schema = ops.table_schema()
        if self._schema is None and schema is not None:
            self._schema = ops.create(schema)
        self._buffer: list[pa.Table] = []
        self._prefix = f"{ctx.subtask:05d}-g{ctx.generation}"

    def __repr__(self) -> str:
        ctx = self.ctx
        return f"LakeWriter({self.ops.describe}, step={ctx.step!r}, subtask={ctx.subtask})"

    @property
    def committer(self) -> bool:
        return self.ctx.subtask == 0

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Buffers the values that fit the table's schema.

        Raises:
            RecordsRejected: after buffering the rest, naming each value that does not fit (a
                missing, extra or mistyped field; ``to_record`` raising): dead letters.
        """
        if not values:
            return
        records: list[Any] = []
        failed: list[tuple[int, Exception]] = []
        index: list[int] = []
        to_record = self._to_record
        for i, value in enumerate(values):
            if to_record is None:
                records.append(value)
                index.append(i)
                continue
            try:
                records.append(to_record(value))
                index.append(i)
            except Exception as exc:
                failed.append((i, exc))
        if self._schema is None and records:
            self._schema = self.ops.create(infer_schema(records))
        if records:
            assert self._schema is not None
            table, rejects = to_table(records, self._schema)
            for j, why in rejects:
                failed.append((index[j], ValueError(f"{self.ops.describe}: {why}")))
            if table.num_rows:
                self._buffer.append(table)
        if failed:
            failed.sort(key=lambda f: f[0])
            raise RecordsRejected(
                f"{len(failed)} of {len(values)} values do not fit {self.ops.describe} "
                f"(first: {failed[0][1]})",
                failed,
            )

    def prepare(self, checkpoint_id: int) -> dict[str, Any]:
        """Writes the epoch's data files and its staging manifest; returns the committable."""
        files: list[Any] = []
        rows = sum(t.num_rows for t in self._buffer)
        if self._buffer:
            data = pa.concat_tables(self._buffer)
            prefix = f"{self._prefix}-c{checkpoint_id}-{uuid.uuid4().hex[:8]}"
            files = self.ops.write_files(data, prefix)
        self._buffer = []
        ctx = self.ctx
        name = self.staging.write(
            checkpoint_id,
            {"job": ctx.job, "step": ctx.step, "subtask": ctx.subtask, "rows": rows,
             "files": files},
        )  # fmt: skip
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d rows=%d files=%d manifest=%s",
            checkpoint_id, ctx.step, ctx.subtask, rows, len(files), name,
        )  # fmt: skip
        return {"manifest": name, "rows": rows}

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """The committer commits every subtask's epochs up to ``checkpoint_id`` in one table
        commit; the others do nothing. Idempotent.

        A checkpoint that did not complete (aborted, its committable carried) is not committed
        on its own: the engine commits the completed one after it next, whose commit covers it
        (one table commit per completed checkpoint)."""
        if self.committer and self.staging.lineage.completed(checkpoint_id):
            self._commit_through(checkpoint_id)

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits what the restored checkpoint covers (committer), deletes this subtask's
        orphans: manifests (and their data files) of checkpoints after the restored one.

        Raises:
            ConfigError: the table holds a commit of this job and step newer than the job's
                newest completed checkpoint (another run of the job, whose snapshots are gone).
        """
        restored = max((c for c, _x in pending), default=None)
        self._check_history()
        self.staging.delete_temps()
        if self.committer and restored is not None:
            self._commit_through(restored)
        self.ctx.fault("mid-sink-recover")
        orphans = [m for m in self.staging.own() if restored is None or m.checkpoint > restored]
        self._discard(orphans, f"orphans (after the restored checkpoint {restored})")

    def close(self) -> None:
        self._buffer = []

    # -- the commit ------------------------------------------------------------------------------

    def _commit_through(self, checkpoint_id: int) -> None:
        ctx = self.ctx
        for attempt in range(_RETRIES):
            last = self.ops.last_committed()
            manifests = self.staging.manifests()
            if last >= checkpoint_id:
                self.staging.delete([m for m in manifests if m.checkpoint <= checkpoint_id])
                return
            landed = [m for m in manifests if m.checkpoint <= last]
            due, rolled_back = self.staging.lineage.sort(
                [m for m in manifests if last < m.checkpoint <= checkpoint_id], checkpoint_id
            )
            # Rolled back: a zombie of an older generation wrote them after the recovery
            # deleted the orphans it saw; landing them would repeat the replayed epoch.
            self._discard(rolled_back, "manifests of rolled-back checkpoints", logging.WARNING)
            files: list[Any] = []
            rows = 0
            for m in due:
                body = self._read(m)
                files.extend(body["files"])
                rows += body.get("rows", 0)
            if not files:
                self.staging.delete(landed + due)
                return
            began = time.monotonic()
            try:
                self.ops.commit(files, checkpoint_id)
            except CommitConflict as exc:
                log.info(
                    "commit conflict step=%r checkpoint_id=%d attempt=%d: %s (retrying)",
                    ctx.step, checkpoint_id, attempt + 1, exc,
                )  # fmt: skip
                self._sleep(min(0.05 * 2**attempt, 1.0))
                continue
            log.info(
                "committed checkpoint_id=%d step=%r table=%s manifests=%d files=%d rows=%d "
                "after=%d took_ms=%.1f",
                checkpoint_id, ctx.step, self.ops.describe, len(due), len(files), rows, last,
                (time.monotonic() - began) * 1000,
            )  # fmt: skip
            ctx.fault("mid-sink-commit")
            self.staging.delete(landed + due)
            return
        raise EosflowError(
            f"{self.ops.describe}: checkpoint {checkpoint_id} could not be committed after "
            f"{_RETRIES} attempts, each losing to another writer's commit; the job restarts "
            "and retries (is another job compacting or writing this table without pause?)"
        )

    def _discard(self, manifests: list[Manifest], what: str, level: int = logging.INFO) -> None:
        """Deletes ``manifests`` and their data files: epochs that must never land."""
        for m in manifests:
            try:
                body = self.staging.read(m)
            except FileNotFoundError:
                continue
            self.ops.delete_files(body.get("files", []))
            self.staging.delete([m])
        if manifests:
            log.log(
                level, "deleted %s step=%r subtask=%d manifests=%s",
                what, self.ctx.step, self.ctx.subtask, [m.name for m in manifests],
            )  # fmt: skip

    def _read(self, m: Manifest) -> dict[str, Any]:
        try:
            return self.staging.read(m)
        except FileNotFoundError:
            raise SnapshotError(
                f"{self.ops.describe}: the staging manifest {m.name} vanished while committing "
                f"checkpoint {m.checkpoint} (under {self.staging.url}); another committer of "
                "this job and step is running",
                reason="missing",
                path=m.name,
            ) from None

    def _check_history(self) -> None:
        url = self.ctx.snapshot_url
        if url is None:
            return
        last = self.ops.last_committed()
        if not last:
            return
        completed = SnapshotStore(url).completed_ids(self.ctx.job)
        newest = completed[-1] if completed else 0
        if last > newest:
            raise ConfigError(
                f"{self.ops.describe}: the table holds job {self.ctx.job!r} step "
                f"{self.ctx.step!r}'s commit of checkpoint {last}, but the job's newest "
                f"completed checkpoint is {newest}: this is another run of the job (its "
                "snapshots were deleted, or `eosflow reset` ran without --pipeline, which "
                "leaves the tables' records alone), "
                "whose checkpoint ids start again and whose epochs would be skipped as "
                f"committed. Give the job another name, write to another table, or "
                f"{self.ops.forget_hint}"
            )


def recorded_commits(ops: TableOps) -> list[str]:
    """What ``eosflow reset`` clears in the table: its record of the (job, step)'s last
    committed checkpoint (the guard of :meth:`LakeWriter._check_history` refuses a run whose
    checkpoint ids are behind it), said in a line; ``[]`` when it has none."""
    last = ops.last_committed()
    if not last:
        return []
    return [f"{ops.describe}: the record of step {ops.ctx.step!r}'s commits (through checkpoint "
            f"{last}; the rows stay)"]  # fmt: skip


def forget_commits(ops: TableOps) -> list[str]:
    """Clears what :func:`recorded_commits` lists; returns what it cleared."""
    found = recorded_commits(ops)
    if found:
        ops.forget()
        log.info("%s: forgot job=%s step=%s commits", ops.describe, ops.ctx.job, ops.ctx.step)
    return found
