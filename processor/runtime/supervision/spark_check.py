"""The Spark runner's first-task check: can the executors run the workers?

Before the first long-running barrier job, one short Spark job runs one task per task slot
(at least one per worker). Each task checks, in the executor's Python, what a worker needs
before it can do anything: the driver's Python version (major.minor), eosflow and its
dependencies importable, and the pipeline file loading with the job's environment into the
same plan as on the driver (same fingerprint). It returns what it found instead of raising, so
the driver gets one structured result per task and fails the run at once with a
:class:`~processor.errors.ConfigError` naming the one-line fix: set ``PYSPARK_PYTHON`` (or
``--conf spark.pyspark.python=PATH``) to a Python with eosflow, ship a packed virtualenv with
``--archives``, or forward a variable with ``--env NAME``.

Why this exists: on a standalone cluster the executors ran ``python3`` without eosflow, or
lacked a variable the pipeline reads; the barrier job failed, was restarted with backoff, and
the run ended after about 50 s with ``ModuleNotFoundError`` or ``KeyError`` and no hint of the
fix (issue 39).

:func:`probe` runs on the executors and must not need eosflow to be unpickled there: this
module is pickled by value (``cloudpickle.register_pickle_by_value``), and :func:`probe` only
imports eosflow inside its ``try``. The rest is the driver's side: :func:`check_executors`
and the pure message builders (:func:`results_message`, :func:`failure_message`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

__all__ = ["CHECK_TIMEOUT_S", "check_executors", "failure_message", "probe", "results_message"]

log = logging.getLogger(__name__)

_DOCS = "docs/spark.md, 'A packed virtual environment'"
#: Seconds the check waits for executors to run it (EOSFLOW_SPARK_CHECK_TIMEOUT overrides).
CHECK_TIMEOUT_S = 120.0


def _python_fix(version: str) -> str:
    return (
        f"set PYSPARK_PYTHON (or --conf spark.pyspark.python=PATH) to a Python {version} with "
        f"eosflow installed on every executor, or ship a packed venv with --archives ({_DOCS})"
    )


def _missing_variable(exc: BaseException | None) -> str | None:
    """The name in the first ``KeyError`` of ``exc``'s chain (``os.environ["NAME"]``)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):
            return exc.args[0]
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _digest(value: str | None) -> str | None:
    """A variable's value as the check compares it (not the value: it may be a secret)."""
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _recording_environ() -> Iterator[set[str]]:
    """``os.environ`` (and ``os.getenv``) recording the names read, while the pipeline loads:
    the names to forward when the plan differs from the driver's."""
    names: set[str] = set()
    real = os.environ

    class Reads(MutableMapping[str, str]):
        def __getitem__(self, key: str) -> str:
            names.add(key)
            return real[key]

        def __contains__(self, key: object) -> bool:
            if isinstance(key, str):
                names.add(key)
            return key in real

        def __setitem__(self, key: str, value: str) -> None:
            real[key] = value

        def __delitem__(self, key: str) -> None:
            del real[key]

        def __iter__(self) -> Iterator[str]:
            return iter(real)

        def __len__(self) -> int:
            return len(real)

        def copy(self) -> dict[str, str]:
            return dict(real)

    os.environ = Reads()  # type: ignore[assignment]  # noqa: B003 - a view, not a new environ
    try:
        yield names
    finally:
        os.environ = real  # noqa: B003


