"""Separate hosts on one machine, for tests: network namespaces on a bridge.

:class:`Hosts` makes a Linux bridge with an address of this machine on it (the "router": the
driver, Kafka and the S3 store listen there) and ``n`` network namespaces, each joined to the
bridge by a veth pair and given an address of its own. A process started in a namespace
(:func:`processor.embedded._process.spawn` with ``netns=``) also gets a host name of its own, so
it looks like another host to eosflow (``socket.gethostname()``): the Spark runner then cannot
SIGKILL it from here, as it could not on a real cluster. Each host resolves its own name and
the others' (``/etc/netns/NAME/hosts``, bind-mounted on its ``/etc/hosts`` as ``ip netns exec``
does).

:meth:`Hosts.cut` takes a host's link down (a network partition: packets are dropped, nothing
is closed); :meth:`Hosts.mend` brings it back.

It needs ``ip`` (iproute2) and CAP_NET_ADMIN and CAP_SYS_ADMIN (root, or a container allowed
to make namespaces): :func:`hosts_unavailable` says why not, for a test to skip with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "Hosts", "hosts_unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def hosts_unavailable() -> str | None:
    """Why this machine cannot make :class:`Hosts` (``None`` if it can)."""
    if shutil.which("ip") is None:
        return "no 'ip' command (apt-get install iproute2)"
    probe = f"ef-probe-{uuid.uuid4().hex[:6]}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot make a network namespace ({done.stderr.strip()}): needs root"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace: its name (also its host name), address and the bridge side of its link."""

    name: str
    address: str
    link: str  # the veth end on the bridge: down = cut off


@dataclass
class Hosts:
    """``n`` hosts on a bridge whose address is :attr:`router`; use as a context manager."""

    n: int
    subnet: int = 0  # 10.231.<subnet>.0/24; default: from the process id
    router: str = ""
    hosts: list[Host] = field(default_factory=list)
    _tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])

    def __post_init__(self) -> None:
        self.subnet = self.subnet or 1 + os.getpid() % 250
        self.router = f"10.231.{self.subnet}.1"

    @property
    def bridge(self) -> str:
        return f"efbr{self._tag}"

    def up(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            # A MAC of its own: by default a bridge takes its lowest port's, and changes it when
            # that port goes down (a cut), which left the other hosts' ARP entries for the
            # router stale: they were cut off too.
            _ip("link", "set", self.bridge, "address", f"02:ef:{self.subnet:02x}:00:00:01")
            _ip("addr", "add", f"{self.router}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n):
                name = f"ef{self._tag}h{i + 1}"
                here, there = f"efv{self._tag}{i + 1}", f"efp{self._tag}{i + 1}"
                address = f"10.231.{self.subnet}.{i + 2}"
                _ip("netns", "add", name)
                _ip("link", "add", here, "type", "veth", "peer", "name", there)
                _ip("link", "set", there, "netns", name)
                _ip("link", "set", here, "master", self.bridge)
                _ip("link", "set", here, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", there)
                _ip("-n", name, "link", "set", there, "up")
                _ip("-n", name, "link", "set", "lo", "up")
                self.hosts.append(Host(name, address, here))
            for host in self.hosts:  # each resolves its own name and the others'
                conf = Path("/etc/netns", host.name)
                conf.mkdir(parents=True, exist_ok=True)
                (conf / "hosts").write_text(
                    f"127.0.0.1 localhost\n{self.router} router\n"
                    + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
                )
        except BaseException:
            self.down()
            raise
        return self

    def cut(self, host: Host) -> None:
        """Cuts ``host`` off: its link goes down; its connections hang, none is closed."""
        _ip("link", "set", host.link, "down")

    def mend(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def by_name(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def down(self) -> None:
        """Removes the namespaces, links and bridge (processes still in a namespace keep it
        alive until they exit: stop them first)."""
        for host in self.hosts:
            _ip("link", "del", host.link, check=False)
            _ip("netns", "del", host.name, check=False)
            shutil.rmtree(Path("/etc/netns", host.name), ignore_errors=True)
        with contextlib.suppress(OSError):
            _ip("link", "del", self.bridge, check=False)
        self.hosts = []

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *_exc: object) -> None:
        self.down()
