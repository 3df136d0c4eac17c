"""Connected components of a stream of graph edges, by label propagation in a loop.

The pipeline (what ``eosflow run`` executes)::

    edges (Kafka, JSON {"u", "v", "ts_ms"}) -> both ends -> iterate "propagate":
        key by node -> node state (label, neighbours) -> label messages to the neighbours ─┐
             ▲                                          (the loop's feedback, back-edge)  │
             └────────────────────────────────────────────────────────────────────────────┘
        and every label change -> part files

Every node starts with its own id as its label; a node that learns a smaller label adopts it and
tells its neighbours, and a new edge tells each end the other's label. When nothing is left in
the loop, every node's label is the smallest node id of its component. The output is a changelog
``[node, label]``, one line per label change; per node the labels only decrease, so a line that
appears twice was committed twice.

The reference answer is computed without the engine (union-find over the same edges):
``python examples/connected_components.py`` writes the edges, runs the job until idle, and checks
that every node's last label is its component's minimum and that no line is duplicated::

    python examples/connected_components.py [--edges 30000] [--nodes 50000] [--workers 2]

Or run the pipeline on its own against an existing topic::

    EDGES_TOPIC=edges OUTPUT_DIR=out/cc eosflow run examples/connected_components.py --until-idle
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator
from typing import Any

from connectors import JsonSerde
from processor import Dataflow, Stream
from sinks import FileSink


def absorb(state: dict[str, Any] | None, msg: dict[str, int]) -> dict[str, Any]:
    """One message to a node: ``{"node", "edge"}`` (a new neighbour) or ``{"node", "label"}``
    (a neighbour's label). The state keeps the label and the neighbours, and says which
    messages to send (``send``) and whether the label changed."""
    node = msg["node"]
    if state is None:
        label, adj, changed = node, [], True
    else:
        label, adj, changed = state["label"], state["adj"], False
    send: list[dict[str, int]] = []
    if "edge" in msg:
        other = msg["edge"]
        if other not in adj:
            adj = [*adj, other]
        send.append({"node": other, "label": label})
    elif msg["label"] < label:
        label, changed = msg["label"], True
        send = [{"node": a, "label": label} for a in adj]
    return {"label": label, "adj": adj, "send": send, "changed": changed}


def propagate(loop: Stream) -> tuple[Stream, Stream]:
    """The loop body: returns (messages fed back, label changes)."""
    nodes = loop.key_by("by-node", lambda m: m["node"]).aggregate(
        "node-state", init=lambda: None, add=absorb
    )
    messages = nodes.flat_map("tell-neighbours", lambda s: s["send"])
    labels = nodes.filter("label-changed", lambda s: s["changed"]).map(
        "label", lambda s: s["label"]
    )
    return messages, labels


flow = Dataflow(os.environ.get("JOB_NAME", "connected-components"))
(
    flow.source(
        "edges",
        os.environ.get("EDGES_TOPIC", "edges"),
        serde=JsonSerde(),
        timestamp=lambda e: e["ts_ms"],
    )
    .flat_map(
        "both-ends",
        lambda e: [{"node": e["u"], "edge": e["v"]}, {"node": e["v"], "edge": e["u"]}],
    )
    .iterate("propagate", propagate)
    .sink("labels", FileSink(os.environ.get("OUTPUT_DIR", "out/connected-components")))
)


# -- the input and the reference answer (no engine involved) --------------------------------------


def graph_edges(edges: int, *, nodes: int, seed: int = 7) -> Iterator[dict[str, int]]:
    """``edges`` random edges over ``nodes`` nodes (no self-loops); the same arguments always
    give the same edges. Near ``edges = nodes / 2`` the random graph has one large component
    with long paths and many small ones: labels travel far around the loop."""
    rng = random.Random(seed)
    base_ms = 1_700_000_000_000
    for i in range(edges):
        u = rng.randrange(nodes)
        v = rng.randrange(nodes - 1)
        yield {"u": u, "v": v if v < u else v + 1, "ts_ms": base_ms + i * 10}


def reference_labels(edges: Iterable[dict[str, int]]) -> dict[int, int]:
    """Every node that has an edge -> the smallest node id of its component (union-find)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in edges:
        a, b = find(e["u"]), find(e["v"])
        if a != b:
            parent[max(a, b)] = min(a, b)  # the root is always the component's minimum
    return {node: find(node) for node in parent}


def check_labels(lines: Iterable[list[int]], want: dict[int, int]) -> list[str]:
    """Problems of the committed changelog ``[node, label]`` against ``want`` (empty: none)."""
    seen: set[tuple[int, int]] = set()
    final: dict[int, int] = {}
    problems: list[str] = []
    for node, label in lines:
        if (node, label) in seen:
            problems.append(f"line [{node}, {label}] committed twice")
        seen.add((node, label))
        final[node] = min(label, final.get(node, label))
    wrong = [n for n in want if final.get(n) != want[n]]
    extra = sorted(set(final) - set(want))
    problems += [f"node {n}: label {final.get(n)}, want {want[n]}" for n in wrong[:10]]
    if len(wrong) > 10:
        problems.append(f"... {len(wrong)} nodes with a wrong or missing label")
    problems += [f"node {n} is in no edge but has a label" for n in extra[:10]]
    return problems


def main() -> None:
    from clicks import example_parser, finish, produce_json, run_until_idle

    from sinks import read_jsonl

    parser = example_parser("connected components")
    parser.add_argument("--edges", type=int, default=30_000)
    parser.add_argument("--nodes", type=int, default=50_000)
    args = parser.parse_args()

    def produce(brokers: str, run_id: str) -> str:
        topic = os.environ["EDGES_TOPIC"] = f"edges-{run_id}"
        edges = graph_edges(args.edges, nodes=args.nodes)
        took = produce_json(brokers, topic, edges, key=lambda e: str(e["u"]), total=args.edges)
        return f"wrote {args.edges:,} edges to {topic} in {took:.1f}s"

    result = run_until_idle(__file__, args, "connected components", produce)
    lines = read_jsonl(os.environ["OUTPUT_DIR"])
    want = reference_labels(graph_edges(args.edges, nodes=args.nodes))
    logs = [n for _c, n, _s in result.loop_logs]
    print(
        f"connected components: {result.records_in:,} edges in {result.seconds:.1f}s, "
        f"{len(lines):,} label changes for {len(want):,} nodes in "
        f"{len(set(want.values())):,} components; {result.checkpoints} checkpoints, "
        f"back-edge log per checkpoint max {max(logs, default=0):,}, "
        f"mean {sum(logs) / max(1, len(logs)):,.0f} records"
    )
    problems = check_labels(lines, want)
    finish(
        args,
        problems,
        "OK: every node's label is the smallest node of its component, no line twice",
    )


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
