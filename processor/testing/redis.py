"""Redis faults: a private embedded Redis that a test (or ``eosflow certify``) may kill and
bring back on the same port, with its data (a clean shutdown flushes the append-only file) or
without it (the files deleted, as after a restart of a Redis without persistence or a lost
disk)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from processor.embedded._process import stop
from processor.embedded.servers import Server, start_redis
from processor.errors import ServerNotFoundError

__all__ = ["kill_redis", "private_redis", "restart_redis"]


def private_redis(workdir: Path, port: int | None = None) -> Server:
    """A Redis of the caller alone (append-only file in ``workdir``), on ``port`` if given.

    Raises:
        ServerNotFoundError: no ``redis-server`` binary; under pytest the test skips instead.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return start_redis(workdir, owned=True, port=port)
    except ServerNotFoundError as exc:
        if "pytest" in sys.modules:
            import pytest

            pytest.skip(f"no redis-server binary for a private server: {exc}")
        raise


def kill_redis(server: Server, *, clean: bool = False) -> None:
    """Stops it by PID: SIGTERM (a clean shutdown: the append-only file is flushed) if
    ``clean``, else SIGKILL."""
    if clean:
        stop(server.process)
        return
    os.kill(server.process.pid, signal.SIGKILL)
    if server.process.popen is not None:
        server.process.popen.wait(timeout=10)
    stop(server.process)  # forgets it (and reaps it)


def restart_redis(server: Server, *, empty: bool) -> Server:
    """Starts Redis again on the same port and directory; ``empty`` deletes its data first."""
    workdir = Path(server.workdir)
    if empty:
        for path in workdir.iterdir():
            if path.name.startswith(("appendonly", "dump")) or path.name == "appendonlydir":
                if path.is_dir():
                    for inner in path.iterdir():
                        inner.unlink()
                    path.rmdir()
                else:
                    path.unlink()
    return start_redis(workdir, owned=True, port=server.port)
