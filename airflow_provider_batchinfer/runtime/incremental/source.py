"""Incremental scoring, before Ray starts: the run's key context, and which earlier run to reuse.

The earlier run is one of this task's own committed runs under the same ``base_stage_location``:
its ``_SUCCESS`` names the same dag, task and map index, its ``_job.json`` claim names the same task
and the attempt that committed, and its ``reuse`` section has this run's key scheme and context (same
model sha256, params, input columns and types, output schema). Among those, the newest by commit
order is tried first: the time the store recorded for the marker's write (its ``mtime``, S3's
``LastModified``), never a date the writer put into the manifest. A marker the store dates in the
future, or whose ``finished_at`` lies after its own commit, is never a source. Before it is used it
is checked like the sensor checks a run, content included (schema, every part present with its
size, Parquet footer and sha256) and every key file it lists must be present with its size; a run
that fails is skipped with a note (the manifest's ``reuse.notes``) and the next older one is tried.
With none, every row is scored, and this run's keys still make the next run incremental.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from airflow_provider_batchinfer.contract import (
    JOB_SPEC_FILE,
    SUCCESS_MARKER,
    ContractError,
    JobFile,
    Manifest,
    RunOwner,
)
from airflow_provider_batchinfer.contract.reuse import KEY_SCHEME
from airflow_provider_batchinfer.runtime.errors import JobError
from airflow_provider_batchinfer.runtime.incremental.keys import context_digest
from airflow_provider_batchinfer.store.locations import StageError, sanitize_run_key
from airflow_provider_batchinfer.store.stage import Stage

if TYPE_CHECKING:
    import pyarrow as pa

    from airflow_provider_batchinfer.runtime.planning.pipeline import ColumnPlan


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
    appended to later (an index that fails its checksum while it is matched)."""

    mode: str
    context: str
    columns: tuple[str, ...]
    source: Source | None
    notes: list[str] = field(default_factory=list)
    # set by reuse_match.prepare: "loaded" (the source's keys were matched), "files" (the keyed
    # copies the pool reads), "reuse_s" (seconds the match took)
    state: dict[str, Any] = field(default_factory=dict)


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


#: how far a store's clock or a writer's may run ahead of this driver's before a date counts as future
CLOCK_SKEW_S = 300.0


@dataclass(frozen=True)
class _Candidate:
    """A committed run of this task with a compatible key index, and when the store says it committed."""

    run: Stage
    manifest: Manifest
    committed_at: datetime


def _same_task(owner: RunOwner | None, job: JobFile) -> bool:
    """Written by this job's dag, task and map index (any run, any try)."""
    me = job.airflow
    return owner is not None and (owner.dag_id, owner.task_id, owner.map_index) == (
        me.dag_id,
        me.task_id,
        me.map_index,
    )


def _committed_at(marker: Stage) -> datetime | None:
    """When the store recorded the marker's write (None: no marker). This is the commit order: the
    writer chooses what the manifest says, not when the store saw its marker."""
    import pyarrow.fs as pafs

    with marker._io("look up"):
        info = marker.fs.get_file_info(marker.path)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type != pafs.FileType.File or info.mtime is None:
        raise StageError(
            f"the store records no modification time for {marker.location}, so its commit order is unknown"
        )
    mtime: datetime = info.mtime
    return mtime if mtime.tzinfo else mtime.replace(tzinfo=timezone.utc)


