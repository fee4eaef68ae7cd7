"""The plugin's FastAPI app: the batch-runs, run and trend pages (HTML) and the same data as JSON.

Mounted by the api-server under ``/batchinfer``. Airflow does not protect a plugin's routes, so
every route here asks Airflow's own dependencies: ``get_user`` (the JWT in the ``_token`` cookie or
an ``Authorization: Bearer`` header: 401 without one) and the auth manager's DAG permission, as
the core API's task-instance routes do (403, or the list filtered to the DAGs the user may read).
Every link is relative, so the pages work under a path prefix behind a proxy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

from airflow.api_fastapi.auth.managers.models.base_user import BaseUser
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.common.db.common import _get_session
from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_provider_batchinfer.ui import queries, views
from airflow_provider_batchinfer.ui.manifests import RunDetail, run_detail

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
URL_PREFIX = "/batchinfer"


#: the caller, from Airflow's own authentication (401 without a credential)
User = Annotated[BaseUser, Depends(get_user)]
Db = Annotated[Session, Depends(_get_session, scope="function")]
#: the core API's checks for reading a DAG's task instances and their XComs (what these pages show),
#: on the ``dag_id`` query parameter
TaskInstanceAccess = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE))
XComAccess = Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.XCOM))
DagAccess = [TaskInstanceAccess, XComAccess]


def readable_dag_ids(user: BaseUser, wanted: str = "") -> set[str]:
    """The DAGs the user may read (the auth manager's answer, as the core API's lists use it); a DAG
    asked for by name that is not among them is a 403, as the core API answers."""
    from airflow.api_fastapi.app import get_auth_manager

    allowed = get_auth_manager().get_authorized_dag_ids(user=user, method="GET")
    if wanted and wanted not in allowed:
        raise HTTPException(status_code=403, detail="Forbidden")
    return {wanted} if wanted else set(allowed)


def _wants_json(request: Request) -> bool:
    return "/api/" in request.url.path


templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(
    fmt_int=views.fmt_int,
    fmt_num=views.fmt_num,
    fmt_seconds=views.fmt_seconds,
    fmt_bytes=views.fmt_bytes,
    fmt_cost=views.fmt_cost,
)
router = APIRouter()


def create_app() -> FastAPI:
    """The app the plugin mounts; built on first use, in the api-server only."""
    app = FastAPI(title="Batch inference runs", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.include_router(router)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _any_error)
    return app


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """A refusal or a miss: JSON for the API, a page (never a stack trace) for the pages."""
    if _wants_json(request):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    context = {"status": exc.status_code, "detail": exc.detail}
    return templates.TemplateResponse(request, "error.html", context, status_code=exc.status_code)


async def _any_error(request: Request, exc: Exception) -> Response:
    log.exception("batch runs page %s failed", request.url.path)
    detail = "the page could not be built; the api-server's log says why"
    if _wants_json(request):
        return JSONResponse({"detail": detail}, status_code=500)
    return templates.TemplateResponse(request, "error.html", {"status": 500, "detail": detail}, status_code=500)


# --- the data each page and its JSON twin show ------------------------------------------------------
def runs_data(user: BaseUser, session: Session, flt: queries.RunFilter, offset: int, limit: int) -> dict[str, Any]:
    offset, limit = views.page_bounds(offset, limit)
    allowed = readable_dag_ids(user, flt.dag_id)
    total, rows = queries.list_runs(session, allowed, flt, offset, limit)
    return {"total": total, "offset": offset, "limit": limit, "filters": flt.to_dict(), "runs": rows}


def run_data(session: Session, dag_id: str, task_id: str, run_id: str, map_index: int) -> dict[str, Any]:
    row = queries.one_run(session, dag_id, task_id, run_id, map_index)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no batch inference run {dag_id}.{task_id} {run_id}")
    detail: RunDetail = run_detail(row, queries.connection_id(session, row))
    return {"run": row, "detail": detail}


def trends_data(session: Session, dag_id: str, task_id: str) -> dict[str, Any]:
    rows = queries.task_runs(session, dag_id, task_id)
    return {"dag_id": dag_id, "task_id": task_id, "points": views.trend_points(rows)}


# --- routes -----------------------------------------------------------------------------------------
@router.get("/", include_in_schema=False)
def index() -> RedirectResponse:
    return RedirectResponse("runs", status_code=307)


class RunsQuery:
    """The list's query parameters, shared by the page and its JSON twin."""

    def __init__(
        self,
        dag_id: str = "",
        task_id: str = "",
        model: str = "",
        state: str = "",
        offset: int = 0,
        limit: int = views.DEFAULT_PAGE_SIZE,
    ) -> None:
        self.filter = queries.RunFilter(dag_id, task_id, model, state)
        self.offset = offset
        self.limit = limit


