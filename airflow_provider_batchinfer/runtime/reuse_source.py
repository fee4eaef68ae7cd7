"""Incremental scoring, before Ray starts: the run's key context, and which earlier run to reuse.

The earlier run is the newest committed one (by its manifest's ``finished_at``) under the same
``base_stage_location`` whose ``_SUCCESS`` has a ``reuse`` section with this run's key scheme and
context (same model sha256, params, input columns and types, output schema). Before it is used it is
checked like the sensor checks a run (schema, every part present with its size and Parquet footer)
and every key file it lists must be present with its size; a run that fails is skipped with a note
(the manifest's ``reuse.notes``) and the next older compatible one is tried. With none, every row
is scored, and this run's keys still make the next run incremental.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, ContractError, JobFile, Manifest
from airflow_provider_batchinfer.contract.reuse import KEY_SCHEME
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.reuse_keys import context_digest
from airflow_provider_batchinfer.stage import Stage, StageError, sanitize_run_key

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.plan import ColumnPlan


class ReuseSpecError(JobError):
    """``JobSpec(reuse=...)`` cannot work for this job; no retry can fix it."""

    permanent = True


@dataclass(frozen=True)
class Source:
    """The earlier run whose predictions are copied: its run directory, its parts (a row's part
    index is its position here), its key files ``(part index, location, rows, sha256)``, its
    passthrough columns (everything else in a part is a prediction)."""

    run_dir: str
    parts: tuple[str, ...]
    key_files: tuple[tuple[int, str, int, str], ...]
    passthrough: tuple[str, ...]
    finished_at: str

    @property
    def indexed_rows(self) -> int:
        return sum(f[2] for f in self.key_files)


@dataclass(frozen=True)
class ReusePlan:
    """What the driver decided before Ray: the mode, the key context, the model-input columns the
    keys cover, the earlier run (None: nothing to reuse) and notes for the manifest. ``notes`` is
    appended to later (an index that fails its checksum while loading)."""

    mode: str
    context: str
    columns: tuple[str, ...]
    source: Source | None
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)  # "loaded": the shards hold the source's keys


def base_of(job: JobFile) -> Stage:
    """The ``base_stage_location`` a run directory was placed under (``<base>/<run key>[/map-<i>]``)."""
    run_dir = job.run_dir.rstrip("/")
    owner = job.airflow
    tail = [sanitize_run_key(owner.run_id)] + ([f"map-{owner.map_index}"] if owner.map_index >= 0 else [])
    parts = run_dir.split("/")
    if len(parts) <= len(tail) or parts[-len(tail) :] != tail:
        raise ReuseSpecError(
            f"JobSpec(reuse='unchanged') needs OutputSpec(base_stage_location=...): the run directory {run_dir} is "
            f"not <base>/{'/'.join(tail)}, so there are no earlier runs to reuse from"
        )
    return Stage.open("/".join(parts[: -len(tail)]), dict(job.storage_options) or None)


def _arrow_type(schema: pa.Schema, column: str) -> str:
    return str(schema.field(column).type) if column in schema.names else "?"


def plan_reuse(job: JobFile, plan: ColumnPlan, schema: pa.Schema, engine: str | None) -> ReusePlan | None:
    """The reuse plan of a job with ``JobSpec.reuse`` set (None without): refuses what keys cannot
    cover, computes the context and picks the earlier run."""
    mode = job.job_spec.reuse
    if not mode:
        return None
    if job.input_spec.column_handling:
        raise ReuseSpecError(
            "JobSpec(reuse='unchanged') cannot be combined with InputSpec.column_handling: the model reads the "
            "files those columns name, and a row's key sees only the location, not the file's content. Drop one"
        )
    if engine == "vllm":
        raise ReuseSpecError(
            "JobSpec(reuse='unchanged') is not supported on the vLLM engine; use engine='transformers' or drop reuse"
        )
    model = job.model
    columns = tuple(plan["sources"])
    names = tuple(plan["model_inputs"]) or columns
    context = context_digest(
        model=f"{model.name}/{model.version}",
        model_sha256=model.sha256,
        flavor=model.flavor,
        params=dict(job.input_spec.params),
        inputs=[(name, src, _arrow_type(schema, src)) for name, src in zip(names, columns, strict=True)],
        outputs=model.outputs,
        engine=engine,
    )
    base = base_of(job)
    notes: list[str] = []
    source = find_source(base, job, context, notes)
    return ReusePlan(mode=mode, context=context, columns=columns, source=source, notes=notes)


def _candidates(base: Stage, job: JobFile) -> list[Stage]:
    """Every run directory beside this one (``map-<i>`` below each for a mapped task)."""
    import pyarrow.fs as pafs

    with base._io("list"):
        infos = base.fs.get_file_info(pafs.FileSelector(base.path, recursive=False, allow_not_found=True))
    own = job.run_dir.rstrip("/")
    out = []
    for info in infos:
        if info.type != pafs.FileType.Directory:
            continue
        run = base.child(posixpath.basename(info.path.rstrip("/")))
        if job.airflow.map_index >= 0:
            run = run.child(f"map-{job.airflow.map_index}")
        if run.location.rstrip("/") != own:
            out.append(run)
    return out


def find_source(base: Stage, job: JobFile, context: str, notes: list[str]) -> Source | None:
    """The newest valid compatible earlier run under ``base``, or None (``notes`` say why)."""
    compatible: list[tuple[str, Stage, Manifest]] = []
    incompatible = 0
    for run in _candidates(base, job):
        marker = run.child(SUCCESS_MARKER)
        try:
            if not marker.exists():
                continue
            manifest = Manifest.from_json(marker.read_bytes(), marker.location)
        except (ContractError, StageError) as exc:
            notes.append(f"skipped {run.location}: its {SUCCESS_MARKER} cannot be read ({exc})")
            continue
        reuse = manifest.reuse
        if reuse is None or reuse.scheme != KEY_SCHEME or reuse.context != context:
            incompatible += 1
            continue
        compatible.append((manifest.finished_at, run, manifest))
    if incompatible:
        notes.append(
            f"{incompatible} earlier run(s) under {base.location} were scored without reuse or with another model "
            "sha256, params, input columns or output schema; none of their rows can be reused"
        )
    for _finished, run, manifest in sorted(compatible, key=lambda c: c[0], reverse=True):
        try:
            return _checked_source(run, manifest)
        except (ContractError, StageError) as exc:
            notes.append(f"skipped {run.location}: {exc}")
    if not compatible:
        notes.append(f"no earlier committed run under {base.location} has a compatible key index: every row is scored")
    return None


def _checked_source(run: Stage, manifest: Manifest) -> Source:
    """The earlier run as a Source, after the sensor's checks and a listing of its key files."""
    from airflow_provider_batchinfer.markers import validate_manifest

    validate_manifest(run, manifest)
    reuse = manifest.reuse
    assert reuse is not None  # find_source only passes runs with a reuse section
    present = dict(run.list_files())
    parts = tuple(f.name for f in manifest.files)
    position = {name: i for i, name in enumerate(parts)}
    key_files = []
    for entry in reuse.index:
        if present.get(entry.name) != entry.size:
            found = "missing" if entry.name not in present else f"{present[entry.name]} bytes"
            raise StageError(
                f"its key file {entry.name} is {found}, but its {SUCCESS_MARKER} says {entry.size} bytes; not reusing it"
            )
        key_files.append((position[entry.part], run.child(*entry.name.split("/")).location, entry.rows, entry.sha256))
    return Source(
        run_dir=run.location,
        parts=parts,
        key_files=tuple(key_files),
        passthrough=manifest.passthrough_columns,
        finished_at=manifest.finished_at,
    )
