"""File sink: part files written under hidden temporary names, renamed atomically on commit.

Layout of the output directory (docs/sink-files.md, "Layout")::

    part-<subtask:05d>-<checkpoint_id:010d>.<ext>          committed; one per subtask and epoch
    part-<subtask:05d>-<checkpoint_id:010d>-<n:04d>.<ext>  committed, when max_part_bytes is set
    .part-<subtask:05d>-g<generation>-<seq>.inprogress     being written, or prepared (hidden)
    .eosflow-sink.json                                     the (job, step) owning the directory

``<ext>`` is ``jsonl`` (one JSON value per line), ``txt`` (raw lines) or ``avro`` (one Avro object
container file per part). Readers glob ``part-*`` (or call :func:`read_committed`,
:func:`read_jsonl`, :func:`read_avro`) and see committed epochs only: a part file appears whole,
by ``os.replace``, when its checkpoint completes. A directory belongs to one sink step of one
job: part names hold the subtask and the checkpoint, not the step, so writers of another step or
job are refused instead of overwriting each other's parts.

- :mod:`sinks.files.sink`: :class:`FileSink`, the configuration, checked before the job runs.
- :mod:`sinks.files.writer`: :class:`FileSinkWriter`, the two-phase commit of one subtask.
- :mod:`sinks.files.parts`: in-progress part files (lines, Avro) and the encoding of values.
- :mod:`sinks.files.directory`: part names, the directory's claim, its file system, fsync.
- :mod:`sinks.files.read`: readers of the committed output.
"""

from __future__ import annotations

from sinks.files.read import read_avro, read_committed, read_committed_lines, read_jsonl
from sinks.files.sink import FileSink
from sinks.files.writer import FileSinkWriter

__all__ = [
    "FileSink",
    "FileSinkWriter",
    "read_avro",
    "read_committed",
    "read_committed_lines",
    "read_jsonl",
]
