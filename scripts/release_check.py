#!/usr/bin/env python3
"""The release check: the test tiers on real Apache Kafka brokers, with a summary to publish.

For each broker (by default Apache Kafka 4.3.1 and 2.3.0 from the folder ``../shared/kafka``
beside the repository, started on free loopback ports and stopped at the end; or brokers you
name), it runs ``eosflow probe``, README command 2 (``-m "not slow and not crash"``), the crash
tier (``-m "crash and not slow"``) and ``eosflow certify`` of ``examples/running_total.py``
with a transactional Kafka sink, then writes a Markdown summary (the table of
docs/release-check.md)::

    python scripts/release_check.py                         # both brokers, both tiers, certify
    python scripts/release_check.py --kafka 4.3.1 --tiers command2 --no-certify   # CI's tier
    python scripts/release_check.py --brokers kafka-3.9=127.0.0.1:9092   # a broker of yours

A tier fails when pytest fails, collects no test, or skips a test for a broker feature that
Apache Kafka has (a skip whose reason starts with ``broker feature missing:``,
``tests/features.py``). Exit status 0 when every tier of every broker passed (and certify said
PASS), 1 otherwise, 2 when a broker could not be had or the arguments are wrong.

Apache Kafka itself is never part of this repository: the script only runs a distribution's
``start.sh``/``stop.sh`` (``--dist``, ``EOSFLOW_KAFKA_DIST``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = {
    "command2": ("README command 2", "not slow and not crash"),
    "crash": ("crash tier", "crash and not slow"),
}
FEATURE_SKIP = "broker feature missing:"  # tests/features.py


@dataclass
class Tier:
    name: str
    exit_status: int
    seconds: float
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    skips: dict[str, int] = field(default_factory=dict)  # reason -> tests

    @property
    def feature_skips(self) -> list[str]:
        return [reason for reason in self.skips if FEATURE_SKIP in reason]

    @property
    def ok(self) -> bool:
        return (
            self.exit_status == 0
            and self.passed > 0
            and not self.failed
            and not self.errors
            and not self.feature_skips
        )

    def verdict(self) -> str:
        if self.exit_status == 5 or self.passed + self.failed + self.errors == 0:
            return "FAILED: collected no test"
        if self.feature_skips:
            return f"FAILED: {len(self.feature_skips)} broker-feature skip(s)"
        if not self.ok:
            return f"FAILED (pytest exit {self.exit_status})"
        return "passed"


@dataclass
class BrokerResult:
    label: str
    brokers: str
    probe: list[str] = field(default_factory=list)
    tiers: list[Tier] = field(default_factory=list)
    certify: str | None = None  # PASS/FAIL line, None when not run
    error: str | None = None

    @property
    def ok(self) -> bool:
        certified = self.certify is None or self.certify.startswith("PASS")
        return self.error is None and all(t.ok for t in self.tiers) and certified


def read_junit(path: Path, name: str, exit_status: int, seconds: float) -> Tier:
    """Counts, failures and skip reasons of a pytest ``--junitxml`` report."""
    tier = Tier(name, exit_status, seconds)
    if not path.exists():
        return tier
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            tier.passed += 1
        elif outcome.tag == "skipped":
            tier.skipped += 1
            reason = _skip_reason(outcome.get("message", ""))
            tier.skips[reason] = tier.skips.get(reason, 0) + 1
        elif outcome.tag == "failure":
            tier.failed += 1
            tier.failures.append(test)
        else:
            tier.errors += 1
            tier.failures.append(f"{test} (error)")
    return tier


def _skip_reason(message: str) -> str:
    # "Skipped: <reason>"; the per-test details (ports, topic names) made every line unique.
    reason = message.removeprefix("Skipped: ").strip()
    reason = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", reason)
    return reason[:300]


def free_port(pair: bool = False) -> int:
    """A free loopback port (and the next one free too, with ``pair``: the KRaft controller)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not pair:
            return port
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 1))
            return port
    raise RuntimeError("no free pair of loopback ports")


