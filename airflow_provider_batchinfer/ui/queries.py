"""The batch runs in Airflow's metadata database: task instances of the operator joined with the
XCom return value it pushed. Filters, order and pagination run in SQL, so a page of 50 costs the
same with 10 runs or 100,000; nothing is read from the stage here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, select

from airflow_provider_batchinfer.ui.identity import is_provider_task
from airflow_provider_batchinfer.ui.views import RunRow, run_row

if TYPE_CHECKING:
    from sqlalchemy.orm import Session
    from sqlalchemy.sql import Select

RETURN_KEY = "return_value"
#: how many of a task's newest runs the trend plots show
TREND_RUNS = 200


@dataclass(frozen=True)
class RunFilter:
    """What the batch-runs table is narrowed to; an empty field does not filter."""

    dag_id: str = ""
    task_id: str = ""
    model: str = ""
    state: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"dag_id": self.dag_id, "task_id": self.task_id, "model": self.model, "state": self.state}


def _runs(session: Session, dag_ids: set[str]) -> Select:
    """Every task instance of the provider's operator (by class path: ``identity.py``) in the
    readable DAGs, with its return value (NULL before it committed)."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel

    return (
        select(
            TI.dag_id,
            TI.task_id,
            TI.run_id,
            TI.map_index,
            TI.try_number,
            TI.state,
            TI.start_date,
            TI.end_date,
            TI.duration,
            XComModel.value,
        )
        .select_from(TI)
        .outerjoin(
            XComModel,
            and_(
                XComModel.dag_id == TI.dag_id,
                XComModel.run_id == TI.run_id,
                XComModel.task_id == TI.task_id,
                XComModel.map_index == TI.map_index,
                XComModel.key == RETURN_KEY,
            ),
        )
        .where(TI.dag_id.in_(sorted(dag_ids)), is_provider_task(session, dag_ids))
    )


def _filtered(session: Session, dag_ids: set[str], flt: RunFilter) -> Select:
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel

    stmt = _runs(session, dag_ids)
    if flt.dag_id:
        stmt = stmt.where(TI.dag_id == flt.dag_id)
    if flt.task_id:
        stmt = stmt.where(TI.task_id == flt.task_id)
    if flt.state:
        stmt = stmt.where(TI.state == flt.state)
    if flt.model:
        stmt = stmt.where(XComModel.value["model"].as_string() == flt.model)
    return stmt


def _row(record: Any) -> RunRow:
    from airflow.models.xcom import XComModel

    data = record._asdict()
    value = data.pop("value")
    try:
        value = XComModel.deserialize_value(record) if value is not None else None
    except Exception:  # a value this reader cannot decode shows as a run without figures
        value = None
    return run_row(data, value)


def list_runs(session: Session, dag_ids: set[str], flt: RunFilter, offset: int, limit: int) -> tuple[int, list[RunRow]]:
    """``(total, rows)``: the matching runs, newest first, ``limit`` of them from ``offset``."""
    from airflow.models.taskinstance import TaskInstance as TI

    if not dag_ids:
        return 0, []
    stmt = _filtered(session, dag_ids, flt)
    total = session.scalar(select(func.count()).select_from(stmt.subquery())) or 0
    page = stmt.order_by(TI.start_date.desc(), TI.id.desc()).offset(offset).limit(limit)
    return total, [_row(r) for r in session.execute(page)]


def one_run(session: Session, dag_id: str, task_id: str, run_id: str, map_index: int) -> RunRow | None:
    """One task instance of the operator, or None when there is no such run (or not of it)."""
    from airflow.models.taskinstance import TaskInstance as TI

    stmt = _runs(session, {dag_id}).where(TI.task_id == task_id, TI.run_id == run_id, TI.map_index == map_index)
    record = session.execute(stmt).first()
    return None if record is None else _row(record)


def task_runs(session: Session, dag_id: str, task_id: str, limit: int = TREND_RUNS) -> list[RunRow]:
    """A task's newest ``limit`` runs, oldest first (the trend's x axis)."""
    from airflow.models.taskinstance import TaskInstance as TI

    stmt = (
        _runs(session, {dag_id}).where(TI.task_id == task_id).order_by(TI.start_date.desc(), TI.id.desc()).limit(limit)
    )
    return [_row(r) for r in session.execute(stmt)][::-1]


def filter_choices(session: Session, dag_ids: set[str]) -> dict[str, list[str]]:
    """The DAGs and tasks the filter form offers: distinct values of the readable runs."""
    from airflow.models.taskinstance import TaskInstance as TI

    if not dag_ids:
        return {"dag_ids": [], "task_ids": []}
    which = is_provider_task(session, dag_ids)
    base = select(TI.dag_id, TI.task_id).where(TI.dag_id.in_(sorted(dag_ids)), which).distinct()
    pairs = session.execute(base).all()
    return {"dag_ids": sorted({p[0] for p in pairs}), "task_ids": sorted({p[1] for p in pairs})}


def connection_id(session: Session, row: RunRow) -> str | None:
    """The connection the run used: its rendered ``model_service_conn_id`` (None when Airflow no
    longer keeps the rendered fields of that run)."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields as RTIF

    fields = session.scalar(
        select(RTIF.rendered_fields).where(
            RTIF.dag_id == row.dag_id,
            RTIF.task_id == row.task_id,
            RTIF.run_id == row.run_id,
            RTIF.map_index == row.map_index,
        )
    )
    value = fields.get("model_service_conn_id") if isinstance(fields, dict) else None
    return value if isinstance(value, str) and value else None
