"""The lakehouse sinks on object storage: the Delta table, the Iceberg warehouse and the job's
staging manifests on a real S3 API on loopback (moto's server, the fixture of
``tests/integration/s3_server.py``), reached by delta-rs's object store, pyiceberg's FileIO and
s3fs as in production. Read back with ``deltalake`` and a ``pyiceberg`` scan.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pyiceberg")

from processor.contracts import SinkContext  # noqa: E402
from processor.snapshot.store import SnapshotStore  # noqa: E402
from sinks.lake import DeltaSink, IcebergSink, read_delta, read_iceberg  # noqa: E402
from tests.integration.s3_server import ACCESS, S3Server, s3_server  # noqa: E402

__all__ = ["s3_server"]  # the fixture, imported to be used here

pytestmark = pytest.mark.integration

SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64()), ("shard", pa.string())])


def delta_options(server: S3Server) -> dict[str, str]:
    """delta-rs on moto: conditional PUT (``etag``) makes concurrent log writes safe."""
    return {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS["key"],
        "AWS_SECRET_ACCESS_KEY": ACCESS["secret"],
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
        "conditional_put": "etag",
    }


def iceberg_catalog(server: S3Server, bucket: str, tmp: Path) -> dict[str, str]:
    return {
        "type": "sql",
        "uri": f"sqlite:///{tmp}/catalog.db",
        "warehouse": f"s3://{bucket}/warehouse",
        "s3.endpoint": server.endpoint,
        "s3.access-key-id": ACCESS["key"],
        "s3.secret-access-key": ACCESS["secret"],
        "s3.region": "us-east-1",
    }


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The staging manifests go to ``s3://`` through s3fs, configured as AWS's SDKs are."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ACCESS["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an earlier test's server, on another port
    return s3_server


@pytest.mark.parametrize("fmt", ["delta", "iceberg"])
def test_lake_sink_on_s3_commits_each_epoch_once_when_committers_race_and_recover(
    fmt: str, s3_env: S3Server, tmp_path: Path
) -> None:
    bucket = s3_env.bucket()
    if fmt == "delta":
        uri = f"s3://{bucket}/tables/clicks"
        options = delta_options(s3_env)
        sink: Any = DeltaSink(uri, schema=SCHEMA, partition_by=["shard"], storage_options=options)

        def read() -> Any:
            return read_delta(uri, storage_options=options)
    else:
        catalog = iceberg_catalog(s3_env, bucket, tmp_path)
        sink = IcebergSink(
            "lake.clicks", catalog=catalog, schema=SCHEMA, partition_by=[("shard", "identity")]
        )

        def read() -> Any:
            return read_iceberg("lake.clicks", catalog=catalog)

    sink.preflight(job="s3-job", checkpoint_interval=1.0)

    def writer(subtask: int, generation: int = 1) -> Any:
        ctx = SinkContext(
            "s3-job", "out", subtask, 2, generation, snapshot_url=f"s3://{bucket}/snapshots"
        )
        return sink.open(ctx)

    ws = [writer(0), writer(1)]
    for w in ws:
        w.recover([])
    want: Counter[tuple[str, int]] = Counter()
    for chk in (1, 2):
        for s, w in enumerate(ws):
            rows = [{"user": f"u{s}", "n": chk * 100 + i, "shard": str(i % 3)} for i in range(50)]
            w.write(rows)
            want.update((r["user"], r["n"]) for r in rows)
    cs = [w.prepare(2) for w in ws]
    # Checkpoint 2 completes in generation 1 (a sink commits only completed checkpoints).
    store = SnapshotStore(f"s3://{bucket}/snapshots")
    handle = store.write_task_snapshot("s3-job", 2, "t.0", {"x": 1})
    store.complete("s3-job", 2, {"t.0": handle}, {"generation": 1})
    # A second committer (the next generation's recovery) commits first, inside the first
    # committer's commit: the first one's retry must find the epoch there.
    racer = writer(0, generation=2)
    original = ws[0].ops.commit
    raced: list[int] = []

    def commit_after_racer(files: list[Any], checkpoint_id: int) -> None:
        if not raced:
            raced.append(checkpoint_id)
            racer.commit(checkpoint_id, cs[0])
        original(files, checkpoint_id)

    ws[0].ops.commit = commit_after_racer
    ws[0].commit(2, cs[0])
    ws[1].commit(2, cs[1])
    assert raced == [2]
    got = Counter((r["user"], r["n"]) for r in read().to_pylist())
    assert got == want
    ws[0].commit(2, cs[0])  # again: a no-op
    assert Counter((r["user"], r["n"]) for r in read().to_pylist()) == want
    assert ws[0].staging.manifests() == []
