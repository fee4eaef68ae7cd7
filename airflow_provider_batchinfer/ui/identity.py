"""Which task instances are the provider's operator: by its class path, not its name.

``TaskInstance.operator`` holds only a class name (``task_type``), and any DAG may define a class
called ``BatchInferenceOperator``. The class's module is in the DAG version's serialized DAG
(``_task_module`` beside ``task_type``, as Airflow's own task API reads it), and every task
instance names the DAG version it ran (``dag_version_id``), so the pages list a task instance only
when the serialized DAG of its own version records the provider's class path for its task. A task
instance without a DAG version, or whose serialized DAG is gone, is not listed.

What each DAG version's serialized DAG says is kept in this process, keyed by the version and its
``dag_hash``: Airflow rewrites a version's serialized DAG in place only while the version has no
task instance, and then its hash changes with it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, false, or_, select

if TYPE_CHECKING:
    from sqlalchemy.orm import Session
    from sqlalchemy.sql import ColumnElement

#: the operator's class path, as Airflow serializes it (``_task_module``, ``task_type``)
OPERATOR_MODULE = "airflow_provider_batchinfer.operators.batch_inference"
OPERATOR_CLASS = "BatchInferenceOperator"
CACHE_VERSIONS = 4096

_cache: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
_lock = threading.Lock()


def operator_tasks(data: Mapping[str, Any] | None) -> frozenset[str]:
    """The task ids a serialized DAG records as the provider's operator (module and class both)."""
    dag = data.get("dag") if isinstance(data, Mapping) else None
    tasks = dag.get("tasks") if isinstance(dag, Mapping) else None
    found = set()
    for task in tasks if isinstance(tasks, list) else []:
        var = task.get("__var", task) if isinstance(task, Mapping) else None
        if not isinstance(var, Mapping):
            continue
        if var.get("_task_module") == OPERATOR_MODULE and var.get("task_type") == OPERATOR_CLASS:
            task_id = var.get("task_id")
            if isinstance(task_id, str):
                found.add(task_id)
    return frozenset(found)


def provider_tasks(session: Session, dag_ids: set[str]) -> dict[Any, frozenset[str]]:
    """``{dag version id: task ids}`` of the provider's operator, over the DAG versions that task
    instances of ``dag_ids`` named ``BatchInferenceOperator`` ran."""
    from airflow.models.serialized_dag import SerializedDagModel as SDM
    from airflow.models.taskinstance import TaskInstance as TI

    if not dag_ids:
        return {}
    versions = select(TI.dag_version_id).where(
        TI.operator == OPERATOR_CLASS, TI.dag_id.in_(sorted(dag_ids)), TI.dag_version_id.is_not(None)
    )
    rows = session.execute(select(SDM.dag_version_id, SDM.dag_hash).where(SDM.dag_version_id.in_(versions)))
    hashes: dict[Any, str] = dict(rows.tuples().all())
    known: dict[Any, frozenset[str]] = {}
    missing = []
    with _lock:
        for version, dag_hash in hashes.items():
            key = (str(version), dag_hash)
            if key in _cache:
                _cache.move_to_end(key)
                known[version] = _cache[key]
            else:
                missing.append(version)
    for start in range(0, len(missing), 100):
        for sdm in session.scalars(select(SDM).where(SDM.dag_version_id.in_(missing[start : start + 100]))):
            tasks = operator_tasks(sdm.data)
            known[sdm.dag_version_id] = tasks
            with _lock:
                _cache[(str(sdm.dag_version_id), sdm.dag_hash)] = tasks
                while len(_cache) > CACHE_VERSIONS:
                    _cache.popitem(last=False)
    return {version: tasks for version, tasks in known.items() if tasks}


def is_provider_task(session: Session, dag_ids: set[str]) -> ColumnElement[bool]:
    """A WHERE clause on ``TaskInstance``: its DAG version records the provider's class for its task."""
    from airflow.models.taskinstance import TaskInstance as TI

    tasks = provider_tasks(session, dag_ids)
    if not tasks:
        return false()
    return or_(*(and_(TI.dag_version_id == v, TI.task_id.in_(sorted(ids))) for v, ids in tasks.items()))


def clear_cache() -> None:
    with _lock:
        _cache.clear()
