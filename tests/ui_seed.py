"""Batch runs as Airflow records them, inserted in bulk into a metadata DB: a DAG, its DAG runs, one
``BatchInferenceOperator`` task instance per run and its XCom return value. For the batch runs
pages' component test (2,000 runs) and the screenshots' demo (``scripts/ui_screenshots.py --demo``)."""

from __future__ import annotations

import hashlib
import io
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.contract import SUCCESS_MARKER, FileEntry, Manifest, part_name
from tests.runs import manifest_for, write_part


def error_part(
    run_dir: Path, name: str, ids: list[int], message: str = "ValueError: cannot score text 'boom'"
) -> FileEntry:
    """A dead-letter file as the runtime writes it: the rows' ids and an ``error`` message each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    messages = [f"{message} (row {i})" for i in ids]
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "error": messages}), sink)
    data = sink.getvalue()
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_bytes(data)
    return FileEntry(name=name, size=len(data), rows=len(ids), sha256=hashlib.sha256(data).hexdigest())


def committed_run_with_dead_letters(
    run_dir: Path, rows: int = 8, dead: int = 2, message: str = "ValueError: cannot score text 'boom'"
) -> Manifest:
    """A committed run directory: one part of ``rows`` rows, ``dead`` dead-lettered rows (each with
    ``message`` and its row), ``_SUCCESS``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    part = write_part(run_dir, part_name(0, "t01aaaa"), list(range(rows)))
    dead_ids = list(range(rows, rows + dead))
    errors = error_part(run_dir, part_name(0, "t01aaaa", dead_letter=True), dead_ids, message)
    manifest = manifest_for(run_dir, (part,), (errors,))
    (run_dir / SUCCESS_MARKER).write_text(manifest.to_json())
    return manifest


def _operator(task_id: str) -> Any:
    from airflow_provider_batchinfer import BatchInferenceOperator, OutputSpec

    return BatchInferenceOperator(
        task_id=task_id,
        model="text_length",
        version="v1",
        input="/in",
        output_spec=OutputSpec(base_stage_location="ui"),
    )


def _serialize(session: Any, dag_id: str, task_id: str, make_task: Callable[[str], Any]) -> tuple[Any, str]:
    """A DAG of one task, written as the DAG processor writes it: ``(its DAG version id, task type)``."""
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import LazyDeserializedDAG
    from sqlalchemy import select

    with DAG(dag_id, schedule=None) as dag:
        task = make_task(task_id)
    SerializedDagModel.write_dag(LazyDeserializedDAG.from_dag(dag), bundle_name="ui_seed", session=session)
    session.flush()
    version = session.scalar(select(SerializedDagModel.dag_version_id).where(SerializedDagModel.dag_id == dag_id))
    return version, task.task_type


def seed_runs(
    session: Any,
    dag_id: str,
    task_id: str,
    results: Sequence[dict[str, Any] | None],
    start: datetime,
    every: timedelta = timedelta(minutes=1),
    states: Sequence[str] | None = None,
    make_task: Callable[[str], Any] | None = None,
) -> list[str]:
    """One DAG run per result, ``every`` apart from ``start``, with the operator's task instance and,
    where the result is not None, its XCom return value; returns the run ids. The DAG is serialized
    as the DAG processor writes it (a DAG version whose serialized DAG records the task's class),
    with the task ``make_task(task_id)`` builds: by default a ``BatchInferenceOperator``."""
    from airflow.models.dag import DagModel
    from airflow.models.dagbundle import DagBundleModel
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from sqlalchemy import insert, select

    session.merge(DagBundleModel(name="ui_seed"))
    session.flush()
    session.add(DagModel(dag_id=dag_id, fileloc=f"/dags/{dag_id}.py", bundle_name="ui_seed", is_stale=False))
    session.flush()
    version_id, operator = _serialize(session, dag_id, task_id, make_task or _operator)
    run_ids = [f"scheduled__{(start + i * every).isoformat()}" for i in range(len(results))]
    states = states or ["success"] * len(results)
    session.execute(
        insert(DagRun.__table__),
        [
            {
                "dag_id": dag_id,
                "run_id": run_id,
                "run_type": "scheduled",
                "state": state,
                "run_after": start + i * every,
            }
            for i, (run_id, state) in enumerate(zip(run_ids, states, strict=True))
        ],
    )
    ids = dict(session.execute(select(DagRun.run_id, DagRun.id).where(DagRun.dag_id == dag_id)).all())
    session.execute(
        insert(TaskInstance.__table__),
        [
            {
                "id": uuid.uuid4(),
                "dag_id": dag_id,
                "task_id": task_id,
                "run_id": run_id,
                "map_index": -1,
                "try_number": 1,
                "state": state,
                "operator": operator,
                "dag_version_id": version_id,
                "pool": "default_pool",
                "pool_slots": 1,
                "priority_weight": 1,
                "max_tries": 0,
                "hostname": "",
                "unixname": "airflow",
                "queue": "default",
                "start_date": start + i * every,
                "end_date": None if state == "running" else start + i * every + timedelta(seconds=12),
                "duration": None if state == "running" else 12.0,
            }
            for i, (run_id, state) in enumerate(zip(run_ids, states, strict=True))
        ],
    )
    xcoms = [
        {
            "dag_run_id": ids[run_id],
            "task_id": task_id,
            "map_index": -1,
            "key": "return_value",
            "dag_id": dag_id,
            "run_id": run_id,
            "value": result,
            "timestamp": start + i * every,
        }
        for i, (run_id, result) in enumerate(zip(run_ids, results, strict=True))
        if result is not None
    ]
    if xcoms:
        session.execute(insert(XComModel.__table__), xcoms)
    session.commit()
    return run_ids