def probe(payload: dict[str, Any], _partition: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """One executor task of the check (runs in the executor's Python; never raises).

    Yields one result: ``host``, ``python`` (the interpreter), ``version`` (major.minor),
    ``stage`` (``ok``, ``version``, ``import`` or ``pipeline``: the first check that failed),
    ``error`` (``Type: message``), ``missing`` (the variable of a ``KeyError``) and
    ``fingerprint`` (of the plan the pipeline compiled into).
    """
    import socket

    started = time.monotonic()
    found: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": sys.executable,
        "version": "{}.{}".format(*sys.version_info[:2]),
        "stage": "ok",
        "error": "",
        "missing": None,
        "fingerprint": None,
        "import_s": None,
        "load_s": None,
    }
    if found["version"] != payload["version"]:
        found["stage"] = "version"
        yield found
        return
    try:  # eosflow and what its workers import (confluent-kafka, the snapshot store, ...)
        from processor.compiler import compile_flow
        from processor.runtime.pipeline import load_flow
        from processor.runtime.supervision import worker  # noqa: F401
    except Exception as exc:
        found.update(stage="import", error=f"{type(exc).__name__}: {exc}")
        yield found
        return
    found["import_s"] = round(time.monotonic() - started, 3)
    try:
        # spark.python.worker.reuse=false: this process ends with the task, so does this.
        os.environ.update(payload["environ"])
        path = payload["pipeline"]
        if not os.path.isfile(path):  # on a cluster: the copy shipped by addFile
            from pyspark import SparkFiles

            path = SparkFiles.get(os.path.basename(path))
        with _recording_environ() as read:
            plan = compile_flow(
                load_flow(path),
                payload["workers"],
                combine=payload["recovery"] != "local",
                key_groups=payload["key_groups"],
                epoch=payload["epoch"],
            )
        found["read"] = {name: _digest(os.environ.get(name)) for name in sorted(read)}
        found["fingerprint"] = plan.fingerprint()
        found["load_s"] = round(time.monotonic() - started - found["import_s"], 3)
    except Exception as exc:
        found.update(
            stage="pipeline",
            error=f"{type(exc).__name__}: {exc}"[:500],
            missing=_missing_variable(exc),
        )
    yield found


def results_message(
    results: list[dict[str, Any]],
    *,
    version: str,
    fingerprint: str | None,
    driver_environ: Mapping[str, str],
) -> str | None:
    """What the executors cannot do, with the fix, in one line; ``None`` if they can.

    ``version``: the driver's Python (major.minor); ``fingerprint``: the driver's plan's;
    ``driver_environ``: the driver's environment (to tell a variable set only here).
    """
    for r in results:
        where = f"executor {r['host']} ({r['python']})"
        stage = r["stage"]
        if stage == "version":
            return (
                f"{where} runs Python {r['version']} but the driver runs Python {version}: "
                + _python_fix(version)
            )
        if stage == "import":
            return (
                f"{where} cannot import eosflow or its dependencies ({r['error']}): "
                + _python_fix(version)
            )
        if stage == "pipeline":
            name = r.get("missing")
            if name:
                if name in driver_environ:
                    return (
                        f"the pipeline file does not load on {where}: {r['error']}; {name} is "
                        f"set on the driver but not on the executors: forward it with --env {name}"
                    )
                return (
                    f"the pipeline file does not load on {where}: {r['error']}: give the "
                    f"executors the variable with --env {name}=VALUE"
                )
            return (
                f"the pipeline file does not load on {where}: {r['error']}: the executors need "
                "what the driver has: forward the variables it reads with --env NAME, and "
                f"the modules it imports in a packed venv with --archives ({_DOCS})"
            )
        if fingerprint is not None and r.get("fingerprint") not in (None, fingerprint):
            differ = [
                name
                for name, digest in (r.get("read") or {}).items()
                if digest != _digest(driver_environ.get(name))
            ]
            if not differ:
                return (
                    f"the pipeline compiled into another plan on {where} than on the driver: "
                    "it probably reads environment variables that differ there: forward them "
                    "with --env NAME"
                )
            unset = [n for n in differ if r["read"][n] is None]
            return (
                f"the pipeline compiled into another plan on {where} than on the driver: it "
                f"reads {', '.join(differ)}, "
                + (f"unset there ({', '.join(unset)}), " if unset else "")
                + "which differ from the driver's: forward them with "
                + " ".join(f"--env {n}" for n in differ)
            )
    return None


def failure_message(text: str, *, version: str, python: str) -> str:
    """The one-line fix for a check job that failed in Spark itself (the executors' Python did
    not start, or PySpark refused it before :func:`probe` ran); ``text``: Spark's error."""
    if "PYTHON_VERSION_MISMATCH" in text or "different version" in text:
        return f"the executors run another Python than the driver's {version}: " + _python_fix(
            version
        )
    if "Cannot run program" in text:
        return f"the executors cannot start their Python ({python}): " + _python_fix(version)
    lines = [line for line in text.splitlines() if "Error" in line or "Exception" in line]
    module = next((line for line in lines if "No module named" in line), None)
    if module is not None:
        return f"the executors' Python ({python}): {module.strip()[:300]}: " + _python_fix(version)
    first = (lines[0] if lines else text.strip().split("\n", 1)[0]).strip()[:300]
    return (
        f"the executors' first-task check failed: {first}. If their Python lacks eosflow: "
        + _python_fix(version)
    )