def find_source(base: Stage, job: JobFile, context: str, notes: list[str]) -> Source | None:
    """The newest (by commit order) valid compatible earlier run of this task under ``base``, or
    None (``notes`` say why)."""
    compatible: list[_Candidate] = []
    foreign = incompatible = 0
    for run in _candidates(base, job):
        marker = run.child(SUCCESS_MARKER)
        try:
            committed_at = _committed_at(marker)
            if committed_at is None:
                continue
            manifest = Manifest.from_json(marker.read_bytes(), marker.location)
        except (ContractError, StageError) as exc:
            notes.append(f"skipped {run.location}: its {SUCCESS_MARKER} cannot be read ({exc})")
            continue
        if not _same_task(manifest.airflow, job):
            foreign += 1
            continue
        reuse = manifest.reuse
        if (
            reuse is None
            or reuse.scheme != KEY_SCHEME
            or reuse.context != context
            or manifest.model.sha256 != job.model.sha256
        ):
            incompatible += 1
            continue
        compatible.append(_Candidate(run, manifest, committed_at))
    if foreign:
        notes.append(
            f"{foreign} committed run(s) under {base.location} belong to another dag, task or map index; another "
            "task's output is never reused"
        )
    if incompatible:
        notes.append(
            f"{incompatible} earlier run(s) under {base.location} were scored without reuse or with another model "
            "sha256, params, input columns or output schema; none of their rows can be reused"
        )
    now = datetime.now(timezone.utc)
    for candidate in sorted(compatible, key=lambda c: (c.committed_at, c.run.location), reverse=True):
        try:
            return _checked_source(candidate, job, now)
        except (ContractError, StageError) as exc:
            notes.append(f"skipped {candidate.run.location}: {exc}")
    if not compatible:
        notes.append(f"no earlier committed run under {base.location} has a compatible key index: every row is scored")
    return None


def _check_dates(candidate: _Candidate, now: datetime) -> None:
    """Refuse a commit the store dates in the future, and a manifest that says it finished after its
    own commit (or in the future): either clock lies, so the run's place in the order is unknown."""
    skew = timedelta(seconds=CLOCK_SKEW_S)
    committed = candidate.committed_at
    if committed > now + skew:
        raise StageError(
            f"the store dates its {SUCCESS_MARKER} {committed.isoformat()}, in the future (now {now.isoformat()}); "
            "a marker from the future is never reused"
        )
    text = candidate.manifest.finished_at
    try:
        finished = datetime.fromisoformat(text)
    except ValueError:
        raise StageError(f"its finished_at {text!r:.60} is not a date; not reusing it") from None
    finished = finished if finished.tzinfo else finished.replace(tzinfo=timezone.utc)
    if finished > now + skew:
        raise StageError(
            f"its manifest says it finished at {text}, in the future (now {now.isoformat()}); a marker from the "
            "future is never reused"
        )
    if finished > committed + skew:
        raise StageError(
            f"its manifest says it finished at {text}, after its {SUCCESS_MARKER} was committed "
            f"({committed.isoformat()}); not reusing it"
        )


def _check_claim(run: Stage, manifest: Manifest, job: JobFile) -> None:
    """The run directory's claim names this task and the attempt that committed the marker."""
    from airflow_provider_batchinfer.store.commit.rundir import read_claim

    claim = read_claim(run)
    if claim is None:
        raise StageError(f"it has no {JOB_SPEC_FILE}, so nothing says which task committed it; not reusing it")
    if not _same_task(claim.airflow, job) or claim.attempt != manifest.job.attempt:
        owner = claim.airflow
        raise StageError(
            f"its {JOB_SPEC_FILE} names {owner.dag_id}.{owner.task_id} (map index {owner.map_index}) attempt "
            f"{claim.attempt}, not this task's attempt {manifest.job.attempt} that committed its {SUCCESS_MARKER}; "
            "not reusing it"
        )


def _checked_source(candidate: _Candidate, job: JobFile, now: datetime) -> Source:
    """The earlier run as a Source, after its dates, its claim, the sensor's checks with checksums (a
    damaged part would otherwise be copied into a new commit under fresh checksums) and a listing of
    its key files."""
    from airflow_provider_batchinfer.store.commit.markers import validate_manifest

    run, manifest = candidate.run, candidate.manifest
    _check_dates(candidate, now)
    _check_claim(run, manifest, job)
    validate_manifest(run, manifest, verify_checksums=True)
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
