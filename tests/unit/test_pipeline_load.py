"""Loading a pipeline file (processor.runtime.pipeline.load_flow): its errors say where, and
what Python would suggest (issue 50: a ``NameError`` lost the file:line and "Did you mean")."""

from __future__ import annotations

from pathlib import Path

import pytest

from processor.errors import DefinitionError
from processor.runtime.pipeline import load_flow

HEAD = 'from processor import Dataflow\nflow = Dataflow("x")\nstream = flow.source("c", "c")\n'


def test_a_name_error_names_the_line_and_what_python_would_suggest(tmp_path: Path) -> None:
    file = tmp_path / "pipe.py"
    file.write_text(HEAD + 'strem.sink("out", None)\n')
    with pytest.raises(DefinitionError) as err:
        load_flow(file)
    text = str(err.value)
    assert f"{file}:4: strem.sink" in text, text
    assert "NameError: name 'strem' is not defined. Did you mean: 'stream'?" in text, text


def test_an_attribute_error_in_a_helper_names_the_pipelines_line(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("def build(flow):\n    return flow.sorce('a', 'b')\n")
    file = tmp_path / "pipe2.py"
    file.write_text(HEAD + "import helper_mod\nhelper_mod.build(flow)\n")
    with pytest.raises(DefinitionError) as err:
        load_flow(file)
    text = str(err.value)
    assert f"{file}:5: helper_mod.build(flow)" in text, text  # the pipeline's own line
    assert "'Dataflow' object has no attribute 'sorce'. Did you mean: 'source'?" in text, text