@contextlib.contextmanager
def kafka_from_dist(dist: Path, version: str, log: Path) -> Iterator[str]:
    """A broker of ``dist/version`` (its ``start.sh``) on free ports; stopped and wiped after."""
    home = dist / version
    port = free_port(pair=True)
    state = Path(tempfile.mkdtemp(prefix=f"eosflow-kafka-{version}-"))
    env = {
        **os.environ,
        "KAFKA_PORT": str(port),
        "KAFKA_STATE_DIR": str(state),
        "KAFKA_ZK_PORT": str(free_port()),
        "KAFKA_PYTHON": sys.executable,
    }
    started = time.monotonic()
    with log.open("a") as out:
        status = subprocess.call(
            [str(home / "start.sh"), "--fresh"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        if status != 0:
            raise RuntimeError(f"{home}/start.sh exited {status}; its output is in {log}")
        say(f"Apache Kafka {version} on 127.0.0.1:{port} ({time.monotonic() - started:.0f} s)")
        yield f"127.0.0.1:{port}"
    finally:
        with log.open("a") as out:
            subprocess.call(
                [str(home / "stop.sh"), "--wipe"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        shutil.rmtree(state, ignore_errors=True)


def run_tier(key: str, brokers: str, workers: int, work: Path, extra: list[str]) -> Tier:
    name, marks = TIERS[key]
    report = work / f"{key}.xml"
    command = [sys.executable, "-m", "pytest", "-m", marks, "-n", str(workers)]
    command += ["--dist", "loadgroup", "-rfEs", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", *extra]
    say(f"{name} on {brokers}: {' '.join(command[1:])}")
    started = time.monotonic()
    # The output goes through as it comes: a 15-minute tier must show that it is alive.
    env = {**os.environ, "EOSFLOW_KAFKA_BROKERS": brokers}
    status = subprocess.call(command, cwd=ROOT, env=env)
    tier = read_junit(report, name, status, time.monotonic() - started)
    say(f"{name}: {tier.verdict()}: {summary_counts(tier)} in {minutes(tier.seconds)}")
    for reason in tier.feature_skips:
        say(f"  skipped for a broker feature Apache Kafka has: {reason}")
    return tier


def probe(brokers: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "processor.cli", "probe"],
        cwd=ROOT,
        env={**os.environ, "EOSFLOW_KAFKA_BROKERS": brokers},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line.rstrip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return lines[:6]


def certify(brokers: str, work: Path) -> str:
    """``eosflow certify`` of the running total into a transactional Kafka sink: its verdict."""
    env = {**os.environ, "EOSFLOW_KAFKA_BROKERS": brokers, "OUTPUT_TOPIC": f"totals-{os.getpid()}"}
    clicks = work / "clicks.jsonl"
    subprocess.run(
        [sys.executable, "examples/clicks.py", "--jsonl", str(clicks), "--records", "20000"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    say("certify examples/running_total.py (transactional Kafka sink, 20,000 records)")
    started = time.monotonic()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "processor.cli", "certify", "examples/running_total.py"),
            *("--input", f"clicks={clicks}", "--input-key", "user"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (work / "certify.log").write_text(done.stdout + done.stderr)
    verdict_line = re.compile(r"\s*(PASS|FAIL|ERROR|NONDETERMINISTIC):")
    output = (done.stdout + done.stderr).splitlines()
    verdicts = [line.strip()[:160] for line in output if verdict_line.match(line)]
    verdict = verdicts[-1] if verdicts else f"FAIL (exit {done.returncode}, no verdict)"
    if done.returncode != 0 and verdict.startswith("PASS"):
        verdict = f"FAIL (exit {done.returncode}) after {verdict}"
    return f"{verdict} ({time.monotonic() - started:.0f} s)"


def summary_counts(tier: Tier) -> str:
    text = f"{tier.passed} passed, {tier.failed} failed, {tier.skipped} skipped"
    return text + (f", {tier.errors} errors" if tier.errors else "")


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def head_commit() -> str:
    """The commit the tests run at (read at the start: the tree may move during a long run)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    return (done.stdout.strip() or "unknown commit") + (" with local changes" if dirty else "")


def write_summary(
    results: list[BrokerResult], workers: int, out: Path, commit: str, started: datetime
) -> str:
    stamp = started.strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"### {stamp}, `{commit}`, {os.cpu_count()} cores, `-n {workers}`",
        "",
        "| broker | tier | result | passed | failed | skipped | time |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        if result.error:
            lines.append(f"| {result.label} | - | **not run**: {result.error} | | | | |")
        for tier in result.tiers:
            lines.append(
                f"| {result.label} | {tier.name} | {'**' + tier.verdict() + '**'} | "
                f"{tier.passed} | {tier.failed + tier.errors} | {tier.skipped} | "
                f"{minutes(tier.seconds)} |"
            )
        if result.certify is not None:
            lines.append(
                f"| {result.label} | certify `running_total.py` → transactional `KafkaSink` "
                f"| {result.certify} | | | | |"
            )
    for result in results:
        lines += ["", f"**{result.label}** (`{result.brokers}`)"]
        if result.probe:
            lines += ["", "```console", "$ eosflow probe", *result.probe, "```"]
        for tier in result.tiers:
            if tier.failures:
                lines += ["", f"{tier.name}, failed:", *[f"- `{t}`" for t in tier.failures]]
            if tier.skips:
                lines += ["", f"{tier.name}, skipped (tests: reason):"]
                lines += [f"- {n}: {reason}" for reason, n in sorted(tier.skips.items())]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def say(message: str) -> None:
    print(f"== release-check: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dist",
        type=Path,
        default=Path(os.environ.get("EOSFLOW_KAFKA_DIST", ROOT.parent / "shared" / "kafka")),
        help="the folder of Apache Kafka distributions, one sub-folder per version with "
        "start.sh/stop.sh (default: ../shared/kafka beside the repository, or "
        "EOSFLOW_KAFKA_DIST)",
    )
    parser.add_argument(
        "--kafka",
        default="4.3.1,2.3.0",
        help="versions to start from --dist, comma-separated (default 4.3.1,2.3.0)",
    )
    parser.add_argument(
        "--brokers",
        action="append",
        default=[],
        metavar="LABEL=HOST:PORT",
        help="a running broker to check instead of starting any (repeatable)",
    )
    parser.add_argument("--tiers", default="command2,crash", help="command2, crash or both")
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (4)")
    parser.add_argument("--no-certify", action="store_true", help="skip eosflow certify")
    parser.add_argument(
        "--out", type=Path, default=Path("release-check.md"), help="the summary (Markdown)"
    )
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)

    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if unknown := [t for t in tiers if t not in TIERS]:
        parser.error(f"unknown tier(s) {unknown}: choose from {sorted(TIERS)}")
    if args.brokers:
        targets = [tuple(b.split("=", 1)) if "=" in b else (b, b) for b in args.brokers]
    else:
        versions = [v.strip() for v in args.kafka.split(",") if v.strip()]
        missing = [v for v in versions if not (args.dist / v / "start.sh").exists()]
        if missing:
            say(
                f"no Apache Kafka {', '.join(missing)} in {args.dist} (a folder per version "
                "with start.sh, as ../shared/kafka holds): name running brokers with "
                "--brokers LABEL=HOST:PORT, or the folder with --dist"
            )
            return 2
        targets = [(f"Apache Kafka {v}", v) for v in versions]

    commit, started = head_commit(), datetime.now(timezone.utc)
    work = Path(tempfile.mkdtemp(prefix="eosflow-release-check-"))
    say(f"logs and reports in {work}")
    results: list[BrokerResult] = []
    for label, target in targets:
        with contextlib.ExitStack() as stack:
            result = BrokerResult(label, target)
            results.append(result)
            if not args.brokers:
                try:
                    result.brokers = stack.enter_context(
                        kafka_from_dist(args.dist, target, work / f"kafka-{target}.log")
                    )
                except RuntimeError as exc:
                    result.error = str(exc)
                    say(f"{label}: {exc}")
                    continue
            result.probe = probe(result.brokers)
            print("\n".join(result.probe), flush=True)
            for key in tiers:
                tier_dir = work / re.sub(r"\W+", "-", label) / key
                tier_dir.mkdir(parents=True, exist_ok=True)
                result.tiers.append(
                    run_tier(key, result.brokers, args.workers, tier_dir, args.pytest_args)
                )
            if not args.no_certify:
                result.certify = certify(result.brokers, work)
                say(f"certify: {result.certify}")

    text = write_summary(results, args.workers, args.out, commit, started)
    print(text, flush=True)
    say(f"summary written to {args.out}")
    if any(r.error for r in results):
        return 2
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
