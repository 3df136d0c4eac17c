"""eosflow's engine: public API, graph compilation, task runtime, checkpoints, runners, CLI.

What a pipeline file needs is here::

    from processor import Dataflow, Tumbling
    from connectors import JsonSerde
    from sinks import FileSink

The layers, the path of a record and the path of a barrier: ``docs/architecture.md``.
"""

from processor.dataflow import DEAD_LETTERS, Dataflow, KeyedStream, Stream, Table
from processor.errors import (
    ConfigError,
    DefinitionError,
    DeserializationError,
    EosflowError,
    SerializationError,
)
from processor.windows import Session, Sliding, Tumbling

__version__ = "0.1.0.dev0"

__all__ = [
    "DEAD_LETTERS",
    "ConfigError",
    "Dataflow",
    "DefinitionError",
    "DeserializationError",
    "EosflowError",
    "KeyedStream",
    "SerializationError",
    "Session",
    "Sliding",
    "Stream",
    "Table",
    "Tumbling",
    "__version__",
]
