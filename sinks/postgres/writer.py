"""The PostgreSQL sink's writer: one epoch's rows, prepared at the barrier, committed when the
checkpoint completes (the package docstring shows the protocol).

Prepared transactions keep their row locks until ``COMMIT PREPARED``. Epoch ``n + 1`` may reach
its barrier before checkpoint ``n``'s completion reaches the writer, or after ``n`` aborted; a
write then waits for a lock that only this same thread would release. So before writing, the
writer settles its earlier prepared epochs: it commits those a completed checkpoint covers (the
snapshot store says which), and folds those of aborted checkpoints into the new transaction
(``ROLLBACK PREPARED``, then their rows are written again, with the new epoch's). The
committable lists the checkpoints a transaction covers, so ``commit`` of a folded epoch commits
the transaction that carries it. Anything else that holds a lock (another job, a session, a
second writer of the same key) makes the write fail after ``lock_timeout`` with an error naming
the lock; the worker restarts and recovery settles every prepared transaction of the job.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from processor.contracts import SinkContext
from processor.errors import SerializationError, SnapshotError
from sinks.postgres.prepared import (
    PostgresSinkConfig,
    _check_checkpoint_id,
    _Database,
    _gid_prefix,
    _Txn,
)

__all__ = ["PostgresSinkWriter"]

log = logging.getLogger(__name__)


class PostgresSinkWriter:
    """One subtask's writer of a :class:`PostgresSink`.

    Committable of an epoch: ``{"gid": <global id>, "txn": <nonce>, "covers": [<checkpoint
    id>, ...]}`` (``covers`` ends with the epoch's own checkpoint; earlier ids were folded in).

    Invariants:
        Nothing is visible before ``commit``: rows are written only inside a transaction that
        is prepared, never committed, by ``prepare``.
        ``commit`` and ``recover`` are idempotent: a transaction no longer prepared counts as
        committed only if its marker (same checkpoint, same nonce) is visible; otherwise they
        raise ``SnapshotError("missing")`` rather than lose its rows silently.
        A transaction is committed only when a completed checkpoint covers it (the engine's
        ``commit``, or the snapshot store's manifests before an early commit in ``prepare``).
        At most one transaction of this writer is prepared after ``prepare`` returns (given a
        snapshot store in the context, which tells completed from aborted checkpoints).
        ``recover`` rolls back every other prepared transaction with this writer's global-id
        prefix (orphans of checkpoints that never completed).
        ``write`` is all or nothing per call: a value that cannot be turned into a row leaves
        the buffer as it was.
    """

    def __init__(self, sink: PostgresSinkConfig, ctx: SinkContext) -> None:
        self.sink = sink
        self.ctx = ctx
        self.prefix = _gid_prefix(ctx.job, ctx.step, ctx.subtask)
        self._append: list[tuple[Any, ...]] = []
        self._upsert: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self._prepared: dict[int, tuple[_Txn, list[tuple[Any, ...]]]] = {}
        self._absorbed_by: dict[int, _Txn] = {}
        self._done: set[int] = set()
        self._key_idx = tuple(sink.columns.index(k) for k in sink.key)
        self._store: Any = None
        self._db = _Database(sink, ctx)

    def __repr__(self) -> str:
        ctx = self.ctx
        table = ".".join(self.sink.table)
        return f"PostgresSinkWriter({table!r}, step={ctx.step!r}, subtask={ctx.subtask})"

    # -- epoch -----------------------------------------------------------------------------------

    def write(self, values: Sequence[Any]) -> None:
        """Buffers ``values`` as rows of the current epoch (upsert: the last row per key).

        Raises:
            SerializationError: a value does not give a row of ``columns`` (nothing of this
                call is buffered).
        """
        rows = [self._row(value) for value in values]
        if self.sink.mode == "append":
            self._append.extend(rows)
        else:
            idx = self._key_idx
            self._upsert.update((tuple(r[i] for i in idx), r) for r in rows)

    def prepare(self, checkpoint_id: int) -> dict[str, Any] | None:
        """Writes the epoch's rows in a transaction and prepares it; returns its committable,
        or ``None`` when the epoch wrote nothing.

        Earlier prepared epochs of this writer are settled first (module docstring): committed
        when a completed checkpoint covers them, folded into this transaction otherwise.

        Raises:
            EosflowError: a row lock stayed taken for ``lock_timeout``.
            SerializationError: the database refused a value (type, range, constraint).
            ConfigError: prepared transactions are disabled or all in use.
        """
        _check_checkpoint_id(checkpoint_id)
        rows = self._append if self.sink.mode == "append" else list(self._upsert.values())
        if not rows:
            return None
        carried, covers = self._settle_earlier(checkpoint_id)
        if carried:
            rows = self._merge(carried, rows)
        txn = _Txn(
            checkpoint_id,
            f"{self.prefix}{checkpoint_id}",
            uuid.uuid4().hex[:16],
            (*covers, checkpoint_id),
        )
        started = time.perf_counter()
        self._db.prepare(txn, rows)
        took_ms = (time.perf_counter() - started) * 1000
        self._prepared[checkpoint_id] = (txn, rows)
        for folded in covers:
            self._absorbed_by[folded] = txn
        self._append, self._upsert = [], {}
        log.info(
            "prepared checkpoint_id=%d step=%r subtask=%d gid=%s rows=%d folded=%s took_ms=%.1f",
            checkpoint_id,
            self.ctx.step,
            self.ctx.subtask,
            txn.gid,
            len(rows),
            list(covers),
            took_ms,
        )
        return txn.committable()

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """``COMMIT PREPARED`` the epoch's transaction (or the one it was folded into).
        Idempotent; ``None`` is a no-op.

        Raises:
            SnapshotError: ``missing`` when the transaction is neither prepared nor committed
                (someone rolled it back: its rows are lost); ``corrupt`` when ``committable``
                is not one of this writer's.
        """
        if committable is None:
            return
        self._settle(checkpoint_id, self._parse(checkpoint_id, committable))
        # The engine commits in checkpoint order: nothing at or below this id comes again.
        self._done = {c for c in self._done if c > checkpoint_id}
        self._absorbed_by = {c: t for c, t in self._absorbed_by.items() if c > checkpoint_id}

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Commits ``pending`` in order, then rolls back this writer's other prepared
        transactions (orphans of checkpoints that never completed). Idempotent.

        Raises:
            SnapshotError: as :meth:`commit`.
        """
        txns = [(c, self._parse(c, x)) for c, x in pending if x is not None]
        for _chk, txn in txns:  # later transactions win: they carry everything folded before
            for folded in txn.covers[:-1]:
                self._absorbed_by[folded] = txn
        for i, (chk, txn) in enumerate(txns):
            self._settle(chk, txn)
            if i == 0:
                self.ctx.fault("mid-sink-recover")
        rolled_back = 0
        for gid in self._db.prepared_gids(self.prefix):
            if not gid[len(self.prefix) :].isdigit():
                continue  # another writer whose prefix merely starts like ours
            if not self._db.rollback_prepared(gid):
                continue  # settled by someone else meanwhile
            rolled_back += 1
            log.info(
                "rolled back orphan step=%r subtask=%d gid=%s", self.ctx.step, self.ctx.subtask, gid
            )
        self._prepared.clear()
        self._done.clear()
        self._absorbed_by.clear()
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d orphans_rolled_back=%d",
            self.ctx.step,
            self.ctx.subtask,
            self.ctx.generation,
            len(txns),
            rolled_back,
        )

    def close(self) -> None:
        """Closes the connection. Prepared transactions stay for ``recover``; rows buffered
        for an unprepared epoch are dropped (the epoch will be replayed)."""
        self._db.close()
        self._append, self._upsert = [], {}

    # -- transactions ----------------------------------------------------------------------------

    def _settle(self, checkpoint_id: int, txn: _Txn, *, early: bool = False) -> None:
        """Makes checkpoint ``checkpoint_id``'s rows committed, through ``txn`` or the later
        transaction it was folded into."""
        if checkpoint_id in self._done:
            return
        holder = self._absorbed_by.get(checkpoint_id, txn)
        ctx = self.ctx
        if self._db.commit_prepared(holder.gid):
            outcome = "committed early" if early else "committed"
        elif self._db.marker(holder.checkpoint_id) == holder.nonce:
            outcome = "already committed"
        else:
            raise SnapshotError(
                f"PostgreSQL sink step={ctx.step!r} subtask={ctx.subtask}: the output of "
                f"checkpoint {checkpoint_id} is missing: prepared transaction {holder.gid!r} is "
                f"neither in pg_prepared_xacts nor committed (no marker with txn="
                f"{holder.nonce!r} in {'.'.join(self.sink.commits_table)}). It was rolled back "
                "by someone else, or the sink points at another database than before the "
                "restart; its rows are lost. Committing would hide that: restore the database "
                "or rerun the job from scratch",
                reason="missing",
            )
        self._done.update(holder.covers)
        self._prepared.pop(holder.checkpoint_id, None)
        log.info(
            "%s checkpoint_id=%d step=%r subtask=%d gid=%s",
            outcome,
            checkpoint_id,
            ctx.step,
            ctx.subtask,
            holder.gid,
        )

    def _settle_earlier(self, checkpoint_id: int) -> tuple[list[tuple[Any, ...]], list[int]]:
        """Before epoch ``checkpoint_id`` writes: commit earlier prepared epochs that a
        completed checkpoint covers, fold the others (aborted) into the new transaction.

        Returns the folded rows (oldest first) and the checkpoints they cover.
        """
        carried: list[tuple[Any, ...]] = []
        covers: list[int] = []
        if not self._prepared:
            return carried, covers
        newest = self._newest_completed(below=checkpoint_id)
        if newest is None:  # no snapshot store to ask: rely on lock_timeout
            return carried, covers
        for earlier in sorted(self._prepared):
            txn, rows = self._prepared[earlier]
            if earlier <= newest:
                # Completed, but its completion has not reached this task yet: commit now
                # (the engine's commit later is a no-op), or this epoch waits for its locks.
                self._settle(earlier, txn, early=True)
                continue
            # Every checkpoint since ``earlier`` aborted (at most one is pending at a time):
            # no restore will ever commit it alone, so its rows move into this transaction.
            self._db.rollback_prepared(txn.gid)  # False if already gone: its rows are in memory
            del self._prepared[earlier]
            carried = self._merge(carried, rows) if carried else rows
            covers.extend(txn.covers)
            log.info(
                "folded aborted checkpoint_id=%d into checkpoint_id=%d step=%r subtask=%d",
                earlier,
                checkpoint_id,
                self.ctx.step,
                self.ctx.subtask,
            )
        return carried, covers

    def _newest_completed(self, *, below: int) -> int | None:
        """The newest completed checkpoint below ``below`` (-1: none), ``None`` if unknown."""
        if self.ctx.snapshot_url is None:
            return None
        if self._store is None:
            from processor.snapshot.store import SnapshotStore

            self._store = SnapshotStore(self.ctx.snapshot_url)
        ids = [c for c in self._store.completed_ids(self.ctx.job) if c < below]
        return ids[-1] if ids else -1

    # -- helpers ---------------------------------------------------------------------------------

    def _merge(
        self, older: list[tuple[Any, ...]], newer: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        if self.sink.mode == "append":
            return older + newer
        idx = self._key_idx
        merged = {tuple(r[i] for i in idx): r for r in older}
        merged.update((tuple(r[i] for i in idx), r) for r in newer)
        return list(merged.values())

    def _row(self, value: Any) -> tuple[Any, ...]:
        sink = self.sink
        try:
            row = sink.row(value) if sink.row is not None else value
        except Exception as exc:
            why = f"row function raised {type(exc).__name__}: {exc}"
            raise self._unwritable(value, why) from exc
        if isinstance(row, Mapping):
            missing = [c for c in sink.columns if c not in row]
            if missing:
                raise self._unwritable(value, f"its row has no {missing}")
            return tuple(row[c] for c in sink.columns)
        if not isinstance(row, list | tuple):
            raise self._unwritable(value, f"its row is a {type(row).__name__}, not tuple/dict")
        if len(row) != len(sink.columns):
            raise self._unwritable(
                value, f"its row has {len(row)} fields for {len(sink.columns)} columns"
            )
        return tuple(row)

    def _unwritable(self, value: Any, why: str) -> SerializationError:
        columns = ", ".join(self.sink.columns)
        return SerializationError(
            f"PostgreSQL sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not turn "
            f"a value of type {type(value).__name__} ({value!r:.80}) into a row ({columns}): "
            f"{why}. Give PostgresSink a row= function returning a tuple in column order or a "
            "dict by column name"
        )

    def _parse(self, checkpoint_id: int, committable: Any) -> _Txn:
        c = committable if isinstance(committable, dict) else {}
        gid, nonce, covers = c.get("gid"), c.get("txn"), c.get("covers")
        if (
            not isinstance(gid, str)
            or gid != f"{self.prefix}{checkpoint_id}"
            or not isinstance(nonce, str)
            or not isinstance(covers, list | tuple)
            or not covers
            or covers[-1] != checkpoint_id
            or not all(isinstance(x, int) and x <= checkpoint_id for x in covers)
        ):
            raise SnapshotError(
                f"PostgreSQL sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"{committable!r} of checkpoint {checkpoint_id} is not one of this writer's "
                f"(expected {{'gid': '{self.prefix}{checkpoint_id}', 'txn': <nonce>, 'covers': "
                f"[..., {checkpoint_id}]}}); was the step's sink replaced since the snapshot "
                "was taken?",
                reason="corrupt",
            )
        return _Txn(checkpoint_id, gid, nonce, tuple(covers))
