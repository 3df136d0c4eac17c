"""Unit tests for sinks.postgres without a server: configuration, global ids, the DSN and the
optional psycopg dependency. The protocol itself runs against a real PostgreSQL in
tests/integration/test_sinks_postgres.py and tests/e2e/test_sink_postgres.py."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from processor.contracts import Sink
from processor.errors import ConfigError
from sinks.postgres import DSN_ENV, PostgresSink, global_id

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ("user_id", "clicks", "amount")


def test_sink_satisfies_contract_and_holds_configuration_only_when_built() -> None:
    sink = PostgresSink(
        "public.totals", {"user_id": "text", "n": "bigint"}, mode="upsert", key="user_id"
    )
    assert isinstance(sink, Sink)
    assert sink.table == ("public", "totals")
    assert sink.columns == ("user_id", "n")
    assert sink.types == {"user_id": "text", "n": "bigint"}
    assert sink.key == ("user_id",)
    assert repr(sink) == "PostgresSink('public.totals', mode='upsert')"
    assert PostgresSink("t", COLUMNS).types is None  # names only: the table must exist


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "merge"}, r"mode 'merge': expected one of \('append', 'upsert'\)"),
        ({"mode": "upsert"}, r"mode='upsert' needs key="),
        ({"key": ("user_id",)}, r"key= is for mode='upsert'"),
        ({"mode": "upsert", "key": ("page",)}, r"key columns \['page'\] are not in columns"),
        ({"columns": ()}, "non-empty list of column names"),
        ({"columns": "user_id"}, "non-empty list of column names"),
        ({"columns": ("a", "a")}, "distinct names"),
        ({"row": "user_id"}, "row must be a function"),
        ({"lock_timeout": 5}, "lock_timeout must be a positive timedelta"),
        ({"lock_timeout": timedelta(0)}, "lock_timeout must be a positive timedelta"),
        ({"keep_markers": 0}, "keep_markers must be >= 1"),
        ({"table": "a.b.c"}, r"table 'a.b.c' is not a table name"),
        ({"table": ""}, r"table '' is not a table name"),
        ({"commits_table": "x."}, r"commits_table 'x.' is not a table name"),
    ],
)
def test_config_error_says_what_is_wrong_when_sink_is_built_badly(
    kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"table": "totals", "columns": COLUMNS, **kwargs}
    with pytest.raises(ConfigError, match=message):
        PostgresSink(**args)


def test_dsn_is_read_from_environment_when_used_not_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)
    sink = PostgresSink("totals", COLUMNS)
    monkeypatch.setenv(DSN_ENV, "postgresql://later@db:5432/app")
    assert sink.resolve_dsn() == "postgresql://later@db:5432/app"
    explicit = PostgresSink("totals", COLUMNS, dsn="postgresql://given@db/app")
    assert explicit.resolve_dsn() == "postgresql://given@db/app"


def test_config_error_names_the_variable_when_there_is_no_dsn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(DSN_ENV, raising=False)
    sink = PostgresSink("totals", COLUMNS)
    with pytest.raises(ConfigError, match=f"table 'totals' has no database.*{DSN_ENV}"):
        sink.preflight(job="clicks", checkpoint_interval=1.0)


def test_config_error_says_how_to_install_psycopg_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # "import psycopg" now raises ImportError
    sink = PostgresSink("totals", COLUMNS, dsn="postgresql://u@127.0.0.1:1/db")
    with pytest.raises(ConfigError, match=r"pip install 'eosflow\[postgres\]'"):
        sink.preflight(job="clicks", checkpoint_interval=1.0)


def test_psycopg_is_not_imported_when_a_pipeline_builds_the_sink() -> None:
    code = (
        "import sys\n"
        "from sinks.postgres import PostgresSink\n"
        "PostgresSink('totals', {'user_id': 'text'})\n"
        "print('psycopg' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


def test_global_id_names_job_step_subtask_and_checkpoint() -> None:
    assert global_id("clicks", "out", 3, 42) == "eosflow:clicks:out:3:42"
    ids = {global_id(j, s, t, 1) for j in ("a", "b") for s in ("x", "y") for t in (1, 11)}
    assert len(ids) == 8


def test_global_id_is_hashed_to_fit_postgres_when_names_are_long() -> None:
    job, step = "j" * 200, "s" * 63
    first, last = global_id(job, step, 99999, 0), global_id(job, step, 99999, 10**10 - 1)
    assert len(last.encode()) <= 199
    assert first.rsplit(":", 1)[0] == last.rsplit(":", 1)[0]  # one prefix per writer
    assert first.startswith("eosflow:h-") and first.endswith(":99999:0")
    assert global_id(job + "x", step, 99999, 0) != first
