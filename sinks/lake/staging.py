"""The staging area of a lakehouse sink: one small manifest per subtask and checkpoint.

At the barrier each subtask writes its epoch's data files into the table's location (invisible:
no table snapshot references them yet) and a manifest naming them here::

    <snapshot_url>/<job>/staging/<step>/
        c<checkpoint:010d>-e<shape epoch>-s<subtask:05d>-g<generation>.json

When the checkpoint completes, one writer (subtask 0, the committer) lists the manifests of
every subtask and commits all their files in ONE table commit. Manifests are written to a
temporary name and moved into place, so a listed manifest is always whole. Pure bookkeeping on
fsspec; knows nothing of Iceberg or Delta.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import orjson

from processor.contracts import SinkContext
from processor.errors import ConfigError

__all__ = ["Manifest", "Staging"]

_NAME = re.compile(r"c(\d{10,})-e(\d+)-s(\d{5,})-g(\d+)\.json\Z")


@dataclass(frozen=True)
class Manifest:
    """One subtask's prepared epoch: its checkpoint, who wrote it, its data files."""

    name: str
    checkpoint: int
    epoch: int
    subtask: int
    generation: int


def _parse(name: str) -> Manifest | None:
    m = _NAME.match(name)
    if m is None:
        return None
    chk, epoch, subtask, gen = map(int, m.groups())
    return Manifest(name, chk, epoch, subtask, gen)


class Staging:
    """The manifests of one sink step of one job, under the job's snapshot store."""

    def __init__(self, ctx: SinkContext, *, base_url: str | None = None) -> None:
        base = base_url or ctx.snapshot_url
        if base is None:
            raise ConfigError(
                f"sink step {ctx.step!r}: a lakehouse sink stages its epochs in the job's "
                "snapshot store, and this runner gave none (SinkContext.snapshot_url); run it "
                "with eosflow run (local or Spark runner)"
            )
        self.ctx = ctx
        self.url = f"{base.rstrip('/')}/{ctx.job}/staging/{ctx.step}"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)

    def name(self, checkpoint_id: int) -> str:
        ctx = self.ctx
        return f"c{checkpoint_id:010d}-e{ctx.epoch}-s{ctx.subtask:05d}-g{ctx.generation}.json"

    def write(self, checkpoint_id: int, body: dict[str, Any]) -> str:
        """Writes this subtask's manifest of ``checkpoint_id`` (whole or not at all)."""
        name = self.name(checkpoint_id)
        final = f"{self.path}/{name}"
        temp = f"{self.path}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
        self.fs.makedirs(self.path, exist_ok=True)
        self.fs.pipe_file(temp, orjson.dumps(body))
        self.fs.mv(temp, final)
        return name

    def read(self, manifest: Manifest) -> dict[str, Any]:
        body: dict[str, Any] = orjson.loads(self.fs.cat_file(f"{self.path}/{manifest.name}"))
        return body

    def manifests(self) -> list[Manifest]:
        """Every whole manifest, in (checkpoint, epoch, subtask, generation) order."""
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
        found = [m for m in map(_parse, names) if m is not None]
        return sorted(found, key=lambda m: (m.checkpoint, m.epoch, m.subtask, m.generation))

    def own(self) -> list[Manifest]:
        """This writer's manifests (its shape epoch and subtask, any generation)."""
        ctx = self.ctx
        return [m for m in self.manifests() if m.epoch == ctx.epoch and m.subtask == ctx.subtask]

    def delete(self, manifests: list[Manifest]) -> None:
        for m in manifests:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.path}/{m.name}")

    def delete_temps(self) -> None:
        """Temporary names of manifests whose writer died mid-write (this subtask's)."""
        prefix = ".c"
        marker = f"-e{self.ctx.epoch}-s{self.ctx.subtask:05d}-"
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return
        for n in names:
            if n.startswith(prefix) and marker in n and n.endswith(".tmp"):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(f"{self.path}/{n}")
