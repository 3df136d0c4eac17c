"""Summaries, Markdown tables and the plot of a throughput results file.

Re-render from a saved run (no broker needed)::

    python bench/report.py bench/results/throughput-<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

__all__ = ["markdown", "plot", "summarise"]

MODES = ("aligned", "unaligned", "sync")
COLOURS = {"aligned": "tab:blue", "unaligned": "tab:green", "sync": "tab:red"}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Medians per pipeline and configuration, ratios against "off" and the ceiling."""
    summary: dict[str, Any] = {"pipelines": {}}
    ceiling = {
        n: _median([c["records_per_s"] for c in results["ceiling"] if c["processes"] == n])
        for n in sorted({c["processes"] for c in results["ceiling"]})
    }
    summary["ceiling"] = ceiling
    for pipeline in results["pipelines"]:
        runs = [r for r in results["runs"] if r["pipeline"] == pipeline]
        off = _median([r["records_per_s"] for r in runs if r["mode"] == "none"])
        rows = []
        order = {"none": 0, "aligned": 1, "unaligned": 2, "sync": 3}
        keys = {(r["mode"], r["interval_s"] or 0.0) for r in runs}
        for key in sorted(keys, key=lambda k: (order.get(k[0], 9), k[1])):
            mode, interval = key
            these = [r for r in runs if (r["mode"], r["interval_s"] or 0.0) == key]
            rate = _median([r["records_per_s"] for r in these])
            chk = [r["checkpoint_ms_median"] for r in these if r["checkpoint_ms_median"]]
            p95 = [r["checkpoint_ms_p95"] for r in these if r["checkpoint_ms_p95"]]
            rows.append(
                {
                    "mode": mode,
                    "interval_s": interval if mode != "none" else None,
                    "records_per_s": rate,
                    "samples": [round(r["records_per_s"]) for r in these],
                    "vs_off": rate / off if rate and off else None,
                    "checkpoints": _median([r["checkpoints"] for r in these]),
                    "checkpoint_ms_median": _median(chk),
                    "checkpoint_ms_p95": _median(p95),
                    "workers_cpu_per_wall": _median(
                        [r["workers_cpu_s"] / r["seconds"] for r in these if r["seconds"]]
                    ),
                    "workers_cpu_us_per_record": _median(
                        [1e6 * r["workers_cpu_s"] / r["records"] for r in these]
                    ),
                    "broker_cpu_us_per_record": _median(
                        [1e6 * r["broker_cpu_s"] / r["records"] for r in these]
                    ),
                    "ready_s": _median([r["ready_s"] for r in these]),
                    "output_bad": sum(not r.get("output_ok", True) for r in these),
                }
            )
        summary["pipelines"][pipeline] = {"off": off, "rows": rows}
    best = max((c for c in ceiling.values() if c), default=None)
    keyed = summary["pipelines"].get("keyed_count")
    if keyed and best:
        summary["eosflow_vs_ceiling"] = {
            f"{r['mode']}@{r['interval_s']}": r["records_per_s"] / best
            for r in keyed["rows"]
            if r["records_per_s"]
        }
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict[str, Any], summary: dict[str, Any]) -> str:
    """The tables of RESULTS.md."""
    lines: list[str] = []
    ceiling = summary["ceiling"]
    best = max((c for c in ceiling.values() if c), default=None)
    for pipeline, data in summary["pipelines"].items():
        lines += [
            f"**{pipeline}** ({results['records'][pipeline]:,} records, "
            f"{results['workers']} workers)",
            "",
            "| mode | interval | records/s (median) | samples | vs off | vs ceiling "
            "| checkpoints | chk ms median / p95 | worker CPU µs/record | broker CPU µs/record "
            "| output |",
            "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in data["rows"]:
            interval = "-" if r["interval_s"] is None else f"{r['interval_s']:g} s"
            mode = "off (none)" if r["mode"] == "none" else r["mode"]
            n = len(r["samples"])
            output = "ok" if not r["output_bad"] else f"**incomplete in {r['output_bad']}/{n}**"
            vs_ceiling = (
                _fmt(r["records_per_s"] / best, ".2f")
                if best and pipeline == "keyed_count" and r["records_per_s"]
                else "-"
            )
            lines.append(
                f"| {mode} | {interval} | {_fmt(r['records_per_s'], ',.0f')} "
                f"| {', '.join(f'{s:,}' for s in r['samples'])} | {_fmt(r['vs_off'], '.2f')} "
                f"| {vs_ceiling} | {_fmt(r['checkpoints'], '.0f')} "
                f"| {_fmt(r['checkpoint_ms_median'], '.0f')} / "
                f"{_fmt(r['checkpoint_ms_p95'], '.0f')} "
                f"| {_fmt(r['workers_cpu_us_per_record'], '.1f')} "
                f"| {_fmt(r['broker_cpu_us_per_record'], '.1f')} "
                f"| {output} |"
            )
        lines.append("")
    if ceiling:
        lines += ["**Ceiling** (raw confluent-kafka loop, keyed-count job)", ""]
        lines += ["| processes | records/s (median) | samples |", "|---:|---:|---|"]
        for n, rate in ceiling.items():
            samples = [round(c["records_per_s"]) for c in results["ceiling"] if c["processes"] == n]
            lines.append(f"| {n} | {_fmt(rate, ',.0f')} | {', '.join(f'{s:,}' for s in samples)} |")
        lines.append("")
    if results.get("recovery"):
        lines += [
            "**Recovery** (keyed_count, aligned, 1 s checkpoints, SIGKILL one worker; seconds "
            "from the kill)",
            "",
            "| run | victim | detected | new generation connected | first new committed output "
            "| restored chk | exactly-once check |",
            "|---:|---:|---:|---:|---:|---:|---|",
        ]
        for i, r in enumerate(results["recovery"], 1):
            check = r.get("check") or r.get("error") or "-"
            lines.append(
                f"| {i} | {r.get('victim', '-')} | {_fmt(r.get('detect_s'), '.2f')} "
                f"| {_fmt(r.get('connected_s'), '.2f')} | {_fmt(r.get('first_output_s'), '.2f')} "
                f"| {r.get('restored_checkpoint', '-')} | {check} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    """records/s against checkpoint interval, one line per mode, one panel per pipeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    pipelines = list(summary["pipelines"])
    fig, axes = plt.subplots(1, len(pipelines), figsize=(6.5 * len(pipelines), 5.6), squeeze=False)
    for ax, pipeline in zip(axes[0], pipelines, strict=True):
        data = summary["pipelines"][pipeline]
        for mode in MODES:
            rows = [r for r in data["rows"] if r["mode"] == mode and r["records_per_s"]]
            if rows:
                xs = [r["interval_s"] for r in rows]
                ys = [r["records_per_s"] for r in rows]
                ax.plot(xs, ys, marker="o", color=COLOURS[mode], label=mode)
                bad = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r["output_bad"]]
                if bad:
                    ax.scatter(
                        [x for x, _ in bad],
                        [y for _, y in bad],
                        marker="x",
                        s=90,
                        color="black",
                        zorder=5,
                        label=f"{mode}: output incomplete (see RESULTS.md)",
                    )
        if data["off"]:
            ax.axhline(data["off"], color="black", linestyle="--", label="checkpointing off")
        if pipeline == "keyed_count":
            for n, rate in summary["ceiling"].items():
                if rate:
                    ax.axhline(
                        rate,
                        color="grey",
                        linestyle=":" if n == 1 else "-.",
                        label=f"ceiling, raw loop, {n} process{'es' if n > 1 else ''}",
                    )
        ax.set_xscale("log")
        ax.set_xticks([0.1, 0.5, 1, 5], labels=["0.1", "0.5", "1", "5"])
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y / 1000:,.0f}k"))
        ax.set_xlabel("checkpoint interval (s)")
        ax.set_ylabel("records/s (median, steady state)")
        ax.set_title(f"{pipeline}: {results['records'][pipeline]:,} clicks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.suptitle(
        f"eosflow throughput, {results['workers']} workers, local runner, embedded Tansu "
        f"({results['started']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--png", type=Path, default=None, help="default: next to the results")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    summary = summarise(results)
    print(markdown(results, summary))
    png = args.png or args.results.with_name("throughput.png")
    plot(results, summary, png)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
