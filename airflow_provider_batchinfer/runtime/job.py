"""A job between its checks and its commit: what the checks found (:class:`CheckedJob`) and what the
pipeline did (:class:`PipelineRun`).

Both engines, the empty run and the driver pass these along, so they sit below all of them: the
driver builds a ``CheckedJob``, an engine turns it into a ``PipelineRun``, the commit reads both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_provider_batchinfer.contract import JobFile
from airflow_provider_batchinfer.registry import ModelRegistry
from airflow_provider_batchinfer.runtime.incremental.source import ReusePlan
from airflow_provider_batchinfer.runtime.model import usage
from airflow_provider_batchinfer.runtime.output import commit
from airflow_provider_batchinfer.runtime.planning.pipeline import ActorPool, ColumnPlan
from airflow_provider_batchinfer.runtime.rows.resume import KeptParts
from airflow_provider_batchinfer.store.stage import Stage


@dataclass(frozen=True)
class CheckedJob:
    """A job that passed every check that needs no Ray, with what those checks found."""

    job: JobFile
    run_dir: Stage
    storage: dict[str, Any] | None
    registry: ModelRegistry
    files: list[str]
    file_groups: list[list[int]]  # each input file's rows per row group, from its footer
    input_rows: int
    plan: ColumnPlan
    kept: KeptParts
    batch_rows: int  # rows per batch handed to a replica
    engine: str | None
    # the most rows of one model call (flavors.call_rows): JobSpec.max_batch_rows, or the kind's own
    call_rows: int
    # incremental scoring: the key context and the earlier run to copy from (None: reuse off)
    reuse: ReusePlan | None = None
    # seconds the check that InputSpec.id_column is unique took (None: no id column)
    id_check_s: float | None = None
    # uncompressed bytes a row of the columns read holds, from the first file's footer (sizes reads)
    row_bytes: float = 0.0
    # "module:Class" the model imports from installed packages, outside its digest (python_class.py)
    unhashed_imports: tuple[str, ...] = ()

    @property
    def todo_rows(self) -> int:
        return self.input_rows - self.kept["rows"] - self.kept["error_rows"]

    @property
    def read_files(self) -> list[str]:
        """The files this attempt reads: the input's, or what RESUME left of it (``resume.py``)."""
        read = self.kept["read"]
        return self.files if read is None else read.files

    @property
    def read_groups(self) -> list[list[int]]:
        """Each of :attr:`read_files`' rows per row group."""
        read = self.kept["read"]
        return self.file_groups if read is None else read.groups


@dataclass(frozen=True)
class PipelineRun:
    """What the Ray pipeline did: the files it wrote, the pool it ran on, and its timings."""

    written: commit.Written
    pool: ActorPool
    ray_ready_at: float  # time.monotonic() when Ray was up
    pipeline_s: float
    steady_rows_per_s: float | None
    placements: list[dict[str, Any]]  # replicas per node (io.replicas_per_node)
    waited_s: float  # for the reservation
    meter: usage.Meter  # what the reservation held, for the manifest's usage
