"""Console sink: prints each epoch's lines when its checkpoint completes. For development.

A terminal is not transactional, so this sink is exactly-once only up to the crash window of
printing itself: lines are buffered during the epoch, carried in the snapshot by ``prepare`` and
printed by ``commit``. Nothing of an epoch is printed before its checkpoint completes, and an
epoch that never completes is never printed. But if the process is killed while ``commit`` is
printing (or after printing, before the engine records the commit), ``recover`` prints that
epoch again after the restart. Use the file, Kafka or PostgreSQL sinks for output that matters.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from processor.contracts import SinkContext
from processor.errors import ConfigError, SerializationError, SnapshotError

__all__ = ["ConsoleSink", "ConsoleSinkWriter"]

log = logging.getLogger(__name__)


class ConsoleSink:
    """Prints every value as one line on commit (at-least-once across crashes; see the module).

    Args:
        stream: where to print; ``None`` means ``sys.stdout`` as it is at each commit (so
            redirections made after the pipeline file was imported are followed). A stream
            given here must be usable in every worker process that opens the sink.
        format: turns one value into its line (without newline); default ``str``.
        prefix: put before every line, e.g. ``"[clicks] "``.

    Raises:
        ConfigError: ``format`` is not callable, ``prefix`` is not a ``str``, or ``stream`` has
            no ``write`` method.
    """

    def __init__(
        self,
        *,
        stream: TextIO | None = None,
        format: Callable[[Any], str] | None = None,
        prefix: str = "",
    ) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigError(
                f"ConsoleSink stream must be a text stream with write(), got "
                f"{type(stream).__name__}; pass e.g. sys.stderr, or None for sys.stdout"
            )
        if format is not None and not callable(format):
            raise ConfigError(
                f"ConsoleSink format must be a function value -> str, got {type(format).__name__}"
            )
        if not isinstance(prefix, str):
            raise ConfigError(f"ConsoleSink prefix must be a str, got {type(prefix).__name__}")
        # Configuration only: sys.stdout is looked up at commit time, never held here.
        self.stream = stream
        self.format = format
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"ConsoleSink(prefix={self.prefix!r})"

    def open(self, ctx: SinkContext) -> ConsoleSinkWriter:
        """A writer for subtask ``ctx.subtask``."""
        return ConsoleSinkWriter(ctx, stream=self.stream, format=self.format, prefix=self.prefix)


class ConsoleSinkWriter:
    """One subtask's writer of a :class:`ConsoleSink`.

    ``write`` formats values into the epoch's buffer; ``prepare`` hands the buffer over as the
    committable (a ``list`` of ``str``, stored in the snapshot); ``commit`` prints it and flushes.

    Invariants:
        Nothing is printed before ``commit``; lines of epochs that never complete are dropped.
        ``commit`` is idempotent within a process: a checkpoint id not above the last one
        printed is skipped. Across a crash during printing, ``recover`` prints the pending
        epochs again (the terminal cannot be rolled back).
        ``write`` is all or nothing per call: a value that fails to format adds no line.
        The buffer holds one epoch; the stream is never closed by the writer.
    """

    def __init__(
        self,
        ctx: SinkContext,
        *,
        stream: TextIO | None = None,
        format: Callable[[Any], str] | None = None,
        prefix: str = "",
    ) -> None:
        self.ctx = ctx
        self._stream = stream
        self._format: Callable[[Any], str] = format if format is not None else str
        self._prefix = prefix
        self._lines: list[str] = []
        self._last_committed = -1

    def __repr__(self) -> str:
        return f"ConsoleSinkWriter(step={self.ctx.step!r}, subtask={self.ctx.subtask})"

    def write(self, values: Sequence[Any]) -> None:
        """Formats ``values`` into the epoch's buffer, one line each.

        Raises:
            SerializationError: ``format`` raised or returned something else than a ``str``.
        """
        self._lines.extend([self._line(value) for value in values])

    def prepare(self, checkpoint_id: int) -> list[str] | None:
        """The epoch's lines (the buffer is handed over and emptied), or ``None`` if none."""
        if not self._lines:
            return None
        lines, self._lines = self._lines, []
        log.debug(
            "prepared checkpoint_id=%d step=%r subtask=%d lines=%d",
            checkpoint_id,
            self.ctx.step,
            self.ctx.subtask,
            len(lines),
        )
        return lines

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        """Prints the prepared lines and flushes. ``None`` is a no-op.

        Raises:
            SnapshotError: ``corrupt`` when ``committable`` is not a list of ``str``.
        """
        if committable is None:
            return
        if checkpoint_id <= self._last_committed:
            log.debug(
                "already committed checkpoint_id=%d step=%r subtask=%d",
                checkpoint_id,
                self.ctx.step,
                self.ctx.subtask,
            )
            return
        if not isinstance(committable, list) or not all(isinstance(x, str) for x in committable):
            raise SnapshotError(
                f"console sink step={self.ctx.step!r} subtask={self.ctx.subtask}: committable "
                f"of checkpoint {checkpoint_id} is a {type(committable).__name__}, not a list "
                "of str lines; was the step's sink replaced since the snapshot was taken?",
                reason="corrupt",
            )
        stream = self._stream if self._stream is not None else sys.stdout
        stream.write("".join([f"{line}\n" for line in committable]))
        stream.flush()
        self._last_committed = checkpoint_id
        log.debug(
            "committed checkpoint_id=%d step=%r subtask=%d lines=%d",
            checkpoint_id,
            self.ctx.step,
            self.ctx.subtask,
            len(committable),
        )

    def recover(self, pending: Sequence[tuple[int, Any]]) -> None:
        """Prints the pending epochs (in order) and drops any buffered, unprepared lines."""
        self._lines = []
        for checkpoint_id, committable in pending:
            self.commit(checkpoint_id, committable)
        log.info(
            "recovered step=%r subtask=%d generation=%d pending=%d",
            self.ctx.step,
            self.ctx.subtask,
            self.ctx.generation,
            len(pending),
        )

    def close(self) -> None:
        """Drops the unprepared lines of the current epoch; the stream stays open."""
        self._lines = []

    def _line(self, value: Any) -> str:
        try:
            text = self._format(value)
        except Exception as exc:
            raise self._unformattable(value, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise self._unformattable(value, f"format returned {type(text).__name__}, not str")
        return self._prefix + text

    def _unformattable(self, value: Any, why: str) -> SerializationError:
        return SerializationError(
            f"console sink step={self.ctx.step!r} subtask={self.ctx.subtask} could not format a "
            f"value of type {type(value).__name__}: {why}. Fix the format= function or convert "
            "the value in a map step before the sink"
        )
