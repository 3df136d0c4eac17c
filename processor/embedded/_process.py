"""Start and stop one server process on loopback, by PID, without leaving orphans.

Three layers keep a server from outliving whoever owns it:

* ``owned=True`` servers (tests, ``eosflow run`` on embedded defaults) get ``PR_SET_PDEATHSIG``:
  the kernel sends SIGKILL to the server when its parent dies, even if the parent was SIGKILLed.
* :func:`stop` sends SIGTERM to the server's whole process group, waits, then SIGKILL.
* An ``atexit`` hook and the CLI's signal handlers stop every server this process still owns.

``owned=False`` servers (``eosflow dev up``) are detached on purpose and stopped later by PID from
the state file; :func:`stop` checks the PID still runs the same command line before it signals,
so a recycled PID is never killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from processor.errors import InfrastructureError

__all__ = [
    "ServerExited",
    "ServerProcess",
    "free_port",
    "is_running",
    "spawn",
    "stop",
    "wait_until",
]


class ServerExited(InfrastructureError):
    """The server process exited during start-up (not a timeout)."""


log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_OWNED: dict[int, ServerProcess] = {}


@dataclass
class ServerProcess:
    """A running server: enough to find, check and stop it from another process."""

    name: str
    pid: int
    argv: list[str]
    log_path: str
    popen: subprocess.Popen[bytes] | None = None

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "argv": self.argv, "log_path": self.log_path}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ServerProcess:
        argv = data["argv"]
        assert isinstance(argv, list)
        return cls(
            str(data["name"]), int(str(data["pid"])), [str(a) for a in argv], str(data["log_path"])
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_SLAVE = 0x1000, 0x4000, 0x80000


def _enter_host(netns: str) -> None:
    """Become a process of another host: ``ip netns exec`` (without ``ip`` in the server's
    command line: its PID is the server's), and a host name of its own (``netns``) in a new
    UTS namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {netns}")
    finally:
        os.close(fd)
    name = netns.encode()
    if libc.unshare(_CLONE_NEWUTS) != 0 or libc.sethostname(name, len(name)) != 0:
        raise OSError(ctypes.get_errno(), f"a host name of its own for {netns}")
    # As ``ip netns exec``: /etc/netns/NAME/hosts, if any, is this host's /etc/hosts (a host
    # resolves its own name: Spark's executors look it up), in a mount namespace of its own.
    hosts = f"/etc/netns/{netns}/hosts".encode()
    if os.path.exists(hosts):
        if libc.unshare(_CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), f"a mount namespace for {netns}")
        if libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None) != 0:
            raise OSError(ctypes.get_errno(), "mount --make-rslave /")
        if libc.mount(hosts, b"/etc/hosts", None, _MS_BIND, None) != 0:
            raise OSError(ctypes.get_errno(), f"bind-mount {hosts.decode()} on /etc/hosts")


def _preexec(
    owned: bool, uid: int | None, gid: int | None, netns: str | None = None
) -> Callable[[], None]:
    def run() -> None:
        os.setsid()
        if netns is not None:
            _enter_host(netns)
        if gid is not None:
            os.setgroups([])
            os.setgid(gid)
        if uid is not None:
            os.setuid(uid)
        if owned:
            # After setuid: a credential change clears the parent-death signal.
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return run


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log_path: Path,
    owned: bool,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    uid: int | None = None,
    gid: int | None = None,
    netns: str | None = None,
    stdin: int = subprocess.DEVNULL,
    fork_safe: bool = False,
) -> ServerProcess:
    """Start ``argv`` in its own session with output to ``log_path``; ``netns``: in that
    network namespace (``ip netns add``), with that host name (needs CAP_SYS_ADMIN; see
    :class:`processor.testing.hosts.Hosts`); ``stdin``: ``subprocess.PIPE`` to write to it
    (``popen.stdin``). ``fork_safe``: no Python code between fork and exec (a new session by
    ``start_new_session``, no parent-death signal): for a caller with many threads, where a
    ``preexec_fn`` can deadlock the child on a lock another thread held at the fork, and
    ``Popen`` then waits for it for ever (a runner's loop hung so in CI, issue 51).

    Call it from a thread that lives as long as the server should: the kernel's parent-death
    signal fires when the *thread* that forked exits, not the process.
    """
    log_file = open(log_path, "ab")  # noqa: SIM115 - the child keeps the descriptor
    try:
        popen = subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=None if fork_safe else _preexec(owned, uid, gid, netns),
            start_new_session=fork_safe,
            close_fds=True,
        )
    except OSError as exc:
        raise InfrastructureError(f"could not start {name} ({argv[0]}): {exc}") from exc
    finally:
        log_file.close()
    server = ServerProcess(name, popen.pid, list(argv), str(log_path), popen)
    if owned:
        _OWNED[popen.pid] = server
    log.info("started server=%s pid=%d", name, popen.pid)
    return server


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def is_running(server: ServerProcess) -> bool:
    """True when ``server.pid`` is alive and still runs ``server.argv`` (not a recycled PID)."""
    if server.popen is not None and server.popen.poll() is not None:
        return False
    cmdline = _cmdline(server.pid)
    if cmdline is None:
        return False
    try:
        with open(f"/proc/{server.pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except OSError:
        return False
    # Servers rewrite their title ("redis-server 127.0.0.1:6379"): compare the program name only.
    return bool(cmdline) and Path(cmdline[0].split()[0]).name == Path(server.argv[0]).name


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop(server: ServerProcess, *, timeout: float = 10.0) -> None:
    """Stop the server and its process group: SIGTERM, then SIGKILL after ``timeout`` seconds."""
    _OWNED.pop(server.pid, None)
    if not is_running(server):
        _reap(server)
        return
    _signal_group(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(server)
        if not is_running(server):
            break
        time.sleep(0.02)
    else:
        log.warning(
            "server=%s pid=%d ignored SIGTERM for %.0fs; sending SIGKILL",
            server.name,
            server.pid,
            timeout,
        )
    # Children of the server (postgres backends) may outlive their leader for a moment.
    _signal_group(server.pid, signal.SIGKILL)
    _reap(server)
    log.info("stopped server=%s pid=%d", server.name, server.pid)


def _reap(server: ServerProcess) -> None:
    if server.popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.popen.wait(timeout=0)
    else:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(server.pid, os.WNOHANG)


def wait_until(
    server: ServerProcess, ready: Callable[[], bool], *, timeout: float, what: str
) -> float:
    """Poll ``ready`` until it returns True; return the seconds it took.

    Raises:
        InfrastructureError: the server exited or did not become ready in time; the message
            carries the tail of its log.
    """
    start = time.monotonic()
    delay = 0.01
    while True:
        if not is_running(server):
            raise ServerExited(
                f"{server.name} exited during start-up (pid {server.pid}); its log "
                f"{server.log_path} ends with:\n{server.log_tail()}"
            )
        with contextlib.suppress(OSError):
            if ready():
                return time.monotonic() - start
        if time.monotonic() - start > timeout:
            stop(server)
            raise InfrastructureError(
                f"{server.name} did not {what} within {timeout:.0f}s (pid {server.pid}); its log "
                f"{server.log_path} ends with:\n{server.log_tail()}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def stop_owned() -> None:
    """Stop every server this process started with ``owned=True`` and has not stopped yet."""
    for server in list(_OWNED.values()):
        try:
            stop(server, timeout=5.0)
        except Exception:  # the interpreter is exiting: keep stopping the others
            log.exception("could not stop server=%s pid=%d", server.name, server.pid)


atexit.register(stop_owned)
