"""The Grafana dashboard, and the Prometheus and Grafana services of docker/compose.yaml.

Nothing here starts a container: the files are read and checked against each other and against
the metrics eosflow exports, so that a renamed metric, a panel on a series nobody exports or a
scrape target that names the wrong service fails here rather than as an empty dashboard.

PyYAML is not a dependency, so the YAML files are read as text, by helpers that understand only
the subset these files use: block mappings indented by two spaces, block sequences indented
under their key, flow sequences on one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.observe.metrics import LABEL, METRICS

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "eosflow.json"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
DATASOURCE = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDER = DOCKER / "grafana" / "provisioning" / "dashboards" / "eosflow.yaml"

JOB_MATCHER = f'{LABEL}="${LABEL}"'
GRID_WIDTH = 24


# --- what eosflow exports ---------------------------------------------------------------------


#: Metric name -> (type, every label, the job's included), from the runner's catalogue.
EXPORTED = {
    name: (kind, frozenset((LABEL, *labels))) for name, (kind, _help, labels) in METRICS.items()
}


def _series() -> dict[str, str]:
    """Each series name Prometheus stores -> the exported metric it belongs to.

    A counter is stored as ``<name>_total`` (whether or not the catalogue's name has the suffix),
    a histogram as ``_bucket``, ``_sum`` and ``_count``, a gauge under its own name. Mapping the
    series rather than stripping suffixes keeps ``eosflow_checkpoints_completed_total`` from
    passing as a gauge, or a gauge from being read as a counter.
    """
    series: dict[str, str] = {}
    for name, (kind, _labels) in EXPORTED.items():
        if kind == "counter":
            series[name.removesuffix("_total") + "_total"] = name
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                series[name + suffix] = name
        else:
            series[name] = name
    return series


SERIES = _series()


# --- the dashboard ----------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _panels() -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    panels = []
    for panel in _dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def _queries() -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    return [
        (panel["title"], target)
        for panel in _panels()
        if panel["type"] != "row"
        for target in panel.get("targets", [])
    ]


def _metric_names(expr: str) -> list[tuple[str, int]]:
    """Series names an expression selects, with their offsets in it.

    Label matchers (``{eosflow_job="..."}``) and grouping clauses (``by (...)``) are blanked first
    (keeping offsets), so that a label called ``eosflow_job`` is not taken for a metric.
    """
    blank = re.sub(r"\{[^}]*\}", lambda m: " " * len(m[0]), expr)
    blank = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
        lambda m: " " * len(m[0]),
        blank,
    )
    return [(m[0], m.start()) for m in re.finditer(r"(?<![\w$])eosflow_\w+", blank)]


def _provisioned_datasource_uid() -> str:
    uids: list[str] = re.findall(r"^\s*uid:\s*(\S+)\s*$", DATASOURCE.read_text(), re.M)
    assert len(uids) == 1, f"{DATASOURCE}: expected one datasource uid, got {uids}"
    return uids[0]


def test_dashboard_panels_have_a_datasource_and_queries_when_loaded() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "eosflow"
    assert 36 <= dashboard["schemaVersion"] <= 41
    uid = _provisioned_datasource_uid()
    panels = [panel for panel in _panels() if panel["type"] != "row"]
    assert panels
    for panel in panels:
        where = f"panel {panel.get('title')!r}"
        assert panel.get("title"), f"{where}: no title"
        assert panel.get("datasource") == {"type": "prometheus", "uid": uid}, where
        targets = panel.get("targets")
        assert targets, f"{where}: no queries"
        ref_ids = [target["refId"] for target in targets]
        assert len(set(ref_ids)) == len(ref_ids), f"{where}: refIds {ref_ids} repeat"
        for target in targets:
            assert target.get("expr", "").strip(), f"{where}: query {target['refId']} is empty"
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], where


def test_panel_ids_are_unique_and_grid_positions_do_not_overlap() -> None:
    panels = _panels()
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids), f"panel ids repeat: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for panel in _dashboard()["panels"]:  # nested (collapsed) panels are laid out on expanding
        pos = panel["gridPos"]
        x, y, w, h = pos["x"], pos["y"], pos["w"], pos["h"]
        assert w > 0 and h > 0 and x >= 0 and y >= 0, f"{panel['title']!r}: gridPos {pos}"
        assert x + w <= GRID_WIDTH, f"{panel['title']!r} is wider than the grid: {pos}"
        if panel["type"] == "row":
            assert (x, w, h) == (0, GRID_WIDTH, 1), f"row {panel['title']!r}: gridPos {pos}"
        for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
            assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r} at {cell}"
            cells[cell] = panel["title"]


def test_job_variable_lists_the_jobs_that_export_job_info() -> None:
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    job = variables["eosflow_job"]
    assert job["type"] == "query"
    assert job["datasource"]["uid"] == _provisioned_datasource_uid()
    query = job["query"] if isinstance(job["query"], str) else job["query"]["query"]
    assert re.sub(r"\s", "", query) == "label_values(eosflow_job_info,eosflow_job)"
    assert "eosflow_job_info" in EXPORTED


def test_every_query_selects_the_chosen_job() -> None:
    for title, target in _queries():
        expr = target["expr"]
        names = _metric_names(expr)
        assert names, f"{title!r}: {expr!r} selects no eosflow metric"
        for name, start in names:
            matchers = re.match(r"\{([^}]*)\}", expr[start + len(name) :])
            assert matchers and JOB_MATCHER in matchers[1], (
                f"{title!r}: {name} in {expr!r} is not restricted to {JOB_MATCHER}"
            )


def test_queries_name_only_metrics_eosflow_exports() -> None:
    for title, target in _queries():
        for name, _start in _metric_names(target["expr"]):
            assert name in SERIES, (
                f"{title!r}: {name} is not a series of any metric eosflow exports "
                f"({target['expr']!r})"
            )


def test_every_exported_metric_is_on_a_panel() -> None:
    shown = {
        SERIES[name]
        for _title, target in _queries()
        for name, _start in _metric_names(target["expr"])
        if name in SERIES
    }
    assert set(EXPORTED) - shown == set(), "exported metrics that no panel shows"


def test_counters_are_rated_and_histograms_are_read_through_their_buckets() -> None:
    """Counters only inside rate()/irate()/increase() over a range, histogram buckets only in
    histogram_quantile(q, sum by (le, ...) (rate(x_bucket[...]))), gauges never rated."""
    for title, target in _queries():
        expr = target["expr"]
        for name, start in _metric_names(expr):
            family = SERIES.get(name)
            if family is None:
                continue  # reported by test_queries_name_only_metrics_eosflow_exports
            kind = EXPORTED[family][0]
            before, after = expr[:start], expr[start + len(name) :]
            rated = re.search(r"\b(?:rate|irate|increase)\(\s*$", before)
            ranged = re.match(r"\{[^}]*\}\[[^\]]+\]\s*\)", after)
            where = f"{title!r}: {name} in {expr!r}"
            if kind == "gauge":
                assert not rated, f"{where}: a gauge is read raw, not rated"
                continue
            assert rated and ranged, f"{where}: a {kind} series must be rated over a range"
            if name.endswith("_bucket"):
                assert re.search(
                    r"histogram_quantile\(\s*0?\.\d+\s*,"
                    r"\s*sum by \(\s*le\b[^)]*\)\s*\(\s*rate\(\s*$",
                    before,
                ), f"{where}: expected histogram_quantile(q, sum by (le) (rate(x_bucket[...])))"


def test_grouping_and_legend_labels_are_labels_of_the_queried_metrics() -> None:
    for title, target in _queries():
        expr = target["expr"]
        labels: set[str] = set()
        for name, _start in _metric_names(expr):
            if name in SERIES:
                labels |= EXPORTED[SERIES[name]][1]
                if name.endswith("_bucket"):
                    labels.add("le")
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            grouped = {label.strip() for label in clause.split(",") if label.strip()}
            assert grouped <= labels, f"{title!r}: {expr!r} groups by {grouped - labels}"
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= labels, f"{title!r}: legend names {legend - labels}, not labels"


# --- docker/compose.yaml, prometheus.yml, Grafana provisioning -------------------------------


def _services() -> dict[str, list[str]]:
    """Each service's lines (indented under it, comments dropped), by service name."""
    services: dict[str, list[str]] = {}
    current: str | None = None
    inside = False
    for line in COMPOSE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line.startswith(" "):
            inside, current = line.rstrip() == "services:", None
            continue
        if inside:
            if match := re.fullmatch(r" {2}([\w.-]+):\s*", line):
                current = match[1]
                services[current] = []
            elif current is not None:
                services[current].append(line)
    return services


def _block(lines: list[str], key: str, indent: int = 4) -> list[str]:
    """The stripped lines of ``key:``'s block value, ``key`` indented by ``indent`` spaces."""
    found: list[str] | None = None
    for line in lines:
        depth = len(line) - len(line.lstrip())
        if found is None:
            if depth == indent and line.strip() == f"{key}:":
                found = []
        elif depth > indent:
            found.append(line.strip())
        else:
            break
    return found or []


def _items(block: list[str]) -> list[str]:
    """A block sequence's scalar items, unquoted."""
    return [line[2:].strip().strip("\"'") for line in block if line.startswith("- ")]


def _value(lines: list[str], key: str, indent: int = 4) -> str | None:
    for line in lines:
        if match := re.fullmatch(rf" {{{indent}}}{re.escape(key)}:\s*(.+?)\s*", line):
            return match[1].strip("\"'")
    return None


def _anchor_env() -> dict[str, str]:
    """The ``x-eosflow-env`` anchor's variables."""
    text = COMPOSE.read_text()
    block = re.search(r"^x-eosflow-env: &eosflow-env\n((?:(?: {2}.*)?\n)+)", text, re.M)
    assert block, f"{COMPOSE}: no x-eosflow-env anchor"
    return dict(re.findall(r'^ {2}(\w+):\s*"([^"]*)"', block[1], re.M))


def test_compose_publishes_every_port_on_loopback_only() -> None:
    text = COMPOSE.read_text()
    services = _services()
    assert {"app", "prometheus", "grafana"} <= set(services)
    # The long syntax and host networking would escape the check below.
    assert not re.search(r"^\s*(?:published|host_ip|network_mode):", text, re.M)
    published: dict[str, list[str]] = {
        name: _items(_block(lines, "ports")) for name, lines in services.items()
    }
    found = sum(len(_block(lines, "ports")) > 0 for lines in services.values())
    assert found == len(re.findall(r"^\s*ports:", text, re.M)), "a ports: block was not read"
    header = text.split("\nname:", 1)[0]
    for name, ports in published.items():
        for port in ports:
            match = re.fullmatch(r"127\.0\.0\.1:(\d+):(\d+)", port)
            assert match, f"service {name}: port {port!r} is not bound to 127.0.0.1"
            assert f":{match[1]}" in header, f"host port {match[1]} missing from the header"
    assert published["prometheus"] == ["127.0.0.1:9090:9090"]
    assert published["grafana"] == ["127.0.0.1:3000:3000"]


def test_app_serves_metrics_on_every_interface_at_the_scraped_port() -> None:
    env = _anchor_env()
    assert env["EOSFLOW_METRICS"] == "0.0.0.0:9249"
    assert _value(_services()["app"], "environment") == "*eosflow-env"


def test_prometheus_scrapes_the_app_service_at_its_metrics_port() -> None:
    config = "\n".join(
        line for line in PROMETHEUS.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    targets = re.findall(r"^\s*- targets:\s*\[([^\]]*)\]\s*$", config, re.M)
    assert len(targets) == 1, f"{PROMETHEUS}: expected one targets list, got {targets}"
    listed = [target.strip().strip("\"'") for target in targets[0].split(",")]
    assert listed == ["app:9249"]
    assert set(re.findall(r"^\s*scrape_interval:\s*(\S+)", config, re.M)) == {"5s"}
    assert re.findall(r"^\s*metrics_path:\s*(\S+)", config, re.M) in ([], ["/metrics"])
    host, port = listed[0].split(":")
    services = _services()
    assert host in services, f"the scrape target names {host!r}, not a compose service"
    assert _anchor_env()["EOSFLOW_METRICS"].rsplit(":", 1)[1] == port
    prometheus = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", _value(prometheus, "image") or "")
    config_file = "/etc/prometheus/prometheus.yml"
    assert f"./prometheus/prometheus.yml:{config_file}:ro" in _items(_block(prometheus, "volumes"))
    assert f"--config.file={config_file}" in _items(_block(prometheus, "command"))


def test_grafana_provisions_the_compose_prometheus_and_the_dashboard() -> None:
    services = _services()
    grafana = services["grafana"]
    assert re.fullmatch(r"grafana/grafana-oss:\d+\.\d+\.\d+", _value(grafana, "image") or "")
    env = dict(
        (key.strip(), value.strip().strip("\"'"))
        for key, value in (line.split(":", 1) for line in _block(grafana, "environment"))
    )
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"

    urls = re.findall(r"^\s*url:\s*(\S+)\s*$", DATASOURCE.read_text(), re.M)
    assert urls == ["http://prometheus:9090"]
    assert "127.0.0.1:9090:9090" in _items(_block(services["prometheus"], "ports"))

    mounts = dict(
        item.split(":", 2)[:2] for item in _items(_block(grafana, "volumes"))
    )  # source -> target
    for source in mounts:
        assert (DOCKER / source).exists(), f"grafana mounts {source}, which does not exist"
    provisioning = "/etc/grafana/provisioning"
    assert mounts["./grafana/provisioning/datasources"] == f"{provisioning}/datasources"
    assert mounts["./grafana/provisioning/dashboards"] == f"{provisioning}/dashboards"
    paths = re.findall(r"^\s*path:\s*(\S+)\s*$", PROVIDER.read_text(), re.M)
    assert paths == [mounts["./grafana/dashboards"]], "the provider does not read the dashboards"
    assert DASHBOARD.parent == DOCKER / "grafana" / "dashboards"
    home = env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home in (None, f"{mounts['./grafana/dashboards']}/{DASHBOARD.name}")


@pytest.mark.parametrize("path", [COMPOSE, PROMETHEUS, DATASOURCE, PROVIDER])
def test_yaml_files_are_indented_with_spaces_when_read_as_text(path: Path) -> None:
    """The helpers above read two-space block YAML; a tab would make them miss a block."""
    assert "\t" not in path.read_text(), f"{path} has a tab"
