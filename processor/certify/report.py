"""A certify's report: per run, the faults injected, restarts, recovery times and what its
committed output looked like next to the reference; as text, JSON and JUnit XML.

Verdicts: ``PASS`` (every fault run committed the reference output, in each key's order where
the sink keeps it), ``FAIL`` (some run did not, or a fault run failed), ``NONDETERMINISTIC``
(the two fault-free runs differ: the output depends on more than the input, so no fault run
can be judged), ``ERROR`` (a fault-free run failed).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from processor.testing.compare import Output

__all__ = ["EXIT_CODES", "Report", "RunOutcome", "SinkCheck"]

#: The exit status of ``eosflow certify`` per verdict.
EXIT_CODES = {"PASS": 0, "FAIL": 1, "ERROR": 1, "NONDETERMINISTIC": 3}


@dataclass
class SinkCheck:
    """One sink of one run compared with the reference."""

    sink: str
    counts: dict[str, int]
    diff: str = ""  # the readable difference (empty when equal)
    order_keys: int = 0  # keys whose sequences were compared (ordered sinks)
    out_of_order: int = 0
    order_example: Any = None

    @property
    def ok(self) -> bool:
        return not self.diff and not self.out_of_order

    def describe(self) -> str:
        c = self.counts
        if self.diff:
            parts = [f"{c[k]:,} {k}" for k in ("missing", "duplicated", "unexpected") if c[k]]
            text = f"{self.sink}: {', '.join(parts)} (of {c['expected']:,})"
        else:
            text = f"{self.sink}: equal ({c['actual']:,} records"
            text += f", {self.order_keys:,} keys in order)" if self.order_keys else ")"
        if self.out_of_order:
            text += f"; {self.out_of_order:,} of {self.order_keys:,} keys out of order"
        return text


@dataclass
class RunOutcome:
    """One run of the pipeline."""

    name: str
    faults: str
    job: str = ""
    redis_db: int | None = None
    tables: list[str] = field(default_factory=list)
    restarts: int = 0
    causes: list[str] = field(default_factory=list)
    checkpoints: int = 0
    recovery_s: list[float] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)
    injected: int = 0
    seconds: float = 0.0
    error: str | None = None
    checks: list[SinkCheck] = field(default_factory=list)
    outputs: dict[str, list[Output]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)

    def fault_text(self) -> str:
        if self.fired or self.not_reached:
            total = len(self.fired) + len(self.not_reached)
            return f"SIGKILL at {len(self.fired)} of {total} protocol points"
        if self.faults.endswith("random SIGKILLs"):
            return f"{self.injected} of {self.faults}"
        if self.faults != "none" and not self.injected:
            return f"{self.faults} (not injected)"
        return self.faults

    def line(self) -> str:
        """The run as one progress line."""
        recovery = "/".join(f"{t:.1f}" for t in self.recovery_s) or "-"
        head = (
            f"run {self.name:>3}  {self.fault_text():<44} restarts={self.restarts:<2} "
            f"recovery_s={recovery:<14} {self.seconds:6.1f}s"
        )
        if self.error:
            return f"{head}  ERROR {self.error}"
        if self.name == "ref":
            counts = ", ".join(f"{n}: {len(o):,} records" for n, o in self.outputs.items())
            return f"{head}  reference ({counts})"
        return f"{head}  " + "; ".join(c.describe() for c in self.checks)


@dataclass
class Report:
    """Everything a certify found."""

    pipeline: str
    job: str
    seed: int
    runner: str
    workers: int
    servers: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[RunOutcome] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
    workdir: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.verdict, 1)

    def conclusion(self) -> str:
        fault_runs = [r for r in self.runs if r.name not in ("ref", "det")]
        ref = next((r for r in self.runs if r.name == "ref"), None)
        total = sum(len(o) for o in ref.outputs.values()) if ref else 0
        if self.verdict == "PASS":
            restarts = sum(r.restarts for r in fault_runs)
            return (
                f"PASS: all {len(fault_runs)} fault runs ({restarts} restarts in all) committed "
                f"exactly the reference output ({total:,} records)"
            )
        if self.verdict == "NONDETERMINISTIC":
            det = next(r for r in self.runs if r.name == "det")
            what = "; ".join(c.describe() for c in det.checks if not c.ok)
            return (
                "NONDETERMINISTIC: two runs without any fault committed different outputs "
                f"({what}). The pipeline's output depends on more than its input: random(), "
                "the wall clock, a lookup outside the pipeline, or the order in which records "
                "of one key arrive from different partitions (a running aggregate of a key "
                "spread over partitions; key the input topic by it, e.g. --input-key FIELD). "
                "Certify cannot tell a fault's damage from chance, so no fault run was judged. "
                "Make the functions depend on the records only (e.g. the event time instead "
                "of time.time()) and certify again"
            )
        if self.verdict == "ERROR":
            bad = next((r for r in self.runs if r.error), None)
            return f"ERROR: a run without faults failed: {bad.error if bad else '?'}"
        bad_runs = [r for r in fault_runs if not r.ok]
        text = (
            f"FAIL: {len(bad_runs)} of {len(fault_runs)} fault runs did not commit the "
            "reference output exactly once (see above). If a step writes somewhere outside "
            "the sinks (a file, a database, an HTTP call), a replay after a failure repeats "
            "it: only sinks commit with the checkpoint"
        )
        checks = [c for r in bad_runs for c in r.checks if not c.ok]
        if checks and all(
            not c.counts["duplicated"] and c.counts["missing"] == c.counts["unexpected"]
            for c in checks
        ):
            text += (
                ". Here no record was duplicated or lost in number: records have other values, "
                "which is what an output that depends on timing looks like (a running "
                "aggregate of a key whose records sit in several partitions sees them in "
                "another order after a restart); the two fault-free runs did not show it. "
                "Key the input by the aggregate's key (--input-key), or certify again to see "
                "whether it repeats"
            )
        return text

    def text(self) -> str:
        lines = [
            f"eosflow certify {self.pipeline}: job {self.job!r}, {self.runner} runner, "
            f"{self.workers} workers, seed {self.seed}",
            "servers: " + ", ".join(f"{k} {v}" for k, v in self.servers.items()),
        ]
        for topic, info in self.inputs.items():
            lines.append(
                f"input {topic}: {info['records']:,} records in {info['partitions']} "
                f"partitions from {info['from']}"
            )
        lines.append("")
        for run in self.runs:
            lines.append(run.line())
            if run.not_reached:
                lines.append(f"       protocol points not reached: {', '.join(run.not_reached)}")
            if run.fired:
                lines.append(f"       protocol points fired: {', '.join(run.fired)}")
            for check in run.checks:
                if check.diff:
                    lines.extend("       " + x for x in check.diff.splitlines())
                if check.order_example:
                    key, want, got = check.order_example
                    lines.append(f"       key {key}: expected {want}..., committed {got}...")
            for cause in run.causes[:3] if not run.ok else ():
                lines.append(f"       restart cause: {cause[:200]}")
        for kind, why in self.skipped.items():
            lines.append(f"not injected: {kind}: {why}")
        lines.extend(self.notes)
        if self.workdir:
            lines.append(f"runs' files (state, worker logs, file outputs): {self.workdir}")
        lines.append("")
        lines.append(self.conclusion())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for run in data["runs"]:
            run.pop("outputs", None)
        data["conclusion"] = self.conclusion()
        return data

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    def write_junit(self, path: Path) -> None:
        """One test suite, one test case per run (JUnit XML, as CI systems read it)."""
        failures = sum(1 for r in self.runs if not r.ok and not r.error)
        errors = sum(1 for r in self.runs if r.error)
        suite = ET.Element(
            "testsuite",
            name=f"eosflow certify {self.pipeline}",
            tests=str(len(self.runs)),
            failures=str(failures),
            errors=str(errors),
            time=f"{sum(r.seconds for r in self.runs):.2f}",
        )
        for run in self.runs:
            case = ET.SubElement(
                suite,
                "testcase",
                classname=f"certify.{self.job}",
                name=f"run {run.name}: {run.fault_text()}",
                time=f"{run.seconds:.2f}",
            )
            if run.error:
                ET.SubElement(case, "error", message=run.error[:200]).text = run.error
            elif not run.ok:
                text = "\n".join(c.describe() + "\n" + c.diff for c in run.checks if not c.ok)
                ET.SubElement(case, "failure", message=text.splitlines()[0][:200]).text = text
            ET.SubElement(case, "system-out").text = run.line()
        ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)
