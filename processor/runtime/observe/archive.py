"""The job page of a run that is over: what the runner leaves behind and how it is read back
(``eosflow status --web JOB``; docs/observability.md, "After the run").

While it runs, the runner writes its last ``/api/job`` document beside ``status.json``
(:data:`PAGE_FILE`, at every status write: a runner killed by SIGKILL leaves the one of its
last seconds). :func:`read_page` rebuilds the page's document from it, ``status.json`` and the
checkpoints the job's snapshot store still holds (retained manifests the run's in-memory
history never saw, from earlier runs, are added to its history), marked ``archived``. The
server is the runner's own (:class:`~processor.runtime.observe.webui.WebServer`), read-only.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from processor.snapshot.store import SnapshotStore

__all__ = ["PAGE_FILE", "read_page", "write_page"]

log = logging.getLogger(__name__)

#: The last ``/api/job`` document of the job's latest run, beside its ``status.json``.
PAGE_FILE = "job-page.json"


def write_page(run_dir: Path, api: dict[str, Any]) -> None:
    """Writes ``api`` (the runner's ``/api/job`` document) atomically to ``run_dir``."""
    if not api:
        return
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".job-page-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(api, f, default=str)
        os.replace(tmp, run_dir / PAGE_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _from_status(status: dict[str, Any]) -> dict[str, Any]:
    """A page document from ``status.json`` alone (a run of an eosflow without the page file,
    or a runner that died before its first status write)."""
    causes = status.get("restart_causes") or []
    return {
        **{k: status.get(k) for k in ("job", "generation", "restarts", "uptime_s", "mode")},
        "runner": status.get("runner"),
        "updated_ms": status.get("updated_ms"),
        "workers": status.get("workers", []),
        "graph": {"stages": [], "edges": []},
        "steps": {},
        "records": {"in": status.get("records_in"), "out": status.get("records_out")},
        "checkpoints": {**status.get("checkpoint", {}), "history": []},
        "restarts_list": [{"at_ms": None, "cause": c, "kind": "?"} for c in causes],
        "lag": {"sources": [], "channels": []},
        "dead_letters": {"total": status.get("dead_letters", 0), "recent": []},
        "watermarks": status.get("watermarks"),
    }


def _retained(job: str, snapshot_url: str) -> list[dict[str, Any]]:
    """The completed checkpoints the snapshot store holds, as history entries."""
    store = SnapshotStore(snapshot_url)
    entries = []
    for cid in store.completed_ids(job):
        try:
            m = store.load(job, cid)
        except Exception as exc:  # a damaged manifest: the page shows the others
            log.warning("checkpoint_id=%d manifest not read: %s", cid, exc)
            continue
        entries.append(
            {
                "id": cid,
                "status": "completed",
                "reason": None,
                "kind": None,
                "at_ms": m.created_ms,
                "duration_s": None,
                "alignment_s": None,
                "size_bytes": sum(h.size for h in m.tasks.values()),
                "retained": True,
            }
        )
    return entries


def read_page(job_dir: Path, *, alive: bool, snapshot_url: str | None = None) -> dict[str, Any]:
    """The job page's document of the job whose files are in ``job_dir`` (its
    ``status.json``, :data:`PAGE_FILE`), with the checkpoints of its snapshot store
    (``snapshot_url``, default: the one ``status.json`` names).

    Raises:
        FileNotFoundError: ``job_dir`` has no ``status.json``.
    """
    status_path = job_dir / "status.json"
    status: dict[str, Any] = json.loads(status_path.read_text())
    page_path = job_dir / PAGE_FILE
    page: dict[str, Any]
    try:
        page = json.loads(page_path.read_text())
    except (FileNotFoundError, ValueError):
        page = _from_status(status)
    state = status.get("state", page.get("state"))
    if state == "running" and not alive:
        state = "died"  # its runner is gone without saying so: killed, or its host lost
    page["state"] = state
    history: list[dict[str, Any]] = list(page.get("checkpoints", {}).get("history") or [])
    url = snapshot_url or status.get("snapshot_url")
    retained: list[int] = []
    store_error = None
    if url:
        try:
            kept = _retained(str(page.get("job") or job_dir.name), url)
        except Exception as exc:  # the page still shows the run's own history
            store_error = f"{type(exc).__name__}: {exc}"
            kept = []
        retained = [e["id"] for e in kept]
        seen = {e.get("id") for e in history}
        for e in history:
            if e.get("id") in retained:
                e["retained"] = True
        history += [e for e in kept if e["id"] not in seen]
        history.sort(key=lambda e: (e.get("id") or 0, e.get("at_ms") or 0))
    page.setdefault("checkpoints", {})["history"] = history
    page["archived"] = {
        "status_file": str(status_path),
        "page_file": str(page_path) if page_path.exists() else None,
        "written_ms": page.get("updated_ms"),
        "snapshot_url": url,
        "retained_checkpoints": retained,
        "store_error": store_error,
    }
    return page