def _check_timeout() -> float:
    value = os.environ.get("EOSFLOW_SPARK_CHECK_TIMEOUT", "")
    try:
        return float(value) if value else CHECK_TIMEOUT_S
    except ValueError:
        from processor.errors import ConfigError

        raise ConfigError(
            f"EOSFLOW_SPARK_CHECK_TIMEOUT={value!r}: expected seconds, e.g. 300"
        ) from None


def _no_executor_message(sc: Any, waited: float) -> str:
    """Why no executor ran the check: the cluster gave none, or they cannot reach the driver."""
    try:  # the driver's own entry is one of them
        executors = max(0, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)
    except Exception:  # a py4j detail: the message stands without the count
        executors = -1
    driver = sc.getConf().get("spark.driver.host", "?")
    got = f"{executors} executor(s) registered" if executors >= 0 else "executors unknown"
    return (
        f"no executor ran the first-task check within {waited:.0f}s ({got}): the cluster "
        "has no free cores or memory for this application, or its executors fail to start "
        "(the master's web UI, and each worker's work/<app-id>/<executor>/stderr, say why), "
        f"or they cannot connect back to the driver at {driver} (set --conf "
        "spark.driver.host=ADDRESS that the executors reach). Waiting longer: "
        "EOSFLOW_SPARK_CHECK_TIMEOUT=SECONDS"
    )


def check_executors(
    sc: Any,
    spec: dict[str, Any],
    environ: dict[str, str],
    *,
    local: bool,
    timeout: float | None = None,
) -> float:
    """Runs the check on ``sc``'s executors for worker spec ``spec`` (the first generation's)
    with the workers' ``environ``; returns its seconds. ``local``: a ``local`` master, whose
    task slots share one Python (one task checks them all). ``timeout``: seconds until no
    executor having run it fails the run (default ``EOSFLOW_SPARK_CHECK_TIMEOUT``, else
    :data:`CHECK_TIMEOUT_S`): a cluster that never starts an executor for the application
    would otherwise keep the run waiting for ever ("Initial job has not accepted any
    resources").

    Raises:
        ConfigError: what the executors cannot do and the fix (:func:`results_message`).
    """
    from pyspark import cloudpickle

    from processor.errors import ConfigError

    started = time.monotonic()
    version = "{}.{}".format(*sys.version_info[:2])
    # By value: the executors may lack eosflow (see the module docstring).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    payload = {
        "version": version,
        "environ": environ,
        "pipeline": spec["pipeline"],
        "workers": int(spec["workers"]),
        "recovery": str(spec.get("recovery", "global")),
        "key_groups": spec.get("key_groups"),
        "epoch": int(spec.get("epoch", 0)),
    }
    tasks = 1 if local else max(int(spec["workers"]), int(sc.defaultParallelism))
    box: dict[str, Any] = {}
    done = threading.Event()
    group = f"eosflow-check-{os.getpid()}-{int(started * 1000)}"

    def run() -> None:
        try:  # job groups are per thread
            sc.setJobGroup(group, "eosflow executor check", interruptOnCancel=True)
            box["results"] = (
                sc.parallelize(range(tasks), tasks)
                .mapPartitions(functools.partial(probe, payload))
                .collect()
            )
        except Exception as exc:  # py4j/Spark errors carry the executor's traceback as text
            box["error"] = str(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="spark-executor-check", daemon=True).start()
    limit = timeout if timeout is not None else _check_timeout()
    if not done.wait(limit):
        sc.cancelJobGroup(group)
        raise ConfigError(_no_executor_message(sc, limit))
    if "error" in box:
        python = str(getattr(sc, "pythonExec", "python3"))
        raise ConfigError(failure_message(box["error"], version=version, python=python))
    results = box["results"]
    message = results_message(
        results,
        version=version,
        fingerprint=spec.get("fingerprint"),
        driver_environ={**os.environ, **environ},
    )
    log.info(
        "spark executor check tasks=%d in %.2fs: %s", tasks, time.monotonic() - started,
        [(r["host"], r["stage"], r["import_s"], r["load_s"]) for r in results],
    )  # fmt: skip
    if message is not None:
        raise ConfigError(message)
    return time.monotonic() - started
