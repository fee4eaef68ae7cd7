"""Incremental scoring in the Ray pipeline (``JobSpec(reuse="unchanged")``, ``docs/incremental.md``).

``keyed read (or read -> key_batch) -> ReusingReplica -> keyed sink``:

- Before Ray, ``reuse_match.prepare`` matches the input's keys against the earlier run's in
  hash-partitioned spill files and writes the input again with each row's key and earlier place;
  ``keyed_input`` makes the pool read those copies. A key file that fails its sha256 or row count
  makes the whole run score every row (a note in the manifest), never half-reuse. Without an
  earlier run, ``with_keys`` adds a keying stage (a task fused with the read).
- ``ReusingReplica`` scores only the rows without an earlier prediction and copies the others' from
  the earlier run's parts (the row groups they are in, cached; passthrough columns from today's
  input). Copied rows never reach the model.
- ``KeyedPartsDatasink`` writes each part as usual and, beside it, its key file
  (``_reuse/<part>.keys.parquet``: the key and whether the row was reused, row for row); both are
  written by the same write task under the same attempt, so RESUME, OVERWRITE, fencing and the
  commit treat them alike. ``section`` lists the key files in the manifest's ``reuse`` section.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from airflow_provider_batchinfer.contract import FileEntry
from airflow_provider_batchinfer.contract.reuse import KEY_SCHEME, IndexFile, ReuseInfo, key_file_name
from airflow_provider_batchinfer.runtime.incremental.keys import (
    KEY_COLUMN,
    REUSED_COLUMN,
    SOURCE_PART_COLUMN,
    SOURCE_ROW_COLUMN,
    key_batch,
)
from airflow_provider_batchinfer.runtime.incremental.source import ReusePlan, Source
from airflow_provider_batchinfer.runtime.model.replica import ModelReplica
from airflow_provider_batchinfer.runtime.output.parts import PartsDatasink, _PartWriter
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from ray.data import Dataset

    from airflow_provider_batchinfer.runtime.rows.resume import KeptParts

ROW_GROUP_CACHE = 8  # decoded row groups of earlier parts a replica keeps


# --- the keying stage ----------------------------------------------------------------------------------


def keyed_input(plan: ReusePlan | None, files: list[str], columns: list[str]) -> tuple[list[str], list[str]]:
    """The files and columns the pool reads: the keyed copies ``reuse_match.prepare`` wrote (with
    each row's key and earlier place), or ``files`` and ``columns`` as they are."""
    copies = plan.state.get("files") if plan is not None else None
    if not copies:
        return files, columns
    return list(copies), [*columns, KEY_COLUMN, SOURCE_PART_COLUMN, SOURCE_ROW_COLUMN]


def with_keys(ds: Dataset, plan: ReusePlan | None, io: dict[str, Any]) -> Dataset:
    """``ds`` with each row's key and earlier location: as read from the keyed copies, or computed
    by a keying stage without an earlier run's keys (no-op without reuse)."""
    if plan is None:
        return ds
    for note in plan.notes:
        print(f"[batchinfer] reuse: {note}", flush=True)
    if plan.state.get("files"):
        return ds
    return ds.map_batches(
        key_batch,
        fn_kwargs={"columns": list(plan.columns), "context": plan.context},
        batch_size=None,
        batch_format="pyarrow",
        **io,
    )


def replica_class(
    plan: ReusePlan | None, storage: Mapping[str, Any] | None, base: type[ModelReplica] = ModelReplica
) -> type[ModelReplica]:
    """The actor class the pool runs: ``base``, or ``base`` under a :class:`ReusingReplica` bound to
    the earlier run (so whatever ``base`` adds to a model batch, e.g. usage's timing, still applies
    to the rows it scores)."""
    if plan is None:
        return base
    source = plan.source if plan.state.get("loaded") else None
    bases = (ReusingReplica,) if base is ModelReplica else (ReusingReplica, base)
    return type("ReusingReplica", bases, {"SOURCE": source, "STORAGE": dict(storage or {}) or None})


# --- the replica ---------------------------------------------------------------------------------------


class Gatherer:
    """Copies predictions out of the earlier run's parts: for each (part, row), the row group that
    holds it (the parts are written one row group per model batch), decoded once and cached."""

    def __init__(self, source: Source, storage: Mapping[str, Any] | None) -> None:
        self.source, self.storage = source, dict(storage) if storage else None
        self.files: dict[int, tuple[Any, Any, list[str]]] = {}
        self.cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()

    def _open(self, part: int) -> tuple[Any, Any, list[str]]:
        if part not in self.files:
            import numpy as np
            import pyarrow.parquet as pq

            stage = Stage.open(self.source.run_dir, self.storage).child(self.source.parts[part])
            pf = pq.ParquetFile(stage.fs.open_input_file(stage.path))
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            outputs = [c for c in pf.schema_arrow.names if c not in self.source.passthrough]
            self.files[part] = (pf, starts, outputs)
        return self.files[part]

    def _row_group(self, part: int, group: int) -> pa.Table:
        key = (part, group)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        pf, _starts, outputs = self._open(part)
        table = pf.read_row_group(group, columns=outputs)
        self.cache[key] = table
        if len(self.cache) > ROW_GROUP_CACHE:
            self.cache.popitem(last=False)
        return table

    def take(self, parts: np.ndarray, rows: np.ndarray) -> pa.Table:
        """The prediction columns of each (part, row), in the order asked."""
        import numpy as np
        import pyarrow as pa

        pieces, positions = [], []
        for part in np.unique(parts):
            chosen = np.nonzero(parts == part)[0]
            _pf, starts, _outputs = self._open(int(part))
            groups = np.searchsorted(starts, rows[chosen], side="right") - 1
            for group in np.unique(groups):
                here = chosen[groups == group]
                table = self._row_group(int(part), int(group))
                pieces.append(table.take(pa.array(rows[here] - starts[group])))
                positions.append(here)
        table = pa.concat_tables(pieces, promote_options="default")
        return table.take(pa.array(np.argsort(np.concatenate(positions), kind="stable")))


class ReusingReplica(ModelReplica):
    """A model replica that scores only the rows the earlier run did not have, and copies the rest."""

    SOURCE: ClassVar[Source | None] = None
    STORAGE: ClassVar[dict[str, Any] | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = {**self.plan, "passthrough": [*self.plan["passthrough"], KEY_COLUMN]}
        self.gatherer = Gatherer(self.SOURCE, self.STORAGE) if self.SOURCE is not None else None

    def __call__(self, batch: pa.Table) -> pa.Table:
        import numpy as np
        import pyarrow as pa

        found = batch.column(SOURCE_PART_COLUMN).to_numpy() >= 0
        if self.gatherer is None or not found.any() or batch.num_rows == 0:
            scored = super().__call__(batch)
            return scored.append_column(REUSED_COLUMN, pa.array(np.zeros(scored.num_rows, bool)))
        tables = []
        if not found.all():
            scored = super().__call__(batch.filter(pa.array(~found)))
            tables.append(scored.append_column(REUSED_COLUMN, pa.array(np.zeros(scored.num_rows, bool))))
        tables.append(self._copied(batch.filter(pa.array(found)), tables[0].schema if tables else None))
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")

    def _copied(self, batch: pa.Table, like: pa.Schema | None) -> pa.Table:
        """Today's passthrough and key, the earlier run's predictions, marked reused."""
        import numpy as np
        import pyarrow as pa

        assert self.gatherer is not None
        outputs = self.gatherer.take(
            batch.column(SOURCE_PART_COLUMN).to_numpy(), batch.column(SOURCE_ROW_COLUMN).to_numpy()
        )
        columns = {c: batch.column(c) for c in self.plan["passthrough"]}
        for name in outputs.column_names:
            column = outputs.column(name)
            if like is not None and name in like.names and like.field(name).type != column.type:
                column = column.cast(like.field(name).type)
            columns[name] = column
        columns[REUSED_COLUMN] = pa.array(np.ones(batch.num_rows, bool))
        if self.counter is not None:
            self.counter.add.remote(batch.num_rows)
        return pa.table(columns)


# --- the sink: parts and their key files ---------------------------------------------------------------


class KeyedPartsDatasink(PartsDatasink):
    """``PartsDatasink`` that also writes each part's key file, row for row, and returns its entry."""

    index: list[IndexFile]

    def write(self, blocks: Iterable[Any], ctx: Any) -> list[Any]:
        import pyarrow.compute as pc
        from ray.data.block import BlockAccessor

        from airflow_provider_batchinfer.contract import part_name
        from airflow_provider_batchinfer.runtime.errors import ERROR_COLUMN

        part = part_name(ctx.task_idx, self.attempt)
        keys = _PartWriter(Stage.open(self.run_dir, self.storage_options).child(*key_file_name(part).split("/")), part)

        reused = [0]

        def stripped() -> Iterable[Any]:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if KEY_COLUMN in table.column_names:
                    good = table
                    if ERROR_COLUMN in table.column_names:
                        good = table.filter(pc.is_null(table.column(ERROR_COLUMN)))
                    if good.num_rows:
                        keys.write(good.select([KEY_COLUMN, REUSED_COLUMN]).rename_columns(["key", "reused"]))
                        reused[0] += int(pc.sum(good.column(REUSED_COLUMN)).as_py() or 0)
                    table = table.drop_columns([KEY_COLUMN, REUSED_COLUMN])
                yield table

        entries: list[Any] = list(super().write(stripped(), ctx))
        key_entry = keys.close()
        if key_entry is not None:
            written = {e.name: e.rows for e in entries}
            if written.get(part) != key_entry.rows:
                raise RuntimeError(
                    f"{part}: {written.get(part)} rows written but {key_entry.rows} keys; not committing"
                )
            assert key_entry.sha256 is not None
            entries.append(
                IndexFile(key_file_name(part), part, key_entry.size, key_entry.rows, key_entry.sha256, reused[0])
            )
        return entries

    def record(self, entries: Iterable[Any]) -> None:
        entries = list(entries)
        self.index = sorted((e for e in entries if isinstance(e, IndexFile)), key=lambda e: e.name)
        super().record(e for e in entries if isinstance(e, FileEntry))


def make_keyed_datasink(
    run_dir: str,
    attempt: str,
    storage_options: Mapping[str, Any] | None,
    error_columns: list[str] | None = None,
    provenance: tuple[str, str] | None = None,
) -> KeyedPartsDatasink:
    from ray.data import Datasink

    class _Sink(KeyedPartsDatasink, Datasink):
        def on_write_complete(self, write_result: Any) -> None:
            self.record(e for returned in write_result.write_returns if returned for e in returned)

        def get_name(self) -> str:
            return "WriteKeyedParts"

    sink = _Sink(run_dir, attempt, storage_options, None, error_columns, provenance)
    sink.index = []
    return sink


# --- the manifest's section ------------------------------------------------------------------------------


def _kept_index(run_dir: Stage, part: FileEntry) -> IndexFile | None:
    """The key file an earlier attempt of this run (RESUME) wrote beside a kept part, when it is whole
    and matches the part's rows; None otherwise (those rows are then simply not reusable next time)."""
    import hashlib

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    stage = run_dir.child(*key_file_name(part.name).split("/"))
    try:
        data = stage.read_bytes()
        reused = pq.read_table(pa.BufferReader(data), columns=["reused"]).column("reused")
    except Exception:  # missing or cut off mid-write
        return None
    if len(reused) != part.rows:
        return None
    sha = hashlib.sha256(data).hexdigest()
    return IndexFile(stage.location[len(run_dir.location) + 1 :], part.name, len(data), part.rows, sha,
                     int(pc.sum(reused).as_py() or 0))  # fmt: skip


def section(
    plan: ReusePlan | None, run_dir: Stage, kept: KeptParts, index: Iterable[IndexFile], input_rows: int
) -> ReuseInfo | None:
    """The manifest's ``reuse`` section: this attempt's key files and those of kept parts."""
    if plan is None:
        return None
    files = list(index)
    for part in kept["files"]:
        entry = _kept_index(run_dir, part)
        if entry is not None:
            files.append(entry)
    files.sort(key=lambda e: e.name)
    reused = sum(f.reused_rows for f in files)
    source = plan.source.run_dir if plan.source is not None and plan.state.get("loaded") else None
    info = ReuseInfo(
        mode=plan.mode,
        scheme=KEY_SCHEME,
        context=plan.context,
        index=tuple(files),
        source_run=source,
        reused_rows=reused,
        scored_rows=input_rows - reused,
        notes=tuple(plan.notes),
    )
    print(
        f"[batchinfer] reuse: {reused:,} row(s) copied from {source or 'no earlier run'}, "
        f"{input_rows - reused:,} scored; {info.indexed_rows:,} keys indexed for the next run",
        flush=True,
    )
    return info
