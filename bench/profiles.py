"""Sampling profiles of a benchmark's processes, with py-spy, summarised as top-N tables.

``bench/peers.py --profile DIR`` runs every system under ``py-spy record --subprocesses`` (so an
eosflow run's workers are sampled too) and writes ``DIR/<system>.raw`` (collapsed stacks) and
``DIR/<system>-top.txt``. A profiled run is slower than a plain one (py-spy stops each process
to sample it): its records/s are not comparable with an unprofiled run's; its *shares* of time
per function are what it is for.

Print the table of a saved profile::

    python bench/profiles.py DIR/eosflow1.raw --top 15 [--match b-local-]

Self time is the share of samples whose innermost frame is the function; inclusive time the share
of samples with the function anywhere on the stack (counted once per sample). py-spy is run
without ``--idle``, yet here (a container) it still records threads blocked in a wait: the
samples whose innermost frame is one of :data:`WAITS` are dropped and counted apart, so shares
are of the time spent working.
"""

from __future__ import annotations

import argparse
import re
import shutil
from collections import Counter
from pathlib import Path

__all__ = ["py_spy", "top", "wrap"]

#: ``func (path/to/file.py:123)`` frames of py-spy's raw format; the line number is dropped so
#: one function's samples add up.
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


#: Innermost frames of threads that wait (a lock, a socket, an idle thread pool).
WAITS = (
    "Condition.wait (",
    "Event.wait (",
    "Connection._recv_exact (",
    "_worker (concurrent/futures/thread.py)",
    "select (",
    "sleep (",
)


def py_spy() -> str | None:
    """The py-spy executable, or ``None`` (``pip install py-spy``)."""
    return shutil.which("py-spy")


def wrap(command: list[str], raw: Path, *, rate: int = 200) -> list[str]:
    """``command`` under ``py-spy record`` (its children too), collapsed stacks into ``raw``."""
    exe = py_spy()
    if exe is None:
        raise RuntimeError("--profile needs py-spy: pip install py-spy")
    return [
        exe, "record", "--subprocesses", "--format", "raw", "--rate", str(rate),
        "--output", str(raw), "--", *command,
    ]  # fmt: skip


def _frame(text: str) -> str:
    match = _FRAME.match(text.strip())
    if match is None:
        return text.strip()
    file = match["file"]
    for marker in ("site-packages/", "/work/", "lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{match['func']} ({file})"


def top(raw: Path, n: int = 15, match: str | None = None) -> str:
    """The ``n`` functions with the most self time, and their inclusive time, as a table;
    ``match``: only the samples whose stack (process command lines included) contains it."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = waiting = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or (match is not None and match not in stack):
            continue
        samples = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        frames = [f for f in frames if not f.startswith("process ")]  # --subprocesses roots
        if not frames:
            continue
        if frames[-1].startswith(WAITS):
            waiting += samples
            continue
        total += samples
        own[frames[-1]] += samples
        for f in set(frames):
            inclusive[f] += samples
    if not total:
        return f"{raw}: no samples"
    rows = [
        f"{raw.name}{f' [{match}]' if match else ''}: {total:,} samples working "
        f"({waiting:,} more in waits, dropped)",
        "| self % | incl. % | function (file) |",
        "|---:|---:|---|",
    ]
    for func, samples in own.most_common(n):
        rows.append(
            f"| {100 * samples / total:.1f} | {100 * inclusive[func] / total:.1f} | `{func}` |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="Top functions of a py-spy raw profile.")
    parser.add_argument("raw", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--match", help="only stacks containing this text (e.g. a job name in a worker's command)"
    )
    args = parser.parse_args()
    for raw in args.raw:
        print(top(raw, args.top, args.match))
        print()


if __name__ == "__main__":
    main()
