"""The staging area of a lakehouse sink: one small manifest per subtask and checkpoint.

At the barrier each subtask writes its epoch's data files into the table's location (invisible:
no table snapshot references them yet) and a manifest naming them here::

    <snapshot_url>/<job>/staging/<step>/
        c<checkpoint:010d>-e<shape epoch>-s<subtask:05d>-g<generation>.json

When the checkpoint completes, one writer (subtask 0, the committer) lists the manifests of
every subtask and commits all their files in ONE table commit. Manifests are written to a
temporary name and moved into place, so a listed manifest is always whole.

Which manifests may land (:class:`Lineage`): a manifest of checkpoint ``c`` written by
generation ``g`` belongs to the job's history iff ``g`` completed some checkpoint ``>= c``
(that checkpoint's snapshot holds it, or its commit covered it). Otherwise ``c`` was rolled
back: a later generation restored an earlier checkpoint and replays the epoch, and the manifest
came from a zombie of ``g`` that wrote it after the recovery had deleted the orphans it could
see. Pure bookkeeping on fsspec and the snapshot store; knows nothing of Iceberg or Delta.
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
from processor.errors import ConfigError, SnapshotError
from processor.snapshot.store import SnapshotStore

__all__ = ["Lineage", "Manifest", "Staging"]

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

    def __init__(self, ctx: SinkContext) -> None:
        base = ctx.snapshot_url
        if base is None:
            raise ConfigError(
                f"sink step {ctx.step!r}: a lakehouse sink stages its epochs in the job's "
                "snapshot store, and this runner gave none (SinkContext.snapshot_url); run it "
                "with eosflow run (local or Spark runner)"
            )
        self.ctx = ctx
        self.lineage = Lineage(base, ctx.job)
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
        # Other processes write here: a listing cached by this process (s3fs's dircache, only
        # invalidated by this process's own writes) would leave their manifests out.
        self.fs.invalidate_cache(self.path)
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


class Lineage:
    """Which generation completed each of the job's checkpoints, as the coordinator recorded it
    in the checkpoint's manifest; read from the snapshot store, once per checkpoint (a
    completed checkpoint never changes).

    Invariants:
        A manifest is committable only if its generation completed a checkpoint at or after its
        own; it is rolled back (to be deleted) only if, in addition, a later generation
        completed a checkpoint. Neither: its generation may still complete it (left alone).
    """

    def __init__(self, url: str, job: str) -> None:
        self.store = SnapshotStore(url)
        self.job = job
        self._by: dict[int, int | None] = {}  # checkpoint -> generation (None: not recorded)

    def _generation(self, checkpoint_id: int) -> int | None:
        if checkpoint_id not in self._by:
            self._by[checkpoint_id] = self.store.load(self.job, checkpoint_id).metadata.get(
                "generation"
            )
        return self._by[checkpoint_id]

    def completed(self, checkpoint_id: int) -> bool:
        """``checkpoint_id`` has completed (its manifest is in the store)."""
        try:
            self._generation(checkpoint_id)
        except SnapshotError:
            return False
        return True

    def sort(
        self, manifests: list[Manifest], checkpoint_id: int
    ) -> tuple[list[Manifest], list[Manifest]]:
        """``manifests`` (of checkpoints ``<= checkpoint_id``) as ``(committable, rolled
        back)``; the ones that are neither are left out."""
        target = self._generation(checkpoint_id) if self.completed(checkpoint_id) else -1
        if target is None or all(m.generation == target for m in manifests):
            return manifests, []  # the usual case: no listing of the store
        completed: list[tuple[int, int | None]] = []
        low = min(m.checkpoint for m in manifests)
        for chk in self.store.completed_ids(self.job):
            if chk < low:  # no evidence for a manifest of ``low`` or later
                continue
            try:
                completed.append((chk, self._generation(chk)))
            except SnapshotError:
                continue  # deleted by retention meanwhile, or unreadable: no evidence
        ok, rolled_back = [], []
        for m in manifests:
            if any(c >= m.checkpoint and g in (None, m.generation) for c, g in completed):
                ok.append(m)
            elif any(g is not None and g > m.generation for _c, g in completed):
                rolled_back.append(m)
        return ok, rolled_back
