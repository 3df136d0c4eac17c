"""Unit tests for sinks.console: lines printed on commit only, to a given stream or stdout."""

from __future__ import annotations

import io
from typing import Any

import pytest

from processor.contracts import Sink, SinkContext, SinkWriter
from processor.errors import ConfigError, SerializationError, SnapshotError
from processor.snapshot import codec
from sinks import ConsoleSink

CTX = SinkContext(job="clicks", step="show", subtask=0, parallelism=1, generation=1)


def test_nothing_is_printed_when_epoch_is_written_and_prepared_but_not_committed() -> None:
    stream = io.StringIO()
    writer = ConsoleSink(stream=stream).open(CTX)
    writer.write([1, "two"])
    committable = writer.prepare(1)
    assert stream.getvalue() == ""
    writer.commit(1, committable)
    assert stream.getvalue() == "1\ntwo\n"


def test_sink_and_writer_satisfy_contracts_when_opened() -> None:
    sink = ConsoleSink()
    writer = sink.open(CTX)
    assert isinstance(sink, Sink)
    assert isinstance(writer, SinkWriter)


def test_format_and_prefix_are_applied_when_given() -> None:
    stream = io.StringIO()
    sink = ConsoleSink(stream=stream, format=lambda v: f"{v['k']}={v['n']}", prefix="[show] ")
    writer = sink.open(CTX)
    writer.write([{"k": "a", "n": 1}, {"k": "b", "n": 2}])
    writer.commit(1, writer.prepare(1))
    assert stream.getvalue() == "[show] a=1\n[show] b=2\n"


def test_prepare_returns_none_when_epoch_is_empty() -> None:
    writer = ConsoleSink(stream=io.StringIO()).open(CTX)
    writer.write([])
    assert writer.prepare(1) is None


def test_epochs_are_printed_separately_when_prepared_one_after_another() -> None:
    stream = io.StringIO()
    writer = ConsoleSink(stream=stream).open(CTX)
    writer.write(["a"])
    c1 = writer.prepare(1)
    writer.write(["b"])
    c2 = writer.prepare(2)
    assert (c1, c2) == (["a"], ["b"])
    writer.commit(1, c1)
    assert stream.getvalue() == "a\n"
    writer.commit(2, c2)
    assert stream.getvalue() == "a\nb\n"


def test_commit_prints_once_when_called_twice() -> None:
    stream = io.StringIO()
    writer = ConsoleSink(stream=stream).open(CTX)
    writer.write(["once"])
    committable = writer.prepare(1)
    writer.commit(1, committable)
    writer.commit(1, committable)
    writer.commit(1, None)
    assert stream.getvalue() == "once\n"


def test_recover_prints_pending_and_drops_unprepared_lines_when_restarted() -> None:
    stream = io.StringIO()
    before = ConsoleSink(stream=stream).open(CTX)
    before.write(["pending"])
    committable = before.prepare(1)
    before.write(["orphan"])  # "crash": never prepared
    after = ConsoleSink(stream=stream).open(CTX)
    after.recover([(1, codec.loads(codec.dumps(committable)))])
    before.recover([])
    before.close()
    assert before.prepare(2) is None
    assert stream.getvalue() == "pending\n"


def test_committable_is_a_list_of_str_when_prepared() -> None:
    writer = ConsoleSink(stream=io.StringIO()).open(CTX)
    writer.write([1, None, 2.5])
    committable = writer.prepare(1)
    assert committable == ["1", "None", "2.5"]
    assert codec.loads(codec.dumps(committable)) == committable


def test_stdout_is_looked_up_when_committing(capsys: pytest.CaptureFixture[str]) -> None:
    sink = ConsoleSink()
    assert sink.stream is None
    writer = sink.open(CTX)
    writer.write(["to stdout"])
    writer.commit(1, writer.prepare(1))
    assert capsys.readouterr().out == "to stdout\n"


def test_serialization_error_names_step_and_type_when_format_raises() -> None:
    writer = ConsoleSink(stream=io.StringIO(), format=lambda v: v["missing"]).open(CTX)
    writer.write([{"missing": "ok"}])
    with pytest.raises(SerializationError, match=r"step='show'.*type dict.*KeyError"):
        writer.write([{"other": 1}])
    assert writer.prepare(1) == ["ok"]


def test_serialization_error_is_raised_when_format_returns_no_str() -> None:
    sink = ConsoleSink(stream=io.StringIO(), format=lambda v: v)
    with pytest.raises(SerializationError, match="format returned int, not str"):
        sink.open(CTX).write([1])


def test_commit_raises_when_committable_is_not_a_list_of_str() -> None:
    writer = ConsoleSink(stream=io.StringIO()).open(CTX)
    with pytest.raises(SnapshotError, match="not a list of str") as info:
        writer.commit(1, {"temp": "x", "final": "y"})
    assert info.value.reason == "corrupt"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"format": "{}"}, "format must be a function"),
        ({"prefix": 3}, "prefix must be a str"),
        ({"stream": "stdout"}, "stream must be a text stream"),
    ],
)
def test_config_error_is_raised_when_option_is_invalid(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ConsoleSink(**kwargs)