Runs = Annotated[RunsQuery, Depends()]


@router.get("/api/runs")
def api_runs(user: User, session: Db, query: Runs) -> dict[str, Any]:
    data = runs_data(user, session, query.filter, query.offset, query.limit)
    return {**data, "runs": [r.to_dict() for r in data["runs"]]}


@router.get("/runs", response_class=HTMLResponse)
def runs_page(request: Request, user: User, session: Db, query: Runs) -> Response:
    flt, limit = query.filter, query.limit
    data = runs_data(user, session, flt, query.offset, limit)
    page = views.Page(data["offset"], data["limit"], data["total"])
    choices = queries.filter_choices(session, readable_dag_ids(user))
    context = {**data, "page": page, "choices": choices, "query": _query(flt, limit)}
    return templates.TemplateResponse(request, "runs.html", context)


@router.get("/api/run", dependencies=DagAccess)
def api_run(session: Db, dag_id: Annotated[str, Query()], task_id: str, run_id: str, map_index: int = -1) -> dict:
    data = run_data(session, dag_id, task_id, run_id, map_index)
    return {"run": data["run"].to_dict(), **data["detail"].to_dict()}


@router.get("/run", response_class=HTMLResponse, dependencies=DagAccess)
def run_page(
    request: Request, session: Db, dag_id: Annotated[str, Query()], task_id: str, run_id: str, map_index: int = -1
) -> Response:
    data = run_data(session, dag_id, task_id, run_id, map_index)
    return templates.TemplateResponse(request, "run.html", {**data, "ti_href": _ti_href(data["run"])})


@router.get("/api/trends", dependencies=DagAccess)
def api_trends(session: Db, dag_id: Annotated[str, Query()], task_id: str) -> dict[str, Any]:
    data = trends_data(session, dag_id, task_id)
    return {**data, "points": [p.__dict__ for p in data["points"]]}


@router.get("/trends", response_class=HTMLResponse, dependencies=DagAccess)
def trends_page(request: Request, session: Db, dag_id: Annotated[str, Query()], task_id: str) -> Response:
    data = trends_data(session, dag_id, task_id)
    points = data["points"]
    labels = [p.run_id for p in points]
    plots = [
        views.svg_plot([p.rows_per_s for p in points], labels, "rows/s"),
        views.svg_plot([p.cost_per_million for p in points], labels, "cost per million rows"),
        views.svg_plot([p.error_fraction for p in points], labels, "dead-lettered fraction"),
    ]
    return templates.TemplateResponse(request, "trends.html", {**data, "plots": plots})


def _query(flt: queries.RunFilter, limit: int) -> dict[str, Any]:
    """The filter's query parameters, for the pager's links."""
    return {**{k: v for k, v in flt.to_dict().items() if v}, "limit": limit}


def _ti_href(row: views.RunRow) -> str:
    """The task instance in Airflow's UI, relative to this page (``<prefix>/batchinfer/run``)."""
    from urllib.parse import quote

    href = f"../dags/{quote(row.dag_id, safe='')}/runs/{quote(row.run_id, safe='')}/tasks/{quote(row.task_id, safe='')}"
    return href + (f"/mapped/{row.map_index}" if row.map_index >= 0 else "")
