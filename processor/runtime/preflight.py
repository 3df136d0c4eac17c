"""Start-up checks: what a job needs is checked once, before any worker starts, so that a
bad configuration fails with a message instead of a restart loop."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from processor.compiler import Plan
from processor.contracts import preflight_sink
from processor.errors import ConfigError
from processor.runtime.job import RunOptions

__all__ = ["extra_environ", "preflight"]

log = logging.getLogger(__name__)


def preflight(plan: Plan, options: RunOptions, interval: float | None) -> None:
    """Sinks check their configuration; local recovery checks its Redis."""
    flow = plan.flow
    sinks = [s.params["sink"] for s in flow.steps.values() if s.kind == "sink"]
    if flow.dead_letter_sink is not None:
        sinks.append(flow.dead_letter_sink)
    else:
        log.warning(
            "job=%s has no dead-letter destination: records that fail to decode are "
            "counted, logged and skipped, and a user function that raises fails the job; "
            "give Dataflow(..., dead_letters=<sink>) to keep them",
            plan.job,
        )
    with extra_environ(options.environ):
        for sink in sinks:
            preflight_sink(
                sink,
                job=plan.job,
                checkpoint_interval=interval,
                checkpoint_timeout=options.checkpoint_timeout if interval is not None else None,
            )
        if options.recovery == "local":
            _preflight_redis()


def _preflight_redis() -> None:
    """Local recovery keeps the IDs of channel records in Redis: reachable, or fail now."""
    from dedup.store import redis_client  # the engine's one other reach into dedup/

    client = redis_client(None, timeout_s=5.0, name="eosflow-preflight")
    try:
        client.ping()
    except Exception as exc:
        raise ConfigError(
            f"--recovery local keeps record IDs in Redis, which did not answer at "
            f"EOSFLOW_REDIS_URL ({type(exc).__name__}: {exc}). Start Redis there (eosflow dev up "
            "starts one on loopback), or use --recovery global"
        ) from None
    finally:
        client.close()


@contextlib.contextmanager
def extra_environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` while the pipeline file is loaded in this process."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
