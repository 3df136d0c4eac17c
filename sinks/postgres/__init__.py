"""PostgreSQL sink: two-phase commit with ``PREPARE TRANSACTION`` (docs/sink-postgres.md,
"Protocol").

One writer per sink subtask, one connection per writer. An epoch's rows are buffered in memory
and written at the barrier, in one transaction that also writes a marker row, and is then
``PREPARE``-d under a global id; ``COMMIT PREPARED`` runs when the checkpoint completes::

    write(values)   rows buffered (upsert mode: the last row per key)
    prepare(n)      BEGIN; COPY / INSERT .. ON CONFLICT; marker row; PREPARE TRANSACTION 'gid'
    commit(n)       COMMIT PREPARED 'gid'   (gone: the marker row says whether it committed)
    recover(p)      commit p's transactions, ROLLBACK PREPARED this writer's other ones

See docs/sink-postgres.md for the table layout, server settings and the guarantees.

Modules: :mod:`sinks.postgres.sink` (configuration, start-up checks), :mod:`sinks.postgres.writer`
(an epoch, and settling earlier prepared epochs) and :mod:`sinks.postgres.prepared` (global ids,
markers, and the SQL a writer runs).
"""

from sinks.postgres.prepared import COMMITS_TABLE, global_id
from sinks.postgres.sink import DSN_ENV, PostgresSink
from sinks.postgres.writer import PostgresSinkWriter

__all__ = ["COMMITS_TABLE", "DSN_ENV", "PostgresSink", "PostgresSinkWriter", "global_id"]
