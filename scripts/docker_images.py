#!/usr/bin/env python3
"""A Docker engine and eosflow's local container images, on a machine that reaches no image
registry (only Debian's package mirror and PyPI).

    python3 scripts/docker_images.py setup [--env-file F]   # engine + base + images (default)
    python3 scripts/docker_images.py build [--only kafka,redis]  # images only (engine must answer)
    python3 scripts/docker_images.py env                     # the variables the tests need
    python3 scripts/docker_images.py stop                    # stop the dockerd `setup` started

``setup``:

1. A Docker engine: if ``docker info`` fails, installs Debian's ``docker.io`` (as root, with
   apt-get) when ``dockerd`` is missing, and starts ``dockerd --bridge=none --iptables=false`` in
   the background (log and PID file under ``$EOSFLOW_DOCKER_DIR``, default /tmp/eosflow-docker).
   No bridge: every container runs on the host network, bound to 127.0.0.1.
2. The base image ``eosflow/debian-base:bookworm``: ``debootstrap --variant=minbase bookworm``
   from the Debian mirror apt already uses, imported with ``docker import``. Built once; kept.
3. The images, ``FROM`` that base (docker/images/*/Dockerfile, ``docker build --network host`` so
   that apt and pip inside the build reach the mirror and PyPI): Kafka (Apache Kafka from
   ``$EOSFLOW_KAFKA_DIST/4.3.1``, default ../shared/kafka/4.3.1 beside the repository), Redis,
   PostgreSQL and the eosflow app. Each build context is assembled in a temporary directory and
   hashed with its Dockerfile, build arguments and the base image's ID; an image whose hash tag
   exists is not built again.

Every step prints how long it took. The last lines are ``export NAME=value`` lines (also written
to ``--env-file``) naming the images and the network mode for the tests and for
docker/compose.local.yaml. Exit status 1, with the reason, when a step cannot be done.

Only the standard library: runs with the system python3, before any virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docker" / "images"
STATE = Path(os.environ.get("EOSFLOW_DOCKER_DIR", "/tmp/eosflow-docker"))
BASE_IMAGE = "eosflow/debian-base:bookworm"
SUITE = "bookworm"
KAFKA_VERSION = "4.3.1"
#: Locally added CA certificates of the host (a TLS-intercepting proxy's): the app build trusts
#: them, so that pip inside it reaches PyPI where the host's pip does.
HOST_CAS = Path("/usr/local/share/ca-certificates")


class SetupError(Exception):
    """A step cannot be done here; the message says why and what to do."""


@dataclass
class Image:
    """One image of docker/images/: its tag, and what goes into its build context.

    Attributes:
        name: the folder under docker/images/ and the key of ``--only``.
        repository: the image's name without tag.
        version: the stable tag (``repository:version``), re-pointed at every build.
        variable: the environment variable that names the image for the tests.
        args: build arguments (with ``BASE_IMAGE``).
    """

    name: str
    repository: str
    version: str
    variable: str
    args: dict[str, str] = field(default_factory=dict)

    @property
    def alias(self) -> str:
        return f"{self.repository}:{self.version}"


def images() -> dict[str, Image]:
    return {
        "kafka": Image(
            "kafka", "eosflow/kafka", KAFKA_VERSION, "EOSFLOW_KAFKA_IMAGE",
            {"KAFKA_VERSION": KAFKA_VERSION},
        ),
        "redis": Image("redis", "eosflow/redis", SUITE, "EOSFLOW_REDIS_IMAGE"),
        "postgres": Image("postgres", "eosflow/postgres", SUITE, "EOSFLOW_POSTGRES_IMAGE"),
        "app": Image("app", "eosflow/app", "local", "EOSFLOW_APP_IMAGE"),
    }  # fmt: skip


def say(message: str) -> None:
    print(f"[docker_images] {message}", flush=True)


@contextmanager
def step(what: str) -> Iterator[None]:
    """Prints ``what`` and, when it ends, how long it took."""
    say(f"{what} ...")
    started = time.monotonic()
    try:
        yield
    except SetupError:
        say(f"{what}: FAILED after {time.monotonic() - started:.1f}s")
        raise
    say(f"{what}: done in {time.monotonic() - started:.1f}s")


def run(*command: str, log: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Runs ``command``; its output goes to ``log`` if given (else it is returned).

    Raises:
        SetupError: it exited non-zero (with the end of its output).
    """
    environ = {**os.environ, **(env or {})}
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as sink:
            sink.write(f"$ {' '.join(command)}\n")
            sink.flush()
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=environ)
        if done.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise SetupError(f"{' '.join(command)} exited with {done.returncode}; {log}:\n{tail}")
        return ""
    result = subprocess.run(command, capture_output=True, text=True, env=environ)
    if result.returncode != 0:
        raise SetupError(
            f"{' '.join(command)} exited with {result.returncode}: {result.stderr.strip()[-2000:]}"
        )
    return result.stdout


def engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def apt_install(*packages: str) -> None:
    if os.geteuid() != 0:
        raise SetupError(f"{', '.join(packages)} missing and not root: apt-get install {packages}")
    if shutil.which("apt-get") is None:
        raise SetupError(f"{', '.join(packages)} missing and no apt-get to install them")
    log = STATE / "apt.log"
    run("apt-get", "update", log=log)
    run(
        "apt-get", "install", "-y", "--no-install-recommends", *packages,
        log=log, env={"DEBIAN_FRONTEND": "noninteractive"},
    )  # fmt: skip


def ensure_engine() -> None:
    """A Docker engine that answers, started here (no bridge, no iptables) if none does."""
    if engine_answers():
        say("a Docker engine answers 'docker info': using it")
        return
    if shutil.which("dockerd") is None:
        with step("installing Debian's docker.io"):
            apt_install("docker.io")
    if os.geteuid() != 0:
        raise SetupError("no Docker engine answers and dockerd must start as root")
    STATE.mkdir(parents=True, exist_ok=True)
    log = STATE / "dockerd.log"
    with step(f"starting dockerd --bridge=none --iptables=false (log {log})"):
        with log.open("a") as sink:
            proc = subprocess.Popen(
                ["dockerd", "--bridge=none", "--iptables=false"],
                stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        (STATE / "dockerd.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 60
        while not engine_answers():
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise SetupError(f"dockerd exited with {proc.returncode}; {log} ends:\n{tail}")
            if time.monotonic() > deadline:
                raise SetupError(f"dockerd (pid {proc.pid}) does not answer after 60s; see {log}")
            time.sleep(0.5)
        say(f"dockerd pid {proc.pid}")


def stop_engine() -> None:
    """Stops the dockerd that ``setup`` started (by its PID file), if it still runs."""
    pid_file = STATE / "dockerd.pid"
    if not pid_file.exists():
        say("no dockerd started by this script (no PID file)")
        return
    pid = int(pid_file.read_text())
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists() or b"dockerd" not in cmdline.read_bytes():
        say(f"dockerd {pid} no longer runs")
        pid_file.unlink()
        return
    os.kill(pid, 15)
    deadline = time.monotonic() + 30
    while cmdline.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if cmdline.exists():
        raise SetupError(f"dockerd {pid} still runs 30s after SIGTERM")
    pid_file.unlink()
    say(f"stopped dockerd {pid}")


def image_id(tag: str) -> str | None:
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else None


def apt_sources() -> list[tuple[str, str]]:
    """(URI, suite) of every ``deb`` entry apt uses (one-line and deb822 files)."""
    found: list[tuple[str, str]] = []
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.startswith(("#", " ")):
                        key, value = line.split(":", 1)
                        fields[key.strip().lower()] = value.strip()
                if "deb" in fields.get("types", "").split():
                    for uri in fields.get("uris", "").split():
                        found += [(uri, suite) for suite in fields.get("suites", "").split()]
        else:
            for line in text.splitlines():
                words = [w for w in line.split() if not w.startswith("[")]
                if len(words) >= 3 and words[0] == "deb":
                    found.append((words[1], words[2]))
    return found


def mirrors() -> tuple[str, str | None]:
    """The Debian mirror apt uses for bookworm, and its security mirror (if any)."""
    sources = apt_sources()
    main = next((uri for uri, suite in sources if suite == SUITE), None)
    if main is None:
        raise SetupError(f"no '{SUITE}' entry in apt's sources: which Debian mirror to use?")
    security = next((uri for uri, suite in sources if suite == f"{SUITE}-security"), None)
    return main.rstrip("/"), security.rstrip("/") if security else None


def build_base(rebuild: bool) -> None:
    """``eosflow/debian-base:bookworm`` from debootstrap, unless it exists."""
    if image_id(BASE_IMAGE) and not rebuild:
        say(f"{BASE_IMAGE} exists: kept")
        return
    if shutil.which("debootstrap") is None:
        with step("installing debootstrap"):
            apt_install("debootstrap")
    main, security = mirrors()
    with tempfile.TemporaryDirectory(prefix="debian-base-", dir=STATE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        with step(f"debootstrap --variant=minbase {SUITE} from {main}"):
            run(
                "debootstrap", "--variant=minbase", SUITE, str(rootfs), main,
                log=STATE / "debootstrap.log",
            )  # fmt: skip
        lines = [f"deb {main} {SUITE} main", f"deb {main} {SUITE}-updates main"]
        if security:
            lines.append(f"deb {security} {SUITE}-security main")
        (rootfs / "etc/apt/sources.list").write_text("\n".join(lines) + "\n")
        (rootfs / "etc/apt/apt.conf.d/90eosflow").write_text(
            'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n'
        )
        # No service starts from a package's postinst inside an image build.
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        with step(f"docker import {BASE_IMAGE}"):
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            imported = subprocess.run(
                ["docker", "import", "--change", 'CMD ["bash"]', "--change", "ENV LANG=C.UTF-8",
                 "-", BASE_IMAGE],
                stdin=tar.stdout, capture_output=True, text=True,
            )  # fmt: skip
            assert tar.stdout is not None
            tar.stdout.close()
            if tar.wait() != 0 or imported.returncode != 0:
                raise SetupError(f"docker import failed: {imported.stderr.strip()}")


def repository_files() -> list[Path]:
    """The repository's files a clone has (tracked, and untracked but not ignored)."""
    out = run(
        "git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"
    )
    return sorted(
        p
        for p in (Path(name) for name in out.split("\0") if name)
        if (ROOT / p).is_file() and not (ROOT / p).is_symlink()
    )


def kafka_dist() -> Path:
    """Apache Kafka's broker: ``$EOSFLOW_KAFKA_DIST/<version>`` (as .ci/run and
    scripts/release_check.py read that variable), default ../shared/kafka beside the clone."""
    brokers = Path(os.environ.get("EOSFLOW_KAFKA_DIST") or ROOT.parent / "shared" / "kafka")
    dist = brokers / KAFKA_VERSION
    if not (dist / "libs").is_dir():
        raise SetupError(
            f"no Kafka distribution at {dist} (a folder with libs/*.jar and config/): set "
            f"EOSFLOW_KAFKA_DIST to the folder that holds {KAFKA_VERSION}/, or leave the Kafka "
            "image out with --only redis,postgres,app"
        )
    return dist


def assemble(image: Image, context: Path) -> Path:
    """Fills ``context`` with ``image``'s build context; returns its Dockerfile."""
    folder = IMAGES / image.name
    if image.name == "app":
        for rel in repository_files():
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, context / rel)
        cas = context / "docker/images/app/extra-ca"
        cas.mkdir(parents=True, exist_ok=True)
        for cert in sorted(HOST_CAS.glob("*.crt")):
            shutil.copyfile(cert, cas / cert.name)
        return context / "docker/images/app/Dockerfile"
    shutil.copytree(folder, context, dirs_exist_ok=True)
    if image.name == "kafka":
        dist = kafka_dist()
        shutil.copytree(
            dist, context / "kafka", ignore=shutil.ignore_patterns("start.sh", "stop.sh", "run")
        )
    return context / "Dockerfile"


def context_hash(context: Path, args: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for key in sorted(args):
        digest.update(f"arg {key}={args[key]}\n".encode())
    for path in sorted(p for p in context.rglob("*") if p.is_file()):
        rel = path.relative_to(context).as_posix()
        digest.update(f"file {rel} {path.stat().st_mode & 0o111:o}\n".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def build_image(image: Image, base_id: str, rebuild: bool) -> str:
    """Builds ``image`` unless an image of the same context hash exists; returns its tag."""
    args = {"BASE_IMAGE": BASE_IMAGE, "BASE_IMAGE_ID": base_id, **image.args}
    with tempfile.TemporaryDirectory(prefix=f"ctx-{image.name}-", dir=STATE) as tmp:
        context = Path(tmp)
        dockerfile = assemble(image, context)
        tag = f"{image.repository}:{image.version}-{context_hash(context, args)}"
        if image_id(tag) and not rebuild:
            say(f"{tag} exists (same Dockerfile, context and base): kept")
        else:
            build_args = [
                a
                for k, v in args.items()
                if k != "BASE_IMAGE_ID"
                for a in ("--build-arg", f"{k}={v}")
            ]
            with step(f"docker build {tag}"):
                run(
                    "docker", "build", "--network", "host", "--force-rm", "-f", str(dockerfile),
                    "-t", tag, *build_args, str(context),
                    log=STATE / f"build-{image.name}.log", env={"DOCKER_BUILDKIT": "0"},
                )  # fmt: skip
    run("docker", "tag", tag, image.alias)
    return tag


def exports(tags: dict[str, str]) -> list[str]:
    lines = [f"export {images()[name].variable}={tag}" for name, tag in tags.items()]
    # No bridge on this engine: containers on the host network, 127.0.0.1; no Ryuk (it needs a
    # published port), processor.testing removes its containers itself.
    return [
        *lines,
        "export EOSFLOW_DOCKER_NETWORK=host",
        "export TESTCONTAINERS_RYUK_DISABLED=true",
    ]


def build_all(only: list[str], rebuild: bool, rebuild_base: bool) -> dict[str, str]:
    STATE.mkdir(parents=True, exist_ok=True)
    build_base(rebuild_base)
    base_id = image_id(BASE_IMAGE)
    if base_id is None:
        raise SetupError(f"{BASE_IMAGE} missing after its build")
    known = images()
    return {name: build_image(known[name], base_id, rebuild) for name in only}


def existing() -> dict[str, str]:
    """The stable tags of the images that exist (what ``env`` prints)."""
    return {n: i.alias for n, i in images().items() if image_id(i.alias) is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command", nargs="?", default="setup", choices=["setup", "build", "env", "stop"]
    )
    parser.add_argument("--only", default=",".join(images()), help="images to build (default: all)")
    parser.add_argument(
        "--rebuild", action="store_true", help="build even when the hash tag exists"
    )
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the base again")
    parser.add_argument("--env-file", type=Path, help="also write the export lines there")
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(images()))
    if unknown:
        parser.error(f"--only: unknown images {unknown}; choose from {list(images())}")
    started = time.monotonic()
    try:
        if args.command == "stop":
            stop_engine()
            return 0
        if args.command == "setup":
            with step("Docker engine"):
                ensure_engine()
        elif not engine_answers():
            raise SetupError("no Docker engine answers 'docker info': run the 'setup' command")
        tags = (
            existing()
            if args.command == "env"
            else build_all(only, args.rebuild, args.rebuild_base)
        )
    except SetupError as exc:
        print(f"docker_images: {exc}", file=sys.stderr)
        return 1
    lines = exports(tags)
    if args.env_file is not None:
        args.env_file.write_text("\n".join(lines) + "\n")
    if args.command != "env":
        say(f"{args.command} finished in {time.monotonic() - started:.1f}s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
